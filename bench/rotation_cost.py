"""What a rotation before quantizing (``+had``) costs per checkpoint in a sweep: one measurement (quantize and
evaluate) of a checkpoint with the study's quantizers, against the same measurement with every quantizer rotated,
interleaved in one process, best of N each (the machine is shared: only the ratio of the same run is read).
Goal (issue 37): <= 1.2x.

    .venv/bin/python bench/rotation_cost.py                        # the cooldown study's model (4 x 128, BPE 4096)
    .venv/bin/python bench/rotation_cost.py --preset pythia-70m    # a wider model (512; MLP 2048)
    .venv/bin/python bench/rotation_cost.py --quick                # `make bench`: 1 repeat, fewer windows

The model has random weights (the time does not depend on them) and the tokens are random ids; the numbers
that matter are ``ratio`` (rotated / plain wall time of the whole measurement) and where the extra time goes
(the engine's phases: the rotations of weights and statistics land in quantize_layers, the online rotations of
W4A4's activations in calib_forward and eval_forward).
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from quantdyn.engine.measure import MeasureConfig, measure
from quantdyn.models.gpt import GPT, ModelConfig, resolve_model_config
from common import record, write_results  # bench/common.py (this directory is on sys.path)


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quantizers", default="gptq3,rtn4,nvfp4,w4a4", help="the plain quantizers; each also +had")
    ap.add_argument("--preset", default="", help="model preset (default: the cooldown study's 4 x 128 model)")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--windows", type=int, default=128, help="evaluation windows of --seq tokens")
    ap.add_argument("--calib", type=int, default=64, help="calibration sequences of --seq tokens")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats; the best of each is kept")
    ap.add_argument("--quick", action="store_true", help="1 repeat, 32 windows, 16 calibration sequences")
    ap.add_argument("--out", default="", help="results file (default bench/results/rotation_cost-<machine>-<date>.json)")
    a = ap.parse_args()
    if a.quick:
        a.repeats, a.windows, a.calib = 1, 32, 16
    torch.manual_seed(0)
    shape = dict(preset=a.preset) if a.preset else dict(n_layer=4, d_model=128, n_head=4, tie_embeddings=True)
    model = GPT(resolve_model_config(ModelConfig(**shape, vocab_size=a.vocab))).eval()
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    windows = torch.randint(0, vocab, (a.windows, a.seq + 1), generator=g)
    calib = torch.randint(0, vocab, (a.calib, a.seq), generator=g)
    plain = [q for q in a.quantizers.split(",") if q]
    rotated = [f"{q}+had" for q in plain]
    runs: dict[str, list[dict]] = {"plain": [], "rotated": []}
    load = [_load()]
    for _ in range(a.repeats):
        for name, qs in (("plain", plain), ("rotated", rotated)):
            t0, c0 = time.perf_counter(), time.process_time()
            m = measure(model, qs, windows, calib, cfg=MeasureConfig(batch_size=16))
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            rot_s = sum(r.get("rotation_seconds") or 0.0 for q in m.quantizations.values() for r in q.rows)
            runs[name].append({"wall": wall, "cpu": cpu, "phases": m.phase_seconds, "rotation_seconds": rot_s})
            print(f"{name:8s} {wall:7.2f} s, {cpu:7.2f} CPU s  (weights/statistics rotated: {rot_s:.2f} s)  "
                  f"load {_load()}", flush=True)
        load.append(_load())
    best = {k: min(v, key=lambda r: r["wall"]) for k, v in runs.items()}
    ratio = best["rotated"]["wall"] / best["plain"]["wall"]
    # CPU seconds of this process: less at the mercy of the machine's other jobs than wall time (threads add up)
    cpu_ratio = min(r["cpu"] for r in runs["rotated"]) / min(r["cpu"] for r in runs["plain"])
    figures = {"ratio": ratio, "cpu_ratio": cpu_ratio, "plain_s": best["plain"]["wall"], "rotated_s": best["rotated"]["wall"],
               "rotation_seconds": best["rotated"]["rotation_seconds"], "goal": 1.2,
               "phases_plain": best["plain"]["phases"], "phases_rotated": best["rotated"]["phases"]}
    print(f"best of {a.repeats}: plain {best['plain']['wall']:.2f} s, rotated {best['rotated']['wall']:.2f} s, "
          f"ratio {ratio:.3f}x (goal <= 1.2x), CPU seconds {cpu_ratio:.3f}x; load averages {load}")
    model_desc = a.preset or "4x128 GPT, vocab 4096 (the cooldown study's shape)"
    path = write_results("rotation_cost", {"model": model_desc, "quantizers": plain, "windows": a.windows,
                                           "calib": a.calib, "seq": a.seq, "repeats": a.repeats, "load": load,
                                           "runs": runs, **figures},
                         out=a.out, suffix=a.preset or "")
    print(f"wrote {path}")
    record("rotation_cost", figures, a)


if __name__ == "__main__":
    main()
