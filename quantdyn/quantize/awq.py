"""AWQ: activation-aware weight quantization (Lin et al. 2024, MLSys), after
the official mit-han-lab/llm-awq ``auto_scale`` / ``auto_clip``.

Input channels with large activations matter more, so before rounding the
weight is scaled per input channel, W' = W diag(s), and the inputs by 1/s.
The scales come from a grid search over alpha in {0, 1/n, ..., (n-1)/n}:

    s = mean|x|^alpha, clamped at 1e-4, normalised by sqrt(max(s) * min(s))

keeping the alpha with the smallest layer output error. Then an optional
clipping search shrinks each (row, group)'s range by (1 - i/n), i < n/2,
keeping the best per group (llm-awq auto_clip), and the scaled weight is
rounded to nearest on the usual grid (quantize/primitives.py).

What quantdyn returns: ``codes/scales/zeros`` quantize W·diag(s) and
``QuantResult.weight = Q(W·diag(s))·diag(s)^-1``, i.e. the 1/s is divided back
out of the dequantized weight, so the model's full-precision function is
untouched and no neighbouring op is modified. ``QuantResult.awq_scales`` is s,
for callers that want the deployable form instead: fold 1/s into the preceding
LayerNorm/linear (:func:`fold_into_norm`) and keep Q(W·diag(s)) as the weight;
both give the same outputs up to float rounding.

Differences from llm-awq, by design: the error is measured per linear layer
from the Hessian statistic H = 2/N sum x x^T (exactly the mean squared output
error over the calibration tokens, with no token subsampling) instead of on
the output of the enclosing module, each layer gets its own s (no sharing
across q/k/v, which the divide-back form makes unnecessary), and the grid is
GPTQ's min-max grid with 0 in range. llm-awq skips clipping for q/k
projections; quantdyn clips every layer when ``awq_clip`` is on.
"""
from __future__ import annotations

import time

import torch

from quantdyn.errors import QuantdynError
from quantdyn.quantize.catalogue import QUANTIZERS, QuantConfig, QuantMethod, compute_dtype
from quantdyn.quantize.gptq import ActStats, stats_from
from quantdyn.quantize.primitives import (
    QuantResult,
    check_group_size,
    check_weight,
    clipped_fraction,
    dequantize_weight,
    layer_loss,
    rtn_weight,
)

CLIP_MAX_SHRINK = 0.5
"""llm-awq auto_clip: the range is shrunk by at most half."""


def _as_stats(x_stats_or_X: ActStats | torch.Tensor) -> ActStats:
    if isinstance(x_stats_or_X, ActStats):
        return x_stats_or_X
    if isinstance(x_stats_or_X, torch.Tensor):
        return stats_from(x_stats_or_X)
    raise QuantdynError("AWQ needs calibration inputs X (tokens, in_features) or their ActStats")


def _output_error(dW: torch.Tensor, H: torch.Tensor) -> float:
    """1/2 tr(dW H dW^T) in float32 (the search's objective)."""
    return 0.5 * float((dW @ H * dW).sum())


def awq_scales(abs_mean: torch.Tensor, alpha: float) -> torch.Tensor:
    """s = mean|x|^alpha clamped at 1e-4, divided by sqrt(max(s) min(s)) (llm-awq)."""
    s = abs_mean.float().pow(alpha).clamp(min=1e-4)
    return s / (s.max() * s.min()).sqrt()


@torch.no_grad()
def awq_search(
    W: torch.Tensor, x_stats_or_X: ActStats | torch.Tensor, cfg: QuantConfig
) -> tuple[torch.Tensor, float, list[float]]:
    """Grid search of the AWQ scales -> (s (in,), best alpha, loss per alpha).

    alpha = 0 gives s = 1, i.e. plain RTN, so the chosen scales never do worse
    than RTN on the calibration objective.
    """
    check_weight(W)
    stats = _as_stats(x_stats_or_X)
    W = W.to(compute_dtype(W))
    H = stats.H.to(W)
    if H.shape != (W.shape[1], W.shape[1]):
        raise QuantdynError(f"AWQ: statistics of width {H.shape[0]} do not match in_features={W.shape[1]}")
    x_mean = stats.abs_mean.to(W)
    losses: list[float] = []
    best = (float("inf"), 0.0, torch.ones_like(x_mean))
    for k in range(cfg.awq_grid):
        alpha = k / cfg.awq_grid
        s = awq_scales(x_mean, alpha)
        W_hat = rtn_weight(W * s, cfg.bits, cfg.sym, cfg.group_size, cfg.mse)[0] / s
        loss = _output_error(W - W_hat, H)
        losses.append(loss)
        if loss < best[0]:
            best = (loss, alpha, s)
    return best[2], best[1], losses


@torch.no_grad()
def awq_clip(Ws: torch.Tensor, Hs: torch.Tensor, cfg: QuantConfig) -> torch.Tensor:
    """Per-(row, group) clipping bound of the scaled weight Ws (out, in) -> (out, n_groups).

    Hs is the Hessian of the scaled inputs (diag(1/s) H diag(1/s)); each group is
    scored by its own block of Hs, as llm-awq scores each group's partial output.
    """
    R, C = Ws.shape
    g = check_group_size(cfg.group_size, C) or C
    starts = list(range(0, C, g))
    org_max = torch.stack([Ws[:, a:a + g].abs().amax(1) for a in starts], 1)  # (R, G)
    best_err = torch.full_like(org_max, float("inf"))
    best_max = org_max.clone()
    for i in range(int(CLIP_MAX_SHRINK * cfg.awq_grid)):
        max_val = org_max * (1 - i / cfg.awq_grid)
        err = torch.empty_like(org_max)
        for k, a in enumerate(starts):
            w = Ws[:, a:a + g]
            m = max_val[:, k:k + 1]
            cur = torch.clamp(w, -m, m)
            q = rtn_weight(cur, cfg.bits, cfg.sym, 0, cfg.mse)[0]
            dW = q - w
            err[:, k] = (dW @ Hs[a:a + g, a:a + g] * dW).sum(1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_max = torch.where(better, max_val, best_max)
    return best_max


@torch.no_grad()
def awq(W: torch.Tensor, x_stats_or_X: ActStats | torch.Tensor, cfg: QuantConfig) -> QuantResult:
    """AWQ-quantize W (out, in): scale search, optional clip search, group RTN of W·diag(s).

    Returns weight = Q(clip(W·diag(s)))·diag(s)^-1 and the scales s in ``awq_scales``.
    """
    t0 = time.perf_counter()
    stats = _as_stats(x_stats_or_X)
    Wc = W.to(compute_dtype(W))
    s, alpha, losses = awq_search(Wc, stats, cfg)
    Ws = Wc * s
    g = check_group_size(cfg.group_size, Wc.shape[1])
    H = stats.H.to(Wc)
    if cfg.awq_clip:
        Hs = H / s[:, None] / s[None, :]
        bound = awq_clip(Ws, Hs, cfg)
        gi = torch.arange(Wc.shape[1], device=Wc.device) // (g or Wc.shape[1])
        m = bound[:, gi]
        Ws = torch.clamp(Ws, -m, m)
    _, codes, scales, zeros, g_idx = rtn_weight(Ws, cfg.bits, cfg.sym, g, cfg.mse)
    weight = dequantize_weight(codes, scales, zeros, g_idx) / s
    seconds = time.perf_counter() - t0
    return QuantResult(
        weight=weight, codes=codes, scales=scales, zeros=zeros, g_idx=g_idx, bits=cfg.bits,
        loss=layer_loss(Wc, weight, H), seconds=seconds,
        diagnostics=dict(
            awq_alpha=alpha, awq_rtn_loss=losses[0], awq_search_loss=min(losses),
            clipped_fraction=clipped_fraction(Wc * s, scales, zeros, g_idx, cfg.bits),
        ),
        awq_scales=s,
    )


def fold_into_norm(
    norm_weight: torch.Tensor, norm_bias: torch.Tensor | None, s: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Deployable AWQ form: the preceding norm's (weight, bias) divided by s, so that
    norm'(x) @ (W·diag(s))^T == norm(x) @ W^T (pair it with weights W·diag(s))."""
    return norm_weight / s, None if norm_bias is None else norm_bias / s


def _awq_entry(W: torch.Tensor, stats: ActStats | None, cfg: QuantConfig) -> QuantResult:
    if stats is None:
        raise QuantdynError("AWQ needs calibration data (activation statistics); pass calibration token ids")
    return awq(W, stats, cfg)


QUANTIZERS.add("awq", QuantMethod(fn=_awq_entry, needs_calibration=True, needs_abs_stats=True))
