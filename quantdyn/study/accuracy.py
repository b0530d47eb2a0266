"""Downstream accuracy of a checkpoint and its quantized twins (what `quantdyn eval` runs).

lm-eval runs whole models, so the full-precision model is loaded in memory; its quantized
twins are made by the streamed engine (``quantdyn.measure``: the one implementation of
quantization) and written into copies of that model, then
``evaluate/downstream.accuracy_rows_for_point`` runs the tasks on all of them.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
import torch.nn as nn

from quantdyn.errors import QuantdynError
from quantdyn.evaluate.downstream import (
    BUILTIN_TASKS,
    _hf_lm,
    _lm_eval,
    _load_model,
    _load_tokenizer,
    _ref_hash,
    _split_names,
    accuracy_rows_for_point,
    prepare_tasks,
    state_hash,
)
from quantdyn.measure.engine import MeasureConfig, measure
from quantdyn.measure.rows import calib_hash as calib_identity
from quantdyn.quantize.config import parse_quantizer
from quantdyn.runtime import resolve_device


def quantized_twin(model: nn.Module, layer_weights: dict[str, torch.Tensor]) -> nn.Module:
    """A copy of ``model`` with the quantized weights of the engine (layer name -> weight in the module's own
    layout) written in; each replaced weight is a new parameter, so a quantized tied head is untied."""
    twin = copy.deepcopy(model)
    modules = dict(twin.named_modules())
    for name, w in layer_weights.items():
        mod = modules[name]
        mod.weight = nn.Parameter(w.to(device=mod.weight.device, dtype=mod.weight.dtype), requires_grad=False)
    return twin.eval()


def quantized_twins(model: nn.Module, quantizers: dict, calib_ids: torch.Tensor, device, cfg: MeasureConfig
                    ) -> dict[str, nn.Module]:
    """{label: quantized copy of ``model``} from one streamed walk over the in-memory model."""
    weights: dict[str, dict[str, torch.Tensor]] = {label: {} for label in quantizers}
    measure(model, quantizers, None, calib_ids, device=device, cfg=cfg,
            on_layer=lambda label, full, res, m: weights[label].__setitem__(full, m.weight.detach().clone()))
    return {label: quantized_twin(model, weights[label]) for label in quantizers}


def evaluate_accuracy(
    model_ref_or_model: str | Path | nn.Module,
    tasks: str | Iterable[str],
    quantizer: str | Any | Sequence[str | Any] | None = None,
    num_fewshot: int = 0,
    limit: int | float | None = None,
    seed: int = 0,
    *,
    tokenizer=None,
    data=None,
    calib_ids: torch.Tensor | None = None,
    calib_samples: int = 32,
    calib_seq_len: int = 128,
    backend: str = "quantdyn",
    batch_size: int = 16,
    device: str = "auto",
    metric: str | None = None,
    checkpoint_hash: str | None = None,
    builtin_n: int = 500,
    task_dir: str | Path | None = None,
    include_paths: Sequence[str | Path] = (),
    quantize_threads: int = 1,
    progress: bool = False,
) -> list[dict]:
    """Accuracy of a model and of its quantized copies on lm-eval tasks -> result rows.

    ``model_ref_or_model``: a checkpoint directory, ``hub-id[@revision]`` or an
    nn.Module (then pass ``tokenizer``).  ``quantizer``: None (FP rows only), a
    spec such as ``"gptq3"`` / a QuantConfig, or a list of them.  Calibration
    windows come from ``calib_ids``, else from ``data`` (a TokenData), else from
    ``builtin:kjv`` tokenized with the model's own tokenizer.  ``data`` also
    feeds the built-in tasks (for a path it defaults to builtin:kjv with the
    checkpoint's tokenizer).  ``backend``: "quantdyn" (QuantdynLM) or "hf"
    (lm-eval's HFLM; needs a transformers model).  Rows are ready for
    ``ResultStore.append``.
    """
    if backend not in ("quantdyn", "hf"):
        raise QuantdynError(f"unknown backend '{backend}'; choose 'quantdyn' or 'hf'")
    if num_fewshot < 0:
        raise QuantdynError(f"--num-fewshot must be >= 0, got {num_fewshot}")
    if limit is not None and limit <= 0:
        raise QuantdynError(f"--limit must be positive, got {limit}")
    _lm_eval()
    dev = resolve_device(device)
    qspecs = [] if quantizer is None else (list(quantizer) if isinstance(quantizer, (list, tuple)) else [quantizer])
    qcfgs = {(q if isinstance(q, str) else parse_quantizer(q).name): parse_quantizer(q) for q in qspecs}
    names = _split_names(tasks)

    ref, model = None, None
    if isinstance(model_ref_or_model, nn.Module):
        model = model_ref_or_model
        if tokenizer is None:
            tokenizer = getattr(data, "tokenizer", None)
        if tokenizer is None:
            raise QuantdynError("evaluating a model object needs its tokenizer: pass tokenizer= (or data=)")
    else:
        ref = str(model_ref_or_model)
        if backend == "quantdyn" or qcfgs:  # HFLM loads an unquantized checkpoint from its path itself
            model = _load_model(ref, backend, dev)
        tokenizer = tokenizer or _load_tokenizer(ref)
    if data is None and ref is not None and (qcfgs or any(n in BUILTIN_TASKS for n in names)):
        from quantdyn.data.prepare import DataConfig, prepare_data

        data = prepare_data(DataConfig(source="builtin:kjv", tokenizer=ref.split("@")[0]), progress=progress)

    ckpt_hash = checkpoint_hash or (_ref_hash(ref) if ref is not None else state_hash(model))
    base = {"checkpoint": ref, "checkpoint_hash": ckpt_hash}
    loaded, ident = prepare_tasks(names, data=data, seed=seed, builtin_n=builtin_n, task_dir=task_dir,
                                  include_paths=include_paths)

    calib = ""
    q_models: dict[str, Any] = {}
    if qcfgs:
        if calib_ids is None:
            if data is None:
                raise QuantdynError("quantizing needs calibration data: pass calib_ids= or data=")
            calib_ids = data.calib_windows(calib_samples, calib_seq_len, seed)
            calib = calib_identity(data.data_hash, calib_samples, calib_seq_len, seed)
        else:
            import hashlib

            calib = hashlib.sha1(calib_ids.cpu().numpy().tobytes()).hexdigest()[:12]
        q_models = quantized_twins(model, qcfgs, calib_ids, dev, MeasureConfig(quantize_threads=quantize_threads))

    if backend == "hf":
        fp_lm = _hf_lm(model if model is not None else ref, tokenizer, batch_size, dev)
        q_lms = {label: _hf_lm(m, tokenizer, batch_size, dev) for label, m in q_models.items()}
    else:
        fp_lm, q_lms = model, q_models
    return accuracy_rows_for_point(
        fp_lm, q_lms, loaded, tokenizer=tokenizer, quant_configs=qcfgs, base=base, num_fewshot=num_fewshot,
        limit=limit, seed=seed, metric=metric, batch_size=batch_size, calib_hash=calib, task_ident=ident,
        backend=backend, progress=progress,
    )
