"""Round-to-nearest (RTN): every weight to its nearest grid point.

Grids are min-max per output row, or per (row, group of ``group_size``
consecutive input columns), computed from the weights themselves (optionally
with the MSE clipping search); see quantize/primitives.py for the grid.
"""
from __future__ import annotations

import time

import torch

from quantdyn.errors import QuantdynError
from quantdyn.quantize.catalogue import QUANTIZERS, QuantConfig, QuantMethod, compute_dtype
from quantdyn.quantize.primitives import QuantResult, clipped_fraction, layer_loss, rtn_weight


def rtn(W: torch.Tensor, cfg: QuantConfig, H: torch.Tensor | None = None) -> QuantResult:
    """Quantize W (out, in) by round-to-nearest; with a Hessian H (in, in) also report the loss."""
    t0 = time.perf_counter()
    Wc = W.to(compute_dtype(W))
    W_hat, codes, scales, zeros, g_idx = rtn_weight(Wc, cfg.bits, cfg.sym, cfg.group_size, cfg.mse)
    seconds = time.perf_counter() - t0
    if H is not None and H.shape != (W.shape[1], W.shape[1]):
        raise QuantdynError(f"RTN: Hessian of shape {tuple(H.shape)} does not match in_features={W.shape[1]}")
    return QuantResult(
        weight=W_hat, codes=codes, scales=scales, zeros=zeros, g_idx=g_idx, bits=cfg.bits,
        loss=None if H is None else layer_loss(Wc, W_hat, H),
        seconds=seconds,
        diagnostics=dict(clipped_fraction=clipped_fraction(Wc, scales, zeros, g_idx, cfg.bits)),
    )


def _rtn_entry(W: torch.Tensor, stats, cfg: QuantConfig) -> QuantResult:
    return rtn(W, cfg, None if stats is None else stats.H)


QUANTIZERS.add("rtn", QuantMethod(fn=_rtn_entry, needs_calibration=False))
