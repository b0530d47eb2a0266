"""Sharpness-aware minimisation (SAM) and its adaptive variant (ASAM) around any element-wise optimizer.

SAM (Foret et al., 2021, "Sharpness-Aware Minimization for Efficiently Improving Generalization", eq. 2 and
Algorithm 1) takes, at weights w with mini-batch loss L:

    g   = ∇L(w)
    ε   = ρ g / ‖g‖₂                          (the first-order worst case in a ρ-ball)
    g_S = ∇L(w + ε)                           (same mini-batch)
    w  ← base optimizer step from w with gradient g_S

ASAM (Kwon et al., 2021, "ASAM: Adaptive Sharpness-Aware Minimization for Scale-Invariant Learning", eq. 7, with
the normalisation operator T_w = |w| element-wise, as in the widely used reference implementation of both
papers) replaces the ball by one scaled by the weights:

    ε = ρ T_w² g / ‖T_w g‖₂

so a weight's perturbation grows with its magnitude (scale invariance). ‖·‖₂ is over *all* parameters that have a
gradient (one global norm, as both papers). The perturbation is undone by restoring a copy of the weights, bit
for bit, not by subtracting ε.

This module is pure over parameter lists; the trainer (train/trainer.py, ``optimizer_step``) runs the two
forward/backward passes and says what a SAM step costs (two forward/backward passes per step, in run.json).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import torch

_TINY = 1e-12  # added to the norm, as in both papers' code: a zero gradient gives ε = 0, not NaN


def _global_norm(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """‖(t₁, …, t_n)‖₂ over all tensors, float32 or wider; a DTensor's partial norms are gathered."""
    total = torch.nn.utils.get_total_norm(list(tensors), norm_type=2.0)
    if hasattr(total, "full_tensor"):  # FSDP2: a DTensor holding the shards' partial norms
        total = total.full_tensor()
    return total


@torch.no_grad()
def sam_perturbation(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], rho: float,
                     adaptive: bool) -> list[torch.Tensor]:
    """ε for each parameter (SAM: ρ g/‖g‖; ASAM: ρ |w|² g/‖|w| g‖), from the gradients at the current weights."""
    if adaptive:
        scaled = [p.abs() * g for p, g in zip(params, grads)]
        norm = _global_norm(scaled)
        return [(p * p) * g * (rho / (norm + _TINY)).to(g.dtype) for p, g in zip(params, grads)]
    norm = _global_norm(grads)
    return [g * (rho / (norm + _TINY)).to(g.dtype) for g in grads]


@contextmanager
def perturbed(params: Sequence[torch.nn.Parameter], rho: float, adaptive: bool) -> Iterator[None]:
    """Inside: the weights moved to w + ε (ε from the gradients they hold now, which are then cleared so that
    the caller's backward writes ∇L(w + ε)). On exit: the original weights restored exactly; the gradients
    written inside stay (they are the SAM gradient the optimizer then uses)."""
    with_grad = [p for p in params if p.grad is not None]
    eps = sam_perturbation(with_grad, [p.grad for p in with_grad], rho, adaptive)
    saved = [p.detach().clone() for p in with_grad]
    with torch.no_grad():
        for p, e in zip(with_grad, eps):
            p.add_(e)
    for p in params:
        p.grad = None
    try:
        yield
    finally:
        with torch.no_grad():
            for p, w in zip(with_grad, saved):
                p.copy_(w)
