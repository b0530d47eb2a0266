"""The rotations family's figure: the LR-decay effect without and with a rotation, per quantizer pair
(studies/rotation_findings.py). matplotlib is imported here, when the figure is drawn, not when a spec is read."""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

from quantdyn.report.output import save_figure, subplots
from quantdyn.results.stats import VERDICTS, verdict_of
from quantdyn.studies.rotation_findings import rotation_effect_words


def rotations(found: Sequence[Mapping], out: Path) -> bool:
    """One row per finding: the decay effect (decayed endpoint − constant-LR control, Δ CE) of the plain quantizer
    (grey) and of its rotated twin (the verdict's colour), each ± 2 × its uncertainty, and the words of the
    difference beside them."""
    rows = [f for f in found if f.get("plain") and f.get("decay_plain") is not None]
    if not rows:
        return False
    fig, axes = subplots(1, 1, figsize=(8.5, 0.55 * len(rows) + 1.4), squeeze=False)
    ax = axes[0, 0]
    labels = []
    for k, f in enumerate(rows):
        y = len(rows) - 1 - k
        colour = verdict_of(f.get("verdict")).colour if f.get("verdict") in VERDICTS else "C0"
        ax.errorbar([f["decay_plain"]], [y + 0.15], xerr=[2 * (f["decay_plain_se"] or 0)], fmt="s", ms=4,
                    color="0.45", capsize=2, label="without rotation" if k == 0 else None)
        ax.errorbar([f["decay_rotated"]], [y - 0.15], xerr=[2 * (f["decay_rotated_se"] or 0)], fmt="o", ms=4,
                    color=colour, capsize=2, label="with rotation" if k == 0 else None)
        labels.append(f"{f['plain']} → {f['quantizer']}\n{f.get('branch') or ''}")
        ax.annotate(rotation_effect_words(f), xy=(1.01, y), xycoords=("axes fraction", "data"), fontsize=7,
                    va="center")
    ax.axvline(0, color="0.3", lw=0.8)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(labels[::-1], fontsize=7)
    ax.set_xlabel("decay effect: Δ CE(decayed) − Δ CE(constant-LR control) (nats), ± 2 × uncertainty", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3, axis="x")
    ax.set_ylim(-0.6, len(rows) - 0.4)
    # above the axes: inside them the legend hid a row's points (the last row's, where it sat)
    ax.legend(fontsize=7, loc="lower left", bbox_to_anchor=(0, 1.0), ncol=2, frameon=False)
    save_figure(fig, out)
    return True
