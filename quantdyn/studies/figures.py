"""The findings' own figures (matplotlib, PNG), drawn from the detail tables of findings.py.

  peak_lr     Δ CE against FP loss per peak LR (each run faint, the matched levels marked)   paper A (b)
  averaging   averages minus the decayed endpoint: Δ CE and CE of the quantized model          paper A (c)
  sharpness   Hessian trace (± SE), top eigenvalue and Δ CE against tokens, main / cooldown / control  (d)
  predictors  Spearman ρ of each metric with Δ CE, bootstrap intervals                          paper B
  overview    every finding: z = effect / uncertainty, or ρ with its interval, coloured by verdict
Each function returns whether it drew anything.
"""
from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from quantdyn.results.schema import MAIN, is_cooldown, parse_branch
from quantdyn.results.stats import NOT_RESOLVED, OPPOSITE, REPRODUCED

_MARKERS = "osD^v<>pP*hX"


def _save(fig, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _quantizers(detail: list[dict]) -> list[str]:
    return list(dict.fromkeys(d["quantizer"] for d in detail if d.get("quantizer")))


def peak_lr(detail: list[dict], out: Path) -> bool:
    """Δ CE against FP loss, one colour per peak LR; faint lines: each run's checkpoints; markers: the
    interpolated values at the matched FP losses (mean over seeds)."""
    qs = _quantizers(detail)
    if not qs:
        return False
    lrs = sorted({d["peak_lr"] for d in detail})
    cmap = plt.get_cmap("viridis")
    fig, axes = plt.subplots(1, len(qs), figsize=(3.8 * len(qs), 3.4), squeeze=False)
    for ax, q in zip(axes[0], qs):
        for k, lr in enumerate(lrs):
            col = cmap(k / max(1, len(lrs) - 1))
            runs = sorted({d["run"] for d in detail if d["quantizer"] == q and d["peak_lr"] == lr})
            for run in runs:
                pts = sorted((d for d in detail if d["run"] == run and d["quantizer"] == q and not d["level"]),
                             key=lambda d: d["step"])
                ax.plot([d["ce_fp"] for d in pts], [d["delta_ce"] for d in pts], "-", color=col, alpha=0.35, lw=0.8)
            levels = sorted({d["ce_fp"] for d in detail if d["quantizer"] == q and d["level"]})
            means = []
            for L in levels:
                vals = [d["delta_ce"] for d in detail if d["quantizer"] == q and d["peak_lr"] == lr and d["level"]
                        and d["ce_fp"] == L and d["delta_ce"] is not None]
                means.append(sum(vals) / len(vals) if vals else math.nan)
            ax.plot(levels, means, _MARKERS[k % len(_MARKERS)] + "-", color=col, ms=4, lw=1.6, label=f"LR {lr:g}")
        for L in sorted({d["ce_fp"] for d in detail if d["quantizer"] == q and d["level"]}):
            ax.axvline(L, color="0.8", lw=0.6, zorder=0)
        ax.set_title(f"{q}: Δ CE at matched FP loss", fontsize=9)
        ax.set_xlabel("FP loss (nats)", fontsize=8)
        ax.invert_xaxis()
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
    axes[0, 0].set_ylabel("Δ CE", fontsize=8)
    axes[0, -1].legend(fontsize=7)
    _save(fig, out)
    return True


def averaging(detail: list[dict], out: Path) -> bool:
    """Per quantizer: each average (and the constant-LR main checkpoint) minus the decayed endpoint at equal
    tokens — Δ CE (left) and CE of the quantized model (right), one marker per seed, mean ± SE."""
    rows = [d for d in detail if d.get("d_delta_ce") is not None]
    qs = _quantizers(rows)
    if not qs:
        return False
    fig, axes = plt.subplots(len(qs), 2, figsize=(8.5, 2.2 * len(qs) + 0.8), squeeze=False)
    for i, q in enumerate(qs):
        mine = [d for d in rows if d["quantizer"] == q]
        names = sorted({d["checkpoint"] for d in mine})
        for j, (key, label) in enumerate((("d_delta_ce", "Δ CE"), ("d_ce_q", "CE(quantized)"))):
            ax = axes[i, j]
            for k, name in enumerate(names):
                vals = [d[key] for d in mine if d["checkpoint"] == name]
                ses = [d[f"{key}_se"] for d in mine if d["checkpoint"] == name]
                ax.errorbar(vals, [k] * len(vals), xerr=ses, fmt="o", ms=3, color="C0", alpha=0.6, capsize=1.5)
                m = sum(vals) / len(vals)
                ax.plot([m], [k], "|", color="k", ms=12, mew=2)
            ax.axvline(0, color="0.4", lw=0.8)
            ax.set_yticks(range(len(names)))
            ax.set_yticklabels(names if j == 0 else [], fontsize=7)
            ax.set_title(f"{q}: {label} minus the decayed endpoint", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3, axis="x")
    axes[-1, 0].set_xlabel("difference (nats); < 0: the average is better", fontsize=8)
    axes[-1, 1].set_xlabel("difference (nats); < 0: the average is better", fontsize=8)
    _save(fig, out)
    return True


def sharpness(detail: list[dict], out: Path) -> bool:
    """Hessian trace (± SE), top eigenvalue and Δ CE of the first quantizer against tokens, one column per
    seed: main run (black), cooldown branches (red), constant-LR controls (blue, dashed)."""
    qs = _quantizers(detail)
    if not qs:
        return False
    q = qs[0]
    mine = [d for d in detail if d["quantizer"] == q]
    runs = sorted({d["run"] for d in mine})[:4]
    fig, axes = plt.subplots(3, len(runs), figsize=(3.3 * len(runs) + 0.6, 6.4), squeeze=False, sharex="col")
    for c, run in enumerate(runs):
        pts = [d for d in mine if d["run"] == run]
        branches = sorted({d["branch"] for d in pts})
        for b in branches:
            seq = sorted((d for d in pts if d["branch"] == b), key=lambda d: d["tokens"] or 0)
            parsed = parse_branch(b)
            if parsed is not None:
                start = next((d for d in pts if d["branch"] == MAIN and d["step"] is not None
                              and seq and d["step"] == parsed.from_step), None)
                seq = ([start] if start else []) + seq
            style = dict(color="k", ls="-") if b == MAIN else \
                dict(color="C3", ls="-") if is_cooldown(b) else dict(color="C0", ls="--")
            x = [d["tokens"] for d in seq]
            axes[0, c].errorbar(x, [d["hessian_trace"] for d in seq],
                                yerr=[d.get("hessian_trace_se") or 0 for d in seq], marker="o", ms=2.5,
                                capsize=1.5, lw=1, label=b, **style)
            axes[1, c].plot(x, [d["hessian_top_eig"] for d in seq], marker="o", ms=2.5, lw=1, **style)
            axes[2, c].errorbar(x, [d["delta_ce"] for d in seq], yerr=[d.get("delta_ce_se") or 0 for d in seq],
                                marker="o", ms=2.5, capsize=1.5, lw=1, **style)
        axes[0, c].set_title(run, fontsize=9)
        axes[2, c].set_xlabel("tokens", fontsize=8)
        for ax in axes[:, c]:
            ax.grid(alpha=0.3)
            ax.tick_params(labelsize=7)
    axes[0, 0].set_ylabel("Hessian trace", fontsize=8)
    axes[1, 0].set_ylabel("top eigenvalue", fontsize=8)
    axes[2, 0].set_ylabel(f"Δ CE {q}", fontsize=8)
    axes[0, 0].legend(fontsize=6)
    _save(fig, out)
    return True


def predictors(findings: list[dict], out: Path) -> bool:
    """Spearman ρ of each metric with Δ CE (bootstrap interval), one row per metric, one colour per quantizer."""
    rows = [f for f in findings if f.get("family") == "predictors" and f.get("metric") == "Spearman ρ"
            and f.get("effect") is not None]
    if not rows:
        return False
    labels = list(dict.fromkeys(f["comparison"].split(" over ")[0] for f in rows))
    qs = list(dict.fromkeys(f["quantizer"] for f in rows))
    fig, ax = plt.subplots(figsize=(7.0, 0.45 * len(labels) * max(1, len(qs) / 2) + 1.2))
    for k, q in enumerate(qs):
        for i, lab in enumerate(labels):
            f = next((x for x in rows if x["quantizer"] == q and x["comparison"].startswith(lab)), None)
            if f is None:
                continue
            y = i + (k - (len(qs) - 1) / 2) * 0.18
            lo, hi = f.get("interval_lo"), f.get("interval_hi")
            err = [[f["effect"] - lo], [hi - f["effect"]]] if lo is not None and hi is not None else None
            ax.errorbar([f["effect"]], [y], xerr=err, fmt="o", ms=4, capsize=2, color=f"C{k}",
                        label=q if i == 0 else None)
    ax.axvline(0, color="0.4", lw=0.8)
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels([lab.replace("Spearman(", "").replace(", Δ CE)", "") for lab in labels], fontsize=8)
    ax.set_xlabel("Spearman ρ with Δ CE (95 % bootstrap interval)", fontsize=8)
    ax.set_xlim(-1.05, 1.05)
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize=7)
    _save(fig, out)
    return True


def overview(findings: list[dict], out: Path) -> bool:
    """Every finding at a glance: SE-based effects as z = effect / uncertainty (the band |z| <= 2 is "not
    resolved"; ticks: the single seeds), correlations as ρ with their bootstrap interval; colour = verdict."""
    colour = {REPRODUCED: "#1a7f37", OPPOSITE: "#b42318", NOT_RESOLVED: "0.45"}
    zs = [f for f in findings if f.get("se") is not None and f.get("effect") is not None and f["se"] > 0]
    cs = [f for f in findings if f.get("interval_lo") is not None and f.get("effect") is not None]
    panels = [(rows, key) for rows, key in ((zs, "z"), (cs, "rho")) if rows]
    if not panels:
        return False
    heights = [len(rows) for rows, _ in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(10.5, 0.3 * sum(heights) + 1.1 * len(panels)), squeeze=False,
                             gridspec_kw={"height_ratios": [h + 1.5 for h in heights]})

    def label(f):
        cmp = f["comparison"].split(": ", 1)[-1]
        return f"{f.get('quantizer') or ''} {f['metric']}: {cmp}"[:62]

    for ax, (rows, key) in zip(axes[:, 0], panels):
        for i, f in enumerate(rows):
            c = colour.get(f["verdict"], "0.45")
            if key == "z":
                ax.plot([f["effect"] / f["se"]], [i], "o", color=c, ms=4)
                for p in f.get("per_seed") or []:
                    ax.plot([p / f["se"]], [i], "|", color=c, alpha=0.6, ms=7)
            else:
                ax.errorbar([f["effect"]], [i], xerr=[[f["effect"] - f["interval_lo"]],
                                                       [f["interval_hi"] - f["effect"]]],
                            fmt="o", color=c, ms=4, capsize=2)
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([label(f) for f in rows], fontsize=6)
        ax.axvline(0, color="0.3", lw=0.8)
        if key == "z":
            ax.axvspan(-2, 2, color="0.92", zorder=0)
            lo, hi = ax.get_xlim()
            ax.set_xlim(min(lo, -3), max(hi, 3))
            ax.set_xlabel("z = effect / uncertainty (grey band: not resolved; ticks: single seeds)", fontsize=8)
        else:
            ax.set_xlim(-1.05, 1.05)
            ax.set_xlabel("correlation (or difference of correlations) with its bootstrap interval", fontsize=8)
        ax.invert_yaxis()
        ax.grid(alpha=0.3, axis="x")
        ax.tick_params(labelsize=7)
    _save(fig, out)
    return True
