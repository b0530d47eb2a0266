"""Where the quantization error comes from along training: the per-tensor sensitivity rows (kind ``sensitivity``,
engine/sensitivity.py) as maps, and what a cooldown does to each tensor group.

  sensitivity_map    per candidate type, the predicted KL of quantizing each tensor group alone (y: block x
                     attn/mlp, block 0 at the bottom) at every main-run checkpoint (x, in training order), the LR
                     at those checkpoints in a strip above
  decay_gains        per cooldown branch against its constant-LR control, at their last checkpoints: how much
                     each group's predicted KL changed, with its uncertainty and verdict by the one rule of
                     results/stats.py (SE of the two estimates over the sensitivity windows and the group's
                     stable-phase jitter along the main run, |z| > 2 resolved); the groups that gained most first

Their checkpoint tick labels are thinned to what fits the axis (report/output.py checkpoint_ticks), as the
per-block heat maps of report/error_maps.py are.
"""
from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np

from quantdyn.report.output import (LR_STYLE, LR_TEXT, MAX_HEIGHT, PAGE_WIDTH, checkpoint_label, checkpoint_ticks,
                                    figure, save_figure, subplots)
from quantdyn.results.schema import SENSITIVITY, number
from quantdyn.results.stats import (DECAY_LOWERS, DECAY_RAISES, OPPOSITE, REPRODUCED, VERDICTS, Difference,
                                    decay_verdict, format_estimate, stable_jitter, verdict_of, verdict_sign)
from quantdyn.runs import MAIN, control_of, is_cooldown


def _main(rows: list[dict], run: str) -> list[dict]:
    return [r for r in _of_run(rows, run) if (r.get("branch") or MAIN) == MAIN]


def _of_run(rows: list[dict], run: str) -> list[dict]:
    return [r for r in SENSITIVITY.select(rows) if r.get("run") == run]


def _group_order(group: str) -> tuple[int, str]:
    """'10.mlp' -> (10, 'mlp'): groups in block order (block 10 after block 2)."""
    block, _, kind = group.partition(".")
    return int(block), kind


def _groups(rows: list[dict]) -> list[str]:
    return sorted({r["tensor"] for r in rows if r.get("scope") == "group"}, key=_group_order)


def _types(rows: list[dict]) -> list[str]:
    types = {r["type"] for r in rows if r.get("scope") == "model"}
    bpw = {t: min(number(r.get("bits_per_weight")) or 0 for r in rows if r.get("type") == t) for t in types}
    return sorted(types, key=lambda t: (bpw[t], t))


def sensitivity_map(rows: list[dict], run: str, out: Path) -> list[dict]:
    """The map of the module docstring; returns the table behind it ([] when the run has no sensitivity rows)."""
    mine = [r for r in _main(rows, run) if r.get("scope") in ("group", "model")]
    if not mine:
        return []
    from matplotlib.colors import LogNorm  # the report's plotting library, imported on use

    points = sorted({(number(r.get("tokens")) or 0, number(r.get("step")) or 0, r.get("checkpoint_hash")) for r in mine})
    col = {p[2]: j for j, p in enumerate(points)}
    first_of = {}
    for r in mine:
        first_of.setdefault(r.get("checkpoint_hash"), r)
    labels = [checkpoint_label(first_of[p[2]]) for p in points]
    lrs = [number(first_of[p[2]].get("lr")) for p in points]
    groups, types = _groups(mine), _types(mine)
    n_types = len(types)
    height = min(MAX_HEIGHT, 0.9 + n_types * max(1.4, 0.16 * len(groups) + 0.6))
    fig = figure((PAGE_WIDTH, height))
    grid = fig.add_gridspec(n_types + 1, 2, height_ratios=[0.8] + [max(1.4, 0.16 * len(groups) + 0.6)] * n_types,
                            width_ratios=[40, 1], hspace=0.45, wspace=0.03)
    ax_lr = fig.add_subplot(grid[0, 0])
    table = []
    axes = []
    for i, t in enumerate(types):
        ax = fig.add_subplot(grid[i + 1, 0], sharex=ax_lr)
        axes.append(ax)
        mat = np.full((len(groups), len(points)), np.nan)
        for r in mine:
            if r.get("type") == t and r.get("scope") == "group":
                v = number(r.get("kl_pred"))
                mat[groups.index(r["tensor"]), col[r.get("checkpoint_hash")]] = v if v and v > 0 else np.nan
                table.append({"type": t, "group": r["tensor"], "step": r.get("step"), "tokens": r.get("tokens"),
                              "lr": r.get("lr"), "kl_pred": r.get("kl_pred"), "kl_pred_se": r.get("kl_pred_se")})
        finite = mat[np.isfinite(mat)]
        norm = LogNorm(vmin=finite.min(), vmax=finite.max()) if finite.size and finite.max() > finite.min() else None
        im = ax.imshow(mat, aspect="auto", origin="lower", interpolation="nearest", cmap="magma", norm=norm)
        cax = fig.add_subplot(grid[i + 1, 1])
        cb = fig.colorbar(im, cax=cax)
        cb.ax.tick_params(labelsize=6, which="both")
        step = max(1, math.ceil(len(groups) / 12))
        ax.set_yticks(range(0, len(groups), step))
        ax.set_yticklabels([g.replace(".", " ") for g in groups[::step]], fontsize=6)
        ax.set_ylabel(f"{t}\npredicted KL", fontsize=7)
        if i < n_types - 1:
            ax.tick_params(labelbottom=False)
    xs = np.arange(len(points))
    if any(v is not None for v in lrs):
        ax_lr.plot(xs, [v if v is not None else np.nan for v in lrs], marker=".", ms=3, **LR_STYLE)
    ax_lr.set_ylabel("LR", fontsize=7, color=LR_TEXT)
    ax_lr.tick_params(axis="y", labelsize=6, colors=LR_TEXT)
    ax_lr.tick_params(labelbottom=False)
    ax_lr.set_xlim(-0.5, len(points) - 0.5)
    ax_lr.set_title(f"{run}: predicted KL of quantizing each tensor group alone, along training", fontsize=9)
    checkpoint_ticks(axes[-1], labels, fig)
    axes[-1].set_xlabel("tokens (checkpoint)", fontsize=7)
    with warnings.catch_warnings():  # the colour bars' axes: tight_layout keeps the grid as it is, as wanted
        warnings.filterwarnings("ignore", message=".*not compatible with tight_layout.*")
        save_figure(fig, out)
    return table


def decay_gains(rows: list[dict], run: str) -> list[dict]:
    """The table of the module docstring (sorted by z, largest gain first)."""
    mine = _of_run(rows, run)
    sens = [r for r in mine if r.get("scope") == "group"]
    branches = sorted({r.get("branch") for r in sens if is_cooldown(r.get("branch"))})
    table = []
    for t in _types(mine):
        for g in _groups(sens):
            of = [r for r in sens if r.get("type") == t and r["tensor"] == g]
            jitter = stable_jitter([{**r, "delta_ce": r.get("kl_pred")} for r in of])
            for b in branches:
                end = _last([r for r in of if r.get("branch") == b])
                ctl = _last([r for r in of if r.get("branch") == control_of(b)])
                if end is None or ctl is None or end.get("tokens") != ctl.get("tokens"):
                    continue
                d = Difference(end["kl_pred"] - ctl["kl_pred"],
                               math.hypot(number(end.get("kl_pred_se")) or 0.0, number(ctl.get("kl_pred_se")) or 0.0),
                               jitter=jitter)
                sign = verdict_sign(d.difference, d.se)
                eff, se, z = format_estimate(d.difference, d.se)
                table.append({"run": run, "branch": b, "type": t, "group": g, "tokens": end.get("tokens"),
                              "kl_decayed": end["kl_pred"], "kl_control": ctl["kl_pred"],
                              "ratio": end["kl_pred"] / ctl["kl_pred"] if ctl["kl_pred"] else None,
                              "difference": d.difference, "difference_se": d.se, "stable_jitter": jitter, "z": d.z,
                              "estimate": f"{eff} ± {se} (z {z})", "verdict": decay_verdict(sign)})
    return sorted(table, key=lambda r: (r["branch"], r["type"], -(r["z"] if math.isfinite(r["z"]) else -1e9)))


def _last(rows: list[dict]) -> dict | None:
    return max(rows, key=lambda r: (number(r.get("tokens")) or 0, number(r.get("step")) or 0)) if rows else None


_GAIN_COLOUR = {DECAY_RAISES: VERDICTS[REPRODUCED].colour, DECAY_LOWERS: VERDICTS[OPPOSITE].colour}
"""A group's bar: the colours of the verdicts on paper A's claim that the decay raises the error (claim_verdict with
the expected sign +1), grey within uncertainty."""


def decay_gain_figure(table: list[dict], run: str, out: Path) -> bool:
    """Per cooldown branch, each group's decayed-minus-control predicted KL (relative to the control's) ± 2 SE,
    for the lowest-bit type; filled where the verdict resolves it."""
    if not table:
        return False
    t0 = table[0]["type"]
    branches = sorted({r["branch"] for r in table})
    n_groups = len({r["group"] for r in table})
    fig, axes = subplots(1, len(branches), figsize=(PAGE_WIDTH, min(MAX_HEIGHT, 1.2 + 0.18 * n_groups)),
                         squeeze=False)
    for ax, b in zip(axes[0], branches):
        rs = sorted([r for r in table if r["branch"] == b and r["type"] == t0], key=lambda r: _group_order(r["group"]))
        y = np.arange(len(rs))
        rel = [r["difference"] / r["kl_control"] if r["kl_control"] else np.nan for r in rs]
        err = [2 * r["difference_se"] / r["kl_control"] if r["kl_control"] else np.nan for r in rs]
        colors = [_GAIN_COLOUR[r["verdict"]] if r["verdict"] in _GAIN_COLOUR else verdict_of(None).colour
                  for r in rs]
        ax.barh(y, rel, xerr=err, color=colors, error_kw={"lw": 0.8, "capsize": 1.5})
        ax.axvline(0, color="k", lw=0.6)
        ax.set_yticks(y)
        ax.set_yticklabels([r["group"].replace(".", " ") for r in rs], fontsize=6)
        ax.tick_params(axis="x", labelsize=6)
        ax.set_title(b, fontsize=8)
        ax.set_xlabel(f"{t0}: (decayed − control) / control, ± 2 SE", fontsize=7)
    from matplotlib.patches import Patch

    fig.legend(handles=[Patch(color=_GAIN_COLOUR[DECAY_RAISES], label=DECAY_RAISES),
                        Patch(color=_GAIN_COLOUR[DECAY_LOWERS], label=DECAY_LOWERS),
                        Patch(color=verdict_of(None).colour, label="within uncertainty")],
               loc="lower center", ncol=3, fontsize=6, frameon=False)
    fig.suptitle(f"{run}: which tensor groups the decay made more sensitive", fontsize=9)
    save_figure(fig, out, bottom=0.3)
    return True


MAP_CAPTION = (
    "Per candidate type (rows of panels, fewest bits first) the predicted KL(FP ‖ Q) per token of quantizing one "
    "tensor group alone (y: block, attention and MLP; x: main-run checkpoints in training order; colour: log "
    "scale, its own per panel), from the sampled-Fisher sensitivity pass of every checkpoint (engine/"
    "sensitivity.py, on the calibration windows); the LR at those checkpoints above. Tick labels are thinned to "
    "what fits.")
GAIN_CAPTION = (
    "Per cooldown branch: the decayed endpoint's predicted KL of each tensor group minus its constant-LR control's "
    "at equal tokens, relative to the control's, ± 2 SE; coloured as the verdicts on paper A's claim that the decay "
    "raises the error (green: raises, red: lowers), grey within uncertainty. SE: the two estimates' SEs over the "
    "sensitivity windows and the group's stable-phase jitter along the main run, combined as for every verdict on "
    "this page (results/stats.py). The table lists every type, the groups that gained most first.")


def sections(rows: list[dict], out: Path) -> list[tuple[str, str, list[dict], str]]:
    """Per run with sensitivity rows: its map and, with cooldown branches, its decay table (title, figure, table,
    caption)."""
    found = []
    runs = sorted({r["run"] for r in SENSITIVITY.select(rows) if r.get("run")})
    for run in runs:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in run)
        png = out / f"sensitivity_{safe}.png"
        table = sensitivity_map(rows, run, png)
        if table:
            found.append((f"Run {run}: where the error comes from, along training", png.name, table, MAP_CAPTION))
        gains = decay_gains(rows, run)
        png2 = out / f"sensitivity_decay_{safe}.png"
        if gains and decay_gain_figure(gains, run, png2):
            found.append((f"Run {run}: which tensor groups the decay made more sensitive", png2.name, gains,
                          GAIN_CAPTION))
    return found
