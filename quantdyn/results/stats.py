"""The statistics of result rows, and the one verdict rule.

Every mean ± SE, paired difference, bootstrap interval and verdict in quantdyn is computed here, so a
number means the same in a row, the demo's printout, the findings table and the report.

Mean and SE
    :func:`mean_se`: mean and standard error sqrt(s² / n) with the n − 1 variance (NaN SE for n < 2);
    :func:`se_of_mean`: the SE of the mean of k independent estimates, sqrt(Σ SE_i²) / k.

A row's uncertainty (:class:`Uncertainty`, :func:`uncertainty`, :func:`total_se`)
    A ptq row's Δ CE carries its paired SE over evaluation windows and, when the quantization was repeated
    R times, the SD over the repeats: SE_total = sqrt(SE_eval² + SD_run² / R) (:func:`combined_se`; the
    writers store it as ``delta_ce_total_se``), every error bar's and verdict's uncertainty; which part
    dominates (:func:`dominant`: EVAL or RUN). :func:`rel_delta_ce` reads Δ CE / CE(FP) (and
    :func:`rel_delta_ce_se` its error bar) from old rows too. results/schema.py says what each field
    means; this module computes.

Paired differences (:func:`paired_difference`)
    Row a minus row b. When both rows carry per-window values (``window_delta``) for the same evaluation
    windows, the difference is taken window by window and its SE is the SE of the per-window differences
    (the windows' shared difficulty cancels). "The same windows" means equal ``eval_hash``: rows whose
    hashes differ are never paired (their SEs add in quadrature); a row without a hash (written before the
    field) pairs on an equal window count. The run-to-run part sqrt(SD_a²/R_a + SD_b²/R_b) is added in
    quadrature (the two quantizations are independent draws), None when neither row repeated its
    quantization. The same pairing sets a row against its checkpoint's bf16 noise floor
    (:func:`floor_difference`, :func:`within_noise_floor`).

The verdict rule (:class:`Effect`, :func:`verdict_sign`)
    An effect is resolved when |z| > Z (default 2), z = effect / SE, where SE is its combined uncertainty:

        within = sqrt(SE_windows² + SE_run² + SE_jitter²)
        SE     = max(within, SE_seeds)          (SE_seeds only with two or more seeds)

    * SE_windows: the paired SE over evaluation windows;
    * SE_run: the run-to-run SE of the quantization (rows with quant_repeats R > 1; else not measured);
    * SE_jitter: the stable-phase jitter (:func:`stable_jitter`), only where the comparison is along a
      trajectory — a decayed endpoint against its constant-LR control. It is the scatter of ONE
      checkpoint's Δ CE about the smooth trend of constant-LR training, so a single decayed-minus-control
      difference carries it as one more independent noise source, added in quadrature. (It already holds
      that checkpoint's own window and single-quantization noise, so adding it to SE_windows and SE_run
      counts those twice: the rule errs towards "not resolved".)
    * over k seeds each part is combined as sqrt(Σ part_i²) / k, and SE_seeds = SD of the per-seed
      effects / √k; the seeds' spread already contains the other parts, and taking the larger keeps a
      few seeds from over-claiming.

    A resolved effect has a direction (its sign); an unresolved one, or one whose SE is unknown (None,
    NaN, 0), has none. The words: a paper's claim is "reproduced" (the paper's sign), "opposite" or "not
    resolved at this scale"; a decayed-minus-control difference "decay raises the error", "decay lowers
    the error" or "within uncertainty (|z| <= 2)". Intervals (correlations): resolved when the interval
    excludes 0. :data:`VERDICTS` is the one table of the words with their tone and colour (page and figures).

Printing (:func:`format_estimate`, :func:`format_interval`)
    Numbers are printed with as many significant digits as it takes for the printed numbers to agree with
    the printed verdict: the printed z, and the printed effect over the printed SE, are beyond Z exactly
    when the verdict is resolved (0.00201 ± 0.00100 rather than 0.0020 ± 0.0010 for z = 2.01).

Bootstrap (:func:`bootstrap_intervals`)
    Percentile intervals over resamples of n rows with replacement, for one or several statistics computed
    on the same resamples; resamples where a statistic is undefined (NaN) are dropped and counted.

Numbers are read from rows with :func:`quantdyn.results.schema.number` (finite reals; anything else is
"not measured").
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Sequence

import numpy as np

from quantdyn.results.schema import PTQ, number
from quantdyn.runs import control_of

Z = 2.0
"""The default verdict threshold: resolved when |z| > Z."""

# ------------------------------------------------------------------ mean and SE


def mean_se(values) -> tuple[float, float]:
    """Mean and standard error (n − 1 variance) of ``values`` (a sequence, numpy array or CPU tensor), in
    float64; the SE is NaN for fewer than two values, both are NaN for none."""
    x = np.asarray(values, dtype=np.float64).ravel()
    if x.size == 0:
        return math.nan, math.nan
    mean = float(x.mean())
    if x.size < 2:
        return mean, math.nan
    return mean, float(x.std(ddof=1) / math.sqrt(x.size))


def se_of_mean(ses: Sequence[float]) -> float:
    """The SE of the mean of k independent estimates with SEs ``ses``: sqrt(Σ SE_i²) / k."""
    if not ses:
        raise ValueError("se_of_mean needs at least one SE")
    return math.sqrt(sum(float(s) ** 2 for s in ses)) / len(ses)


# ------------------------------------------------------------------ what a row carries: Δ CE / CE(FP), its uncertainty


def rel_delta_ce(row: dict) -> float | None:
    """Δ CE / CE(FP): the row's ``rel_delta_ce``, else ``delta_ce / ce_fp`` (rows written before the field);
    None when neither can be read."""
    v = number(row.get("rel_delta_ce"))
    if v is not None:
        return v
    d, fp = number(row.get("delta_ce")), number(row.get("ce_fp"))
    return d / fp if d is not None and fp else None


EVAL = "evaluation windows"
"""``uncertainty_dominant`` when the evaluation windows' SE is the larger part."""
RUN = "quantization run"
"""``uncertainty_dominant`` when the run-to-run part SD_run/√R is the larger."""


def combined_se(eval_se: float, run_sd: float | None, repeats: int) -> float:
    """sqrt(SE_eval² + SD_run² / R): the uncertainty of a Δ CE averaged over R quantizations (SD_run None:
    not measured, the evaluation SE alone)."""
    return math.sqrt(eval_se ** 2 + (run_sd or 0.0) ** 2 / repeats)


def dominant(eval_se: float, run_se: float | None) -> str:
    """Which part of an uncertainty is the larger: RUN when run_se exceeds eval_se, else EVAL (also when the
    run-to-run part was not measured)."""
    return RUN if run_se is not None and run_se > eval_se else EVAL


def repeats(row: dict) -> int:
    """R, the number of quantizations the row's Δ CE averages (1 when absent)."""
    r = number(row.get("quant_repeats"))
    return int(r) if r and r >= 1 else 1


@dataclass(frozen=True)
class Uncertainty:
    """The parts of a Δ CE's uncertainty and their combination.

    A ptq row's ``delta_ce_se`` is the paired SE over evaluation windows; it is blind to what re-quantizing
    the same checkpoint changes (calibration draw, float order), which a row measures when it repeats the
    quantization R times (``quant_repeats``, ``delta_ce_run_sd``). The uncertainty of the mean is
    SE_total = sqrt(SE_eval² + SD_run² / R); every error bar and every verdict uses it."""

    eval_se: float
    """Paired SE over evaluation windows (``<prefix>_se``; 0 when missing)."""
    run_sd: float | None
    """SD over the R repeated quantizations (None when R = 1: not measured)."""
    repeats: int
    """R."""
    total_se: float
    """The combined SE: the row's stored ``<prefix>_total_se`` when it has one, else combined_se()."""

    @property
    def run_se(self) -> float | None:
        """The run-to-run part of the SE of the mean, SD_run / √R (None when not measured)."""
        return None if self.run_sd is None else self.run_sd / math.sqrt(self.repeats)

    @property
    def dominant(self) -> str:
        """RUN when SD_run/√R exceeds the evaluation SE, else EVAL."""
        return dominant(self.eval_se, self.run_se)


def uncertainty(row: dict, prefix: str = "delta_ce") -> Uncertainty:
    """The uncertainty of ``row[prefix]`` (``delta_ce``, or ``kl`` with ``kl_se``/``kl_run_sd``).

    A stored ``<prefix>_total_se`` is taken as it is (the writer's own combination); otherwise it is
    combined from the parts, missing parts counting as 0 (a verdict treats a total of 0 as unknown)."""
    eval_se = number(row.get(f"{prefix}_se")) or 0.0
    R = repeats(row)
    sd = number(row.get(f"{prefix}_run_sd")) if R > 1 else None
    stored = number(row.get(f"{prefix}_total_se"))
    return Uncertainty(eval_se, sd, R, stored if stored is not None else combined_se(eval_se, sd, R))


def total_se(row: dict, prefix: str = "delta_ce") -> float:
    """The error bar of ``row[prefix]``: its combined uncertainty (:class:`Uncertainty`)."""
    return uncertainty(row, prefix).total_se


def rel_delta_ce_se(row: dict) -> float:
    """The error bar of rel_delta_ce: total_se / CE(FP) (0 without CE(FP))."""
    fp = number(row.get("ce_fp"))
    return total_se(row) / fp if fp else 0.0


# ------------------------------------------------------------------ paired differences


@dataclass(frozen=True)
class Difference:
    """One quantity of row a minus row b, with the parts of its uncertainty."""

    difference: float
    """a − b."""
    eval_se: float
    """SE over evaluation windows: paired when ``paired``, else the two rows' SEs in quadrature."""
    run_se: float | None = None
    """Run-to-run SE, sqrt(SD_a²/R_a + SD_b²/R_b) (None when neither row repeated its quantization)."""
    jitter: float | None = None
    """The stable-phase jitter, for a comparison along a trajectory (None: not part of this comparison)."""
    paired: bool = False
    """Whether the evaluation windows were paired one by one."""

    @property
    def se(self) -> float:
        """The combined uncertainty, sqrt(eval_se² + run_se² + jitter²)."""
        return math.sqrt(self.eval_se ** 2 + (self.run_se or 0.0) ** 2 + (self.jitter or 0.0) ** 2)

    @property
    def z(self) -> float:
        """difference / se (NaN when se is 0)."""
        return z_of(self.difference, self.se)

    @property
    def dominant(self) -> str:
        """Which of the measurement's parts (windows or quantization run) is the larger."""
        return dominant(self.eval_se, self.run_se)


def same_windows(a: Mapping, b: Mapping) -> bool:
    """Whether rows a and b were evaluated on the same windows as far as their ``eval_hash`` can tell:
    equal hashes, or a hash missing on either (rows written before the field)."""
    ha, hb = a.get("eval_hash"), b.get("eval_hash")
    return ha is None or hb is None or ha == hb


def window_values(row: Mapping, metric: str = "delta_ce",
                  fp_windows: Mapping[str, Sequence[float]] | None = None) -> np.ndarray | None:
    """The per-window values of ``metric`` of a row: ``window_delta`` for delta_ce; for ce_q (the quantized
    model's CE) the FP window CE of the row's checkpoint (``fp_windows[checkpoint]``) plus window_delta.
    None when the row does not carry them."""
    if metric == "kl":  # KL(FP ‖ Q) per window (rows since the sensitivity work; None before)
        wk = row.get("window_kl")
        return np.asarray(wk, dtype=np.float64) if wk else None
    wd = row.get("window_delta")
    if not wd:
        return None
    if metric == "delta_ce":
        return np.asarray(wd, dtype=np.float64)
    if metric != "ce_q":
        raise ValueError(f"no per-window values of {metric!r}: delta_ce or ce_q")
    fp = (fp_windows or {}).get(str(row.get("checkpoint")))
    if fp is None or len(fp) != len(wd):
        return None
    return np.asarray(fp, dtype=np.float64) + np.asarray(wd, dtype=np.float64)


def paired_difference(a: Mapping, b: Mapping, metric: str = "delta_ce",
                      fp_windows: Mapping[str, Sequence[float]] | None = None) -> Difference:
    """``metric`` of row a minus row b (see the module docstring).

    metric = delta_ce: per-window Δ CE paired window by window when both rows carry ``window_delta`` for
    the same windows (:func:`same_windows`), else the rows' ``delta_ce_se`` in quadrature.
    metric = ce_q: per-window CE(q) = FP window CE (``fp_windows[checkpoint]``) + window_delta, paired the
    same way; without FP windows the FP CE's own SEs (``ce_fp_se``: window-to-window spread, much larger
    than a paired SE) stand in. metric = kl: the per-window KL(FP ‖ Q) (``window_kl``) paired the same way,
    else the rows' ``kl_se`` in quadrature (the run-to-run part is Δ CE's, the only one rows measure)."""
    if metric not in ("delta_ce", "ce_q", "kl"):
        raise ValueError(f"paired_difference of {metric!r}: delta_ce, ce_q or kl")
    d = float(a[metric]) - float(b[metric])
    wa, wb = window_values(a, metric, fp_windows), window_values(b, metric, fp_windows)
    paired = wa is not None and wb is not None and len(wa) == len(wb) and len(wa) > 1 and same_windows(a, b)
    if paired:
        eval_se = mean_se(wa - wb)[1]
    else:
        se_key = {"delta_ce": "delta_ce_se", "kl": "kl_se"}.get(metric, "ce_fp_se")
        eval_se = math.hypot(number(a.get(se_key)) or 0.0, number(b.get(se_key)) or 0.0)
    runs = [u.run_se for u in (uncertainty(dict(a)), uncertainty(dict(b))) if u.run_se is not None]
    run_se = math.sqrt(sum(r * r for r in runs)) if runs else None
    return Difference(d, eval_se, run_se, None, paired)


# ------------------------------------------------------------------ the stable-phase jitter


def stable_jitter(rows: Sequence[Mapping], peak_rtol: float = 1e-6) -> float | None:
    """Checkpoint-to-checkpoint scatter of Δ CE over a run's stable phase: the SD of the residuals of the
    main run's peak-LR, not-decaying checkpoints about a least-squares line in tokens (n − 2 degrees of
    freedom). ``rows``: one quantizer's ptq rows of one run.

    Δ CE drifts over the stable phase (at constant LR it usually grows with tokens); the line removes that
    drift, which the constant-LR control already carries in a decayed-minus-control difference, so what is
    left is the noise of one checkpoint such a difference must exceed. None with fewer than 4 checkpoints."""
    main = [r for r in rows if r.get("branch") == "main" and number(r.get("lr")) is not None
            and not r.get("decaying") and number(r.get("tokens")) is not None and number(r.get("delta_ce")) is not None]
    if not main:
        return None
    peak = max(number(r["lr"]) for r in main)
    pts = [(number(r["tokens"]), number(r["delta_ce"])) for r in main if number(r["lr"]) >= peak * (1 - peak_rtol)]
    if len(pts) < 4:
        return None
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    slope = sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx > 0 else 0.0
    res = [y - my - slope * (x - mx) for x, y in pts]
    return math.sqrt(sum(e * e for e in res) / (n - 2))


# ------------------------------------------------------------------ combining and the verdict rule


def z_of(effect: float | None, se: float | None) -> float:
    """effect / se; NaN when either is unknown or se is not positive."""
    e, s = number(effect), number(se)
    return e / s if e is not None and s is not None and s > 0 else math.nan


@dataclass(frozen=True)
class Effect:
    """An effect (a difference, or the mean of per-seed differences) with its uncertainty in parts and the
    combination the verdict uses (the module docstring's rule)."""

    effect: float
    """The (mean) difference."""
    se_windows: float | None
    """Paired SE over evaluation windows, sqrt(Σ SE_i²) / k over seeds (None: the measurement gives none)."""
    se_run: float | None
    """Run-to-run SE of the quantization, combined alike (None: not measured, R = 1)."""
    se_jitter: float | None
    """Stable-phase jitter, combined alike (None: not a comparison along a trajectory, or too few checkpoints)."""
    se_seeds: float | None
    """SD of the per-seed effects / √k (None with one seed)."""
    n_seeds: int
    """k."""
    per_seed: tuple[float, ...]
    """Each seed's effect."""

    @property
    def se_within(self) -> float:
        """sqrt(se_windows² + se_run² + se_jitter²)."""
        return math.sqrt(sum(x * x for x in (self.se_windows, self.se_run, self.se_jitter) if x is not None))

    @property
    def se(self) -> float:
        """The combined uncertainty: max(se_within, se_seeds)."""
        return max(self.se_within, self.se_seeds or 0.0)

    @property
    def z(self) -> float:
        return z_of(self.effect, self.se)

    @property
    def same_sign(self) -> bool:
        """Whether every seed's effect has the same (nonzero) sign."""
        return all(x > 0 for x in self.per_seed) or all(x < 0 for x in self.per_seed)

    def fields(self) -> dict:
        """The effect as row fields (findings tables, JSON, CSV)."""
        return {"effect": self.effect, "se": self.se, "se_windows": self.se_windows, "se_run": self.se_run,
                "se_jitter": self.se_jitter, "se_seeds": self.se_seeds, "z": self.z, "n_seeds": self.n_seeds,
                "per_seed": list(self.per_seed)}


def _combined_part(values: Sequence[float | None], k: int) -> float | None:
    got = [v for v in values if v is not None]
    return math.sqrt(sum(v * v for v in got)) / k if got else None


def combine(per_seed: Sequence[Difference]) -> Effect:
    """The mean of per-seed differences and its uncertainty in parts (the module docstring's rule)."""
    k = len(per_seed)
    if k == 0:
        raise ValueError("combine needs at least one difference")
    diffs = [float(p.difference) for p in per_seed]
    between = statistics.stdev(diffs) / math.sqrt(k) if k >= 2 else None
    return Effect(statistics.fmean(diffs), _combined_part([p.eval_se for p in per_seed], k),
                  _combined_part([p.run_se for p in per_seed], k), _combined_part([p.jitter for p in per_seed], k),
                  between, k, tuple(diffs))


def decay_difference(decayed: Mapping, control: Mapping, jitter: float | None) -> Difference:
    """A decayed endpoint minus its constant-LR control: paired over windows, the run-to-run part, and the
    stable-phase jitter of the run and quantizer (a comparison along a trajectory)."""
    return replace(paired_difference(decayed, control), jitter=jitter)


def floor_difference(row: Mapping, fp_row: Mapping) -> Difference | None:
    """A ptq row's Δ CE minus its checkpoint's bf16 noise floor (the fp row's ``floor_delta_ce``, with
    ``floor_window_delta`` to pair window by window), as :func:`paired_difference`; None when the fp row carries
    no floor (written before it, or measured without it)."""
    if number(fp_row.get("floor_delta_ce")) is None or number(row.get("delta_ce")) is None:
        return None
    floor = {"delta_ce": fp_row["floor_delta_ce"], "delta_ce_se": fp_row.get("floor_delta_ce_se"),
             "window_delta": fp_row.get("floor_window_delta"), "eval_hash": fp_row.get("eval_hash")}
    return paired_difference(row, floor)


def within_noise_floor(row: Mapping, fp_row: Mapping, z: float = Z) -> bool | None:
    """Whether a ptq row's Δ CE sits inside its checkpoint's noise floor: Δ CE − floor Δ CE is not resolved above
    0 (at most z times its paired SE; at most 0 when that SE is unknown). None without a floor."""
    d = floor_difference(row, fp_row)
    if d is None:
        return None
    se = number(d.se)
    return d.difference <= (z * se if se is not None else 0.0)


def verdict_sign(effect: float | None, se: float | None, z: float = Z) -> int:
    """The one verdict rule: +1 or −1 (the effect's sign) when |effect / se| > z, 0 when the effect lies
    inside z·se or either is unknown (None, NaN, ±inf, se <= 0)."""
    t = z_of(effect, se)
    if math.isnan(t) or abs(t) <= z:
        return 0
    return 1 if t > 0 else -1


def interval_sign(lo: float | None, hi: float | None) -> int:
    """+1 when an interval lies above 0, −1 below, 0 when it holds 0 or is unknown."""
    lo, hi = number(lo), number(hi)
    if lo is None or hi is None:
        return 0
    return 1 if lo > 0 else -1 if hi < 0 else 0


REPRODUCED = "reproduced"
OPPOSITE = "opposite"
NOT_RESOLVED = "not resolved at this scale"
DECAY_RAISES = "decay raises the error"
DECAY_LOWERS = "decay lowers the error"


@dataclass(frozen=True)
class Verdict:
    """A verdict on a paper's claim and how it is shown, the same on the page, in every figure and in print."""

    word: str
    """The verdict (REPRODUCED, OPPOSITE, NOT_RESOLVED)."""
    tone: str
    """The tone of its sentence on the page: 'yes', 'no' or 'unresolved' (report Section.sentences)."""
    colour: str
    """Its colour: the page's dot and words, the findings' figures."""
    legend: str
    """Its legend in a figure; ``{z:g}`` is the threshold."""


VERDICTS: dict[str, Verdict] = {v.word: v for v in (
    Verdict(REPRODUCED, "yes", "#1a7f37", "reproduced: resolved (|z| > {z:g}) with the paper's sign"),
    Verdict(OPPOSITE, "no", "#b42318", "opposite: resolved (|z| > {z:g}) against the paper's sign"),
    Verdict(NOT_RESOLVED, "unresolved", "#6e6e6e", "not resolved at this scale (|z| ≤ {z:g})"),
)}
"""The verdict words and their tones and colours: the one table (green: the paper's sign, red: against it, grey:
not resolved)."""
TONES: dict[str, str] = {v.tone: v.colour for v in VERDICTS.values()}
"""Tone -> colour, for the page's sentences."""


def verdict_of(word: str | None) -> Verdict:
    """How the verdict ``word`` is shown (any other word, e.g. "no finding": as not resolved)."""
    return VERDICTS.get(str(word), VERDICTS[NOT_RESOLVED])


def claim_verdict(sign: int, expected: int) -> str:
    """A paper's claim against a resolved direction: reproduced (the paper's sign), opposite, or not resolved."""
    if sign == 0:
        return NOT_RESOLVED
    return REPRODUCED if (sign > 0) == (expected > 0) else OPPOSITE


def within_uncertainty(z: float = Z) -> str:
    return f"within uncertainty (|z| <= {z:g})"


def decay_verdict(sign: int, z: float = Z) -> str:
    """The words for a decayed-minus-control difference: decay raises / lowers the error, or within uncertainty."""
    return DECAY_RAISES if sign > 0 else DECAY_LOWERS if sign < 0 else within_uncertainty(z)


# ------------------------------------------------------------------ decayed endpoints against their controls


def _last(rows: list[Mapping]) -> Mapping | None:
    return max(rows, key=lambda r: (number(r.get("tokens")) or 0, number(r.get("step")) or 0)) if rows else None


def decay_table(rows: Sequence[Mapping], run: str, z: float = Z) -> list[dict]:
    """Per quantizer and cooldown branch of ``run``: the decayed endpoint minus its constant-LR control at
    equal tokens (the last checkpoint of each, paired over windows), with the quantizer's stable-phase
    jitter, the combined uncertainty and the verdict of the rule (the module docstring). The findings'
    decay finding, the demo's printout and the report's cooldown table all read this table.

    Fields: run, quantizer, branch, from_step, step, tokens, delta_ce_decayed, delta_ce_control, delta_ce_control_se,
    ce_fp_decayed, ce_fp_control, difference, difference_eval_se, difference_run_se, stable_jitter,
    difference_se (the combined uncertainty), z, exceeds_uncertainty (|z| > z), verdict (decay raises / lowers
    the error / within uncertainty), dominant (windows or quantization run), paired, quant_repeats (the smaller
    R of the two rows). A cooldown branch whose control is not in the rows, or ends at other tokens, is left out."""
    mine = [r for r in rows if PTQ.matches(r) and r.get("run") == run]
    bits = {r.get("quantizer"): number(r.get("bits")) or 0 for r in mine}
    branches = sorted({r.get("branch") for r in mine
                       if r.get("ckpt_kind") == "cooldown" and control_of(r.get("branch")) is not None})
    table = []
    for q in sorted(bits, key=lambda q: (-bits[q], str(q))):
        of_q = [r for r in mine if r.get("quantizer") == q]
        jitter = stable_jitter(of_q)
        for b in branches:
            end = _last([r for r in of_q if r.get("branch") == b])
            ctrl = _last([r for r in of_q if r.get("branch") == control_of(b)])
            if end is None or ctrl is None or end.get("tokens") != ctrl.get("tokens"):
                continue
            d = decay_difference(end, ctrl, jitter)
            sign = verdict_sign(d.difference, d.se, z)
            table.append({"run": run, "quantizer": q, "branch": b, "from_step": end.get("parent_step"),
                          "step": end.get("step"), "tokens": end.get("tokens"),
                          "delta_ce_decayed": end["delta_ce"], "delta_ce_control": ctrl["delta_ce"],
                          "delta_ce_control_se": (total_se(dict(ctrl)) if number(ctrl.get("delta_ce_se")) is not None
                                                  else None),
                          "ce_fp_decayed": end.get("ce_fp"), "ce_fp_control": ctrl.get("ce_fp"),
                          "difference": d.difference, "difference_eval_se": d.eval_se,
                          "difference_run_se": d.run_se, "stable_jitter": jitter, "difference_se": d.se, "z": d.z,
                          "exceeds_uncertainty": sign != 0, "verdict": decay_verdict(sign, z),
                          "dominant": d.dominant, "paired": d.paired,
                          "quant_repeats": min(uncertainty(dict(end)).repeats, uncertainty(dict(ctrl)).repeats)})
    return table


# ------------------------------------------------------------------ printing


def _fixed_or_sci(effect: float, se: float, digits: int) -> tuple[str, str]:
    """effect and se with ``digits`` significant digits of se, effect to the same decimal place."""
    exp_se = math.floor(math.log10(se))
    decimals = digits - 1 - exp_se
    if 0 <= decimals <= 12 and abs(effect) < 1e12:
        return f"{effect:+.{decimals}f}", f"{se:.{decimals}f}"
    exp_e = math.floor(math.log10(abs(effect))) if effect else exp_se
    return f"{effect:+.{max(0, digits - 1 + exp_e - exp_se)}e}", f"{se:.{digits - 1}e}"


def format_estimate(effect: float, se: float | None, z: float = Z, digits: int = 2) -> tuple[str, str, str]:
    """(effect, SE, z) as text, with at least ``digits`` significant digits of the SE (the effect to the same
    decimal place) and z to one decimal, each given more digits until the printed numbers agree with the
    verdict: |printed z| > z, and |printed effect| / printed SE > z, exactly when verdict_sign resolves it.
    Without a usable SE: the effect alone and 'n/a'."""
    e = number(effect)
    s = number(se)
    if e is None:
        return "n/a", "n/a", "n/a"
    if s is None or s <= 0:
        return f"{e:+.4g}", "n/a", "n/a"
    resolved = verdict_sign(e, s, z) != 0
    e_txt = s_txt = ""
    for d in range(digits, 18):
        e_txt, s_txt = _fixed_or_sci(e, s, d)
        ps = float(s_txt)
        if ps > 0 and (abs(float(e_txt)) / ps > z) == resolved:
            break
    else:
        e_txt, s_txt = repr(e), repr(s)
    t = e / s
    z_txt = ""
    for d in range(1, 18):
        z_txt = f"{t:+.{d}f}"
        if (abs(float(z_txt)) > z) == resolved:
            break
    else:
        z_txt = repr(t)
    return _no_signed_zero(e_txt), s_txt, _no_signed_zero(z_txt)


def _no_signed_zero(txt: str) -> str:
    """'-0.0000' and '+0.0' read as a sign the digits do not carry: a number printed as zero is printed unsigned."""
    try:
        return txt.lstrip("+-") if float(txt) == 0.0 else txt
    except ValueError:
        return txt


def format_interval(effect: float | None, lo: float | None, hi: float | None, decimals: int = 2) -> str:
    """'+0.45 [+0.12, +0.71]', with more decimals where needed so the printed interval excludes 0 exactly
    when the interval does ('+0.45 [n/a]' without one; 'n/a' without an effect)."""
    e, lo, hi = number(effect), number(lo), number(hi)
    if e is None:
        return "n/a"
    if lo is None or hi is None:
        return f"{e:+.{decimals}f} [n/a]"
    sign = interval_sign(lo, hi)
    for d in range(decimals, 18):
        lo_t, hi_t = f"{lo:+.{d}f}", f"{hi:+.{d}f}"
        if interval_sign(float(lo_t), float(hi_t)) == sign:
            return f"{e:+.{d}f} [{lo_t}, {hi_t}]"
    return f"{e!r} [{lo!r}, {hi!r}]"


# ------------------------------------------------------------------ bootstrap


def percentile_interval(values, ci: float) -> tuple[float, float]:
    """The central ``ci`` percentile interval of ``values``, NaNs dropped ((nan, nan) when none are left)."""
    v = np.asarray(values, dtype=np.float64)
    v = v[~np.isnan(v)]
    if not v.size:
        return math.nan, math.nan
    a = 1.0 - ci
    lo, hi = np.quantile(v, [a / 2, 1 - a / 2])
    return float(lo), float(hi)


def bootstrap_intervals(statistics_of: Sequence[Callable[[np.ndarray], float]], n: int, n_boot: int, ci: float,
                        rng: np.random.Generator) -> list[tuple[float, float, int]]:
    """Percentile bootstrap intervals of several statistics of n rows, on the same resamples.

    Draws ``n_boot`` resamples of the row indices 0..n−1 with replacement from ``rng`` (one
    ``rng.integers(0, n, size=(n_boot, n))``); each statistic maps an index array to a number (NaN where
    it is undefined on that resample). Returns per statistic (lo, hi, resamples where it was defined)."""
    idx = rng.integers(0, n, size=(n_boot, n))
    out = []
    for stat in statistics_of:
        vals = np.array([stat(i) for i in idx], dtype=np.float64)
        lo, hi = percentile_interval(vals, ci)
        out.append((lo, hi, int((~np.isnan(vals)).sum())))
    return out


__all__ = [
    "DECAY_LOWERS", "DECAY_RAISES", "EVAL", "NOT_RESOLVED", "OPPOSITE", "REPRODUCED", "RUN", "TONES", "VERDICTS",
    "Z", "Difference", "Effect", "Uncertainty", "Verdict", "bootstrap_intervals", "claim_verdict", "combine",
    "combined_se", "decay_difference", "decay_table", "decay_verdict", "dominant", "format_estimate",
    "format_interval", "interval_sign", "mean_se", "paired_difference", "percentile_interval", "rel_delta_ce",
    "rel_delta_ce_se", "repeats", "same_windows", "se_of_mean", "stable_jitter", "total_se", "uncertainty",
    "verdict_of", "verdict_sign", "window_values", "within_uncertainty", "z_of",
]
