"""Weight averaging: LAWA, EMA and soups as pure functions over state dicts,
plus the online averagers the trainer updates.

LAWA (Kaddour 2022; Sanyal et al. 2023): uniform average of the last K
snapshots taken every P steps.  EMA: ``e_t = d·e_{t-1} + (1-d)·w_t`` from
``e_0 = 0`` with bias correction ``ê_t = e_t / (1 - d^t)`` (so ê_1 = w_1).
Averages are accumulated in float64 on the CPU and cast back.
"""
from __future__ import annotations

from collections import deque
from typing import Sequence

import torch

StateDict = dict[str, torch.Tensor]


def local_state_dict(model: torch.nn.Module) -> StateDict:
    """``model.state_dict()`` with every sharded tensor (an FSDP2 DTensor) replaced by this
    process's shard: what the online averagers keep, so their memory is sharded like the model's."""
    return {k: v.to_local() if hasattr(v, "to_local") else v for k, v in model.state_dict().items()}


def weighted_average(states: Sequence[StateDict], weights: Sequence[float] | None = None) -> StateDict:
    """Σ w_i·θ_i / Σ w_i over state dicts (non-float tensors taken from the last)."""
    if not states:
        raise ValueError("weighted_average needs at least one state dict")
    w = [1.0] * len(states) if weights is None else [float(x) for x in weights]
    if len(w) != len(states) or sum(w) <= 0 or any(x < 0 for x in w):
        raise ValueError("weights must be non-negative, one per state, with a positive sum")
    total = sum(w)
    keys = set(states[0])
    for s in states[1:]:
        if set(s) != keys:
            raise ValueError("state dicts to average have different parameter names (different architectures?)")
    out: StateDict = {}
    for k, v0 in states[-1].items():
        if torch.is_floating_point(v0):
            acc = torch.zeros(v0.shape, dtype=torch.float64)
            for s, wi in zip(states, w):
                acc += s[k].detach().to("cpu", torch.float64) * (wi / total)
            out[k] = acc.to(v0.dtype)
        else:
            out[k] = v0.detach().cpu().clone()
    return out


def interpolate(a: StateDict, b: StateDict, alpha: float) -> StateDict:
    """(1 - α)·a + α·b."""
    return weighted_average([a, b], [1.0 - alpha, alpha]) if 0 < alpha < 1 else (
        {k: v.detach().cpu().clone() for k, v in (a if alpha == 0 else b).items()}
    )


def lawa_steps(step: int, window: int, every: int) -> list[int]:
    """Snapshot steps averaged by LAWA at ``step``: step, step-P, ..., (K of them, > 0)."""
    return [s for s in (step - i * every for i in range(window)) if s > 0][::-1]


class OnlineLAWA:
    """Ring buffer of the last K snapshots, kept on the CPU (under FSDP2: each process's shards)."""

    def __init__(self, window: int, every: int):
        self.window, self.every = window, every
        self.buffer: deque[tuple[int, StateDict]] = deque(maxlen=window)

    def update(self, step: int, model: torch.nn.Module) -> None:
        if step % self.every == 0:
            self.buffer.append((step, {k: v.detach().to("cpu", copy=True) for k, v in local_state_dict(model).items()}))

    def ready(self) -> bool:
        return len(self.buffer) > 0

    def average(self) -> StateDict:
        return weighted_average([s for _, s in self.buffer])

    def steps(self) -> list[int]:
        return [s for s, _ in self.buffer]

    def state_dict(self) -> dict:
        return {"steps": self.steps(), "states": [s for _, s in self.buffer]}

    def load_state_dict(self, d: dict) -> None:
        self.buffer.clear()
        for s, sd in zip(d["steps"], d["states"]):
            self.buffer.append((int(s), sd))


class OnlineEMA:
    """Bias-corrected EMA of the weights (float64 accumulator on the CPU; under FSDP2 each process
    accumulates its own shards)."""

    def __init__(self, decay: float):
        self.decay = decay
        self.t = 0
        self.acc: StateDict = {}

    def update(self, model: torch.nn.Module) -> None:
        self.t += 1
        for k, v in local_state_dict(model).items():
            if not torch.is_floating_point(v):
                continue
            x = v.detach().to("cpu", torch.float64)
            if k not in self.acc:
                self.acc[k] = torch.zeros_like(x)
            self.acc[k].mul_(self.decay).add_(x, alpha=1.0 - self.decay)

    def average(self, like: StateDict) -> StateDict:
        corr = 1.0 - self.decay**self.t
        return {
            k: (self.acc[k] / corr).to(v.dtype) if k in self.acc else v.detach().cpu().clone()
            for k, v in like.items()
        }

    def state_dict(self) -> dict:
        return {"decay": self.decay, "t": self.t, "acc": self.acc}

    def load_state_dict(self, d: dict) -> None:
        self.decay, self.t, self.acc = float(d["decay"]), int(d["t"]), dict(d["acc"])
