"""The papers' findings, computed from result rows: effect, uncertainty, verdict.

Pure functions of rows (dicts as the results store returns them); nothing here trains, reads
checkpoints or draws.  Every finding row says what was compared, the measured effect, its uncertainty
in parts and a verdict that follows from the numbers, by the one rule of :mod:`quantdyn.results.stats`
(differences paired over evaluation windows, combined with the run-to-run spread of the quantization,
the stable-phase jitter where a decayed endpoint is compared with its control, and the seeds' spread):

* ``se_windows``: paired SE over the evaluation windows, combined over seeds as sqrt(sum SE_i^2) / k;
* ``se_run``: run-to-run SE of the quantization itself, sqrt(SD_a^2/R_a + SD_b^2/R_b) from rows that
  repeated their quantization R > 1 times (None when R = 1: not measured);
* ``se_jitter``: the stable-phase jitter of Δ CE (decay findings only; None elsewhere);
* ``se_seeds``: SD of the per-seed effects / sqrt(k) (None with one seed);
* ``se``: the uncertainty the verdict uses, max(sqrt(se_windows^2 + se_run^2 + se_jitter^2), se_seeds).

Decay and averaging rows also carry ``baseline``, the mean over seeds of the quantity the effect is relative
to (the control's Δ CE; the decayed endpoint's Δ CE or CE(quantized)), named by ``baseline_of``, and where it is
known ``baseline_se``, its uncertainty (a ratio to a baseline not resolved from 0 is not printed:
:func:`relative_baseline`); decay rows name their ``seed_family``, cooldown ``branch`` and its ``control``.

Verdict (``z`` = FindingsSpec.z, default 2): an effect with |effect / se| <= z is "not resolved at this
scale", whatever its sign; beyond it, "reproduced" when its sign is the one the paper reports,
"opposite" otherwise.  Correlations carry a percentile-bootstrap interval instead of an SE: resolved
when the interval excludes 0.

Families (studies/families.py FINDING_FAMILIES registers each with its inputs, figure and words): decay (paper
A a), peak_lr (b), averaging (c), sharpness (d), predictors (paper B), early_warning (issue 48.5).  Each function
returns (finding rows, detail tables for figures and docs).
"""
from __future__ import annotations

import math
import re
import statistics
from typing import Iterable, Mapping, Sequence

import numpy as np

from quantdyn.analysis.correlate import CorrelateConfig, correlate, spearman
from quantdyn.results.schema import ANALYSIS, FP, PTQ, number
from quantdyn.results.stats import (  # the verdict words are the findings' too: fd.REPRODUCED ...
    NOT_RESOLVED,
    OPPOSITE,
    REPRODUCED,  # noqa: F401
    Z,
    Difference,
    Effect,
    bootstrap_intervals,
    claim_verdict,
    combine,
    decay_table,
    decay_verdict,
    format_estimate,
    format_interval,
    interval_sign,
    mean_se,
    paired_difference,
    same_windows,
    total_se,
    uncertainty,
    verdict_sign,
)
from quantdyn.runs import control_of, is_cooldown

_SEED_SUFFIX = re.compile(r"-s(\d+)$")
AVERAGED = ("lawa", "ema", "soup")
"""The ckpt_kind of an averaged checkpoint (LAWA, EMA, a soup)."""


# ------------------------------------------------------------------ verdicts (the rule: results/stats.py)
def verdict(effect: float | None, se: float | None, expected: int, z: float = Z) -> str:
    """reproduced / opposite / not resolved at this scale for an effect with uncertainty ``se``.

    ``expected`` is the sign the paper reports (+1 or -1).  An effect inside z·se, or one whose
    uncertainty is unknown (None, nan, <= 0), is not resolved."""
    return claim_verdict(verdict_sign(effect, se, z), expected)


def interval_verdict(lo: float | None, hi: float | None, expected: int) -> str:
    """The verdict of a quantity known by an interval [lo, hi]: resolved when it excludes 0."""
    return claim_verdict(interval_sign(lo, hi), expected)


def null_verdict(lo: float | None, hi: float | None) -> str:
    """For a claim of *no* association (paper B: MMR/kurtosis do not predict): an interval that excludes 0
    contradicts it; one that includes 0 does not establish it either (not resolved)."""
    return OPPOSITE if interval_sign(lo, hi) != 0 else NOT_RESOLVED


def family_of(run: str) -> str:
    """A run's name without its seed suffix: runs that differ only by seed share it."""
    return _SEED_SUFFIX.sub("", run)


def finding_row(finding: str, family: str, quantizer: str | None, comparison: str, metric: str,
                eff: Effect, expected: int, z: float, figure: str, **extra) -> dict:
    """One line of the findings table for an SE-based effect."""
    return {"finding": finding, "family": family, "quantizer": quantizer, "comparison": comparison,
            "metric": metric, **eff.fields(), "interval_lo": None, "interval_hi": None,
            "expected": "+" if expected > 0 else "-", "verdict": verdict(eff.effect, eff.se, expected, z),
            "z_threshold": z, "figure": figure, **extra}


def correlation_row(finding: str, family: str, quantizer: str | None, comparison: str, metric: str,
                    rho: float, lo: float, hi: float, n: int, expected: int, figure: str, null: bool = False,
                    **extra) -> dict:
    """One line of the findings table for a correlation with a bootstrap interval."""
    return {"finding": finding, "family": family, "quantizer": quantizer, "comparison": comparison,
            "metric": metric, "effect": rho, "se": None, "se_windows": None, "se_run": None, "se_jitter": None,
            "se_seeds": None, "z": None, "n_seeds": None, "per_seed": None, "interval_lo": lo, "interval_hi": hi,
            "n": n, "expected": "0" if null else ("+" if expected > 0 else "-"),
            "verdict": null_verdict(lo, hi) if null else interval_verdict(lo, hi, expected), "figure": figure,
            **extra}


# ------------------------------------------------------------------ rows
def dedupe(rows: Iterable[Mapping], repeats: int | None = None) -> list[dict]:
    """One row per (kind, checkpoint, branch, step, quantizer/analysis): a store can hold the same checkpoint
    measured with other repeat counts or eval settings; keep the row with ``repeats`` (when given), else the
    newest."""
    best: dict[tuple, dict] = {}
    for r in rows:
        k = (r.get("kind"), r.get("checkpoint"), r.get("run"), r.get("branch"), r.get("step"), r.get("quantizer"),
             r.get("analysis"), r.get("task"))
        old = best.get(k)
        if old is None:
            best[k] = dict(r)
            continue

        def rank(x):
            match = repeats is not None and uncertainty(x).repeats == repeats
            return (match, str(x.get("time") or ""))

        if rank(r) > rank(old):
            best[k] = dict(r)
    return list(best.values())


def with_fp_se(rows: list[dict]) -> list[dict]:
    """PTQ rows with ``ce_fp_se`` from the FP row of the same checkpoint (for unpaired CE(q) differences)."""
    fp = {(r.get("checkpoint"), r.get("run"), r.get("branch"), r.get("step")): r.get("ce_fp_se")
          for r in rows if FP.matches(r)}
    return [{**r, "ce_fp_se": fp.get((r.get("checkpoint"), r.get("run"), r.get("branch"), r.get("step")))}
            if PTQ.matches(r) and "ce_fp_se" not in r else r for r in rows]


TRAINED_KINDS = ("checkpoint", "cooldown", "control")
"""ckpt_kind of the checkpoints a run trained here holds: its main checkpoints and its branches'."""


def trained_runs(rows: Sequence[Mapping]) -> list[str]:
    """The runs trained here (a main checkpoint, or a cooldown or control branch: ckpt_kind in TRAINED_KINDS), the
    ones a finding compares: a public trajectory (a hub repo) is measured, never compared with another model's at
    another peak LR. A branch's rows alone make their run one (a sweep with ``--tokens-range 1:`` leaves the branch
    point, the run's only main checkpoint, out)."""
    return sorted({r["run"] for r in rows if PTQ.matches(r) and r.get("run") and r.get("ckpt_kind") in TRAINED_KINDS})


def unpaired_cooldowns(rows: Sequence[Mapping], runs: Sequence[str]) -> list[str]:
    """Why a decayed endpoint of ``runs`` has no line in its decay table, one sentence per cooldown branch and
    quantizer set: its constant-LR control has no rows, or it ends at other tokens (decay_table's rule)."""
    out = []
    for run in runs:
        mine = _ptq(rows, run)
        for b in sorted({r.get("branch") for r in mine if is_cooldown(r.get("branch"))}):
            ctrl = control_of(b)
            qs = sorted({r.get("quantizer") for r in mine if r.get("branch") == b})
            missing = [q for q in qs if not _ptq(mine, branch=ctrl, quantizer=q)]
            if missing:
                out.append(f"{run}: the decayed endpoint {b} has no constant-LR control in these rows ({ctrl} has no "
                           f"{', '.join(missing)} rows: `quantdyn cooldown ... --control` trains it, a sweep of the "
                           "run measures it)")
                continue
            off = [(q, _last(_ptq(mine, branch=b, quantizer=q)), _last(_ptq(mine, branch=ctrl, quantizer=q)))
                   for q in qs]
            off = [(q, e, c) for q, e, c in off if e.get("tokens") != c.get("tokens")]
            if off:
                q, e, c = off[0]
                out.append(f"{run}: the last rows of {b} and {ctrl} are at different tokens ({e.get('tokens')} and "
                           f"{c.get('tokens')}, {q}{' and others' if len(off) > 1 else ''}); sweep both endpoints")
    return out


def quantizers_of(rows: Iterable[Mapping], wanted: Sequence[str] = ()) -> list[str]:
    """Swept quantizers, most bits first (``wanted`` restricts and orders them)."""
    ptq = PTQ.select(rows)
    have = {r["quantizer"]: r.get("bits") or 0 for r in ptq}
    if wanted:
        return [q for q in wanted if q in have]
    return sorted(have, key=lambda q: (-have[q], q))


def _ptq(rows, run=None, branch=None, quantizer=None) -> list[dict]:
    return [r for r in rows if PTQ.matches(r) and (run is None or r.get("run") == run)
            and (branch is None or r.get("branch") == branch) and (quantizer is None or r.get("quantizer") == quantizer)]


def _last(rows: list[dict]) -> dict | None:
    return max(rows, key=lambda r: (r.get("tokens") or 0, r.get("step") or 0)) if rows else None


# ------------------------------------------------------------------ (a) decay vs control
def _table_difference(t: Mapping) -> Difference:
    """The difference of one line of a decay table (older tables may carry only difference and its SE)."""
    return Difference(t["difference"], t.get("difference_eval_se", t.get("difference_se")),
                      t.get("difference_run_se"), t.get("stable_jitter"), bool(t.get("paired")))


def seed_summary(tables: list[dict], z: float = Z) -> list[dict]:
    """Per (run family, quantizer, branch) over runs that differ only by seed: the mean decayed-minus-control
    difference and its uncertainty (results.stats.combine).  Empty unless two runs share one."""
    groups: dict[tuple, list[dict]] = {}
    for t in tables:
        groups.setdefault((family_of(t.get("run", "")), t["quantizer"], t["branch"]), []).append(t)
    out = []
    for (fam, q, b), ts in groups.items():
        if len(ts) < 2:
            continue
        eff = combine([_table_difference(t) for t in ts])
        out.append({"family": fam, "quantizer": q, "branch": b, "n_seeds": eff.n_seeds, "difference": eff.effect,
                    "difference_se": eff.se, "within_se": eff.se_windows, "run_se": eff.se_run,
                    "jitter_se": eff.se_jitter, "between_se": eff.se_seeds, "z": eff.z, "min": min(eff.per_seed),
                    "max": max(eff.per_seed), "same_sign": eff.same_sign,
                    "verdict": decay_verdict(verdict_sign(eff.effect, eff.se, z), z)})
    return out


def decay_findings(rows: list[dict], runs: Sequence[str], quantizers: Sequence[str] = (), z: float = Z):
    """Paper A (a): the decayed endpoint quantizes worse than its same-token constant-LR control."""
    tables = [t for run in runs for t in decay_table(rows, run, z)]
    qs = quantizers_of(rows, quantizers)
    groups: dict[tuple, list[dict]] = {}
    for t in tables:
        if t["quantizer"] in qs:
            groups.setdefault((family_of(t["run"]), t["quantizer"], t["branch"]), []).append(t)
    out = []
    for (fam, q, b), ts in sorted(groups.items(), key=lambda kv: (kv[0][0], qs.index(kv[0][1]), kv[0][2])):
        eff = combine([_table_difference(t) for t in ts])
        first = sorted(ts, key=lambda t: t["run"])[0]["run"]
        out.append(finding_row(
            "A(a) LR decay raises the quantization error", "decay", q,
            f"{fam}: decayed endpoint − constant-LR control, {b} (step {ts[0]['step']})", "Δ CE", eff, +1, z,
            f"rainbow_{_safe(first)}.png", quant_repeats=ts[0]["quant_repeats"],
            jitter=max((t["stable_jitter"] for t in ts if t["stable_jitter"] is not None), default=None),
            seed_family=fam, branch=b, control=control_of(b),
            baseline=statistics.fmean(t["delta_ce_control"] for t in ts), baseline_of="the control's Δ CE",
            baseline_se=_mean_se([t.get("delta_ce_control_se") for t in ts])))
    return out, {"decay": tables}


def _mean_se(ses: Sequence) -> float | None:
    """The SE of a mean of k independent values with these SEs, sqrt(Σ se²) / k; None if one is unknown."""
    vals = [number(s) for s in ses]
    if not vals or any(v is None for v in vals):
        return None
    return math.sqrt(sum(v * v for v in vals)) / len(vals)


def relative_baseline(f: Mapping) -> float | None:
    """The reference a finding's effect is given relative to (as a percentage of), or None where that ratio means
    nothing: no positive ``baseline``, or one not resolved from 0 (baseline <= z x ``baseline_se``, when its SE is
    known) — a ratio to a number indistinguishable from 0 is noise of any size ("-1.2e+02 ± 1.5e+02 % of the
    control's Δ CE"). The report's words, table and figure all ask this."""
    b = number(f.get("baseline"))
    if b is None or b <= 0:
        return None
    se = number(f.get("baseline_se"))
    if se is not None and b <= (number(f.get("z_threshold")) or Z) * se:
        return None
    return b


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)


# ------------------------------------------------------------------ (b) peak LR at matched FP loss
def curve(rows: list[dict], run: str, quantizer: str, from_fraction: float = 0.0) -> list[dict]:
    """The main-run PTQ rows of ``run`` in step order, from ``from_fraction`` of its last step on."""
    pts = sorted((r for r in _ptq(rows, run=run, branch="main", quantizer=quantizer) if r.get("step") is not None),
                 key=lambda r: r["step"])
    if not pts:
        return []
    first = from_fraction * pts[-1]["step"]
    return [r for r in pts if r["step"] >= first]


def interpolate_at_loss(pts: list[dict], loss: float) -> dict | None:
    """Δ CE of a run at FP loss ``loss``: linear interpolation in FP loss between the two checkpoints where the
    run first reaches it (in step order), with the per-window deltas and the run-to-run SE interpolated alike.

    Returns {delta_ce, window_delta (array or None), run_se (or None), weight, steps} or None when the run
    never crosses ``loss``."""
    for a, b in zip(pts, pts[1:]):
        la, lb = a["ce_fp"], b["ce_fp"]
        if (la - loss) * (lb - loss) <= 0 and la != lb:
            w = (la - loss) / (la - lb)
            wa, wb = a.get("window_delta"), b.get("window_delta")
            wd = ((1 - w) * np.asarray(wa, dtype=np.float64) + w * np.asarray(wb, dtype=np.float64)
                  if wa and wb and len(wa) == len(wb) else None)
            ra, rb = uncertainty(a).run_se, uncertainty(b).run_se
            rse = math.hypot((1 - w) * (ra or 0.0), w * (rb or 0.0)) if (ra is not None or rb is not None) else None
            se = math.hypot((1 - w) * (number(a.get("delta_ce_se")) or 0.0), w * (number(b.get("delta_ce_se")) or 0.0))
            return {"delta_ce": (1 - w) * a["delta_ce"] + w * b["delta_ce"], "window_delta": wd, "run_se": rse,
                    "eval_se": se, "weight": w, "steps": (a["step"], b["step"]), "eval_hash": a.get("eval_hash")}
        if la == lb == loss:
            return {"delta_ce": a["delta_ce"], "window_delta": np.asarray(a["window_delta"], dtype=np.float64)
                    if a.get("window_delta") else None, "run_se": uncertainty(a).run_se,
                    "eval_se": number(a.get("delta_ce_se")),
                    "weight": 0.0, "steps": (a["step"], a["step"]), "eval_hash": a.get("eval_hash")}
    if len(pts) == 1 and pts[0]["ce_fp"] == loss:
        return interpolate_at_loss(pts * 2, loss)
    return None


def matched_levels(curves: Sequence[list[dict]], n: int) -> list[float]:
    """``n`` FP-loss levels every curve covers: evenly spaced over the overlap of the curves' loss ranges
    (from the highest of their lowest losses up to the lowest of their highest), lowest loss first."""
    if not curves or any(len(c) < 2 for c in curves):
        return []
    lo = max(min(r["ce_fp"] for r in c) for c in curves)
    hi = min(max(r["ce_fp"] for r in c) for c in curves)
    if hi < lo:
        return []
    if n == 1 or hi == lo:
        return [lo]
    return [lo + (hi - lo) * j / (n - 1) for j in range(n)]


def matched_difference(hi_pts: list[dict], lo_pts: list[dict], levels: Sequence[float]) -> Difference | None:
    """Mean over ``levels`` of Δ CE(hi run) − Δ CE(lo run) at matched FP loss, paired over windows (the
    per-window differences averaged over the levels, then their SE) when every level's two points carry
    window deltas of the same windows."""
    a = [interpolate_at_loss(hi_pts, L) for L in levels]
    b = [interpolate_at_loss(lo_pts, L) for L in levels]
    if any(x is None for x in a + b):
        return None
    d = statistics.fmean(x["delta_ce"] - y["delta_ce"] for x, y in zip(a, b))
    wins = [x["window_delta"] - y["window_delta"] for x, y in zip(a, b)
            if x["window_delta"] is not None and y["window_delta"] is not None
            and len(x["window_delta"]) == len(y["window_delta"]) and same_windows(x, y)]
    paired = len(wins) == len(levels) and len(wins[0]) > 1
    if paired:
        eval_se = mean_se(np.mean(wins, axis=0))[1]
    else:  # unpaired: conservative
        eval_se = statistics.fmean(math.hypot(x["eval_se"] or 0.0, y["eval_se"] or 0.0) for x, y in zip(a, b))
    rs = [math.hypot(x["run_se"] or 0.0, y["run_se"] or 0.0) for x, y in zip(a, b)
          if x["run_se"] is not None or y["run_se"] is not None]
    # levels share checkpoints, so their run-to-run errors are correlated: average (not sqrt-sum) them
    rse = statistics.fmean(rs) if rs else None
    return Difference(d, eval_se, rse, None, paired)


def _run_lr(rows: list[dict], run: str) -> float | None:
    return next((number(r.get("peak_lr")) for r in rows if r.get("run") == run and number(r.get("peak_lr"))), None)


def _run_seed(rows: list[dict], run: str):
    s = next((r.get("seed") for r in rows if r.get("run") == run and r.get("seed") is not None), None)
    if s is None:
        m = _SEED_SUFFIX.search(run)
        s = int(m.group(1)) if m else 0
    return s


def lr_pairs(lrs: Sequence[float]) -> list[tuple[float, float]]:
    """The (higher, lower) peak-LR pairs a study compares: each LR with the next lower one, and the highest
    with the lowest when there are more than two."""
    lrs = sorted(lrs)
    pairs = [(hi, lo) for lo, hi in zip(lrs, lrs[1:])]
    if len(lrs) > 2:
        pairs.append((lrs[-1], lrs[0]))
    return pairs


def peak_lr_findings(rows: list[dict], runs: Sequence[str], quantizers: Sequence[str] = (), levels: int = 5,
                     from_fraction: float = 0.25, z: float = 2.0, cfg: CorrelateConfig = CorrelateConfig()):
    """Paper A (b): a higher peak LR gives a lower quantization error at similar FP loss.

    For every pair of peak LRs (lr_pairs), per seed: Δ CE of the higher-LR run minus the lower-LR run at
    ``levels`` FP losses inside the overlap of the pair's Δ CE-vs-FP-loss curves (every seed's; each curve
    is a run's main checkpoints from ``from_fraction`` of its steps on, interpolated by interpolate_at_loss),
    averaged over the levels and paired over windows; combined over seeds.  Beside it, the same pair at
    equal steps (final checkpoints: equal tokens, different FP loss), and, over every run, Spearman of
    log10 peak LR with the run's mean Δ CE at the levels all runs share (paper: negative)."""
    qs = quantizers_of(rows, quantizers)
    lrs = {run: _run_lr(rows, run) for run in runs}
    seeds = {run: _run_seed(rows, run) for run in runs}
    runs = [r for r in runs if lrs[r] is not None and _ptq(rows, run=r)]
    out: list[dict] = []
    detail: list[dict] = []
    by_seed: dict = {}
    for r in runs:
        by_seed.setdefault(seeds[r], {})[lrs[r]] = r
    common = sorted(lr for lr in {lrs[r] for r in runs} if all(lr in m for m in by_seed.values()))
    if len(common) < 2:
        return out, {"peak_lr": detail}
    title = "A(b) higher peak LR, lower error at similar FP loss"
    for q in qs:
        curves = {r: curve(rows, r, q, from_fraction) for r in runs}
        for hi, lo in lr_pairs(common):
            name = f"LR {hi:g} − LR {lo:g}"
            pair_runs = [m[x] for m in by_seed.values() for x in (hi, lo)]
            lv = matched_levels([curves[r] for r in pair_runs], levels)
            per_seed, equal = [], []
            for s, m in sorted(by_seed.items(), key=lambda kv: str(kv[0])):
                if lv:
                    md = matched_difference(curves[m[hi]], curves[m[lo]], lv)
                    if md is not None:
                        per_seed.append(md)
                ends = [_last(_ptq(rows, run=x, branch="main", quantizer=q)) for x in (m[hi], m[lo])]
                if all(e is not None for e in ends) and ends[0]["step"] == ends[1]["step"]:
                    equal.append(paired_difference(ends[0], ends[1]))
            if per_seed:
                eff = combine(per_seed)
                out.append(finding_row(title, "peak_lr", q, f"{name} at {len(lv)} matched FP losses "
                                       f"{lv[0]:.3f}–{lv[-1]:.3f}", "Δ CE", eff, -1, z, "findings_peak_lr.png",
                                       levels=lv, lr_hi=hi, lr_lo=lo))
            else:
                out.append({"finding": title, "family": "peak_lr", "quantizer": q, "metric": "Δ CE",
                            "comparison": f"{name}: the runs' FP-loss ranges do not overlap (no matched loss)",
                            "effect": None, "se": None, "verdict": NOT_RESOLVED, "expected": "-",
                            "figure": "findings_peak_lr.png", "lr_hi": hi, "lr_lo": lo})
            if equal:
                eff = combine(equal)
                out.append(finding_row(title + " (equal steps, for comparison)", "peak_lr", q,
                                       f"{name} at the final checkpoint (equal tokens, FP losses differ)", "Δ CE",
                                       eff, -1, z, "findings_peak_lr.png", lr_hi=hi, lr_lo=lo))
        lv_all = matched_levels([curves[r] for r in runs], levels)
        for r in runs:
            for L in lv_all:
                v = interpolate_at_loss(curves[r], L)
                detail.append({"quantizer": q, "run": r, "peak_lr": lrs[r], "seed": seeds[r], "ce_fp": L,
                               "delta_ce": v["delta_ce"] if v else None, "level": True})
            for p in _ptq(rows, run=r, branch="main", quantizer=q):
                detail.append({"quantizer": q, "run": r, "peak_lr": lrs[r], "seed": seeds[r], "ce_fp": p["ce_fp"],
                               "delta_ce": p["delta_ce"], "step": p["step"], "level": False})
        pts = []
        for r in runs:
            vals = [interpolate_at_loss(curves[r], L) for L in lv_all]
            if lv_all and all(v is not None for v in vals):
                pts.append({"log_lr": math.log10(lrs[r]), "delta_ce": statistics.fmean(v["delta_ce"] for v in vals)})
        if len(pts) >= cfg.min_rows and len({p["log_lr"] for p in pts}) >= 2:
            c = correlate(pts, "delta_ce", ["log_lr"], cfg)[0]
            out.append(correlation_row(
                title, "peak_lr", q, f"Spearman(log peak LR, Δ CE at {len(lv_all)} FP losses all runs reach, "
                f"{lv_all[0]:.3f}–{lv_all[-1]:.3f}) over {c['n']} runs", "Spearman ρ", c["spearman"],
                c["spearman_lo"], c["spearman_hi"], c["n"], -1, "findings_peak_lr.png"))
        elif len(common) > 2:
            out.append({"finding": title, "family": "peak_lr", "quantizer": q, "metric": "Spearman ρ",
                        "comparison": "Spearman(log peak LR, Δ CE at matched loss): no FP loss that every run "
                                      "reaches", "effect": None, "se": None, "verdict": NOT_RESOLVED,
                        "expected": "-", "figure": "findings_peak_lr.png"})
    return out, {"peak_lr": detail}


# ------------------------------------------------------------------ (c) averaging vs decay
def averaging_findings(rows: list[dict], runs: Sequence[str], reference_branch: str, at_step: int | None = None,
                       quantizers: Sequence[str] = (), z: float = 2.0,
                       fp_windows: Mapping[str, Sequence[float]] | None = None):
    """Paper A (c): LAWA and soups match or beat LR decay (at 3 bits), at equal tokens.

    Per run: every averaged checkpoint (branches whose ckpt_kind is lawa, ema or soup) at the reference's
    tokens, and the constant-LR main checkpoint there, against ``reference_branch``'s endpoint (the decayed
    model): Δ CE and CE of the quantized model (paired over windows; see paired_difference), FP CE beside."""
    qs = quantizers_of(rows, quantizers)
    out: list[dict] = []
    detail: list[dict] = []
    groups: dict[tuple, dict[str, list]] = {}
    for run in runs:
        for q in qs:
            ref = _last(_ptq(rows, run=run, branch=reference_branch, quantizer=q))
            if ref is None:
                continue
            tokens = ref["tokens"]
            cands = {}
            for r in _ptq(rows, run=run, quantizer=q):
                if r.get("tokens") != tokens or r is ref:
                    continue
                if r.get("ckpt_kind") in AVERAGED:
                    cands[r["branch"]] = r
                elif r.get("branch") == "main":
                    cands["main (constant LR, no averaging)"] = r
            detail.append({"run": run, "quantizer": q, "checkpoint": f"decayed ({reference_branch})",
                           "tokens": tokens, "ce_fp": ref["ce_fp"], "ce_q": ref["ce_q"], "delta_ce": ref["delta_ce"],
                           "delta_ce_se": total_se(ref)})
            for name, r in sorted(cands.items()):
                dd = paired_difference(r, ref, "delta_ce")
                dq = paired_difference(r, ref, "ce_q", fp_windows)
                detail.append({"run": run, "quantizer": q, "checkpoint": name, "tokens": tokens, "ce_fp": r["ce_fp"],
                               "ce_q": r["ce_q"], "delta_ce": r["delta_ce"], "delta_ce_se": total_se(r),
                               "d_delta_ce": dd.difference, "d_delta_ce_se": dd.se,
                               "d_ce_q": dq.difference, "d_ce_q_se": dq.se, "d_ce_q_paired": dq.paired,
                               "d_ce_fp": r["ce_fp"] - ref["ce_fp"]})
                g = groups.setdefault((q, name), {"dce": [], "ceq": [], "fp": [], "ref_dce": [], "ref_ceq": []})
                g["dce"].append(dd)
                g["ceq"].append(dq)
                g["fp"].append(r["ce_fp"] - ref["ce_fp"])
                g["ref_dce"].append(ref["delta_ce"])
                g["ref_ceq"].append(ref["ce_q"])
    for (q, name), g in sorted(groups.items(), key=lambda kv: (qs.index(kv[0][0]), kv[0][1])):
        if name.startswith("main"):
            continue  # context only (the decay finding's own comparison), in the detail table
        fp = statistics.fmean(g["fp"])
        e1 = combine(g["dce"])
        out.append(finding_row("A(c) weight averaging matches or beats LR decay", "averaging", q,
                               f"{name} − decayed endpoint (equal tokens)", "Δ CE", e1, -1, z,
                               "findings_averaging.png", d_ce_fp=fp, baseline=statistics.fmean(g["ref_dce"]),
                               baseline_of="the decayed endpoint's Δ CE"))
        e2 = combine(g["ceq"])
        out.append(finding_row("A(c) weight averaging matches or beats LR decay", "averaging", q,
                               f"{name} − decayed endpoint (equal tokens)", "CE(quantized)", e2, -1, z,
                               "findings_averaging.png", d_ce_fp=fp, baseline=statistics.fmean(g["ref_ceq"]),
                               baseline_of="the decayed endpoint's CE(quantized)"))
    return out, {"averaging": detail}


# ------------------------------------------------------------------ (d) sharpness through a cooldown
def _analysis(rows, name="hessian") -> dict[tuple, dict]:
    return {(r.get("run"), r.get("branch"), r.get("step")): r for r in rows
            if ANALYSIS.matches(r) and r.get("analysis") == name}


def sharpness_findings(rows: list[dict], runs: Sequence[str], quantizers: Sequence[str] = (), z: float = 2.0,
                       cfg: CorrelateConfig = CorrelateConfig()):
    """Paper A (d): the Hessian trace and top eigenvalue surge during the decay, mirroring Δ CE.

    Per run: decayed endpoint minus its constant-LR control (trace: SE from the Hutchinson estimates of both;
    top eigenvalue: power iteration gives no SE, so only the seeds' spread), combined over seeds; and across
    every measured checkpoint of every run (main, branches): Spearman of trace / top eigenvalue with Δ CE
    per quantizer, percentile-bootstrap interval (checkpoints of one run are not independent draws: read the
    interval as optimistic)."""
    hs = _analysis(rows)
    out: list[dict] = []
    detail: list[dict] = []
    per: dict[tuple, list] = {}
    for run in runs:
        branches = sorted({k[1] for k in hs if k[0] == run and is_cooldown(k[1])})
        for b in branches:
            ends = [v for k, v in hs.items() if k[0] == run and k[1] == b]
            ctrls = [v for k, v in hs.items() if k[0] == run and k[1] == control_of(b)]
            end, ctrl = _last(ends), _last(ctrls)
            if end is None or ctrl is None or end.get("tokens") != ctrl.get("tokens"):
                continue
            start = hs.get((run, "main", end.get("parent_step")))
            for metric, se_key in (("hessian_trace", "hessian_trace_se"), ("hessian_top_eig", None)):
                a, c = number(end.get(metric)), number(ctrl.get(metric))
                if a is None or c is None:
                    continue
                se = math.hypot(number(end.get(se_key)) or 0.0, number(ctrl.get(se_key)) or 0.0) if se_key else 0.0
                per.setdefault((family_of(run), b, metric, "control"), []).append(Difference(a - c, se))
                if start is not None and number(start.get(metric)) is not None:
                    s0 = number(start.get(metric))
                    se0 = math.hypot(number(end.get(se_key)) or 0.0, number(start.get(se_key)) or 0.0) if se_key else 0.0
                    per.setdefault((family_of(run), b, metric, "start"), []).append(Difference(a - s0, se0))
    labels = {"hessian_trace": "Hessian trace", "hessian_top_eig": "top Hessian eigenvalue"}
    for (fam, b, metric, vs), ps in sorted(per.items()):
        eff = combine(ps)
        what = "constant-LR control" if vs == "control" else "the branch's start checkpoint"
        row = finding_row("A(d) Hessian trace and top eigenvalue surge during the decay", "sharpness", None,
                          f"{fam}: decayed endpoint − {what}, {b}", labels[metric], eff, +1, z,
                          "findings_sharpness.png")
        if metric == "hessian_top_eig":
            row["se_windows"] = None  # power iteration gives no within-run SE: "n/a", not a measured 0
            if eff.se_seeds is None:
                row["verdict"] = NOT_RESOLVED  # one seed and no SE from power iteration: nothing to compare with
        out.append(row)
    for q in quantizers_of(rows, quantizers):
        table = []
        for run in runs:
            for r in _ptq(rows, run=run, quantizer=q):
                h = hs.get((run, r.get("branch"), r.get("step")))
                if h is None:
                    continue
                table.append({"delta_ce": r["delta_ce"], "hessian_trace": number(h.get("hessian_trace")),
                              "hessian_top_eig": number(h.get("hessian_top_eig"))})
                detail.append({"quantizer": q, "run": run, "branch": r.get("branch"), "step": r.get("step"),
                               "tokens": r.get("tokens"), "lr": r.get("lr"), "delta_ce": r["delta_ce"],
                               "delta_ce_se": total_se(r), "ce_fp": r["ce_fp"], **table[-1],
                               "hessian_trace_se": number(h.get("hessian_trace_se"))})
        if len(table) < cfg.min_rows:
            continue
        for c in correlate(table, "delta_ce", ["hessian_trace", "hessian_top_eig"], cfg):
            out.append(correlation_row(
                "A(d) Hessian trace and top eigenvalue surge during the decay", "sharpness", q,
                f"Spearman({labels[c['metric']]}, Δ CE) over {c['n']} checkpoints (main, cooldowns, controls)",
                "Spearman ρ", c["spearman"], c["spearman_lo"], c["spearman_hi"], c["n"], +1,
                "findings_sharpness.png"))
    return out, {"sharpness": detail}


# ------------------------------------------------------------------ paper B: which metric predicts PTQ error
OUTLIER_METRICS = ("weight_mmr_mean", "weight_kurtosis_mean", "act_mmr_mean", "act_kurtosis_mean")
PROPAGATION_METRIC = "prop_R_final"


def final_points(rows: list[dict], runs: Sequence[str], quantizer: str) -> list[dict]:
    """One row per run: Δ CE of ``quantizer`` at the run's final main checkpoint joined with that checkpoint's
    analysis metrics (outliers; propagation for this quantizer as prop_*)."""
    out = []
    for run in runs:
        end = _last(_ptq(rows, run=run, branch="main", quantizer=quantizer))
        if end is None:
            continue
        row = {"run": run, "optimizer": end.get("optimizer"), "n_params": end.get("n_params"),
               "ce_fp": end["ce_fp"], "delta_ce": end["delta_ce"], "delta_ce_se": total_se(end)}
        for r in rows:
            if not ANALYSIS.matches(r) or r.get("run") != run or r.get("branch") != "main" \
                    or r.get("step") != end.get("step"):
                continue
            for k, v in r.items():
                if k.startswith("prop_"):
                    base, _, q = k.partition("__")
                    if q == quantizer:
                        row[base] = number(v)
                elif k in OUTLIER_METRICS or k.startswith(("weight_", "act_")):
                    row[k] = number(v)
        out.append(row)
    return out


def _spearman_difference(x1, x2, y, cfg: CorrelateConfig) -> tuple[float, float, float]:
    """ρ(x1, y) − ρ(x2, y) with a percentile bootstrap interval (the same resamples for both correlations)."""
    x1, x2, y = (np.asarray(v, dtype=np.float64) for v in (x1, x2, y))
    d = spearman(x1, y) - spearman(x2, y)
    if not cfg.n_boot:
        return d, math.nan, math.nan
    ((lo, hi, _),) = bootstrap_intervals([lambda i: spearman(x1[i], y[i]) - spearman(x2[i], y[i])], len(y),
                                         cfg.n_boot, cfg.ci, np.random.default_rng(cfg.seed))
    return d, lo, hi


def predictor_findings(rows: list[dict], runs: Sequence[str], quantizers: Sequence[str] = (),
                       cfg: CorrelateConfig = CorrelateConfig()):
    """Paper B: MMR and kurtosis fail to predict PTQ degradation across optimizers; R_L predicts it.

    Across the runs' final checkpoints (optimizers x sizes x seeds), per quantizer: Spearman of each outlier
    metric and of R_L with Δ CE (bootstrap intervals), and ρ(R_L) − ρ(metric) with a paired bootstrap
    (paper: positive — R_L predicts better)."""
    out: list[dict] = []
    detail: list[dict] = []
    names = {"weight_mmr_mean": "weight MMR", "weight_kurtosis_mean": "weight kurtosis",
             "act_mmr_mean": "activation MMR", "act_kurtosis_mean": "activation kurtosis",
             PROPAGATION_METRIC: "R_L (propagated error)"}
    for q in quantizers_of(rows, quantizers):
        pts = final_points(rows, runs, q)
        detail += [{"quantizer": q, **p} for p in pts]
        if len(pts) < cfg.min_rows:
            continue
        metrics = [m for m in (*OUTLIER_METRICS, PROPAGATION_METRIC) if sum(p.get(m) is not None for p in pts)
                   >= cfg.min_rows]
        cs = {c["metric"]: c for c in correlate(pts, "delta_ce", metrics, cfg)}
        for m in metrics:
            c = cs[m]
            is_rl = m == PROPAGATION_METRIC
            out.append(correlation_row(
                "B R_L predicts PTQ error" if is_rl else "B MMR/kurtosis fail to predict PTQ error", "predictors", q,
                f"Spearman({names[m]}, Δ CE) over {c['n']} final checkpoints", "Spearman ρ", c["spearman"],
                c["spearman_lo"], c["spearman_hi"], c["n"], +1, "findings_predictors.png", null=not is_rl))
        if PROPAGATION_METRIC in metrics:
            for m in metrics:
                if m == PROPAGATION_METRIC:
                    continue
                both = [p for p in pts if p.get(m) is not None and p.get(PROPAGATION_METRIC) is not None]
                if len(both) < cfg.min_rows:
                    continue
                d, lo, hi = _spearman_difference([p[PROPAGATION_METRIC] for p in both], [p[m] for p in both],
                                              [p["delta_ce"] for p in both], cfg)
                out.append(correlation_row(
                    "B R_L predicts PTQ error where MMR/kurtosis do not", "predictors", q,
                    f"ρ(R_L) − ρ({names[m]}) over {len(both)} final checkpoints (paired bootstrap)", "Δ Spearman ρ",
                    d, lo, hi, len(both), +1, "findings_predictors.png"))
    return out, {"predictors": detail}


# ------------------------------------------------------------------ issue 48.5: the cheap early warning
EARLY_WARNING_CLAIM = "Early warning: the curvature along the update predicts the PTQ error"
WARNING_METRIC = "curvature_along_update"
EARLY_WARNING_FIGURE = "findings_early_warning.png"
EARLY_WARNING_BESIDE = ("hessian_trace", PROPAGATION_METRIC)
"""Computed beside the early warning over the same checkpoints, where their analysis rows exist."""


def early_warning_points(rows: list[dict], runs: Sequence[str], quantizer: str) -> list[dict]:
    """One row per checkpoint of ``runs`` that has a curvature_along_update (the analysis ``curvature``) and a
    ``quantizer`` PTQ row: its Δ CE, the curvature and, where their rows exist, the Hessian trace and R_L of that
    quantizer. Identical weights reached by the same update count once (a control's checkpoint that equals the main
    run's, the branch point as a branch's step 0: one checkpoint_hash and curvature_from_hash), the main run's
    place first."""
    curv, hs, props = _analysis(rows, "curvature"), _analysis(rows, "hessian"), _analysis(rows, "propagation")
    out, seen = [], set()
    for run in runs:
        ptq = sorted(_ptq(rows, run=run, quantizer=quantizer),
                     key=lambda r: (r.get("branch") != "main", str(r.get("branch")), r.get("step") or 0))
        for r in ptq:
            where = (run, r.get("branch"), r.get("step"))
            c = curv.get(where)
            k = number(c.get(WARNING_METRIC)) if c is not None else None
            if k is None:
                continue
            same = (run, r.get("checkpoint_hash"), c.get("curvature_from_hash")) if r.get("checkpoint_hash") else where
            if same in seen:
                continue
            seen.add(same)
            h, prop = hs.get(where) or {}, props.get(where) or {}
            out.append({"quantizer": quantizer, "run": run, "branch": r.get("branch"), "step": r.get("step"),
                        "tokens": r.get("tokens"), "lr": r.get("lr"), "delta_ce": r["delta_ce"],
                        "delta_ce_se": total_se(r), WARNING_METRIC: k,
                        "update_norm": number(c.get("update_norm")),
                        "curvature_from_step": c.get("curvature_from_step"),
                        "hessian_trace": number(h.get("hessian_trace")),
                        PROPAGATION_METRIC: number(prop.get(f"{PROPAGATION_METRIC}__{quantizer}"))})
    return out


def early_warning_findings(rows: list[dict], runs: Sequence[str], quantizers: Sequence[str] = (),
                           cfg: CorrelateConfig = CorrelateConfig(), z: float = Z):
    """Issue 48.5: does the curvature along the update (three forward passes per checkpoint) predict Δ CE?

    Per quantizer, over the checkpoints of ``runs`` that have it (:func:`early_warning_points`): Spearman ρ of the
    curvature with Δ CE with its percentile-bootstrap interval, and beside it, over the same checkpoints where their
    rows exist, the same for the Hessian trace and R_L (what quantdyn computes already; checkpoints of one run are
    not independent draws: read the intervals as optimistic). Along the trajectory, per cooldown branch and its
    constant-LR control: the curvature at each of their checkpoints (detail ``early_warning_trajectory``), and the
    decayed endpoint's minus the control's at equal tokens, combined over seeds (a finite difference has no SE of
    its own: with one seed not resolved, as the top eigenvalue)."""
    out: list[dict] = []
    detail: list[dict] = []
    names = {WARNING_METRIC: "curvature along the update", "hessian_trace": "Hessian trace",
             PROPAGATION_METRIC: "R_L (propagated error)"}
    for q in quantizers_of(rows, quantizers):
        pts = early_warning_points(rows, runs, q)
        detail += pts
        if len(pts) < cfg.min_rows:
            continue
        metrics = [m for m in (WARNING_METRIC, *EARLY_WARNING_BESIDE)
                   if sum(p.get(m) is not None for p in pts) >= cfg.min_rows]
        cs = {c["metric"]: c for c in correlate(pts, "delta_ce", metrics, cfg)}
        for m in metrics:
            c = cs[m]
            beside = "" if m == WARNING_METRIC else "beside it: "
            out.append(correlation_row(
                EARLY_WARNING_CLAIM, "early_warning", q,
                f"{beside}Spearman({names[m]}, Δ CE) over {c['n']} checkpoints with the warning", "Spearman ρ",
                c["spearman"], c["spearman_lo"], c["spearman_hi"], c["n"], +1, EARLY_WARNING_FIGURE, predictor=m))
    curv = _analysis(rows, "curvature")
    trajectory: list[dict] = []
    per: dict[tuple, list] = {}
    for run in runs:
        for b in sorted({k[1] for k in curv if k[0] == run and is_cooldown(k[1])}):
            ctrl = control_of(b)
            for role, branch in (("cooldown", b), ("control", ctrl)):
                for (_, _, step), c in sorted(((k, v) for k, v in curv.items() if k[0] == run and k[1] == branch),
                                              key=lambda kv: kv[0][2] or 0):
                    trajectory.append({"run": run, "cooldown": b, "role": role, "branch": branch, "step": step,
                                       "tokens": c.get("tokens"), "lr": c.get("lr"),
                                       WARNING_METRIC: number(c.get(WARNING_METRIC)),
                                       "update_norm": number(c.get("update_norm")),
                                       "curvature_from_step": c.get("curvature_from_step")})
            ends = [v for k, v in curv.items() if k[0] == run and k[1] == b and number(v.get(WARNING_METRIC))
                    is not None]
            ctrls = [v for k, v in curv.items() if k[0] == run and k[1] == ctrl
                     and number(v.get(WARNING_METRIC)) is not None]
            end, last = _last(ends), _last(ctrls)
            if end is None or last is None or end.get("tokens") != last.get("tokens"):
                continue
            per.setdefault((family_of(run), b), []).append(
                Difference(number(end[WARNING_METRIC]) - number(last[WARNING_METRIC]), 0.0))
    for (fam, b), ps in sorted(per.items()):
        eff = combine(ps)
        row = finding_row(EARLY_WARNING_CLAIM, "early_warning", None,
                          f"{fam}: decayed endpoint − constant-LR control, {b}", "curvature along the update", eff, +1,
                          z, EARLY_WARNING_FIGURE, branch=b, control=control_of(b), seed_family=fam,
                          predictor=None)
        row["se_windows"] = None  # a finite difference of three losses gives no within-run SE: "n/a", not 0
        if eff.se_seeds is None:
            row["verdict"] = NOT_RESOLVED
        out.append(row)
    return out, {"early_warning": detail, "early_warning_trajectory": trajectory}


# ------------------------------------------------------------------ formatting
def _g(v: float, signed: bool = False) -> str:
    """A number with 4 decimals, or 2 significant digits in scientific notation when it is small."""
    if v != 0 and abs(v) < 1e-3:
        return f"{v:+.1e}" if signed else f"{v:.1e}"
    return f"{v:+.4f}" if signed else f"{v:.4f}"


def estimate_text(effect: float, se: float | None, z: float = Z) -> str:
    """'+0.0123 ± 0.0031 (z +3.9)': an effect, its combined uncertainty and z with the digits that make the
    printed numbers agree with the verdict (results.stats.format_estimate)."""
    e, s, t = format_estimate(effect, se, z)
    return f"{e} ± {s}" + (f" (z {t})" if t != "n/a" else "")


def format_effect(f: Mapping) -> str:
    """'+0.0123 ± 0.0031 (z +3.9)' (SE-based) or '+0.45 [+0.12, +0.71]' (interval), 'n/a' without an effect."""
    e = number(f.get("effect"))
    if e is None:
        return "n/a"
    if f.get("interval_lo") is not None or f.get("se") is None:
        return format_interval(e, f.get("interval_lo"), f.get("interval_hi"))
    return estimate_text(e, f["se"], number(f.get("z_threshold")) or Z)


def format_parts(f: Mapping) -> str:
    """The uncertainty's parts: windows, seeds, run-to-run, jitter (or the bootstrap's size)."""
    if f.get("se") is None:
        return f"bootstrap over {f['n']} points" if f.get("interval_lo") is not None and f.get("n") else ""
    parts = [f"windows {_g(float(f['se_windows']))}" if f.get("se_windows") is not None else "windows n/a"]
    parts.append(f"seeds {_g(float(f['se_seeds']))} (k={f['n_seeds']})" if f.get("se_seeds") is not None
                 else f"seeds n/a (k={f.get('n_seeds', 1)})")
    parts.append(f"run-to-run {_g(float(f['se_run']))}" if f.get("se_run") is not None
                 else "run-to-run not measured (R=1)")
    if f.get("se_jitter") is not None:
        parts.append(f"stable-phase jitter {_g(float(f['se_jitter']))}")
    return ", ".join(parts)


def format_table(findings: Sequence[Mapping]) -> list[str]:
    """The findings table as text lines, grouped by finding (for text reports; the terminal gets the verdicts once,
    as sentences: section.summary_lines)."""
    if not findings:
        return ["  (no findings: the rows this study needs are missing)"]
    lines: list[str] = []
    w_q = max(9, *(len(str(f.get("quantizer") or "-")) for f in findings))
    w_m = max(6, *(len(str(f.get("metric"))) for f in findings))
    w_e = max(len(format_effect(f)) for f in findings)
    title = None
    for f in findings:
        if f["finding"] != title:
            title = f["finding"]
            lines.append(f"  {title}   (paper's sign: {f.get('expected', '?')})")
        lines.append(f"    {str(f.get('quantizer') or '-'):<{w_q}} {f['metric']:<{w_m}} {format_effect(f):>{w_e}}  "
                     f"{f['verdict']:<27} {f['comparison']}")
        parts = format_parts(f)
        lines.append(f"    {'':<{w_q}} {'':<{w_m}} {'':>{w_e}}  " + (f"({parts}; " if parts else "(")
                     + f"figure {f.get('figure') or '-'})")
    return lines


def _aligned(header: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] = ()) -> list[str]:
    """Text columns, each as wide as its widest cell (``right``: right-aligned column indices)."""
    widths = [max(len(r[c]) for r in (header, *rows)) for c in range(len(header))]
    return ["  " + " ".join(cell.rjust(w) if c in right else cell.ljust(w)
                            for c, (cell, w) in enumerate(zip(r, widths))).rstrip() for r in (header, *rows)]


def _part(v) -> str:
    return "-" if number(v) is None else _g(float(v))


def format_decay_table(tables: Sequence[Mapping], across: Sequence[Mapping] = (), z: float = Z) -> list[str]:
    """The decayed-minus-control comparison as text lines (for text reports; the report shows it as a table):
    per run, quantizer and cooldown branch, from ``decay_table``; then, from ``seed_summary``, the mean over
    seeds. Every line gives the difference ± its combined uncertainty, z, the parts and the verdict of the
    one rule (results/stats.py, as decay_table and seed_summary decided it), its numbers with the digits that
    make z and the verdict agree."""
    if not tables:
        return []
    lines = ["", "Decayed endpoint minus its constant-LR control (same tokens); ± is the combined uncertainty",
             "√(windows² + run-to-run² + jitter²): the paired SE over evaluation windows, the run-to-run SD of the",
             "quantization when it was repeated (R > 1; '-': not measured) and the stable-phase jitter (SD of Δ CE",
             "about a line through the run's constant-LR checkpoints; '-': fewer than 4). Verdict: |z| > "
             f"{z:g}, z = difference / uncertainty:"]
    body = [[str(t["run"]), str(t["quantizer"]), str(t["branch"]), f"{t['delta_ce_decayed']:.4f}",
             f"{t['delta_ce_control']:.4f}", estimate_text(t["difference"], t["difference_se"], z),
             _part(t.get("difference_eval_se")), _part(t.get("difference_run_se")), _part(t.get("stable_jitter")),
             t["verdict"]] for t in tables]
    lines += _aligned(["run", "quantizer", "branch", "ΔCE decayed", "ΔCE control", "difference ± uncertainty (z)",
                       "windows", "run-to-run", "jitter", "verdict"], body, right=(3, 4, 5, 6, 7, 8))
    if across:
        lines += ["", "Across seeds: the mean difference ± the larger of the within-seed uncertainty (its parts",
                  "combined over seeds, sqrt(Σ part²) / k) and the between-seed SE (SD over seeds / √k):"]
        body = [[str(a["family"]), str(a["quantizer"]), str(a["branch"]), str(a["n_seeds"]),
                 estimate_text(a["difference"], a["difference_se"], z), _part(a.get("within_se")),
                 _part(a.get("run_se")), _part(a.get("jitter_se")), _part(a.get("between_se")),
                 f"{a['min']:+.4f} .. {a['max']:+.4f}",
                 a["verdict"] + ("" if a["same_sign"] else " (seeds disagree in sign)")] for a in across]
        lines += _aligned(["family", "quantizer", "branch", "k", "difference ± uncertainty (z)", "windows",
                           "run-to-run", "jitter", "between", "seeds", "verdict"], body, right=(3, 4, 5, 6, 7, 8))
    return lines
