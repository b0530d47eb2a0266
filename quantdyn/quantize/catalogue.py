"""The quantizer catalogue: quantizer configuration, named presets, the QUANTIZERS registry and
short-name parsing ("gptq4", "rtn3g64", "gptq4-gptqmodel", "awq4-sym").

Labels
------
Every configuration has one canonical label, :attr:`QuantConfig.name`, and
``parse_quantizer(cfg.name) == cfg`` for every valid config.  The label is
``<method><bits>`` plus ``g<group>`` unless the group is the default 128, then
at most one preset and the tokens that set the remaining fields, in a fixed
order; of the spellings with and without a preset the shortest wins (ties: no
preset).  The parser also accepts every other spelling and normalises it:
``gptq4g128``, ``GPTQ4`` and ``gptq4-reference`` are all ``gptq4``.  Rows are
keyed by :func:`quantdyn.config.config_hash` of the config, never by label.

Tokens after the head, applied left to right: a preset name; ``sym``/``asym``,
``mse``/``nomse``, ``act``/``noact``, ``gar``/``nogar``, ``static``/``nostatic``,
``seq``/``noseq``, ``head``/``nohead``, ``clip``/``noclip``; and values
``damp<x>`` (damp_percent), ``dampinc<x>`` (damp_auto_increment),
``block<n>`` (block_size), ``grid<n>`` (awq_grid), e.g. ``gptq3-act-damp0.1``.

Deployment formats
------------------
GGUF block types, FP8, NF4, MXFP4 and NVFP4 register under their own labels (module
``quantize.formats``): ``q8_0 q4_0 q4_1 q5_0 q5_1 q2_k q3_k q4_k q5_k q6_k``, the llama.cpp mixes
``q3_k_m q4_k_m q5_k_m``, each GGUF label but ``q8_0`` also as ``<label>-imatrix`` (llama.cpp's
quantization with an importance matrix from the calibration activations), ``fp8`` (per tensor),
``fp8-channel``, ``w8a8-fp8`` (FP8 per channel weights and FP8 per-token activations), ``nf4``,
``mxfp4``, ``nvfp4``, ``f16`` (the weight kept in 16-bit floats, llama.cpp's F16). A format fixes its
bits and group size; the only token a format label takes is ``head``/``nohead`` (``q4_k_m-head``).
GGUF tensors whose rows do not fit the block take llama.cpp's fallback type (recorded in the layer rows).

Rotations
---------
``+had`` after any label rotates every quantized layer's input features by a randomized Hadamard transform
first (``gptq3+had``, ``nvfp4+had``, ``w8a8-fp8+had``); ``+r1`` rotates the residual stream (RMSNorm models);
``+seed<N>`` seeds the random signs (default 0), e.g. ``rtn4+had+r1+seed1``. Canonical order: had, r1, seed.
The rotation fields stay out of a config's hash while unset, so the hashes of unrotated configs are unchanged.

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
import math
import numbers
import re
from dataclasses import dataclass
from decimal import Decimal
import json
from functools import lru_cache
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

from quantdyn.config import OMIT_DEFAULT, config_hash, from_dict, to_dict
from quantdyn.errors import QuantdynError, did_you_mean, unknown_name
from quantdyn.registry import LazyRegistry, Registry

if TYPE_CHECKING:  # labels are parsed without torch (see QUANTIZERS); the algorithms import it
    import torch
    import torch.nn as nn


@dataclass(frozen=True)
class QuantConfig:
    """How to quantize the linear weights of a model (weight-only, integer grid)."""

    method: str = "gptq"
    """Quantizer: one of QUANTIZERS ('rtn', 'gptq', 'awq', or a deployment format such as 'q4_k_m', 'fp8')."""
    bits: int = 4
    """Bit width of the codes, 2..8."""
    group_size: int | None = 128
    """Input columns sharing one (scale, zero), >= 1; 0 (or None) = one group per output row (GPTQModel's -1).
    If it does not divide in_features the last group is shorter (as the reference does);
    act_group_aware needs it to divide in_features."""
    sym: bool = False
    """Symmetric grid (zero = (maxq+1)/2) instead of asymmetric min-max."""
    mse: bool = False
    """Search the clipping range per row/group minimising |Q(w) - w|^2.4 (reference Quantizer(mse=True))."""
    damp_percent: float = 0.01
    """GPTQ damping, in (0, 1): add damp_percent * mean(diag H) to diag H."""
    damp_auto_increment: float = 0.0
    """In [0, 1): if the damped Hessian is not positive definite, raise damp_percent by this and retry
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
    """GPTQ lazy-update block width (columns), >= 1."""
    awq_grid: int = 20
    """AWQ: number of alpha values in [0, 1) searched for the scales s = mean|x|^alpha, >= 1."""
    awq_clip: bool = True
    """AWQ: search a per-(row, group) clipping range after scaling (llm-awq auto_clip)."""
    quantize_head: bool = False
    """Also quantize the output head (lm_head); embeddings always stay full precision."""
    hadamard: bool = dataclasses.field(default=False, metadata=OMIT_DEFAULT)
    """Rotate the input features of every quantized layer by a randomized Hadamard transform R first (label
    ``+had``; quantize/rotation.py): the weight is quantized as Q(W R), the layer computes (x R) Q(W R)ᵀ, and
    activation quantization (w8a8-fp8, w4a4) quantizes x R. Full precision is unchanged (R Rᵀ = I)."""
    r1: bool = dataclasses.field(default=False, metadata=OMIT_DEFAULT)
    """Rotate the residual stream (QuaRot's R1; label ``+r1``; quantize/residual_rotation.py), fused into the
    embedding, the layers that read and write the stream and the head: exact for RMSNorm pre-norm models
    (llama, qwen2, qwen3) only; others are refused."""
    rotation_seed: int = dataclasses.field(default=0, metadata=OMIT_DEFAULT)
    """Seed of the rotations' random signs (label ``+seed<N>``), >= 0; recorded in every row."""

    def __post_init__(self):
        canonical = QUANTIZERS.canonical(self.method) if isinstance(self.method, str) else None
        if canonical is not None:  # plan:FILE and auto@BUDGET:TYPES (quantize.plan): one spelling per plan
            object.__setattr__(self, "method", canonical)
        catalogue = QUANTIZERS if canonical is not None else label_catalogue()
        if not isinstance(self.method, str) or self.method not in catalogue:
            raise unknown_name("quantizer", str(self.method), catalogue.names())
        spec = catalogue.get(self.method).format
        if spec is not None:
            _check_format_fields(self, spec)
        bits = _integer(self.bits)  # a format's own (f16: 16), else a grid's
        if bits is None or (spec is None and not 2 <= bits <= 8):
            raise QuantdynError(f"quantizer bits={self.bits!r} is not supported; choose an integer from 2 to 8")
        g = self.group_size
        gi = 0 if g is None else _integer(g)
        if gi == -1:
            raise QuantdynError("quantizer group_size=-1 is not a group size; write 0 for one group per output row "
                                "(what GPTQModel and HF write as -1), or a positive size such as 128")
        if gi is None or gi < 0:
            raise QuantdynError(f"quantizer group_size={g!r} must be 0 (one group per output row) or a positive "
                                "integer such as 128")
        damp = _real(self.damp_percent)
        if damp is None or not 0.0 < damp < 1.0:
            raise QuantdynError(f"quantizer damp_percent={self.damp_percent!r} must lie in (0, 1), e.g. 0.01")
        inc = _real(self.damp_auto_increment)
        if inc is None or not 0.0 <= inc < 1.0:
            raise QuantdynError(f"quantizer damp_auto_increment={self.damp_auto_increment!r} must lie in [0, 1) "
                                "(0 = fail on a Hessian that is not positive definite)")
        block = _integer(self.block_size)
        if block is None or block < 1:
            raise QuantdynError(f"quantizer block_size={self.block_size!r} must be an integer >= 1 (columns per "
                                "GPTQ lazy update, e.g. 128)")
        grid = _integer(self.awq_grid)
        if grid is None or grid < 1:
            raise QuantdynError(f"quantizer awq_grid={self.awq_grid!r} must be an integer >= 1 (alpha values "
                                "searched, e.g. 20)")
        for name in _BOOL_TOKENS:
            if not isinstance(getattr(self, name), bool):
                raise QuantdynError(f"quantizer {name}={getattr(self, name)!r} must be true or false")
        # store plain int/float so equal configs hash equally (numpy scalars, 0 vs 0.0)
        for name, value in (("bits", bits), ("group_size", gi), ("damp_percent", damp),
                            ("damp_auto_increment", inc), ("block_size", block), ("awq_grid", grid)):
            object.__setattr__(self, name, value)
        if self.act_order and self.act_group_aware:
            raise QuantdynError("quantizer act_order and act_group_aware exclude each other; set only one")
        if self.act_group_aware and not self.group_size:
            raise QuantdynError("quantizer act_group_aware needs group_size > 0")
        if self.static_groups and not self.group_size:
            raise QuantdynError("quantizer static_groups needs group_size > 0")
        _check_rotation(self)

    @property
    def name(self) -> str:
        """The canonical label, e.g. 'gptq4', 'rtn3g64', 'gptq4-gptqmodel' (module docstring: Labels)."""
        return canonical_label(self)


def _integer(value: Any) -> int | None:
    """``value`` as an int if it is an integer (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


def _real(value: Any) -> float | None:
    """``value`` as a finite float if it is a real number (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        return None
    return float(value)


# ----------------------------------------------------------------------------- registry


class FormatSpec(NamedTuple):
    """What a deployment format fixes (GGUF, FP8, NF4, MXFP4, NVFP4)."""

    label: str
    """How labels spell it (``q4_k_m``, ``fp8-channel``, ``q4_k-imatrix``)."""
    bits: int
    """Bits of one code (a mix: of its default type)."""
    group_size: int
    """Weights sharing one scale along a row (0: a whole row, or, for ``fp8``, the whole tensor)."""


@dataclass(frozen=True)
class TensorSite:
    """Where a weight sits, for formats that choose per tensor (llama.cpp's mixes and shape fallbacks)."""

    path: str
    """The layer's path inside its block (``attention.query_key_value``), or the head's path."""
    block: int
    """Block index; -1 for the head."""
    n_blocks: int
    """Number of blocks of the model."""
    shape: tuple[int, int]
    """(out_features, in_features)."""


class QuantMethod(NamedTuple):
    """A registered quantizer: ``fn(W, stats, cfg) -> QuantResult``."""

    fn: Callable[..., Any]
    """The pure tensor function (stats: quantize.gptq.ActStats or None)."""
    needs_calibration: bool
    """Whether apply must collect activation statistics (H, mean |x|)."""
    format: FormatSpec | None = None
    """Set for deployment formats: their label, bits and group size (fixed, not configurable)."""
    for_tensor: Callable[[Any, TensorSite], tuple[Any, dict]] | None = None
    """``for_tensor(cfg, site) -> (method, notes)``: the registered method that quantizes this tensor (a mix's
    type for it, or llama.cpp's fallback) and what to record in its layer row; None = ``cfg.method`` itself.
    A per-tensor plan returns the tensor's whole QuantConfig instead of a method."""
    act_quant: Callable[[torch.Tensor], torch.Tensor] | None = None
    """Activation fake quantization applied to the input of every quantized layer (W8A8); None = weights only."""
    fp_calibration: bool = False
    """Calibration statistics from the full-precision model's activations (llama-imatrix runs the unquantized
    model), not from the stream through this quantizer's own already quantized blocks (GPTQ's sequential way).
    An in-place walk (``quantize_model``) has no full-precision copy of a block once it is quantized: there the
    stream goes through the quantized block."""
    needs_abs_stats: bool = False
    """Whether the calibration statistics must also hold Σ|x| per input feature (``ActStats.abs_sum``, AWQ's
    activation scales; ``gptq.stats_update(need_abs=...)``), besides the Hessian."""


BUILTIN_MODULES = ("quantdyn.quantize.rtn", "quantdyn.quantize.gptq", "quantdyn.quantize.awq",
                   "quantdyn.quantize.formats", "quantdyn.quantize.plan")
"""The modules that register the built-in quantizers and what makes the plan families (each imports torch)."""


def _import_builtins() -> None:
    for module in BUILTIN_MODULES:
        import_module(module)


QUANTIZERS: LazyRegistry[QuantMethod] = LazyRegistry("quantizer", load=_import_builtins)
"""rtn, gptq, awq and the formats register themselves from their modules (BUILTIN_MODULES), imported on the
first lookup; parsing a label does not look here until they are (:func:`label_catalogue`)."""


PLAN_PREFIX, AUTO_PREFIX = "plan:", "auto@"
"""The per-tensor plan labels (``plan:FILE``, ``auto@BUDGET:TYPES``, quantize/plan.py): names made from what they
point to, so they are families of the registry, not entries of the catalogue file. They are declared here, so that
a label is parsed without torch; quantize/plan.py (one of BUILTIN_MODULES) registers what makes and spells them
(:func:`implement_family`)."""

_FAMILY_MAKERS: dict[str, tuple[Callable[[str], QuantMethod], Callable[[str], str]]] = {}


def implement_family(prefix: str, make: Callable[[str], QuantMethod], canonical: Callable[[str], str]) -> None:
    """What makes the quantizer of a name of the declared family ``prefix`` (PLAN_PREFIX, AUTO_PREFIX) and what
    spells it canonically: registered by the module that implements the family when it is imported."""
    if prefix not in (PLAN_PREFIX, AUTO_PREFIX) or prefix in _FAMILY_MAKERS:
        raise ValueError(f"quantizer family '{prefix}' is not declared or is implemented twice")
    _FAMILY_MAKERS[prefix] = (make, canonical)


def _family(prefix: str, which: int) -> Callable[[str], Any]:
    """The family's maker (0) or spelling (1); the first call imports the built-in modules, its own among them."""
    def call(name: str) -> Any:
        if prefix not in _FAMILY_MAKERS:
            QUANTIZERS.names()  # loads the built-in modules, the family's own among them
        return _FAMILY_MAKERS[prefix][which](name)
    return call


for _prefix in (PLAN_PREFIX, AUTO_PREFIX):
    QUANTIZERS.add_family(_prefix, _family(_prefix, 0), _family(_prefix, 1))

CATALOGUE_FILE = Path(__file__).with_name("catalogue.json")
"""Every built-in quantizer's name and format spec, written from QUANTIZERS by ``python tools/quantizer_catalogue.py``
(tests/test_quant_config.py fails while it differs from the registry)."""


class Declared(NamedTuple):
    """A quantizer as the catalogue file declares it: what label parsing needs, without its implementation."""

    format: FormatSpec | None


@lru_cache(maxsize=1)
def _declared() -> Registry[Declared]:
    data = json.loads(CATALOGUE_FILE.read_text())["quantizers"]
    declared: Registry[Declared] = Registry("quantizer")
    for name, spec in data.items():
        declared.add(name, Declared(FormatSpec(**spec) if spec is not None else None))
    return declared


def label_catalogue() -> Registry:
    """What parsing and checking a label reads (names; ``.format`` of each): QUANTIZERS once its modules are
    imported, else the catalogue file (CATALOGUE_FILE), so that `quantdyn quantize M --quantizers gptqx3` is
    refused without importing torch. The two agree (a test compares them)."""
    return QUANTIZERS if QUANTIZERS.loaded else _declared()


def catalogue_of_registry() -> dict[str, Any]:
    """The catalogue file's content from the registry's built-in quantizers (those defined in quantdyn)."""
    names = [n for n in QUANTIZERS if QUANTIZERS.get(n).fn.__module__.startswith("quantdyn.")]
    specs = {n: QUANTIZERS.get(n).format for n in names}
    return {"quantizers": {n: (s._asdict() if s is not None else None) for n, s in specs.items()}}


_FORMAT_FREE = ("quantize_head", "hadamard", "r1", "rotation_seed")
"""The QuantConfig fields a deployment format leaves to the user (the head, the rotations)."""


def _check_format_fields(cfg: "QuantConfig", spec: FormatSpec) -> None:
    """A format fixes bits and group size (the QuantConfig defaults give way to them) and has no GPTQ/AWQ
    options: anything else set is an error naming the field."""
    defaults = {f.name: f.default for f in dataclasses.fields(QuantConfig)}
    for name, fixed in (("bits", spec.bits), ("group_size", spec.group_size)):
        value = getattr(cfg, name)
        if value != fixed and value != defaults[name]:
            raise QuantdynError(f"quantizer {spec.label} has {name}={fixed} by definition; leave {name} out "
                                f"(got {value!r})")
        object.__setattr__(cfg, name, fixed)
    for f in dataclasses.fields(QuantConfig):
        if f.name in ("method", "bits", "group_size", *_FORMAT_FREE):
            continue
        if getattr(cfg, f.name) != f.default:
            raise QuantdynError(f"quantizer option {f.name} does not apply to the format {spec.label}; "
                                f"a format label takes only -head/-nohead (e.g. {spec.label}-head)")


def format_labels() -> dict[str, str]:
    """Every deployment-format label (and the method name where it differs, e.g. fp8_channel) -> its method."""
    out: dict[str, str] = {}
    catalogue = label_catalogue()
    for name in catalogue:
        spec = catalogue.get(name).format
        if spec is not None:
            out[spec.label] = name
            out[name] = name
    return out


def _format_head(spec: str) -> tuple[str, list[str]] | None:
    """(method, remaining tokens) if ``spec`` starts with a format label (longest match), else None."""
    labels = format_labels()
    for label in sorted(labels, key=len, reverse=True):
        if spec == label or spec.startswith(label + "-"):
            rest = spec[len(label) + 1:]
            return labels[label], [t for t in rest.split("-") if t] if rest else []
    return None


def _parse_format(spec: str, method: str, tokens: list[str]) -> dict[str, Any]:
    fields: dict[str, Any] = {"method": method}
    for t in tokens:
        if t in ("head", "nohead"):
            fields["quantize_head"] = t == "head"
        elif t == "imatrix":
            catalogue = label_catalogue()
            with_im = f"{catalogue.get(method).format.label}-imatrix"
            if with_im not in catalogue:
                raise QuantdynError(f"quantizer '{spec}': {catalogue.get(method).format.label} takes no importance "
                                    f"matrix (llama.cpp ignores it for this type)")
            fields["method"] = with_im
        else:
            raise QuantdynError(f"unknown option '{t}' in quantizer '{spec}'{did_you_mean(t, ['head', 'nohead', 'imatrix'])}"
                                f"; a format label takes only -head, -nohead (and GGUF types -imatrix)")
    return fields


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

# field -> (token when True, token when False); also the canonical order of boolean tokens
_BOOL_TOKENS: dict[str, tuple[str, str]] = {
    "sym": ("sym", "asym"),
    "mse": ("mse", "nomse"),
    "act_order": ("act", "noact"),
    "act_group_aware": ("gar", "nogar"),
    "static_groups": ("static", "nostatic"),
    "true_sequential": ("seq", "noseq"),
    "quantize_head": ("head", "nohead"),
    "awq_clip": ("clip", "noclip"),
}
_FLAGS: dict[str, dict[str, Any]] = {tok: {f: value} for f, pair in _BOOL_TOKENS.items()
                                     for tok, value in zip(pair, (True, False))}
# token prefix -> field; canonical order of valued tokens
_VALUE_TOKENS: dict[str, str] = {"damp": "damp_percent", "dampinc": "damp_auto_increment", "block": "block_size",
                                 "grid": "awq_grid"}
_VALUE = re.compile(r"^(?P<prefix>dampinc|damp|block|grid)(?P<value>\d+(?:\.\d*)?|\.\d+)$")

_SPEC = re.compile(r"^(?P<method>[a-z]+?)(?P<bits>\d+)(?:g(?P<group>\d+))?$")
_DEFAULT_GROUP = 128


def _number_token(value: float | int) -> str:
    """A number without exponent or sign (tokens are '-'-separated): 1e-05 -> '0.00001'."""
    if isinstance(value, int):
        return str(value)
    return format(Decimal(repr(float(value))), "f")


def canonical_label(cfg: "QuantConfig") -> str:
    """The one label of ``cfg``; ``parse_quantizer(canonical_label(cfg)) == cfg``."""
    spec = label_catalogue().get(cfg.method).format
    if spec is not None:
        return spec.label + ("-head" if cfg.quantize_head else "") + rotation_suffix(cfg)
    defaults = {f.name: f.default for f in dataclasses.fields(QuantConfig)}
    head = f"{cfg.method}{cfg.bits}" + ("" if cfg.group_size == _DEFAULT_GROUP else f"g{cfg.group_size}")
    best = ""
    for preset in (None, *PRESETS):
        base = {**defaults, **(PRESETS[preset] if preset else {})}
        tokens = [preset] if preset else []
        for f, (on, off) in _BOOL_TOKENS.items():
            if getattr(cfg, f) != base[f]:
                tokens.append(on if getattr(cfg, f) else off)
        for prefix, f in _VALUE_TOKENS.items():
            if getattr(cfg, f) != base[f]:
                tokens.append(prefix + _number_token(getattr(cfg, f)))
        label = "-".join([head, *tokens])
        if not best or len(label) < len(best):
            best = label
    return best + rotation_suffix(cfg)


# ----------------------------------------------------------------------------- rotations (+had, +r1, +seed<N>)

_ROTATION_TOKENS = ("had", "r1")
"""The rotation tokens after '+', in canonical order: field hadamard, field r1."""


def rotation_suffix(cfg: "QuantConfig") -> str:
    """'+had', '+had+r1+seed3', ... ('' without a rotation): the part of the label after the quantizer's."""
    tokens = [t for t, on in zip(_ROTATION_TOKENS, (cfg.hadamard, cfg.r1)) if on]
    if cfg.rotation_seed:
        tokens.append(f"seed{cfg.rotation_seed}")
    return "".join(f"+{t}" for t in tokens)


def rotation_of(cfg: "QuantConfig") -> str | None:
    """'had', 'r1', 'had+r1' or None: which rotations ``cfg`` applies (the rows' ``rotation`` field)."""
    return "+".join(t for t, on in zip(_ROTATION_TOKENS, (cfg.hadamard, cfg.r1)) if on) or None


def _split_rotation(text: str, spec: str) -> tuple[str, dict[str, Any]]:
    """('rtn4', {hadamard: True, rotation_seed: 3}) from 'rtn4+had+seed3'; (text, {}) without '+'."""
    base, *tokens = text.split("+")
    fields: dict[str, Any] = {}
    for t in tokens:
        m = re.fullmatch(r"seed(\d+)", t)
        if t == "had":
            fields["hadamard"] = True
        elif t == "r1":
            fields["r1"] = True
        elif m is not None:
            fields["rotation_seed"] = int(m[1])
        else:
            raise QuantdynError(f"unknown rotation '+{t}' in quantizer '{spec}'{did_you_mean(t, ['had', 'r1', 'seed'])}"
                                f"; rotations come last: <quantizer>+had (Hadamard on every layer's input), +r1 (residual stream), "
                                f"+seed<N> (the signs' seed), e.g. rtn4+had, gptq3+had+r1+seed1")
    if tokens and not base:
        raise QuantdynError(f"quantizer '{spec}' has a rotation but no quantizer before it; write e.g. rtn4+had")
    return base, fields


def _check_rotation(cfg: "QuantConfig") -> None:
    for name in ("hadamard", "r1"):
        if not isinstance(getattr(cfg, name), bool):
            raise QuantdynError(f"quantizer {name}={getattr(cfg, name)!r} must be true or false")
    seed = _integer(cfg.rotation_seed)
    if seed is None or seed < 0:
        raise QuantdynError(f"quantizer rotation_seed={cfg.rotation_seed!r} must be an integer >= 0")
    object.__setattr__(cfg, "rotation_seed", seed)
    if seed and not (cfg.hadamard or cfg.r1):
        raise QuantdynError(f"quantizer rotation_seed={seed} seeds a rotation, but none is asked for; add +had or +r1")


def quant_preset(name: str, **overrides: Any) -> QuantConfig:
    """QuantConfig of a named preset with explicit field overrides."""
    if name not in PRESETS:
        raise unknown_name("quantizer preset", name, PRESETS)
    return from_dict(QuantConfig, {**PRESETS[name], **overrides}, "quantizer")


def _parse_short(spec: str) -> dict[str, Any]:
    """'gptq4g64-gptqmodel-mse' -> field dict (preset first, then flags, then method/bits/group)."""
    if QUANTIZERS.canonical(spec.strip()) is not None:  # plan:FILE, auto@BUDGET:TYPES (paths keep their case)
        return {"method": spec.strip()}
    text, rotation = _split_rotation(spec.strip().lower(), spec)
    if rotation:
        return {**_parse_short(text), **rotation}
    fmt = _format_head(text)
    if fmt is not None:
        return _parse_format(spec, *fmt)
    head, *tokens = text.split("-")
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
    catalogue = label_catalogue()
    if m is None:
        formats = sorted(format_labels())
        raise QuantdynError(
            f"cannot read quantizer {spec!r}{did_you_mean(text, formats)}; write <method><bits>[g<group>][-<preset or "
            f"flag>...], e.g. gptq4, rtn3g64, gptq4-gptqmodel, awq4-sym, or a format: "
            f"{', '.join(l for l in formats if l == catalogue.get(format_labels()[l]).format.label)}"
        )
    fields: dict[str, Any] = {}
    for t in parts:
        v = _VALUE.match(t)
        if t in PRESETS:
            fields = {**fields, **PRESETS[t]}
        elif t in _FLAGS:
            fields.update(_FLAGS[t])
        elif v is not None:
            f = _VALUE_TOKENS[v["prefix"]]
            text = v["value"]
            if f in ("block_size", "awq_grid"):
                if "." in text:
                    raise QuantdynError(f"quantizer option '{t}' in '{spec}' needs an integer, e.g. {v['prefix']}64")
                fields[f] = int(text)
            else:
                fields[f] = float(text)
        else:
            choices = sorted([*PRESETS, *_FLAGS])
            raise QuantdynError(
                f"unknown quantizer option '{t}' in '{spec}'{did_you_mean(t, [*choices, *_VALUE_TOKENS])}; "
                f"choose presets/flags from: {', '.join(choices)}, or damp<x>, dampinc<x>, block<n>, grid<n>"
            )
    method = m["method"]
    if method not in catalogue:
        labels = sorted({catalogue.get(n).format.label if catalogue.get(n).format else n for n in catalogue})
        raise QuantdynError(f"unknown quantizer '{spec}'{did_you_mean(text, labels)}; choose a method "
                            f"({', '.join(n for n in catalogue.names() if catalogue.get(n).format is None)}) with "
                            f"bits, e.g. gptq4, or a format: {', '.join(l for l in labels if l not in catalogue or catalogue.get(l).format)}")
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
        if not isinstance(preset, str) or preset not in PRESETS:
            raise unknown_name("quantizer preset", str(preset), PRESETS)
        fields.update(PRESETS[preset])
    if name is not None:
        fields.update(_parse_short(str(name)))
    fields.update(data)
    return from_dict(QuantConfig, fields, "quantizer")


def row_fields(label: str, qc: QuantConfig) -> dict:
    """The quantizer columns of a result row: the canonical label (one spelling per configuration, so gptq4 and
    gptq4g128 group together), the spec as the user wrote it, the full config and its hash (rows are keyed by
    the hash, never by a label)."""
    rotation = {"rotation": rotation_of(qc), "rotation_seed": qc.rotation_seed} if rotation_of(qc) else {}
    return {"quantizer": qc.name, "quantizer_spec": label, "method": qc.method, "bits": qc.bits,
            "group_size": qc.group_size, "quant_config": to_dict(qc), "quant_config_hash": config_hash(qc),
            **rotation}


def config_for_tensor(cfg: QuantConfig, site: TensorSite) -> tuple[QuantConfig, dict]:
    """The configuration that quantizes the tensor at ``site`` and the notes for its layer row: ``cfg`` itself,
    or, for formats that choose per tensor (llama.cpp's mixes and shape fallbacks), the registered format the
    tensor gets (notes: ``quantizer_method``, ``gguf_fallback_from``)."""
    method = QUANTIZERS.get(cfg.method)
    if method.for_tensor is None:
        return cfg, {}
    resolved, notes = method.for_tensor(cfg, site)
    if isinstance(resolved, QuantConfig):  # a per-tensor plan gives the tensor's whole configuration
        return resolved, {**notes, "quantizer_method": resolved.method}
    if resolved == cfg.method:
        return cfg, notes
    spec = QUANTIZERS.get(resolved).format
    fixed = {"bits": spec.bits, "group_size": spec.group_size} if spec is not None else {}
    return dataclasses.replace(cfg, method=resolved, **fixed), {**notes, "quantizer_method": resolved}


def grid_bits_per_weight(cfg: QuantConfig, out_features: int, in_features: int) -> float:
    """Storage bits per weight of an integer-grid quantizer (rtn, gptq, awq) as a packed GPTQ / compressed-tensors
    checkpoint stores it: the codes, an fp16 scale per group, a ``bits``-bit zero point per group unless
    symmetric, and with act-order an int32 group index per input column (AWQ's scales fold into the previous
    layer). Deployment formats report their own (``QuantResult.bits_per_weight``)."""
    g = cfg.group_size
    groups = 1 if not g or g >= in_features else -(-in_features // g)
    bpw = cfg.bits + (16 + (0 if cfg.sym else cfg.bits)) * groups / in_features
    if cfg.act_order or cfg.act_group_aware:
        bpw += 32 / out_features
    return float(bpw)


def compute_dtype(W: torch.Tensor) -> torch.dtype:
    """float32 for half/bfloat16/float32 weights, float64 stays float64."""
    import torch  # here, not at the top: this module parses labels without torch

    return torch.promote_types(W.dtype, torch.float32)


class BlockTransform:
    """A variant that is not a weight quantizer but a change of each block's forward (e.g. QAT's deployed
    W+A fake-quantized form). It needs no calibration; the walk applies it to its copy of every block
    (and of the head) and carries the probe sets through the result."""

    name: str = "transform"

    def block(self, block: nn.Module) -> nn.Module:
        """The transformed block (may modify and return ``block``, which is the walk's own copy)."""
        raise NotImplementedError

    def head(self, head: nn.Module) -> nn.Module | None:
        """The transformed head (``head`` is a copy), or None to keep the full-precision head."""
        return None
