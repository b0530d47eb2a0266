import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import tiny_run_dict

from quantdyn.config import from_dict
from quantdyn.errors import QuantdynError
from quantdyn.models.hf_io import load_gpt
from quantdyn.runs import latest_resumable, list_checkpoints, read_meta
from quantdyn.train.branches import cooldown
from quantdyn.train.checkpoint import read_metrics
from quantdyn.train.config import RunConfig
from quantdyn.train.trainer import train


def _cfg(tmp_path, data_cfg, name="t", **train_kw):
    d = tiny_run_dict(tmp_path, data_cfg, **train_kw)
    d["name"] = name
    return from_dict(RunConfig, d)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _losses(run_dir):
    return [(r["step"], r["train/loss"]) for r in read_metrics(run_dir) if "train/loss" in r]


def _assert_same_weights(run_a, run_b, *checkpoints):
    """The checkpoints (paths relative to the run directories) hold bit-identical weights in both runs."""
    from safetensors.torch import load_file

    for rel in checkpoints:
        a, b = load_file(run_a / rel / "model.safetensors"), load_file(run_b / rel / "model.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), rel


def test_exact_resume(tmp_path, kjv_small):
    data_cfg, _ = kjv_small
    full = train(_cfg(tmp_path, data_cfg, "full"), progress=False)
    part = train(_cfg(tmp_path, data_cfg, "part"), progress=False, stop_after=4)
    assert latest_resumable(part).step == 4 and len(list_checkpoints(part)) == 1
    # a crashed run may have logged beyond its last checkpoint: resume truncates those rows
    with open(part / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 6, "train/loss": 123.0}) + "\n")
    train(_cfg(tmp_path, data_cfg, "part"), part, resume=latest_resumable(part), progress=False)
    assert _losses(part) == _losses(full)
    _assert_same_weights(full, part, "checkpoints/step-0000012")


def test_checkpoint_metadata_and_loss_falls(tmp_path, kjv_small):
    data_cfg, _ = kjv_small
    run = train(_cfg(tmp_path, data_cfg, "m", steps=24, eval_every=8, checkpoint_every=8), progress=False)
    cks = list_checkpoints(run)
    assert [c.step for c in cks] == [8, 16, 24]
    m = read_meta(cks[-1].path)
    assert m["tokens"] == 24 * 4 * 32 and m["lr"] == pytest.approx(0.0) and m["schedule"]["name"] == "wsd"
    assert m["config"]["model"]["vocab_size"] == 512 and m["git_sha"]
    vals = [r["val/loss"] for r in read_metrics(run) if "val/loss" in r]
    assert vals[-1] < vals[0] - 0.3
    # tokenizer files travel with the checkpoint so transformers can load both
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(cks[-1].path).vocab_size == 512
    # no temp directories left behind
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]


def test_atomic_checkpoint_survives_crash(tmp_path, kjv_small, monkeypatch):
    data_cfg, _ = kjv_small
    run = train(_cfg(tmp_path, data_cfg, "a", steps=4, checkpoint_every=2), progress=False)
    before = (run / "checkpoints" / "step-0000004" / "model.safetensors").read_bytes()
    import quantdyn.train.checkpoint as ck

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(ck.torch, "save", boom)
    # resuming from step 2 rewrites step 4: the failed write leaves the old checkpoint in place
    with pytest.raises(RuntimeError):
        train(_cfg(tmp_path, data_cfg, "a", steps=4, checkpoint_every=2), run, resume=list_checkpoints(run)[0],
              progress=False)
    assert (run / "checkpoints" / "step-0000004" / "model.safetensors").read_bytes() == before
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]


def test_cooldown_branches_and_control(tmp_path, kjv_small):
    data_cfg, _ = kjv_small
    cfg = _cfg(tmp_path, data_cfg, "p", steps=16, checkpoint_every=4)
    cfg = from_dict(RunConfig, {**tiny_run_dict(tmp_path, data_cfg, steps=16, checkpoint_every=4),
                                "name": "p", "schedule": {"name": "constant", "warmup": 2}})
    parent = train(cfg, progress=False)
    out = cooldown(parent, from_step=8, decay_steps=[4, 8], shape="linear", control=True, progress=False)
    names = sorted(p.name for p in out)
    assert names == ["control-s8-d4", "control-s8-d8", "cooldown-s8-d4-linear", "cooldown-s8-d8-linear"]
    cool = parent / "branches" / "cooldown-s8-d8-linear"
    m = read_meta(list_checkpoints(cool)[-1].path)
    assert m["step"] == 16 and m["lr"] == pytest.approx(0.0) and m["parent"]["from_step"] == 8
    ctrl_meta = read_meta(list_checkpoints(parent / "branches" / "control-s8-d8")[-1].path)
    assert ctrl_meta["lr"] == pytest.approx(cfg.optim.lr) and ctrl_meta["tokens"] == m["tokens"]
    # the constant-LR control equals the parent continuing: same losses step for step
    assert _losses(parent / "branches" / "control-s8-d8") == [x for x in _losses(parent) if x[0] > 8]
    # rerun is a no-op
    assert cooldown(parent, 8, [8], control=True, progress=False)
    with pytest.raises(QuantdynError, match="no resumable checkpoint at step 5"):
        cooldown(parent, 5, [4])


def test_bad_training_input(tmp_path, kjv_small):
    data_cfg, _ = kjv_small
    d = tiny_run_dict(tmp_path, data_cfg)
    d["model"]["vocab_size"] = 256
    with pytest.raises(QuantdynError, match="smaller than the tokenizer"):
        train(from_dict(RunConfig, d), progress=False)
    run = train(_cfg(tmp_path, data_cfg, "r", steps=4), progress=False)
    d = tiny_run_dict(tmp_path, data_cfg, steps=8)
    d["model"]["d_model"] = 64
    with pytest.raises(QuantdynError, match="model shape"):
        train(from_dict(RunConfig, d), run, resume=latest_resumable(run), progress=False)
    (run / "checkpoints" / "step-0000004" / "training_state.pt").write_bytes(b"\x00junk")
    with pytest.raises(QuantdynError, match="corrupt"):
        train(_cfg(tmp_path, data_cfg, "r", steps=8), run, resume=latest_resumable(run), progress=False)


def test_cli_train_and_errors(tmp_path, kjv_small, cli):
    import yaml

    data_cfg, _ = kjv_small
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(yaml.safe_dump(tiny_run_dict(tmp_path, data_cfg, steps=4)))
    r = cli("train", cfg_path, "name=cli", "--quiet")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "cli" / "checkpoints" / "step-0000004").is_dir()
    _one_line_exit2(cli("train", cfg_path, "optim.lrr=1"), "did you mean 'lr'")
    _one_line_exit2(cli("train", "--resume", tmp_path / "nope"), "not a quantdyn run directory")


@pytest.mark.e2e
def test_ddp_two_processes_match_single(tmp_path, kjv_small):
    """torchrun --nproc_per_node 2 over gloo: same global batches, same checkpoint."""
    import yaml

    data_cfg, _ = kjv_small
    single = tiny_run_dict(tmp_path, data_cfg, steps=6, batch_size=4, checkpoint_every=6)
    single["name"] = "single"
    train(from_dict(RunConfig, single), progress=False)
    ddp = tiny_run_dict(tmp_path, data_cfg, steps=6, batch_size=2, checkpoint_every=6)  # 2 ranks x 2 = 4
    ddp["name"] = "ddp"
    p = tmp_path / "ddp.yaml"
    p.write_text(yaml.safe_dump(ddp))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
         "-m", "quantdyn.cli", "train", str(p), "--quiet"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    a = load_gpt(tmp_path / "single" / "checkpoints" / "step-0000006")
    b = load_gpt(tmp_path / "ddp" / "checkpoints" / "step-0000006")
    for (k, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5, msg=k)
    la = [l for _, l in _losses(tmp_path / "single")]
    lb = [l for _, l in _losses(tmp_path / "ddp")]
    assert la == pytest.approx(lb, rel=1e-4)


def test_in_training_monitor_logs_delta_ce(tmp_path, kjv_small):
    data_cfg, _ = kjv_small
    d = tiny_run_dict(tmp_path, data_cfg, steps=8, checkpoint_every=8)
    d["name"] = "mon"
    d["monitor"] = {"every": 4, "quantizers": ["rtn2", "rtn8"], "calib_samples": 4, "eval_windows": 8}
    from quantdyn.monitor import hooks_for

    cfg = from_dict(RunConfig, d)
    run = train(cfg, progress=False, hooks=hooks_for(cfg))
    rows = [r for r in read_metrics(run) if "ptq/rtn2/delta_ce" in r]
    assert [r["step"] for r in rows] == [4, 8]
    assert all({"ptq/rtn2/delta_ce_se", "ptq/rtn2/kl", "ptq/rtn2/rel_delta_ce", "ptq/rtn2/top1_agree", "ptq/ce_fp"}
               <= set(r) for r in rows)
    # metrics.jsonl holds the shared names once: none of the keys written before 0.2 beside them
    raw = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert not [k for r in raw for k in r if k.startswith("dce_") or k in ("tokens", "lr", "train_loss", "val_loss")]
    # the logged value is what an independent measurement of the step-8 checkpoint gives
    import copy

    from quantdyn.data.prepare import prepare_data
    from quantdyn.engine.walk import quantize_model
    from quantdyn.evaluate.quant_error import compare_models
    from quantdyn.quantize.catalogue import parse_quantizer

    data = prepare_data(data_cfg, progress=False)
    fp = load_gpt(run / "checkpoints" / "step-0000008")
    q = copy.deepcopy(fp)
    quantize_model(q, data.calib_windows(4, 32, seed=0), parse_quantizer("rtn2"), progress=False)
    m = compare_models(fp, q, data.eval_windows(32, 8))
    assert rows[-1]["ptq/rtn2/delta_ce"] == pytest.approx(m["delta_ce"], abs=1e-6)
    assert rows[-1]["ptq/rtn2/delta_ce_se"] == pytest.approx(m["delta_ce_se"], rel=1e-4)
    assert all(abs(r["ptq/rtn8/delta_ce"]) < 2e-3 for r in rows) and rows[-1]["ptq/rtn2/delta_ce_se"] > 0
    d["monitor"]["quantizers"] = ["rtm4"]
    with pytest.raises(QuantdynError, match="did you mean"):
        from_dict(RunConfig, d)


def test_qat_finetune_from_fp_and_sweep_qat_rows(tmp_path, kjv_small):
    """QAT fine-tuning from an FP checkpoint: trains, saves plain-loadable weights, and the sweep
    measures the deployed (W+A fake-quantized) model against its own FP weights."""
    from quantdyn.results.store import ResultStore
    from quantdyn.sweep.sweep import SweepConfig, run_sweep

    data_cfg, _ = kjv_small
    fp_run = train(_cfg(tmp_path, data_cfg, "fp", steps=8, checkpoint_every=8), progress=False)
    d = tiny_run_dict(tmp_path, data_cfg, steps=6, checkpoint_every=6, eval_every=3)
    d.update(name="qat", init_weights=str(fp_run / "checkpoints" / "step-0000008"),
             qat={"method": "quest", "w_bits": 4, "a_bits": 4, "hadamard_block": 32}, optim={"name": "muon"})
    run = train(from_dict(RunConfig, d), progress=False)
    vals = [r["val/loss"] for r in read_metrics(run) if "val/loss" in r]
    assert vals[-1] < vals[0]  # QAT fine-tuning improves the quantized model's loss
    m = load_gpt(run / "checkpoints" / "step-0000006")  # plain GPT loads a QAT checkpoint
    assert type(m.gpt_neox.layers[0].attention.dense) is torch.nn.Linear
    cfg = from_dict(SweepConfig, {"trajectory": {"run": str(run)}, "quantizers": ["rtn4"],
                                  "store": str(tmp_path / "st"),
                                  "data": {"calib_samples": 4, "calib_seq_len": 32, "eval_windows": 8,
                                           "eval_seq_len": 32}})
    run_sweep(cfg, progress=False)
    rows = ResultStore(tmp_path / "st").rows()
    q = [r for r in rows if r["kind"] == "qat"]
    assert len(q) == 1 and q[0]["quantizer"] == "qat-quest-w4a4" and q[0]["optimizer"] == "muon"
    # the deployed QAT model is the one training validated: same windows, same loss
    assert q[0]["ce_q"] == pytest.approx(vals[-1], abs=1e-4) and q[0]["n_params"] > 0


@pytest.mark.parametrize("optim", ["schedulefree_adamw", "kron"])
def test_exact_resume_stateful_optimizers(tmp_path, kjv_small, optim):
    """Schedule-free (train/eval points) and Kron (global numpy RNG) resume exactly too."""
    data_cfg, _ = kjv_small
    def cfg(name):
        d = tiny_run_dict(tmp_path, data_cfg, steps=8, checkpoint_every=4)
        d.update(name=name, optim={"name": optim})
        return from_dict(RunConfig, d)
    full = train(cfg("full"), progress=False)
    part = train(cfg("part"), progress=False, stop_after=4)
    train(cfg("part"), part, resume=latest_resumable(part), progress=False)
    assert _losses(part) == _losses(full)
    _assert_same_weights(full, part, "checkpoints/step-0000008")


def test_exact_resume_of_qat_with_online_averages(tmp_path, kjv_small):
    """A QAT run (min-max STE fake quantization) with LAWA and EMA resumes exactly: weights, averages, losses."""
    data_cfg, _ = kjv_small

    def cfg(name):
        d = tiny_run_dict(tmp_path, data_cfg, steps=8, checkpoint_every=4, eval_every=4)
        d.update(name=name, qat={"method": "ste", "w_bits": 4, "a_bits": 4},
                 averaging={"ema_decay": 0.9, "lawa_window": 2, "lawa_every": 1})
        return from_dict(RunConfig, d)

    full = train(cfg("full"), progress=False)
    part = train(cfg("part"), progress=False, stop_after=4)
    train(cfg("part"), part, resume=latest_resumable(part), progress=False)
    assert _losses(part) == _losses(full)
    saved = sorted(p.parent.relative_to(full) for p in full.rglob("step-0000008/model.safetensors"))
    assert len(saved) == 3  # the checkpoint, LAWA and EMA
    _assert_same_weights(full, part, *saved)


def test_monitor_config_without_hooks_warns_the_caller(tmp_path, kjv_small):
    """train() cannot build the monitor (a layer above): a config asking for one without hooks is a warning that
    points at the caller's line."""
    data_cfg, _ = kjv_small
    d = tiny_run_dict(tmp_path, data_cfg, steps=2, checkpoint_every=2)
    d.update(name="w", monitor={"every": 2, "quantizers": ["rtn4"]})
    with pytest.warns(UserWarning, match="no step hooks, so nothing is monitored") as caught:
        train(from_dict(RunConfig, d), progress=False)
    assert [w.filename for w in caught if "step hooks" in str(w.message)] == [__file__]


def test_an_early_warning_alone_without_hooks_warns_too(tmp_path, kjv_small):
    """monitor.warning_every without monitor.every also needs the hooks (issue 48.5)."""
    d = tiny_run_dict(tmp_path, kjv_small[0], steps=2, checkpoint_every=2)
    d.update(name="ww", monitor={"warning_every": 1})
    with pytest.warns(UserWarning, match="monitor.warning_every=1 is set but train\\(\\) got no step hooks"):
        train(from_dict(RunConfig, d), progress=False)


def _one_line_exit2(r, *needles):
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    for n in needles:
        assert n in lines[0], lines[0]


def test_train_refuses_a_run_with_checkpoints_unless_resume_or_overwrite(tmp_path, kjv_small, cli):
    import yaml

    data_cfg, _ = kjv_small
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(yaml.safe_dump({**tiny_run_dict(tmp_path, data_cfg, steps=4, checkpoint_every=2), "name": "r"}))
    assert cli("train", cfg_path, "--quiet", "--device", "cpu").returncode == 0
    run = tmp_path / "r"
    files = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    r = cli("train", cfg_path, "--quiet")
    _one_line_exit2(r, "already has checkpoints (last: step 4)", f"--resume {run}", "--overwrite")
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == files  # nothing touched
    # --overwrite starts again: the old checkpoints, averages and metrics go, the new run is complete
    (run / "checkpoints" / "step-0000002" / "stale-marker").write_text("old")
    r = cli("train", cfg_path, "--quiet", "--overwrite")
    assert r.returncode == 0, r.stderr[-2000:]
    assert not (run / "checkpoints" / "step-0000002" / "stale-marker").exists()
    assert [c.step for c in list_checkpoints(run)] == [2, 4]
    assert [x["step"] for x in read_metrics(run) if "train/loss" in x] == [2, 4]  # one set of rows, not two
    _one_line_exit2(cli("train", "--resume", run, "--overwrite"), "does not go with --resume")
    _one_line_exit2(cli("train", cfg_path, "--device", "cuda:0", "name=gpu"), "no CUDA GPU is visible")
    assert not (tmp_path / "gpu").exists()


def test_resume_checks_the_edited_config_before_writing_anything(tmp_path, kjv_small, cli):
    """F4: an edited optim.name (or global batch, or data) is refused in one line, before
    config.yaml, run.json or metrics.jsonl are rewritten."""
    import yaml

    data_cfg, _ = kjv_small
    run = train(_cfg(tmp_path, data_cfg, "e", steps=4, checkpoint_every=2), progress=False)
    original = yaml.safe_load((run / "config.yaml").read_text())

    def edited(change):
        d = yaml.safe_load(yaml.safe_dump(original))
        change(d)
        d["train"]["steps"] = 8  # an extension, so that the edit is what stops the resume
        (run / "config.yaml").write_text(yaml.safe_dump(d))
        return {p: p.read_bytes() for p in (run / "config.yaml", run / "run.json", run / "metrics.jsonl")}

    cases = [
        (lambda d: d["optim"].update(name="lion"), ["optim.name='adamw'", "'lion'"]),
        (lambda d: d["optim"].update(name="muon"), ["optim.name='adamw'"]),
        (lambda d: d["train"].update(batch_size=8), ["tokens per step", "keep the global batch"]),
        (lambda d: d["data"].update(max_tokens=150_000), ["other data", "init_weights"]),
        (lambda d: d["model"].update(d_model=64), ["model shape"]),
    ]
    for change, needles in cases:
        before = edited(change)
        r = cli("train", "--resume", run, "--quiet")
        _one_line_exit2(r, *needles)
        assert {p: p.read_bytes() for p in before} == before
    (run / "config.yaml").write_text(yaml.safe_dump({**original, "train": {**original["train"], "steps": 6}}))
    assert cli("train", "--resume", run, "--quiet").returncode == 0  # extending the run is a valid edit
    assert [c.step for c in list_checkpoints(run)] == [2, 4, 6]


def test_resume_of_a_finished_run_is_a_no_op_success(tmp_path, kjv_small, cli):
    """A requeued job, or a kill after the last checkpoint was written: `--resume` says the run is finished,
    exits 0 and touches nothing (what a SLURM requeue script needs)."""
    data_cfg, _ = kjv_small
    run = train(_cfg(tmp_path, data_cfg, "f", steps=4, checkpoint_every=2), progress=False)
    files = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    r = cli("train", "--resume", run, "--quiet")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "already finished at step 4 (train.steps=4)" in r.stderr and "Traceback" not in r.stderr
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == files


def test_kill_between_a_steps_averages_and_its_checkpoint_resumes_exactly(tmp_path, kjv_small, monkeypatch):
    """The checkpoint commits a step: averages are written before it, so a run killed between the two
    resumes from the previous checkpoint and ends with the same weights and averages as an unbroken run."""
    import quantdyn.train.trainer as trainer

    data_cfg, _ = kjv_small

    def cfg(name):
        d = tiny_run_dict(tmp_path, data_cfg, steps=4, checkpoint_every=2)
        d.update(name=name, averaging={"ema_decay": 0.9, "lawa_window": 2, "lawa_every": 1})
        return from_dict(RunConfig, d)

    ref = train(cfg("ref"), progress=False)
    real = trainer.save_checkpoint

    class Killed(Exception):
        pass

    def dies_at_the_last_commit(directory, *a, **k):
        if directory.parent.name == "checkpoints" and directory.name == "step-0000004":
            raise Killed
        return real(directory, *a, **k)

    monkeypatch.setattr(trainer, "save_checkpoint", dies_at_the_last_commit)
    with pytest.raises(Killed):
        train(cfg("k"), progress=False)
    run = tmp_path / "k"
    averages = sorted(p.relative_to(run) for p in (run / "averages").rglob("step-0000004"))
    assert len(averages) == 2  # the averages of step 4 were written, its checkpoint was not
    assert latest_resumable(run).step == 2
    monkeypatch.setattr(trainer, "save_checkpoint", real)
    train(cfg("k"), run, resume=latest_resumable(run), progress=False)
    _assert_same_weights(ref, run, *averages, "checkpoints/step-0000004")


def test_stale_checkpoint_temporaries_are_removed_at_start(tmp_path, kjv_small):
    data_cfg, _ = kjv_small
    d = tiny_run_dict(tmp_path, data_cfg, steps=4, checkpoint_every=2)
    d.update(name="s", schedule={"name": "constant", "warmup": 1}, averaging={"ema_decay": 0.9})
    run = train(from_dict(RunConfig, d), progress=False, stop_after=2)
    # what a kill -9 in the middle of a save leaves behind
    stale = [run / "checkpoints" / ".step-0000004.tmp-abc123", run / "checkpoints" / ".step-0000002.old-999",
             run / "averages" / "ema-0.9" / ".step-0000004.tmp-x"]
    for p in stale:
        p.mkdir(parents=True)
        (p / "model.safetensors").write_bytes(b"half")
    keep = run / "checkpoints" / "notes.txt"
    keep.write_text("mine")
    train(from_dict(RunConfig, d), run, resume=latest_resumable(run), progress=False)
    assert not any(p.exists() for p in stale) and keep.exists()
    # cooldown removes those of its branches too
    branch = run / "branches" / "cooldown-s2-d2-linear" / "checkpoints" / ".step-0000004.tmp-q"
    branch.mkdir(parents=True)
    cooldown(run, 2, [2], progress=False)
    assert not branch.exists()


def test_ctrl_c_message_says_how_to_continue(tmp_path, kjv_small, monkeypatch, cli):
    import yaml

    import quantdyn.train.trainer as trainer

    data_cfg, _ = kjv_small
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(yaml.safe_dump({**tiny_run_dict(tmp_path, data_cfg, steps=4, checkpoint_every=2), "name": "k"}))
    real = trainer.train

    def interrupted(*a, **k):
        real(*a, **k, stop_after=2)
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer, "train", interrupted)
    run = tmp_path / "k"
    for args in (["train", cfg_path, "--quiet"], ["train", "--resume", run, "--quiet"]):
        r = cli(*args)
        assert r.returncode == 130
        assert r.stderr.strip().splitlines() == [f"interrupted; continue from step 2 with `quantdyn train --resume {run}`"]

    def early(*a, **k):  # interrupted before the first checkpoint: rerunning the same command starts again
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer, "train", early)
    r = cli("train", cfg_path, "name=fresh", "--quiet")
    assert r.returncode == 130 and "no checkpoint was written yet; rerun the same command" in r.stderr


def test_run_dir_layout_and_its_readers(tmp_path):
    """RunDir is the one place that names a run's parts; a torn metrics line is skipped, a broken run.json
    is one line."""
    from quantdyn.errors import QuantdynError
    from quantdyn.runs import RunDir, checkpoint_dir, step_name

    rd = RunDir(tmp_path)
    assert rd.checkpoint(400) == checkpoint_dir(tmp_path, 400) == tmp_path / "checkpoints" / "step-0000400"
    assert rd.average("lawa-k4-p2", 12) == tmp_path / "averages" / "lawa-k4-p2" / step_name(12)
    assert rd.branch("cd").checkpoint(1) == tmp_path / "branches" / "cd" / "checkpoints" / "step-0000001"
    assert rd.read_info() == {} and read_metrics(tmp_path) == []
    rd.metrics.write_bytes(b'{"step": 1, "train_loss": 2.5, "lr": 0.1}\n[1]\n{"step": 2, "train_lo')  # killed mid-line
    # a file written before 0.2 (legacy keys only) reads with the shared names
    assert read_metrics(tmp_path) == [{"step": 1, "train/loss": 2.5, "train/lr": 0.1}]
    rd.metrics.write_text('{"step": 1, "train_loss": 2.5, "train/loss": 2.5, "dce_rtn4": 0.1}\n')  # 0.1 wrote both
    assert read_metrics(tmp_path) == [{"step": 1, "train/loss": 2.5, "dce_rtn4": 0.1}]
    assert rd.status(8) == "new"
    rd.info.write_text("{not json")
    with pytest.raises(QuantdynError, match="run.json' is not valid JSON"):
        rd.read_info()
