"""Report sections for paper B: optimizers under quantization, and QAT scaling laws."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from quantdyn.analysis.scaling import ScalingFit, predict
from quantdyn.report.output import panel_grid, save_figure
from quantdyn.report.palette import ordered_colors, quantizer_color
from quantdyn.results.schema import ANALYSIS, FP, PTQ, QAT, SCALING


def _final_main(rows: list[dict]) -> dict[str, int]:
    last: dict[str, int] = {}
    for r in rows:
        if r.get("branch") == "main" and r.get("step") is not None:
            last[r["run"]] = max(last.get(r["run"], -1), r["step"])
    return last


def optimizer_table(rows: list[dict]) -> list[dict]:
    """Per run's final checkpoint: optimizer, FP loss, PTQ Δ CE per quantizer, QAT gap, outliers and R_L."""
    last = _final_main(rows)
    out: dict[str, dict] = {}
    for r in rows:
        run = r.get("run")
        if r.get("branch") != "main" or run not in last or r.get("step") != last[run] or r.get("optimizer") is None:
            continue
        t = out.setdefault(run, {"run": run, "optimizer": r["optimizer"], "qat": r.get("qat"),
                                 "n_params": r.get("n_params"), "tokens": r.get("tokens")})
        if FP.matches(r):
            t["ce_fp"] = r["ce_fp"]
        elif PTQ.matches(r):
            t[f"dce_{r['quantizer']}"] = r["delta_ce"]
        elif QAT.matches(r):
            t["ce_qat_deployed"] = r["ce_q"]
        elif ANALYSIS.matches(r):
            for k in ("weight_mmr_mean", "weight_kurtosis_mean", "act_mmr_mean", "act_kurtosis_mean"):
                if k in r:
                    t[k] = r[k]
            for k, v in r.items():
                if k.startswith("prop_R_final__"):
                    t[f"R_L_{k.split('__', 1)[1]}"] = v
    return sorted(out.values(), key=lambda t: (str(t["optimizer"]), t.get("n_params") or 0))


def scaling_figure(rows: list[dict], out: Path) -> list[dict]:
    fits = SCALING.select(rows)
    if not fits:
        return []
    groups = sorted({f["group"] for f in fits})
    fig, axes = panel_grid(len(groups), max_cols=3, panel_height=2.8, extra_height=0.0)
    table = []
    for ax, g in zip(axes, groups):
        for f in (x for x in fits if x["group"] == g):
            pts = f["points"]
            N = np.array([p["N"] for p in pts], dtype=float)
            L = np.array([p["loss"] for p in pts], dtype=float)
            style = "o" if f["precision"] == "fp" else "s"
            ax.scatter(N, L, marker=style, s=18, label=f"{f['precision']} points")
            fit = ScalingFit(f["A"], f["alpha"], f["B"], f["beta"], f["E"], f.get("rho", 1.0))
            Dm = float(np.median([p["D"] for p in pts]))
            grid = np.geomspace(N.min() * 0.8, N.max() * 1.25, 50)
            ax.plot(grid, predict(fit, grid, np.full_like(grid, Dm)), lw=1,
                    label=f"{f['precision']} fit (D={Dm:.2g})" + (f", ρ={f['rho']:.2f}" if f["precision"] == "qat" else ""))
            table.append({k: f.get(k) for k in ("group", "precision", "A", "alpha", "B", "beta", "E", "rho",
                                                 "rho_lo", "rho_hi", "n_points")})
        ax.set_xscale("log")
        ax.set_title(str(g), fontsize=9)
        ax.set_xlabel("non-embedding parameters N", fontsize=8)
        ax.set_ylabel("loss", fontsize=8)
        ax.legend(fontsize=6)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
    save_figure(fig, out)
    return table


def optimizer_figure(table: list[dict], out: Path) -> bool:
    """Δ CE of each PTQ quantizer at each run's end, grouped by optimizer."""
    qs = sorted({k for t in table for k in t if k.startswith("dce_")})
    opts = sorted({str(t["optimizer"]) for t in table if not t.get("qat")})
    if not qs or len(opts) < 2:
        return False
    fig, axes = panel_grid(len(qs), max_cols=3, panel_height=2.6, extra_height=0.0)
    colors = ordered_colors(opts)
    for ax, q in zip(axes, qs):
        for i, o in enumerate(opts):
            vals = [t[q] for t in table if str(t["optimizer"]) == o and q in t and not t.get("qat")]
            ax.scatter([i] * len(vals), vals, s=16, color=colors[o])
        ax.set_xticks(range(len(opts)))
        ax.set_xticklabels(opts, rotation=45, fontsize=7)
        label = q.removeprefix("dce_")
        ax.set_title(f"Δ CE {label}", fontsize=9, color=quantizer_color(label))
        ax.grid(alpha=0.3)
        ax.tick_params(axis="y", labelsize=7)
    save_figure(fig, out)
    return True
