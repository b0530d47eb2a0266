"""Bit allocation under a size budget: one type per tensor so that the summed predicted error is smallest while
the stored bits stay at or under the budget (a multiple-choice knapsack).

    choice = allocate({"l0": {"q3_k": (cost_bits, err), "q4_k": (...)}, ...}, budget_bits)

Exact dynamic programming over the budget, in units of the greatest common divisor of the costs. Why not only the
Lagrangian relaxation (minimise err + λ·bits per tensor, bisect λ): it reaches only the budgets on the convex hull
of the per-tensor curves, so it can leave up to one tensor's step of bits unused (on a 24-tensor model about
0.05-0.1 bits per weight, the tolerance the goals compare at), and it can never pick a point inside the hull. The
costs are integers (a tensor's bits per weight times its size: rows count bits exactly), so the DP is exact and
small: 24 tensors x 4 types x ~5,000 budget units at Pythia-70M shapes. Where the table would exceed
``max_cells`` (very large models, types whose costs share no large divisor) the Lagrangian solution is taken and
the bits it leaves are spent greedily on the upgrades with the best error drop per bit.

The errors are taken as additive over tensors (the sensitivity pass measures each tensor alone); what that
ignores, the pass's group and whole-model rows show.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import reduce

import numpy as np

from quantdyn.errors import QuantdynError

Curves = dict[str, dict[str, tuple[int, float]]]
"""tensor -> type -> (cost in bits, predicted error)."""


@dataclass(frozen=True)
class Allocation:
    """The chosen type per tensor."""

    choice: dict[str, str]
    """tensor -> type."""
    bits: int
    """Total cost in bits (<= the budget)."""
    error: float
    """Summed predicted error."""
    method: str
    """``knapsack-dp`` (exact) or ``lagrangian+greedy``."""


def _total(curves: Curves, choice: dict[str, str]) -> tuple[int, float]:
    return (sum(curves[t][c][0] for t, c in choice.items()), math.fsum(curves[t][c][1] for t, c in choice.items()))


def allocate(curves: Curves, budget_bits: int, max_cells: int = 200_000_000) -> Allocation:
    """The assignment of minimal summed error with total cost <= ``budget_bits``; a QuantdynError if even the
    cheapest types exceed it."""
    tensors = sorted(curves)
    if not tensors:
        raise QuantdynError("nothing to allocate: no tensors")
    cheapest = sum(min(c for c, _ in curves[t].values()) for t in tensors)
    if cheapest > budget_bits:
        raise QuantdynError(f"the budget of {budget_bits} bits is below the cheapest assignment ({cheapest} bits)")
    unit = reduce(math.gcd, (c for t in tensors for c, _ in curves[t].values()))
    capacity = budget_bits // unit
    if capacity * len(tensors) <= max_cells:
        return _dp(curves, tensors, unit, capacity)
    return _lagrangian(curves, tensors, budget_bits)


def _dp(curves: Curves, tensors: list[str], unit: int, capacity: int) -> Allocation:
    """best[c]: the least error of the tensors so far within c units; ``pick`` remembers each tensor's option."""
    best = np.zeros(capacity + 1)
    picks = []
    for t in tensors:
        opts = sorted(curves[t].items())
        new = np.full(capacity + 1, np.inf)
        pick = np.full(capacity + 1, -1, dtype=np.int16)
        for k, (_, (cost, err)) in enumerate(opts):
            w = cost // unit
            if w > capacity:
                continue
            cand = np.full(capacity + 1, np.inf)
            cand[w:] = best[: capacity + 1 - w] + err
            better = cand < new
            new[better], pick[better] = cand[better], k
        best = new
        picks.append((opts, pick))
    c = int(np.argmin(best))  # the least error within the whole capacity (best is non-increasing in c anyway)
    choice = {}
    for t, (opts, pick) in zip(reversed(tensors), reversed(picks)):
        k = int(pick[c])
        choice[t] = opts[k][0]
        c -= opts[k][1][0] // unit
    bits, error = _total(curves, choice)
    return Allocation(choice, bits, error, "knapsack-dp")


def _lagrangian(curves: Curves, tensors: list[str], budget_bits: int) -> Allocation:
    def at(lam: float) -> dict[str, str]:
        return {t: min(curves[t], key=lambda k: (curves[t][k][1] + lam * curves[t][k][0], curves[t][k][0]))
                for t in tensors}

    lo, hi = 0.0, 1.0
    while _total(curves, at(hi))[0] > budget_bits:
        hi *= 2
        if hi > 1e30:
            break
    if _total(curves, at(lo))[0] <= budget_bits:
        hi = lo
    for _ in range(200):
        mid = (lo + hi) / 2
        if _total(curves, at(mid))[0] <= budget_bits:
            hi = mid
        else:
            lo = mid
    choice = at(hi)
    spent, _ = _total(curves, choice)
    while True:  # greedy: the upgrade with the best error drop per bit that still fits
        best = None
        for t in tensors:
            c0, e0 = curves[t][choice[t]]
            for k, (c, e) in curves[t].items():
                if c > c0 and e < e0 and spent - c0 + c <= budget_bits:
                    gain = (e0 - e) / (c - c0)
                    if best is None or gain > best[0]:
                        best = (gain, t, k, c - c0)
        if best is None:
            break
        _, t, k, dc = best
        choice[t] = k
        spent += dc
    bits, error = _total(curves, choice)
    return Allocation(choice, bits, error, "lagrangian+greedy")


def check_types_hold(tensors: list[tuple[str, int, str, tuple[int, int]]], types: tuple[str, ...]) -> None:
    """One line, before any work, naming every candidate type some tensor (name, block, path, shape) cannot hold
    as it is -- the row widths it cannot hold, how many tensors have them, llama.cpp's fallback for each -- and the
    candidates that hold every tensor. A plan's tensor holds its type as it is (llama.cpp would silently store
    another type, which the sensitivity pass did not measure), so such a type is refused, all of them at once,
    rather than one per attempt after the sensitivity pass."""
    from quantdyn.quantize.plan import fallback_of  # a pure shape rule; plan.py never imports this module

    misfits: dict[str, tuple[dict[int, list[str]], str]] = {}  # type -> ({row width: tensors}, fallback)
    for name, _, _, shape in tensors:
        for t in types:
            try:
                alt = fallback_of(t, shape)
            except QuantdynError:  # rows fit no GGUF block at all (not a multiple of 32)
                alt = "f16"
            if alt is not None:
                widths, _ = misfits.setdefault(t, ({}, alt))
                widths.setdefault(int(shape[1]), []).append(name)
    if not misfits:
        return
    by_widths: dict[tuple[int, ...], list[str]] = {}
    for t, (widths, _) in misfits.items():
        by_widths.setdefault(tuple(sorted(widths)), []).append(t)
    parts = []
    for ws, ts in by_widths.items():
        tensors_at = [n for w in ws for n in misfits[ts[0]][0][w]]
        falls = ", ".join(f"{t}->{misfits[t][1]}" for t in ts)
        parts.append(f"{', '.join(ts)} cannot hold rows of {' or '.join(map(str, ws))} weights ({len(tensors_at)} "
                     f"tensor{'s' if len(tensors_at) > 1 else ''}, e.g. {tensors_at[0]}; llama.cpp would store them "
                     f"as its fallback {falls})")
    fit = [t for t in types if t not in misfits]
    fallbacks = list(dict.fromkeys(misfits[t][1] for t in misfits if misfits[t][1] != "f16"))
    keep = (f"of the types given, {', '.join(fit)} hold{'s' if len(fit) == 1 else ''} every tensor" if fit
            else "none of the types given holds every tensor")
    hint = f" (llama.cpp's own fallbacks: {','.join(fallbacks)})" if fallbacks else ""
    raise QuantdynError(f"{'; '.join(parts)}; {keep}. Drop {', '.join(misfits)} from --types, or allocate between "
                        f"types that hold every tensor{hint}, e.g. --types {','.join(dict.fromkeys(fit + fallbacks))}")
