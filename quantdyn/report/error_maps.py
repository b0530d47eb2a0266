"""Where, when and on which tokens the quantization error appears, and what mere bf16 costs beside it.

  noise_floor_band   the checkpoint's bf16 noise floor (fp rows' ``floor_<metric>``) as a grey band on a
                     trajectory panel (called by ``figures.metric_panels`` for every metric it draws)
  block_heatmaps     per quantizer, the relative error of every block's output (``block_rel_fro``) as a
                     block x checkpoint heat map along the main run, the noise floor's map beside them: paper
                     A's decay effect and paper B's propagated error in one picture
  kl_by_confidence   KL(FP ‖ Q) by FP's top-1 probability (``kl_by_confidence``), the decayed endpoint of each
                     cooldown branch beside its constant-LR control
  sections           the report sections of the two figures, when the rows carry their fields

Rows written before these fields existed lack them: a figure that needs a field no row has is left out, and
the section's caption names the rows that lack it (one line), never an error.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from matplotlib.colors import LogNorm
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter

from quantdyn.report.output import checkpoint_label, checkpoint_ticks, layout_figure, panel_grid, save_figure
from quantdyn.report.palette import Palette
from quantdyn.results.schema import FP, PTQ, RowKind, number
from quantdyn.runs import MAIN, control_of

FLOOR_COLOR = "0.55"
FLOOR_LABEL = "bf16 noise floor (± 2 SE)"
CONFIDENCE_BUCKETS = ("[0, .25)", "[.25, .5)", "[.5, .75)", "[.75, .95)", "[.95, 1]")
"""The buckets of ``kl_by_confidence`` (evaluate/quant_error.CONFIDENCE_EDGES)."""

# metric -> (the value a perfect quantizer has, the floor's SE field or None, divide the SE by CE(FP))
_FLOOR_OF = {
    "delta_ce": (0.0, "floor_delta_ce_se", False),
    "rel_delta_ce": (0.0, "floor_delta_ce_se", True),
    "delta_ppl": (0.0, None, False),
    "kl": (0.0, "floor_kl_se", False),
    "top1_agree": (1.0, "floor_top1_agree_se", False),
}


_PLAIN = FuncFormatter(lambda v, _pos=None: f"{v:.2g}")
"""Tick labels as plain numbers (0.002, 3e-05), never mathtext powers: easier to read, cheaper to draw."""
_PLAIN_2_5 = FuncFormatter(lambda v, _pos=None: f"{v:.2g}" if v > 0 and f"{v:.1e}"[0] in "25" else "")
"""Minor log ticks: only 2× and 5× a power of ten labelled."""


def _plain_ticks(axis) -> None:
    axis.set_major_formatter(_PLAIN)
    axis.set_minor_formatter(_PLAIN_2_5)
    axis.set_tick_params(which="both", labelsize=6)


def _floor_span(p: dict, key: str) -> tuple[float, float] | None:
    """(no-error value, floor value pushed 2 SE away from it) of one fp point, or None without a floor."""
    perfect, se_key, relative = _FLOOR_OF[key]
    v = number(p.get(f"floor_{key}"))
    if v is None:
        return None
    se = number(p.get(se_key)) if se_key else 0.0
    if se and relative:
        se = se / (number(p.get("ce_fp")) or math.inf)
    edge = v + 2 * (se or 0.0) if perfect == 0.0 else v - 2 * (se or 0.0)
    return perfect, edge


def noise_floor_band(ax, fp: list[dict], key: str, x_key: str) -> bool:
    """Shade, on the panel of metric ``key``, the region between the no-error value (0; 1 for agreement) and the
    checkpoint's bf16 noise floor 2 SE beyond its value, at every checkpoint whose fp row carries a floor: a
    quantizer inside the band is indistinguishable from storing the model in bf16. On a log axis the band runs
    from the panel's bottom. Returns whether a band was drawn."""
    if key not in _FLOOR_OF:
        return False
    pts = sorted((p for p in fp if p.get(x_key) is not None and _floor_span(p, key) is not None),
                 key=lambda p: p[x_key])
    if not pts:
        return False
    xs = [p[x_key] for p in pts]
    lo, hi = zip(*(_floor_span(p, key) for p in pts))
    if ax.get_yscale() == "log":
        hi = [max(h, 1e-300) for h in hi]
        ax.plot(xs, hi, alpha=0)  # let the band's edge into the axis limits
        bottom = ax.get_ylim()[0]
        ax.fill_between(xs, bottom, hi, color=FLOOR_COLOR, alpha=0.25, lw=0, zorder=0)
        ax.set_ylim(bottom=bottom)
    else:
        ax.fill_between(xs, lo, hi, color=FLOOR_COLOR, alpha=0.25, lw=0, zorder=0)
    return True


def noise_floor_handle() -> Patch:
    """The legend entry of :func:`noise_floor_band`."""
    return Patch(color=FLOOR_COLOR, alpha=0.25, label=FLOOR_LABEL)


def noise_floor_rows(fp: list[dict]) -> list[dict]:
    """The numbers behind the band, one table row per checkpoint with a floor."""
    out = []
    for p in fp:
        if number(p.get("floor_delta_ce")) is None:
            continue
        out.append({"quantizer": "bf16 noise floor", "step": p.get("step"), "tokens": p.get("tokens"),
                    "floor_rounding": p.get("floor_rounding"),
                    **{f"floor_{k}": p.get(f"floor_{k}") for k in ("delta_ce", "delta_ce_se", "kl", "kl_se",
                                                                   "top1_agree", "kl_p99")}})
    return out


# --------------------------------------------------------------------------- per-block maps
def _main_rows(rows: list[dict], run: str, kind: RowKind) -> list[dict]:
    return sorted((r for r in kind.select(rows) if r.get("run") == run
                   and (r.get("branch") or MAIN) == MAIN), key=lambda r: (r.get("tokens") or 0, r.get("step") or 0))


def block_heatmaps(rows: list[dict], run: str, out: Path, palette: Palette | None = None,
                   metric: str = "block_rel_fro") -> list[dict]:
    """One panel per quantizer (and one for the noise floor): ``metric`` (default the relative Frobenius error of
    each block's output against FP) of every block (y, block 0 at the bottom) at every main-run checkpoint
    (x, in training order), on a log colour scale of its own. Returns the table behind it ([] when no row of
    the run carries the maps: nothing is drawn)."""
    ptq = [r for r in _main_rows(rows, run, PTQ) if r.get(metric)]
    fps = [r for r in _main_rows(rows, run, FP) if r.get(f"floor_{metric}")]
    qs = sorted({r["quantizer"] for r in ptq}, key=lambda q: (-(next(r.get("bits") or 0 for r in ptq
                                                                      if r["quantizer"] == q)), q))
    series = {q: [r for r in ptq if r["quantizer"] == q] for q in qs}
    if fps:
        series["bf16 noise floor"] = [{**r, metric: r[f"floor_{metric}"]} for r in fps]
    if not series:
        return []
    palette = palette or Palette.for_rows(rows)
    fig, axes = panel_grid(len(series), max_cols=2, panel_height=2.3, extra_height=0.4)
    table = []
    ticks: list = []
    for ax, (q, pts) in zip(axes, series.items()):
        n_blocks = max(len(r[metric]) for r in pts)
        grid = np.full((n_blocks, len(pts)), np.nan)
        for j, r in enumerate(pts):
            vals = [number(v) for v in r[metric]]
            grid[: len(vals), j] = [v if v is not None and v > 0 else np.nan for v in vals]
            table.append({"quantizer": q, "step": r.get("step"), "tokens": r.get("tokens"),
                          **{f"block_{b}": v for b, v in enumerate(vals)}})
        finite = grid[np.isfinite(grid)]
        norm = LogNorm(vmin=finite.min(), vmax=finite.max()) if finite.size and finite.max() > finite.min() else None
        im = ax.imshow(grid, aspect="auto", origin="lower", interpolation="nearest", cmap="magma", norm=norm)
        cb = fig.colorbar(im, ax=ax, pad=0.02)
        cb.ax.tick_params(labelsize=6, which="both")
        _plain_ticks(cb.ax.yaxis)
        ticks.append((ax, [checkpoint_label(r) for r in pts]))  # labelled once the panel's width is known
        ax.set_yticks(range(0, n_blocks, max(1, n_blocks // 8)))
        ax.tick_params(labelsize=6)
        ax.set_title(q, fontsize=8, color=palette.quantizer(q) if q in qs else FLOOR_COLOR)
        ax.set_ylabel("block", fontsize=7)
        ax.set_xlabel("tokens (checkpoint)", fontsize=7)
    fig.suptitle(f"{run}: relative error of every block's output, along training", fontsize=10, y=0.995)
    layout_figure(fig)
    for ax, labels in ticks:  # as many checkpoint labels as fit each panel (10-50 checkpoints stay readable)
        checkpoint_ticks(ax, labels, fig)
    save_figure(fig, out)
    return table


# --------------------------------------------------------------------------- KL by confidence
def _endpoint(rows: list[dict], run: str, branch: str, q: str) -> dict | None:
    pts = [r for r in rows if PTQ.matches(r) and r.get("run") == run and r.get("branch") == branch
           and r.get("quantizer") == q and r.get("kl_by_confidence")]
    return max(pts, key=lambda r: (r.get("tokens") or 0, r.get("step") or 0)) if pts else None


def kl_by_confidence(rows: list[dict], run: str, out: Path, palette: Palette | None = None) -> list[dict]:
    """Per quantizer: mean KL(FP ‖ Q) in each bucket of FP's top-1 probability, for the decayed endpoint of every
    cooldown branch of ``run`` (filled bars) beside its constant-LR control's (hatched), on a log axis; the
    fraction of tokens in each bucket under the bars. Returns the table behind it ([] when no cooldown/control
    pair carries the histogram: nothing is drawn)."""
    ptq = [r for r in rows if PTQ.matches(r) and r.get("run") == run]
    branches = sorted({r["branch"] for r in ptq if r.get("ckpt_kind") == "cooldown" and control_of(r.get("branch"))})
    pairs = []
    for q in sorted({r["quantizer"] for r in ptq}):
        for b in branches:
            dec, ctl = _endpoint(rows, run, b, q), _endpoint(rows, run, control_of(b), q)
            if dec is not None and ctl is not None:
                pairs.append((q, b, dec, ctl))
    if not pairs:
        return []
    palette = palette or Palette.for_rows(rows)
    fig, axes = panel_grid(len(pairs), max_cols=2, panel_height=2.4, extra_height=0.5)
    table = []
    x = np.arange(len(CONFIDENCE_BUCKETS))
    for ax, (q, b, dec, ctl) in zip(axes, pairs):
        for k, (r, name, hatch) in enumerate(((dec, b, None), (ctl, control_of(b), "///"))):
            vals = [number(v) for v in r["kl_by_confidence"]]
            frac = [number(v) for v in (r.get("confidence_fraction") or [])]
            col = palette.branch(b)
            ax.bar(x + (k - 0.5) * 0.4, [v if v else np.nan for v in vals], width=0.4, color=col if k == 0 else "none",
                   edgecolor=col, hatch=hatch, label=name)
            for i, v in enumerate(vals):
                table.append({"quantizer": q, "branch": name, "step": r.get("step"), "tokens": r.get("tokens"),
                              "confidence": CONFIDENCE_BUCKETS[i], "kl_mean": v,
                              "token_fraction": frac[i] if i < len(frac) else None})
        fr = [number(v) for v in (dec.get("confidence_fraction") or [])]
        ax.set_xticks(x)
        ax.set_xticklabels([f"{c}\n{100 * f:.0f}%" if f is not None else c
                            for c, f in zip(CONFIDENCE_BUCKETS, fr + [None] * len(CONFIDENCE_BUCKETS))], fontsize=6)
        shown = [t["kl_mean"] for t in table[-2 * len(x):] if t["kl_mean"]]
        if shown:
            ax.set_yscale("log")
            ax.set_ylim(min(shown) / 3, max(shown) * 2)
            _plain_ticks(ax.yaxis)
        ax.set_title(f"{q}: {b}", fontsize=8, color=palette.quantizer(q))
        ax.set_ylabel("mean KL(FP ‖ Q)", fontsize=7)
        ax.set_xlabel("FP top-1 probability (share of tokens: decayed endpoint)", fontsize=7)
        ax.tick_params(labelsize=6)
        ax.legend(fontsize=6, frameon=False)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"{run}: KL by the FP model's confidence, decayed endpoint (filled) vs control (hatched)",
                 fontsize=9, y=0.995)
    save_figure(fig, out)
    return table


# --------------------------------------------------------------------------- report sections
def _lacking(rows: list[dict], field: str) -> str:
    n = sum(1 for r in rows if PTQ.matches(r) and not r.get(field))
    return (f" {n} ptq row(s) lack {field} (written before quantdyn measured it) and are left out."
            if n else "")


_SECTIONS = (  # (file stem, figure, title after "Run <run>: ", caption, the row field it needs)
    ("block_errors", block_heatmaps, "where in the network and when in training the error appears",
     "Per quantizer, the relative Frobenius error ‖H_Q − H_FP‖/‖H_FP‖ of every block's output on the evaluation "
     "windows (y: block, 0 at the bottom; x: main-run checkpoints in training order; colour: log scale, its own per "
     "panel). The last panel is the bf16 noise floor's map: what rounding every block's output to bf16 costs.",
     "block_rel_fro"),
    ("kl_by_confidence", kl_by_confidence, "KL by the model's confidence, decayed endpoint vs control",
     "Mean KL(FP ‖ Q) of the evaluation tokens in each bucket of the FP model's top-1 probability (exllamav3's "
     "buckets), for the last checkpoint of each cooldown branch (filled) and of its constant-LR control "
     "(hatched); the share of tokens in each bucket (decayed endpoint) under the axis. The mean KL is dominated "
     "by tokens the model is unsure of; this shows whether decay moves the error among confident or uncertain "
     "tokens.", "kl_by_confidence"),
)


def sections(rows: list[dict], out: Path, palette: Palette | None = None) -> list[tuple[str, str, list[dict], str]]:
    """The heat-map and KL-by-confidence sections of the report, per run, when rows carry their fields."""
    found = []
    runs = sorted({r["run"] for r in rows if PTQ.matches(r) and r.get("run")})
    for run in runs:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in run)
        for stem, figure, title, caption, field in _SECTIONS:
            png = out / f"{stem}_{safe}.png"
            table = figure(rows, run, png, palette)
            if table:
                found.append((f"Run {run}: {title}", png.name, table, caption + _lacking(rows, field)))
    return found
