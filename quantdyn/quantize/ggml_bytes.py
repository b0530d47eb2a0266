"""The bit packing of ggml's blocks (``ggml-common.h``): the pieces every GGUF block type's ``pack`` and
``unpack`` (``quantize.gguf``) are assembled from. Tensors are (rows, blocks, ...) int32 byte values, the
last dim running over a block's bytes in file order.
"""
from __future__ import annotations

import torch


def half_bytes(x: torch.Tensor) -> torch.Tensor:
    """float16 (rows, blocks) -> its two little-endian bytes (rows, blocks, 2)."""
    return x.contiguous().view(torch.uint8).reshape(*x.shape, 2)


def bytes_half(B: torch.Tensor, offset: int) -> torch.Tensor:
    """The float16 stored at byte ``offset`` of every block of B (rows, blocks, type_size) -> (rows, blocks)."""
    return B[..., offset:offset + 2].to(torch.uint8).contiguous().view(torch.float16)[..., 0]


def planes(L: torch.Tensor, width: int, shifts: int) -> torch.Tensor:
    """Pack ``shifts`` groups of ``width`` consecutive codes into one byte each, group k at bit 8/shifts*k
    (the qs layout of every k-quant): (..., shifts * width) -> (..., width)."""
    L = L.to(torch.int32).reshape(*L.shape[:-1], shifts, width)
    bits = 8 // shifts
    out = torch.zeros_like(L[..., 0, :])
    for k in range(shifts):
        out |= (L[..., k, :] & ((1 << bits) - 1)) << (bits * k)
    return out


def unplanes(q: torch.Tensor, shifts: int) -> torch.Tensor:
    """Inverse of :func:`planes`."""
    bits = 8 // shifts
    q = q.to(torch.int32)
    return torch.cat([(q >> (bits * k)) & ((1 << bits) - 1) for k in range(shifts)], -1)


def nibbles(L: torch.Tensor) -> torch.Tensor:
    """The qs of the 32-weight types: code m in the low nibble of byte m, code 16 + m in its high nibble."""
    return (L[..., :16] & 0xF) | ((L[..., 16:] & 0xF) << 4)


def unnibbles(qs: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`nibbles`."""
    return torch.cat([qs & 0xF, qs >> 4], -1)


def high_bits(L: torch.Tensor, bit: int, n: int) -> torch.Tensor:
    """Q5_0/Q5_1: bit ``bit`` of each of the n codes of a block as a little-endian uint32 (4 bytes)."""
    hb = ((L.to(torch.int64) >> bit) & 1) << torch.arange(n, dtype=torch.int64)
    word = hb.sum(-1)
    return torch.stack([(word >> (8 * k)) & 0xFF for k in range(4)], -1)


def unhigh_bits(B: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`high_bits`: the 4 bytes (..., 4) -> one bit per code (..., n)."""
    word = sum(B[..., k].to(torch.int64) << (8 * k) for k in range(4))
    return ((word[..., None] >> torch.arange(n, dtype=torch.int64)) & 1).to(torch.int32)


def bit_columns(L: torch.Tensor, bit: int) -> torch.Tensor:
    """The hmask of Q3_K and qh of Q5_K: bit k of byte m is bit ``bit`` of code 32 k + m (..., 256) -> (..., 32)."""
    out = torch.zeros(*L.shape[:-1], 32, dtype=torch.int32)
    for k in range(8):
        out |= ((L[..., 32 * k:32 * (k + 1)] >> bit) & 1) << k
    return out


def unbit_columns(B: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`bit_columns`: 32 bytes (..., 32) -> one bit per code (..., 256)."""
    return torch.cat([(B >> k) & 1 for k in range(8)], -1)


def pack_scale_min_k4(ls: torch.Tensor, lm: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K: 8 six-bit scales and mins (8, B) -> the 12 scale bytes (12, B)."""
    ls, lm = ls.to(torch.int32), lm.to(torch.int32)
    out = torch.zeros(12, ls.shape[1], dtype=torch.int32)
    out[0:4] = ls[0:4] | ((ls[4:8] >> 4) << 6)
    out[4:8] = lm[0:4] | ((lm[4:8] >> 4) << 6)
    out[8:12] = (ls[4:8] & 0xF) | ((lm[4:8] & 0xF) << 4)
    return out.to(torch.uint8)


def unpack_scale_min_k4(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``get_scale_min_k4`` for j = 0..7 on (12, B) bytes -> (sc, m) each (8, B) int32."""
    q = q.to(torch.int32)
    sc = torch.cat([q[0:4] & 63, (q[8:12] & 0xF) | ((q[0:4] >> 6) << 4)])
    m = torch.cat([q[4:8] & 63, (q[8:12] >> 4) | ((q[4:8] >> 6) << 4)])
    return sc, m


def pack_q3_scales(Ls: torch.Tensor) -> torch.Tensor:
    """Q3_K: 16 six-bit scales (16, B) (stored value = scale + 32) -> the 12 scale bytes (12, B)."""
    l = Ls.to(torch.int32)  # noqa: E741
    out = torch.zeros(12, l.shape[1], dtype=torch.int32)
    out[0:8] = (l[0:8] & 0xF) | ((l[8:16] & 0xF) << 4)
    hi = l >> 4
    for j in range(16):
        out[8 + j % 4] |= hi[j] << (2 * (j // 4))
    return out.to(torch.uint8)


def unpack_q3_scales(q: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_q3_scales`: (12, B) bytes -> signed scales (16, B) int32 in [-32, 31]."""
    q = q.to(torch.int32)
    low = torch.cat([q[0:8] & 0xF, q[0:8] >> 4])
    hi = torch.stack([(q[8 + j % 4] >> (2 * (j // 4))) & 3 for j in range(16)])
    return (low | (hi << 4)) - 32
