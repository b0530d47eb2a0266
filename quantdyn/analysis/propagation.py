"""Error propagation through the blocks (paper B, "Beyond Outliers", §error propagation).

For a full-precision network with blocks f_ℓ and its quantized copy with
blocks f^q_ℓ, run four forward passes per block ℓ = 1..L from the FP hidden
state h_{ℓ−1} and the quantized one h^q_{ℓ−1}:

    h_ℓ            = f_ℓ(h_{ℓ−1})          FP block, FP input
    f_ℓ(h^q_{ℓ−1})                          FP block, quantized input
    f^q_ℓ(h_{ℓ−1})                          quantized block, FP input
    h^q_ℓ          = f^q_ℓ(h^q_{ℓ−1})      quantized block, quantized input

With the error vectors (all tensors flattened; ‖·‖ is the Frobenius norm over
every token of every sequence, ⟨·,·⟩ the matching inner product)

    e = h^q_ℓ − h_ℓ                       total error
    a = f_ℓ(h^q_{ℓ−1}) − h_ℓ              error carried in from earlier blocks
    b = f^q_ℓ(h_{ℓ−1}) − h_ℓ              new error of quantizing block ℓ
    d = e − a − b                         interaction (0 if the block is affine
                                          in (input, weights) jointly)

the relative errors are

    R_ℓ = ‖e‖²/‖h_ℓ‖²,  A_ℓ = ‖a‖²/‖h_ℓ‖²,  B_ℓ = ‖b‖²/‖h_ℓ‖²,
    C_ℓ = (2⟨a,b⟩ + 2⟨a+b, d⟩ + ‖d‖²) / ‖h_ℓ‖²
        = C_cross + C_interaction  with  C_cross = 2⟨a,b⟩/‖h_ℓ‖²,
                                        C_interaction = (2⟨a+b,d⟩ + ‖d‖²)/‖h_ℓ‖²,

so that, since e = a + b + d, ‖e‖² = ‖a‖² + ‖b‖² + 2⟨a,b⟩ + 2⟨a+b,d⟩ + ‖d‖²
and **R_ℓ = A_ℓ + B_ℓ + C_ℓ exactly** (C is computed from its own formula, not
as a difference, so the identity is a check; sums are in float64).  The gain
G_ℓ = A_ℓ / R_{ℓ−1} measures how block ℓ amplifies (> 1) or damps (< 1) the
incoming relative error, with R_0 = ‖h^q_0 − h_0‖²/‖h_0‖² the error of the
block inputs (0 when the embedding is not quantized: then G_1 is undefined and
reported as None, as is any G_ℓ with R_{ℓ−1} = 0).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from quantdyn.errors import QuantdynError

BlockFn = Callable[[torch.Tensor], torch.Tensor]

_SUMS = ("hh", "ee", "aa", "bb", "ab", "abd", "dd")


def propagation_sums(
    fp_blocks: Sequence[BlockFn],
    q_blocks: Sequence[BlockFn],
    h0: torch.Tensor,
    h0_q: torch.Tensor | None = None,
) -> list[dict[str, float]]:
    """Raw float64 sums behind :func:`error_propagation` for one batch.

    Entry 0 describes the block inputs ({'hh': ‖h_0‖², 'ee': ‖h^q_0 − h_0‖²});
    entry ℓ >= 1 holds ‖h‖², ‖e‖², ‖a‖², ‖b‖², ⟨a,b⟩, ⟨a+b,d⟩, ‖d‖² of block ℓ.
    Sums over batches add, so callers with many batches accumulate these and
    call :func:`finalize_propagation` once.
    """
    if len(fp_blocks) != len(q_blocks):
        raise QuantdynError(
            f"error propagation: {len(fp_blocks)} full-precision blocks but {len(q_blocks)} quantized ones; "
            "the quantized model must have the same architecture"
        )
    if not fp_blocks:
        raise QuantdynError("error propagation: no blocks given")
    h = h0
    hq = h0 if h0_q is None else h0_q
    if hq.shape != h.shape:
        raise QuantdynError(f"error propagation: h0_q shape {tuple(hq.shape)} differs from h0 shape {tuple(h.shape)}")
    out = [input_sums(h, hq)]
    for f, fq in zip(fp_blocks, q_blocks):
        sums, h, hq = block_sums(f, fq, h, hq)
        out.append(sums)
    return out


def input_sums(h: torch.Tensor, hq: torch.Tensor) -> dict[str, float]:
    """Entry 0 of the sums: ‖h_0‖² and ‖h^q_0 − h_0‖² of the block inputs."""
    d0 = (hq - h).double()
    return {"hh": _sq(h), "ee": float((d0 * d0).sum())}


def block_sums(f: BlockFn, fq: BlockFn, h: torch.Tensor, hq: torch.Tensor) -> tuple[dict[str, float], torch.Tensor,
                                                                                        torch.Tensor]:
    """The sums of one block from its FP input ``h`` and quantized input ``hq`` (four forward passes);
    returns (sums, h_next, hq_next)."""
    h_next = f(h)  # FP block, FP input
    f_hq = f(hq)  # FP block, quantized input
    fq_h = fq(h)  # quantized block, FP input
    hq_next = fq(hq)  # quantized block, quantized input
    H = h_next.double()
    e = hq_next.double() - H
    a = f_hq.double() - H
    b = fq_h.double() - H
    d = e - a - b
    sums = {
        "hh": float((H * H).sum()),
        "ee": float((e * e).sum()),
        "aa": float((a * a).sum()),
        "bb": float((b * b).sum()),
        "ab": float((a * b).sum()),
        "abd": float(((a + b) * d).sum()),
        "dd": float((d * d).sum()),
    }
    return sums, h_next, hq_next


def _sq(x: torch.Tensor) -> float:
    x = x.double()
    return float((x * x).sum())


def finalize_propagation(sums: list[dict[str, float]]) -> list[dict]:
    """Turn accumulated sums into one row per block (see the module docstring).

    Row keys: block (0-based index), R, A, B, C, C_cross, C_interaction,
    R_prev (R_{ℓ−1}; R_0 for the first block), gain (A / R_prev, None when
    R_prev = 0), h_norm_sq (‖h_ℓ‖²)."""
    rows = []
    r_prev = sums[0]["ee"] / sums[0]["hh"] if sums[0]["hh"] > 0 else 0.0
    for i, s in enumerate(sums[1:]):
        hh = s["hh"]
        if hh == 0:
            raise QuantdynError(f"error propagation: block {i} output is all zeros; relative errors are undefined")
        c_cross = 2 * s["ab"] / hh
        c_inter = (2 * s["abd"] + s["dd"]) / hh
        A = s["aa"] / hh
        R = s["ee"] / hh
        rows.append(
            {
                "block": i,
                "R": R,
                "A": A,
                "B": s["bb"] / hh,
                "C": c_cross + c_inter,
                "C_cross": c_cross,
                "C_interaction": c_inter,
                "R_prev": r_prev,
                "gain": A / r_prev if r_prev > 0 else None,
                "h_norm_sq": hh,
            }
        )
        r_prev = R
    return rows


def error_propagation(
    fp_blocks: Sequence[BlockFn],
    q_blocks: Sequence[BlockFn],
    h0: torch.Tensor,
    h0_q: torch.Tensor | None = None,
) -> list[dict]:
    """Per-block R, A, B, C and gain (module docstring) for one input batch.

    ``fp_blocks[ℓ]`` and ``q_blocks[ℓ]`` are callables h -> h of the FP and
    quantized block ℓ (bind rope / masks into them); ``h0`` is the FP input of
    the first block and ``h0_q`` the quantized one (default: ``h0``).  Call it
    under ``torch.no_grad()`` for models.
    """
    return finalize_propagation(propagation_sums(fp_blocks, q_blocks, h0, h0_q))
