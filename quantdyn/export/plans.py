"""Per-tensor plans of integer grids as deployable checkpoints: GPTQ with GPTQModel's ``dynamic`` per-module
overrides, compressed-tensors with one config group per scheme, and the llm-compressor recipe that makes the same.

A plan (``plan:FILE`` or ``auto@...``) whose types are integer grids (rtn, gptq: bits x group x symmetry) and f16
is written layer by layer in the format's own layout (export/layouts.py) with each layer's own configuration; what
differs from one layer to the next goes into the quantization config:

* GPTQ: the configuration covering the most weights is the base (``bits``, ``group_size``, ``sym``,
  ``desc_act``); every other layer has an entry ``"+:^<module>$": {bits, group_size, sym, desc_act}`` in
  ``dynamic`` (GPTQModel's per-module regex overrides, read by GPTQModel and vLLM; "+:" a positive match), and an
  f16 layer ``"-:^<module>$": {}`` (a negative match: the module is not quantized and keeps its dense weight).
* compressed-tensors: ``config_groups`` ``group_<i>``, one per distinct scheme, targeting its modules by exact
  name; f16 layers under ``ignore`` (they stay ``nn.Linear`` with their dense weight).
* llm-compressor: the recipe (``quant_stage.quant_modifiers``) whose modifiers would quantize the same modules
  with the same schemes (GPTQModifier for gptq types, QuantizationModifier for rtn), written beside a
  compressed-tensors export as ``recipe.yaml``.
"""
from __future__ import annotations

import re
from typing import Mapping

from quantdyn.errors import QuantdynError
from quantdyn.export.layouts import permuted_groups
from quantdyn.quantize.catalogue import QUANTIZERS, QuantConfig, parse_quantizer
from quantdyn.quantize.plan import KEEP, is_auto, parse_auto, plan_of

LayerConfigs = Mapping[str, "QuantConfig | None"]
"""Layer name (checkpoint name without ``.weight``) -> its configuration (None: kept in f16)."""


def is_plan(qcfg: QuantConfig) -> bool:
    return plan_of(qcfg) is not None or is_auto(qcfg)


def plan_types(qcfg: QuantConfig) -> list[str]:
    """The types a plan or auto@ quantizer may give a layer."""
    plan = plan_of(qcfg)
    return sorted({t.type for t in plan.tensors}) if plan is not None else list(parse_auto(qcfg.method)[1])


def check_int_plan(qcfg: QuantConfig, fmt: str) -> list[QuantConfig]:
    """The integer configurations of a plan for a GPTQ / compressed-tensors export, or one line naming the type the
    format cannot hold."""
    out = []
    for t in plan_types(qcfg):
        if t == KEEP:
            continue
        qc = parse_quantizer(t)
        if qc.hadamard:  # one transform_config for the model: a per-tensor +had would be applied to every layer or none
            raise QuantdynError(f"{fmt} exports of a plan hold no per-tensor rotation; {qcfg.name} has type {t}: "
                                "measure it with quantdyn (quantize, sweep), or allocate without +had types to export")
        if QUANTIZERS.get(qc.method).format is not None:
            raise QuantdynError(f"{fmt} checkpoints hold integer grids; {qcfg.name} has type {t}: export a plan of GGUF "
                                "types with --export gguf")
        out.append(qc)
    return out


def layer_config(qcfg: QuantConfig, plan_type: str | None) -> QuantConfig | None:
    """A plan layer's configuration from the type its layer row records (None: f16)."""
    if plan_type is None:
        raise QuantdynError(f"a layer of {qcfg.name} came without its plan type; export it through the engine")
    return None if plan_type == KEEP else parse_quantizer(plan_type)


def _scheme(qc: QuantConfig) -> tuple:
    return (qc.bits, qc.group_size, qc.sym, permuted_groups(qc))


def _base(layers: LayerConfigs, sizes: Mapping[str, int] | None = None) -> QuantConfig:
    weight: dict[tuple, int] = {}
    first: dict[tuple, QuantConfig] = {}
    for name, qc in layers.items():
        if qc is not None:
            k = _scheme(qc)
            weight[k] = weight.get(k, 0) + (sizes or {}).get(name, 1)
            first.setdefault(k, qc)
    if not weight:
        raise QuantdynError("the plan quantizes no layer (every layer is f16); nothing to export as integers")
    return first[max(weight, key=lambda k: (weight[k], k))]


def _module(name: str) -> str:
    return f"^{re.escape(name)}$"


def gptq_dynamic(layers: LayerConfigs, sizes: Mapping[str, int] | None = None) -> tuple[QuantConfig, dict]:
    """(base configuration, GPTQModel ``dynamic`` dict) of a plan's layers (module docstring)."""
    base = _base(layers, sizes)
    dynamic: dict[str, dict] = {}
    for name, qc in sorted(layers.items()):
        if qc is None:
            dynamic[f"-:{_module(name)}"] = {}
        elif _scheme(qc) != _scheme(base):
            dynamic[f"+:{_module(name)}"] = {"bits": qc.bits, "group_size": qc.group_size or -1, "sym": qc.sym,
                                             "desc_act": permuted_groups(qc)}
    return base, dynamic


def _ct_weights(qc: QuantConfig) -> dict:
    return {"num_bits": qc.bits, "type": "int", "symmetric": qc.sym, "group_size": qc.group_size or None,
            "strategy": "group" if qc.group_size else "channel", "dynamic": False, "observer": "minmax"}


def ct_groups(layers: LayerConfigs) -> tuple[dict, list[str]]:
    """(compressed-tensors ``config_groups``, ``ignore``) of a plan's layers: one group per scheme."""
    schemes: dict[tuple, list[str]] = {}
    cfgs: dict[tuple, QuantConfig] = {}
    for name, qc in sorted(layers.items()):
        if qc is not None:
            schemes.setdefault(_scheme(qc), []).append(name)
            cfgs.setdefault(_scheme(qc), qc)
    groups = {f"group_{i}": {"targets": names, "weights": _ct_weights(cfgs[k]), "input_activations": None,
                             "output_activations": None, "format": "pack-quantized"}
              for i, (k, names) in enumerate(sorted(schemes.items()))}
    return groups, sorted(name for name, qc in layers.items() if qc is None)


def llmcompressor_recipe(layers: LayerConfigs) -> dict:
    """The llm-compressor recipe that quantizes the same modules with the same schemes: GPTQModifier for gptq types,
    QuantizationModifier for rtn (round to nearest), each with its own config groups; the head and f16 layers
    ignored."""
    mods: dict[str, dict] = {}
    for modifier, methods in (("GPTQModifier", ("gptq",)), ("QuantizationModifier", ("rtn",))):
        part = {n: qc for n, qc in layers.items() if qc is not None and qc.method in methods}
        if not part:
            continue
        groups, _ = ct_groups(part)
        others = sorted(n for n in layers if n not in part)
        entry: dict = {"ignore": ["lm_head", *others], "config_groups": {
            k: {"targets": g["targets"], "weights": g["weights"]} for k, g in groups.items()}}
        if modifier == "GPTQModifier":
            qc = next(iter(part.values()))
            entry.update(dampening_frac=qc.damp_percent, block_size=qc.block_size, actorder=(
                "group" if qc.act_group_aware else "dynamic" if qc.act_order else None))
        mods[modifier] = entry
    return {"quant_stage": {"quant_modifiers": mods}}
