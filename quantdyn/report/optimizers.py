"""Report sections for paper B: optimizers under quantization, and QAT scaling laws."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from quantdyn.analysis.scaling import ScalingFit, predict


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
        if r["kind"] == "fp":
            t["ce_fp"] = r["ce_fp"]
        elif r["kind"] == "ptq":
            t[f"dce_{r['quantizer']}"] = r["delta_ce"]
        elif r["kind"] == "qat":
            t["ce_qat_deployed"] = r["ce_q"]
        elif r["kind"] == "analysis":
            for k in ("weight_mmr_mean", "weight_kurtosis_mean", "act_mmr_mean", "act_kurtosis_mean"):
                if k in r:
                    t[k] = r[k]
            for k, v in r.items():
                if k.startswith("prop_R_final__"):
                    t[f"R_L_{k.split('__', 1)[1]}"] = v
    return sorted(out.values(), key=lambda t: (str(t["optimizer"]), t.get("n_params") or 0))


def scaling_figure(rows: list[dict], out: Path) -> list[dict]:
    fits = [r for r in rows if r.get("kind") == "scaling"]
    if not fits:
        return []
    groups = sorted({f["group"] for f in fits})
    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 3.5), squeeze=False)
    table = []
    for ax, g in zip(axes[0], groups):
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
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return table


def optimizer_figure(table: list[dict], out: Path) -> bool:
    """Δ CE of each PTQ quantizer at each run's end, grouped by optimizer."""
    qs = sorted({k for t in table for k in t if k.startswith("dce_")})
    opts = sorted({str(t["optimizer"]) for t in table if not t.get("qat")})
    if not qs or len(opts) < 2:
        return False
    fig, axes = plt.subplots(1, len(qs), figsize=(3.4 * len(qs), 3.2), squeeze=False)
    for ax, q in zip(axes[0], qs):
        for i, o in enumerate(opts):
            vals = [t[q] for t in table if str(t["optimizer"]) == o and q in t and not t.get("qat")]
            ax.scatter([i] * len(vals), vals, s=16)
        ax.set_xticks(range(len(opts)))
        ax.set_xticklabels(opts, rotation=45, fontsize=7)
        ax.set_title(q.replace("dce_", "Δ CE "), fontsize=9)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return True
