"""GGUF block quantization (llama.cpp / ggml): Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the k-quants
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, without and with an importance matrix, and the per-tensor type
recipes of the Q3_K_M / Q4_K_M / Q5_K_M mixes.

Reference: ggml's ``ggml-quants.c`` (functions ``quantize_row_<type>_ref``, used by
``ggml_quantize_chunk`` when no importance matrix is given, and ``quantize_row_<type>_impl``
with ``quant_weights``), the block layouts of ``ggml-common.h`` and the type choice of
``llama_tensor_get_type`` in ``src/llama-quant.cpp``, read at llama.cpp commit 0c1e570
(2026-10-01, vendored by llama-cpp-python 0.3.36). K-quants: Kawrakow, llama.cpp PR #1684
(2023). No ggml code is used here; every function below is a vectorised re-derivation that
makes the same decisions in the same float32 arithmetic.

Exactness
---------
ggml works block by block in scalar float32 C compiled without FMA contraction (ggml-base is
built for the baseline ISA). Here every block is processed at once, element-major (n, blocks),
and every sum the reference accumulates in a loop is accumulated in the same left-to-right
order (:func:`_seq_sum`), so that each product, sum and comparison is the same IEEE float32
operation as in C: codes, scales and dequantized values are bit-identical to the reference
(tests/test_formats_gguf.py checks them against bytes written by ggml itself).
``nearest_int`` is emulated with its own magic-number trick and the C conversions to
``uint8_t``/``int8_t`` wrap as they do in C.

Storage (ggml block types; ``bits_per_weight`` counts scales as the format stores them)::

    type  block  bytes  bpw     value of code L (d, dmin fp16; sc, m the sub-block's scale/min)
    q8_0    32    34   8.5      d * (L - 128)                 (L = int8 q + 128)
    q4_0    32    18   4.5      d * (L - 8)
    q4_1    32    20   5.0      d * L + m
    q5_0    32    22   5.5      d * (L - 16)
    q5_1    32    24   6.0      d * L + m
    q2_K   256    84   2.625    (d*sc) * L - (dmin*m)         16 sub-blocks of 16, 4-bit sc and m
    q3_K   256   110   3.4375   (d*sc) * (L - 4)              16 of 16, 6-bit signed sc
    q4_K   256   144   4.5      (d*sc) * L - (dmin*m)         8 of 32, 6-bit sc and m
    q5_K   256   176   5.5      (d*sc) * L - (dmin*m)         8 of 32, 6-bit sc and m
    q6_K   256   210   6.5625   (d*sc) * (L - 32)             16 of 16, int8 sc

The importance matrix is llama-imatrix's: per input column, the mean over calibration tokens
of x_j^2 (:func:`imatrix_from_stats`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from quantdyn.errors import QuantdynError

QK = 32
"""Block of the legacy types (Q4_0 ... Q8_0)."""
QK_K = 256
"""Super-block of the k-quants."""
GROUP_MAX_EPS = float(np.float32(1e-15))
"""ggml's threshold under which a group counts as all zero."""

F32 = torch.float32


@dataclass(frozen=True)
class GGMLType:
    """One ggml block type."""

    name: str
    """ggml's name (``q4_K``); quantdyn's labels use the lower-case form (``q4_k``)."""
    type_id: int
    """GGMLQuantizationType value in GGUF files."""
    block: int
    """Weights per block (the row length must be a multiple)."""
    type_size: int
    """Bytes per block."""
    bits: int
    """Bits of one code."""
    group: int
    """Weights sharing one (sub-block) scale."""

    @property
    def bits_per_weight(self) -> float:
        return self.type_size * 8 / self.block


GGML_TYPES: dict[str, GGMLType] = {t.name.lower(): t for t in (
    GGMLType("q4_0", 2, QK, 18, 4, QK),
    GGMLType("q4_1", 3, QK, 20, 4, QK),
    GGMLType("q5_0", 6, QK, 22, 5, QK),
    GGMLType("q5_1", 7, QK, 24, 5, QK),
    GGMLType("q8_0", 8, QK, 34, 8, QK),
    GGMLType("q2_K", 10, QK_K, 84, 2, 16),
    GGMLType("q3_K", 11, QK_K, 110, 3, 16),
    GGMLType("q4_K", 12, QK_K, 144, 4, 32),
    GGMLType("q5_K", 13, QK_K, 176, 5, 32),
    GGMLType("q6_K", 14, QK_K, 210, 6, 16),
)}
"""The block types, by quantdyn's lower-case name."""

_ZERO_POINT = {"q8_0": 128, "q4_0": 8, "q5_0": 16, "q3_k": 4, "q6_k": 32}
"""Offset of the symmetric types' codes: value = step * (L - offset)."""


@dataclass(frozen=True)
class GGUFQuant:
    """One matrix in a ggml block type."""

    type: str
    """quantdyn's name of the block type (``q4_k``)."""
    codes: torch.Tensor
    """(rows, cols) uint8: the level index L of every weight as the block stores it."""
    fields: dict[str, torch.Tensor]
    """The block's other fields, per block or sub-block: ``d``/``dmin``/``m`` float16 (rows, blocks);
    ``sc``/``mn`` uint8 or int8 (rows, blocks, sub-blocks)."""
    weight: torch.Tensor
    """(rows, cols) float32: the dequantized weight, as ggml's ``dequantize_row_<type>`` computes it."""

    @property
    def ggml(self) -> GGMLType:
        return GGML_TYPES[self.type]

    def step_and_zero(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(step, zero), each (rows, cols // group): ``weight ~= step * (codes - zero)`` per group (exact for the
        symmetric types; for the types with a minimum ``zero = min / step``, 0 where the step is 0)."""
        t, f = self.type, self.fields
        rows = self.codes.shape[0]
        if t in ("q8_0", "q4_0", "q5_0"):
            step = f["d"].float()
            return step, torch.full_like(step, _ZERO_POINT[t])
        if t in ("q4_1", "q5_1"):
            step, lo = f["d"].float(), f["m"].float()
            return step, torch.where(step != 0, -lo / step, torch.zeros_like(step))
        d = f["d"].float()[:, :, None]
        if t in ("q3_k", "q6_k"):
            step = (d * f["sc"].float()).reshape(rows, -1)
            return step, torch.full_like(step, _ZERO_POINT[t])
        step = (d * f["sc"].float()).reshape(rows, -1)
        lo = (f["dmin"].float()[:, :, None] * f["mn"].float()).reshape(rows, -1)
        return step, torch.where(step != 0, lo / step, torch.zeros_like(step))


# ----------------------------------------------------------------------------- float32 arithmetic as in C


def _c(value: float) -> torch.Tensor:
    """A float32 constant (0-dim tensor), so that no operation with it runs in float64."""
    return torch.tensor(np.float32(value), dtype=F32)


def _seq_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over dim 0 of an element-major (n, blocks) tensor, left to right in float32, as a C loop
    ``for (i...) s += t[i]`` does (torch's own reductions sum in another order)."""
    acc = t[0]
    for i in range(1, t.shape[0]):
        acc = acc + t[i]
    return acc


def _nearest_int(x: torch.Tensor) -> torch.Tensor:
    """ggml's ``nearest_int``: add 1.5 * 2^23 in float32 and read the low mantissa bits (round half to even
    for |x| < 2^22, and the same garbage as C beyond). Returns float32 integer values."""
    v = (x + _c(12582912.0)).view(torch.int32)
    return ((v & 0x007FFFFF) - 0x00400000).to(F32)


def _roundf(x: torch.Tensor) -> torch.Tensor:
    """C ``roundf``: half away from zero (exact: x - trunc(x) is exact in float)."""
    r = torch.trunc(x)
    return r + torch.sign(x) * ((x - r).abs() >= 0.5).to(F32)


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    """C ``sqrtf`` (correctly rounded). torch's vectorised float32 sqrt is not correctly rounded on every CPU
    (measured: off by one ulp with AVX-512); the float64 root rounded to float32 is, since 53 >= 2 * 24 + 2."""
    return torch.sqrt(x.double()).float()


def _max0(v: torch.Tensor) -> torch.Tensor:
    """``m = 0; if (v > m) m = v`` over the last dim: the largest value if positive, else +0 (never -0)."""
    m = v.max(-1).values
    return torch.where(m > 0, m, torch.zeros_like(m))


def _fp16(x: torch.Tensor) -> torch.Tensor:
    """GGML_FP32_TO_FP16 (round to nearest even) as float16."""
    return x.to(torch.float16)


def _u8(x: torch.Tensor) -> torch.Tensor:
    """C conversion of an int to ``uint8_t`` (wraps modulo 256), as float32."""
    return torch.remainder(x, 256)


def _i8(x: torch.Tensor) -> torch.Tensor:
    """C conversion of an int to ``int8_t`` (wraps into [-128, 127]), as float32."""
    return torch.remainder(x + 128, 256) - 128


def _first_absmax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(amax, value with that |value|, the first such in the block) per block of element-major x."""
    ax = x.abs()
    idx = ax.argmax(0, keepdim=True)  # first maximal index, as the C loop's strict '<'
    return ax.gather(0, idx)[0], x.gather(0, idx)[0]


def _where(mask, a, b):
    return torch.where(mask, a, b)


# ----------------------------------------------------------------------------- ggml's scale searches


def _make_qx_quants(x: torch.Tensor, nmax: int, w: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``make_qx_quants(n, nmax, x, L, rmse_type=1, qw)`` on element-major x (n, B): weighted least-squares
    symmetric scale over 19 candidate grids. Returns (scale (B,), L (n, B) in [0, 2 nmax - 1])."""
    amax, mx = _first_absmax(x)
    zero = amax < GROUP_MAX_EPS
    mx = _where(zero, torch.ones_like(mx), mx)
    w = x * x if w is None else w
    wx = w * x

    def levels(iscale):
        return torch.clamp(_nearest_int(iscale * x), -nmax, nmax - 1)

    lv = levels(_c(-nmax) / mx)
    sumlx, suml2 = _seq_sum(wx * lv), _seq_sum((w * lv) * lv)
    scale = _where(suml2 != 0, sumlx / suml2, torch.zeros_like(sumlx))
    best = scale * sumlx
    L = lv
    for step in range(-9, 10):
        if step == 0:
            continue
        lv = levels(_c(-(np.float32(nmax) + np.float32(0.1) * np.float32(step))) / mx)
        slx, sl2 = _seq_sum(wx * lv), _seq_sum((w * lv) * lv)
        better = (sl2 > 0) & (slx * slx > best * sl2)
        L = _where(better, lv, L)
        scale = _where(better, slx / sl2, scale)
        best = _where(better, scale * slx, best)
    return _where(zero, torch.zeros_like(scale), scale), _where(zero, torch.zeros_like(L), L + nmax)


def _make_q3_quants(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``make_q3_quants(n, nmax, x, L, do_rmse=true)``: start from the symmetric grid of the largest value,
    then up to 5 rounds of coordinate descent on each level (weights x^2). Returns (scale, L + nmax)."""
    amax, mx = _first_absmax(x)
    zero = amax < GROUP_MAX_EPS
    mx = _where(zero, torch.ones_like(mx), mx)
    L = torch.clamp(_nearest_int((_c(-nmax) / mx) * x), -nmax, nmax - 1)
    w = x * x
    wx = w * x
    sumlx, suml2 = _seq_sum(wx * L), _seq_sum((w * L) * L)
    L = list(L)
    for _ in range(5):  # a block without changes stays unchanged: running all rounds is the C early exit
        for i in range(x.shape[0]):
            slx = sumlx - wx[i] * L[i]
            sl2 = suml2 - (w[i] * L[i]) * L[i]
            new = torch.clamp(_nearest_int((x[i] * sl2) / slx), -nmax, nmax - 1)
            slx2 = slx + wx[i] * new
            sl22 = sl2 + (w[i] * new) * new
            take = (slx > 0) & (new != L[i]) & (sl22 > 0) & ((slx2 * slx2) * suml2 > (sumlx * sumlx) * sl22)
            L[i] = _where(take, new, L[i])
            sumlx = _where(take, slx2, sumlx)
            suml2 = _where(take, sl22, suml2)
    L = torch.stack(L)
    scale = _where(suml2 > 0, sumlx / suml2, torch.zeros_like(sumlx))
    return _where(zero, torch.zeros_like(scale), scale), _where(zero, torch.zeros_like(L), L + nmax)


def _make_qkx_quants(x: torch.Tensor, w: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int,
                     use_mad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``make_qkx2_quants`` / ``make_qkx3_quants`` (the same search; qkx3 is called with explicit weights):
    an affine grid ``scale * L + min`` (min <= 0) refined over nstep+1 candidate ranges by weighted least
    squares. Returns (scale (B,), the_min = -min (B,), L (n, B) in [0, nmax])."""
    mn = torch.clamp(x.min(0).values, max=0.0)
    mx = x.max(0).values
    sum_w, sum_x = _seq_sum(w), _seq_sum(w * x)
    flat = mx == mn
    rng = _where(flat, torch.ones_like(mx), mx - mn)

    def err_of(diff):
        return _seq_sum(w * (diff.abs() if use_mad else diff * diff))

    iscale = _c(nmax) / rng
    scale = 1 / iscale
    L = torch.clamp(_nearest_int(iscale * (x - mn)), 0, nmax)
    best = err_of((scale * L + mn) - x)
    for step in range(nstep + 1):
        c = np.float32(np.float32(rmin) + np.float32(rdelta) * np.float32(step)) + np.float32(nmax)
        rng = _where(flat, torch.ones_like(mx), mx - mn)  # min moves with every accepted candidate
        La = torch.clamp(_nearest_int((_c(c) / rng) * (x - mn)), 0, nmax)
        wl = w * La
        sum_l, sum_l2, sum_xl = _seq_sum(wl), _seq_sum(wl * La), _seq_sum(wl * x)
        D = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
        pos = this_min > 0
        this_min = _where(pos, torch.zeros_like(this_min), this_min)
        this_scale = _where(pos, sum_xl / sum_l2, this_scale)
        cur = err_of((this_scale * La + this_min) - x)
        better = (D > 0) & (cur < best) & ~flat
        L = _where(better, La, L)
        best = _where(better, cur, best)
        scale = _where(better, this_scale, scale)
        mn = _where(better, this_min, mn)
    zeros = torch.zeros_like(scale)
    return _where(flat, zeros, scale), -mn, _where(flat, torch.zeros_like(L), L)


def _make_qp_quants(x: torch.Tensor, nmax: int, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``make_qp_quants(n, nmax, x, L, quant_weights)``: quantize the (non-negative) sub-block scales or mins
    of a super-block to [0, nmax] with a weighted search and 5 rounds of coordinate descent.
    Returns (super-block scale (B,), L (n, B) as uint8 values)."""
    mx = torch.clamp(x.max(0).values, min=0.0)
    zero = mx < GROUP_MAX_EPS
    mx = _where(zero, torch.ones_like(mx), mx)
    iscale = _c(nmax) / mx
    L0 = _u8(_nearest_int(iscale * x))
    d = x - (1 / iscale) * L0
    best = _seq_sum((w * d) * d)
    for step in range(-4, 5):
        if step == 0:
            continue
        isc = _c(np.float32(np.float32(0.1) * np.float32(step)) + np.float32(nmax)) / mx
        lv = torch.clamp(_nearest_int(isc * x), max=nmax)
        d = x - (1 / isc) * lv
        mse = _seq_sum((w * d) * d)
        better = mse < best
        best = _where(better, mse, best)
        iscale = _where(better, isc, iscale)
    lv = torch.clamp(_nearest_int(iscale * x), max=nmax)
    wx = w * x
    sumlx, suml2 = _seq_sum(wx * lv), _seq_sum((w * lv) * lv)
    L = list(_u8(lv))
    for _ in range(5):
        for i in range(x.shape[0]):
            slx = sumlx - wx[i] * L[i]
            sl2 = suml2 - (w[i] * L[i]) * L[i]
            new = torch.clamp(_nearest_int((x[i] * sl2) / slx), max=nmax)
            slx2 = slx + wx[i] * new
            sl22 = sl2 + (w[i] * new) * new
            take = (slx > 0) & (sl2 > 0) & (new != L[i]) & ((slx2 * slx2) * suml2 > (sumlx * sumlx) * sl22)
            L[i] = _where(take, _u8(new), L[i])
            sumlx = _where(take, slx2, sumlx)
            suml2 = _where(take, sl22, suml2)
    L = torch.stack(L)
    scale = _where(suml2 > 0, sumlx / suml2, torch.zeros_like(sumlx))
    return _where(zero, torch.zeros_like(scale), scale), _where(zero, torch.zeros_like(L), L)


# ----------------------------------------------------------------------------- layout helpers


def _blocks(t: torch.Tensor, n: int) -> torch.Tensor:
    """(rows, cols) -> element-major (n, rows * cols / n): column b is the b-th block of n in row-major order."""
    return t.reshape(-1, n).t().contiguous()


def _unblocks(t: torch.Tensor, rows: int) -> torch.Tensor:
    """Inverse of :func:`_blocks`."""
    return t.t().reshape(rows, -1)


def _row_sigma2(X: torch.Tensor, factor: float, per: int) -> torch.Tensor:
    """``factor * sum x^2 / per`` over each run of ``per`` consecutive weights (a row or a super-block),
    summed left to right; one value per run."""
    s = _seq_sum(_blocks(X * X, per))
    return (_c(factor) * s) / _c(per) if factor != 1 else s / _c(per)


def _expand(v: torch.Tensor, n: int) -> torch.Tensor:
    """Per-block values (B,) -> element-major (n, B)."""
    return v[None].expand(n, -1)


# ----------------------------------------------------------------------------- the legacy types


def _legacy_sym(X: torch.Tensor, t: str) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_row_q4_0_ref / q5_0_ref / q8_0_ref: (d (blocks,) float32, L (32, blocks))."""
    x = _blocks(X, QK)
    if t == "q8_0":
        d = x.abs().max(0).values / _c(127)
        idv = _where(d != 0, 1 / d, torch.zeros_like(d))
        return d, _roundf(x * idv) + 128
    half = 8 if t == "q4_0" else 16
    _, mx = _first_absmax(x)
    d = mx / _c(-half)
    idv = _where(d != 0, 1 / d, torch.zeros_like(d))
    return d, torch.clamp(torch.trunc(x * idv + _c(half + 0.5)), max=2 * half - 1)


def _legacy_min(X: torch.Tensor, t: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """quantize_row_q4_1_ref / q5_1_ref: (d, min, L)."""
    x = _blocks(X, QK)
    nmax = 15 if t == "q4_1" else 31
    mn, mx = x.min(0).values, x.max(0).values
    d = (mx - mn) / _c(nmax)
    idv = _where(d != 0, 1 / d, torch.zeros_like(d))
    L = torch.trunc((x - mn) * idv + _c(0.5))
    return d, mn, (torch.clamp(L, max=15) if t == "q4_1" else L)


def _legacy_imatrix(X: torch.Tensor, t: str, qw: torch.Tensor):
    """quantize_row_<q4_0|q4_1|q5_0|q5_1>_impl with quant_weights: weights qw * sqrt(sigma2 + x^2),
    sigma2 = mean x^2 over the whole row."""
    rows, cols = X.shape
    sigma2 = _row_sigma2(X, 1, cols)
    x = _blocks(X, QK)
    s2 = _expand(sigma2.repeat_interleave(cols // QK), QK)
    w = _blocks(qw.expand(rows, cols), QK) * _sqrt(s2 + x * x)
    if t in ("q4_0", "q5_0"):
        d, L = _make_qx_quants(x, 8 if t == "q4_0" else 16, w)
        return d, None, L
    scale, the_min, L = _make_qkx_quants(x, w, 15 if t == "q4_1" else 31, -0.9, 0.05, 36, False)
    return scale, -the_min, L


# ----------------------------------------------------------------------------- the k-quants


def _pack_scale_min_k4(ls: torch.Tensor, lm: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K: 8 six-bit scales and mins (8, B) -> the 12 scale bytes (12, B)."""
    ls, lm = ls.to(torch.int32), lm.to(torch.int32)
    out = torch.zeros(12, ls.shape[1], dtype=torch.int32)
    out[0:4] = ls[0:4] | ((ls[4:8] >> 4) << 6)
    out[4:8] = lm[0:4] | ((lm[4:8] >> 4) << 6)
    out[8:12] = (ls[4:8] & 0xF) | ((lm[4:8] & 0xF) << 4)
    return out.to(torch.uint8)


def _unpack_scale_min_k4(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``get_scale_min_k4`` for j = 0..7 on (12, B) bytes -> (sc, m) each (8, B) int32."""
    q = q.to(torch.int32)
    sc = torch.cat([q[0:4] & 63, (q[8:12] & 0xF) | ((q[0:4] >> 6) << 4)])
    m = torch.cat([q[4:8] & 63, (q[8:12] >> 4) | ((q[4:8] >> 6) << 4)])
    return sc, m


def _requantize(x: torch.Tensor, L: torch.Tensor, step: torch.Tensor, lo: torch.Tensor | None, lmin: int,
                lmax: int) -> torch.Tensor:
    """The final pass of every k-quant: with the stored (fp16) super-block scales, L = clamp(nearest_int(
    (x + lo) / step)); a sub-block whose step is 0 keeps the L of its search (C ``if (!d) continue``)."""
    num = x if lo is None else x + _expand(lo, x.shape[0])
    stepx = _expand(step, x.shape[0])
    new = torch.clamp(_nearest_int(num / stepx), lmin, lmax)
    return _where(stepx != 0, new, L)


def _q2_k(X: torch.Tensor, qw: torch.Tensor | None):
    rows, cols = X.shape
    x = _blocks(X, 16)  # (16, S) sub-blocks
    S = x.shape[1]
    if qw is None:  # quantize_row_q2_K_ref
        scales, mins, L = _make_qkx_quants(x, x.abs(), 3, -0.5, 0.1, 15, True)
        sc_b, mn_b = scales.reshape(-1, 16), mins.reshape(-1, 16)  # (B, 16) per super-block
        max_scale = _max0(sc_b)
        max_min = _max0(mn_b)
        has_s, has_m = max_scale > 0, max_min > 0
        ls = _where(has_s[:, None], _u8(_nearest_int((_c(15) / max_scale)[:, None] * sc_b)), torch.zeros_like(sc_b))
        lm = _where(has_m[:, None], _nearest_int((_c(15) / max_min)[:, None] * mn_b), torch.zeros_like(mn_b))
        byte = _u8(ls.to(torch.int32) | (lm.to(torch.int32) << 4)).to(F32)
        d = _fp16(_where(has_s, max_scale / _c(15), torch.zeros_like(max_scale)))
        dmin = _fp16(_where(has_m, max_min / _c(15), torch.zeros_like(max_min)))
    else:  # quantize_row_q2_K_impl
        sigma2 = _row_sigma2(X, 1, QK_K)
        s2 = _expand(sigma2.repeat_interleave(16), 16)
        w = _blocks(qw.expand(rows, cols), 16) * _sqrt(s2 + x * x)
        sw = _seq_sum(w)
        scales, mins, L = _make_qkx_quants(x, w, 3, -0.9, 0.05, 36, False)
        dm, Ls = _make_qp_quants(scales.reshape(-1, 16).t().contiguous(), 15, sw.reshape(-1, 16).t().contiguous())
        mm, Lm = _make_qp_quants(mins.reshape(-1, 16).t().contiguous(), 15, sw.reshape(-1, 16).t().contiguous())
        byte = _u8(Ls.t().to(torch.int32) | (Lm.t().to(torch.int32) << 4)).to(F32)
        d, dmin = _fp16(dm), _fp16(mm)
    sc = (byte.to(torch.int32) & 0xF).to(F32)
    mn = (byte.to(torch.int32) >> 4).to(F32)
    step = (d.float()[:, None] * sc).reshape(S)
    lo = (dmin.float()[:, None] * mn).reshape(S)
    L = _requantize(x, L, step, lo, 0, 3)
    fields = dict(d=d.reshape(rows, -1), dmin=dmin.reshape(rows, -1),
                  sc=sc.to(torch.uint8).reshape(rows, -1, 16), mn=mn.to(torch.uint8).reshape(rows, -1, 16))
    return _unblocks(L, rows), fields


def _pack_q3_scales(Ls: torch.Tensor) -> torch.Tensor:
    """Q3_K: 16 six-bit scales (16, B) (stored value = scale + 32) -> the 12 scale bytes (12, B)."""
    l = Ls.to(torch.int32)
    out = torch.zeros(12, l.shape[1], dtype=torch.int32)
    out[0:8] = (l[0:8] & 0xF) | ((l[8:16] & 0xF) << 4)
    hi = l >> 4
    for j in range(16):
        out[8 + j % 4] |= hi[j] << (2 * (j // 4))
    return out.to(torch.uint8)


def _unpack_q3_scales(q: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_pack_q3_scales`: (12, B) bytes -> signed scales (16, B) int32 in [-32, 31]."""
    q = q.to(torch.int32)
    low = torch.cat([q[0:8] & 0xF, q[0:8] >> 4])
    hi = torch.stack([(q[8 + j % 4] >> (2 * (j // 4))) & 3 for j in range(16)])
    return (low | (hi << 4)) - 32


def _q3_k(X: torch.Tensor, qw: torch.Tensor | None):
    rows, cols = X.shape
    x = _blocks(X, 16)
    S = x.shape[1]
    if qw is None:  # quantize_row_q3_K_ref
        scales, L = _make_q3_quants(x, 4)
        sc_b = scales.reshape(-1, 16)
        amax, max_scale = _first_absmax(sc_b.t())
        has = max_scale != 0
        iscale = _c(-32) / _where(has, max_scale, torch.ones_like(max_scale))
        l = _i8(_nearest_int(iscale[:, None] * sc_b))
        Ls = _where(has[:, None], torch.clamp(l, -32, 31) + 32, torch.zeros_like(l))
        d = _fp16(_where(has, 1 / iscale, torch.zeros_like(iscale)))
    else:  # quantize_row_q3_K_impl
        sigma2 = _row_sigma2(X, 2, QK_K)
        s2 = _expand(sigma2.repeat_interleave(16), 16)
        w = _blocks(qw.expand(rows, cols), 16) * _sqrt(s2 + x * x)
        sw = _seq_sum(w)
        scales, L = _make_qx_quants(x, 4, w)
        db, Lsb = _make_qx_quants(scales.reshape(-1, 16).t().contiguous(), 32, sw.reshape(-1, 16).t().contiguous())
        Ls, d = Lsb.t(), _fp16(db)
    sc = Ls - 32  # the decoded signed scale (the 12 bytes hold exactly these 6 bits)
    step = (d.float()[:, None] * sc).reshape(S)
    L = _requantize(x, L, step, None, -4, 3)
    L = _where(_expand(step, 16) != 0, L + 4, L)
    fields = dict(d=d.reshape(rows, -1), sc=sc.to(torch.int8).reshape(rows, -1, 16))
    return _unblocks(L, rows), fields


def _q45_k(X: torch.Tensor, qw: torch.Tensor | None, nmax: int):
    """Q4_K (nmax 15) and Q5_K (nmax 31)."""
    rows, cols = X.shape
    x = _blocks(X, 32)  # (32, S)
    S = x.shape[1]
    if qw is None:  # quantize_row_q<4|5>_K_ref
        av_x = _sqrt(_seq_sum(x * x) / _c(32))
        w = _expand(av_x, 32) + x.abs()
        rmin, nstep = (-1.0, 20) if nmax == 15 else (-0.5, 15)
        scales, mins, L = _make_qkx_quants(x, w, nmax, rmin, 0.1, nstep, False)
        sc_b, mn_b = scales.reshape(-1, 8), mins.reshape(-1, 8)
        max_scale = _max0(sc_b)
        max_min = _max0(mn_b)
        inv_s = _where(max_scale > 0, _c(63) / max_scale, torch.zeros_like(max_scale))
        inv_m = _where(max_min > 0, _c(63) / max_min, torch.zeros_like(max_min))
        ls = torch.clamp(_u8(_nearest_int(inv_s[:, None] * sc_b)), max=63)
        lm = torch.clamp(_u8(_nearest_int(inv_m[:, None] * mn_b)), max=63)
        d, dmin = _fp16(max_scale / _c(63)), _fp16(max_min / _c(63))
    else:  # quantize_row_q<4|5>_K_impl
        sigma2 = _row_sigma2(X, 2, QK_K)
        s2 = _expand(sigma2.repeat_interleave(8), 32)
        w = _blocks(qw.expand(rows, cols), 32) * _sqrt(s2 + x * x)
        sw = _seq_sum(w).reshape(-1, 8).t().contiguous()
        scales, mins, L = _make_qkx_quants(x, w, nmax, -0.9, 0.05, 36, False)
        db, Ls = _make_qp_quants(scales.reshape(-1, 8).t().contiguous(), 63, sw)
        mb, Lm = _make_qp_quants(mins.reshape(-1, 8).t().contiguous(), 63, sw)
        ls, lm = torch.clamp(Ls.t(), max=63), torch.clamp(Lm.t(), max=63)
        d, dmin = _fp16(db), _fp16(mb)
    step = (d.float()[:, None] * ls).reshape(S)
    lo = (dmin.float()[:, None] * lm).reshape(S)
    L = _requantize(x, L, step, lo, 0, nmax)
    fields = dict(d=d.reshape(rows, -1), dmin=dmin.reshape(rows, -1),
                  sc=ls.to(torch.uint8).reshape(rows, -1, 8), mn=lm.to(torch.uint8).reshape(rows, -1, 8))
    return _unblocks(L, rows), fields


def _q6_k(X: torch.Tensor, qw: torch.Tensor | None):
    rows, cols = X.shape
    x = _blocks(X, 16)
    S = x.shape[1]
    w = None if qw is None else _blocks(qw.expand(rows, cols), 16)  # impl: weights = quant_weights as given
    scales, L = _make_qx_quants(x, 32, w)
    sc_b = scales.reshape(-1, 16)
    max_abs, max_scale = _first_absmax(sc_b.t())
    zero = max_abs < GROUP_MAX_EPS
    iscale = _c(-128) / _where(zero, torch.ones_like(max_scale), max_scale)
    sc = _where(zero[:, None], torch.zeros_like(sc_b), torch.clamp(_nearest_int(iscale[:, None] * sc_b), max=127))
    d = _fp16(_where(zero, torch.zeros_like(iscale), 1 / iscale))
    step = (d.float()[:, None] * sc).reshape(S)
    L = _requantize(x, L, step, None, -32, 31)
    L = _where(_expand(step, 16) != 0, L + 32, L)
    L = _where(_expand(zero.repeat_interleave(16), 16), torch.zeros_like(L), L)  # an all-zero block is memset
    fields = dict(d=d.reshape(rows, -1), sc=sc.to(torch.int8).reshape(rows, -1, 16))
    return _unblocks(L, rows), fields


# ----------------------------------------------------------------------------- dequantization


def dequantize_fields(t: str, codes: torch.Tensor, fields: dict[str, torch.Tensor]) -> torch.Tensor:
    """ggml's ``dequantize_row_<type>`` on (codes, fields): the float32 weight, operation for operation."""
    L = codes.to(F32)
    rows = L.shape[0]
    g = GGML_TYPES[t].group
    Lg = L.reshape(rows, -1, g)
    d = fields["d"].float()
    if t in _ZERO_POINT and t not in ("q3_k", "q6_k"):
        return ((Lg - _ZERO_POINT[t]) * d[:, :, None]).reshape(rows, -1)
    if t in ("q4_1", "q5_1"):
        return (Lg * d[:, :, None] + fields["m"].float()[:, :, None]).reshape(rows, -1)
    sub = GGML_TYPES[t].block // g
    dsub = d.repeat_interleave(sub, 1)[:, :, None]
    sc = fields["sc"].float().reshape(rows, -1)[:, :, None]
    if t in ("q3_k", "q6_k"):
        return ((dsub * sc) * (Lg - _ZERO_POINT[t])).reshape(rows, -1)
    lo = fields["dmin"].float().repeat_interleave(sub, 1)[:, :, None] * fields["mn"].float().reshape(rows, -1)[:, :, None]
    return ((dsub * sc) * Lg - lo).reshape(rows, -1)


# ----------------------------------------------------------------------------- the public function


def check_row_length(t: str, cols: int, what: str = "weight") -> None:
    """One-line error unless a row of ``cols`` weights splits into blocks of type ``t``."""
    blk = GGML_TYPES[t].block
    if cols % blk:
        raise QuantdynError(f"{what} has rows of {cols} weights; GGUF {GGML_TYPES[t].name} needs a multiple of {blk} "
                            f"(llama.cpp falls back to another type: see quantize.gguf.fallback_type)")


def quantize_gguf(W: torch.Tensor, t: str, imatrix: torch.Tensor | None = None) -> GGUFQuant:
    """Quantize W (rows, cols) to ggml block type ``t`` (``q4_k`` ...), as ``ggml_quantize_chunk`` does:
    ``quantize_row_<t>_ref`` without an importance matrix, ``quantize_row_<t>_impl`` with one
    (``imatrix``: (cols,) non-negative weights per input column; Q8_0 ignores it, as ggml does)."""
    if t not in GGML_TYPES:
        from quantdyn.errors import unknown_name
        raise unknown_name("GGUF block type", t, GGML_TYPES)
    if W.dim() != 2:
        raise QuantdynError(f"GGUF quantization needs a 2-D weight, got shape {tuple(W.shape)}")
    check_row_length(t, W.shape[1])
    X = W.detach().to(device="cpu", dtype=F32).contiguous()
    qw = None
    if imatrix is not None and t != "q8_0":
        qw = imatrix.detach().to(device="cpu", dtype=F32).reshape(1, -1)
        if qw.shape[1] != X.shape[1]:
            raise QuantdynError(f"importance matrix has {qw.shape[1]} entries but the weight has {X.shape[1]} columns")
        if not torch.isfinite(qw).all() or (qw < 0).any():
            raise QuantdynError("importance matrix must be finite and non-negative (mean x^2 per input column)")
    rows = X.shape[0]
    if t in ("q8_0", "q4_0", "q5_0"):
        d, L = _legacy_sym(X, t) if qw is None else _legacy_imatrix(X, t, qw)[::2]
        fields = dict(d=_fp16(d).reshape(rows, -1))
        codes = _unblocks(L, rows)
    elif t in ("q4_1", "q5_1"):
        d, mn, L = _legacy_min(X, t) if qw is None else _legacy_imatrix(X, t, qw)
        fields = dict(d=_fp16(d).reshape(rows, -1), m=_fp16(mn).reshape(rows, -1))
        codes = _unblocks(L, rows)
    elif t == "q2_k":
        codes, fields = _q2_k(X, qw)
    elif t == "q3_k":
        codes, fields = _q3_k(X, qw)
    elif t in ("q4_k", "q5_k"):
        codes, fields = _q45_k(X, qw, 15 if t == "q4_k" else 31)
    else:
        codes, fields = _q6_k(X, qw)
    codes = codes.to(torch.uint8)
    return GGUFQuant(t, codes, fields, dequantize_fields(t, codes, fields))


# ----------------------------------------------------------------------------- bytes (the GGUF tensor data)


def _h(x: torch.Tensor) -> torch.Tensor:
    """float16 (rows, blocks) -> its two little-endian bytes (rows, blocks, 2)."""
    return x.contiguous().view(torch.uint8).reshape(*x.shape, 2)


def _planes(L: torch.Tensor, width: int, shifts: int) -> torch.Tensor:
    """Pack ``shifts`` groups of ``width`` consecutive codes into one byte each, group k at bit 8/shifts*k
    (the qs layout of every k-quant): (..., shifts * width) -> (..., width)."""
    L = L.to(torch.int32).reshape(*L.shape[:-1], shifts, width)
    bits = 8 // shifts
    out = torch.zeros_like(L[..., 0, :])
    for k in range(shifts):
        out |= (L[..., k, :] & ((1 << bits) - 1)) << (bits * k)
    return out


def _unplanes(q: torch.Tensor, shifts: int) -> torch.Tensor:
    bits = 8 // shifts
    q = q.to(torch.int32)
    return torch.cat([(q >> (bits * k)) & ((1 << bits) - 1) for k in range(shifts)], -1)


def _high_bits(L: torch.Tensor, bit: int, n: int) -> torch.Tensor:
    """Q5_0/Q5_1: bit ``bit`` of each of the n codes of a block as a little-endian uint32 (4 bytes)."""
    hb = ((L.to(torch.int64) >> bit) & 1) << torch.arange(n, dtype=torch.int64)
    word = hb.sum(-1)
    return torch.stack([(word >> (8 * k)) & 0xFF for k in range(4)], -1)


def pack_gguf(q: GGUFQuant) -> torch.Tensor:
    """The ggml block bytes of ``q``: (rows, row_bytes) uint8, exactly what a GGUF file stores."""
    t, f = q.type, q.fields
    rows, cols = q.codes.shape
    L = q.codes.to(torch.int32).reshape(rows, -1, GGML_TYPES[t].block)
    nb = L.shape[1]
    parts: list[torch.Tensor]
    if t == "q8_0":
        parts = [_h(f["d"]), (L - 128).to(torch.int8).view(torch.uint8)]
    elif t in ("q4_0", "q4_1"):
        lo_hi = (L[..., :16] & 0xF) | ((L[..., 16:] & 0xF) << 4)
        parts = [_h(f["d"])] + ([_h(f["m"])] if t == "q4_1" else []) + [lo_hi]
    elif t in ("q5_0", "q5_1"):
        qs = (L[..., :16] & 0xF) | ((L[..., 16:] & 0xF) << 4)
        parts = [_h(f["d"])] + ([_h(f["m"])] if t == "q5_1" else []) + [_high_bits(L, 4, 32), qs]
    elif t == "q2_k":
        scales = (f["sc"].to(torch.int32) | (f["mn"].to(torch.int32) << 4))
        qs = torch.cat([_planes(L[..., h * 128:(h + 1) * 128], 32, 4) for h in range(2)], -1)
        parts = [scales, qs, _h(f["d"]), _h(f["dmin"])]
    elif t == "q3_k":
        hm = torch.zeros(rows, nb, 32, dtype=torch.int32)
        for k in range(8):  # bit k of hmask[m] is the high bit of code 32 k + m
            hm |= ((L[..., 32 * k:32 * (k + 1)] >> 2) & 1) << k
        qs = torch.cat([_planes(L[..., h * 128:(h + 1) * 128] & 3, 32, 4) for h in range(2)], -1)
        sc = _pack_q3_scales((f["sc"].to(torch.int32) + 32).reshape(-1, 16).t()).t().reshape(rows, nb, 12)
        parts = [hm, qs, sc, _h(f["d"])]
    elif t in ("q4_k", "q5_k"):
        sc = _pack_scale_min_k4(f["sc"].reshape(-1, 8).t(), f["mn"].reshape(-1, 8).t()).t().reshape(rows, nb, 12)
        qs = torch.cat([_planes(L[..., h * 64:(h + 1) * 64] & 0xF, 32, 2) for h in range(4)], -1)
        parts = [_h(f["d"]), _h(f["dmin"]), sc]
        if t == "q5_k":
            qh = torch.zeros(rows, nb, 32, dtype=torch.int32)
            for k in range(8):  # bit k of qh[m] is bit 4 of code 32 k + m
                qh |= ((L[..., 32 * k:32 * (k + 1)] >> 4) & 1) << k
            parts.append(qh)
        parts.append(qs)
    else:  # q6_k
        ql_parts, qh_parts = [], []
        for h in range(2):
            blk = L[..., h * 128:(h + 1) * 128]
            q1, q2, q3, q4 = (blk[..., 32 * k:32 * (k + 1)] for k in range(4))
            ql_parts += [(q1 & 0xF) | ((q3 & 0xF) << 4), (q2 & 0xF) | ((q4 & 0xF) << 4)]
            qh_parts.append((q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6))
        parts = [torch.cat(ql_parts, -1), torch.cat(qh_parts, -1), f["sc"].to(torch.int8).view(torch.uint8), _h(f["d"])]
    out = torch.cat([p.to(torch.int32) & 0xFF if p.dtype != torch.uint8 else p.to(torch.int32) for p in parts], -1)
    return out.to(torch.uint8).reshape(rows, nb * GGML_TYPES[t].type_size)


def unpack_gguf(data: torch.Tensor, t: str, cols: int) -> GGUFQuant:
    """Read ggml block bytes (rows, row_bytes) of type ``t`` back into codes and fields (and the dequantized
    weight): the inverse of :func:`pack_gguf`, used to compare with files llama.cpp wrote."""
    g = GGML_TYPES[t]
    rows = data.shape[0]
    nb = cols // g.block
    B = data.reshape(rows, nb, g.type_size).to(torch.int32)

    def half(o):
        return B[..., o:o + 2].to(torch.uint8).contiguous().view(torch.float16)[..., 0]

    if t == "q8_0":
        codes = B[..., 2:].to(torch.uint8).view(torch.int8).to(torch.int32) + 128
        fields = dict(d=half(0))
    elif t in ("q4_0", "q4_1"):
        o = 2 if t == "q4_0" else 4
        qs = B[..., o:o + 16]
        codes = torch.cat([qs & 0xF, qs >> 4], -1)
        fields = dict(d=half(0)) if t == "q4_0" else dict(d=half(0), m=half(2))
    elif t in ("q5_0", "q5_1"):
        o = 2 if t == "q5_0" else 4
        word = sum(B[..., o + k].to(torch.int64) << (8 * k) for k in range(4))
        hb = ((word[..., None] >> torch.arange(32, dtype=torch.int64)) & 1).to(torch.int32)
        qs = B[..., o + 4:o + 20]
        codes = torch.cat([qs & 0xF, qs >> 4], -1) | (hb << 4)
        fields = dict(d=half(0)) if t == "q5_0" else dict(d=half(0), m=half(2))
    elif t == "q2_k":
        sc = B[..., 0:16]
        codes = torch.cat([_unplanes(B[..., 16 + 32 * h:16 + 32 * (h + 1)], 4) for h in range(2)], -1)
        fields = dict(d=half(80), dmin=half(82), sc=(sc & 0xF).to(torch.uint8), mn=(sc >> 4).to(torch.uint8))
    elif t == "q3_k":
        hm = B[..., 0:32]
        low = torch.cat([_unplanes(B[..., 32 + 32 * h:32 + 32 * (h + 1)], 4) for h in range(2)], -1)
        high = torch.cat([(hm >> k) & 1 for k in range(8)], -1)
        codes = low | (high << 2)
        sc = _unpack_q3_scales(B[..., 96:108].reshape(-1, 12).t()).t().reshape(rows, nb, 16)
        fields = dict(d=half(108), sc=sc.to(torch.int8))
    elif t in ("q4_k", "q5_k"):
        sc, mn = _unpack_scale_min_k4(B[..., 4:16].reshape(-1, 12).t())
        o = 16 if t == "q4_k" else 48
        codes = torch.cat([_unplanes(B[..., o + 32 * h:o + 32 * (h + 1)], 2) for h in range(4)], -1)
        if t == "q5_k":
            qh = B[..., 16:48]
            codes = codes | (torch.cat([(qh >> k) & 1 for k in range(8)], -1) << 4)
        fields = dict(d=half(0), dmin=half(2), sc=sc.t().reshape(rows, nb, 8).to(torch.uint8),
                      mn=mn.t().reshape(rows, nb, 8).to(torch.uint8))
    else:  # q6_k
        ql, qh = B[..., 0:128], B[..., 128:192]
        parts = []
        for h in range(2):
            a, b, hh = ql[..., 64 * h:64 * h + 32], ql[..., 64 * h + 32:64 * h + 64], qh[..., 32 * h:32 * (h + 1)]
            parts += [(a & 0xF) | ((hh & 3) << 4), (b & 0xF) | (((hh >> 2) & 3) << 4),
                      (a >> 4) | (((hh >> 4) & 3) << 4), (b >> 4) | (((hh >> 6) & 3) << 4)]
        codes = torch.cat(parts, -1)
        fields = dict(d=half(208), sc=B[..., 192:208].to(torch.uint8).view(torch.int8))
    codes = codes.reshape(rows, cols).to(torch.uint8)
    return GGUFQuant(t, codes, fields, dequantize_fields(t, codes, fields))


# ----------------------------------------------------------------------------- per-tensor types (llama.cpp's recipes)

MIXES: dict[str, str] = {"q3_k_m": "q3_k", "q4_k_m": "q4_k", "q5_k_m": "q5_k"}
"""llama.cpp's ``LLAMA_FTYPE_MOSTLY_Q*_K_M`` mixes and their default block type."""

TENSOR_CATEGORY: dict[str, str] = {
    # GPT-NeoX / Pythia (and quantdyn's GPT)
    "attention.query_key_value": "attn_qkv", "attention.dense": "attn_output",
    "mlp.dense_h_to_4h": "ffn_up", "mlp.dense_4h_to_h": "ffn_down",
    # LLaMA-like (llama, olmo, qwen2)
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    # GPT-2
    "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output", "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down",
}
"""A block's layer (its path inside the block) -> the llama.cpp tensor name it becomes (``blk.N.<name>.weight``),
which is what llama.cpp's type recipe keys on; the head is ``output``."""

_FALLBACK = {"q2_k": "q4_0", "q3_k": "q4_0", "q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}
"""llama.cpp's ``tensor_type_fallback`` for a row length that is not a multiple of 256."""


def tensor_category(name: str) -> str:
    """llama.cpp's category of a block layer path (``output`` for the head, ``other`` if unknown)."""
    return TENSOR_CATEGORY.get(name, "other")


def fallback_type(t: str, cols: int) -> str | None:
    """The type llama.cpp quantizes a tensor of row length ``cols`` with when ``t`` does not fit: Q2_K/Q3_K ->
    Q4_0, Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0 (32-weight blocks); None if ``t`` fits. Where even the
    fallback does not fit (rows not a multiple of 32) llama.cpp stores F16, which quantdyn refuses instead."""
    if cols % GGML_TYPES[t].block == 0:
        return None
    alt = _FALLBACK.get(t, t)
    if cols % GGML_TYPES[alt].block:
        raise QuantdynError(f"rows of {cols} weights fit no GGUF block type (llama.cpp would store the tensor in F16; "
                            f"quantdyn does not emulate that): GGUF needs a multiple of 32")
    return alt


def _use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def mix_type(mix: str, category: str, layer: int, n_layers: int, cols: int) -> str:
    """The block type llama.cpp's ``llama_tensor_get_type`` gives a tensor in a Q*_K_M mix (commit 0c1e570), for
    the dense, non-Falcon architectures quantdyn walks (GPT-NeoX, LLaMA, GPT-2): ``layer`` is the tensor's
    block, which is also llama.cpp's running count of attn_v-like and ffn_down tensors when blocks are written
    in order; ``n_layers`` the number of blocks. Before the shape fallback (:func:`fallback_type`).

    * output (the head): Q6_K, or Q8_0 if its rows are not a multiple of 256;
    * attn_v and attn_qkv (llama.cpp counts both as attn_v-like): Q3_K_M -> Q5_K in the first 2 blocks
      else Q4_K; Q4_K_M / Q5_K_M -> Q6_K in the blocks where ``use_more_bits`` (the first and last eighth
      and every third in between), else the default;
    * ffn_down: Q3_K_M -> Q5_K in the first sixteenth, else Q4_K; Q4_K_M / Q5_K_M -> Q6_K where
      ``use_more_bits``;
    * attn_output: Q3_K_M -> Q4_K;
    * everything else: the mix's default type (Q3_K, Q4_K, Q5_K).
    """
    default = MIXES[mix]
    if category == "output":
        return "q8_0" if cols % QK_K else "q6_k"
    if category in ("attn_v", "attn_qkv"):
        if mix == "q3_k_m":
            return "q5_k" if layer < 2 else "q4_k"
        return "q6_k" if _use_more_bits(layer, n_layers) else default
    if category == "ffn_down":
        if mix == "q3_k_m":
            return "q5_k" if layer < n_layers // 16 else "q4_k"
        return "q6_k" if _use_more_bits(layer, n_layers) else default
    if category == "attn_output" and mix == "q3_k_m":
        return "q4_k"
    return default
