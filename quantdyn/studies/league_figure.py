"""The interventions league's figure (studies/league.py): FP CE against quantized CE, one point per intervention
and quantizer, each the seeds' mean difference from the standard linear-decay endpoint ± 2 × its uncertainty on both
axes. matplotlib is imported here, when the figure is drawn, not when a spec is read."""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

from quantdyn.report.output import save_figure, subplots


def league(found: Sequence[Mapping], out: Path) -> bool:
    """One panel per quantizer: x = FP CE − standard's, y = CE(quantized) − standard's (nats), the origin being
    the standard endpoint; below the diagonal an intervention buys more quantized quality than FP quality."""
    rows = [f for f in found if f.get("family") == "interventions" and f.get("effect") is not None]
    if not rows:
        return False
    qs = list(dict.fromkeys(f["quantizer"] for f in rows))
    cols = min(3, len(qs))
    n_rows = -(-len(qs) // cols)
    fig, axes = subplots(n_rows, cols, figsize=(3.6 * cols + 0.6, 3.3 * n_rows + 0.4), squeeze=False)
    names = list(dict.fromkeys(f["intervention"] for f in rows))
    for ax in axes.flat[len(qs):]:
        ax.set_visible(False)
    for ax, q in zip(axes.flat, qs):
        for f in (f for f in rows if f["quantizer"] == q):
            k = names.index(f["intervention"])
            ax.errorbar([f["d_ce_fp"]], [f["effect"]], xerr=[2 * (f.get("d_ce_fp_se") or 0)],
                        yerr=[2 * (f.get("se") or 0)], fmt="D" if f.get("deployed_format") else "o", ms=5,
                        color=f"C{k % 10}", capsize=2, label=f["intervention"])
        ax.axhline(0, color="0.3", lw=0.8)
        ax.axvline(0, color="0.3", lw=0.8)
        lo, hi = ax.get_xlim()
        ax.plot([lo, hi], [lo, hi], color="0.6", lw=0.8, ls=":")
        ax.set_xlim(lo, hi)
        ax.set_title(q, fontsize=9)
        ax.set_xlabel("FP CE − standard's (nats)", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("CE(quantized) − standard's (nats)", fontsize=8)
    handles, labels = axes[0][0].get_legend_handles_labels()
    seen = dict(zip(labels, handles))
    fig.legend(list(seen.values()), list(seen), loc="lower center", ncol=min(4, len(seen)), fontsize=7, frameon=False)
    save_figure(fig, out, bottom=0.2 + 0.18 * ((len(seen) + 3) // 4))
    return True
