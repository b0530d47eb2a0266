"""Per-tensor quantization plans: which type every linear of a model gets, as a quantizer like any other.

A plan is what ``quantdyn allocate`` writes (a JSON file) and what two label families read:

* ``plan:PATH`` quantizes every block linear with the type the plan file gives it; its canonical label carries
  the digest of the plan's assignment (``plan:plan.json#3f2a9c1e``), so rows of two different plans saved under
  one path never share a key, and a plan file changed after its label was written is refused;
* ``auto@BUDGET:TYPE,TYPE,...`` (``auto@4.5:q3_k,q4_k,q5_k,q6_k``) allocates on every checkpoint as it is
  measured: the engine measures that checkpoint's per-tensor sensitivity to the candidate types and quantizes
  with the plan the allocator makes under the budget (``engine.sensitivity``). Candidate types are sorted by
  name in the canonical label.

Candidate types: GGUF block types (with or without ``-imatrix``), integer grids of rtn and gptq (``gptq4``,
``rtn3g64-sym``), the float formats (fp8, fp8-channel, nf4, mxfp4, nvfp4) and ``f16`` (the tensor kept in 16-bit
floats, llama.cpp's F16). Refused: awq (its scales are fitted per layer pair), the llama.cpp mixes (a mix is
itself a per-tensor recipe), w8a8 (activation quantization is per model, not per tensor), ``-head`` and
``-seq`` labels, and a set that mixes types calibrated on the full-precision model's activations (``-imatrix``)
with types calibrated on their own quantized stream (gptq). Plans cover the decoder blocks' linears; the head
stays in full precision, as with every quantizer without ``-head``.

Bits per weight are counted exactly as result rows count them (``engine.rows.storage_fields``): per tensor the
format's own storage (GGUF: the block type after llama.cpp's shape fallback; a grid: scales, zero points and
act-order's index, ``catalogue.grid_bits_per_weight``; f16: 16), averaged over tensors weighted by their size.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from quantdyn import __version__
from quantdyn.errors import QuantdynError
from quantdyn.files import write_text_atomic
from quantdyn.quantize.catalogue import (AUTO_PREFIX, PLAN_PREFIX, QUANTIZERS, FormatSpec, QuantConfig, QuantMethod,
                                      TensorSite, config_for_tensor, grid_bits_per_weight, implement_family,
                                      parse_quantizer)
from quantdyn.quantize.formats import F16
from quantdyn.quantize.gguf import GGML_TYPES
from quantdyn.quantize.gguf_mixes import MIXES, tensor_category
from quantdyn.quantize import rotation  # the module, not its name: plan is loaded while rotation may still be (registry)

PLAN_FORMAT = "quantdyn-plan"
"""The ``format`` field of a plan file."""
PLAN_VERSION = 1
KEEP = F16
"""The type of a tensor a plan keeps in 16-bit floats (llama.cpp's F16; registered in quantize/formats.py like
every other type): it has no codes, so a plan's bits and main type leave it aside and exports keep it dense."""


@dataclass(frozen=True)
class ModelTensor:
    """One block linear of a model: its name, where it sits and its shape (what sensitivity rows and plans name)."""

    name: str
    """The layer's full name in the checkpoint, without ``.weight`` (``gpt_neox.layers.0.mlp.dense_4h_to_h``)."""
    block: int
    """Its decoder block."""
    path: str
    """Its path inside the block (``mlp.dense_4h_to_h``)."""
    shape: tuple[int, int]
    """(out_features, in_features)."""

    @property
    def group(self) -> str:
        """Its tensor group: ``attn`` or ``mlp`` (by llama.cpp's category), ``other`` for anything else."""
        cat = tensor_category(self.path)
        if cat.startswith("attn"):
            return "attn"
        if cat.startswith("ffn"):
            return "mlp"
        low = self.path.lower()
        return "attn" if "attn" in low or "attention" in low else "mlp" if "mlp" in low or "ffn" in low else "other"


@dataclass(frozen=True)
class PlanTensor(ModelTensor):
    """One linear of a plan: a model tensor and its type."""

    type: str
    """The quantizer label it is quantized with (``q4_k``, ``gptq3g64``, ``f16``)."""


@dataclass(frozen=True)
class Plan:
    """A per-tensor assignment and where it came from (the file ``quantdyn allocate`` writes)."""

    model_type: str
    """The architecture it was made for (``gpt_neox``, ``llama``)."""
    n_blocks: int
    """Decoder blocks of that model."""
    tensors: tuple[PlanTensor, ...]
    """Every quantized linear, in block order."""
    budget: float | None = None
    """The bits-per-weight budget it was allocated under (None: written by hand)."""
    candidates: tuple[str, ...] = ()
    """The candidate types it was allocated from."""
    predicted_kl: float | None = None
    """The allocator's additive prediction of the mean KL(FP ‖ Q) per token."""
    allocator: str = ""
    """How it was allocated (``knapsack-dp`` or ``lagrangian+greedy``)."""
    checkpoint: str = ""
    """The checkpoint whose sensitivity it was allocated on."""
    extra: dict = field(default_factory=dict)
    """Anything else the maker recorded (data, draws, the sensitivity pass's cost)."""

    def assignment(self) -> dict[str, str]:
        return {t.name: t.type for t in self.tensors}

    def types_by_weight(self) -> list[str]:
        """Its types, the one holding the most weights first (ties: in the order of the tensors)."""
        sizes: dict[str, int] = {}
        for t in self.tensors:
            sizes[t.type] = sizes.get(t.type, 0) + t.shape[0] * t.shape[1]
        return sorted(sizes, key=lambda k: -sizes[k])

    @property
    def main_type(self) -> str | None:
        """The type holding the most weights, f16 aside (ties: the first in tensor order); None when every tensor
        is f16. It names a GGUF file's type (export/gguf.py, export/llama_quantize.py)."""
        return next((t for t in self.types_by_weight() if t != KEEP), None)

    @property
    def digest(self) -> str:
        """8 hex digits of the assignment and the architecture: what makes two plans the same quantizer."""
        blob = json.dumps({"model_type": self.model_type, "n_blocks": self.n_blocks,
                           "tensors": [[t.name, list(t.shape), t.type] for t in self.tensors]}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:8]

    @functools.cached_property
    def _by_site(self) -> dict[tuple[int, str], PlanTensor]:
        return {(t.block, t.path): t for t in self.tensors}

    def type_at(self, block: int, path: str) -> PlanTensor | None:
        """The entry of the linear at ``path`` inside block ``block`` (None: the plan has none)."""
        return self._by_site.get((block, path))

    def bits_per_weight(self) -> float:
        """The plan's bits per weight, counted as rows count them."""
        n = sum(t.shape[0] * t.shape[1] for t in self.tensors)
        return tensor_bits(self) / n if n else 0.0

    def to_json(self) -> dict:
        return {"format": PLAN_FORMAT, "version": PLAN_VERSION, "model_type": self.model_type,
                "n_blocks": self.n_blocks, "budget": self.budget, "candidates": list(self.candidates),
                "bits_per_weight": self.bits_per_weight(), "predicted_kl": self.predicted_kl,
                "allocator": self.allocator, "checkpoint": self.checkpoint, "digest": self.digest,
                "quantdyn": __version__, "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "tensors": {t.name: {"type": t.type, "block": t.block, "path": t.path, "shape": list(t.shape)}
                            for t in self.tensors},
                **({"extra": self.extra} if self.extra else {})}


def plan_from_json(data: dict, where: str) -> Plan:
    """A plan from its JSON form; one line naming ``where`` for anything malformed."""
    if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
        raise QuantdynError(f"{where} is not a quantdyn plan (no \"format\": \"{PLAN_FORMAT}\"); make one with "
                            "`quantdyn allocate CKPT --budget B --types T,... --out plan.json`")
    if data.get("version") != PLAN_VERSION:
        raise QuantdynError(f"{where} is a plan of version {data.get('version')}; this quantdyn reads version "
                            f"{PLAN_VERSION}")
    try:
        tensors = tuple(PlanTensor(name, int(e["block"]), str(e["path"]), (int(e["shape"][0]), int(e["shape"][1])),
                                   str(e["type"])) for name, e in data["tensors"].items())
        plan = Plan(str(data["model_type"]), int(data["n_blocks"]), tensors,
                    None if data.get("budget") is None else float(data["budget"]), tuple(data.get("candidates") or ()),
                    data.get("predicted_kl"), str(data.get("allocator") or ""), str(data.get("checkpoint") or ""),
                    dict(data.get("extra") or {}))
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise QuantdynError(f"{where} is a malformed plan ({type(e).__name__}: {e}); write it again with "
                            "`quantdyn allocate`") from None
    if not tensors:
        raise QuantdynError(f"{where} has no tensors")
    for t in tensors:
        check_candidate(t.type, f"{where}, tensor {t.name}")
    return plan


def read_plan(path: str | Path) -> Plan:
    p = Path(path)
    if not p.is_file():
        raise QuantdynError(f"plan file '{p}' does not exist; make one with `quantdyn allocate CKPT --budget B "
                            "--types T,... --out plan.json`")
    try:
        data = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise QuantdynError(f"plan file '{p}' is not readable JSON ({e})") from None
    return plan_from_json(data, f"plan file '{p}'")


def write_plan(plan: Plan, path: str | Path) -> Path:
    """Write ``plan`` atomically (the caller refuses an existing file first)."""
    write_text_atomic(Path(path), json.dumps(plan.to_json(), indent=1) + "\n")
    return Path(path)


# ----------------------------------------------------------------------------- candidate types

def check_candidate(label: str, where: str = "") -> QuantConfig:
    """The QuantConfig of a candidate type, or a one-line refusal of a type no plan holds."""
    at = f"{where}: " if where else ""
    qc = parse_quantizer(label)
    method = QUANTIZERS.get(qc.method)
    base = qc.method.removesuffix("-imatrix")
    if qc.method.startswith((PLAN_PREFIX, AUTO_PREFIX)) or base in MIXES:
        raise QuantdynError(f"{at}'{label}' chooses types per tensor itself; a plan's types are single types such "
                            f"as q4_k, gptq4 or {KEEP}")
    if qc.method == "awq":
        raise QuantdynError(f"{at}awq cannot be a plan's type (its scales are fitted per layer); use rtn or gptq")
    if method.act_quant is not None:
        raise QuantdynError(f"{at}'{label}' quantizes activations of the whole model; a plan's types are weight-only")
    if qc.quantize_head or qc.true_sequential:
        raise QuantdynError(f"{at}'{label}': -head and -seq apply to a whole model, not to one tensor of a plan")
    if qc.r1:
        raise QuantdynError(f"{at}'{label}': +r1 rotates the residual stream of the whole model, not one tensor; a "
                            f"plan's types may take +had (each layer's input rotated), e.g. {qc.method}+had")
    return qc


def calibration_kind(qcs: list[QuantConfig]) -> tuple[bool, bool]:
    """(needs calibration, calibrated on the FP model's activations) of a set of types; one line if they disagree."""
    needing = [qc for qc in qcs if QUANTIZERS.get(qc.method).needs_calibration]
    fp = {QUANTIZERS.get(qc.method).fp_calibration for qc in needing}
    if len(fp) > 1:
        a = next(qc.name for qc in needing if QUANTIZERS.get(qc.method).fp_calibration)
        b = next(qc.name for qc in needing if not QUANTIZERS.get(qc.method).fp_calibration)
        raise QuantdynError(f"types {a} and {b} calibrate differently ({a} on the full-precision model's "
                            f"activations, {b} on its own quantized blocks' outputs); one plan takes one kind")
    return bool(needing), bool(fp and fp.pop())


_BPW_CACHE: dict[tuple[str, tuple[int, int]], float] = {}


def type_bits_per_weight(label: str, shape: tuple[int, int], site: TensorSite | None = None) -> float:
    """Bits per weight of one tensor of ``shape`` in type ``label``, as its layer row will count them: GGUF types
    after llama.cpp's shape fallback, grids with ``grid_bits_per_weight``, float formats from the format itself
    (run once per shape on zeros: f16 16)."""
    qc = parse_quantizer(label)
    site = site or TensorSite("", 0, 1, tuple(shape))
    resolved, _ = config_for_tensor(qc, site)
    if resolved.method.removesuffix("-imatrix") in GGML_TYPES:
        return GGML_TYPES.get(resolved.method.removesuffix("-imatrix")).bits_per_weight
    if QUANTIZERS.get(resolved.method).format is None:
        return grid_bits_per_weight(resolved, *shape)
    key = (resolved.method, tuple(shape))
    if key not in _BPW_CACHE:
        res = QUANTIZERS.get(resolved.method).fn(torch.zeros(shape), None, resolved)
        _BPW_CACHE[key] = float(res.bits_per_weight)
    return _BPW_CACHE[key]


def tensor_bits(plan: Plan) -> int:
    """Total storage bits of the plan's tensors (each tensor's bits per weight times its size, an integer)."""
    return sum(round(type_bits_per_weight(t.type, t.shape, TensorSite(t.path, t.block, plan.n_blocks, t.shape))
                     * t.shape[0] * t.shape[1]) for t in plan.tensors)


def fallback_of(label: str, shape: tuple[int, int]) -> str | None:
    """The type llama.cpp would store a tensor of ``shape`` in instead of the GGUF type ``label`` (None: it fits or
    ``label`` is not a GGUF type). A plan's tensor must hold its type as it is."""
    qc = parse_quantizer(label)
    resolved, notes = config_for_tensor(qc, TensorSite("", 0, 1, tuple(shape)))
    return resolved.method if notes.get("gguf_fallback_from") else None


# ----------------------------------------------------------------------------- the label families

_AUTO = re.compile(r"^auto@(?P<budget>\d+(?:\.\d*)?|\.\d+):(?P<types>.+)$")


def parse_auto(label: str) -> tuple[float, tuple[str, ...]]:
    """``auto@4.5:q3_k,q4_k`` -> (4.5, the canonical type labels sorted by name); one line for a bad label."""
    m = _AUTO.match(label.strip())
    if m is None:
        raise QuantdynError(f"cannot read quantizer '{label}'; write auto@BUDGET:TYPE,TYPE,... with the budget in "
                            "bits per weight, e.g. auto@4.5:q3_k,q4_k,q5_k,q6_k")
    budget = float(m["budget"])
    items = [t.strip() for t in m["types"].split(",") if t.strip()]
    types = sorted({check_candidate(t, f"quantizer '{label}'").name for t in items})
    if len(types) < 2:
        raise QuantdynError(f"quantizer '{label}' needs at least two candidate types to allocate between, e.g. "
                            "auto@4.5:q3_k,q4_k,q5_k,q6_k")
    calibration_kind([parse_quantizer(t) for t in types])
    return budget, tuple(types)


def _canonical_auto(label: str) -> str:
    budget, types = parse_auto(label)
    return f"auto@{budget:g}:{','.join(types)}"


def _split_plan_label(label: str) -> tuple[str, str | None]:
    body = label[len(PLAN_PREFIX):]
    path, _, digest = body.rpartition("#") if "#" in body else (body, "", None)
    if not path:
        raise QuantdynError(f"quantizer '{label}' names no plan file; write plan:PATH, e.g. plan:plan.json")
    return path, digest


_PLANS: dict[str, Plan] = {}
"""Plans by canonical label: the ones read from files and the ones ``auto@`` made (``register_plan``)."""


def _canonical_plan(label: str) -> str:
    """``plan:PATH`` -> ``plan:PATH#<digest>``, the file read again every time (a plan rewritten under the same
    path is another quantizer); in-memory plans (``register_plan``) by their label."""
    if label in _PLANS and label.startswith(f"{PLAN_PREFIX}{_IN_MEMORY}#"):
        return label
    path, digest = _split_plan_label(label)
    plan = read_plan(path)
    if digest is not None and digest != plan.digest:
        raise QuantdynError(f"plan file '{path}' has changed since the label '{label}' was written (its digest is "
                            f"now {plan.digest}); use plan:{path} for the plan as it is now")
    name = f"{PLAN_PREFIX}{path}#{plan.digest}"
    _PLANS[name] = plan
    return name


_IN_MEMORY = "auto"
"""The path part of the labels of plans made in memory (``plan:auto#<digest>``)."""


def register_plan(plan: Plan) -> str:
    """A plan made in memory (by ``auto@``) as a quantizer: its canonical label ``plan:auto#<digest>``."""
    name = f"{PLAN_PREFIX}{_IN_MEMORY}#{plan.digest}"
    _PLANS.setdefault(name, plan)
    QUANTIZERS.get(name)  # made now: the walk looks it up by name
    return name


def plan_of(qc: QuantConfig) -> Plan | None:
    """The plan behind a ``plan:`` quantizer, None for any other."""
    if not qc.method.startswith(PLAN_PREFIX):
        return None
    return _PLANS[_canonical_plan(qc.method)]


def is_auto(qc: QuantConfig) -> bool:
    return qc.method.startswith(AUTO_PREFIX)


def _max_bits(qcs: list[QuantConfig]) -> int:
    """The largest bit width of the codes among ``qcs``, f16 aside (8 without any): the bits of a plan's label."""
    return max((qc.bits for qc in qcs if qc.method != KEEP), default=8)


def _make_plan_method(label: str) -> QuantMethod:
    name = _canonical_plan(label)
    plan = _PLANS[name]
    qcs = {t: check_candidate(t, f"plan {name}") for t in sorted({t.type for t in plan.tensors})}
    needs_calibration, fp_calibration = calibration_kind(list(qcs.values()))

    def per_tensor(*args, **kwargs):
        raise QuantdynError(f"plan {name} quantizes each tensor with its own type: run it through the engine "
                            "(measure, sweep, quantize), which gives every layer its place in the model")

    def for_tensor(cfg: QuantConfig, site: TensorSite):
        entry = plan.type_at(site.block, site.path)
        if entry is None or site.block < 0:
            where = "the head" if site.block < 0 else f"layer {site.path} of block {site.block}"
            raise QuantdynError(f"plan {name} has no type for {where}; it was made for a {plan.model_type} model of "
                                f"{plan.n_blocks} blocks: allocate a plan for this checkpoint")
        if tuple(site.shape) != entry.shape:
            raise QuantdynError(f"plan {name} was made for {entry.name} of shape {list(entry.shape)}, this checkpoint's "
                                f"is {list(site.shape)}: allocate a plan for this checkpoint")
        resolved, notes = config_for_tensor(qcs[entry.type], site)
        return resolved, {**notes, "plan_type": entry.type}

    return QuantMethod(per_tensor, needs_calibration, FormatSpec(name, _max_bits(list(qcs.values())), 0),
                       for_tensor, fp_calibration=fp_calibration)


def _make_auto_method(label: str) -> QuantMethod:
    name = _canonical_auto(label)
    _, types = parse_auto(name)
    qcs = [parse_quantizer(t) for t in types]
    _, fp_calibration = calibration_kind(qcs)  # calibration windows always: the sensitivity pass runs on them

    def not_allocated(*args, **kwargs):
        raise QuantdynError(f"{name} allocates per checkpoint while it is measured (measure, sweep, quantize, the "
                            "monitor); to quantize a model in place, make a plan first with `quantdyn allocate`")

    def for_tensor(cfg, site):
        not_allocated()

    return QuantMethod(not_allocated, True, FormatSpec(name, _max_bits(qcs), 0), for_tensor,
                       fp_calibration=fp_calibration)


# the families themselves are declared with QUANTIZERS (quantize/catalogue.py), which calls these on first use
implement_family(PLAN_PREFIX, _make_plan_method, _canonical_plan)
implement_family(AUTO_PREFIX, _make_auto_method, _canonical_auto)


def budget_range(tensors: list[tuple[str, int, str, tuple[int, int]]], n_blocks: int,
                 types: tuple[str, ...]) -> tuple[float, float]:
    """(fewest, most) bits per weight any assignment of ``types`` to ``tensors`` (name, block, path, shape) reaches:
    every tensor in its cheapest type, every tensor in its richest."""
    cost, n = _tensor_type_bits(tensors, n_blocks, types)
    return sum(min(c) for c in cost) / n, sum(max(c) for c in cost) / n


def _tensor_type_bits(tensors: list[tuple[str, int, str, tuple[int, int]]], n_blocks: int,
                      types: tuple[str, ...]) -> tuple[list[list[int]], int]:
    """Each tensor's storage bits in each of ``types`` (integers, as a plan counts them), and the number of weights."""
    cost = [[round(type_bits_per_weight(t, shape, TensorSite(path, block, n_blocks, shape)) * shape[0] * shape[1])
             for t in types] for _, block, path, shape in tensors]
    return cost, sum(shape[0] * shape[1] for _, _, _, shape in tensors)


def forced_assignment(tensors: list[tuple[str, int, str, tuple[int, int]]], n_blocks: int, types: tuple[str, ...],
                      budget: float) -> tuple[str, ...] | None:
    """The one assignment of ``types`` to ``tensors`` (name, block, path, shape) that an allocation under ``budget``
    can make, when there is only one: every tensor's cheapest type is unique and no tensor can move to a richer one
    within the bits the budget leaves above every tensor in its cheapest type (bits counted as a plan counts them:
    integers per tensor, the budget floored over all weights). None when the allocation has a choice to make (or the
    budget is below the cheapest assignment: check_plan_budget says so)."""
    cost, n = _tensor_type_bits(tensors, n_blocks, types)
    slack = math.floor(budget * n + 1e-9) - sum(min(c) for c in cost)
    if slack < 0:
        return None
    out = []
    for c in cost:
        ranked = sorted(c)
        if len(ranked) > 1 and (ranked[1] == ranked[0] or ranked[1] - ranked[0] <= slack):
            return None
        out.append(types[c.index(ranked[0])])
    return tuple(out)


def check_plan_budget(budget: float, low: float, high: float, types: tuple[str, ...]) -> None:
    """One line unless ``budget`` lies in [low, high] (what every tensor in its cheapest / richest type costs)."""
    if not math.isfinite(budget) or budget < low - 1e-12 or budget > high + 1e-12:
        raise QuantdynError(f"budget {budget:g} bits per weight is outside what {', '.join(types)} can reach on this "
                            f"model: {low:.4f} (every tensor in its cheapest type) to {high:.4f} (every tensor in its "
                            "richest); choose a budget in that range")


def check_types_fit(tensors: list[tuple[str, int, str, tuple[int, int]]], types: tuple[str, ...]) -> None:
    """One line naming the first tensor whose rows cannot hold one of ``types`` as it is, and llama.cpp's fallback."""
    for name, _, _, shape in tensors:
        for t in types:
            if t != KEEP and parse_quantizer(t).hadamard:
                rotation.check_width(shape[1], f"tensor {name}")
            try:
                alt = fallback_of(t, shape)
            except QuantdynError:  # rows fit no GGUF block at all (not a multiple of 32)
                raise QuantdynError(f"tensor {name} has rows of {shape[1]} weights, which {t} cannot hold (no GGUF "
                                    f"block type fits; llama.cpp would store it as F16); drop {t} from the types") from None
            if alt is not None:
                raise QuantdynError(f"tensor {name} has rows of {shape[1]} weights, which {t} cannot hold (it needs a "
                                    f"multiple of {GGML_TYPES.get(parse_quantizer(t).method.removesuffix('-imatrix')).block}"
                                    f"; llama.cpp would store it as {alt} instead); drop {t} from the types")
