"""Dense bit-packing of integer codes into int32 words (pure tensor functions).

Both export formats store sub-byte codes the same way along the packed dimension:
the codes of a row are read as one little-endian bit stream in which code ``i``
occupies bits ``[i*bits, (i+1)*bits)``; every 32 codes fill exactly ``bits`` words.
For 2, 4 and 8 bits this is the familiar "``32/bits`` codes per word, code ``j``
of a word at shift ``j*bits``"; for 3 bits it is the GPTQ "10 | 1 | 10 | 1 | 10"
layout, where codes 10 and 21 straddle word boundaries (GPTQModel
``_pack_rows_3``; compressed-tensors ``pack_to_int32`` since 0.18, which packs
every width from 1 to 8 this way). A row whose length is not a multiple of 32
is padded with zero codes and cut to ``ceil(n * bits / 32)`` words, which is
what both libraries allocate.

Words are stored as ``int32`` (two's complement of the unsigned 32-bit word).
Work is done in int64 on chunks of rows so that memory stays a small multiple
of the packed tensor.
"""
from __future__ import annotations

import math

import torch

from quantdyn.errors import QuantdynError

WORD_BITS = 32
"""Bits per packed word (int32)."""

_ROW_CHUNK = 2048
"""Rows packed per step (bounds the int64 temporaries to ~32 * 8 bytes * chunk * words)."""


def packed_words(n: int, bits: int) -> int:
    """Number of int32 words holding ``n`` codes of ``bits`` bits."""
    return math.ceil(n * bits / WORD_BITS)


def _check(bits: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise QuantdynError(f"cannot pack {bits!r}-bit codes; widths from 1 to 8 bits are supported")


def _layout(bits: int) -> list[tuple[int, int]]:
    """(word, shift) of each of the 32 codes of a group."""
    return [divmod(i * bits, WORD_BITS) for i in range(WORD_BITS)]


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words held in int64 -> the int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``codes`` (rows, n), integers in [0, 2^bits), along the last dim -> int32 (rows, ceil(n*bits/32))."""
    _check(bits)
    if codes.dim() != 2:
        raise QuantdynError(f"codes to pack must be 2-D, got shape {tuple(codes.shape)}")
    if codes.dtype.is_floating_point or codes.dtype == torch.bool:
        raise QuantdynError(f"codes to pack must be integers, got dtype {codes.dtype}")
    rows, n = codes.shape
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= 2**bits):
        raise QuantdynError(
            f"codes lie in [{int(codes.min())}, {int(codes.max())}], outside [0, {2**bits - 1}] of {bits} bits"
        )
    groups = math.ceil(n / WORD_BITS)
    n_words = packed_words(n, bits)
    layout = _layout(bits)
    out = torch.empty((rows, n_words), dtype=torch.int32)
    for r0 in range(0, rows, _ROW_CHUNK):
        chunk = codes[r0:r0 + _ROW_CHUNK].to(torch.int64)
        r = chunk.shape[0]
        padded = torch.zeros((r, groups * WORD_BITS), dtype=torch.int64)
        padded[:, :n] = chunk
        v = padded.view(r, groups, WORD_BITS)
        words = torch.zeros((r, groups, bits), dtype=torch.int64)
        for i, (w, s) in enumerate(layout):
            words[:, :, w] |= (v[:, :, i] << s) & 0xFFFFFFFF
            if s + bits > WORD_BITS:  # the code's high bits continue in the next word
                words[:, :, w + 1] |= v[:, :, i] >> (WORD_BITS - s)
        out[r0:r0 + r] = _to_int32(words.view(r, groups * bits)[:, :n_words])
    return out


def unpack_rows(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_rows`: int32 (rows, words) -> int32 codes (rows, n)."""
    _check(bits)
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise QuantdynError(f"packed codes must be a 2-D int32 tensor, got {packed.dtype} {tuple(packed.shape)}")
    rows, n_words = packed.shape
    if n_words != packed_words(n, bits):
        raise QuantdynError(
            f"{n_words} packed words per row cannot hold exactly {n} codes of {bits} bits "
            f"(expected {packed_words(n, bits)}); the tensor does not match its shape"
        )
    groups = math.ceil(n / WORD_BITS)
    layout = _layout(bits)
    mask = 2**bits - 1
    out = torch.empty((rows, n), dtype=torch.int32)
    for r0 in range(0, rows, _ROW_CHUNK):
        chunk = packed[r0:r0 + _ROW_CHUNK].to(torch.int64) & 0xFFFFFFFF
        r = chunk.shape[0]
        words = torch.zeros((r, groups * bits), dtype=torch.int64)
        words[:, :n_words] = chunk
        words = words.view(r, groups, bits)
        codes = torch.empty((r, groups, WORD_BITS), dtype=torch.int64)
        for i, (w, s) in enumerate(layout):
            c = words[:, :, w] >> s
            if s + bits > WORD_BITS:
                c = c | (words[:, :, w + 1] << (WORD_BITS - s))
            codes[:, :, i] = c & mask
        out[r0:r0 + r] = codes.view(r, groups * WORD_BITS)[:, :n].to(torch.int32)
    return out
