"""ggml's float32 arithmetic and scale searches, vectorised over blocks: the numerics every GGUF block type
(``quantize.gguf``) is built from.

Reference: ggml's ``ggml-quants.c`` (``nearest_int``, ``make_qx_quants``, ``make_q3_quants``,
``make_qkx2_quants`` / ``make_qkx3_quants``, ``make_qp_quants``), read at llama.cpp commit 0c1e570
(2026-10-01). No ggml code is used here; every function is a vectorised re-derivation that makes the same
decisions in the same float32 arithmetic.

Exactness
---------
ggml works block by block in scalar float32 C compiled without FMA contraction (ggml-base is built for the
baseline ISA). Here every block is processed at once, element-major (n, blocks) (:func:`blocks`), and every
sum the reference accumulates in a loop is accumulated in the same left-to-right order (:func:`seq_sum`), so
that each product, sum and comparison is the same IEEE float32 operation as in C. ``nearest_int`` is emulated
with its own magic-number trick and the C conversions to ``uint8_t``/``int8_t`` wrap as they do in C.
"""
from __future__ import annotations

import numpy as np
import torch

GROUP_MAX_EPS = float(np.float32(1e-15))
"""ggml's threshold under which a group counts as all zero."""

F32 = torch.float32


# ----------------------------------------------------------------------------- float32 arithmetic as in C


def c32(value: float) -> torch.Tensor:
    """A float32 constant (0-dim tensor), so that no operation with it runs in float64."""
    return torch.tensor(np.float32(value), dtype=F32)


def seq_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over dim 0 of an element-major (n, blocks) tensor, left to right in float32, as a C loop
    ``for (i...) s += t[i]`` does (torch's own reductions sum in another order)."""
    acc = t[0]
    for i in range(1, t.shape[0]):
        acc = acc + t[i]
    return acc


def nearest_int(x: torch.Tensor) -> torch.Tensor:
    """ggml's ``nearest_int``: add 1.5 * 2^23 in float32 and read the low mantissa bits (round half to even
    for |x| < 2^22, and the same garbage as C beyond). Returns float32 integer values."""
    v = (x + c32(12582912.0)).view(torch.int32)
    return ((v & 0x007FFFFF) - 0x00400000).to(F32)


def roundf(x: torch.Tensor) -> torch.Tensor:
    """C ``roundf``: half away from zero (exact: x - trunc(x) is exact in float)."""
    r = torch.trunc(x)
    return r + torch.sign(x) * ((x - r).abs() >= 0.5).to(F32)


def sqrtf(x: torch.Tensor) -> torch.Tensor:
    """C ``sqrtf`` (correctly rounded). torch's vectorised float32 sqrt is not correctly rounded on every CPU
    (measured: off by one ulp with AVX-512); the float64 root rounded to float32 is, since 53 >= 2 * 24 + 2."""
    return torch.sqrt(x.double()).float()


def max0(v: torch.Tensor) -> torch.Tensor:
    """``m = 0; if (v > m) m = v`` over the last dim: the largest value if positive, else +0 (never -0)."""
    m = v.max(-1).values
    return torch.where(m > 0, m, torch.zeros_like(m))


def fp16(x: torch.Tensor) -> torch.Tensor:
    """GGML_FP32_TO_FP16 (round to nearest even) as float16."""
    return x.to(torch.float16)


def u8(x: torch.Tensor) -> torch.Tensor:
    """C conversion of an int to ``uint8_t`` (wraps modulo 256), as float32."""
    return torch.remainder(x, 256)


def i8(x: torch.Tensor) -> torch.Tensor:
    """C conversion of an int to ``int8_t`` (wraps into [-128, 127]), as float32."""
    return torch.remainder(x + 128, 256) - 128


def first_absmax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(amax, value with that |value|, the first such in the block) per block of element-major x."""
    ax = x.abs()
    idx = ax.argmax(0, keepdim=True)  # first maximal index, as the C loop's strict '<'
    return ax.gather(0, idx)[0], x.gather(0, idx)[0]


def where(mask, a, b):
    return torch.where(mask, a, b)


# ----------------------------------------------------------------------------- ggml's scale searches


def make_qx_quants(x: torch.Tensor, nmax: int, w: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``make_qx_quants(n, nmax, x, L, rmse_type=1, qw)`` on element-major x (n, B): weighted least-squares
    symmetric scale over 19 candidate grids. Returns (scale (B,), L (n, B) in [0, 2 nmax - 1])."""
    amax, mx = first_absmax(x)
    zero = amax < GROUP_MAX_EPS
    mx = where(zero, torch.ones_like(mx), mx)
    w = x * x if w is None else w
    wx = w * x

    def levels(iscale):
        return torch.clamp(nearest_int(iscale * x), -nmax, nmax - 1)

    lv = levels(c32(-nmax) / mx)
    sumlx, suml2 = seq_sum(wx * lv), seq_sum((w * lv) * lv)
    scale = where(suml2 != 0, sumlx / suml2, torch.zeros_like(sumlx))
    best = scale * sumlx
    L = lv
    for step in range(-9, 10):
        if step == 0:
            continue
        lv = levels(c32(-(np.float32(nmax) + np.float32(0.1) * np.float32(step))) / mx)
        slx, sl2 = seq_sum(wx * lv), seq_sum((w * lv) * lv)
        better = (sl2 > 0) & (slx * slx > best * sl2)
        L = where(better, lv, L)
        scale = where(better, slx / sl2, scale)
        best = where(better, scale * slx, best)
    return where(zero, torch.zeros_like(scale), scale), where(zero, torch.zeros_like(L), L + nmax)


def make_q3_quants(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``make_q3_quants(n, nmax, x, L, do_rmse=true)``: start from the symmetric grid of the largest value,
    then up to 5 rounds of coordinate descent on each level (weights x^2). Returns (scale, L + nmax)."""
    amax, mx = first_absmax(x)
    zero = amax < GROUP_MAX_EPS
    mx = where(zero, torch.ones_like(mx), mx)
    L = torch.clamp(nearest_int((c32(-nmax) / mx) * x), -nmax, nmax - 1)
    w = x * x
    wx = w * x
    sumlx, suml2 = seq_sum(wx * L), seq_sum((w * L) * L)
    L = list(L)
    for _ in range(5):  # a block without changes stays unchanged: running all rounds is the C early exit
        for i in range(x.shape[0]):
            slx = sumlx - wx[i] * L[i]
            sl2 = suml2 - (w[i] * L[i]) * L[i]
            new = torch.clamp(nearest_int((x[i] * sl2) / slx), -nmax, nmax - 1)
            slx2 = slx + wx[i] * new
            sl22 = sl2 + (w[i] * new) * new
            take = (slx > 0) & (new != L[i]) & (sl22 > 0) & ((slx2 * slx2) * suml2 > (sumlx * sumlx) * sl22)
            L[i] = where(take, new, L[i])
            sumlx = where(take, slx2, sumlx)
            suml2 = where(take, sl22, suml2)
    L = torch.stack(L)
    scale = where(suml2 > 0, sumlx / suml2, torch.zeros_like(sumlx))
    return where(zero, torch.zeros_like(scale), scale), where(zero, torch.zeros_like(L), L + nmax)


def make_qkx_quants(x: torch.Tensor, w: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int,
                    use_mad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``make_qkx2_quants`` / ``make_qkx3_quants`` (the same search; qkx3 is called with explicit weights):
    an affine grid ``scale * L + min`` (min <= 0) refined over nstep+1 candidate ranges by weighted least
    squares. Returns (scale (B,), the_min = -min (B,), L (n, B) in [0, nmax])."""
    mn = torch.clamp(x.min(0).values, max=0.0)
    mx = x.max(0).values
    sum_w, sum_x = seq_sum(w), seq_sum(w * x)
    flat = mx == mn
    rng = where(flat, torch.ones_like(mx), mx - mn)

    def err_of(diff):
        return seq_sum(w * (diff.abs() if use_mad else diff * diff))

    iscale = c32(nmax) / rng
    scale = 1 / iscale
    L = torch.clamp(nearest_int(iscale * (x - mn)), 0, nmax)
    best = err_of((scale * L + mn) - x)
    for step in range(nstep + 1):
        c = np.float32(np.float32(rmin) + np.float32(rdelta) * np.float32(step)) + np.float32(nmax)
        rng = where(flat, torch.ones_like(mx), mx - mn)  # min moves with every accepted candidate
        La = torch.clamp(nearest_int((c32(c) / rng) * (x - mn)), 0, nmax)
        wl = w * La
        sum_l, sum_l2, sum_xl = seq_sum(wl), seq_sum(wl * La), seq_sum(wl * x)
        D = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
        pos = this_min > 0
        this_min = where(pos, torch.zeros_like(this_min), this_min)
        this_scale = where(pos, sum_xl / sum_l2, this_scale)
        cur = err_of((this_scale * La + this_min) - x)
        better = (D > 0) & (cur < best) & ~flat
        L = where(better, La, L)
        best = where(better, cur, best)
        scale = where(better, this_scale, scale)
        mn = where(better, this_min, mn)
    zeros = torch.zeros_like(scale)
    return where(flat, zeros, scale), -mn, where(flat, torch.zeros_like(L), L)


def make_qp_quants(x: torch.Tensor, nmax: int, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``make_qp_quants(n, nmax, x, L, quant_weights)``: quantize the (non-negative) sub-block scales or mins
    of a super-block to [0, nmax] with a weighted search and 5 rounds of coordinate descent.
    Returns (super-block scale (B,), L (n, B) as uint8 values)."""
    mx = torch.clamp(x.max(0).values, min=0.0)
    zero = mx < GROUP_MAX_EPS
    mx = where(zero, torch.ones_like(mx), mx)
    iscale = c32(nmax) / mx
    L0 = u8(nearest_int(iscale * x))
    d = x - (1 / iscale) * L0
    best = seq_sum((w * d) * d)
    for step in range(-4, 5):
        if step == 0:
            continue
        isc = c32(np.float32(np.float32(0.1) * np.float32(step)) + np.float32(nmax)) / mx
        lv = torch.clamp(nearest_int(isc * x), max=nmax)
        d = x - (1 / isc) * lv
        mse = seq_sum((w * d) * d)
        better = mse < best
        best = where(better, mse, best)
        iscale = where(better, isc, iscale)
    lv = torch.clamp(nearest_int(iscale * x), max=nmax)
    wx = w * x
    sumlx, suml2 = seq_sum(wx * lv), seq_sum((w * lv) * lv)
    L = list(u8(lv))
    for _ in range(5):
        for i in range(x.shape[0]):
            slx = sumlx - wx[i] * L[i]
            sl2 = suml2 - (w[i] * L[i]) * L[i]
            new = torch.clamp(nearest_int((x[i] * sl2) / slx), max=nmax)
            slx2 = slx + wx[i] * new
            sl22 = sl2 + (w[i] * new) * new
            take = (slx > 0) & (sl2 > 0) & (new != L[i]) & ((slx2 * slx2) * suml2 > (sumlx * sumlx) * sl22)
            L[i] = where(take, u8(new), L[i])
            sumlx = where(take, slx2, sumlx)
            suml2 = where(take, sl22, suml2)
    L = torch.stack(L)
    scale = where(suml2 > 0, sumlx / suml2, torch.zeros_like(sumlx))
    return where(zero, torch.zeros_like(scale), scale), where(zero, torch.zeros_like(L), L)


# ----------------------------------------------------------------------------- layout helpers


def blocks(t: torch.Tensor, n: int) -> torch.Tensor:
    """(rows, cols) -> element-major (n, rows * cols / n): column b is the b-th block of n in row-major order."""
    return t.reshape(-1, n).t().contiguous()


def unblocks(t: torch.Tensor, rows: int) -> torch.Tensor:
    """Inverse of :func:`blocks`."""
    return t.t().reshape(rows, -1)


def row_sigma2(X: torch.Tensor, factor: float, per: int) -> torch.Tensor:
    """``factor * sum x^2 / per`` over each run of ``per`` consecutive weights (a row or a super-block),
    summed left to right; one value per run."""
    s = seq_sum(blocks(X * X, per))
    return (c32(factor) * s) / c32(per) if factor != 1 else s / c32(per)


def expand(v: torch.Tensor, n: int) -> torch.Tensor:
    """Per-block values (B,) -> element-major (n, B)."""
    return v[None].expand(n, -1)



def requantize(x: torch.Tensor, L: torch.Tensor, step: torch.Tensor, lo: torch.Tensor | None, lmin: int,
               lmax: int) -> torch.Tensor:
    """The final pass of every k-quant: with the stored (fp16) super-block scales, L = clamp(nearest_int(
    (x + lo) / step)); a sub-block whose step is 0 keeps the L of its search (C ``if (!d) continue``)."""
    num = x if lo is None else x + expand(lo, x.shape[0])
    stepx = expand(step, x.shape[0])
    new = torch.clamp(nearest_int(num / stepx), lmin, lmax)
    return where(stepx != 0, new, L)
