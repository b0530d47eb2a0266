"""quantdyn's Python API end to end, in under a minute on a CPU: train a tiny run, branch a cooldown and its
constant-LR control, quantize one checkpoint, sweep every checkpoint, read the rows as a DataFrame, write the
report.

    python examples/api_quickstart.py [--steps 40] [--out runs/api-quickstart]

Everything here goes through ``quantdyn.api`` (the public names; see its docstring), the same calls the
command line makes (`quantdyn train`, `cooldown`, `quantize`, `sweep`, `results`, `report`).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import quantdyn.api as qd


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", type=Path, default=Path("runs/api-quickstart"))
    args = ap.parse_args(argv)
    out = args.out
    every = max(1, args.steps // 4)

    # 1. train: a RunConfig from a plain dict (the same keys as configs/*.yaml), the monitor off
    cfg = qd.from_dict(qd.RunConfig, {
        "name": "quickstart", "out_dir": str(out / "runs"), "seed": 0,
        "model": {"n_layer": 2, "d_model": 64, "n_head": 2, "max_seq_len": 128},
        "data": {"source": "builtin:kjv", "tokenizer": "bpe:512", "max_tokens": 200_000,
                 "bpe_train_chars": 400_000},
        "schedule": {"name": "constant", "warmup": 4},
        "train": {"steps": args.steps, "batch_size": 8, "seq_len": 64, "eval_every": every, "eval_windows": 8,
                  "checkpoint_every": every, "log_every": every},
    })
    run = qd.train(cfg, progress=False, overwrite=True)

    # 2. a linear cooldown from the middle checkpoint, and its constant-LR control of equal length
    branches = qd.cooldown(run, from_step=2 * every, decay_steps=[every], control=True, progress=False)

    # 3. one checkpoint, quantized and measured with two quantizers in one pass (the `quantize` command as a call)
    final = sorted((run / "checkpoints").iterdir())[-1]
    res = qd.quantize_checkpoint(str(final), ["gptq3g32", "rtn4"], calib_samples=8, calib_seq_len=64,
                                 eval_tokens=4096, eval_seq_len=64, progress=False)
    for label, x in res.metrics.items():
        print(f"final checkpoint, {label}: Δ CE {x['delta_ce']:+.4f} ± {x['delta_ce_total_se']:.4f}")

    # 4. sweep every checkpoint of the run and its branches into a store
    store = out / "results"
    sweep = qd.from_dict(qd.SweepConfig, {
        "trajectory": {"run": str(run)}, "quantizers": ["rtn3", "gptq3"], "store": str(store),
        "data": {"calib_samples": 8, "calib_seq_len": 64, "eval_windows": 16, "eval_seq_len": 64}})
    done = qd.run_sweep(sweep, progress=False)
    print(f"sweep: {done['written']} rows written over {done['checkpoints']} checkpoints")

    # 5. the rows as a pandas DataFrame, and the HTML report
    df = qd.load_results(store)
    ptq = df[df["kind"] == "ptq"]
    print(ptq.pivot_table(index=["branch", "step"], columns="quantizer", values="delta_ce").round(4))
    page = qd.write_report(store, out / "report")
    print(f"report: {page}")
    return {"run": run, "branches": branches, "result": res, "rows": df, "report": page}


if __name__ == "__main__":
    main()
