"""How report figures and their tables are sized and written.

Every figure is a page-width figure (:data:`PAGE_WIDTH` inches; panels wrap into rows, :func:`panel_grid`)
saved twice by :func:`save_figure`: PNG at :data:`PRINT_DPI` and SVG (vector, for print and editing), each
written atomically under its final name.  :func:`write_csv` writes the rows behind a figure beside it.
"""
from __future__ import annotations

import csv
import io
import math
from pathlib import Path

from matplotlib.ticker import FuncFormatter, MaxNLocator

from quantdyn.files import atomic_file
from quantdyn.report.palette import LR_COLOR
from quantdyn.results.schema import number

PAGE_WIDTH = 7.5
"""Inches: a US-letter or A4 page less its margins."""
MAX_HEIGHT = 9.5
"""Inches: the tallest figure that still fits a page."""
PRINT_DPI = 200
"""Dots per inch of the PNGs (print quality: a 7.5-inch figure is 1500 px wide)."""
FIGURE_SUFFIXES = (".png", ".svg")
TABLE_SUFFIX = ".csv"


def figure_stem(out: str | Path) -> Path:
    """``out`` without a figure suffix: ``a/b.png`` and ``a/b`` both give ``a/b`` (a dot inside a name, as
    in ``pythia-1.4b``, is kept)."""
    out = Path(out)
    return out.with_suffix("") if out.suffix.lower() in (".png", ".svg", ".pdf") else out


def figure_paths(out: str | Path) -> list[Path]:
    stem = figure_stem(out)
    return [stem.parent / f"{stem.name}{s}" for s in FIGURE_SUFFIXES]


def subplots(nrows: int = 1, ncols: int = 1, *, figsize: tuple[float, float], **kw):
    """``plt.subplots`` without pyplot: (fig, axes) on an Agg canvas of the figure's own, so that drawing a report
    neither picks nor switches the backend of the process (a notebook keeps its own) and a figure is freed with
    its last reference. ``kw``: Figure.subplots' (sharex, squeeze, gridspec_kw, ...)."""
    fig = figure(figsize)
    return fig, fig.subplots(nrows, ncols, **kw)


def figure(figsize: tuple[float, float]):
    """An empty figure on an Agg canvas of its own (as :func:`subplots`), for a layout of its own
    (``fig.add_gridspec``)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    return fig


def panel_grid(n: int, max_cols: int = 3, panel_height: float = 2.4, width: float = PAGE_WIDTH,
               extra_height: float = 0.5, **kw):
    """A figure of ``n`` panels wrapped into rows of at most ``max_cols``, page-wide; panels left over in the
    last row are hidden.  Returns (fig, flat list of the n axes)."""
    n = max(1, n)
    cols = min(n, max_cols)
    rows = math.ceil(n / cols)
    height = min(MAX_HEIGHT, panel_height * rows + extra_height)
    fig, axes = subplots(rows, cols, figsize=(width, height), squeeze=False, **kw)
    flat = list(axes.flat)
    for k, ax in enumerate(flat[n:], start=n):
        ax.set_visible(False)
        if kw.get("sharex") and k - cols >= 0:  # the panel above is now its column's lowest: give it x labels
            flat[k - cols].tick_params(labelbottom=True)
    return fig, flat[:n]


LR_STYLE = {"color": LR_COLOR, "lw": 1.0, "ls": "-", "alpha": 0.8}
"""How every figure draws the LR (grey, behind the data)."""
LR_TEXT = "0.4"
"""The colour of the LR axis's ticks and label (a darker grey than the line, to be read)."""


def overlay_lr(ax, curves):
    """The LR curves ([(x, lr), ...], the first solid, any others dashed) against the panel's x on a twin axis
    of its own, behind the data, with its scale: ticks and an "LR" label on the right (every panel that draws
    the LR carries its axis). Returns the twin axis (None without curves)."""
    curves = [c for c in curves if c]
    if not curves:
        return None
    ax2 = ax.twinx()
    for k, curve in enumerate(curves):
        xs, ys = zip(*curve)
        ax2.plot(xs, ys, **{**LR_STYLE, "ls": "-" if k == 0 else "--"}, label="LR" if k == 0 else None)
    ax2.set_ylim(bottom=0)
    ax.set_zorder(ax2.get_zorder() + 1)  # the data in front of the LR
    ax.patch.set_visible(False)
    ax2.set_ylabel("LR", color=LR_TEXT, fontsize=7, labelpad=2)
    ax2.tick_params(axis="y", labelsize=6, colors=LR_TEXT, pad=1.5)
    ax2.yaxis.get_offset_text().set(fontsize=6, color=LR_TEXT)
    ax2.yaxis.set_major_locator(MaxNLocator(4))
    ax2.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))  # 0, 0.0008, 0.0016: no 0.0000
    return ax2


def tokens_label(v: float, _pos=None, *, digits: int = 6) -> str:
    """Token counts as 250K, 1.5M, 2B, 3.9T (at most ``digits`` significant digits: 3 gives 1.23M for 1228800)."""
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(v) >= div:
            return f"{v / div:.{digits}g}{unit}"
    return f"{v:.{digits}g}"


def tokens_axis(ax) -> None:
    from matplotlib.ticker import FuncFormatter

    ax.xaxis.set_major_formatter(FuncFormatter(tokens_label))


TICK_FONT = 6
"""Points of the checkpoint tick labels of the maps (checkpoint_ticks)."""


def checkpoint_label(row: dict) -> str:
    """A checkpoint's tick label on a map's x axis: its tokens in 3 significant digits (1.23M), else its step."""
    tokens = number(row.get("tokens"))
    return tokens_label(tokens, digits=3) if tokens is not None else str(row.get("step"))


def checkpoint_ticks(ax, labels: list[str], fig=None) -> list[int]:
    """Put every k-th of ``labels`` (one per column of a map, in order) on ``ax``'s x axis, k the smallest step at
    which the labels fit the axis's width without touching (estimated at TICK_FONT points, 0.6 em a character,
    with a gap of two characters), so that 10-50 checkpoints stay readable; the last checkpoint is labelled when it
    fits. Call it once the figure is laid out (the axis's width is known). Returns the labelled positions."""
    n = len(labels)
    if n == 0:
        return []
    fig = fig or ax.figure
    width_pt = ax.get_position().width * fig.get_figwidth() * 72 * 0.9
    per = (max(len(s) for s in labels) + 2) * 0.6 * TICK_FONT
    step = max(1, math.ceil(n / max(1, int(width_pt // per))))
    ticks = list(range(0, n, step))
    if ticks[-1] != n - 1 and (n - 1 - ticks[-1]) * width_pt / n >= per:
        ticks.append(n - 1)
    ax.set_xticks(ticks)
    ax.set_xticklabels([labels[t] for t in ticks], fontsize=TICK_FONT)
    return ticks


def _write_bytes_atomic(path: Path, data: bytes) -> None:
    with atomic_file(path, "wb") as f:
        f.write(data)


def layout_figure(fig, top: float = 0.0, bottom: float = 0.0) -> None:
    """Lay ``fig`` out (tight_layout), leaving ``top``/``bottom`` inches free for a figure legend or title."""
    h = fig.get_figheight()
    fig.tight_layout(rect=(0, min(0.4, bottom / h), 1, 1 - min(0.4, top / h)))


def save_figure(fig, out: str | Path, top: float = 0.0, bottom: float = 0.0) -> list[Path]:
    """Lay ``fig`` out (:func:`layout_figure`), write it as ``<stem>.png`` (PRINT_DPI) and ``<stem>.svg``, each
    atomically, and close it.

    ``out`` may carry a .png/.svg suffix or none.  SVGs carry no date, so the same figure gives the same
    file.  Returns the paths written (PNG first)."""
    paths = figure_paths(out)
    layout_figure(fig, top, bottom)
    try:
        for p in paths:
            buf = io.BytesIO()
            kw = {"dpi": PRINT_DPI} if p.suffix == ".png" else {"metadata": {"Date": None}}
            fig.savefig(buf, format=p.suffix[1:], **kw)
            _write_bytes_atomic(p, buf.getvalue())
    finally:
        if fig.canvas.manager is not None:  # a figure made with pyplot (subplots' are not pyplot's)
            import matplotlib.pyplot as plt

            plt.close(fig)
    return paths


def table_columns(table: list[dict]) -> list[str]:
    """Every column of ``table`` in order of first appearance."""
    return list(dict.fromkeys(k for row in table for k in row))


def _cell(v):
    if v is None:
        return ""
    if isinstance(v, float):
        return "" if math.isnan(v) else repr(v)
    if isinstance(v, (list, tuple, dict)):
        import json

        return json.dumps(v, default=str)
    return v


def write_csv(table: list[dict], path: str | Path) -> Path:
    """Write ``table`` as CSV (every column of any row; floats at full precision; None and NaN empty),
    atomically.  Returns the path."""
    path = Path(path)
    buf = io.StringIO()
    cols = table_columns(table)
    w = csv.DictWriter(buf, fieldnames=cols, lineterminator="\n")
    w.writeheader()
    for row in table:
        w.writerow({c: _cell(row.get(c)) for c in cols})
    _write_bytes_atomic(path, buf.getvalue().encode())
    return path
