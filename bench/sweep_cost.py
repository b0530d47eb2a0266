"""Cost per checkpoint of a sweep, split into load / quantize / evaluate, and
its growth from 5 to 20 checkpoints (should be linear: tokens are prepared
once, never per checkpoint), and the evaluation time with the quantized
copies of a checkpoint evaluated together (one FP forward per batch, the
default) against one at a time (``eval_group: 1``), on the same 5 checkpoints.

    .venv/bin/python bench/sweep_cost.py [--quantizers gptq3,rtn4] [--windows 100]
    python3 bench/sweep_cost.py --device cuda --preset pythia-160m --quantizers gptq3,gptq4,rtn2,rtn3,rtn4 \
        --checkpoints 1,3 --seq 2048 --calib 64 --windows 50 --no-one-at-a-time          # a GPU

Trains a tiny run with 20 checkpoints in a temporary directory, then sweeps
the first 5 and all 20 into fresh stores and prints the per-checkpoint cost
of each and their ratio (goal ~1.0).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from quantdyn.config import from_dict
from quantdyn.results.store import ResultStore
from quantdyn.runs import list_checkpoints
from quantdyn.sweep.sweep import SweepConfig, run_sweep
from quantdyn.train.config import RunConfig
from quantdyn.train.trainer import train


def sweep_cost(ckpts: list[str], store: Path, quantizers: list[str], windows: int, eval_group: int = 8,
               device: str = "cpu", seq: int = 128, calib: int = 16) -> dict:
    cfg = from_dict(SweepConfig, {"trajectory": {"checkpoints": ckpts}, "quantizers": quantizers, "store": str(store),
                                  "eval_group": eval_group, "device": device,
                                  "data": {"calib_samples": calib, "calib_seq_len": seq, "eval_windows": windows,
                                           "eval_seq_len": seq}})
    t0 = time.perf_counter()
    out = run_sweep(cfg, progress=False)
    wall = time.perf_counter() - t0
    rows = [r for r in ResultStore(store).rows() if r["kind"] == "ptq"]
    per = {
        "load": statistics.mean({r["checkpoint"]: r["t_load"] for r in rows}.values()),
        "quantize": sum(r["t_quantize"] for r in rows) / len(ckpts),
        "evaluate": sum(r["t_eval"] for r in rows) / len(ckpts),
    }
    return {"wall": wall, "per_ckpt": wall / len(ckpts), "parts": per, "n": len(ckpts), "written": out["written"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quantizers", default="gptq3,rtn4")
    ap.add_argument("--windows", type=int, default=100)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="cpu | cuda: where the sweep (and the tiny training) runs")
    ap.add_argument("--preset", default="", help="model preset (default: a 4 x 128 GPT); e.g. pythia-160m on a GPU")
    ap.add_argument("--seq", type=int, default=128, help="training, calibration and evaluation sequence length")
    ap.add_argument("--calib", type=int, default=16, help="calibration sequences")
    ap.add_argument("--checkpoints", default="", help="SMALL,LARGE: sweep the first SMALL and then the first LARGE "
                                                     "checkpoints (default 5,20; quick 2,6)")
    ap.add_argument("--no-one-at-a-time", action="store_true",
                    help="skip the evaluation with one quantized copy at a time (eval_group 1)")
    ap.add_argument("--quick", action="store_true",
                    help="12 training steps (6 checkpoints): 2 vs 6 checkpoints, 16 windows")
    a = ap.parse_args()
    small, large = (2, 6) if a.quick else (5, 20)
    if a.checkpoints:
        parts = a.checkpoints.split(",")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts) or not 0 < int(parts[0]) < int(parts[1]):
            ap.error(f"--checkpoints takes SMALL,LARGE with 0 < SMALL < LARGE (e.g. 1,2), not {a.checkpoints!r}")
        small, large = int(parts[0]), int(parts[1])
    steps = 2 * large  # a checkpoint every 2 steps
    if a.quick:
        a.windows = min(a.windows, 16)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU is visible here (torch.cuda.is_available() is False)")
    qs = [q for q in a.quantizers.split(",") if q]
    model = ({"preset": a.preset, "max_seq_len": max(256, a.seq)} if a.preset else
             {"n_layer": 4, "d_model": 128, "n_head": 4, "max_seq_len": max(256, a.seq)})
    kw = dict(device=a.device, seq=a.seq, calib=a.calib)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = from_dict(RunConfig, {
            "name": "cost", "out_dir": tmp, "model": model,
            **({"data": {"tokenizer": "gpt2"}} if a.preset.startswith("pythia") else {}),
            "schedule": {"name": "constant", "warmup": 0},
            "train": {"steps": steps, "batch_size": 8, "seq_len": a.seq, "eval_every": 0, "eval_windows": 4,
                      "checkpoint_every": 2, "log_every": 10, "device": a.device},
        })
        t0 = time.perf_counter()
        run = train(cfg, progress=False)
        t_train = time.perf_counter() - t0
        ckpts = [str(c.path) for c in list_checkpoints(run)]
        # warm the token cache so both sweeps measure only per-checkpoint work
        sweep_cost(ckpts[:1], Path(tmp) / "warm", qs, a.windows, **kw)
        c5 = sweep_cost(ckpts[:small], Path(tmp) / "s5", qs, a.windows, **kw)
        c20 = sweep_cost(ckpts[:large], Path(tmp) / "s20", qs, a.windows, **kw)
        c5_one = None if a.no_one_at_a_time else sweep_cost(ckpts[:small], Path(tmp) / "s5one", qs, a.windows,
                                                             eval_group=1, **kw)
    print(f"device {a.device}  threads {torch.get_num_threads()}  model {a.preset or '4 x 128'}  quantizers {qs}  "
          f"eval {a.windows} windows x {a.seq} tokens, calibration {a.calib} x {a.seq}  "
          f"(training the {len(ckpts)}-checkpoint run took {t_train:.1f}s)")
    for c in (c5, c20):
        p = c["parts"]
        print(f"{c['n']:>2} checkpoints: {c['wall']:7.1f}s total, {c['per_ckpt']:6.2f}s/ckpt "
              f"(load {p['load']:.2f}  quantize {p['quantize']:.2f}  evaluate {p['evaluate']:.2f})")
    print(f"per-checkpoint cost, {large} vs {small}: ratio {c20['per_ckpt'] / c5['per_ckpt']:.3f}  "
          "(goal ~1.0: linear growth)")
    if c5_one is not None:
        p1 = c5_one["parts"]
        print(f"{small:>2} checkpoints, one quantized copy at a time: {c5_one['wall']:7.1f}s total "
              f"(quantize {p1['quantize']:.2f}  evaluate {p1['evaluate']:.2f} s/ckpt)")
        print(f"evaluation time, together vs one at a time: ratio {c5['parts']['evaluate'] / p1['evaluate']:.3f}  "
              f"(ideal with k quantizers: (k + 1) / 2k)")
    from common import record  # bench/common.py (this script's directory is on sys.path)

    record("sweep_cost", {"device": a.device, "train_s": t_train, "small": c5, "large": c20,
                          "small_one_at_a_time": c5_one, "per_ckpt_ratio": c20["per_ckpt"] / c5["per_ckpt"],
                          "eval_together_vs_one": c5["parts"]["evaluate"] / c5_one["parts"]["evaluate"]
                          if c5_one else None}, a)


if __name__ == "__main__":
    main()
