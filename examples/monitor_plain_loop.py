"""Watch a model's post-training-quantization robustness while a plain PyTorch loop trains it.

    python examples/monitor_plain_loop.py [--steps 120] [--every 20] [--out runs/example-plain-loop]

A 2-layer GPT learns the King James Bible (quantdyn's built-in corpus, BPE 512) with AdamW and a
warmup-stable-decay LR; every ``--every`` steps quantdyn.monitor.PTQMonitor quantizes the current weights
with RTN 4/3-bit and GPTQ 3-bit and measures what that costs (Δ CE, relative Δ CE, KL, top-1 agreement)
without touching them. The metrics are printed and written to OUT/metrics.csv, OUT/metrics.jsonl and, with
tensorboardX installed (pip install 'quantdyn[tensorboard]'), TensorBoard event files in OUT/tensorboard.
Runs on a CPU in well under a minute.
"""
from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from quantdyn.data.prepare import DataConfig, prepare_data
from quantdyn.models.gpt import GPT, ModelConfig, resolve_model_config
from quantdyn.monitor import PTQMonitor
from quantdyn.train.loggers import CSVLogger, JsonlLogger, PrintLogger, TensorBoardLogger

DATA = DataConfig(source="builtin:kjv", tokenizer="bpe:512", max_tokens=200_000, bpe_train_chars=400_000)


def wsd(step: int, steps: int, warmup: int = 10, decay: float = 0.3) -> float:
    """LR multiplier: linear warmup, constant, linear decay to 0 over the last ``decay`` of the steps."""
    start = int(steps * (1 - decay))
    if step < warmup:
        return (step + 1) / warmup
    return 1.0 if step < start else max(0.0, (steps - step) / (steps - start))


def main(argv: list[str] | None = None) -> PTQMonitor:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--out", type=Path, default=Path("runs/example-plain-loop"))
    args = ap.parse_args(argv)

    data = prepare_data(DATA, progress=False)
    torch.manual_seed(0)
    model = GPT(resolve_model_config(ModelConfig(n_layer=2, d_model=64, n_head=2, max_seq_len=128), data.vocab_size))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: wsd(s, args.steps))

    loggers = [PrintLogger(prefix="ptq"), CSVLogger(args.out / "metrics.csv", truncate_after=0),
               JsonlLogger(args.out / "metrics.jsonl", truncate_after=0)]
    if importlib.util.find_spec("tensorboardX") or importlib.util.find_spec("tensorboard"):
        loggers.append(TensorBoardLogger(args.out / "tensorboard", truncate_after=0))
    monitor = PTQMonitor(
        ["rtn4", "rtn3", "gptq3"],
        eval_ids=data.split("val"),           # a token stream: cut into eval_windows windows of seq_len
        calib_ids=data.split("calib"),        # seeded windows of seq_len for GPTQ's Hessians
        every=args.every, loggers=loggers, seq_len=64, eval_windows=16, calib_samples=8,
    )

    tokens = torch.from_numpy(np.asarray(data.train, dtype=np.int64))
    T, B = 64, 16
    gen = torch.Generator().manual_seed(0)
    for step in range(1, args.steps + 1):
        starts = torch.randint(0, len(tokens) - T - 1, (B,), generator=gen)
        batch = torch.stack([tokens[s : s + T + 1] for s in starts])
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        monitor.step(model, step, lr=sched.get_last_lr()[0])   # measures at multiples of --every
    monitor.close()
    print(f"train loss {loss.item():.3f}; monitor took {monitor.seconds:.1f}s; metrics in {args.out}")
    return monitor


if __name__ == "__main__":
    main()
