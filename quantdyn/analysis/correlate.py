"""Which metric predicts the quantization error?

Given a table of runs/checkpoints with metric columns (Hessian trace, MMR,
kurtosis, R_L, ...) and a target column (e.g. Δ CE = CE(quantized) − CE(FP)),
report per metric Pearson's r and Spearman's ρ with percentile-bootstrap
confidence intervals, sorted by |ρ|.  Paper B's claim — MMR and kurtosis do
not predict PTQ damage while the propagated error R_L does — is a statement of
exactly this kind.

Definitions:
* Pearson r = Σ(x−x̄)(y−ȳ) / sqrt(Σ(x−x̄)² Σ(y−ȳ)²); nan if either is constant.
* Spearman ρ = Pearson r of the ranks, ties given their average rank
  (scipy.stats.rankdata's 'average'; equals scipy.stats.spearmanr).
* Bootstrap: ``n_boot`` resamples of the rows with replacement (numpy
  Generator seeded with ``seed``), both statistics recomputed on each (ranks
  recomputed per resample); the CI is the (α/2, 1−α/2) percentile interval
  of the resamples where the statistic is defined (degenerate resamples with a
  constant column are dropped and counted): ``results.stats.bootstrap_intervals``.

Rows where the metric or the target is missing (None, nan) are dropped per
metric (pairwise deletion).  No scipy or pandas needed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from quantdyn.errors import QuantdynError, did_you_mean
from quantdyn.results.stats import bootstrap_intervals

Table = Sequence[Mapping[str, object]] | Mapping[str, Sequence[object]]


@dataclass(frozen=True)
class CorrelateConfig:
    """Bootstrap settings."""

    n_boot: int = 1000
    """Bootstrap resamples (0 = no confidence intervals)."""
    ci: float = 0.95
    """Coverage of the percentile confidence interval."""
    seed: int = 0
    """Seed of the bootstrap resampling."""
    min_rows: int = 3
    """Metrics with fewer complete rows than this get nan statistics."""

    def __post_init__(self):
        if self.n_boot < 0:
            raise QuantdynError(f"correlate.n_boot={self.n_boot} must be >= 0")
        if not 0.0 < self.ci < 1.0:
            raise QuantdynError(f"correlate.ci={self.ci} must lie strictly between 0 and 1 (e.g. 0.95)")
        if self.min_rows < 3:
            raise QuantdynError(f"correlate.min_rows={self.min_rows} must be >= 3")


def rankdata(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n of a 1-D array, ties getting the average of their ranks."""
    x = np.asarray(x)
    sorter = np.argsort(x, kind="mergesort")
    inv = np.empty(sorter.size, dtype=np.intp)
    inv[sorter] = np.arange(sorter.size, dtype=np.intp)
    xs = x[sorter]
    first = np.r_[True, xs[1:] != xs[:-1]]
    dense = first.cumsum()[inv]  # 1-based id of each value's tie group
    bounds = np.r_[np.nonzero(first)[0], first.size]  # start of each group, then n
    return 0.5 * (bounds[dense] + bounds[dense - 1] + 1)


def pearson(x: Sequence[float], y: Sequence[float]) -> float:
    """Pearson correlation; nan if either input is constant or n < 2."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if x.size < 2:
        return math.nan
    dx, dy = x - x.mean(), y - y.mean()
    den = math.sqrt(float(dx @ dx) * float(dy @ dy))
    if den == 0.0:
        return math.nan
    return max(-1.0, min(1.0, float(dx @ dy) / den))


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman correlation (Pearson of average ranks)."""
    return pearson(rankdata(np.asarray(x)), rankdata(np.asarray(y)))


def _columns(table: Table) -> dict[str, list]:
    if isinstance(table, Mapping):
        cols = {str(k): list(v) for k, v in table.items()}
        lengths = {len(v) for v in cols.values()}
        if len(lengths) > 1:
            raise QuantdynError(f"correlate: table columns have different lengths {sorted(lengths)}")
        return cols
    keys = list(dict.fromkeys(k for row in table for k in row))
    return {str(k): [row.get(k) for row in table] for k in keys}


def _as_float(v: object) -> float:
    if v is None or isinstance(v, bool):
        return math.nan
    try:
        f = float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return math.nan
    return f if math.isfinite(f) else math.nan


def correlate(
    table: Table,
    target: str,
    metrics: Sequence[str] | None = None,
    cfg: CorrelateConfig = CorrelateConfig(),
) -> list[dict]:
    """Correlation of each metric column with ``target``.

    Args:
      table: list of dict rows, or dict column -> list of values.
      target: name of the column to predict (e.g. 'delta_ce').
      metrics: columns to test (default: every other column with at least
        ``cfg.min_rows`` numeric values).
      cfg: :class:`CorrelateConfig`.

    Returns rows sorted by |spearman| (descending; nan last), each: metric, n,
    spearman, spearman_lo, spearman_hi, pearson, pearson_lo, pearson_hi,
    n_boot_valid (resamples where Spearman was defined).
    """
    cols = _columns(table)
    if target not in cols:
        raise QuantdynError(f"correlate: no target column '{target}'{did_you_mean(target, cols)}; columns: {', '.join(sorted(cols))}")
    y_all = np.array([_as_float(v) for v in cols[target]])
    if metrics is None:
        metrics = [
            c for c in cols
            if c != target and sum(not math.isnan(_as_float(v)) for v in cols[c]) >= cfg.min_rows
        ]
    else:
        for m in metrics:
            if m not in cols:
                raise QuantdynError(f"correlate: no metric column '{m}'{did_you_mean(m, cols)}")
    rng = np.random.default_rng(cfg.seed)
    out = []
    for m in metrics:
        x_all = np.array([_as_float(v) for v in cols[m]])
        keep = ~(np.isnan(x_all) | np.isnan(y_all))
        x, y = x_all[keep], y_all[keep]
        n = int(x.size)
        row: dict = {"metric": m, "n": n}
        if n < cfg.min_rows:
            row.update({k: math.nan for k in ("spearman", "spearman_lo", "spearman_hi", "pearson", "pearson_lo", "pearson_hi")})
            row["n_boot_valid"] = 0
            out.append(row)
            continue
        row["spearman"] = spearman(x, y)
        row["pearson"] = pearson(x, y)
        if cfg.n_boot:
            (sp_lo, sp_hi, valid), (pe_lo, pe_hi, _) = bootstrap_intervals(
                [lambda i: spearman(x[i], y[i]), lambda i: pearson(x[i], y[i])], n, cfg.n_boot, cfg.ci, rng)
            row.update(spearman_lo=sp_lo, spearman_hi=sp_hi, pearson_lo=pe_lo, pearson_hi=pe_hi, n_boot_valid=valid)
        else:
            row.update(spearman_lo=math.nan, spearman_hi=math.nan, pearson_lo=math.nan, pearson_hi=math.nan, n_boot_valid=0)
        out.append(row)
    out.sort(key=lambda r: -abs(r["spearman"]) if not math.isnan(r["spearman"]) else math.inf)
    return out
