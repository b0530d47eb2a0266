"""Downstream accuracy of a checkpoint and its quantized twins (what `quantdyn eval` runs, and sweeps with
``eval_tasks``), as result rows.

lm-eval runs whole models, so the full-precision model is loaded in memory; its quantized twins are made by the
streamed engine (``quantdyn.engine.measure``: the one implementation of quantization) and written into copies of that
model. :func:`accuracy_rows_for_point` runs the tasks (``evaluate/lm_eval_tasks.py``) on all of them and returns
rows (``kind: "accuracy"``) with the accuracy of both, the drop and its *paired* standard error over examples.
The metric is ``acc``, else ``acc_norm``, else ``exact_match`` (the row's ``metric`` says which).
"""
from __future__ import annotations

import copy
import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from quantdyn.data.prepare import DataConfig, prepare_data
from quantdyn.engine.measure import MeasureConfig, measure
from quantdyn.errors import QuantdynError
from quantdyn.evaluate.lm_eval_tasks import (
    hf_lm,
    load_eval_model,
    load_tokenizer,
    make_lm,
    per_example,
    prepare_tasks,
    require_lm_eval,
    run_tasks,
    split_names,
)
from quantdyn.evaluate.tasks import BUILTIN_TASKS
from quantdyn.models.hf_io import checkpoint_hash
from quantdyn.quantize.catalogue import parse_quantizer, row_fields
from quantdyn.results.schema import ACCURACY
from quantdyn.results.schema import calib_hash as calib_identity
from quantdyn.results.stats import mean_se
from quantdyn.runtime import provenance, resolve_device


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
    require_lm_eval()
    dev = resolve_device(device)
    qspecs = [] if quantizer is None else (list(quantizer) if isinstance(quantizer, (list, tuple)) else [quantizer])
    qcfgs = {(q if isinstance(q, str) else parse_quantizer(q).name): parse_quantizer(q) for q in qspecs}
    names = split_names(tasks)

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
            model = load_eval_model(ref, backend, dev)
        tokenizer = tokenizer or load_tokenizer(ref)
    if data is None and ref is not None and (qcfgs or any(n in BUILTIN_TASKS for n in names)):
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
            calib = hashlib.sha1(calib_ids.cpu().numpy().tobytes()).hexdigest()[:12]
        q_models = quantized_twins(model, qcfgs, calib_ids, dev, MeasureConfig(quantize_threads=quantize_threads))

    if backend == "hf":
        fp_lm = hf_lm(model if model is not None else ref, tokenizer, batch_size, dev)
        q_lms = {label: hf_lm(m, tokenizer, batch_size, dev) for label, m in q_models.items()}
    else:
        fp_lm, q_lms = model, q_models
    return accuracy_rows_for_point(
        fp_lm, q_lms, loaded, tokenizer=tokenizer, quant_configs=qcfgs, base=base, num_fewshot=num_fewshot,
        limit=limit, seed=seed, metric=metric, batch_size=batch_size, calib_hash=calib, task_ident=ident,
        backend=backend, progress=progress,
    )


def _lm_eval_version() -> str | None:
    import lm_eval  # the optional extra; callers checked it with require_lm_eval

    return getattr(lm_eval, "__version__", None)


def state_hash(model: nn.Module) -> str:
    """Content hash of an in-memory model's weights (for models that came from no checkpoint)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
                 if t.numel() else b"")
    return h.hexdigest()[:16]


def accuracy_row_key(checkpoint_hash: str, task: str, task_version: Any, task_ident: dict, num_fewshot: int,
                     limit: Any, seed: int, quant_hash: str, calib_hash: str, metric: str, backend: str) -> str:
    blob = "|".join(str(x) for x in (checkpoint_hash, task, task_version, sorted(task_ident.items()), num_fewshot,
                                     limit, seed, quant_hash, calib_hash, metric, backend))
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _quant_fields(label: str, qc) -> dict:
    if qc is None:
        return {"quantizer": label, "quant_config": None, "quant_config_hash": None}
    return row_fields(label, qc)


def accuracy_rows_for_point(
    fp_model: nn.Module | Any,
    q_models: Mapping[str, nn.Module | Any],
    tasks: str | Iterable[str] | Mapping[str, Any],
    *,
    tokenizer=None,
    quant_configs: Mapping[str, Any] | None = None,
    base: Mapping[str, Any] | None = None,
    data=None,
    num_fewshot: int = 0,
    limit: int | float | None = None,
    seed: int = 0,
    metric: str | None = None,
    batch_size: int = 16,
    calib_hash: str = "",
    builtin_n: int = 500,
    task_dir: str | Path | None = None,
    include_paths: Sequence[str | Path] = (),
    task_ident: Mapping[str, dict] | None = None,
    backend: str = "quantdyn",
    progress: bool = False,
) -> list[dict]:
    """Accuracy rows for one checkpoint: its full-precision model and already quantized copies.

    ``fp_model`` / ``q_models`` values are nn.Modules (wrapped in QuantdynLM
    with ``tokenizer``) or ready lm-eval ``LM`` objects.  ``base`` holds the
    point's fields (the sweep's ``point_fields``: checkpoint_hash, step, ...);
    ``quant_configs`` maps each label to its QuantConfig (for the row identity).
    ``tasks`` is a list of names or the ``{name: Task}`` of :func:`prepare_tasks`.
    With no ``q_models`` the rows hold the full-precision accuracy only.

    Each row: kind "accuracy", task, task_version, metric, n, acc_fp(_se),
    acc_q(_se), acc_drop = acc_fp - acc_q with its paired SE over examples,
    num_fewshot, limit, seed, quantizer fields, checkpoint_hash, provenance,
    and a ``key`` = hash(checkpoint, task and version, task data, few-shot,
    limit, seed, quantizer config, calibration, metric, backend).
    """
    base = dict(base or {})
    if "checkpoint_hash" not in base:
        base["checkpoint_hash"] = state_hash(fp_model) if isinstance(fp_model, nn.Module) else "unknown"
    if isinstance(tasks, Mapping):
        loaded, ident = dict(tasks), dict(task_ident or {})
    else:
        loaded, ident = prepare_tasks(tasks, data=data, seed=seed, builtin_n=builtin_n, task_dir=task_dir,
                                      include_paths=include_paths)
        ident.update(task_ident or {})
    quant_configs = dict(quant_configs or {})

    def as_lm(m):
        if isinstance(m, nn.Module):
            return make_lm(m, tokenizer, batch_size=batch_size, progress=progress)
        return m

    fp = run_tasks(as_lm(fp_model), loaded, num_fewshot=num_fewshot, limit=limit, seed=seed, quiet=not progress)
    qs = {label: run_tasks(as_lm(m), loaded, num_fewshot=num_fewshot, limit=limit, seed=seed, quiet=not progress)
          for label, m in q_models.items()}
    prov = provenance()
    rows = []
    for task in loaded:
        m, v_fp, agg_fp = per_example(fp, task, metric)
        version = fp.get("versions", {}).get(task)
        ids = sorted(v_fp)
        acc_fp, se_fp = mean_se([v_fp[i] for i in ids])
        common = {
            "kind": ACCURACY.name, **base, "task": task, "task_version": version, **ident.get(task, {}),
            "metric": m, "n": len(ids), "num_fewshot": num_fewshot, "limit": limit, "seed": seed,
            "backend": backend, "lm_eval_version": _lm_eval_version(),
            "acc_fp": acc_fp, "acc_fp_se": se_fp, "metrics_fp": agg_fp, "calib_hash": calib_hash or None,
        }
        labels = list(qs) or [None]
        for label in labels:
            qc = quant_configs.get(label) if label else None
            qf = _quant_fields(label, qc) if label else _quant_fields(None, None)
            qhash = (qf.get("quant_config_hash") or str(label)) if label else "fp"
            row = {**common, **qf}
            if label is not None:
                m_q, v_q, agg_q = per_example(qs[label], task, m)
                if sorted(v_q) != ids:
                    raise QuantdynError(f"task '{task}': the quantized run saw other examples than the FP run")
                acc_q, se_q = mean_se([v_q[i] for i in ids])
                drop, se_drop = mean_se([v_fp[i] - v_q[i] for i in ids])
                row.update(acc_q=acc_q, acc_q_se=se_q, acc_drop=drop, acc_drop_se=se_drop, metrics_q=agg_q)
            else:
                row.update(acc_q=None, acc_q_se=None, acc_drop=None, acc_drop_se=None)
            row["key"] = accuracy_row_key(base["checkpoint_hash"], task, version, ident.get(task, {}), num_fewshot,
                                          limit, seed, qhash, calib_hash if label else "", m, backend)
            rows.append({"key": row.pop("key"), **row, **prov})
    return rows


# --------------------------------------------------------------------------- the library entry point
def _ref_hash(ref: str) -> str:
    # the checkpoint hash of the sweep's rows, so accuracy rows join with ptq rows
    return checkpoint_hash(ref.split("@")[0] if Path(ref.split("@")[0]).is_dir() else ref)


# --------------------------------------------------------------------------- printing
def _pct(v) -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{100 * v:6.2f}"


def format_accuracy_table(rows: Iterable[dict]) -> str:
    """The table ``quantdyn eval`` prints: one line per (task, quantizer), accuracies in %.

    Columns: task, metric, n, quantizer, FP, quantized, drop (FP − quantized)
    with its paired standard error; FP-only rows leave the last ones blank.
    """
    rows = ACCURACY.select(rows)
    if not rows:
        return "(no accuracy rows)"
    header = ("task", "metric", "n", "shots", "quantizer", "FP %", "quant %", "drop %", "± se")
    lines = []
    for r in sorted(rows, key=lambda r: (r["task"], str(r.get("quantizer") or ""))):
        lines.append((
            str(r["task"]), str(r["metric"]), str(r["n"]), str(r.get("num_fewshot", "")),
            str(r.get("quantizer") or "—"), _pct(r.get("acc_fp")), _pct(r.get("acc_q")),
            _pct(r.get("acc_drop")), _pct(r.get("acc_drop_se")),
        ))
    widths = [max(len(h), *(len(line[k].strip()) for line in lines)) for k, h in enumerate(header)]
    right = {2, 3, 5, 6, 7, 8}

    def fmt(cells):
        return "  ".join(c.strip().rjust(w) if k in right else c.strip().ljust(w)
                         for k, (c, w) in enumerate(zip(cells, widths))).rstrip()

    out = [fmt(header), fmt(["-" * w for w in widths])] + [fmt(line) for line in lines]
    if any(str(r["task"]).startswith("quantdyn_") for r in rows):
        out.append("quantdyn_* tasks are generated from the held-out split; they are not standard benchmarks.")
    return "\n".join(out)
