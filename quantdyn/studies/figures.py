"""The findings' own figures (matplotlib; PNG and SVG, report/output.py's save_figure), drawn from the detail
tables of findings.py.

  peak_lr     Δ CE against FP loss per peak LR (each run faint, the matched levels marked)   paper A (b)
  averaging   averages minus the decayed endpoint: Δ CE and CE of the quantized model          paper A (c)
  sharpness   Hessian trace (± SE), top eigenvalue and Δ CE against tokens, main / cooldown / control  (d)
  predictors  Spearman ρ of each metric with Δ CE, bootstrap intervals                          paper B
  overview    every finding, full labels, coloured by verdict with a legend: the effect as a percentage of its
              reference (± 2 × uncertainty) with its nats and z beside it, or z, or ρ with its interval
Each function returns whether it drew anything.
"""
from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Callable, Mapping

from matplotlib import colormaps
from matplotlib.lines import Line2D

from quantdyn.report.output import PAGE_WIDTH, save_figure, subplots
from quantdyn.results.stats import NOT_RESOLVED, VERDICTS, format_estimate, format_interval, verdict_of
from quantdyn.runs import MAIN, is_control, is_cooldown, is_intervention, is_nodecay, parse_branch
from quantdyn.studies.findings import relative_baseline

_MARKERS = "osD^v<>pP*hX"


def _quantizers(detail: list[dict]) -> list[str]:
    return list(dict.fromkeys(d["quantizer"] for d in detail if d.get("quantizer")))


def peak_lr(detail: list[dict], out: Path) -> bool:
    """Δ CE against FP loss, one colour per peak LR; faint lines: each run's checkpoints; markers: the
    interpolated values at the matched FP losses (mean over seeds)."""
    qs = _quantizers(detail)
    if not qs:
        return False
    lrs = sorted({d["peak_lr"] for d in detail})
    cmap = colormaps["viridis"]
    fig, axes = subplots(1, len(qs), figsize=(3.8 * len(qs), 3.4), squeeze=False)
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
    save_figure(fig, out)
    return True


def averaging(detail: list[dict], out: Path) -> bool:
    """Per quantizer: each average (and the constant-LR main checkpoint) minus the decayed endpoint at equal
    tokens — Δ CE (left) and CE of the quantized model (right), one marker per seed, mean ± SE."""
    rows = [d for d in detail if d.get("d_delta_ce") is not None]
    qs = _quantizers(rows)
    if not qs:
        return False
    fig, axes = subplots(len(qs), 2, figsize=(8.5, 2.2 * len(qs) + 0.8), squeeze=False)
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
    save_figure(fig, out)
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
    fig, axes = subplots(3, len(runs), figsize=(3.3 * len(runs) + 0.6, 6.4), squeeze=False, sharex="col")
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
    save_figure(fig, out)
    return True


_OTHER_COLOURS = ("C1", "C2", "C4", "C5", "C6", "C8", "C9")  # neither main's black, the cooldown's red nor the control's blue


def _standard_cooldown(b: str) -> bool:
    return is_cooldown(b) and not is_intervention(b) and not is_nodecay(b)


def early_warning(findings: list[dict], detail: list[dict], out: Path) -> bool:
    """The early warning (issue 48.5), first quantizer: Δ CE against the curvature along the update, one point per
    checkpoint (Spearman ρ and its interval in the title); and the curvature against tokens, one line per run and
    branch: main run (black), standard cooldowns (red), constant-LR controls (blue, dashed), interventions and
    no-decay branches (other colours, dotted)."""
    qs = _quantizers(detail)
    if not qs:
        return False
    q = qs[0]
    mine = [d for d in detail if d["quantizer"] == q]
    rho = next((f for f in findings if f.get("quantizer") == q and f.get("predictor") == "curvature_along_update"),
               None)
    fig, axes = subplots(1, 2, figsize=(PAGE_WIDTH, 3.2), squeeze=False)
    left, right = axes[0]
    branches = sorted({d["branch"] for d in mine}, key=lambda b: (b != MAIN, b))
    others = [b for b in branches if b != MAIN and not is_control(b) and not _standard_cooldown(b)]

    def style(b: str) -> dict:  # main black, the standard cooldown red, its control blue dashed, the rest dotted
        if b == MAIN:
            return dict(color="k", ls="-")
        if _standard_cooldown(b):
            return dict(color="C3", ls="-")
        if is_control(b):
            return dict(color="C0", ls="--")
        return dict(color=_OTHER_COLOURS[others.index(b) % len(_OTHER_COLOURS)], ls=":")

    for b in branches:
        pts = [d for d in mine if d["branch"] == b]
        left.errorbar([d["curvature_along_update"] for d in pts], [d["delta_ce"] for d in pts],
                      yerr=[d.get("delta_ce_se") or 0 for d in pts], fmt="o", ms=3, capsize=1.5,
                      color=style(b)["color"], label=b)
        for run in sorted({d["run"] for d in pts}):  # one line per run: seeds are not joined
            seq = sorted((d for d in pts if d["run"] == run), key=lambda d: d["tokens"] or 0)
            parsed = parse_branch(b)
            start = next((d for d in mine if parsed is not None and d["branch"] == MAIN and d["run"] == run
                          and d["step"] == parsed.from_step), None)  # the branch point, where the branch leaves main
            line = ([start] if start else []) + seq
            right.plot([d["tokens"] for d in line], [d["curvature_along_update"] for d in line], marker="o", ms=2.5,
                       lw=1, **style(b))
    if rho is not None and rho.get("effect") is not None:
        rho_text = format_interval(rho["effect"], rho.get("interval_lo"), rho.get("interval_hi"))
        left.set_title(f"{q}: Spearman ρ {rho_text} over {rho.get('n')} checkpoints", fontsize=8)
    left.set_xlabel("curvature along the update", fontsize=8)
    left.set_ylabel(f"Δ CE {q}", fontsize=8)
    right.set_xlabel("tokens", fontsize=8)
    right.set_ylabel("curvature along the update", fontsize=8)
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
    handles, labels = left.get_legend_handles_labels()  # below both panels: no point hidden behind it
    fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize=6, frameon=False)
    bottom = 0.12 + 0.07 * ((len(labels) + 3) // 4)
    save_figure(fig, out, bottom=bottom)
    return True


def predictors(findings: list[dict], out: Path) -> bool:
    """Spearman ρ of each metric with Δ CE (bootstrap interval), one row per metric, one colour per quantizer."""
    rows = [f for f in findings if f.get("family") == "predictors" and f.get("metric") == "Spearman ρ"
            and f.get("effect") is not None]
    if not rows:
        return False
    labels = list(dict.fromkeys(f["comparison"].split(" over ")[0] for f in rows))
    qs = list(dict.fromkeys(f["quantizer"] for f in rows))
    fig, ax = subplots(figsize=(7.0, 0.45 * len(labels) * max(1, len(qs) / 2) + 1.2))
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
    save_figure(fig, out)
    return True


LABEL_WIDTH = 44
"""Characters per line of a finding's label (labels wrap, never cut)."""


def finding_label(f: Mapping, with_family: bool = False) -> str:
    """A finding's label in the overview: quantizer, metric and comparison, wrapped at LABEL_WIDTH, never cut
    (a family may label its findings otherwise: studies/families.py FindingFamily.label)."""
    q = f"{f['quantizer']} · " if f.get("quantizer") else ""
    return "\n".join(textwrap.wrap(f"{q}{f['metric']}: {f['comparison']}", LABEL_WIDTH))


def _mode(f: dict) -> str | None:
    """How a finding is drawn: 'rel' (percent of its reference), 'z', 'rho' (an interval), or None (no number)."""
    if f.get("effect") is None:
        return None
    if f.get("interval_lo") is not None:
        return "rho"
    if f.get("se") is None or f["se"] <= 0:
        return None
    return "rel" if relative_baseline(f) is not None else "z"


def _numbers(f: dict, mode: str) -> str:
    """The right-hand label of a finding: effect ± uncertainty (nats), z; or ρ [interval]."""
    if mode == "rho":
        return format_interval(f["effect"], f["interval_lo"], f["interval_hi"])
    e, s, z = format_estimate(f["effect"], f["se"], f.get("z_threshold") or 2.0)
    unit = " nats" if f.get("metric") in ("Δ CE", "CE(quantized)") else ""
    return f"{e} ± {s}{unit}, z {z}"


def _span(rows: list[dict], mode: str, zt: float) -> tuple[float, float]:
    """The x range of a panel: every point, 0, and the bars of the resolved findings (an unresolved bar may run
    off the panel: it crosses 0 whatever its length, and drawing it whole would flatten every other row)."""
    xs = [0.0]
    for f in rows:
        x, half = _x(f, mode, zt)
        xs.append(x)
        if f["verdict"] != NOT_RESOLVED and half is not None:
            xs += [x - half, x + half]
    lo, hi = min(xs), max(xs)
    pad = 0.08 * (hi - lo or 1.0)
    return lo - pad, hi + pad


def _x(f: dict, mode: str, zt: float) -> tuple[float, float | None]:
    """(x, half width of its bar) of a finding in its panel's units."""
    if mode == "rel":
        scale = 100.0 / f["baseline"]
        return f["effect"] * scale, zt * f["se"] * scale
    if mode == "z":
        return f["effect"] / f["se"], None
    return f["effect"], None


PANEL_TEXT = {
    "rel": ("{claim}: each effect as a percentage of {ref}",
            "effect, % of the reference (bar: ± {z:g} × uncertainty; a bar across 0 is not resolved)"),
    "z": ("{claim}: z = effect / uncertainty", "z (grey band: |z| ≤ {z:g}, not resolved)"),
    "rho": ("{claim}: correlations", "Spearman ρ (or a difference of ρ) with its 95 % bootstrap interval"),
}


def overview(findings: list[dict], out: Path,
             label: Callable[[Mapping, bool], str] = finding_label,
             panel_title: Callable[[list[dict], str], str | None] = lambda rows, mode: None) -> bool:
    """Every finding at a glance, one panel per paper's claim (and way of drawing it), one row per finding,
    coloured by verdict (a legend names every colour); full labels on the left, effect ± uncertainty in nats
    and z on the right. ``label(finding, name its seed family)`` and ``panel_title(a panel's findings, its way of
    drawing: 'rel', 'z' or 'rho')`` (None: PANEL_TEXT's) let the finding families word their own
    (studies/families.py):

    * effects with a reference (decay: the control's Δ CE; averaging: the decayed endpoint's) as a percentage of
      it, the bar spanning ± z × the uncertainty (a bar across 0 is not resolved), diamonds the single seeds;
    * other SE-based effects as z = effect / uncertainty, the band |z| <= z shaded;
    * correlations as ρ with their bootstrap interval.
    An unresolved bar longer than the panel runs off its edge (an arrow marks it)."""
    drawable = [f for f in findings if _mode(f)]
    if not drawable:
        return False
    zt = next((f["z_threshold"] for f in drawable if f.get("z_threshold")), 2.0)
    # a claim's SE-based effects share one way of drawing: relative when every one has a reference > 0, else z
    relative = {c for c in {f["finding"] for f in drawable}
                if all(_mode(f) == "rel" for f in drawable if f["finding"] == c and _mode(f) != "rho")}
    panels: dict[tuple[str, str], list[dict]] = {}
    for f in drawable:
        mode = _mode(f) if _mode(f) == "rho" or f["finding"] in relative else "z"
        panels.setdefault((f["finding"], mode), []).append(f)
    fams = {f.get("seed_family") for f in drawable if f.get("seed_family")}
    labels = {id(f): label(f, len(fams) > 1) for f in drawable}
    heights = [sum(0.2 + 0.12 * labels[id(f)].count("\n") for f in rows) + 0.8 for rows in panels.values()]
    shown = [v for v in VERDICTS.values() if any(f["verdict"] == v.word for f in drawable)]
    seeds = any(len(f.get("per_seed") or []) > 1 for f in drawable if _mode(f) != "rho")
    modes = {mode for _, mode in panels}
    leg_h = 0.17 * math.ceil((len(shown) + bool(modes & {"rel", "rho"}) + seeds) / 2) + 0.15
    fig, axes = subplots(len(panels), 1, figsize=(PAGE_WIDTH, sum(heights) + leg_h + 0.1), squeeze=False,
                         gridspec_kw={"height_ratios": heights})
    for ax, ((claim, mode), rows) in zip(axes[:, 0], panels.items()):
        lo, hi = _span(rows, mode, zt) if mode != "rho" else (-1.05, 1.05)
        if mode == "z":
            lo, hi = min(lo, -zt - 1), max(hi, zt + 1)
            ax.axvspan(-zt, zt, color="0.92", zorder=0)
        ax.set_xlim(lo, hi)
        for i, f in enumerate(rows):
            c = verdict_of(f["verdict"]).colour
            x, half = _x(f, mode, zt)
            if mode == "rho":
                ax.errorbar([x], [i], xerr=[[x - f["interval_lo"]], [f["interval_hi"] - x]], fmt="o", color=c,
                            ms=4.5, capsize=2.5, lw=1.4)
                continue
            if half is not None:
                ax.errorbar([x], [i], xerr=[half], fmt="o", color=c, ms=4.5, capsize=2.5, lw=1.4)
                for end, edge, mark in ((x - half, lo, "<"), (x + half, hi, ">")):
                    if (end < edge) if mark == "<" else (end > edge):
                        ax.plot([edge], [i], mark, color=c, ms=5, clip_on=False)
            else:
                ax.plot([x], [i], "o", color=c, ms=4.5)
            per = f.get("per_seed") or []
            if len(per) > 1:
                unit = 100.0 / f["baseline"] if mode == "rel" else 1.0 / f["se"]
                ax.plot([p * unit for p in per], [i] * len(per), "d", color=c, mfc="white", ms=3.5, mew=0.9,
                        alpha=0.9)
        n = len(rows)
        ax.set_ylim(n - 0.5, -0.5)
        ax.set_yticks(range(n))
        ax.set_yticklabels([labels[id(f)] for f in rows], fontsize=7)
        ax.axvline(0, color="0.3", lw=0.8)
        right = ax.twinx()
        right.set_ylim(ax.get_ylim())
        right.set_yticks(range(n))
        right.set_yticklabels([_numbers(f, mode) for f in rows], fontsize=6.5)
        right.tick_params(axis="y", length=0)
        refs = " / ".join(sorted({f.get("baseline_of") or "its reference" for f in rows}))
        title, xlabel = PANEL_TEXT[mode]
        title = panel_title(rows, mode) or title
        ax.set_title("\n".join(textwrap.wrap(title.format(claim=claim, ref=refs), 95)), fontsize=8.5)
        ax.set_xlabel(xlabel.format(z=zt), fontsize=7.5)
        ax.grid(alpha=0.3, axis="x")
        ax.tick_params(axis="x", labelsize=7)
    handles = [Line2D([], [], ls="none", marker="o", color=v.colour, ms=5, label=v.legend.format(z=zt))
               for v in shown]
    if modes & {"rel", "rho"}:
        bar = " / ".join(x for x, k in ((f"± {zt:g} × uncertainty", "rel"), ("the bootstrap interval", "rho"))
                         if k in modes)
        handles.append(Line2D([], [], color="0.3", marker="o", ms=4, lw=1.4, label=f"bar: {bar}"))
    if seeds:
        handles.append(Line2D([], [], ls="none", marker="d", color="0.3", mfc="white", ms=4, label="one seed"))
    fig.legend(handles=handles, loc="lower center", ncol=2, fontsize=7, frameon=False)
    save_figure(fig, out, bottom=leg_h)
    return True
