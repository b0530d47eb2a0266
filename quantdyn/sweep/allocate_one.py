"""One checkpoint, a size budget, candidate types -> a per-tensor plan: what `quantdyn allocate` runs.

    res = allocate_plan("runs/demo/checkpoints/step-0000600", 4.5, ["q3_k", "q4_k", "q5_k", "q6_k"], out="plan.json")
    res.plan.bits_per_weight(), res.summary["predicted_kl"], res.summary["llama_quantize"]

The checkpoint's sensitivity to every candidate type is measured on the calibration windows (never the
evaluation ones) by the streamed sensitivity pass (engine/sensitivity.py); the allocator (quantize/allocate.py)
picks the assignment of least predicted KL whose bits per weight, counted as result rows count them, stay at or
under the budget. The plan is then a quantizer: ``plan:plan.json`` in sweep, quantize, studies and the monitor.

Refused in one line before anything is read or written: an existing ``out`` (or the llama-quantize script beside
it), a type that is not a plan type, the types some tensor's rows cannot hold (all of them at once, with the widths,
llama.cpp's fallbacks and the types that do hold every tensor), a budget below every tensor in its cheapest type or
above every tensor in its richest. Written: the plan, and where its types are GGUF block types the llama-quantize
command that makes llama.cpp's own file of it (``plan.llama-quantize.sh`` beside ``plan.json``).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from quantdyn.data.prepare import DataConfig, prepare_data
from quantdyn.engine.lazy_model import LazyModel
from quantdyn.engine.sensitivity import Sensitivity, SensitivityConfig, measure_sensitivity, tensor_list
from quantdyn.errors import QuantdynError
from quantdyn.export.llama_quantize import llama_quantize_args
from quantdyn.files import write_text_atomic
from quantdyn.models.hf_io import checkpoint_hash
from quantdyn.quantize.allocate import check_types_hold
from quantdyn.quantize.catalogue import parse_quantizer
from quantdyn.quantize.plan import (Plan, budget_range, calibration_kind, check_candidate, check_plan_budget,
                                    check_types_fit, write_plan)
from quantdyn.results.schema import calib_hash as calib_identity
from quantdyn.results.schema import row_key
from quantdyn.results.store import ResultStore
from quantdyn.runs import resolve_run_reference
from quantdyn.runtime import provenance, resolve_device
from quantdyn.sources.hub import open_checkpoint


@dataclass(frozen=True)
class AllocateResult:
    """What :func:`allocate_plan` made."""

    plan: Plan
    """The plan written to ``out``."""
    out: Path
    """Where."""
    sensitivity: Sensitivity
    """The pass it was allocated on."""
    summary: dict
    """The numbers `quantdyn allocate` prints (and --json writes)."""


def check_types(types: Sequence[str]) -> tuple[str, ...]:
    """Canonical candidate types (one line for one that no plan holds, or for types that calibrate differently)."""
    out = []
    for t in types:
        out.append(check_candidate(t, f"type '{t}'").name)
    out = list(dict.fromkeys(out))
    if len(out) < 2:
        raise QuantdynError("give at least two candidate types to allocate between, e.g. --types q3_k,q4_k,q5_k,q6_k")
    calibration_kind([parse_quantizer(t) for t in out])
    return tuple(out)


def sensitivity_rows(sens: Sensitivity, point: str, calib: str, base: dict) -> list[dict]:
    """The pass's rows with their keys (one per scope x tensor x type); ``point`` identifies the checkpoint (its
    weights' hash, in a sweep qualified by run, branch and step)."""
    what = f"sens:{','.join(sens.types)}:{calib}:{sens.config.draws}"
    return [{"key": row_key(point, f"{what}:{r['scope']}:{r['tensor']}:{r['type']}", ""), **r}
            for r in sens.rows({**base, "calib_hash": calib})]


def allocate_plan(model_ref: str, budget: float, types: Sequence[str], *, out: str | Path,
                  calib_data: str = "builtin:kjv", n_calib_samples: int = 32, calib_seq_len: int = 128,
                  calib_seed: int = 0, tokenizer: str | None = None, store: str | None = None, device: str = "auto",
                  draws: int = 2, progress: bool = True, echo: Callable[[str], None] | None = None) -> AllocateResult:
    """Measure ``model_ref``'s sensitivity to ``types`` and write the plan of least predicted KL under ``budget``
    bits per weight to ``out`` (module docstring). ``store``: also append the sensitivity rows there."""
    types = check_types(types)
    out = Path(out)
    if out.exists():
        raise QuantdynError(f"'{out}' exists; choose a new --out file for the plan (nothing was written)")
    if not out.parent.is_dir():
        raise QuantdynError(f"directory '{out.parent}' of --out does not exist")
    script = llama_quantize_script_path(out)
    if script.exists():
        raise QuantdynError(f"'{script}' exists (the llama-quantize command of an earlier plan); choose a new --out "
                            "file for the plan (nothing was written)")
    if n_calib_samples < 1 or calib_seq_len < 2:
        raise QuantdynError("the sensitivity windows are the calibration windows: give --calib-samples >= 1 and "
                            "--calib-seq-len >= 2")
    cfg = SensitivityConfig(draws=draws)
    dev = resolve_device(device)
    model_ref = resolve_run_reference(model_ref)  # RUN@latest -> its checkpoint, named so in the rows
    weights = open_checkpoint(model_ref)
    source = LazyModel(weights, torch.float32, dev)
    entries = tensor_list(source)
    check_types_hold(entries, types)  # every type against every tensor, all misfits in one line
    check_types_fit(entries, types)  # and what is not a block size: a +had width without a Hadamard matrix
    low, high = budget_range(entries, len(source.blocks), types)
    check_plan_budget(budget, low, high, types)
    st = ResultStore(store) if store else None
    tok = tokenizer or (str(weights.path) if Path(model_ref).is_dir() else model_ref)
    data = prepare_data(DataConfig(source=calib_data, tokenizer=tok), progress=progress)
    vocab = weights.config.get("vocab_size")
    if vocab is not None and data.vocab_size > int(vocab):
        raise QuantdynError(f"tokenizer '{tok}' has {data.vocab_size} tokens but the model only {vocab}; use the "
                            "model's own tokenizer")
    ids = data.calib_windows(n_calib_samples, calib_seq_len, calib_seed)
    sens = measure_sensitivity(source, types, ids, device=dev, cfg=cfg, on_block=echo if progress else None)
    plan, alloc = sens.plan(budget, types, checkpoint=model_ref)
    joint, joint_se = sens.plan_estimate(plan)
    ckpt_hash = checkpoint_hash(str(weights.path)) if Path(model_ref).is_dir() else checkpoint_hash(model_ref)
    calib = calib_identity(data.data_hash, n_calib_samples, calib_seq_len, calib_seed)
    if st is not None:
        base = {"checkpoint": model_ref, "checkpoint_hash": ckpt_hash, "data_key": data.data_hash,
                "n_params": source.n_params(),
                "compute_dtype": "float32", **provenance()}
        st.append_new(sensitivity_rows(sens, ckpt_hash, calib, base))
    lq = llama_quantize_args(plan)
    if lq is not None:  # one --tensor-type per tensor: a file beside the plan, not a terminal line
        write_text_atomic(script, llama_quantize_script(lq))
    write_plan(plan, out)
    counts: dict[str, int] = {}
    for t in plan.tensors:
        counts[t.type] = counts.get(t.type, 0) + 1
    uniform = {k: sens.estimate([(j, i) for j in range(len(sens.tensors))]) for i, k in enumerate(sens.types)}
    summary = {
        "plan": str(out), "quantizer": f"plan:{out}", "digest": plan.digest, "budget": budget,
        "bits_per_weight": plan.bits_per_weight(), "budget_range": [low, high], "types": list(types),
        "counts": counts, "predicted_kl": alloc.error, "predicted_kl_joint": joint, "predicted_kl_joint_se": joint_se,
        "allocator": alloc.method, "uniform_predicted_kl": {k: v[0] for k, v in uniform.items()},
        "rank_correlations": sens.rank_correlations(), "sensitivity_seconds": sens.seconds,
        "sensitivity_tokens": sens.n_tokens, "draws": draws, "checkpoint_hash": ckpt_hash,
        "llama_quantize": lq, "llama_quantize_script": str(script) if lq is not None else None,
        "uniform": _uniform(budget, low, high, plan),
        "store": store,
    }
    return AllocateResult(plan, out, sens, summary)


def llama_quantize_script_path(plan_file: Path) -> Path:
    """Where the plan's llama-quantize command goes: beside the plan (``plan.json`` -> ``plan.llama-quantize.sh``)."""
    return plan_file.with_name(plan_file.stem + ".llama-quantize.sh")


def llama_quantize_script(args: list[str]) -> str:
    """A POSIX shell script running ``llama-quantize`` with ``args`` (export/llama_quantize.py); its input and output
    GGUF files are the script's first two arguments (default: the names in ``args``)."""
    import shlex

    *flags, src, dst, ftype = args
    lines = [f"  {shlex.quote(flags[i])} {shlex.quote(flags[i + 1])} \\" for i in range(0, len(flags), 2)]
    return ("#!/bin/sh\n# llama.cpp's own GGUF of a quantdyn plan: sh THIS_FILE [F32_GGUF [OUT_GGUF]]\n"
            "# (the F32 GGUF: llama.cpp's convert_hf_to_gguf.py --outtype f32)\nexec llama-quantize \\\n"
            + "\n".join(lines) + f'\n  "${{1:-{src}}}" "${{2:-{dst}}}" {ftype}\n')


def _uniform(budget: float, low: float, high: float, plan: Plan) -> str | None:
    """The one type every tensor got when the budget left nothing to choose (at the cheapest or the richest
    assignment), else None."""
    kinds = {t.type for t in plan.tensors}
    if len(kinds) == 1 and (budget <= low + 1e-9 or budget >= high - 1e-9):
        return next(iter(kinds))
    return None
