"""The PTQ monitor inside a Hugging Face ``transformers.Trainer``.

    python examples/monitor_hf_trainer.py [--steps 60] [--every 20] [--out runs/example-hf-trainer]

A tiny GPTNeoXForCausalLM (transformers' own model class) trains on the King James Bible with the
Trainer's warmup-stable-decay schedule; ``PTQMonitorCallback(monitor).add_to(trainer)`` measures RTN 4-bit
and GPTQ 3-bit on the current weights every ``--every`` steps. The metrics appear where the Trainer reports
(its console log; TensorBoard in OUT/runs when tensorboardX is installed, as train/ptq/<quantizer>/...), in
OUT/trainer_state.json's log history, and in the monitor's own CSV (OUT/ptq.csv, exact shared names).
Runs on a CPU in well under a minute.
"""
from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import numpy as np
import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, Trainer, TrainingArguments

from quantdyn.data.prepare import DataConfig, prepare_data
from quantdyn.monitor import PTQMonitor
from quantdyn.monitor.hf import PTQMonitorCallback
from quantdyn.train.loggers import CSVLogger

DATA = DataConfig(source="builtin:kjv", tokenizer="bpe:512", max_tokens=200_000, bpe_train_chars=400_000)


class Windows(torch.utils.data.Dataset):
    """Random windows of seq_len tokens from a token stream (inputs = labels; the model shifts them)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, n: int, seed: int = 0):
        self.tokens, self.seq_len = tokens, seq_len
        self.starts = np.random.default_rng(seed).integers(0, len(tokens) - seq_len, size=n)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict:
        ids = torch.from_numpy(np.asarray(self.tokens[self.starts[i] : self.starts[i] + self.seq_len], dtype=np.int64))
        return {"input_ids": ids, "labels": ids}


def main(argv: list[str] | None = None) -> tuple[Trainer, PTQMonitor]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--out", type=Path, default=Path("runs/example-hf-trainer"))
    args = ap.parse_args(argv)

    data = prepare_data(DATA, progress=False)
    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(GPTNeoXConfig(
        vocab_size=data.vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=256, max_position_embeddings=128))
    batch = 16
    train = Windows(data.train, 64, args.steps * batch)
    report = ["tensorboard"] if importlib.util.find_spec("tensorboardX") or importlib.util.find_spec("tensorboard") else []
    targs = TrainingArguments(
        output_dir=str(args.out), max_steps=args.steps, per_device_train_batch_size=batch, learning_rate=3e-3,
        lr_scheduler_type="warmup_stable_decay",
        lr_scheduler_kwargs={"num_decay_steps": args.steps // 3},
        warmup_steps=5, weight_decay=0.1, logging_steps=10, save_strategy="no", report_to=report, use_cpu=True,
        disable_tqdm=True, dataloader_num_workers=0, seed=0)
    monitor = PTQMonitor(["rtn4", "gptq3"], eval_ids=data.split("val"), calib_ids=data.split("calib"),
                         every=args.every, loggers=[CSVLogger(args.out / "ptq.csv", truncate_after=0)],
                         seq_len=64, eval_windows=16, calib_samples=8)
    trainer = Trainer(model=model, args=targs, train_dataset=train)
    PTQMonitorCallback(monitor).add_to(trainer)  # first, so the Trainer's report_to integrations see the metrics
    trainer.train()
    trainer.save_state()
    monitor.close()
    return trainer, monitor


if __name__ == "__main__":
    main()
