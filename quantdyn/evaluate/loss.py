"""Held-out cross-entropy on cached token windows.

All evaluation in quantdyn goes through :func:`window_losses`: the mean
next-token CE of each window (a row of token ids), so that FP and quantized
models are compared on the same windows (paired) and every aggregate can
carry a standard error over windows.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from quantdyn.models.gpt import logits_of


def autocast_for(device: torch.device, dtype: str = "float32"):
    if dtype in ("bfloat16", "bf16") and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def model_device(model: nn.Module) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def window_ce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token CE per window from logits (B, T, V) and targets (B, T) -> float64 (B,) on the CPU."""
    return ce_of_log_probs(F.log_softmax(logits, -1), y)


def ce_of_log_probs(log_probs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token CE per window from log-probabilities (B, T, V) over the vocabulary (the last, contiguous
    dimension: several times faster than cross_entropy on a (B, V, T) view) -> float64 (B,) on the CPU."""
    return (-log_probs.gather(-1, y.unsqueeze(-1)).squeeze(-1)).mean(1).double().cpu()


@torch.no_grad()
def window_losses(model: nn.Module, windows: torch.Tensor, batch_size: int = 16, dtype: str = "float32") -> torch.Tensor:
    """Mean next-token CE (nats) of each window [n, T] -> float64 tensor [n]."""
    was_training = model.training
    model.eval()
    dev = model_device(model)
    out = []
    try:
        for i in range(0, len(windows), batch_size):
            x = windows[i : i + batch_size].to(dev)
            with autocast_for(dev, dtype):
                logits = logits_of(model, x[:, :-1]).float()
            out.append(window_ce(logits, x[:, 1:]))
    finally:
        model.train(was_training)
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)


def mean_loss(model: nn.Module, windows: torch.Tensor, batch_size: int = 16, dtype: str = "float32") -> float:
    return float(window_losses(model, windows, batch_size, dtype).mean())
