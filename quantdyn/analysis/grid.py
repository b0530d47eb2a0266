"""Is a checkpoint already quantized underneath? Distinct values per block of a weight.

A model distributed as GGUF (or any blockwise low-bit format) and dequantized back to float keeps its weights on
that format's grid: every 32-weight block along the input dimension holds at most 2^bits distinct values
(q4_0: <= 16, typically ~13 of them occur in 32 weights). A float-trained weight has 32 distinct values in
almost every block, in bfloat16 too. Every quantization error measured on grid weights is relative to that
grid, not to the float model the grid came from, and a rotation that mixes the grid's blocks (``+had``) then
destroys an exact low-bit representation (issue 50.8: rtn4+had 2.6x worse than rtn4 on such a model).

:func:`block_levels` counts the distinct values of a sample of blocks of one weight [out, in];
:func:`grid_verdict` turns the median count over a model's quantizable tensors into a verdict.

Threshold (``GRID_MAX_LEVELS`` = 24), from counts over 1,024 blocks of a 768x3072 N(0, 0.02²) weight (this
machine, 2026-11-28; tests/test_weight_grid.py asserts the same figures): float weights have median 32 in float32,
float16 and bfloat16 (bf16's 8-bit mantissa makes a few values collide: 1st percentile 29; Student-t(3) weights in
bf16 the same), q4_0/RTN4-dequantized weights median 13 (99th percentile 16), blockwise min-max grids of 8 levels
median 8, of 32 levels (5-bit) median 19, of 64 levels (6-bit) median 25. A median of at most 24 is out of reach of
float weights in any of these dtypes and names 3-, 4- and 5-bit grids by their bits (ceil(log2 median)); 6-bit and
finer grids are recorded (``weight_grid_levels``) without a verdict.
"""
from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

BLOCK = 32
"""Weights per block along the input dimension (GGUF's legacy and k-quant sub-blocks, q4_0's block)."""
MAX_BLOCKS = 1024
"""Blocks counted per tensor, evenly spaced over it (a 768x3072 weight has 73,728; a sample keeps the cost
to a sort of 32,768 values per tensor while the median of a count of at most 32 is still exact to a level)."""
GRID_MAX_LEVELS = 24
"""A median of at most this many distinct values per block is a low-bit grid (module docstring: float weights 32,
a 5-bit grid 19, a 6-bit grid 25)."""

__all__ = ["BLOCK", "GRID_MAX_LEVELS", "MAX_BLOCKS", "block_levels", "grid_bits", "grid_note", "grid_verdict",
           "median_levels", "rows_grid_note"]


def block_levels(W: torch.Tensor, block: int = BLOCK, max_blocks: int = MAX_BLOCKS) -> torch.Tensor:
    """Distinct values in each of up to ``max_blocks`` blocks of ``block`` consecutive weights along the input
    (last) dimension of ``W`` [out, in] (evenly spaced blocks; a remainder shorter than ``block`` at the end of a
    row is left out). Returns an int64 tensor [n blocks]; empty when a row is shorter than one block."""
    import torch  # here, not at the top: the notes below serve `quantdyn results` and the report, without torch

    if W.dim() != 2:
        raise ValueError(f"block_levels takes a 2-D weight [out, in], got shape {tuple(W.shape)}")
    out, n_in = W.shape
    per_row = n_in // block
    if per_row == 0 or out == 0:
        return torch.zeros(0, dtype=torch.int64)
    blocks = W.detach()[:, :per_row * block].reshape(out * per_row, block)
    if blocks.shape[0] > max_blocks:
        idx = torch.linspace(0, blocks.shape[0] - 1, max_blocks).round().long()
        blocks = blocks[idx]
    s = blocks.sort(dim=1).values  # in the weight's own dtype: distinct stored values, not float32 artefacts
    return (s[:, 1:] != s[:, :-1]).sum(dim=1) + 1


def median_levels(W: torch.Tensor, block: int = BLOCK) -> float | None:
    """The median of :func:`block_levels` for one weight; None when it has no whole block."""
    levels = block_levels(W, block)
    return float(levels.float().median()) if levels.numel() else None


def grid_bits(levels: float) -> int:
    """The bits of a grid whose blocks hold ``levels`` distinct values (median): ceil(log2(levels)), at least 1."""
    return max(1, math.ceil(math.log2(max(levels, 1.0))))


def grid_verdict(per_tensor: dict[str, float | None]) -> tuple[float | None, str | None]:
    """``(weight_grid_levels, weight_grid)`` for a model from its tensors' median levels: the median over the
    tensors that have a block, and e.g. "4-bit grid" (the bits of that median) when it is at most
    ``GRID_MAX_LEVELS``, else None (float weights, or a grid too fine to tell from float)."""
    vals = [v for v in per_tensor.values() if v is not None]
    if not vals:
        return None, None
    med = float(statistics.median(vals))
    return med, (f"{grid_bits(med)}-bit grid" if med <= GRID_MAX_LEVELS else None)


def grid_note(levels: float, verdict: str, where: str = "") -> str:
    """The sentence every output says about a checkpoint on a grid (``weight_grid`` ``verdict``, e.g. "4-bit
    grid", with ``weight_grid_levels`` ``levels``); ``where`` names the checkpoints when not all are."""
    return (f"weights already on a ~{verdict} ({levels:g} distinct values per {BLOCK}-weight block{where}): every "
            f"error here is relative to that grid, not to the float model it was made from")


def rows_grid_note(rows) -> str | None:
    """:func:`grid_note` for result rows: None when no row's checkpoint is on a grid; else the finest grid's bits
    and the median level count over the gridded checkpoints, naming them when only some are."""
    gridded: dict[str, tuple[float, str]] = {}
    every: set[str] = set()
    for r in rows:
        ck = str(r.get("checkpoint") or r.get("run") or "")
        if r.get("weight_grid_levels") is not None:
            every.add(ck)
        if r.get("weight_grid"):
            gridded[ck] = (float(r["weight_grid_levels"]), str(r["weight_grid"]))
    if not gridded:
        return None
    levels = float(statistics.median(v for v, _ in gridded.values()))
    verdict = max((v for _, v in gridded.values()), key=lambda s: int(s.split("-")[0]))
    where = "" if set(gridded) >= every else f"; {len(gridded)} of {len(every)} checkpoints: " + ", ".join(
        sorted(gridded)[:3]) + (", ..." if len(gridded) > 3 else "")
    return grid_note(levels, verdict, where)
