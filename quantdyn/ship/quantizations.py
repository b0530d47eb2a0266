"""The quantizations of a ship: which uniform types fit the budget on this model, in which export format, and the
allocated plan (``auto@BUDGET``) beside them.

Bits per weight are counted on the model's own linears as result rows count them (``quantize/plan.py``
``type_bits_per_weight``: GGUF types after llama.cpp's shape fallback, integer grids with their scales), so a type
"fits" the budget when its measured storage does, not its nominal bits. Two types that quantize every tensor the
same way on this model (a K-quant whose rows all fall back to the same legacy type) are one quantization, kept
under the first name: identical weights are measured once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from quantdyn.errors import QuantdynError, unknown_name
from quantdyn.export.layouts import EXPORT_FORMATS, check_exportable
from quantdyn.quantize.catalogue import QuantConfig, TensorSite, config_for_tensor, parse_quantizer
from quantdyn.quantize.plan import budget_range, check_types_fit, forced_assignment, parse_auto, type_bits_per_weight

DEPLOYMENT_TYPES = ("q8_0", "q6_k", "q5_k_m", "q5_1", "q5_0", "q4_k_m", "q4_1", "q4_0", "q3_k_m", "q2_k",
                    "gptq8", "gptq4", "gptq3", "gptq2", "nvfp4", "mxfp4", "fp8-channel")
"""The common deployment types ship considers by default: llama.cpp's GGUF types and mixes, GPTQ integer grids
(GPTQ / compressed-tensors checkpoints), and the float formats vLLM serves (compressed-tensors)."""

AUTO_TYPES = {"gguf": ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "q8_0", "q4_0", "q5_0"),
              "gptq": ("gptq2", "gptq3", "gptq4", "gptq8"),
              "compressed-tensors": ("gptq2", "gptq3", "gptq4", "gptq8")}
"""The types an ``auto@`` plan allocates between, per export format (those every tensor of the model holds)."""

FORMAT_ORDER = ("gguf", "gptq", "compressed-tensors")
"""The export format of a quantization: the first of these that holds it."""

AUTO = "auto"


@dataclass(frozen=True)
class Quantization:
    """One way to quantize every candidate."""

    name: str
    """How ship names it: a type label (q4_0, gptq4) or auto@BUDGET."""
    label: str
    """The quantizer label the engine measures (auto@BUDGET:TYPES for a plan)."""
    bits_per_weight: float
    """Storage bits per weight on this model (a plan: the budget, its upper bound)."""
    export_format: str
    uniform: bool = True

    def describe(self) -> dict:
        return {"name": self.name, "label": self.label, "bits_per_weight": self.bits_per_weight,
                "format": self.export_format, "uniform": self.uniform}


def model_bits_per_weight(label: str, tensors, n_blocks: int) -> float:
    """Bits per weight of ``label`` over ``tensors`` (ModelTensor), weighted by size."""
    bits = n = 0
    for t in tensors:
        site = TensorSite(t.path, t.block, n_blocks, tuple(t.shape))
        bits += round(type_bits_per_weight(label, tuple(t.shape), site) * t.shape[0] * t.shape[1])
        n += t.shape[0] * t.shape[1]
    return bits / n


def _resolved(qc: QuantConfig, tensors, n_blocks: int) -> tuple:
    return tuple(config_for_tensor(qc, TensorSite(t.path, t.block, n_blocks, tuple(t.shape)))[0]
                 for t in tensors)


def export_format(qc: QuantConfig, model_type: str, formats: Sequence[str]) -> str | None:
    """The first of ``formats`` (in FORMAT_ORDER) that can hold ``qc`` on a ``model_type`` model, else None."""
    for fmt in [f for f in FORMAT_ORDER if f in formats]:
        try:
            check_exportable(fmt, qc, model_type)
        except QuantdynError:
            continue
        return fmt
    return None


def check_formats(formats: Sequence[str]) -> tuple[str, ...]:
    """``--formats``: names of export formats (one line for a name quantdyn cannot write)."""
    for f in formats:
        if f not in EXPORT_FORMATS:
            raise unknown_name("--formats: export format", f, list(EXPORT_FORMATS))
    return tuple(formats) or FORMAT_ORDER


def plan_quantizations(budget: float, tensors, n_blocks: int, model_type: str, *, labels: Sequence[str] = (),
                       formats: Sequence[str] = (), auto: bool = True) -> tuple[list[Quantization], list[str]]:
    """The quantizations to measure at ``budget`` (and notes on what was left out, each one line).

    ``labels``: the uniform types to consider (default :data:`DEPLOYMENT_TYPES`; a given label that no allowed
    format exports is an error). Raises a one-line QuantdynError when none fits the budget, naming the smallest
    bits per weight available."""
    if not budget > 0:
        raise QuantdynError(f"--budget {budget:g} must be a positive number of bits per weight, e.g. 4.5")
    fmts = check_formats(formats)
    given = bool(labels)
    notes: list[str] = []
    out: list[Quantization] = []
    seen: dict[tuple, str] = {}
    avail: dict[str, float] = {}
    for label in labels or DEPLOYMENT_TYPES:
        qc = parse_quantizer(label)
        if qc.method.startswith("auto@") or qc.method.startswith("plan:"):
            raise QuantdynError(f"--quantizers {label}: give uniform types; ship adds auto@{budget:g} itself "
                                "(--no-auto leaves it out)")
        fmt = export_format(qc, model_type, fmts)
        if fmt is None:
            if given:
                raise QuantdynError(f"quantizer {qc.name} cannot be exported as {' or '.join(fmts)} for a {model_type} "
                                    "model; choose types those formats hold (ship writes the chosen one)")
            continue
        bpw = model_bits_per_weight(qc.name, tensors, n_blocks)
        avail[qc.name] = bpw
        if bpw > budget + 1e-9:
            continue
        same = _resolved(qc, tensors, n_blocks)
        if same in seen:
            notes.append(f"{qc.name} quantizes every tensor of this model as {seen[same]} does: measured once, as "
                         f"{seen[same]}")
            continue
        seen[same] = qc.name
        out.append(Quantization(qc.name, qc.name, bpw, fmt))
    if not out:
        if not avail:
            raise QuantdynError(f"no quantizer can be exported as {', '.join(fmts)} for this {model_type} model")
        low = min(avail, key=avail.get)
        raise QuantdynError(f"no quantization fits --budget {budget:g} bits per weight on this model: the smallest "
                            f"available is {low} at {avail[low]:.3f}; raise the budget to at least {avail[low]:.3f}")
    if auto:
        a = auto_quantization(budget, tensors, n_blocks, fmts)
        if isinstance(a, str):
            notes.append(a)
        else:
            only = forced_type(a, tensors, n_blocks)
            same = seen.get(_resolved(parse_quantizer(only), tensors, n_blocks)) if only else None
            if same:  # the plan cannot differ from a uniform type already measured: no sensitivity pass for it
                notes.append(f"{a.name} left out: the budget leaves no tensor room for a type richer than {only}, so "
                             f"its plan is {only} on every tensor, which is measured as {same}")
            else:
                out.append(a)
    return out, notes


def forced_type(a: Quantization, tensors, n_blocks: int) -> str | None:
    """The one type an ``auto@`` quantization's plan can give every tensor of this model, when the budget forces it
    (quantize/plan.py forced_assignment) and it is the same type everywhere; else None."""
    budget, types = parse_auto(parse_quantizer(a.label).method)
    entries = [(t.name, t.block, t.path, tuple(t.shape)) for t in tensors]
    forced = forced_assignment(entries, n_blocks, tuple(types), budget)
    return forced[0] if forced and len(set(forced)) == 1 else None


def auto_quantization(budget: float, tensors, n_blocks: int, fmts: Sequence[str]) -> Quantization | str:
    """``auto@BUDGET`` over the first allowed format's types that every tensor holds, or a line saying why none."""
    entries = [(t.name, t.block, t.path, tuple(t.shape)) for t in tensors]
    for fmt in [f for f in FORMAT_ORDER if f in fmts]:
        types = []
        for t in AUTO_TYPES[fmt]:
            try:
                check_types_fit(entries, (t,))
            except QuantdynError:
                continue
            types.append(t)
        if len(types) < 2:
            continue
        lo, hi = budget_range(entries, n_blocks, tuple(sorted(types)))
        if not lo - 1e-12 <= budget <= hi + 1e-12:
            continue
        label = f"auto@{budget:g}:{','.join(sorted(types))}"
        return Quantization(f"auto@{budget:g}", label, budget, fmt, uniform=False)
    return (f"auto@{budget:g} left out: no allowed format has two or more types every tensor of this model holds "
            "with the budget between their cheapest and richest assignment")
