"""Quantizer configuration, named presets, the QUANTIZERS registry and
short-name parsing ("gptq4", "rtn3g64", "gptq4-gptqmodel", "awq4-sym").

Presets
-------
``reference``  IST-DASLab/gptq (``llama.py``/``opt.py`` argument defaults, commit
               2d65066): damp 0.01, no act-order, dynamic groups, asymmetric,
               no true-sequential, no MSE clipping. These are also QuantConfig's
               defaults (with group_size 128).
``gptqmodel``  GPTQModel defaults that paper 2510.06213 relied on when it set only
               bits and group size. Read from ModelCloud/GPTQModel
               ``gptqmodel/quantization/config.py`` at release v4.2.5 (2025-09-16,
               the last release before the paper, Oct 2025)::

                   group_size=128, damp_percent=0.05, damp_auto_increment=0.01,
                   desc_act=True, act_group_aware=False, static_groups=False,
                   sym=True, true_sequential=True, mse=0.0, lm_head=False

``gptqmodel-v5``  GPTQModel defaults from v5.0.0 (2025-10-24) through v7.3.4
               (``GPTQConfig.__post_init__``): desc_act resolves to False and
               ``act_group_aware`` (group-aware reordering, GAR) to True; the rest
               as above (damp 0.05 from ``_default_damp_percent``).
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch

from quantdyn.config import from_dict
from quantdyn.errors import QuantdynError, did_you_mean, unknown_name
from quantdyn.registry import Registry


@dataclass(frozen=True)
class QuantConfig:
    """How to quantize the linear weights of a model (weight-only, integer grid)."""

    method: str = "gptq"
    """Quantizer: one of QUANTIZERS ('rtn', 'gptq', 'awq')."""
    bits: int = 4
    """Bit width of the codes, 2..8."""
    group_size: int | None = 128
    """Input columns sharing one (scale, zero); 0 (or -1/None) = one group per output row.
    If it does not divide in_features the last group is shorter (as the reference does);
    act_group_aware needs it to divide in_features."""
    sym: bool = False
    """Symmetric grid (zero = (maxq+1)/2) instead of asymmetric min-max."""
    mse: bool = False
    """Search the clipping range per row/group minimising |Q(w) - w|^2.4 (reference Quantizer(mse=True))."""
    damp_percent: float = 0.01
    """GPTQ damping: add damp_percent * mean(diag H) to diag H."""
    damp_auto_increment: float = 0.0
    """If the damped Hessian is not positive definite, raise damp_percent by this and retry
    (GPTQModel); 0 = fail with an error (reference)."""
    act_order: bool = False
    """GPTQ: quantize columns in order of decreasing diag H (reference --act-order, GPTQModel desc_act)."""
    act_group_aware: bool = False
    """GPTQ: group-aware reordering (GPTQModel act_group_aware): groups stay contiguous, ordered by their
    largest diag H, columns ordered by diag H inside each group. Exclusive with act_order."""
    static_groups: bool = False
    """GPTQ: compute every group's grid from the original weights up front (reference --static-groups)."""
    true_sequential: bool = False
    """Within a block, quantize layer groups in order (attention inputs, attention output, MLP in, MLP out),
    re-running the block so later groups see quantized earlier ones."""
    block_size: int = 128
    """GPTQ lazy-update block width (columns)."""
    awq_grid: int = 20
    """AWQ: number of alpha values in [0, 1) searched for the scales s = mean|x|^alpha."""
    awq_clip: bool = True
    """AWQ: search a per-(row, group) clipping range after scaling (llm-awq auto_clip)."""
    quantize_head: bool = False
    """Also quantize the output head (lm_head); embeddings always stay full precision."""

    def __post_init__(self):
        if self.method not in QUANTIZERS:
            raise unknown_name("quantizer", self.method, QUANTIZERS.names())
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not 2 <= self.bits <= 8:
            raise QuantdynError(f"quantizer bits={self.bits!r} is not supported; choose an integer from 2 to 8")
        g = self.group_size
        if g is None or g == -1:
            object.__setattr__(self, "group_size", 0)
        elif isinstance(g, bool) or not isinstance(g, int) or g < 0:
            raise QuantdynError(f"quantizer group_size={g!r} must be a positive integer, or 0 for one group per row")
        if not 0.0 <= self.damp_percent < 1.0:
            raise QuantdynError(f"quantizer damp_percent={self.damp_percent} must lie in [0, 1)")
        if self.damp_auto_increment < 0:
            raise QuantdynError(f"quantizer damp_auto_increment={self.damp_auto_increment} must be >= 0")
        if self.act_order and self.act_group_aware:
            raise QuantdynError("quantizer act_order and act_group_aware exclude each other; set only one")
        if self.act_group_aware and not self.group_size:
            raise QuantdynError("quantizer act_group_aware needs group_size > 0")
        if self.static_groups and not self.group_size:
            raise QuantdynError("quantizer static_groups needs group_size > 0")
        if self.block_size < 1:
            raise QuantdynError(f"quantizer block_size={self.block_size} must be >= 1")
        if self.awq_grid < 1:
            raise QuantdynError(f"quantizer awq_grid={self.awq_grid} must be >= 1")

    @property
    def name(self) -> str:
        """Short label, e.g. 'gptq4g128'."""
        return f"{self.method}{self.bits}g{self.group_size}"


# ----------------------------------------------------------------------------- registry


class QuantMethod(NamedTuple):
    """A registered quantizer: ``fn(W, stats, cfg) -> QuantResult``."""

    fn: Callable[..., Any]
    """The pure tensor function (stats: quantize.gptq.ActStats or None)."""
    needs_calibration: bool
    """Whether apply must collect activation statistics (H, mean |x|)."""


QUANTIZERS: Registry[QuantMethod] = Registry("quantizer")
"""rtn, gptq and awq register themselves from their modules (imported by quantize/__init__)."""


# ----------------------------------------------------------------------------- presets

PRESETS: dict[str, dict[str, Any]] = {
    "reference": dict(damp_percent=0.01, damp_auto_increment=0.0, act_order=False, act_group_aware=False,
                      static_groups=False, sym=False, true_sequential=False, mse=False, group_size=128),
    # GPTQModel v4.2.5 gptqmodel/quantization/config.py QuantizeConfig field defaults
    "gptqmodel": dict(damp_percent=0.05, damp_auto_increment=0.01, act_order=True, act_group_aware=False,
                      static_groups=False, sym=True, true_sequential=True, mse=False, group_size=128),
    # GPTQModel >= v5.0.0 (checked up to v7.3.4): desc_act -> False, act_group_aware -> True
    "gptqmodel-v5": dict(damp_percent=0.05, damp_auto_increment=0.01, act_order=False, act_group_aware=True,
                         static_groups=False, sym=True, true_sequential=True, mse=False, group_size=128),
}

_FLAGS: dict[str, dict[str, Any]] = {
    "sym": dict(sym=True),
    "asym": dict(sym=False),
    "mse": dict(mse=True),
    "act": dict(act_order=True),
    "gar": dict(act_group_aware=True),
    "static": dict(static_groups=True),
    "seq": dict(true_sequential=True),
    "head": dict(quantize_head=True),
}

_SPEC = re.compile(r"^(?P<method>[a-z]+?)(?P<bits>\d+)(?:g(?P<group>\d+))?$")


def quant_preset(name: str, **overrides: Any) -> QuantConfig:
    """QuantConfig of a named preset with explicit field overrides."""
    if name not in PRESETS:
        raise unknown_name("quantizer preset", name, PRESETS)
    return from_dict(QuantConfig, {**PRESETS[name], **overrides}, "quantizer")


def _parse_short(spec: str) -> dict[str, Any]:
    """'gptq4g64-gptqmodel-mse' -> field dict (preset first, then flags, then method/bits/group)."""
    head, *tokens = spec.strip().lower().split("-")
    # preset names may contain '-' (gptqmodel-v5): rejoin greedily
    parts: list[str] = []
    i = 0
    while i < len(tokens):
        if i + 1 < len(tokens) and f"{tokens[i]}-{tokens[i + 1]}" in PRESETS:
            parts.append(f"{tokens[i]}-{tokens[i + 1]}")
            i += 2
        else:
            parts.append(tokens[i])
            i += 1
    m = _SPEC.match(head)
    if m is None:
        raise QuantdynError(
            f"cannot read quantizer '{spec}'; write <method><bits>[g<group>][-<preset or flag>...], "
            f"e.g. gptq4, rtn3g64, gptq4-gptqmodel, awq4-sym (methods: {', '.join(QUANTIZERS.names())})"
        )
    fields: dict[str, Any] = {}
    for t in parts:
        if t in PRESETS:
            fields = {**fields, **PRESETS[t]}
        elif t in _FLAGS:
            fields.update(_FLAGS[t])
        else:
            choices = sorted([*PRESETS, *_FLAGS])
            raise QuantdynError(
                f"unknown quantizer option '{t}' in '{spec}'{did_you_mean(t, choices)}; "
                f"choose presets/flags from: {', '.join(choices)}"
            )
    method = m["method"]
    if method not in QUANTIZERS:
        raise unknown_name("quantizer", method, QUANTIZERS.names())
    fields.update(method=method, bits=int(m["bits"]))
    if m["group"] is not None:
        fields["group_size"] = int(m["group"])
    return fields


def parse_quantizer(spec: str | dict | QuantConfig) -> QuantConfig:
    """Turn a short name or a mapping into a QuantConfig.

    * ``"gptq4"`` -> GPTQ, 4 bits, group 128, asymmetric (QuantConfig defaults);
      ``"rtn3g64"`` sets the group size (``g0`` = per row); suffixes ``-<preset>``
      (reference, gptqmodel, gptqmodel-v5) and flags ``-sym -asym -mse -act -gar
      -static -seq -head`` apply left to right, e.g. ``"gptq4-gptqmodel"``.
    * a dict of QuantConfig fields, optionally with ``preset`` (applied first) and/or
      ``name`` (a short name as above, applied before the explicit fields).
    """
    if isinstance(spec, QuantConfig):
        return spec
    if isinstance(spec, str):
        return from_dict(QuantConfig, _parse_short(spec), "quantizer")
    if not isinstance(spec, dict):
        raise QuantdynError(f"quantizer must be a name like 'gptq4' or a mapping, not {type(spec).__name__}")
    data = dict(spec)
    fields: dict[str, Any] = {}
    preset = data.pop("preset", None)
    name = data.pop("name", None)
    if preset is not None:
        if preset not in PRESETS:
            raise unknown_name("quantizer preset", str(preset), PRESETS)
        fields.update(PRESETS[preset])
    if name is not None:
        fields.update(_parse_short(str(name)))
    fields.update(data)
    return from_dict(QuantConfig, fields, "quantizer")


def replace(cfg: QuantConfig, **changes: Any) -> QuantConfig:
    """dataclasses.replace with QuantdynError on unknown fields."""
    names = {f.name for f in dataclasses.fields(QuantConfig)}
    for k in changes:
        if k not in names:
            raise QuantdynError(f"unknown quantizer field '{k}'{did_you_mean(k, names)}")
    return dataclasses.replace(cfg, **changes)


def compute_dtype(W: torch.Tensor) -> torch.dtype:
    """float32 for half/bfloat16/float32 weights, float64 stays float64."""
    return torch.promote_types(W.dtype, torch.float32)
