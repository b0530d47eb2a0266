"""dist.strategy=fsdp2 on the CPU (gloo): torchrun with 2 processes trains, checkpoints, survives
kill -9, resumes (also with another number of processes) and follows one process's loss curve.

Tolerance of the loss curves (LOSS_RTOL = 1e-5, relative).  The runs see the same global batches
(2 processes x 2 sequences = 1 x 4) and start from the same seeded weights; they differ only in
floating-point summation order: the one-process loss is one fp32 mean over 4x32 tokens, the
2-process loss the mean of two fp32 means, and the gradient mean is summed in another order (a
reduce-scatter of two halves).  Each of these is a few fp32 roundings (unit roundoff 6e-8), so
a step's loss differs by a few ulps (~1e-7 relative), and the weights by a few ulps of their
size, whose first-order effect on the loss over 16 steps is of the same order.  Measured on this
machine: at most 8e-8 (one ulp at loss ~6).  1e-5 leaves two orders of magnitude of margin for
other CPUs' BLAS while still catching any real difference (a wrong batch slice, a missing
gradient average or a lost optimizer state changes the loss by > 1e-3).

Weights are not compared element by element: the attention's key bias gets an exactly-zero true
gradient (softmax is shift-invariant), so Adam turns its rounding noise into steps of ±lr whose
sign differs between the runs — without any effect on the loss.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import tiny_run_dict

from quantdyn.config import from_dict
from quantdyn.errors import QuantdynError
from quantdyn.train.checkpoint import read_metrics
from quantdyn.train.config import RunConfig
from quantdyn.train.trainer import train

LOSS_RTOL = 1e-5
STEPS = 16
EVERY = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_dict(tmp_path, data_cfg, name, batch_size, strategy, steps=STEPS):
    d = tiny_run_dict(tmp_path, data_cfg, steps=steps, batch_size=batch_size, checkpoint_every=EVERY, eval_every=0)
    d.update(name=name, schedule={"name": "constant", "warmup": 2}, dist={"strategy": strategy},
             averaging={"lawa_window": 2, "lawa_every": EVERY, "ema_decay": 0.9})
    return d


TINY = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"


def _tiny_overrides(tmp_path, data_cfg, name, batch_size, strategy, steps=STEPS) -> list[str]:
    """configs/tiny.yaml made small enough for seconds on a CPU (the data section is the session's
    cached kjv_small), as key=value overrides: what the command line of the issue's CI test passes."""
    d = _run_dict(tmp_path, data_cfg, name, batch_size, strategy, steps)
    d["monitor"] = {"every": EVERY * 2, "quantizers": ["rtn4"], "calib_samples": 2, "eval_windows": 4}
    out = []

    def flat(prefix, v):
        if isinstance(v, dict):
            for k, x in v.items():
                flat(f"{prefix}{k}.", x)
        else:
            out.append(f"{prefix[:-1]}={json.dumps(v)}")

    flat("", d)
    return out


def _torchrun(nproc, args, **kw):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), "-m", "quantdyn.cli", "train", *args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **kw)


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in os.listdir("/proc"):
        if stat.isdigit():
            try:
                with open(f"/proc/{stat}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(stat))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _kill9(p: subprocess.Popen) -> None:
    """SIGKILL torchrun and its workers (torchrun starts each worker in a session of its own)."""
    for pid in [*_descendants(p.pid), p.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.wait()


def _kill9_once_written(p: subprocess.Popen, path: Path, timeout_s: float) -> None:
    """Wait, the process alive, until ``path`` exists (a checkpoint it writes), then :func:`_kill9` it: a kill in the
    middle of its run."""
    deadline = time.time() + timeout_s
    while not path.exists():
        assert p.poll() is None, p.communicate()[1][-3000:]
        assert time.time() < deadline, f"no checkpoint within {timeout_s:.0f} s"
        time.sleep(0.002)
    _kill9(p)


def _curve(run_dir, key="train/loss"):
    return {r["step"]: r[key] for r in read_metrics(run_dir) if key in r}


def _assert_same_curve(a, b):
    assert sorted(a) == sorted(b) and a
    for s in a:
        assert abs(a[s] - b[s]) <= LOSS_RTOL * abs(a[s]), (s, a[s], b[s])


@pytest.mark.e2e
def test_fsdp2_two_processes_kill_resume_match_one_process(tmp_path, kjv_small):
    from quantdyn.config import apply_overrides, load_yaml
    from quantdyn.models.hf_io import load_gpt
    from quantdyn.runs import list_checkpoints

    data_cfg, data = kjv_small
    ref_cfg = apply_overrides(load_yaml(TINY), _tiny_overrides(tmp_path, data_cfg, "ref", 4, "ddp"))
    from quantdyn.monitor import hooks_for

    ref_run = from_dict(RunConfig, ref_cfg)
    ref = train(ref_run, progress=False, hooks=hooks_for(ref_run))  # what `quantdyn train` does

    # torchrun --nproc_per_node 2 -m quantdyn.cli train configs/tiny.yaml dist.strategy=fsdp2 (+ tiny overrides):
    # 2 processes x 2 sequences, a long run, killed with SIGKILL as soon as its first checkpoint exists
    run = tmp_path / "fsdp"
    p = _torchrun(2, [str(TINY), *_tiny_overrides(tmp_path, data_cfg, "fsdp", 2, "fsdp2", steps=10_000), "--quiet"])
    first = run / "checkpoints" / f"step-{EVERY:07d}" / "model.safetensors"
    _kill9_once_written(p, first, 240)
    done = [c.step for c in list_checkpoints(run)]
    assert done and max(done) < STEPS, done  # killed mid-run

    # resume to the reference's length (the constant schedule does not depend on train.steps)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["train"]["steps"] = STEPS
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    p = _torchrun(2, ["--resume", str(run), "--quiet"])
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-3000:]
    assert [c.step for c in list_checkpoints(run)] == list(range(EVERY, STEPS + 1, EVERY))
    assert not [x for x in (run / "checkpoints").iterdir() if x.name.startswith(".")]  # no temporaries left
    _assert_same_curve(_curve(ref), _curve(run))
    _assert_same_curve(_curve(ref, "val/loss"), _curve(run, "val/loss"))
    # the in-training quantization monitor sees the gathered weights: the same Δ CE as one process. Δ CE is a
    # difference of two fp32 mean CEs of ~6 nats (one ulp: 4.8e-7; measured difference <= 2.4e-7): 1e-5 = 20 ulps
    mon_ref, mon = _curve(ref, "ptq/rtn4/delta_ce"), _curve(run, "ptq/rtn4/delta_ce")
    assert sorted(mon) == sorted(mon_ref) == list(range(2 * EVERY, STEPS + 1, 2 * EVERY))
    assert all(abs(mon[s] - mon_ref[s]) <= 1e-5 for s in mon), (mon, mon_ref)
    meta = json.loads((run / "checkpoints" / f"step-{STEPS:07d}" / "quantdyn.json").read_text())
    assert (meta["world_size"], meta["dist_strategy"], meta["tokens"]) == (2, "fsdp2", STEPS * 4 * 32)

    # the gathered checkpoint is a plain HF checkpoint: transformers loads it with equal logits
    from transformers import AutoModelForCausalLM

    ck = run / "checkpoints" / f"step-{STEPS:07d}"
    hf = AutoModelForCausalLM.from_pretrained(ck).eval()
    ours = load_gpt(ck).eval()
    x = data.eval_windows(32, 2)
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, ours(x), rtol=1e-4, atol=1e-4)

    # the gathered optimizer state is laid out like a one-process run's, with (nearly) the same numbers
    sa = torch.load(ref / "checkpoints" / f"step-{STEPS:07d}" / "training_state.pt", weights_only=True)
    sb = torch.load(ck / "training_state.pt", weights_only=True)
    assert [g["params"] for g in sa["optimizer"]["param_groups"]] == [g["params"] for g in sb["optimizer"]["param_groups"]]
    assert sa["optimizer"]["state"].keys() == sb["optimizer"]["state"].keys()
    for i, st in sa["optimizer"]["state"].items():
        assert float(st["step"]) == float(sb["optimizer"]["state"][i]["step"]) == STEPS
        # second moments: squares of gradients that agree to a few ulps
        torch.testing.assert_close(sb["optimizer"]["state"][i]["exp_avg_sq"], st["exp_avg_sq"], rtol=1e-4, atol=1e-12)

    # online averages (LAWA, EMA) gathered from the shards give the one-process averages
    for avg in (f"lawa-k2-p{EVERY}", "ema-0.9"):
        a = load_gpt(ref / "averages" / avg / f"step-{STEPS:07d}")
        b = load_gpt(run / "averages" / avg / f"step-{STEPS:07d}")
        from quantdyn.evaluate.loss import mean_loss

        la, lb = mean_loss(a, x), mean_loss(b, x)
        assert abs(la - lb) <= LOSS_RTOL * la, (avg, la, lb)

    # another number of processes, same global batch (1 x 4): the full-state FSDP2 checkpoint resumes
    # in one process (the layout does not depend on the world size or the strategy)
    import shutil

    from quantdyn.runs import latest_resumable

    one = tmp_path / "one"
    shutil.copytree(run, one)
    for c in list_checkpoints(one):
        if c.step > EVERY:
            shutil.rmtree(c.path)
    cfg.update(name="one", out_dir=str(tmp_path), dist={"strategy": "ddp"})
    cfg["train"]["batch_size"] = 4
    cfg["monitor"] = {"every": 0}  # the losses are what this part compares
    train(from_dict(RunConfig, cfg), one, resume=latest_resumable(one), progress=False)
    _assert_same_curve(_curve(ref), _curve(one))


def test_fsdp2_resume_with_another_global_batch_is_refused_before_writing(tmp_path, kjv_small):
    """A world-size change that changes the global batch cannot resume exactly: one line, nothing written."""
    from quantdyn.runs import latest_resumable

    data_cfg, _ = kjv_small
    d = _run_dict(tmp_path, data_cfg, "r", 4, "ddp", steps=4)
    run = train(from_dict(RunConfig, d), progress=False)
    before = {p: p.read_bytes() for p in (run / "config.yaml", run / "run.json", run / "metrics.jsonl")}
    d["train"]["batch_size"] = 2  # as if launched on twice as many processes with the same per-process batch
    d["train"]["steps"] = 6
    with pytest.raises(QuantdynError, match="tokens per step.*keep the global batch"):
        train(from_dict(RunConfig, d), run, resume=latest_resumable(run), progress=False)
    assert {p: p.read_bytes() for p in before} == before


def test_fsdp2_needs_torchrun_and_elementwise_optimizers(tmp_path, kjv_small, monkeypatch):
    from quantdyn.train.distributed import FSDP2, launched_by_torchrun

    data_cfg, _ = kjv_small
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    assert not launched_by_torchrun()
    d = _run_dict(tmp_path, data_cfg, "x", 2, "fsdp2")
    with pytest.raises(QuantdynError, match=r"torchrun --nproc_per_node N -m quantdyn.cli train CONFIG dist.strategy=fsdp2"):
        train(from_dict(RunConfig, d), progress=False)
    assert not (tmp_path / "x").exists()
    with pytest.raises(QuantdynError, match=r"unknown dist.strategy 'fsdp' \(did you mean 'fsdp2'\?\)"):
        from_dict(RunConfig, {"dist": {"strategy": "fsdp"}})
    strategy = FSDP2(torch.device("cpu"), 2, 0)
    muon = from_dict(RunConfig, {"optim": {"name": "muon"}}).optim
    with pytest.raises(QuantdynError, match="optimizer 'muon' works on whole weight matrices.*adamw"):
        strategy.check_optimizer(muon)
    mixed = from_dict(RunConfig, {"optim": {"groups": [{"name": "hidden_matrix", "optimizer": "soap"}]}}).optim
    with pytest.raises(QuantdynError, match="'soap'"):
        strategy.check_optimizer(mixed)
    strategy.check_optimizer(from_dict(RunConfig, {"optim": {"name": "lion"}}).optim)


def test_fsdp2_cli_without_torchrun_is_one_line(tmp_path, kjv_small):
    data_cfg, _ = kjv_small
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(_run_dict(tmp_path, data_cfg, "y", 2, "fsdp2")))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    r = subprocess.run([sys.executable, "-m", "quantdyn.cli", "train", str(p)], capture_output=True, text=True,
                       env=env)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "torchrun" in r.stderr


def test_optimizer_state_name_round_trip_for_combined_optimizers():
    """The conversion between torch's numbered optimizer state and names (what FSDP2 checkpoints go
    through) is lossless, also for a CombinedOptimizer (Muon on matrices + AdamW elsewhere)."""
    from quantdyn.models.gpt import GPT, ModelConfig
    from quantdyn.train.distributed import optimizer_state_from_fqn, optimizer_state_to_fqn
    from quantdyn.train.optimizers import build_optimizer

    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=2, d_model=32, n_head=2, vocab_size=64, max_seq_len=16))
    opt = build_optimizer(model, from_dict(RunConfig, {"optim": {"name": "muon"}}).optim)
    model(torch.randint(0, 64, (2, 8))).sum().backward()
    opt.step()
    saved = opt.state_dict()
    named = optimizer_state_to_fqn(model, opt, saved)
    assert "gpt_neox.layers.0.attention.query_key_value.weight" in named["state"]
    assert all(isinstance(n, str) for g in named["param_groups"] for n in g["params"])
    back = optimizer_state_from_fqn(model, opt, named)
    assert list(back["optimizers"]) == list(saved["optimizers"])
    for k, sd in saved["optimizers"].items():
        assert [g["params"] for g in back["optimizers"][k]["param_groups"]] == [g["params"] for g in sd["param_groups"]]
        assert back["optimizers"][k]["state"].keys() == sd["state"].keys()
        for i, st in sd["state"].items():
            for name, v in st.items():
                assert torch.equal(torch.as_tensor(back["optimizers"][k]["state"][i][name]), torch.as_tensor(v))


def _rank0_first_worker(rank, port, out_dir):
    import torch.distributed as dist

    from quantdyn.errors import QuantdynError
    from quantdyn.train.distributed import rank0_first

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    for case in ("ok", "fail"):
        log = os.path.join(out_dir, f"{case}.log")

        def prepare():
            with open(log, "a") as f:
                f.write(f"start {rank} {time.time()}\n")
            if rank == 0:
                time.sleep(1.0)  # rank 1 must be waiting all this time, not preparing too
                if case == "fail":
                    raise QuantdynError("data source 'x' does not exist")
            with open(log, "a") as f:
                f.write(f"end {rank} {time.time()}\n")
            return rank

        try:
            got = str(rank0_first(prepare, timeout_min=1))
        except QuantdynError as e:
            got = f"error: {e}"
        with open(os.path.join(out_dir, f"{case}.{rank}"), "w") as f:
            f.write(got)
    dist.destroy_process_group()


@pytest.mark.e2e
def test_rank0_first_prepares_on_rank0_while_the_others_wait(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_rank0_first_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    events = [line.split() for line in (tmp_path / "ok.log").read_text().splitlines()]
    assert [e[:2] for e in events] == [["start", "0"], ["end", "0"], ["start", "1"], ["end", "1"]]
    assert float(events[2][2]) >= float(events[1][2])
    assert [(tmp_path / f"ok.{r}").read_text() for r in (0, 1)] == ["0", "1"]
    # rank 0's one-line error reaches every rank; rank 1 never starts its own preparation
    assert [e.split()[:2] for e in (tmp_path / "fail.log").read_text().splitlines()] == [["start", "0"]]
    assert {(tmp_path / f"fail.{r}").read_text() for r in (0, 1)} == {"error: data source 'x' does not exist"}
