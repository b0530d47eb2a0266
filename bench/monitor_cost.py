"""What the in-training PTQ monitor costs, as a fraction of the training time, measured in one run.

    .venv/bin/python bench/monitor_cost.py [--config configs/tiny.yaml] [--steps 1000] [--every 100] [--quick]

One training run of the config (default: the tiny model, configs/tiny.yaml, as `quantdyn train` runs it,
with its evaluation and checkpoints) carries three monitors as step hooks, each at ``--every`` steps with the
run config's monitor defaults (64 evaluation windows of seq_len tokens, 16 calibration windows):

    rtn4            the default monitor (monitor.quantizers: [rtn4])
    gptq3           one calibrated quantizer
    rtn4+gptq3      both in one monitor (one shared full-precision pass)

Each monitor times its own measurements (``PTQMonitor.seconds``); the training time is the run's wall time
less all monitor time. Both sides are measured in the same run, under the same load, so the fractions hold
on a busy machine too (the absolute seconds do not). Quick mode: 200 steps.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import record, write_results

from quantdyn.config import apply_overrides, from_dict, load_yaml
from quantdyn.data.prepare import prepare_data
from quantdyn.monitor import PTQMonitor
from quantdyn.train.config import RunConfig
from quantdyn.train.trainer import train

MONITORS = {"rtn4": ["rtn4"], "gptq3": ["gptq3"], "rtn4+gptq3": ["rtn4", "gptq3"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(HERE.parent / "configs" / "tiny.yaml"))
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--quick", action="store_true", help="200 steps")
    ap.add_argument("--out", default="", help="results JSON (default bench/results/monitor_cost-<machine>-<date>.json)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides of the config")
    args = ap.parse_args()
    steps = 200 if args.quick else args.steps

    with tempfile.TemporaryDirectory() as tmp:
        d = apply_overrides(load_yaml(args.config), [f"train.steps={steps}", f"out_dir={tmp}", "name=monitor-cost",
                                                     *args.overrides])
        cfg = from_dict(RunConfig, d)
        data = prepare_data(cfg.data, progress=False)  # tokenizing is not part of the training time
        mon_cfg = cfg.monitor
        T = cfg.train.seq_len
        eval_ids = data.eval_windows(T, mon_cfg.eval_windows)
        calib_ids = data.calib_windows(mon_cfg.calib_samples, T, seed=0)
        monitors = {name: PTQMonitor(qs, eval_ids=eval_ids, calib_ids=calib_ids, every=args.every)
                    for name, qs in MONITORS.items()}
        t0 = time.perf_counter()
        train(cfg, hooks=list(monitors.values()), progress=False)
        wall = time.perf_counter() - t0
    monitored = sum(m.seconds for m in monitors.values())
    train_s = wall - monitored
    n = len(next(iter(monitors.values())).history)
    print(f"{cfg.name}: {steps} steps of {cfg.tokens_per_step:,} tokens, {torch.get_num_threads()} threads; "
          f"training {train_s:.1f} s (wall {wall:.1f} s, of which monitors {monitored:.1f} s)")
    print(f"| monitor (every {args.every} steps) | measurements | s per measurement | fraction of training time |")
    print("|---|---|---|---|")
    figures = {"steps": steps, "every": args.every, "tokens_per_step": cfg.tokens_per_step, "train_s": train_s,
               "wall_s": wall, "measurements": n, "monitors": {}}
    for name, m in monitors.items():
        frac = m.seconds / train_s
        figures["monitors"][name] = {"seconds": m.seconds, "per_measurement_s": m.seconds / max(1, n),
                                     "fraction": frac}
        print(f"| {name} | {n} | {m.seconds / max(1, n):.2f} | {frac:.2%} |")
    record("monitor_cost", figures, args)
    out = write_results("monitor_cost", {"config": args.config, "overrides": args.overrides, **figures}, args.out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
