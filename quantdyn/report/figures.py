"""Figures of a trajectory study (matplotlib), each drawn from result rows and returning the table of
numbers behind it; every figure is page-wide and written as PNG (print dpi) and SVG (``output.save_figure``).

  metric_panels  FP loss, Δ CE, Δ CE / CE(FP), Δ PPL, KL and top-1 agreement against tokens, one panel per
                 metric (or per group of quantizers of similar size, :func:`y_layout`), one colour per
                 quantizer, the LR overlaid with its axis on every panel: the trajectory figure of a sweep's
                 rows (:func:`trajectory`) and of a monitored run's metrics.jsonl (``monitored.py``) alike; the
                 checkpoints' bf16 noise floor as a grey band (``error_maps.noise_floor_band``)
  rainbow        cooldown branches' Δ CE against tokens, one colour per branch,
                 constant-LR controls dashed beside them (paper A, Fig. 5)
  loss_vs_dce    Δ CE against FP loss, one marker per run/branch (paper A, Fig. 6)
  seeds          runs that differ only by seed: mean Δ CE per branch, error bars = SD over seeds
  averaging_vs_decay  Δ CE of the decayed endpoint against averaged checkpoints

Colours come from :mod:`quantdyn.report.palette` (one per quantizer, one per branch, the same in every
figure).  Error bars are the combined uncertainty of a row (:mod:`quantdyn.results.schema`: evaluation
windows and, where the quantization was repeated, the run-to-run spread), except in ``seeds`` (SD over
seeds); the cooldown table is :func:`quantdyn.results.stats.decay_table`, with its verdicts.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter, NullFormatter

from quantdyn.report import uncertainty
from quantdyn.report.error_maps import noise_floor_band, noise_floor_handle, noise_floor_rows
from quantdyn.report.output import LR_STYLE, PAGE_WIDTH, overlay_lr, panel_grid, save_figure, tokens_axis
from quantdyn.report.palette import FP_COLOR, Palette, ordered_colors
from quantdyn.results.schema import FP, PTQ
from quantdyn.results.stats import decay_table, rel_delta_ce, rel_delta_ce_se, total_se
from quantdyn.runs import MAIN, control_of, is_control

MARKERS = "osD^v<>pP*hX"


def _qorder(rows) -> list[str]:
    def key(q):
        bits = next((r.get("bits") for r in rows if r.get("quantizer") == q), 0)
        return (-(bits or 0), q)

    return sorted({r["quantizer"] for r in rows if PTQ.matches(r)}, key=key)


def _style(ax) -> None:
    ax.grid(alpha=0.3)
    ax.tick_params(labelsize=7)
    ax.yaxis.get_offset_text().set_fontsize(7)


# --------------------------------------------------------------------------- metric panels
@dataclass(frozen=True)
class Metric:
    """One panel of :func:`metric_panels`."""

    key: str
    """Name of the value in a row (and in the figure's table)."""
    label: str
    """y-axis label."""
    value: Callable[[dict], float | None]
    """The value of a row (None: not measured)."""
    se: Callable[[dict], float] | None = None
    """Its error bar, or None."""
    log_ok: bool = True
    """Whether a log y axis may be used (see :func:`y_layout`)."""


METRICS: tuple[Metric, ...] = (
    Metric("delta_ce", "Δ CE (nats)", lambda p: p.get("delta_ce"), total_se),
    Metric("rel_delta_ce", "Δ CE / CE(FP)", rel_delta_ce, rel_delta_ce_se),
    Metric("delta_ppl", "Δ PPL", lambda p: p.get("delta_ppl")),
    Metric("kl", "KL(FP ‖ Q) (nats/token)", lambda p: p.get("kl"), lambda p: total_se(p, "kl")),
    Metric("top1_agree", "top-1 agreement with FP", lambda p: p.get("top1_agree"), log_ok=False),
)
"""The error metrics a PTQ row stores, in panel order."""
SHARED_SPREAD = 5.0
"""The largest ratio between the sizes of quantizers' values (each quantizer's largest |value|) that one linear
axis shows: beyond it the smaller curves fill less than a fifth of the panel and read as flat lines at zero."""


@dataclass(frozen=True)
class YLayout:
    """How one metric's curves share panels (:func:`y_layout`)."""

    scale: str
    """'linear' or 'log'."""
    groups: tuple[tuple[str, ...], ...]
    """The quantizers of each panel, in the caller's order; more than one group: small multiples."""


def y_layout(values: Mapping[str, Sequence[float]], log_ok: bool = True) -> YLayout:
    """The rule that keeps a quantizer that dwarfs the others from flattening them. With m_q the largest |value| of
    quantizer q and spread = max m_q / min m_q (over quantizers with m_q > 0):

    * spread <= SHARED_SPREAD: one panel, linear;
    * else, when every value is > 0 (and the metric allows it): one panel on a log axis, where each curve keeps
      its relative changes at the same height whatever its size;
    * else (a value <= 0, which a log axis cannot show): small multiples — the quantizers in decreasing size,
      a new panel whenever the next one is smaller than 1/SHARED_SPREAD of its panel's largest, each panel linear
      with its own y scale (so within every panel the spread is at most SHARED_SPREAD; a quantizer whose values
      are all 0 joins the last panel)."""
    qs = [q for q, vs in values.items() if len(vs)]
    mag = {q: max(abs(float(v)) for v in values[q]) for q in qs}
    pos = [m for m in mag.values() if m > 0]
    if len(pos) < 2 or max(pos) / min(pos) <= SHARED_SPREAD:
        return YLayout("linear", (tuple(qs),) if qs else ())
    if log_ok and all(float(v) > 0 for q in qs for v in values[q]):
        return YLayout("log", (tuple(qs),))
    groups: list[list[str]] = []
    for q in sorted(qs, key=lambda q: -mag[q]):
        if groups and (mag[q] == 0 or mag[q] * SHARED_SPREAD >= mag[groups[-1][0]]):
            groups[-1].append(q)
        else:
            groups.append([q])
    return YLayout("linear", tuple(tuple(sorted(g, key=qs.index)) for g in groups))


def _plain(v: float, _pos=None) -> str:
    return f"{v:g}"


MINOR_LABEL_DECADES = 2.0
"""A log panel spanning at most this many decades labels its minor ticks (2× and 5× a power of ten) too; a wider
one labels only the powers of ten (three labels a decade on a two-inch panel would overlap)."""


def _plain_2_5(v: float, _pos=None) -> str:
    """Minor log ticks: label 2× and 5× a power of ten, so a panel spanning a decade or two reads well."""
    if v <= 0:
        return ""
    lead = v / 10 ** math.floor(math.log10(v) + 1e-9)
    return f"{v:g}" if min(abs(lead - 2), abs(lead - 5)) < 1e-6 else ""


def _x_key(points: list[dict]) -> str:
    return "tokens" if points and all(p.get("tokens") is not None for p in points) else "step"


def _tokens_per_step(points: list[dict]) -> float | None:
    ratios = {round(p["tokens"] / p["step"], 6) for p in points
              if p.get("tokens") is not None and p.get("step")}
    return ratios.pop() if len(ratios) == 1 else None


def trajectory_table_row(q: str, p: dict) -> dict:
    """The table row of one PTQ point of :func:`metric_panels`."""
    row = {"quantizer": q, "step": p.get("step"), "tokens": p.get("tokens"), "lr": p.get("lr"),
           "decaying": p.get("decaying"), "ce_fp": p.get("ce_fp"), "delta_ce": p.get("delta_ce"),
           **uncertainty.columns(p), "rel_delta_ce": rel_delta_ce(p), "delta_ppl": p.get("delta_ppl"),
           "kl": p.get("kl"), "kl_se": p.get("kl_se"), "kl_total_se": total_se(p, "kl")
           if p.get("kl") is not None else None, "top1_agree": p.get("top1_agree")}
    for k in ("quantizer_spec", "checkpoint", "eval_hash", "calib_hash"):
        if p.get(k) is not None:
            row[k] = p[k]
    return row


def metric_panels(fp: list[dict], series: dict[str, list[dict]], lr_curve: list[tuple[float, float]], out: Path,
                  title: str, palette: Palette | None = None, metrics: tuple[Metric, ...] = METRICS) -> list[dict]:
    """FP loss and every error metric the points carry against tokens (steps when tokens are missing), one
    panel per metric wrapped two to a row, one colour per quantizer, the LR overlaid in grey on every panel
    with its own axis. Quantizers of very different size share a panel by :func:`y_layout`'s rule: linear, a
    log axis, or small multiples (the metric's panel split by size, each with its own y scale).

    ``fp``: points with ce_fp (± ce_fp_se); ``series``: {quantizer: points with the metric values and their
    uncertainties}.  Writes ``out`` (.png and .svg) and returns the table behind it (FP rows have quantizer
    "FP").  A metric no point carries gets no panel."""
    palette = palette or Palette()
    qs = list(series)
    qpts = [p for pts in series.values() for p in pts]
    allpts = qpts + list(fp)
    x_key = _x_key(allpts)
    panels: list = [("fp", (), "linear", False)] if fp else []
    for m in metrics:
        values = {q: [v for p in series[q] if (v := m.value(p)) is not None] for q in qs}
        if not any(values.values()):
            continue
        lay = y_layout(values, m.log_ok)
        panels += [(m, g, lay.scale, len(lay.groups) > 1) for g in lay.groups]
    cols = 2 if len(panels) > 2 else max(1, len(panels))
    top = 0.3  # the legend under the title (tight_layout leaves room for the title itself)
    fig, axes = panel_grid(len(panels), max_cols=cols, panel_height=2.15 if len(panels) > cols else 2.6,
                           extra_height=top, sharex=True)
    table = [{"quantizer": "FP", "step": p.get("step"), "tokens": p.get("tokens"), "lr": p.get("lr"),
              "ce_fp": p["ce_fp"], "ce_fp_se": p.get("ce_fp_se")} for p in fp]
    for q in qs:
        table += [trajectory_table_row(q, p) for p in series[q]]
    table += noise_floor_rows(fp)
    floor_drawn = False
    for ax, (panel, group, scale, split) in zip(axes, panels):
        if panel == "fp":
            pts = sorted(fp, key=lambda p: p[x_key])
            ax.errorbar([p[x_key] for p in pts], [p["ce_fp"] for p in pts],
                        yerr=[p.get("ce_fp_se") or 0 for p in pts], fmt="o-", color=FP_COLOR, ms=2.5, lw=1.1,
                        capsize=1.5)
            ax.set_ylabel("FP loss (nats)", fontsize=8)
        else:
            for q in group:
                pts = sorted((p for p in series[q] if panel.value(p) is not None), key=lambda p: p[x_key])
                yerr = [panel.se(p) for p in pts] if panel.se else None
                ax.errorbar([p[x_key] for p in pts], [panel.value(p) for p in pts], yerr=yerr, fmt="o-",
                            color=palette.quantizer(q), ms=2.5, lw=1.1, capsize=1.5, label=q)
            if scale == "log":
                ax.set_yscale("log")
                # plain numbers (0.1, 1, 10), not mathtext powers: easier to read and much cheaper to draw
                ax.yaxis.set_major_formatter(FuncFormatter(_plain))
                lo, hi = ax.get_ylim()
                if math.log10(hi / lo) <= MINOR_LABEL_DECADES:
                    ax.yaxis.set_minor_formatter(FuncFormatter(_plain_2_5))
                    ax.tick_params(axis="y", which="minor", labelsize=6)
                else:
                    ax.yaxis.set_minor_formatter(NullFormatter())
            floor_drawn |= noise_floor_band(ax, fp, panel.key, x_key)
            ax.set_ylabel(panel.label + (" (log)" if scale == "log" else ""), fontsize=8)
            if split:  # small multiples: say whose panel it is
                ax.legend(fontsize=6, loc="best", handlelength=1.2, borderpad=0.3, labelspacing=0.2, framealpha=0.8)
        overlay_lr(ax, [sorted(lr_curve)])
        _style(ax)
        if x_key == "tokens":
            tokens_axis(ax)
    n_rows = math.ceil(len(panels) / cols)
    for k, ax in enumerate(axes):
        if k >= len(panels) - cols or k // cols == n_rows - 1:
            ax.set_xlabel(x_key, fontsize=8)
    tps = _tokens_per_step(allpts) if x_key == "tokens" else None
    if tps:
        for ax in axes[:cols]:
            sec = ax.secondary_xaxis("top", functions=(lambda t, s=tps: t / s, lambda s, t=tps: s * t))
            sec.tick_params(labelsize=6)
            sec.set_xlabel("step", fontsize=7)
    handles = [Line2D([], [], color=palette.quantizer(q), marker="o", ms=3, lw=1.1, label=q) for q in qs]
    if fp:
        handles.insert(0, Line2D([], [], color=FP_COLOR, marker="o", ms=3, lw=1.1, label="FP"))
    if lr_curve:
        handles.append(Line2D([], [], **LR_STYLE, label="LR (right axis)"))
    if floor_drawn:
        handles.append(noise_floor_handle())
    fig.suptitle(title, fontsize=10, y=0.995)
    fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 1 - 0.25 / fig.get_figheight()),
               ncol=min(8, len(handles)), fontsize=7, frameon=False)
    save_figure(fig, out, top=top)
    return table


def trajectory(rows: list[dict], run: str, lr_curve: list[tuple[int, float]], out: Path,
               palette: Palette | None = None) -> list[dict]:
    """The main trajectory of ``run``: FP loss and every stored error metric per quantizer against tokens,
    with the LR (:func:`metric_panels`)."""
    main = [r for r in rows if r.get("run") == run and (r.get("branch") or MAIN) == MAIN]
    fps = sorted((r for r in main if FP.matches(r)), key=lambda r: r.get("tokens") or 0)
    series = {q: sorted((r for r in main if PTQ.matches(r) and r["quantizer"] == q),
                        key=lambda r: r.get("tokens") or 0) for q in _qorder(main)}
    return metric_panels(fps, series, lr_curve, out, f"{run}: validation loss and quantization error along training",
                         palette or Palette.for_rows(rows))


# --------------------------------------------------------------------------- cooldowns vs controls
def _branch_line(ax, seq, color, fmt, label, alpha=1.0, lw=1.3):
    ax.errorbar([r["tokens"] for r in seq], [r["delta_ce"] for r in seq], yerr=[total_se(r) for r in seq],
                fmt=fmt, color=color, ms=3, lw=lw, capsize=1.5, alpha=alpha, label=label)


def _delta_ce_panel(ax, q: str, handles: dict) -> None:
    """Finish one quantizer's Δ CE-against-tokens panel; its legend entries join ``handles`` (label -> handle)."""
    for h, lab in zip(*ax.get_legend_handles_labels()):
        handles.setdefault(lab, h)
    ax.set_ylabel(f"Δ CE {q}", fontsize=8)
    _style(ax)
    tokens_axis(ax)


def _titled_with_legend(fig, title: str, handles: dict, out: Path, legend_height: float) -> None:
    """Title, the shared legend under the panels (when there is one) and the files."""
    fig.suptitle(title, fontsize=10, y=0.995)
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=min(3, len(handles)), fontsize=7,
                   frameon=False)
    save_figure(fig, out, bottom=legend_height)


def rainbow(rows: list[dict], run: str, out: Path, palette: Palette | None = None) -> list[dict]:
    """Cooldown branches (solid, one colour each) and their controls (dashed, the twin's colour) over the
    main run (black), one panel per quantizer."""
    mine = [r for r in rows if r.get("run") == run and PTQ.matches(r)]
    qs = _qorder(mine)
    branches = sorted({r["branch"] for r in mine if r.get("ckpt_kind") == "cooldown"},
                      key=lambda b: (next((r.get("parent_step") or 0 for r in mine if r["branch"] == b), 0), b))
    if not branches:
        return []
    palette = palette or Palette.for_rows(rows)
    cols = 2 if len(qs) > 1 else 1
    n_leg = 1 + 2 * len(branches)
    leg_h = 0.17 * math.ceil(n_leg / 3) + 0.1
    fig, axes = panel_grid(len(qs), max_cols=cols, panel_height=2.3, extra_height=0.3 + leg_h, sharex=True)
    handles = {}
    for ax, q in zip(axes, qs):
        main = sorted((r for r in mine if r["quantizer"] == q and r["branch"] == "main"), key=lambda r: r["tokens"])
        by_step = {r["step"]: r for r in main}
        _branch_line(ax, main, palette.branch("main"), "o-", "main run", lw=1.0)
        for b in branches:
            col = palette.branch(b)
            pts = sorted((r for r in mine if r["quantizer"] == q and r["branch"] == b), key=lambda r: r["tokens"])
            start = by_step.get(pts[0].get("parent_step")) if pts else None
            seq = ([start] if start else []) + pts
            _branch_line(ax, seq, col, "s-", b)
            ctrl_name = control_of(b)
            ctrl = sorted((r for r in mine if r["quantizer"] == q and r["branch"] == ctrl_name), key=lambda r: r["tokens"])
            if ctrl:
                _branch_line(ax, ([start] if start else []) + ctrl, col, "^--", f"{ctrl_name} (constant LR)",
                             alpha=0.75, lw=1.0)
        _delta_ce_panel(ax, q, handles)
    for ax in axes[-cols:]:
        ax.set_xlabel("tokens", fontsize=8)
    _titled_with_legend(fig, f"{run}: cooldown branches (solid) vs constant-LR controls (dashed)", handles, out, leg_h)
    return decay_table(rows, run)


rainbow_table = decay_table
"""The endpoint table of :func:`rainbow` without drawing: :func:`quantdyn.results.stats.decay_table` (per
quantizer and cooldown branch, the decayed endpoint minus its constant-LR control, its uncertainty in parts
with the stable-phase jitter, z and the verdict)."""


# --------------------------------------------------------------------------- across runs
VARIED_KEYS = ("peak_lr", "weight_decay", "optimizer", "seed")


def varied_key(rows: list[dict]) -> str:
    """The run-level setting that differs between runs (paper A's Figure 6 colours by it), else 'run'."""
    ptq = PTQ.select(rows)
    for k in VARIED_KEYS:
        per_run = {r["run"]: r.get(k) for r in ptq}
        if len(set(map(str, per_run.values()))) > 1:
            return k
    return "run"


def loss_vs_dce(rows: list[dict], out: Path, color_key: str = "run", palette: Palette | None = None) -> list[dict]:
    """Δ CE against FP loss, one colour and marker per value of ``color_key`` (a branch's own colour when the
    key is 'branch'), one panel per quantizer, three panels to a row."""
    ptq = PTQ.select(rows)
    qs = _qorder(ptq)
    groups = sorted({str(r.get(color_key)) for r in ptq}, key=lambda g: (g != "main", is_control(g), g))
    if color_key == "branch":
        palette = palette or Palette.for_rows(rows)
        colors = {g: palette.branch(g) for g in groups}
    else:
        colors = ordered_colors(groups)
    ncol = min(4, max(1, len(groups)))
    leg_h = 0.17 * math.ceil(len(groups) / ncol) + 0.3
    fig, axes = panel_grid(len(qs), max_cols=3, panel_height=2.4, extra_height=leg_h)
    table = []
    for ax, q in zip(axes, qs):
        for k, g in enumerate(groups):
            pts = [r for r in ptq if r["quantizer"] == q and str(r.get(color_key)) == g]
            if not pts:
                continue
            ax.errorbar([r["ce_fp"] for r in pts], [r["delta_ce"] for r in pts],
                        yerr=[total_se(r) for r in pts], fmt=MARKERS[k % len(MARKERS)], ms=3.5,
                        capsize=1.5, ls="none", color=colors[g], mfc="none" if is_control(g) else colors[g], label=g)
            table += [{"quantizer": q, color_key: g, "run": r.get("run"), "branch": r.get("branch"),
                       "step": r.get("step"), "tokens": r.get("tokens"), "ce_fp": r["ce_fp"],
                       "delta_ce": r["delta_ce"], **uncertainty.columns(r), "checkpoint": r.get("checkpoint")}
                      for r in pts]
        ax.set_title(q, fontsize=9, color=Palette.quantizer(q))
        ax.set_xlabel("FP loss (nats)", fontsize=8)
        _style(ax)
    for ax in axes[:: min(3, len(axes))]:
        ax.set_ylabel("Δ CE (nats)", fontsize=8)
    handles = [Line2D([], [], ls="none", marker=MARKERS[k % len(MARKERS)], color=colors[g], ms=4,
                      mfc="none" if is_control(g) else colors[g], label=g) for k, g in enumerate(groups)]
    fig.legend(handles=handles, loc="lower center", ncol=ncol, fontsize=7, frameon=False, title=color_key,
               title_fontsize=7)
    save_figure(fig, out, bottom=leg_h)
    return table


def averaging_vs_decay(rows: list[dict], out: Path, palette: Palette | None = None) -> list[dict]:
    """Per run and bit width: Δ CE of the decayed endpoint against the averaged checkpoints (LAWA, EMA, soups)."""
    ptq = PTQ.select(rows)
    avg_kinds = ("lawa", "ema", "soup")
    table = []
    for run in sorted({r["run"] for r in ptq}):
        mine = [r for r in ptq if r["run"] == run]
        main = [r for r in mine if r["branch"] == "main" and r.get("step") is not None]
        if not main or not any(r.get("ckpt_kind") in avg_kinds for r in mine):
            continue
        last = max(r["step"] for r in main)
        for q in _qorder(mine):
            end = next((r for r in main if r["step"] == last and r["quantizer"] == q), None)
            if end is None:
                continue
            table.append({"run": run, "quantizer": q, "branch": "main", "checkpoint": f"decayed @{last}",
                          "ce_fp": end["ce_fp"], "ce_q": end["ce_q"], "delta_ce": end["delta_ce"],
                          **uncertainty.columns(end)})
            for b in sorted({r["branch"] for r in mine if r.get("ckpt_kind") in avg_kinds}):
                pts = [r for r in mine if r["branch"] == b and r["quantizer"] == q and r.get("step") is not None]
                if pts:
                    best = max(pts, key=lambda r: r["step"])
                    table.append({"run": run, "quantizer": q, "branch": b, "checkpoint": f"{b} @{best['step']}",
                                  "ce_fp": best["ce_fp"], "ce_q": best["ce_q"], "delta_ce": best["delta_ce"],
                                  **uncertainty.columns(best)})
    if not table:
        return []
    palette = palette or Palette.for_rows(rows)
    qs = list(dict.fromkeys(t["quantizer"] for t in table))
    fig, axes = panel_grid(len(qs), max_cols=3, panel_height=3.0, extra_height=0.0)
    for ax, q in zip(axes, qs):
        ts = [t for t in table if t["quantizer"] == q]
        ax.bar(range(len(ts)), [t["delta_ce"] for t in ts], yerr=[t["delta_ce_total_se"] for t in ts], capsize=2,
               color=[palette.branch(t["branch"]) for t in ts])
        ax.set_xticks(range(len(ts)))
        many = len({t["run"] for t in ts}) > 1
        ax.set_xticklabels([f"{t['run']}: {t['checkpoint']}" if many else t["checkpoint"] for t in ts],
                           rotation=45, ha="right", fontsize=6)
        ax.set_title(f"Δ CE {q}", fontsize=9, color=Palette.quantizer(q))
        ax.tick_params(axis="y", labelsize=7)
        ax.grid(alpha=0.3, axis="y")
    save_figure(fig, out)
    return table


def seed_families(rows: list[dict]) -> dict[str, list[str]]:
    """Runs that differ only by seed, named NAME-s<seed> (as `quantdyn study` and `quantdyn grid` name
    them): {NAME: [runs]} for every NAME with at least two seeds."""
    seeds = {r["run"]: r.get("seed") for r in rows if PTQ.matches(r) and r.get("run")}
    fam: dict[str, list[str]] = {}
    for run, seed in seeds.items():
        suffix = f"-s{seed}"
        if seed is not None and run.endswith(suffix):
            fam.setdefault(run[: -len(suffix)], []).append(run)
    return {k: sorted(v) for k, v in sorted(fam.items()) if len(v) >= 2}


def seeds(rows: list[dict], family: str, runs: list[str], out: Path, palette: Palette | None = None) -> list[dict]:
    """Mean Δ CE over the seeds of one family, per quantizer and branch, at the steps every seed has;
    error bars = SD over seeds (n − 1), faint lines = the single seeds."""
    mine = [r for r in rows if PTQ.matches(r) and r.get("run") in runs]
    qs = _qorder(mine)
    branches = sorted({r["branch"] for r in mine}, key=lambda b: (b != MAIN, is_control(b), b))
    if not qs:
        return []
    palette = palette or Palette.for_rows(rows)
    cols = 2 if len(qs) > 1 else 1
    leg_h = 0.17 * math.ceil(len(branches) / 3) + 0.1
    fig, axes = panel_grid(len(qs), max_cols=cols, panel_height=2.3, extra_height=0.3 + leg_h, sharex=True)
    table = []
    handles = {}
    for ax, q in zip(axes, qs):
        mains = {run: {r["step"]: r for r in mine if r["run"] == run and r["branch"] == "main" and r["quantizer"] == q}
                 for run in runs}
        for b in branches:
            per_run = {run: {r["step"]: r for r in mine if r["run"] == run and r["branch"] == b and r["quantizer"] == q}
                       for run in runs}
            steps = sorted(set.intersection(*(set(v) for v in per_run.values())))
            if not steps:
                continue
            parent = next(iter(per_run[runs[0]].values())).get("parent_step") if b != "main" else None
            if parent is not None and all(parent in mains[run] for run in runs):
                for run in runs:  # draw the branch from the checkpoint it starts at (not a table row)
                    per_run[run] = {parent: mains[run][parent], **per_run[run]}
                lines = [parent] + steps
            else:
                lines = steps
            style = "^--" if is_control(b) else "o-"
            col = palette.branch(b)
            for run in runs:
                ax.plot([per_run[run][s]["tokens"] for s in lines], [per_run[run][s]["delta_ce"] for s in lines],
                        style[1:], color=col, lw=0.6, alpha=0.3)
            xs, ms, sds = [], [], []
            for s in lines:
                vals = [per_run[run][s]["delta_ce"] for run in runs]
                m, sd = statistics.fmean(vals), statistics.stdev(vals)
                xs.append(per_run[runs[0]][s]["tokens"])
                ms.append(m)
                sds.append(sd)
                if s not in steps:
                    continue
                table.append({"family": family, "quantizer": q, "branch": b, "step": s, "tokens": xs[-1],
                              "n_seeds": len(vals), "delta_ce_mean": m, "delta_ce_seed_sd": sd,
                              "delta_ce_min": min(vals), "delta_ce_max": max(vals)})
            ax.errorbar(xs, ms, yerr=sds, fmt=style, color=col, ms=3, lw=1.2, capsize=2,
                        alpha=0.8 if is_control(b) else 1.0, label=b)
        _delta_ce_panel(ax, q, handles)
    for ax in axes[-cols:]:
        ax.set_xlabel("tokens", fontsize=8)
    _titled_with_legend(fig, f"{family}: mean over {len(runs)} seeds (error bars: SD over seeds; faint: each seed)",
                        handles, out, leg_h)
    return table


__all__ = [
    "METRICS",
    "SHARED_SPREAD",
    "PAGE_WIDTH",
    "Metric",
    "averaging_vs_decay",
    "loss_vs_dce",
    "metric_panels",
    "overlay_lr",
    "rainbow",
    "rainbow_table",
    "seed_families",
    "seeds",
    "trajectory",
    "varied_key",
    "y_layout",
    "YLayout",
]
