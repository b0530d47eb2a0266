"""Quantization primitives: min-max grids, quantize/dequantize, group helpers.

The grid follows the quantizer of the GPTQ reference implementation
(IST-DASLab ``quant.py``, ``Quantizer(perchannel=True)`` applied to weights),
see PAPERS.md "GPTQ reference algorithm":

* per row (output channel) of the slice ``x`` being quantized, take
  ``xmin = min(min x, 0)`` and ``xmax = max(max x, 0)`` (0 is always on the grid);
* symmetric: ``xmax = max(|xmin|, xmax)``, ``xmin = -xmax`` when ``xmin < 0``
  (a row with no negative entry keeps ``xmin = 0``, as the reference does),
  ``zero = (maxq + 1) / 2``;
* rows with ``xmin == xmax == 0`` get ``[-1, 1]``;
* ``scale = (xmax - xmin) / maxq``; asymmetric ``zero = round(-xmin / scale)``;
* code ``q = clamp(round(x / scale) + zero, 0, maxq)``, value ``scale * (q - zero)``.

Optional MSE clipping (reference ``Quantizer(mse=True)``): shrink the range by
``p = 1 - i/grid`` for ``i < maxshrink * grid`` and keep, per row, the ``p``
with the smallest ``sum |Q(x) - x|^norm`` (norm 2.4, grid 100, maxshrink 0.8).

All functions are pure tensor functions; the element-wise operation order
mirrors the reference so results are bit-identical to it in float32.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

import torch

from quantdyn.errors import QuantdynError

MSE_NORM = 2.4
"""Exponent of the clipping-search error (reference default)."""
MSE_GRID = 100
"""Number of shrink steps per unit range (reference default)."""
MSE_MAXSHRINK = 0.8
"""Largest fraction of the range removed by the clipping search (reference default)."""


@dataclass(frozen=True)
class QuantResult:
    """One quantized weight matrix ``W`` of shape (out_features, in_features).

    ``weight == dequantize_weight(codes, scales, zeros, g_idx) / awq_scales``
    (the division only for AWQ); deployment formats set ``format`` and their own fields below.
    """

    weight: torch.Tensor
    """Dequantized weight (out, in), float32 (float64 if the input was)."""
    codes: torch.Tensor
    """Integer codes in [0, 2^bits - 1], uint8 (out, in), original column order."""
    scales: torch.Tensor
    """Grid step per (row, group), (out, n_groups)."""
    zeros: torch.Tensor
    """Integer zero point per (row, group) stored as float, (out, n_groups)."""
    g_idx: torch.Tensor
    """Group of every input column, int32 (in,)."""
    bits: int
    """Bit width of the codes."""
    loss: float | None = None
    """Layer reconstruction loss. GPTQ: the reference's accumulated
    ``sum (w - q)^2 / (2 [H^-1]_ii^2)`` (= 1/2 tr(dW H_damped dW^T)); RTN/AWQ with a
    Hessian: 1/2 tr(dW H dW^T); None without one. Use :func:`layer_loss` to compare methods."""
    seconds: float = 0.0
    """Wall time of the algorithm."""
    diagnostics: dict = field(default_factory=dict)
    """Extra numbers: damp used, dead columns, clipped fraction, AWQ alpha, ..."""
    perm: torch.Tensor | None = None
    """Column order used by act-order / group-aware reordering (None = natural order)."""
    awq_scales: torch.Tensor | None = None
    """AWQ per-input-channel scales s (in,): codes quantize W·diag(s)."""
    rotation_seed: int | None = None
    """Set when the input features were rotated first (``+had``, quantize/rotation.py): codes, scales, zeros
    quantize W R, and ``weight`` is their dequantized value rotated back, Q(W R) Rᵀ (the layer's function)."""
    format: str | None = None
    """Deployment formats: the stored type (``q4_K``, ``fp8_e4m3``, ``nf4``, ``mxfp4``, ``nvfp4``); None for the
    integer grid above."""
    codebook: torch.Tensor | None = None
    """Float formats: the value of every code, so that ``weight == scales[:, g_idx] * codebook[codes]``
    (``zeros`` are 0). None: the integer grid (for GGUF types with a minimum, ``zeros`` = min / scale, real)."""
    storage: dict | None = None
    """Deployment formats: their stored fields besides the codes, as the format stores them (GGUF block scales,
    E8M0/E4M3 scale bytes, NF4's double-quantized absmax ...); exporters read these."""
    bits_per_weight: float | None = None
    """Storage bits per weight with the scales, as the format stores it (None: see
    ``quantize.catalogue.grid_bits_per_weight``)."""


# ----------------------------------------------------------------------------- threads


@contextlib.contextmanager
def num_threads(n: int | None) -> Iterator[None]:
    """Temporarily set torch's intra-op thread count (None or 0 = leave as is).

    The GPTQ column loop is a long chain of small kernels; on a few CPU cores
    it runs faster on one thread (see bench/gptq_speed.py).
    """
    if not n:
        yield
        return
    if n < 0:
        raise QuantdynError(f"num_threads={n} must be >= 0 (0 = leave torch's setting)")
    old = torch.get_num_threads()
    torch.set_num_threads(int(n))
    try:
        yield
    finally:
        torch.set_num_threads(old)


# ----------------------------------------------------------------------------- validation


def check_bits(bits: int) -> int:
    """Return maxq = 2^bits - 1 for 2 <= bits <= 8, else a QuantdynError."""
    if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 8:
        raise QuantdynError(f"bits={bits!r} is not supported; choose an integer from 2 to 8")
    return 2**bits - 1


def all_finite(t: torch.Tensor) -> bool:
    """Whether every entry of ``t`` is finite, exactly, at a fraction of ``torch.isfinite(t).all()``'s cost on a
    CPU (one reduction, no boolean tensor; the engine checks every weight and calibration batch): a NaN or an
    infinity makes the sum NaN or infinite, so a finite sum means finite entries; only a sum that overflowed (or a
    non-finite entry) takes the element-wise check."""
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def check_weight(W: torch.Tensor, what: str = "weight") -> None:
    if W.dim() != 2:
        raise QuantdynError(f"{what} must be a 2-D (out_features, in_features) matrix, got shape {tuple(W.shape)}")
    if W.numel() == 0:
        raise QuantdynError(f"{what} is empty (shape {tuple(W.shape)}); nothing to quantize")
    if not all_finite(W):
        raise QuantdynError(f"{what} contains NaN or Inf; fix the checkpoint before quantizing")


def check_group_size(group_size: int | None, columns: int) -> int:
    """Normalise group_size (None/0/-1 -> 0 = one group per row)."""
    g = 0 if group_size in (None, -1) else int(group_size)
    if g < 0:
        raise QuantdynError(f"group_size={group_size} must be positive, or 0 for one group per row")
    if g >= columns:
        return 0 if g == columns else g  # one group spanning the row
    return g


def group_index(columns: int, group_size: int, device=None) -> torch.Tensor:
    """g_idx for natural order: column j belongs to group j // group_size (int32)."""
    if not group_size:
        return torch.zeros(columns, dtype=torch.int32, device=device)
    return (torch.arange(columns, device=device) // group_size).to(torch.int32)


def n_groups(columns: int, group_size: int) -> int:
    return 1 if not group_size else -(-columns // group_size)


# ----------------------------------------------------------------------------- grid


def find_params(
    x: torch.Tensor, bits: int, sym: bool, mse: bool = False,
    norm: float = MSE_NORM, grid: int = MSE_GRID, maxshrink: float = MSE_MAXSHRINK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (scale, zero) of the min-max grid of ``x`` (rows, cols); both (rows,).

    Same semantics and operation order as the reference ``Quantizer.find_params``
    with ``perchannel=True, weight=True``.
    """
    # maxq divides as a tensor on x's device, like the reference's 0-dim device tensor: a Python number would take
    # CUDA's "divide by a CPU scalar" path, which multiplies by its reciprocal and is 1 ulp off the IEEE quotient
    # (measured on an H100, 2026-11-24: 69 % of RTN scales differed by one ulp). full_like is a fill kernel: no
    # host-to-device copy, so no stream sync per call (QAT's forward makes one per linear).
    maxq = check_bits(bits)
    zeros_ = torch.zeros(x.shape[0], device=x.device, dtype=x.dtype)
    xmin = torch.minimum(x.min(1)[0], zeros_)
    xmax = torch.maximum(x.max(1)[0], zeros_)
    if sym:
        xmax = torch.maximum(torch.abs(xmin), xmax)
        xmin = torch.where(xmin < 0, -xmax, xmin)
    both0 = (xmin == 0) & (xmax == 0)
    xmin = torch.where(both0, torch.full_like(xmin, -1), xmin)
    xmax = torch.where(both0, torch.full_like(xmax, 1), xmax)
    maxq_t = torch.full_like(xmax, maxq)
    scale = (xmax - xmin) / maxq_t
    if sym:
        zero = torch.full_like(scale, (maxq + 1) / 2)
    else:
        zero = torch.round(-xmin / scale)
    if mse:
        best = torch.full([x.shape[0]], float("inf"), device=x.device, dtype=x.dtype)
        for i in range(int(maxshrink * grid)):
            p = 1 - i / grid
            xmin1 = p * xmin
            xmax1 = p * xmax
            scale1 = (xmax1 - xmin1) / maxq_t
            zero1 = torch.round(-xmin1 / scale1) if not sym else zero
            q = fake_quantize(x, scale1.unsqueeze(1), zero1.unsqueeze(1), maxq)
            q -= x
            q.abs_()
            q.pow_(norm)
            err = torch.sum(q, 1)
            better = err < best
            best = torch.where(better, err, best)
            scale = torch.where(better, scale1, scale)
            zero = torch.where(better, zero1, zero)
    return scale, zero


def quantize_codes(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int) -> torch.Tensor:
    """Integer codes clamp(round(x / scale) + zero, 0, maxq), as floats (broadcasting)."""
    return torch.clamp(torch.round(x / scale) + zero, 0, maxq)


def dequantize_codes(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Values scale * (q - zero); the exact inverse of :func:`quantize_codes` on the grid."""
    return scale * (q.to(scale.dtype) - zero)


def fake_quantize(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int) -> torch.Tensor:
    """Quantize then dequantize (the reference ``quantize``)."""
    return dequantize_codes(quantize_codes(x, scale, zero, maxq), scale, zero)


# ----------------------------------------------------------------------------- whole weights


def group_params(
    W: torch.Tensor, bits: int, sym: bool, group_size: int, mse: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales, zeros), each (rows, n_groups), from contiguous column groups of W.

    ``group_size`` 0 gives one group per row; a last partial group is allowed.
    """
    cols = W.shape[1]
    g = group_size or cols
    pairs = [find_params(W[:, i:i + g], bits, sym, mse) for i in range(0, cols, g)]
    return torch.stack([p[0] for p in pairs], 1), torch.stack([p[1] for p in pairs], 1)


def quantize_weight(
    W: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor, bits: int
) -> torch.Tensor:
    """uint8 codes of W (rows, cols) given per-(row, group) grids and each column's group."""
    gi = g_idx.long()
    return quantize_codes(W, scales[:, gi], zeros[:, gi], check_bits(bits)).to(torch.uint8)


def dequantize_weight(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor
) -> torch.Tensor:
    """W_hat = scale[:, g] * (code - zero[:, g]) for every column's group g."""
    gi = g_idx.long()
    return dequantize_codes(codes, scales[:, gi], zeros[:, gi])


def layer_loss(W: torch.Tensor, W_hat: torch.Tensor, H: torch.Tensor, block: int = 1024) -> float:
    """1/2 tr((W - W_hat) H (W - W_hat)^T): with H = 2/N sum x x^T, the mean over the
    N calibration samples of the summed squared output error ||(W - W_hat) x||^2.

    Computed in float64 on ``block`` x ``block`` tiles (rows of dW, columns of H): besides the inputs it holds
    two block-wide float64 slices, never a float64 copy of H (in² x 8 bytes: 6 GB for a 27,648-wide layer)."""
    total = 0.0
    for i in range(0, W.shape[0], block):
        dW = W[i:i + block].double() - W_hat[i:i + block].double()
        for j in range(0, H.shape[1], block):
            total += float((dW @ H[:, j:j + block].double()).mul_(dW[:, j:j + block]).sum())
    return 0.5 * total


def clipped_fraction(W: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor, bits: int) -> float:
    """Fraction of entries of W whose unclamped code falls outside [0, maxq]."""
    gi = g_idx.long()
    raw = torch.round(W / scales[:, gi]) + zeros[:, gi]
    return float(((raw < 0) | (raw > check_bits(bits))).float().mean())


def rtn_weight(
    W: torch.Tensor, bits: int, sym: bool, group_size: int, mse: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest of W on static groups -> (W_hat, codes, scales, zeros, g_idx)."""
    check_weight(W)
    g = check_group_size(group_size, W.shape[1])
    scales, zeros = group_params(W, bits, sym, g, mse)
    g_idx = group_index(W.shape[1], g, W.device)
    codes = quantize_weight(W, scales, zeros, g_idx, bits)
    return dequantize_weight(codes, scales, zeros, g_idx), codes, scales, zeros, g_idx
