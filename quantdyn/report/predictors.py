"""Which metric predicts the quantization error? (the report's predictor section)

Joins every PTQ row (Δ CE of one quantizer at one checkpoint) with the
analysis rows of the same checkpoint (Hessian, outliers, error propagation
for that quantizer), then reports Spearman and Pearson correlations with
bootstrap intervals across the checkpoints of the study, per quantizer, and
scatter plots of the strongest metrics.
"""
from __future__ import annotations

import math
from pathlib import Path

from quantdyn.analysis.correlate import CorrelateConfig, correlate
from quantdyn.report.output import PAGE_WIDTH, save_figure, subplots
from quantdyn.report.palette import quantizer_color
from quantdyn.results.schema import ANALYSIS, PTQ

META = {"key", "kind", "analysis", "time", "git_sha", "hardware", "checkpoint", "checkpoint_hash", "run", "branch",
        "ckpt_kind", "eval_hash", "calib_hash", "data_key", "step", "tokens", "lr", "decaying", "peak_lr", "seed",
        "parent_step", "hessian_seconds", "hessian_trace_probes", "n_layers", "curvature_from", "update_norm",
        "curvature_from_step", "curvature_slope", "curvature_h", "curvature_windows", "curvature_seconds"}


def _point(r: dict) -> tuple:
    return (r.get("checkpoint"), r.get("run"), r.get("branch"), r.get("step"))


def joined_table(rows: list[dict], quantizer: str) -> list[dict]:
    """One row per checkpoint: delta_ce of ``quantizer`` plus every analysis metric of that checkpoint."""
    metrics: dict[tuple, dict] = {}
    for r in rows:
        if not ANALYSIS.matches(r):
            continue
        m = metrics.setdefault(_point(r), {})
        for k, v in r.items():
            if k in META or not isinstance(v, (int, float)) or isinstance(v, bool):
                continue
            if k.startswith("prop_"):
                base, _, q = k.partition("__")
                if q != quantizer:
                    continue
                k = base
            m[k] = float(v)
    out = []
    for r in rows:
        if PTQ.matches(r) and r.get("quantizer") == quantizer and _point(r) in metrics:
            out.append({"delta_ce": r["delta_ce"], "ce_fp": r["ce_fp"], **metrics[_point(r)]})
    return out


def predictor_rows(rows: list[dict], n_boot: int = 1000) -> list[dict]:
    qs = sorted({r["quantizer"] for r in rows if PTQ.matches(r)})
    out = []
    for q in qs:
        table = joined_table(rows, q)
        if len(table) < 3:
            continue
        for c in correlate(table, "delta_ce", cfg=CorrelateConfig(n_boot=n_boot)):
            out.append({"quantizer": q, **c})
    return out


def predictor_figure(rows: list[dict], corr: list[dict], out: Path, top: int = 4) -> bool:
    qs = sorted({c["quantizer"] for c in corr})[:4]
    if not qs:
        return False
    fig, axes = subplots(len(qs), top, figsize=(PAGE_WIDTH, 2.1 * len(qs)), squeeze=False)
    for i, q in enumerate(qs):
        table = joined_table(rows, q)
        best = [c for c in corr if c["quantizer"] == q and not math.isnan(c["spearman"])][:top]
        for j in range(top):
            ax = axes[i, j]
            if j >= len(best):
                ax.axis("off")
                continue
            m = best[j]["metric"]
            pts = [(t[m], t["delta_ce"]) for t in table if m in t]
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=10, color=quantizer_color(q))
            ax.set_title(f"{q}: ρ={best[j]['spearman']:.2f}\n[{best[j]['spearman_lo']:.2f}, "
                         f"{best[j]['spearman_hi']:.2f}]", fontsize=7, color=quantizer_color(q))
            ax.set_xlabel(m, fontsize=7)
            ax.set_ylabel("Δ CE", fontsize=7)
            ax.tick_params(labelsize=6)
            ax.grid(alpha=0.3)
    save_figure(fig, out)
    return True
