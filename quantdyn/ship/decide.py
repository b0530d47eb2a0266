"""The decision of ``quantdyn ship``, as pure functions of measured options.

An :class:`Option` is one candidate (a checkpoint, an average) quantized one way, with the per-window CE of the
quantized model on the evaluation windows it was measured on. Every comparison is *paired*: two options are
compared window by window on the windows both were measured on, and the SE of the difference is the SE of the
per-window differences (the windows' shared difficulty cancels), with the quantization's run-to-run part added in
quadrature where repeats measured it (results/stats.py: :class:`~quantdyn.results.stats.Difference`, one verdict
rule, |z| > Z resolved).

* :func:`screen` — after a few windows: the options already beaten by the best at |z| > Z are dropped (with the
  difference and z that dropped them); the others go on to be measured in full (successive halving with the
  verdict rule as its cut).
* :func:`decide` — the best option (lowest mean CE(q)), the set statistically tied with it (|z| <= Z), the
  option to ship (among the tied: the smallest file, then the simplest recipe, then the lowest CE(q)) and its
  gain over the naive choice (naive − chosen, paired).
* :func:`naive_quantizer` — the naive choice's quantization: the single uniform type whose bits per weight are
  closest to the budget among those that fit it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from quantdyn.results.stats import Z, Difference, mean_se

RECIPES = ("checkpoint", "control", "cooldown", "ema", "lawa", "soup")
"""How a candidate was made, simplest first (the tie-break after the file size): a checkpoint as trained, then
a checkpoint of a branch, then averages (EMA kept by the trainer, LAWA over one run, a soup across branches)."""


def recipe_rank(how: str) -> int:
    """The place of ``how`` in :data:`RECIPES` (unknown recipes after every known one)."""
    return RECIPES.index(how) if how in RECIPES else len(RECIPES)


@dataclass(frozen=True)
class Option:
    """One candidate × quantization, measured."""

    candidate: str
    """The candidate's name (unique within a ship)."""
    quantizer: str
    """The quantization's label as ship names it (``q4_0``, ``gptq4``, ``auto@5``)."""
    bits_per_weight: float
    """Storage bits per weight of the quantized linears (what decides the file's size)."""
    window_ce: np.ndarray
    """Per-window CE of the quantized model (nats), in window order."""
    how: str = "checkpoint"
    """How the candidate was made (:data:`RECIPES`)."""
    run_se: float | None = None
    """Run-to-run SE of the mean CE over repeated quantizations (SD / sqrt(R)); None when not repeated."""
    uniform: bool = True
    """A single type for every linear (False: an allocated plan, a per-tensor recipe)."""

    @property
    def key(self) -> tuple[str, str]:
        return (self.candidate, self.quantizer)

    @property
    def ce_q(self) -> float:
        return float(np.mean(self.window_ce))

    @property
    def ce_q_se(self) -> float:
        """The SE of CE(q) over windows, with the run-to-run part: the error bar of one option alone (not the SE
        of a difference, which pairs windows)."""
        return math.hypot(mean_se(self.window_ce)[1], self.run_se or 0.0)


def paired(a: Option, b: Option) -> Difference:
    """CE(q) of a minus b, paired over the windows both were measured on (the first min(n_a, n_b) windows)."""
    n = min(len(a.window_ce), len(b.window_ce))
    if n == 0:
        raise ValueError(f"{a.key} and {b.key} share no evaluation window")
    wa, wb = np.asarray(a.window_ce[:n], dtype=np.float64), np.asarray(b.window_ce[:n], dtype=np.float64)
    runs = [r for r in (a.run_se, b.run_se) if r is not None]
    return Difference(float(wa.mean() - wb.mean()), mean_se(wa - wb)[1],
                      math.sqrt(sum(r * r for r in runs)) if runs else None, None, True)


def _resolved_worse(d: Difference, z: float) -> bool:
    return d.se > 0 and d.difference / d.se > z


def best_of(options: Sequence[Option]) -> Option:
    """The option of lowest mean CE(q) (ties: smaller file, simpler recipe, then by name: deterministic)."""
    return min(options, key=lambda o: (o.ce_q, o.bits_per_weight, recipe_rank(o.how), o.key))


@dataclass(frozen=True)
class Dropped:
    """An option the screen left out, and why."""

    option: Option
    beaten_by: Option
    difference: Difference
    """CE(q) of the dropped option minus the best's, on the screening windows."""

    def reason(self) -> str:
        d = self.difference
        return (f"{self.option.candidate} x {self.option.quantizer}: CE(q) {d.difference:+.4f} ± {d.se:.4f} above "
                f"{self.beaten_by.candidate} x {self.beaten_by.quantizer} on {len(self.option.window_ce)} windows "
                f"(z = {d.z:.1f} > {Z:g})")


def screen(options: Sequence[Option], z: float = Z, keep: Sequence[tuple[str, str]] = ()) -> tuple[list[Option], list[Dropped]]:
    """The options not already beaten at |z| > ``z`` by the best one (kept, in their order) and those that are
    (dropped, with the difference that dropped them). ``keep``: keys never dropped (the naive choice, whose
    full measurement the gain needs)."""
    if not options:
        return [], []
    best = best_of(options)
    kept, dropped = [], []
    for o in options:
        d = paired(o, best)
        if o is not best and o.key not in keep and _resolved_worse(d, z):
            dropped.append(Dropped(o, best, d))
        else:
            kept.append(o)
    return kept, dropped


@dataclass(frozen=True)
class Decision:
    """What to ship."""

    chosen: Option
    best: Option
    """The option of lowest mean CE(q) (the chosen one unless a tied option has a smaller file or simpler recipe)."""
    tied: tuple[tuple[Option, Difference], ...]
    """Every other option within |z| <= Z of the best, with its difference from the best (option − best)."""
    naive: Option | None
    gain: Difference | None
    """naive − chosen, paired (positive: the chosen option's quantized CE is lower)."""
    z: float = Z
    ranked: tuple[tuple[Option, Difference], ...] = field(default=())
    """Every option with its difference from the best, best first."""

    @property
    def gain_resolved(self) -> bool:
        return self.gain is not None and self.gain.se > 0 and abs(self.gain.difference / self.gain.se) > self.z


def decide(options: Sequence[Option], naive: tuple[str, str] | None = None, z: float = Z) -> Decision:
    """The decision over ``options`` (each measured on the same windows, in the same order); ``naive`` the key of
    the naive choice (None: none among the options). Raises ValueError without options."""
    if not options:
        raise ValueError("nothing to decide between: no option was measured")
    best = best_of(options)
    ranked = sorted(((o, paired(o, best)) for o in options), key=lambda x: (x[1].difference, x[0].key))
    tied = tuple((o, d) for o, d in ranked if o is not best and not (d.se > 0 and abs(d.difference / d.se) > z))
    pool = [best] + [o for o, _ in tied]
    chosen = min(pool, key=lambda o: (o.bits_per_weight, recipe_rank(o.how), not o.uniform, o.ce_q, o.key))
    by_key: Mapping[tuple[str, str], Option] = {o.key: o for o in options}
    nv = by_key.get(naive) if naive is not None else None
    gain = paired(nv, chosen) if nv is not None else None
    return Decision(chosen, best, tied, nv, gain, z, tuple(ranked))


def naive_quantizer(bpw: Mapping[str, float], budget: float) -> str | None:
    """The uniform type a person would pick without measuring: bits per weight closest to ``budget`` among the
    types that fit it (ties: by name); None when none fits."""
    fits = [(budget - b, q) for q, b in bpw.items() if b <= budget + 1e-9]
    return min(fits)[1] if fits else None
