"""Seconds per training step for every registered optimizer, relative to AdamW.

Model: quantdyn GPT with the pythia-14m shape (6 layers, d 128, vocab 50304);
batch 4 x 128 tokens; cross-entropy on random tokens.  For each device (CPU,
and CUDA when available) and optimizer: build the model from the same seed,
run ``--warmup`` steps, then time ``--steps`` steps (full step = forward +
backward + optimizer.step(); the optimizer.step() alone is timed too).  The
default 20 timed steps include one Shampoo preconditioner recomputation (every
20 steps) and two SOAP eigenbasis updates (every 10), so their amortised cost
is in the numbers.

    .venv/bin/python bench/optimizer_step.py [--steps 20] [--warmup 3] [--optimizers adamw,muon]
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import torch
import torch.nn.functional as F

from quantdyn.models.gpt import GPT, ModelConfig, resolve_model_config
from quantdyn.train.optimizers import OPTIMIZERS, OptimConfig, build_optimizer


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_optimizer(name: str, device: str, steps: int, warmup: int, batch: int, seq: int) -> dict:
    torch.manual_seed(0)
    cfg = resolve_model_config(ModelConfig(preset="pythia-14m"))
    model = GPT(cfg).to(device)
    opt = build_optimizer(model, OptimConfig(name=name))
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=gen).to(device)
               for _ in range(warmup + steps)]
    step_s, opt_s = [], []
    for i, idx in enumerate(batches):
        _sync(device)
        t0 = time.perf_counter()
        logits = model(idx[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), idx[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        _sync(device)
        t1 = time.perf_counter()
        opt.step()
        _sync(device)
        t2 = time.perf_counter()
        if i >= warmup:
            step_s.append(t2 - t0)
            opt_s.append(t2 - t1)
    return dict(optimizer=name, device=device, step_s=sum(step_s) / steps, opt_step_s=sum(opt_s) / steps,
                max_opt_step_s=max(opt_s), final_loss=loss.item())


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS.names()))
    ap.add_argument("--devices", default="cpu,cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    ap.add_argument("--quick", action="store_true", help="3 timed steps after 1 warm-up step")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.warmup = 3, 1
    names = [n for n in args.optimizers.split(",") if n]
    if "adamw" not in names:
        names.insert(0, "adamw")
    names = ["adamw"] + [n for n in names if n != "adamw"]
    rows = []
    print(f"# torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"threads {torch.get_num_threads()}, pythia-14m shape, batch {args.batch} x {args.seq}, "
          f"{args.steps} timed steps after {args.warmup} warmup")
    for device in args.devices.split(","):
        print(f"\n[{device}]  {'optimizer':<20}{'step s':>9}{'x AdamW':>9}{'opt.step s':>12}{'x AdamW':>9}"
              f"{'max opt s':>11}", flush=True)
        base = None
        for n in names:
            r = time_optimizer(n, device, args.steps, args.warmup, args.batch, args.seq)
            base = base or r
            rows.append(r)
            r["step_ratio"] = r["step_s"] / base["step_s"]
            r["opt_step_ratio"] = r["opt_step_s"] / base["opt_step_s"]
            print(f"[{device}]  {r['optimizer']:<20}{r['step_s']:>9.4f}{r['step_ratio']:>9.2f}"
                  f"{r['opt_step_s']:>12.4f}{r['opt_step_ratio']:>9.2f}{r['max_opt_step_s']:>11.4f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    try:
        from common import record  # bench/common.py, when run as bench/optimizer_step.py
    except ImportError:
        return rows
    record("optimizer_step", {"rows": rows}, args)
    return rows


if __name__ == "__main__":
    main()
