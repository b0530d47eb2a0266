"""What issue 29's measures cost per checkpoint: the detailed metrics and the bf16 noise floor, in one run.

    .venv/bin/python bench/metrics_cost.py [--sizes 14m,160m] [--reps 2] [--quick]

One checkpoint of each Pythia shape (random weights, bench/sweep_memory.py's ``write_pythia``) is measured as a
sweep measures a checkpoint (``engine.measure`` with the sweep's MeasureConfig, its default quantizers and data
sizes: gptq3, gptq4, rtn4; 32 calibration and 200 evaluation windows of 128 tokens) in three ways:

    base      detailed_metrics=False, no floor: CE, mean KL and top-1 agreement only (the rows before issue 29)
    metrics   detailed_metrics=True, no floor: + KL percentiles, reverse KL, top-2..5, Δp, correlation, KL by
              confidence, per-block error maps
    floor     detailed_metrics=True and noise_floor=True (what a sweep runs for a checkpoint's first pass)

The three are interleaved, ``--reps`` times in rotated order, in the same process under the same load (the
machine is shared: the load average is recorded before and after); each figure is the minimum over repetitions
(the run least disturbed by other work), wall and CPU seconds alike. Goals (issue 29, item 6):

* metrics / base - 1 <= 10 % per checkpoint;
* floor - metrics <= one extra FP block pass: the walk's evaluation forward of ``metrics`` divided by its
  number of streams (FP and each quantizer: k + 1), i.e. what one more RTN-like variant's blocks cost. The head
  work for the floor variant (its logits and measures) is printed beside it.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import record, write_results  # noqa: E402
from sweep_memory import write_pythia  # noqa: E402

from quantdyn.engine.measure import MeasureConfig, measure  # noqa: E402

QUANTIZERS = ("gptq3", "gptq4", "rtn4")
MODES = {"base": (False, False), "metrics": (True, False), "floor": (True, True)}


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def one(ckpt: Path, mode: str, eval_ids: torch.Tensor, calib_ids: torch.Tensor, quantizers) -> dict:
    detailed, floor = MODES[mode]
    cfg = MeasureConfig(detailed_metrics=detailed)
    w0, c0 = time.perf_counter(), time.process_time()
    m = measure(str(ckpt), list(quantizers), eval_ids, calib_ids, cfg=cfg, noise_floor=floor)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    label = quantizers[0]
    return {"wall": wall, "cpu": cpu, "phases": dict(m.phase_seconds), "n_fields": len(m.metrics[label]),
            "floor_measured": m.noise_floor is not None}


def shape_cost(size: str, ckpt: Path, reps: int, windows: int, calib: int, quantizers) -> dict:
    vocab = int(json.loads((ckpt / "config.json").read_text())["vocab_size"])
    g = torch.Generator().manual_seed(0)
    eval_ids = torch.randint(0, vocab, (windows, 129), generator=g)
    calib_ids = torch.randint(0, vocab, (calib, 128), generator=g)
    one(ckpt, "base", eval_ids[:8], calib_ids[:8], quantizers[-1:])  # warm-up: page cache, allocator, kernels
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    load = [loadavg()]
    order = list(MODES)
    for r in range(reps):
        for mode in order[r % len(order):] + order[: r % len(order)]:
            res = one(ckpt, mode, eval_ids, calib_ids, quantizers)
            runs[mode].append(res)
            print(f"  {size} rep {r + 1} {mode:8s} wall {res['wall']:7.1f} s  cpu {res['cpu']:7.1f} s  "
                  f"eval_forward {res['phases'].get('eval_forward', 0):6.1f} s  head {res['phases'].get('head', 0):6.1f} s"
                  f"  load {loadavg()[0]:.1f}", flush=True)
        load.append(loadavg())
    best = {m: {k: min(x[k] for x in rs) for k in ("wall", "cpu")} for m, rs in runs.items()}
    for m, rs in runs.items():
        for ph in ("eval_forward", "head"):
            best[m][ph] = min(x["phases"].get(ph, 0.0) for x in rs)
    k = len(quantizers)
    one_pass = best["metrics"]["eval_forward"] / (k + 1)
    out = {
        "runs": runs, "best": best, "loadavg": load,
        "metrics_over_base_wall": best["metrics"]["wall"] / best["base"]["wall"],
        "metrics_over_base_cpu": best["metrics"]["cpu"] / best["base"]["cpu"],
        "floor_extra_wall": best["floor"]["wall"] - best["metrics"]["wall"],
        "floor_extra_eval_forward": best["floor"]["eval_forward"] - best["metrics"]["eval_forward"],
        "floor_extra_head": best["floor"]["head"] - best["metrics"]["head"],
        "one_fp_block_pass": one_pass,
    }
    out["floor_extra_in_fp_passes"] = out["floor_extra_wall"] / one_pass if one_pass else float("nan")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="14m,160m")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--windows", type=int, default=200, help="evaluation windows of 128 tokens (the sweep's 200)")
    ap.add_argument("--calib", type=int, default=32, help="calibration windows of 128 tokens (the sweep's 32)")
    ap.add_argument("--quantizers", default=",".join(QUANTIZERS))
    ap.add_argument("--work", default="", help="where the checkpoints are written (default: a temporary directory)")
    ap.add_argument("--quick", action="store_true", help="14m only, 1 repetition, 32 evaluation windows")
    ap.add_argument("--out", default="", help="results JSON (default bench/results/metrics_cost-<machine>-<date>.json)")
    a = ap.parse_args()
    if a.quick:
        a.sizes, a.reps, a.windows = "14m", 1, 32
    quantizers = tuple(q for q in a.quantizers.split(",") if q)
    results: dict = {"quantizers": quantizers, "windows": a.windows, "calib": a.calib, "reps": a.reps,
                     "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d"), "shapes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(a.work or tmp)
        for size in [s for s in a.sizes.split(",") if s]:
            ckpt = write_pythia(size, work / f"pythia-{size}")
            results["shapes"][size] = shape_cost(size, ckpt, a.reps, a.windows, a.calib, quantizers)
            path = write_results("metrics_cost", results, a.out)  # rewritten after each shape: nothing lost
    print(f"\nmetrics cost ({', '.join(quantizers)}; {a.windows} eval x 128 tokens, {a.calib} calibration windows; "
          f"min of {a.reps} interleaved repetitions; {results['threads']} threads)")
    print(f"{'shape':6s} {'base s':>8s} {'metrics s':>9s} {'floor s':>8s} {'metrics/base':>12s} {'(cpu)':>6s} "
          f"{'floor extra s':>13s} {'1 FP pass s':>11s} {'extra/pass':>10s} {'floor head s':>12s}")
    ok = True
    for size, r in results["shapes"].items():
        b = r["best"]
        print(f"{size:6s} {b['base']['wall']:8.1f} {b['metrics']['wall']:9.1f} {b['floor']['wall']:8.1f} "
              f"{r['metrics_over_base_wall']:12.3f} {r['metrics_over_base_cpu']:6.3f} {r['floor_extra_wall']:13.1f} "
              f"{r['one_fp_block_pass']:11.1f} {r['floor_extra_in_fp_passes']:10.2f} {r['floor_extra_head']:12.1f}")
        ok &= r["metrics_over_base_wall"] <= 1.10
    print(f"written: {path}")
    record("metrics_cost", {s: {k: v for k, v in r.items() if k != "runs"} for s, r in results["shapes"].items()}, a)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
