"""What format QAT (qat.format; issue 48.2) adds to a training step: the median time of a forward, backward and
AdamW step of configs/tiny.yaml's model (4 layers, width 128, vocabulary 4096) on 16 x 128 tokens, in full
precision and with each format's straight-through fake quantization of the block linears (Q(W) computed once per
step, train/qat.py). One thread; 10 timed steps after 2 warm-up steps, repeated ``--reps`` times.

    .venv/bin/python bench/qat_format_step.py [--formats rtn4,q4_k,nvfp4] [--reps 2]
"""
from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.nn.functional as F

from quantdyn.models.gpt import GPT, ModelConfig, resolve_model_config
from quantdyn.train.qat import QATConfig, prepare_qat


def median_step(model: torch.nn.Module, idx: torch.Tensor, vocab: int, n: int = 12) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    for _ in range(n):
        t = time.perf_counter()
        logits = model(idx[:, :-1])
        F.cross_entropy(logits.reshape(-1, vocab), idx[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t)
    times = sorted(times[2:])
    return times[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="rtn4,q4_k,nvfp4")
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    vocab = 4096
    base = GPT(resolve_model_config(ModelConfig(vocab_size=vocab, n_layer=4, d_model=128, n_head=4, max_seq_len=512)))
    idx = torch.randint(0, vocab, (16, 129))
    labels = ["fp", *args.formats.split(",")]
    res: dict[str, list[float]] = {}
    for _ in range(args.reps):
        for label in labels:
            m = copy.deepcopy(base)
            if label != "fp":
                prepare_qat(m, QATConfig(format=label))
            res.setdefault(label, []).append(median_step(m, idx, vocab))
    for label, v in res.items():
        print(f"{label:8s} median step {', '.join(f'{x:.3f}' for x in v)} s   x{min(v) / min(res['fp']):.2f} of fp")


if __name__ == "__main__":
    main()
