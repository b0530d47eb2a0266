"""The report's colours: one per quantizer, one per branch, the same in every figure.

Quantizers
    :func:`quantizer_color` is a pure function of the label, so a quantizer has the same colour on every
    page of a report and across reports: a fixed table for the common labels (GPTQ warm, RTN blue, AWQ
    green; fewer bits darker), and for any other label (``rtn4g64``, ``gptq4-gptqmodel``, ...) a colour
    derived from a SHA-1 of the label (never Python's salted ``hash``).

Branches
    ``main`` is black.  Cooldown branches take colours along a rainbow ordered by the step they start from
    (then decay length, then shape), so early branches are violet and late ones red; a constant-LR control
    shares the colour of its cooldown twin and is drawn dashed (branch names: ``results/schema.py``).  Averaged
    checkpoints (LAWA, EMA, soups), stage-2 ingredients and anything else take a qualitative palette in
    name order.  The mapping depends on the set of branches, so a report builds one :class:`Palette` from
    all its rows and hands it to every figure; a figure drawn alone builds one from its own rows.
"""
from __future__ import annotations

import colorsys
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field

from quantdyn.runs import MAIN, control_of, is_cooldown, parse_branch

QUANTIZER_COLORS: dict[str, str] = {
    # GPTQ: warm colours
    "gptq2": "#7f2704",
    "gptq3": "#d62728",
    "gptq4": "#ff7f0e",
    "gptq8": "#e377c2",
    # RTN: blues
    "rtn2": "#08306b",
    "rtn3": "#1f77b4",
    "rtn4": "#17becf",
    "rtn8": "#9467bd",
    # AWQ: greens
    "awq2": "#00441b",
    "awq3": "#2ca02c",
    "awq4": "#8ca252",
    "awq8": "#bcbd22",
    # deployment formats. GGUF: browns and golds, the mixes (what people download) the most distinct
    "q4_k_m": "#a6761d",
    "q3_k_m": "#5c3a12",
    "q5_k_m": "#d8b365",
    "q2_k": "#2b1a08",
    "q3_k": "#7f5a2a",
    "q4_k": "#c99a3b",
    "q5_k": "#e0c38c",
    "q6_k": "#8c6d46",
    "q8_0": "#bfa98a",
    "q4_0": "#b35806",
    "q4_1": "#e08214",
    "q5_0": "#fdb863",
    "q5_1": "#f4a582",
    # floats: magentas (FP8), teal (NF4), violets (the 4-bit block floats)
    "fp8": "#c51b7d",
    "fp8_channel": "#f1b6da",
    "w8a8_fp8": "#8e0152",
    "nf4": "#01665e",
    "nvfp4": "#6a3d9a",
    "mxfp4": "#b2abd2",
    # rtn4 weights with 4-bit activations: a green apart from rtn4's cyan
    "w4a4": "#1a9850",
    # 16-bit floats (a plan's kept tensors; f16 as a quantizer of its own): grey, the unquantized reference's family
    "f16": "#7f7f7f",
}
"""Fixed colours of the common canonical labels (``<method><bits>`` with the default group size 128, and the
deployment formats); a format's ``-imatrix`` variant is its colour lightened."""

FP_COLOR = "#000000"
"""Full precision (the FP loss panel)."""
LR_COLOR = "0.55"
"""The learning-rate overlay (grey)."""
MAIN_COLOR = "#000000"
"""The main run's branch."""

QUALITATIVE = ("#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02", "#a6761d", "#666666",
               "#1f78b4", "#b2df8a", "#fb9a99", "#cab2d6")
"""Colours of averaged checkpoints, ingredients and other branches (ColorBrewer Dark2 + Paired), in name order."""

def _hex(rgb: tuple[float, float, float]) -> str:
    return "#" + "".join(f"{round(max(0.0, min(1.0, c)) * 255):02x}" for c in rgb)


def hashed_color(label: str) -> str:
    """A colour that depends only on ``label``: hue from a SHA-1 of it, saturation and value in a band that
    reads on white."""
    h = hashlib.sha1(label.encode()).digest()
    hue = int.from_bytes(h[:2], "big") / 65536
    sat = 0.55 + 0.35 * h[2] / 255
    val = 0.55 + 0.3 * h[3] / 255
    return _hex(colorsys.hsv_to_rgb(hue, sat, val))


def quantizer_color(label: str) -> str:
    """The colour of a quantizer label: the fixed table for common labels, a hash of the label otherwise."""
    label = str(label)
    if label in QUANTIZER_COLORS:
        return QUANTIZER_COLORS[label]
    base, _, tail = label.rpartition("-")
    if tail == "imatrix" and base in QUANTIZER_COLORS:  # halfway to white: the same family, told apart
        rgb = [int(QUANTIZER_COLORS[base][i:i + 2], 16) / 255 for i in (1, 3, 5)]
        return _hex(tuple(c + 0.5 * (1 - c) for c in rgb))
    return hashed_color(label)


def _rainbow(x: float) -> str:
    from matplotlib import colormaps  # matplotlib is the report's plotting library; imported on use

    return _hex(colormaps["rainbow"](x)[:3])


@dataclass
class Palette:
    """Branch colours of one report (see the module docstring); quantizer colours are label-derived."""

    branches: dict[str, str] = field(default_factory=dict)
    """Branch name -> colour (hex)."""

    @classmethod
    def for_branches(cls, names: Iterable[str]) -> Palette:
        names = sorted({str(n) for n in names if n is not None})
        colors = {MAIN: MAIN_COLOR}
        parsed = {b: p for b in names if (p := parse_branch(b)) is not None}
        cooldowns = [b for b in parsed if is_cooldown(b)]
        # controls without a cooldown twin in these rows still belong on the rainbow, at their start step
        twins = {control_of(b) for b in cooldowns}
        lone = [b for b in parsed if not is_cooldown(b) and b not in twins]
        ordered = sorted(cooldowns + lone, key=lambda b: (parsed[b].from_step, parsed[b].decay_steps, b))
        for k, b in enumerate(ordered):
            colors[b] = _rainbow(k / max(1, len(ordered) - 1)) if len(ordered) > 1 else _rainbow(0.0)
            if b in cooldowns:
                colors.setdefault(control_of(b), colors[b])
        rest = [b for b in names if b not in colors]
        for k, b in enumerate(rest):
            colors[b] = QUALITATIVE[k] if k < len(QUALITATIVE) else hashed_color(b)
        return cls(colors)

    @classmethod
    def for_rows(cls, rows: Iterable[dict]) -> Palette:
        return cls.for_branches(r.get("branch") or MAIN for r in rows)

    def branch(self, name: str | None) -> str:
        """The colour of a branch (one not seen when the palette was built: a hash of its name)."""
        name = name or MAIN
        return self.branches.get(name) or hashed_color(name)

    @staticmethod
    def quantizer(label: str) -> str:
        return quantizer_color(label)


def ordered_colors(values: Iterable, cmap: str = "viridis") -> dict[str, str]:
    """Colours for the values of a run-level setting (peak LR, weight decay, seed, run name): numbers along
    ``cmap`` in numeric order, anything else from the qualitative palette in sorted order.  Keys are str(value)."""
    vals = sorted({str(v) for v in values})
    try:
        nums = sorted(vals, key=float)
    except ValueError:
        return {v: (QUALITATIVE[k] if k < len(QUALITATIVE) else hashed_color(v)) for k, v in enumerate(vals)}
    from matplotlib import colormaps  # matplotlib is the report's plotting library; imported on use

    cm = colormaps[cmap]
    n = len(nums)
    return {v: _hex(cm(0.1 + 0.75 * k / max(1, n - 1))[:3]) for k, v in enumerate(nums)}
