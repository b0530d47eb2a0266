"""What the early warning (PTQMonitor warning_every; issue 48.5) costs a training run: the median time of one
warning (a copy of the weights, their difference to the previous copy, three forward passes on 4 held-out windows,
analysis/hessian.curvature_along) against the median training step (forward, backward, AdamW) of
configs/tiny.yaml's model (4 layers, width 128, vocabulary 4096) on 16 x 128 tokens, both measured in this run,
and the share of training time it takes when it runs every N steps: warning / (N x step). Target: <= 2 %.

    .venv/bin/python bench/early_warning_cost.py [--every 50,100] [--threads 1]
"""
from __future__ import annotations

import argparse
import platform
import time

import torch
import torch.nn.functional as F

from quantdyn.models.gpt import GPT, ModelConfig, resolve_model_config
from quantdyn.monitor.ptq import PTQMonitor


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--every", default="50,100")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    vocab = 4096
    model = GPT(resolve_model_config(ModelConfig(vocab_size=vocab, n_layer=4, d_model=128, n_head=4, max_seq_len=512)))
    idx = torch.randint(0, vocab, (16, 129))
    ev = torch.randint(0, vocab, (8, 129))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = PTQMonitor(["rtn4"], eval_ids=ev, every=0, warning_every=1)
    steps, warns = [], []
    for k in range(args.steps):
        t = time.perf_counter()
        logits = model(idx[:, :-1])
        F.cross_entropy(logits.reshape(-1, vocab), idx[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
        steps.append(time.perf_counter() - t)
        t = time.perf_counter()
        out = mon.step(model, k + 1)
        if out:
            warns.append(time.perf_counter() - t)
    step, warn = median(steps[2:]), median(warns[1:] or warns)
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} thread(s)")
    print(f"training step {step:.3f} s (median of {len(steps) - 2}); one warning {warn:.3f} s "
          f"(x{warn / step:.2f} of a step, median of {len(warns[1:] or warns)})")
    for n in (int(x) for x in args.every.split(",")):
        print(f"warning_every={n}: {100 * warn / (n * step):.2f} % of training time")


if __name__ == "__main__":
    main()
