"""Downstream accuracy against quantization error (paper A, Fig. 4).

``accuracy_vs_dce`` joins accuracy rows (``kind: "accuracy"``, written by
:func:`quantdyn.sweep.accuracy.evaluate_accuracy` or a sweep with
``eval_tasks``) with PTQ rows (``kind: "ptq"``) of the same checkpoint and
quantizer, and plots the accuracy drop (FP − quantized, percentage points,
± paired SE) against Δ CE, one marker per quantizer, one panel per task plus
the mean over tasks when there are several.

Rows are joined on (checkpoint_hash, quant_config_hash) when both rows carry
the config hash, else on (checkpoint_hash, quantizer label).  When several PTQ
rows match (other calibration or evaluation sets), the first one written is used.
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from quantdyn.report.output import panel_grid, save_figure
from quantdyn.report.palette import quantizer_color
from quantdyn.results.schema import ACCURACY, PTQ
from quantdyn.results.stats import se_of_mean, total_se

MARKERS = "osD^v<>pP*hX"
MEAN_TASK = "mean over tasks"


def _ptq_index(rows: list[dict]) -> tuple[dict, dict]:
    by_cfg, by_label = {}, {}
    for r in rows:
        if not PTQ.matches(r) or r.get("delta_ce") is None:
            continue
        h = r.get("checkpoint_hash")
        if r.get("quant_config_hash"):
            by_cfg.setdefault((h, r["quant_config_hash"]), r)
        by_label.setdefault((h, r.get("quantizer")), r)
    return by_cfg, by_label


def accuracy_dce_table(rows: list[dict]) -> list[dict]:
    """The joined points of :func:`accuracy_vs_dce`, without drawing: one dict per
    (checkpoint, quantizer, task) with delta_ce, acc_fp, acc_q, acc_drop, acc_drop_se."""
    by_cfg, by_label = _ptq_index(rows)
    table, seen = [], set()
    for a in rows:
        if not ACCURACY.matches(a) or a.get("acc_drop") is None:
            continue
        h, q = a.get("checkpoint_hash"), a.get("quantizer")
        p = by_cfg.get((h, a.get("quant_config_hash"))) if a.get("quant_config_hash") else None
        p = p or by_label.get((h, q))
        ident = (h, q, a["task"])
        if p is None or ident in seen:
            continue
        seen.add(ident)
        table.append({
            "checkpoint_hash": h, "checkpoint": a.get("checkpoint") or p.get("checkpoint"),
            "step": p.get("step"), "quantizer": q, "task": a["task"], "metric": a.get("metric"),
            "delta_ce": p["delta_ce"], "delta_ce_se": p.get("delta_ce_se"), "delta_ce_total_se": total_se(p),
            "acc_fp": a["acc_fp"], "acc_q": a["acc_q"], "acc_drop": a["acc_drop"], "acc_drop_se": a.get("acc_drop_se"),
        })
    return table


def _with_means(table: list[dict]) -> list[dict]:
    """Add, per (checkpoint, quantizer) seen on every task, the mean drop over tasks (SE: sqrt(Σ SE²) / k, the
    tasks' examples being independent)."""
    tasks = sorted({t["task"] for t in table})
    if len(tasks) < 2:
        return table
    groups = defaultdict(list)
    for t in table:
        groups[(t["checkpoint_hash"], t["quantizer"])].append(t)
    out = list(table)
    for ts in groups.values():
        if len(ts) != len(tasks):
            continue
        ses = [t["acc_drop_se"] for t in ts if t.get("acc_drop_se") is not None]
        out.append({**ts[0], "task": MEAN_TASK, "metric": "mean",
                    "acc_fp": sum(t["acc_fp"] for t in ts) / len(ts), "acc_q": sum(t["acc_q"] for t in ts) / len(ts),
                    "acc_drop": sum(t["acc_drop"] for t in ts) / len(ts),
                    "acc_drop_se": se_of_mean(ses) if len(ses) == len(ts) else None})
    return out


def accuracy_vs_dce(rows: list[dict], out_png: str | Path) -> list[dict]:
    """Accuracy drop (percentage points) against Δ CE across checkpoints, one marker per quantizer.

    Draws one panel per task (plus the mean over tasks when there are
    several) into ``out_png`` and returns the table behind it (see
    :func:`accuracy_dce_table`; the mean rows have task "mean over tasks").
    With no joinable rows it draws an empty panel saying so and returns [].
    """
    table = _with_means(accuracy_dce_table(rows))
    tasks = sorted({t["task"] for t in table if t["task"] != MEAN_TASK})
    if any(t["task"] == MEAN_TASK for t in table):
        tasks.append(MEAN_TASK)
    quantizers = sorted({str(t["quantizer"]) for t in table})
    n = max(1, len(tasks))
    fig, axes = panel_grid(n, max_cols=3, panel_height=2.6, extra_height=0.3)
    if not table:
        ax = axes[0]
        ax.text(0.5, 0.5, "no accuracy rows joined\nto PTQ rows", ha="center", va="center", fontsize=9)
        ax.set_axis_off()
    for ax, task in zip(axes, tasks):
        for k, q in enumerate(quantizers):
            pts = sorted((t for t in table if t["task"] == task and str(t["quantizer"]) == q),
                         key=lambda t: t["delta_ce"])
            if not pts:
                continue
            ax.errorbar([t["delta_ce"] for t in pts], [100 * t["acc_drop"] for t in pts],
                        xerr=[t.get("delta_ce_total_se") or 0 for t in pts],
                        yerr=[100 * (t.get("acc_drop_se") or 0) for t in pts],
                        fmt=MARKERS[k % len(MARKERS)], ms=4, capsize=1.5, ls="none", color=quantizer_color(q),
                        label=q)
        ax.axhline(0, color="0.6", lw=0.8)
        ax.set_title(task, fontsize=9)
        ax.set_xlabel("Δ CE (nats)", fontsize=8)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
    for ax in axes[::3]:
        ax.set_ylabel("accuracy drop (points)", fontsize=8)
    if table:
        axes[-1].legend(fontsize=6, title="quantizer", title_fontsize=7)
    fig.suptitle("Downstream accuracy drop against quantization error", fontsize=10)
    save_figure(fig, out_png, top=0.1)
    return table
