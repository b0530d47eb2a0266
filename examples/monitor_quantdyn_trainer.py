"""The PTQ monitor in quantdyn's own trainer, as a Python call (the CLI does the same from a config:
``quantdyn train configs/tiny.yaml monitor.every=20 'monitor.quantizers=[rtn4,gptq3]'``).

    python examples/monitor_quantdyn_trainer.py [--steps 60] [--every 20] [--out runs]

``train(cfg, hooks=[monitor])`` calls the same PTQMonitor as a plain loop would, on the main process
(gathering the weights first under FSDP2), and logs its metrics with the step's row to every destination of
``cfg.log.to`` — here metrics.jsonl and metrics.csv in OUT/example-quantdyn-trainer, plus TensorBoard when
tensorboardX is installed. Runs on a CPU in well under a minute.
"""
from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from quantdyn.config import from_dict, to_dict
from quantdyn.data.prepare import DataConfig, prepare_data
from quantdyn.monitor import PTQMonitor
from quantdyn.train.config import RunConfig
from quantdyn.train.trainer import train

DATA = DataConfig(source="builtin:kjv", tokenizer="bpe:512", max_tokens=200_000, bpe_train_chars=400_000)


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--out", type=Path, default=Path("runs"))
    args = ap.parse_args(argv)

    tb = ["tensorboard"] if importlib.util.find_spec("tensorboardX") or importlib.util.find_spec("tensorboard") else []
    cfg = from_dict(RunConfig, {
        "name": "example-quantdyn-trainer", "out_dir": str(args.out), "seed": 0,
        "model": {"n_layer": 2, "d_model": 64, "n_head": 2, "max_seq_len": 128},
        "data": to_dict(DATA),
        "schedule": {"name": "wsd", "warmup": 5, "decay": 0.3},
        "train": {"steps": args.steps, "batch_size": 16, "seq_len": 64, "eval_every": args.every, "eval_windows": 16,
                  "checkpoint_every": 0, "log_every": 10},
        "log": {"to": ["jsonl", "csv", *tb]},
    })
    data = prepare_data(cfg.data, progress=False)
    monitor = PTQMonitor(["rtn4", "gptq3"], eval_ids=data.split("val"), calib_ids=data.split("calib"),
                         every=args.every, seq_len=64, eval_windows=16, calib_samples=8)
    run = train(cfg, hooks=[monitor], overwrite=True)
    print(f"run directory: {run}; the monitor took {monitor.seconds:.1f}s")
    return run


if __name__ == "__main__":
    main()
