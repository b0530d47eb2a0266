"""The PTQ monitor (quantdyn.monitor) in a plain loop, quantdyn's trainer, the HF Trainer and Lightning, and the
loggers (metrics.jsonl, CSV, TensorBoard event files read back, W&B offline) and console lines they write."""
from __future__ import annotations

import csv
import glob
import io
import json
import os
import runpy
import struct
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_run_dict

from quantdyn.config import from_dict
from quantdyn.engine.measure import measure
from quantdyn.errors import QuantdynError
from quantdyn.models.gpt import GPT, ModelConfig, resolve_model_config
from quantdyn.monitor import PTQMonitor, causal_lm_of, hooks_for
from quantdyn.quantize.catalogue import parse_quantizer
from quantdyn.train.checkpoint import read_metrics
from quantdyn.train.config import RunConfig
from quantdyn.progress import Progress
from quantdyn.train.loggers import CSVLogger, JsonlLogger, TensorBoardLogger, show_logged
from quantdyn.train.trainer import train

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


# ------------------------------------------------------------------ helpers
def read_tensorboard(log_dir) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} of every scalar in the TensorBoard event files under ``log_dir``: the TFRecord
    framing (length, masked CRC-32C of the length, Event protobuf, masked CRC of the data) parsed and checked
    record by record, as TensorBoard reads it."""
    from tensorboardX.proto import event_pb2
    from tensorboardX.record_writer import masked_crc32c

    out: dict[str, dict[int, float]] = {}
    files = sorted(glob.glob(str(Path(log_dir) / "**" / "events.out.tfevents.*"), recursive=True))
    assert files, f"no event files under {log_dir}"
    for f in files:
        raw = Path(f).read_bytes()
        pos = 0
        while pos < len(raw):
            header = raw[pos : pos + 8]
            (n,) = struct.unpack("<Q", header)
            assert struct.unpack("<I", raw[pos + 8 : pos + 12])[0] == masked_crc32c(header)
            data = raw[pos + 12 : pos + 12 + n]
            assert struct.unpack("<I", raw[pos + 12 + n : pos + 16 + n])[0] == masked_crc32c(data)
            pos += 16 + n
            ev = event_pb2.Event.FromString(data)
            for v in ev.summary.value:
                kind = v.WhichOneof("value")
                if kind == "simple_value":
                    out.setdefault(v.tag, {})[int(ev.step)] = v.simple_value
                elif kind == "tensor" and v.tensor.float_val:
                    out.setdefault(v.tag, {})[int(ev.step)] = v.tensor.float_val[0]
    return out


def _tiny_gpt(vocab=512, seed=0) -> GPT:
    torch.manual_seed(seed)
    return GPT(resolve_model_config(ModelConfig(n_layer=2, d_model=32, n_head=2, max_seq_len=64), vocab))


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _run_example(name: str, *args):
    old = sys.argv
    sys.argv = [name, *map(str, args)]
    try:
        return runpy.run_path(str(EXAMPLES / name), run_name="example")["main"]([str(a) for a in args])
    finally:
        sys.argv = old


def _cfg(tmp_path, data_cfg, name, **kw):
    d = tiny_run_dict(tmp_path, data_cfg, **kw)
    d["name"] = name
    return d


# ------------------------------------------------------------------ the monitor object
def test_monitor_leaves_the_model_untouched_and_reports_the_engines_numbers():
    model = _tiny_gpt()
    model.train()
    gen = torch.Generator().manual_seed(1)
    stream = torch.randint(0, 512, (4000,), generator=gen)
    calib = torch.randint(0, 512, (6, 32), generator=gen)
    mon = PTQMonitor(["rtn3", "gptq3g32"], eval_ids=stream, calib_ids=calib, every=5, seq_len=33,
                     eval_windows=8)
    before, rng = _state(model), torch.get_rng_state()
    assert mon.step(model, 4) == {} and mon.history == []  # not due
    out = mon.step(model, 5, lr=1e-3, tokens=640)
    # bit-identical weights and buffers, same train/eval mode, same torch RNG (a monitored run trains like an
    # unmonitored one)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert model.training and all(m.training for m in model.modules())
    assert torch.equal(rng, torch.get_rng_state())
    # the same numbers as the engine gives for these windows: a stream is cut into windows of seq_len tokens,
    # as TokenData.eval_windows cuts its splits (one windowing)
    windows = stream[: 8 * 33].reshape(8, 33)
    assert torch.equal(mon.windows()[0], windows)
    m = measure(model, ["rtn3", "gptq3g32"], windows, calib, cfg=mon.measure_cfg)
    for q in ("rtn3", "gptq3g32"):
        for k in ("delta_ce", "delta_ce_se", "rel_delta_ce", "kl", "top1_agree"):
            assert out[f"ptq/{q}/{k}"] == pytest.approx(m.metrics[q][k], rel=1e-9, abs=1e-12), (q, k)
    assert out["ptq/ce_fp"] == pytest.approx(m.ce_fp) and out["train/lr"] == 1e-3 and out["train/tokens"] == 640
    assert mon.history == [{"step": 5, **out}] and mon.seconds > 0
    assert out["ptq/rtn3/kl"] > 0 and 0 < out["ptq/rtn3/top1_agree"] < 1  # a random model: Δ CE may be either sign


def test_monitor_finds_the_causal_lm_inside_wrappers():
    model = _tiny_gpt()

    class Holder(torch.nn.Module):  # what a LightningModule looks like to the monitor
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(2, 2)
            self.lm = model

    assert causal_lm_of(torch.nn.DataParallel(torch.compile(model))) is model
    assert causal_lm_of(Holder()) is model
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    hf = GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                          intermediate_size=32))
    assert causal_lm_of(hf) is hf
    with pytest.raises(QuantdynError, match="no causal LM in a Linear"):
        causal_lm_of(torch.nn.Linear(2, 2))


def test_bad_monitor_input_is_one_line_at_construction():
    ids = torch.randint(0, 512, (8, 33))
    with pytest.raises(QuantdynError, match="did you mean 'rtn'"):
        PTQMonitor(["rtm4"], eval_ids=ids)
    with pytest.raises(QuantdynError, match="'gptq3' needs calibration data"):
        PTQMonitor(["rtn4", "gptq3"], eval_ids=ids)
    with pytest.raises(QuantdynError, match="every=0"):
        PTQMonitor(["rtn4"], eval_ids=ids, every=0)
    with pytest.raises(QuantdynError, match="without '/'"):
        PTQMonitor({"a/b": "rtn4"}, eval_ids=ids)
    with pytest.raises(QuantdynError, match="integer token ids"):
        PTQMonitor(["rtn4"], eval_ids=torch.rand(8, 33))
    with pytest.raises(QuantdynError, match="give seq_len"):
        PTQMonitor(["rtn4"], eval_ids=torch.arange(100))
    # a run config: the quantizer is checked when the config is read, before anything trains
    with pytest.raises(QuantdynError, match="did you mean"):
        from_dict(RunConfig, {"monitor": {"every": 5, "quantizers": ["rtm4"]}})
    assert hooks_for(from_dict(RunConfig, {})) == []


# ------------------------------------------------------------------ a plain loop
@pytest.mark.e2e
def test_plain_loop_example_logs_to_csv_jsonl_and_tensorboard(tmp_path, kjv_small, capsys):
    mon = _run_example("monitor_plain_loop.py", "--steps", 8, "--every", 4, "--out", tmp_path / "plain")
    assert [h["step"] for h in mon.history] == [4, 8]
    err = capsys.readouterr().err
    assert "ptq: step 4: rtn4 dCE" in err and "ptq: step 8: gptq3 dCE" in err
    tb = read_tensorboard(tmp_path / "plain" / "tensorboard")
    rows = {r["step"]: r for r in read_metrics(tmp_path / "plain")}
    with open(tmp_path / "plain" / "metrics.csv") as f:
        table = {int(r["step"]): r for r in csv.DictReader(f)}
    for h in mon.history:
        s = h["step"]
        for k in ("ptq/rtn4/delta_ce", "ptq/rtn3/kl", "ptq/gptq3/top1_agree", "train/lr"):
            assert tb[k][s] == pytest.approx(h[k], rel=1e-6, abs=1e-9)  # float32 in the event file
            assert float(table[s][k]) == h[k] and rows[s][k] == h[k]
        assert not any(k.startswith("dce_") for k in rows[s])  # the shared names only, written once


# ------------------------------------------------------------------ quantdyn's trainer
@pytest.mark.e2e
def test_train_command_logs_plain_lines_csv_and_tensorboard(tmp_path, kjv_small, cli, monkeypatch):
    data_cfg, _ = kjv_small
    import yaml

    d = _cfg(tmp_path, data_cfg, "cli", steps=8, eval_every=4, checkpoint_every=8, log_every=2)
    d["monitor"] = {"every": 4, "quantizers": ["rtn4"], "calib_samples": 2, "eval_windows": 4}
    d["log"] = {"to": ["jsonl", "csv", "tensorboard"], "print_every": 4}
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(yaml.safe_dump(d))
    r = cli("train", cfg_path)
    assert r.returncode == 0, r.stderr
    run = tmp_path / "cli"
    # not a terminal: no bar, no carriage returns; a plain line every 4 steps, one per val / monitor measurement
    assert "\r" not in r.stderr and "\r" not in r.stdout
    lines = r.stderr.splitlines()
    assert [l.split(",")[0] for l in lines if ", loss " in l] == ["cli: 4/8 steps (50%)", "cli: 8/8 steps (100%)"]
    assert any(l.startswith("cli: 4/8 steps (50%), loss ") and ", lr " in l and ", tok/s " in l for l in lines)
    assert lines[-1].startswith("cli: 8/8 steps (100%), loss ") and ", took " in lines[-1]  # the end
    assert sum("ptq rtn4 dCE" in l for l in lines) == 2 and sum("val/loss" in l for l in lines) == 2
    rows = read_metrics(run)
    train_rows = [x for x in rows if "train/loss" in x]
    assert [x["step"] for x in train_rows] == [2, 4, 6, 8]
    mon_rows = [x for x in rows if "ptq/rtn4/delta_ce" in x]
    assert [x["step"] for x in mon_rows] == [4, 8]
    tb = read_tensorboard(run / "tensorboard")
    assert sorted(tb["train/loss"]) == [2, 4, 6, 8] and sorted(tb["ptq/rtn4/delta_ce"]) == [4, 8]
    for x in train_rows:
        assert tb["train/loss"][x["step"]] == pytest.approx(x["train/loss"], rel=1e-6)
    for x in mon_rows:
        assert tb["ptq/rtn4/kl"][x["step"]] == pytest.approx(x["ptq/rtn4/kl"], rel=1e-6)
        assert tb["val/loss"][x["step"]] == pytest.approx(x["val/loss"], rel=1e-6)
    with open(run / "metrics.csv") as f:
        table = list(csv.DictReader(f))
    assert [int(t["step"]) for t in table] == [2, 4, 6, 8]
    assert float(table[1]["ptq/rtn4/delta_ce"]) == mon_rows[0]["ptq/rtn4/delta_ce"] and table[0]["ptq/rtn4/delta_ce"] == ""

    # a monitored run trains exactly like an unmonitored one (the monitor leaves weights and RNG alone)
    d2 = dict(d, name="plain", monitor={"every": 0}, log={"to": ["jsonl"]})
    plain = train(from_dict(RunConfig, d2), progress=False)
    assert [x["train/loss"] for x in read_metrics(plain) if "train/loss" in x] == [x["train/loss"] for x in train_rows]

    # --quiet prints nothing while training; --quiet with --verbose is a usage error
    r = cli("train", cfg_path, "--overwrite", "--quiet")
    assert r.returncode == 0 and r.stderr == "" and r.stdout.startswith("run directory:")
    assert len(read_tensorboard(run / "tensorboard")["train/loss"]) == 4  # --overwrite cleared the old events
    r = cli("train", cfg_path, "--overwrite", "--quiet", "--verbose")
    assert r.returncode == 2 and "--quiet and --verbose" in r.stderr and len(r.stderr.strip().splitlines()) == 1


class _CrashAt:
    """A step hook that fails at one step (a run killed after logging past its last checkpoint)."""

    def __init__(self, step: int):
        self.at = step

    def due(self, step: int) -> bool:
        return step == self.at

    def step(self, model, step, lr=None, tokens=None):
        raise RuntimeError("killed")


def test_resume_drops_rows_logged_after_the_checkpoint_in_every_logger(tmp_path, kjv_small):
    data_cfg, _ = kjv_small
    d = _cfg(tmp_path, data_cfg, "r", steps=8, checkpoint_every=4, log_every=2)
    d["log"] = {"to": ["csv", "jsonl"]}
    cfg = from_dict(RunConfig, d)
    with pytest.raises(RuntimeError, match="killed"):
        train(cfg, progress=False, hooks=[_CrashAt(7)])
    run = tmp_path / "r"
    assert [x["step"] for x in read_metrics(run)] == [2, 4, 6]  # step 6 was logged, not checkpointed (crash at 7)
    from quantdyn.runs import latest_resumable

    train(cfg, run, resume=latest_resumable(run), progress=False)
    assert [x["step"] for x in read_metrics(run)] == [2, 4, 6, 8]
    with open(run / "metrics.csv") as f:
        assert [int(t["step"]) for t in csv.DictReader(f)] == [2, 4, 6, 8]


@pytest.mark.e2e
def test_wandb_offline_without_an_account(tmp_path, kjv_small, monkeypatch):
    pytest.importorskip("wandb", reason="the wandb extra is not installed (pip install 'quantdyn[wandb]')")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    data_cfg, _ = kjv_small
    d = _cfg(tmp_path, data_cfg, "wb", steps=4, checkpoint_every=4, log_every=2)
    d["log"] = {"to": ["wandb"]}
    run = train(from_dict(RunConfig, d), progress=False)
    import wandb

    wandb.teardown()  # the run is finished; its service process writes the transaction log's last records by now
    info = json.loads((run / "run.json").read_text())
    runs = glob.glob(str(run / "wandb" / f"offline-run-*-{info['wandb_id']}" / "*.wandb"))
    assert len(runs) == 1, os.listdir(run / "wandb")
    history, run_record = read_wandb(runs[0])
    rows = {x["step"]: x for x in read_metrics(run) if "train/loss" in x}  # metrics.jsonl is written as well
    assert sorted(history) == sorted(rows) == [2, 4]
    for step, x in rows.items():
        assert history[step]["train/loss"] == pytest.approx(x["train/loss"]) and history[step]["train/lr"] == x["train/lr"]
    assert run_record.run_id == info["wandb_id"] and run_record.project == "quantdyn" and run_record.display_name == "wb"
    config = {u.key: json.loads(u.value_json) for u in run_record.config.update}
    assert config["train"]["seq_len"] == 32 and config["name"] == "wb"


def read_wandb(path):
    """({step: {key: value}}, the run record) of a W&B transaction log (``run-ID.wandb``: a 7-byte header, then
    LevelDB-style 32 KiB blocks of records — 7-byte header: CRC, length, type FULL/FIRST/MIDDLE/LAST — each a
    ``wandb_internal_pb2.Record``), which an offline run writes and `wandb sync` uploads."""
    from wandb.proto import wandb_internal_pb2 as pb

    raw = Path(path).read_bytes()
    assert raw[:4] == b":W&B"
    pos, block, buf, records = 7, 32768, b"", []
    while pos + 7 <= len(raw):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        if n == 0 and kind == 0:
            pos += left
            continue
        data, pos = raw[pos + 7 : pos + 7 + n], pos + 7 + n
        if kind in (1, 4):
            records.append(buf + data)
            buf = b""
        else:
            buf = data if kind == 2 else buf + data
    history, run_record = {}, None
    for d in records:
        r = pb.Record.FromString(d)
        which = r.WhichOneof("record_type")
        if which == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            history[int(items["_step"])] = items
        elif which == "run":
            run_record = r.run
    return history, run_record


def test_a_logger_whose_package_is_missing_is_one_line_before_training(tmp_path, kjv_small, cli, monkeypatch):
    import importlib.util

    import yaml

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    data_cfg, _ = kjv_small
    d = _cfg(tmp_path, data_cfg, "nowb", steps=2)
    d["log"] = {"to": ["jsonl", "wandb"]}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(d))
    r = cli("train", tmp_path / "c.yaml")
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "pip install 'quantdyn[wandb]'" in r.stderr and not (tmp_path / "nowb").exists()
    # the writers themselves say the same when their package cannot be imported
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(QuantdynError, match=r"quantdyn\[tensorboard\]"):
        TensorBoardLogger(tmp_path / "tb")
    r = cli("train", tmp_path / "c.yaml", "log.to=[tensorbord]")
    assert r.returncode == 2 and "did you mean 'tensorboard'" in r.stderr


def test_training_console_bar_on_a_terminal_plain_lines_elsewhere():
    """A run's console is the one Progress: on a terminal a bar with the loss in its postfix; elsewhere a plain
    line every 4 steps with the latest loss, one per monitor measurement, and the end."""
    tty = io.StringIO()
    c = Progress("run", 10, unit="steps", every_n=5, stream=tty, tty=True)
    for s in range(1, 11):
        show_logged(c, s, {"train/loss": 5.0 - s / 10, "train/lr": 1e-3, "train/tokens_per_s": 1000.0})
        c.update()
    c.close()
    assert "\r" in tty.getvalue() and "loss=4.0000" in tty.getvalue()
    plain = io.StringIO()
    c = Progress("run", 10, unit="steps", every_n=4, stream=plain, tty=False, initial=1)  # resumed at step 1
    for s in range(2, 11):
        if s % 2 == 0:
            show_logged(c, s, {"train/loss": 5.0 - s / 10, "train/lr": 1e-3, "train/tokens_per_s": 1000.0,
                               **({"ptq/rtn4/delta_ce": 0.01, "ptq/rtn4/kl": 0.002} if s == 10 else {})})
        c.update()
    c.close()
    out = plain.getvalue()
    assert "\r" not in out
    lines = [l for l in out.splitlines() if ", loss " in l]
    assert [l.split(",")[0] for l in lines] == ["run: 5/10 steps (50%)", "run: 9/10 steps (90%)", "run: 10/10 steps (100%)"]
    assert lines[0].startswith("run: 5/10 steps (50%), loss 4.6000, lr 1.00e-03, tok/s 1,000, ")  # step 4's row
    assert "run: step 10/10  ptq rtn4 dCE +0.01" in out and "took" in lines[-1]
    quiet = io.StringIO()
    c = Progress("run", 10, enabled=False, stream=quiet)
    show_logged(c, 2, {"train/loss": 1.0, "val/loss": 1.0}, verbose=True)
    c.update()
    c.close()
    assert quiet.getvalue() == ""


def test_renamed_keywords_still_work_with_a_warning():
    ids = torch.randint(0, 9, (2, 5))
    with pytest.warns(DeprecationWarning, match=r"PTQMonitor\(eval_tokens=...\) is now PTQMonitor\(eval_ids=...\)"):
        mon = PTQMonitor(["rtn4"], eval_tokens=ids, eval_windows=1)
    assert torch.equal(mon.windows()[0], ids[:1]) and mon.n_eval == 1
    with pytest.warns(DeprecationWarning, match=r"PTQMonitor\(n_eval_windows=...\) is now PTQMonitor\(eval_windows"):
        mon = PTQMonitor(["rtn4"], ids, n_eval_windows=1)
    assert mon.n_eval == 1
    with pytest.raises(TypeError, match="eval_tokenz"):
        PTQMonitor(["rtn4"], eval_tokenz=ids)
    with pytest.raises(QuantdynError, match="pass eval_ids"):
        PTQMonitor(["rtn4"])


def test_csv_and_jsonl_loggers_keep_names_and_truncate(tmp_path):
    lg = CSVLogger(tmp_path / "m.csv")
    lg.log({"train/loss": 1.5}, 1)
    lg.log({"train/loss": 1.25, "val/loss": 1.0}, 2)  # a new column: the file is rewritten with it
    lg.log({"train/loss": 1.0}, 3)
    with open(tmp_path / "m.csv") as f:
        assert list(csv.reader(f)) == [["step", "train/loss", "val/loss"], ["1", "1.5", ""], ["2", "1.25", "1.0"],
                                       ["3", "1.0", ""]]
    CSVLogger(tmp_path / "m.csv", truncate_after=2)
    with open(tmp_path / "m.csv") as f:
        assert [r["step"] for r in csv.DictReader(f)] == ["1", "2"]
    j = JsonlLogger(tmp_path / "m.jsonl")
    j.log({"train/loss": 2.0, "ptq/gptq4g128/delta_ce_se": 0.1, "ptq/gptq4g128/delta_ce": 0.5}, 7)
    row = json.loads((tmp_path / "m.jsonl").read_text())
    assert row == {"step": 7, "train/loss": 2.0, "ptq/gptq4g128/delta_ce_se": 0.1, "ptq/gptq4g128/delta_ce": 0.5}


# ------------------------------------------------------------------ HF Trainer and Lightning
@pytest.mark.e2e
def test_hf_trainer_callback_reports_through_the_trainers_integrations(tmp_path, kjv_small):
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")
    trainer, mon = _run_example("monitor_hf_trainer.py", "--steps", 6, "--every", 3, "--out", tmp_path / "hf")
    assert [h["step"] for h in mon.history] == [3, 6]
    # the Trainer's own TensorBoard integration logged them at the monitored steps (its names: train/ + ours)
    tb = read_tensorboard(tmp_path / "hf" / "runs")
    for h in mon.history:
        assert tb["train/ptq/rtn4/delta_ce"][h["step"]] == pytest.approx(h["ptq/rtn4/delta_ce"], rel=1e-6, abs=1e-9)
        assert tb["train/ptq/gptq3/top1_agree"][h["step"]] == pytest.approx(h["ptq/gptq3/top1_agree"], rel=1e-6)
    hist = json.loads((tmp_path / "hf" / "trainer_state.json").read_text())["log_history"]
    logged = {x["step"]: x for x in hist if "ptq/rtn4/kl" in x}
    assert sorted(logged) == [3, 6] and logged[6]["ptq/rtn4/kl"] == mon.history[1]["ptq/rtn4/kl"]
    with open(tmp_path / "hf" / "ptq.csv") as f:  # the monitor's own logger: exact shared names
        assert [int(r["step"]) for r in csv.DictReader(f)] == [3, 6]


@pytest.mark.e2e
def test_lightning_callback_logs_to_the_trainers_loggers(tmp_path, kjv_small):
    pytest.importorskip("lightning", reason="the lightning extra is not installed (pip install 'quantdyn[lightning]')")
    trainer, mon = _run_example("monitor_lightning.py", "--steps", 6, "--every", 3, "--out", tmp_path / "pl")
    assert [h["step"] for h in mon.history] == [3, 6]
    with open(tmp_path / "pl" / "lightning_logs" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("ptq/rtn4/delta_ce")]
    assert [int(r["step"]) for r in rows] == [3, 6]
    for r, h in zip(rows, mon.history):
        assert float(r["ptq/rtn4/delta_ce"]) == pytest.approx(h["ptq/rtn4/delta_ce"], rel=1e-12)
        assert float(r["ptq/gptq3/kl"]) == pytest.approx(h["ptq/gptq3/kl"], rel=1e-12)


@pytest.mark.e2e
def test_quantdyn_trainer_example_uses_the_same_monitor(tmp_path, kjv_small):
    run = _run_example("monitor_quantdyn_trainer.py", "--steps", 4, "--every", 2, "--out", tmp_path)
    rows = [x for x in read_metrics(run) if "ptq/gptq3/delta_ce" in x]
    assert [x["step"] for x in rows] == [2, 4] and all("val/loss" in x for x in rows)


def test_quantizer_labels_are_canonical_for_configs():
    mon = PTQMonitor([parse_quantizer("gptq4"), "rtn4"], eval_ids=torch.randint(0, 9, (2, 5)),
                     calib_ids=torch.randint(0, 9, (2, 4)))
    assert list(mon.quantizers) == [parse_quantizer("gptq4").name, "rtn4"]
