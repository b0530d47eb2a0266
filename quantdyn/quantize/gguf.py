"""GGUF block quantization (llama.cpp / ggml): Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the k-quants
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, without and with an importance matrix. One object per block type
(gguf-py's pattern): its layout, its quantization, dequantization, byte packing and unpacking, its bits
per weight and llama.cpp's fallback for it; adding a type is one new class here. llama.cpp's per-tensor
recipes (Q3_K_M, Q4_K_M, Q5_K_M) are in ``quantize.gguf_mixes``.

Reference: ggml's ``ggml-quants.c`` (functions ``quantize_row_<type>_ref``, used by
``ggml_quantize_chunk`` when no importance matrix is given, and ``quantize_row_<type>_impl``
with ``quant_weights``) and the block layouts of ``ggml-common.h``, read at llama.cpp commit 0c1e570
(2026-10-01, vendored by llama-cpp-python 0.3.36). K-quants: Kawrakow, llama.cpp PR #1684 (2023). No ggml
code is used here; the float32 arithmetic and scale searches are in ``quantize.ggml_float`` (which says how
they stay bit-identical to C), the bit packing in ``quantize.ggml_bytes``: codes, scales and dequantized
values are bit-identical to the reference (tests/test_formats_gguf.py checks them against bytes written by
ggml itself).

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
of x_j^2 (``quantize.formats.imatrix_from_stats``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from quantdyn.errors import QuantdynError
from quantdyn.quantize.ggml_bytes import (bit_columns, bytes_half, half_bytes, high_bits, nibbles, pack_q3_scales,
                                          pack_scale_min_k4, planes, unbit_columns, unhigh_bits, unnibbles,
                                          unpack_q3_scales, unpack_scale_min_k4, unplanes)
from quantdyn.quantize.ggml_float import (F32, GROUP_MAX_EPS, blocks, c32, expand, first_absmax, fp16, i8,
                                          make_q3_quants, make_qkx_quants, make_qp_quants, make_qx_quants, max0,
                                          nearest_int, requantize, roundf, row_sigma2, seq_sum, sqrtf, u8,
                                          unblocks, where)
from quantdyn.registry import Registry

QK = 32
"""Block of the legacy types (Q4_0 ... Q8_0)."""
QK_K = 256
"""Super-block of the k-quants."""

Fields = dict[str, torch.Tensor]


class BlockType:
    """One ggml block type. A subclass sets the layout (the class attributes below) and implements
    :meth:`quantize`, :meth:`pack` and :meth:`unpack`; the family bases implement :meth:`dequantize` and
    :meth:`step_and_zero`. Registered in :data:`GGML_TYPES` by :func:`_block_type`."""

    name: str
    """ggml's name (``q4_K``); quantdyn's labels use the lower-case form (``q4_k``)."""
    type_id: int
    """GGMLQuantizationType value in GGUF files."""
    file_type: int
    """llama.cpp's ``llama_ftype`` of a file of this type alone (a k-type's is its _S mix, whose default it is)."""
    block: int
    """Weights per block (the row length must be a multiple)."""
    type_size: int
    """Bytes per block."""
    bits: int
    """Bits of one code."""
    group: int
    """Weights sharing one (sub-block) scale."""
    fallback: str | None = None
    """llama.cpp's ``tensor_type_fallback`` for rows that are not a multiple of :attr:`block` (a type of
    32-weight blocks); None for the 32-weight types themselves."""
    takes_imatrix: bool = True
    """Whether ggml's quantizer uses an importance matrix for this type (Q8_0 ignores it)."""

    @property
    def bits_per_weight(self) -> float:
        return self.type_size * 8 / self.block

    def quantize(self, X: torch.Tensor, qw: torch.Tensor | None) -> tuple[torch.Tensor, Fields]:
        """``quantize_row_<type>_ref`` (``qw`` None) or ``_impl`` with the importance weights ``qw`` (1, cols) on
        X (rows, cols) float32: (codes (rows, cols) as float32 values, fields as :class:`GGUFQuant` holds them)."""
        raise NotImplementedError

    def dequantize(self, codes: torch.Tensor, fields: Fields) -> torch.Tensor:
        """``dequantize_row_<type>``: the float32 weight (rows, cols), operation for operation."""
        raise NotImplementedError

    def step_and_zero(self, fields: Fields) -> tuple[torch.Tensor, torch.Tensor]:
        """(step, zero), each (rows, cols // group): ``weight ~= step * (codes - zero)`` per group."""
        raise NotImplementedError

    def pack(self, L: torch.Tensor, fields: Fields) -> list[torch.Tensor]:
        """The parts of every block's bytes in file order, each (rows, blocks, n) byte values; L (rows, blocks,
        block) int32 codes."""
        raise NotImplementedError

    def unpack(self, B: torch.Tensor) -> tuple[torch.Tensor, Fields]:
        """Inverse of :meth:`pack`: B (rows, blocks, type_size) int32 bytes -> (codes (rows, blocks, block),
        fields)."""
        raise NotImplementedError


GGML_TYPES: Registry[BlockType] = Registry("GGUF block type")
"""The block types, by quantdyn's lower-case name."""


def _block_type(cls: type[BlockType]) -> type[BlockType]:
    """Register one instance of a block type class under its lower-case name."""
    GGML_TYPES.add(cls.name.lower(), cls())
    return cls


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
    def ggml(self) -> BlockType:
        return GGML_TYPES.get(self.type)

    def step_and_zero(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(step, zero), each (rows, cols // group): ``weight ~= step * (codes - zero)`` per group (exact for the
        symmetric types; for the types with a minimum ``zero = min / step``, 0 where the step is 0)."""
        return self.ggml.step_and_zero(self.fields)


def _per_group(codes: torch.Tensor, group: int) -> torch.Tensor:
    """(rows, cols) codes -> (rows, cols // group, group) float32."""
    return codes.to(F32).reshape(codes.shape[0], -1, group)


def _zero_where_no_step(step: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    return torch.where(step != 0, lo / step, torch.zeros_like(step))


# ----------------------------------------------------------------------------- the legacy types (32-weight blocks)


class _Legacy(BlockType):
    """Q4_0 ... Q8_0: one fp16 scale (and minimum) per block of 32."""

    block = QK
    group = QK

    def quantize(self, X, qw):
        rows, cols = X.shape
        x = blocks(X, QK)
        if qw is None:
            fields, L = self._ref(x)
        else:  # quantize_row_<type>_impl: weights qw * sqrt(sigma2 + x^2), sigma2 = mean x^2 over the whole row
            sigma2 = row_sigma2(X, 1, cols)
            s2 = expand(sigma2.repeat_interleave(cols // QK), QK)
            fields, L = self._impl(x, blocks(qw.expand(rows, cols), QK) * sqrtf(s2 + x * x))
        return unblocks(L, rows), {k: fp16(v).reshape(rows, -1) for k, v in fields.items()}

    def _ref(self, x: torch.Tensor) -> tuple[Fields, torch.Tensor]:
        """``quantize_row_<type>_ref`` on element-major blocks x (32, B): (float32 fields per block, L)."""
        raise NotImplementedError

    def _impl(self, x: torch.Tensor, w: torch.Tensor) -> tuple[Fields, torch.Tensor]:
        """``quantize_row_<type>_impl`` with the importance weights w (32, B)."""
        raise NotImplementedError


class _LegacySymmetric(_Legacy):
    """value = d * (L - zero_point)."""

    zero_point: int
    """Offset of the codes: half the levels."""

    def _ref(self, x):  # quantize_row_q4_0_ref / q5_0_ref
        half = self.zero_point
        _, mx = first_absmax(x)
        d = mx / c32(-half)
        idv = where(d != 0, 1 / d, torch.zeros_like(d))
        return dict(d=d), torch.clamp(torch.trunc(x * idv + c32(half + 0.5)), max=2 * half - 1)

    def _impl(self, x, w):
        d, L = make_qx_quants(x, self.zero_point, w)
        return dict(d=d), L

    def dequantize(self, codes, fields):
        rows = codes.shape[0]
        return ((_per_group(codes, QK) - self.zero_point) * fields["d"].float()[:, :, None]).reshape(rows, -1)

    def step_and_zero(self, fields):
        step = fields["d"].float()
        return step, torch.full_like(step, self.zero_point)


class _LegacyMin(_Legacy):
    """value = d * L + m."""

    nmax: int
    """Largest code."""
    clamps: bool
    """Whether ``_ref`` clamps the codes to nmax (ggml's Q4_1 does, Q5_1 does not)."""

    def _ref(self, x):  # quantize_row_q4_1_ref / q5_1_ref
        mn, mx = x.min(0).values, x.max(0).values
        d = (mx - mn) / c32(self.nmax)
        idv = where(d != 0, 1 / d, torch.zeros_like(d))
        L = torch.trunc((x - mn) * idv + c32(0.5))
        return dict(d=d, m=mn), (torch.clamp(L, max=self.nmax) if self.clamps else L)

    def _impl(self, x, w):
        scale, the_min, L = make_qkx_quants(x, w, self.nmax, -0.9, 0.05, 36, False)
        return dict(d=scale, m=-the_min), L

    def dequantize(self, codes, fields):
        rows = codes.shape[0]
        Lg = _per_group(codes, QK)
        return (Lg * fields["d"].float()[:, :, None] + fields["m"].float()[:, :, None]).reshape(rows, -1)

    def step_and_zero(self, fields):
        step = fields["d"].float()
        return step, _zero_where_no_step(step, -fields["m"].float())


@_block_type
class Q4_0(_LegacySymmetric):
    """block_q4_0: d (fp16), 16 bytes of nibbles."""

    name, type_id, file_type, type_size, bits, zero_point = "q4_0", 2, 2, 18, 4, 8

    def pack(self, L, fields):
        return [half_bytes(fields["d"]), nibbles(L)]

    def unpack(self, B):
        return unnibbles(B[..., 2:18]), dict(d=bytes_half(B, 0))


@_block_type
class Q4_1(_LegacyMin):
    """block_q4_1: d, m (fp16), 16 bytes of nibbles."""

    name, type_id, file_type, type_size, bits, nmax, clamps = "q4_1", 3, 3, 20, 4, 15, True

    def pack(self, L, fields):
        return [half_bytes(fields["d"]), half_bytes(fields["m"]), nibbles(L)]

    def unpack(self, B):
        return unnibbles(B[..., 4:20]), dict(d=bytes_half(B, 0), m=bytes_half(B, 2))


@_block_type
class Q5_0(_LegacySymmetric):
    """block_q5_0: d (fp16), qh (the fifth bits, uint32), 16 bytes of nibbles."""

    name, type_id, file_type, type_size, bits, zero_point = "q5_0", 6, 8, 22, 5, 16

    def pack(self, L, fields):
        return [half_bytes(fields["d"]), high_bits(L, 4, QK), nibbles(L)]

    def unpack(self, B):
        return unnibbles(B[..., 6:22]) | (unhigh_bits(B[..., 2:6], QK) << 4), dict(d=bytes_half(B, 0))


@_block_type
class Q5_1(_LegacyMin):
    """block_q5_1: d, m (fp16), qh (uint32), 16 bytes of nibbles."""

    name, type_id, file_type, type_size, bits, nmax, clamps = "q5_1", 7, 9, 24, 5, 31, False

    def pack(self, L, fields):
        return [half_bytes(fields["d"]), half_bytes(fields["m"]), high_bits(L, 4, QK), nibbles(L)]

    def unpack(self, B):
        codes = unnibbles(B[..., 8:24]) | (unhigh_bits(B[..., 4:8], QK) << 4)
        return codes, dict(d=bytes_half(B, 0), m=bytes_half(B, 2))


@_block_type
class Q8_0(_LegacySymmetric):
    """block_q8_0: d (fp16), 32 int8 (stored here as L = q + 128)."""

    name, type_id, file_type, type_size, bits, zero_point = "q8_0", 8, 7, 34, 8, 128
    takes_imatrix = False

    def _ref(self, x):  # quantize_row_q8_0_ref
        d = x.abs().max(0).values / c32(127)
        idv = where(d != 0, 1 / d, torch.zeros_like(d))
        return dict(d=d), roundf(x * idv) + 128

    def pack(self, L, fields):
        return [half_bytes(fields["d"]), (L - 128).to(torch.int8).view(torch.uint8)]

    def unpack(self, B):
        return B[..., 2:].to(torch.uint8).view(torch.int8).to(torch.int32) + 128, dict(d=bytes_half(B, 0))


# ----------------------------------------------------------------------------- the k-quants (256-weight super-blocks)


class _KQuant(BlockType):
    """A super-block of 256: an fp16 scale ``d`` and per sub-block a quantized scale ``sc``."""

    block = QK_K

    def _sub(self, fields: Fields) -> tuple[torch.Tensor, torch.Tensor]:
        """(d per sub-block (rows, sub-blocks, 1), sc (rows, sub-blocks, 1)) as float32."""
        rows = fields["d"].shape[0]
        dsub = fields["d"].float().repeat_interleave(self.block // self.group, 1)[:, :, None]
        return dsub, fields["sc"].float().reshape(rows, -1)[:, :, None]


class _KSigned(_KQuant):
    """value = (d * sc) * (L - zero_point), sc signed (Q3_K, Q6_K)."""

    zero_point: int
    """Offset of the codes: half the levels."""

    def dequantize(self, codes, fields):
        dsub, sc = self._sub(fields)
        return ((dsub * sc) * (_per_group(codes, self.group) - self.zero_point)).reshape(codes.shape[0], -1)

    def step_and_zero(self, fields):
        rows = fields["d"].shape[0]
        step = (fields["d"].float()[:, :, None] * fields["sc"].float()).reshape(rows, -1)
        return step, torch.full_like(step, self.zero_point)


class _KScaleMin(_KQuant):
    """value = (d * sc) * L - (dmin * mn), sc and mn unsigned (Q2_K, Q4_K, Q5_K)."""

    def dequantize(self, codes, fields):
        rows = codes.shape[0]
        dsub, sc = self._sub(fields)
        dmin = fields["dmin"].float().repeat_interleave(self.block // self.group, 1)[:, :, None]
        lo = dmin * fields["mn"].float().reshape(rows, -1)[:, :, None]
        return ((dsub * sc) * _per_group(codes, self.group) - lo).reshape(rows, -1)

    def step_and_zero(self, fields):
        rows = fields["d"].shape[0]
        step = (fields["d"].float()[:, :, None] * fields["sc"].float()).reshape(rows, -1)
        lo = (fields["dmin"].float()[:, :, None] * fields["mn"].float()).reshape(rows, -1)
        return step, _zero_where_no_step(step, lo)


@_block_type
class Q2_K(_KScaleMin):
    """block_q2_K: 16 bytes of (sc | mn << 4), 64 bytes of 2-bit codes, d, dmin (fp16)."""

    name, type_id, file_type, type_size, bits, group, fallback = "q2_K", 10, 10, 84, 2, 16, "q4_0"

    def quantize(self, X, qw):
        rows, cols = X.shape
        x = blocks(X, 16)  # (16, S) sub-blocks
        S = x.shape[1]
        if qw is None:  # quantize_row_q2_K_ref
            scales, mins, L = make_qkx_quants(x, x.abs(), 3, -0.5, 0.1, 15, True)
            sc_b, mn_b = scales.reshape(-1, 16), mins.reshape(-1, 16)  # (B, 16) per super-block
            max_scale = max0(sc_b)
            max_min = max0(mn_b)
            has_s, has_m = max_scale > 0, max_min > 0
            ls = where(has_s[:, None], u8(nearest_int((c32(15) / max_scale)[:, None] * sc_b)), torch.zeros_like(sc_b))
            lm = where(has_m[:, None], nearest_int((c32(15) / max_min)[:, None] * mn_b), torch.zeros_like(mn_b))
            byte = u8(ls.to(torch.int32) | (lm.to(torch.int32) << 4)).to(F32)
            d = fp16(where(has_s, max_scale / c32(15), torch.zeros_like(max_scale)))
            dmin = fp16(where(has_m, max_min / c32(15), torch.zeros_like(max_min)))
        else:  # quantize_row_q2_K_impl
            sigma2 = row_sigma2(X, 1, QK_K)
            s2 = expand(sigma2.repeat_interleave(16), 16)
            w = blocks(qw.expand(rows, cols), 16) * sqrtf(s2 + x * x)
            sw = seq_sum(w)
            scales, mins, L = make_qkx_quants(x, w, 3, -0.9, 0.05, 36, False)
            dm, Ls = make_qp_quants(scales.reshape(-1, 16).t().contiguous(), 15, sw.reshape(-1, 16).t().contiguous())
            mm, Lm = make_qp_quants(mins.reshape(-1, 16).t().contiguous(), 15, sw.reshape(-1, 16).t().contiguous())
            byte = u8(Ls.t().to(torch.int32) | (Lm.t().to(torch.int32) << 4)).to(F32)
            d, dmin = fp16(dm), fp16(mm)
        sc = (byte.to(torch.int32) & 0xF).to(F32)
        mn = (byte.to(torch.int32) >> 4).to(F32)
        step = (d.float()[:, None] * sc).reshape(S)
        lo = (dmin.float()[:, None] * mn).reshape(S)
        L = requantize(x, L, step, lo, 0, 3)
        fields = dict(d=d.reshape(rows, -1), dmin=dmin.reshape(rows, -1),
                      sc=sc.to(torch.uint8).reshape(rows, -1, 16), mn=mn.to(torch.uint8).reshape(rows, -1, 16))
        return unblocks(L, rows), fields

    def pack(self, L, fields):
        scales = fields["sc"].to(torch.int32) | (fields["mn"].to(torch.int32) << 4)
        qs = torch.cat([planes(L[..., h * 128:(h + 1) * 128], 32, 4) for h in range(2)], -1)
        return [scales, qs, half_bytes(fields["d"]), half_bytes(fields["dmin"])]

    def unpack(self, B):
        sc = B[..., 0:16]
        codes = torch.cat([unplanes(B[..., 16 + 32 * h:16 + 32 * (h + 1)], 4) for h in range(2)], -1)
        return codes, dict(d=bytes_half(B, 80), dmin=bytes_half(B, 82), sc=(sc & 0xF).to(torch.uint8),
                           mn=(sc >> 4).to(torch.uint8))


@_block_type
class Q3_K(_KSigned):
    """block_q3_K: hmask (the third bits, 32 bytes), 64 bytes of 2-bit codes, 12 bytes of 6-bit scales, d."""

    name, type_id, file_type, type_size, bits, group, zero_point, fallback = "q3_K", 11, 11, 110, 3, 16, 4, "q4_0"

    def quantize(self, X, qw):
        rows, cols = X.shape
        x = blocks(X, 16)
        S = x.shape[1]
        if qw is None:  # quantize_row_q3_K_ref
            scales, L = make_q3_quants(x, 4)
            sc_b = scales.reshape(-1, 16)
            amax, max_scale = first_absmax(sc_b.t())
            has = max_scale != 0
            iscale = c32(-32) / where(has, max_scale, torch.ones_like(max_scale))
            l = i8(nearest_int(iscale[:, None] * sc_b))  # noqa: E741
            Ls = where(has[:, None], torch.clamp(l, -32, 31) + 32, torch.zeros_like(l))
            d = fp16(where(has, 1 / iscale, torch.zeros_like(iscale)))
        else:  # quantize_row_q3_K_impl
            sigma2 = row_sigma2(X, 2, QK_K)
            s2 = expand(sigma2.repeat_interleave(16), 16)
            w = blocks(qw.expand(rows, cols), 16) * sqrtf(s2 + x * x)
            sw = seq_sum(w)
            scales, L = make_qx_quants(x, 4, w)
            db, Lsb = make_qx_quants(scales.reshape(-1, 16).t().contiguous(), 32, sw.reshape(-1, 16).t().contiguous())
            Ls, d = Lsb.t(), fp16(db)
        sc = Ls - 32  # the decoded signed scale (the 12 bytes hold exactly these 6 bits)
        step = (d.float()[:, None] * sc).reshape(S)
        L = requantize(x, L, step, None, -4, 3)
        L = where(expand(step, 16) != 0, L + 4, L)
        fields = dict(d=d.reshape(rows, -1), sc=sc.to(torch.int8).reshape(rows, -1, 16))
        return unblocks(L, rows), fields

    def pack(self, L, fields):
        rows, nb = L.shape[:2]
        qs = torch.cat([planes(L[..., h * 128:(h + 1) * 128] & 3, 32, 4) for h in range(2)], -1)
        sc = pack_q3_scales((fields["sc"].to(torch.int32) + 32).reshape(-1, 16).t()).t().reshape(rows, nb, 12)
        return [bit_columns(L, 2), qs, sc, half_bytes(fields["d"])]

    def unpack(self, B):
        rows, nb = B.shape[:2]
        low = torch.cat([unplanes(B[..., 32 + 32 * h:32 + 32 * (h + 1)], 4) for h in range(2)], -1)
        sc = unpack_q3_scales(B[..., 96:108].reshape(-1, 12).t()).t().reshape(rows, nb, 16)
        return low | (unbit_columns(B[..., 0:32]) << 2), dict(d=bytes_half(B, 108), sc=sc.to(torch.int8))


class _Q45K(_KScaleMin):
    """Q4_K and Q5_K: 8 sub-blocks of 32, 6-bit scales and mins packed in 12 bytes."""

    group = 32
    nmax: int
    """Largest code."""
    ref_search: tuple[float, int]
    """(rmin, nstep) of ``make_qkx2_quants`` in ``quantize_row_<type>_ref``."""

    def quantize(self, X, qw):
        rows, cols = X.shape
        nmax = self.nmax
        x = blocks(X, 32)  # (32, S)
        S = x.shape[1]
        if qw is None:  # quantize_row_q<4|5>_K_ref
            av_x = sqrtf(seq_sum(x * x) / c32(32))
            w = expand(av_x, 32) + x.abs()
            rmin, nstep = self.ref_search
            scales, mins, L = make_qkx_quants(x, w, nmax, rmin, 0.1, nstep, False)
            sc_b, mn_b = scales.reshape(-1, 8), mins.reshape(-1, 8)
            max_scale = max0(sc_b)
            max_min = max0(mn_b)
            inv_s = where(max_scale > 0, c32(63) / max_scale, torch.zeros_like(max_scale))
            inv_m = where(max_min > 0, c32(63) / max_min, torch.zeros_like(max_min))
            ls = torch.clamp(u8(nearest_int(inv_s[:, None] * sc_b)), max=63)
            lm = torch.clamp(u8(nearest_int(inv_m[:, None] * mn_b)), max=63)
            d, dmin = fp16(max_scale / c32(63)), fp16(max_min / c32(63))
        else:  # quantize_row_q<4|5>_K_impl
            sigma2 = row_sigma2(X, 2, QK_K)
            s2 = expand(sigma2.repeat_interleave(8), 32)
            w = blocks(qw.expand(rows, cols), 32) * sqrtf(s2 + x * x)
            sw = seq_sum(w).reshape(-1, 8).t().contiguous()
            scales, mins, L = make_qkx_quants(x, w, nmax, -0.9, 0.05, 36, False)
            db, Ls = make_qp_quants(scales.reshape(-1, 8).t().contiguous(), 63, sw)
            mb, Lm = make_qp_quants(mins.reshape(-1, 8).t().contiguous(), 63, sw)
            ls, lm = torch.clamp(Ls.t(), max=63), torch.clamp(Lm.t(), max=63)
            d, dmin = fp16(db), fp16(mb)
        step = (d.float()[:, None] * ls).reshape(S)
        lo = (dmin.float()[:, None] * lm).reshape(S)
        L = requantize(x, L, step, lo, 0, nmax)
        fields = dict(d=d.reshape(rows, -1), dmin=dmin.reshape(rows, -1),
                      sc=ls.to(torch.uint8).reshape(rows, -1, 8), mn=lm.to(torch.uint8).reshape(rows, -1, 8))
        return unblocks(L, rows), fields

    def _head(self, L: torch.Tensor, fields: Fields) -> list[torch.Tensor]:
        """d, dmin and the 12 scale bytes."""
        rows, nb = L.shape[:2]
        f = fields
        sc = pack_scale_min_k4(f["sc"].reshape(-1, 8).t(), f["mn"].reshape(-1, 8).t()).t().reshape(rows, nb, 12)
        return [half_bytes(f["d"]), half_bytes(f["dmin"]), sc]

    @staticmethod
    def _qs(L: torch.Tensor) -> torch.Tensor:
        """The low 4 bits of the codes, 128 bytes."""
        return torch.cat([planes(L[..., h * 64:(h + 1) * 64] & 0xF, 32, 2) for h in range(4)], -1)

    @staticmethod
    def _unpack_at(B: torch.Tensor, qs_offset: int) -> tuple[torch.Tensor, Fields]:
        """Low 4 bits of the codes (from ``qs_offset``) and the fields."""
        rows, nb = B.shape[:2]
        sc, mn = unpack_scale_min_k4(B[..., 4:16].reshape(-1, 12).t())
        codes = torch.cat([unplanes(B[..., qs_offset + 32 * h:qs_offset + 32 * (h + 1)], 2) for h in range(4)], -1)
        return codes, dict(d=bytes_half(B, 0), dmin=bytes_half(B, 2), sc=sc.t().reshape(rows, nb, 8).to(torch.uint8),
                           mn=mn.t().reshape(rows, nb, 8).to(torch.uint8))


@_block_type
class Q4_K(_Q45K):
    """block_q4_K: d, dmin (fp16), 12 scale bytes, 128 bytes of nibbles."""

    name, type_id, file_type, type_size, bits, fallback = "q4_K", 12, 14, 144, 4, "q5_0"
    nmax, ref_search = 15, (-1.0, 20)

    def pack(self, L, fields):
        return [*self._head(L, fields), self._qs(L)]

    def unpack(self, B):
        return self._unpack_at(B, 16)


@_block_type
class Q5_K(_Q45K):
    """block_q5_K: d, dmin (fp16), 12 scale bytes, qh (the fifth bits, 32 bytes), 128 bytes of nibbles."""

    name, type_id, file_type, type_size, bits, fallback = "q5_K", 13, 16, 176, 5, "q5_1"
    nmax, ref_search = 31, (-0.5, 15)

    def pack(self, L, fields):
        return [*self._head(L, fields), bit_columns(L, 4), self._qs(L)]

    def unpack(self, B):
        low, fields = self._unpack_at(B, 48)
        return low | (unbit_columns(B[..., 16:48]) << 4), fields


@_block_type
class Q6_K(_KSigned):
    """block_q6_K: ql (low 4 bits, 128 bytes), qh (high 2 bits, 64 bytes), 16 int8 scales, d (fp16)."""

    name, type_id, file_type, type_size, bits, group, zero_point, fallback = "q6_K", 14, 18, 210, 6, 16, 32, "q8_0"

    def quantize(self, X, qw):
        rows, cols = X.shape
        x = blocks(X, 16)
        S = x.shape[1]
        w = None if qw is None else blocks(qw.expand(rows, cols), 16)  # impl: weights = quant_weights as given
        scales, L = make_qx_quants(x, 32, w)
        sc_b = scales.reshape(-1, 16)
        max_abs, max_scale = first_absmax(sc_b.t())
        zero = max_abs < GROUP_MAX_EPS
        iscale = c32(-128) / where(zero, torch.ones_like(max_scale), max_scale)
        sc = where(zero[:, None], torch.zeros_like(sc_b), torch.clamp(nearest_int(iscale[:, None] * sc_b), max=127))
        d = fp16(where(zero, torch.zeros_like(iscale), 1 / iscale))
        step = (d.float()[:, None] * sc).reshape(S)
        L = requantize(x, L, step, None, -32, 31)
        L = where(expand(step, 16) != 0, L + 32, L)
        L = where(expand(zero.repeat_interleave(16), 16), torch.zeros_like(L), L)  # an all-zero block is memset
        fields = dict(d=d.reshape(rows, -1), sc=sc.to(torch.int8).reshape(rows, -1, 16))
        return unblocks(L, rows), fields

    def pack(self, L, fields):
        ql_parts, qh_parts = [], []
        for h in range(2):
            blk = L[..., h * 128:(h + 1) * 128]
            q1, q2, q3, q4 = (blk[..., 32 * k:32 * (k + 1)] for k in range(4))
            ql_parts += [(q1 & 0xF) | ((q3 & 0xF) << 4), (q2 & 0xF) | ((q4 & 0xF) << 4)]
            qh_parts.append((q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6))
        return [torch.cat(ql_parts, -1), torch.cat(qh_parts, -1), fields["sc"].to(torch.int8).view(torch.uint8),
                half_bytes(fields["d"])]

    def unpack(self, B):
        ql, qh = B[..., 0:128], B[..., 128:192]
        parts = []
        for h in range(2):
            a, b, hh = ql[..., 64 * h:64 * h + 32], ql[..., 64 * h + 32:64 * h + 64], qh[..., 32 * h:32 * (h + 1)]
            parts += [(a & 0xF) | ((hh & 3) << 4), (b & 0xF) | (((hh >> 2) & 3) << 4),
                      (a >> 4) | (((hh >> 4) & 3) << 4), (b >> 4) | (((hh >> 6) & 3) << 4)]
        return torch.cat(parts, -1), dict(d=bytes_half(B, 208), sc=B[..., 192:208].to(torch.uint8).view(torch.int8))


# ----------------------------------------------------------------------------- the public functions


def dequantize_fields(t: str, codes: torch.Tensor, fields: dict[str, torch.Tensor]) -> torch.Tensor:
    """ggml's ``dequantize_row_<type>`` on (codes, fields): the float32 weight, operation for operation."""
    return GGML_TYPES.get(t).dequantize(codes, fields)


def check_row_length(t: str, cols: int, what: str = "weight") -> None:
    """One-line error unless a row of ``cols`` weights splits into blocks of type ``t``."""
    g = GGML_TYPES.get(t)
    if cols % g.block:
        raise QuantdynError(f"{what} has rows of {cols} weights; GGUF {g.name} needs a multiple of {g.block} "
                            f"(llama.cpp falls back to another type: see quantize.gguf_mixes.fallback_type)")


def quantize_gguf(W: torch.Tensor, t: str, imatrix: torch.Tensor | None = None) -> GGUFQuant:
    """Quantize W (rows, cols) to ggml block type ``t`` (``q4_k`` ...), as ``ggml_quantize_chunk`` does:
    ``quantize_row_<t>_ref`` without an importance matrix, ``quantize_row_<t>_impl`` with one
    (``imatrix``: (cols,) non-negative weights per input column; Q8_0 ignores it, as ggml does)."""
    g = GGML_TYPES.get(t)
    if W.dim() != 2:
        raise QuantdynError(f"GGUF quantization needs a 2-D weight, got shape {tuple(W.shape)}")
    check_row_length(t, W.shape[1])
    X = W.detach().to(device="cpu", dtype=F32).contiguous()
    qw = None
    if imatrix is not None and g.takes_imatrix:
        qw = imatrix.detach().to(device="cpu", dtype=F32).reshape(1, -1)
        if qw.shape[1] != X.shape[1]:
            raise QuantdynError(f"importance matrix has {qw.shape[1]} entries but the weight has {X.shape[1]} columns")
        if not torch.isfinite(qw).all() or (qw < 0).any():
            raise QuantdynError("importance matrix must be finite and non-negative (mean x^2 per input column)")
    codes, fields = g.quantize(X, qw)
    codes = codes.to(torch.uint8)
    return GGUFQuant(t, codes, fields, g.dequantize(codes, fields))


def pack_gguf(q: GGUFQuant) -> torch.Tensor:
    """The ggml block bytes of ``q``: (rows, row_bytes) uint8, exactly what a GGUF file stores."""
    g = q.ggml
    rows = q.codes.shape[0]
    L = q.codes.to(torch.int32).reshape(rows, -1, g.block)
    parts = g.pack(L, q.fields)
    out = torch.cat([p.to(torch.int32) & 0xFF if p.dtype != torch.uint8 else p.to(torch.int32) for p in parts], -1)
    return out.to(torch.uint8).reshape(rows, L.shape[1] * g.type_size)


def unpack_gguf(data: torch.Tensor, t: str, cols: int) -> GGUFQuant:
    """Read ggml block bytes (rows, row_bytes) of type ``t`` back into codes and fields (and the dequantized
    weight): the inverse of :func:`pack_gguf`, used to compare with files llama.cpp wrote."""
    g = GGML_TYPES.get(t)
    rows = data.shape[0]
    codes, fields = g.unpack(data.reshape(rows, cols // g.block, g.type_size).to(torch.int32))
    codes = codes.reshape(rows, cols).to(torch.uint8)
    return GGUFQuant(t, codes, fields, g.dequantize(codes, fields))
