"""One model, one or more quantizers: what `quantdyn quantize` runs (through the streamed engine).

    res = quantize_one("runs/tiny/checkpoints/step-0000400", ["gptq3", "rtn4"], eval_tokens=8192)
    res.metrics["gptq3"]["delta_ce"], res.rows          # one result row per quantizer
    res = quantize_one(ref, "gptq4-gptqmodel", out="q4", export="gptq")
    res.out, res.row["export"]

Every quantizer is measured in one streamed pass (they share the full-precision forward). ``out`` writes
the quantized model of the one quantizer given: quantdyn's fake-quantized checkpoint with its codes, or with
``export`` a deployable GPTQ / compressed-tensors checkpoint. Errors speak in this function's terms; the
command line checks its own flags first.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from quantdyn.data.prepare import DataConfig, prepare_data
from quantdyn.engine.lazy_model import LazyModel, compute_dtype_of
from quantdyn.engine.measure import MeasureConfig, check_budget, measure
from quantdyn.engine.rows import calibration_draws, ptq_fields, repeat_labels
from quantdyn.engine.sensitivity import check_quantizers_fit
from quantdyn.engine.streams import parse_bytes
from quantdyn.engine.sinks import ExportSink, QuantizedCheckpointWriter, quantized_layer_shapes
from quantdyn.errors import QuantdynError
from quantdyn.export import push_to_hub as push
from quantdyn.export.layouts import fit_group_size
from quantdyn.models.hf_io import checkpoint_hash
from quantdyn.quantize.catalogue import QuantConfig, parse_quantizer, quant_preset
from quantdyn.quantize.residual_rotation import check_rotations
from quantdyn.results.schema import PTQ
from quantdyn.runs import resolve_run_reference
from quantdyn.runtime import git_sha, provenance, resolve_device
from quantdyn.sources.hub import open_checkpoint

QuantizerSpec = str | dict | QuantConfig

_SUMMARY = ("ce_fp", "ce_q", "delta_ce", "delta_ce_se", "delta_ce_total_se", "rel_delta_ce", "delta_ppl", "kl",
            "kl_se", "top1_agree", "n_windows", "quant_repeats", "delta_ce_run_sd")


@dataclass(frozen=True)
class QuantizeResult:
    """What :func:`quantize_one` measured and wrote."""

    rows: tuple[dict, ...]
    """One result row per quantizer, in the order given (the rows `quantdyn quantize --json` prints)."""
    out: Path | None = None
    """The directory the quantized model was written to (None: nothing written)."""

    @property
    def row(self) -> dict:
        """The row of the one quantizer measured (several: use :attr:`rows` or :attr:`metrics`)."""
        if len(self.rows) != 1:
            raise QuantdynError(f"{len(self.rows)} quantizers were measured; read .rows or .metrics[label]")
        return self.rows[0]

    @property
    def metrics(self) -> dict[str, dict]:
        """Per quantizer label: Δ CE ± SE (paired over windows; total SE with repeats), relative Δ CE, Δ PPL,
        KL ± SE, top-1 agreement, CE of FP and quantized, windows."""
        return {r["quantizer"]: {k: r.get(k) for k in _SUMMARY} for r in self.rows}

    def __getitem__(self, key: str) -> Any:  # quantize_checkpoint returned the row itself before 0.2
        warnings.warn("quantize_checkpoint returns a QuantizeResult: read result.row[key] (or .metrics[label])",
                      DeprecationWarning, stacklevel=2)
        return self.row[key]


_OLD_KEYWORDS = {"n_calib_samples": "calib_samples", "n_eval_tokens": "eval_tokens", "save": "out"}
"""Old keyword -> its name now: n_calib_samples and n_eval_tokens (an earlier spelling) are now spelt as the config
files and the command line spell these sizes (one spelling per size); save is out."""
_QUANTIZER_KEYWORDS = ("method", "bits", "group_size", "preset")
_MEASURE_KEYWORDS = {"threads": "quantize_threads", "dtype": "dtype", "max_memory": "max_memory"}


def _renamed(old: dict[str, Any], kwargs: dict[str, Any], quantizers, measure_cfg):
    """The old keywords of quantize_one, each with a DeprecationWarning naming its new spelling."""
    defaults = {"calib_samples": 32, "eval_tokens": 25600, "out": None}
    for name, value in old.items():
        if name in _OLD_KEYWORDS:
            new = _OLD_KEYWORDS[name]
            if kwargs[new] != defaults[new]:
                raise QuantdynError(f"give {new}= only ({name}= is its old name)")
            warnings.warn(f"quantize_checkpoint({name}=...) is now {new}=...", DeprecationWarning, stacklevel=3)
            kwargs[new] = value
        elif name not in (*_QUANTIZER_KEYWORDS, *_MEASURE_KEYWORDS):
            raise TypeError(f"quantize_checkpoint() got an unexpected keyword argument '{name}'")
    loose = {k: old[k] for k in _QUANTIZER_KEYWORDS if k in old}
    if loose:
        if quantizers is not None:
            raise QuantdynError(f"give the quantizer once: quantizers=..., or {', '.join(loose)} (deprecated)")
        preset = loose.pop("preset", None)
        fields = {"method": "gptq", "bits": 4, "group_size": 128, **loose}
        qc = quant_preset(preset, **fields) if preset else parse_quantizer(fields)
        warnings.warn(f"quantize_checkpoint({', '.join(f'{k}=' for k in old if k in _QUANTIZER_KEYWORDS)}...) is "
                      f"now quantizers='{qc.name}' (a label or a QuantConfig)", DeprecationWarning, stacklevel=3)
        quantizers = qc
    engine = {_MEASURE_KEYWORDS[k]: old[k] for k in _MEASURE_KEYWORDS if k in old}
    if engine:
        warnings.warn(f"quantize_checkpoint({', '.join(f'{k}=' for k in old if k in _MEASURE_KEYWORDS)}...) is now "
                      "measure_cfg=MeasureConfig(quantize_threads=..., dtype=..., max_memory=...)",
                      DeprecationWarning, stacklevel=3)
        measure_cfg = replace(measure_cfg or MeasureConfig(), **engine)
    return quantizers, measure_cfg


def _configs(quantizers: QuantizerSpec | Sequence[QuantizerSpec]) -> list[QuantConfig]:
    specs = [quantizers] if isinstance(quantizers, (str, dict, QuantConfig)) else list(quantizers)
    qcs = [parse_quantizer(q) for q in specs]
    if not qcs:
        raise QuantdynError("no quantizer given; e.g. quantizers='gptq4' or ['gptq3', 'rtn4']")
    seen: dict[str, QuantConfig] = {}
    for spec, qc in zip(specs, qcs):
        if qc.name in seen:
            raise QuantdynError(f"quantizer '{spec}' is given twice (as '{qc.name}'); list each once")
        seen[qc.name] = qc
    return qcs


PARAMETERS = {"quantizers": "quantizers", "out": "out", "export": "export", "export_options": "export_options",
              "push_to_hub": "push_to_hub", "repeats": "repeats", "eval_tokens": "eval_tokens",
              "eval_seq_len": "eval_seq_len", "calib_samples": "calib_samples"}
"""How :func:`check_request` names the parameters in its errors (the command line passes its flags instead)."""


def check_request(qcs: Sequence[QuantConfig], *, out, export, export_options, push_to_hub, repeats: int,
                  eval_tokens: int, eval_seq_len: int, calib_samples: int,
                  names: Mapping[str, str] = PARAMETERS) -> None:
    """What :func:`quantize_one` refuses before any work, each error one line naming the parameters as
    ``names`` says."""
    n = {**PARAMETERS, **names}
    if out is not None and len(qcs) > 1:
        raise QuantdynError(f"{n['out']} writes the model of one quantizer, but {len(qcs)} are given "
                            f"({', '.join(q.name for q in qcs)}); give one in {n['quantizers']}")
    if (export or push_to_hub) and out is None:
        raise QuantdynError(f"{n['export']} and {n['push_to_hub']} need {n['out']}, the directory to write the "
                            "checkpoint to")
    if export_options and not export:
        raise QuantdynError(f"{n['export_options']} sets options of an export format: add {n['export']} gptq or "
                            "compressed-tensors")
    if push_to_hub and not export:
        raise QuantdynError(f"{n['push_to_hub']} uploads an export: add {n['export']} gptq or compressed-tensors")
    if repeats < 1:
        raise QuantdynError(f"{n['repeats']} {repeats} must be >= 1")
    if eval_tokens < eval_seq_len:
        raise QuantdynError(f"{n['eval_tokens']} {eval_tokens} is less than one window of "
                            f"{n['eval_seq_len']} {eval_seq_len}")
    if calib_samples < 1:
        raise QuantdynError(f"{n['calib_samples']} {calib_samples} must be >= 1 (the calibration set is empty)")
    if out is not None and any(q.r1 for q in qcs):
        raise QuantdynError(f"{n['out']} does not write +r1 models: a measurement rotates each block's copy, and a "
                            f"written checkpoint would need its embedding, norms and head rotated too; measure +r1 "
                            f"without {n['out']} (quantize/residual_rotation.rotate_model rotates a model in memory)")


def quantize_one(
    model_ref: str,
    quantizers: QuantizerSpec | Sequence[QuantizerSpec] | None = None,
    *,
    calib_data: str = "builtin:kjv",
    calib_samples: int = 32,
    calib_seq_len: int = 128,
    eval_data: str | None = None,
    eval_tokens: int = 25600,
    eval_seq_len: int = 128,
    tokenizer: str | None = None,
    out: str | Path | None = None,
    export: str | None = None,
    export_options: Mapping[str, str] | None = None,
    push_to_hub: str | None = None,
    device: str = "auto",
    measure_cfg: MeasureConfig | None = None,
    repeats: int = 1,
    repeat_vary: str = "draw",
    progress: bool = True,
    echo: Callable[[str], None] | None = None,
    fit_group: bool = False,
    **old: Any,
) -> QuantizeResult:
    """Quantize ``model_ref`` (checkpoint directory or hub ``ID[@REV]``) with each of ``quantizers`` (a label
    such as ``"gptq4"`` or ``"gptq4-gptqmodel"``, a QuantConfig, or a list of them; default gptq4) and measure
    Δ CE, KL and agreement on held-out text, all in one streamed pass.

    Data: ``calib_samples`` calibration sequences of ``calib_seq_len`` tokens from ``calib_data`` (any quantdyn
    data source); ``eval_tokens`` held-out tokens of ``eval_data`` (default: the calibration source's
    validation split) in windows of ``eval_seq_len`` tokens; ``tokenizer`` defaults to the model's own.
    ``repeats`` R > 1 quantizes R times per quantizer (calibration draw r: engine/rows.calibration_draws) and
    reports the mean, the SD over repeats and the combined uncertainty.

    ``out``: write the quantized model of the one quantizer given there (streamed; repeat 0): quantdyn's
    fake-quantized checkpoint with codes, or with ``export`` ('gptq' or 'compressed-tensors') a deployable
    checkpoint in that format (what the format cannot hold is refused before any work), uploaded to
    ``push_to_hub`` (a repo id) when given; ``export_options`` are the format's options (GPTQ: checkpoint_format
    gptq | gptq_v2, scale_dtype; compressed-tensors: scale_dtype). ``measure_cfg``: the engine's dtype, memory
    budget and CPU threads (default: threads 1, the checkpoint's dtype, automatic memory). ``progress``: lines
    while preparing data; ``echo``: where a line per decoder block goes. ``fit_group``: the first quantizer's group
    size was not chosen by the user (a label that does not spell it, e.g. gptq4), so a compressed-tensors export
    takes the largest group size up to it that divides every layer's input width (576-wide models: 64) instead of
    refusing; the row's quantizer is then that label (gptq4g64) and ``row["export"]["fitted"]`` says why.

    Old keywords (method, bits, group_size, preset, save, threads, dtype, max_memory; later
    n_calib_samples, n_eval_tokens) still work, each with a DeprecationWarning naming its new spelling."""
    if old:
        kw = {"calib_samples": calib_samples, "eval_tokens": eval_tokens, "out": out}
        quantizers, measure_cfg = _renamed(old, kw, quantizers, measure_cfg)
        calib_samples, eval_tokens, out = kw["calib_samples"], kw["eval_tokens"], kw["out"]
    qcs = _configs("gptq4" if quantizers is None else quantizers)
    cfg = measure_cfg or MeasureConfig()
    out = Path(out) if out is not None else None
    check_request(qcs, out=out, export=export, export_options=export_options, push_to_hub=push_to_hub,
                  repeats=repeats, eval_tokens=eval_tokens, eval_seq_len=eval_seq_len,
                  calib_samples=calib_samples)
    dev = resolve_device(device)
    model_ref = resolve_run_reference(model_ref)  # RUN@latest -> its checkpoint, named so in the rows
    weights = open_checkpoint(model_ref)  # validated before any data is prepared
    source = LazyModel(weights, compute_dtype_of(cfg.dtype), dev)
    check_rotations(source.model, qcs)  # +had widths, +r1 architectures: before any data is prepared
    check_budget(source, parse_bytes(cfg.max_memory))  # a budget too small for the model: refused before the data
    check_quantizers_fit(qcs, source)  # a plan made for another model, an auto@ budget out of reach: before any work
    # the writer first: what an export cannot hold is refused before any data is tokenized
    writer = None
    fitted = None
    if out is not None and export == "compressed-tensors" and fit_group:  # a group size the user did not choose
        shapes = quantized_layer_shapes(source)
        fit = fit_group_size(qcs[0], shapes)
        if fit != qcs[0]:
            widths = sorted({i for _, i in shapes.values()})
            fitted = (f"group size {fit.group_size or 'per channel'}, the largest that divides every input width "
                      f"({', '.join(map(str, widths))}; {qcs[0].group_size} does not): {fit.name}")
            qcs = [fit, *qcs[1:]]
    if out is not None and export:
        writer = ExportSink(export, out, source, qcs[0], qcs[0].name, **dict(export_options or {}))
    elif out is not None:
        writer = QuantizedCheckpointWriter(out, source, qcs[0], qcs[0].name, weights.config.get("model_type", "?"))
    try:
        tok = tokenizer or (str(weights.path) if Path(model_ref).is_dir() else model_ref)
        calib = prepare_data(DataConfig(source=calib_data, tokenizer=tok), progress=progress)
        evald = calib if not eval_data or eval_data == calib_data else prepare_data(
            DataConfig(source=eval_data, tokenizer=tok), progress=progress)
        vocab = weights.config.get("vocab_size")
        if vocab is not None and calib.vocab_size > int(vocab):
            raise QuantdynError(f"tokenizer '{tok}' has {calib.vocab_size} tokens but the model only {vocab}; use "
                                "the model's own tokenizer")
        draws = calibration_draws(calib, calib_samples, calib_seq_len, 0, repeats, repeat_vary)
        variants: dict[str, QuantConfig] = {}
        calib_of: dict[str, Any] = {}
        for qc in qcs:
            for label, ids in zip(repeat_labels(qc.name, repeats), draws):
                variants[label], calib_of[label] = qc, ids
        n_windows = eval_tokens // eval_seq_len
        eval_windows = evald.eval_windows(eval_seq_len, n_windows)
        m = measure(source, variants, eval_windows, calib_of, device=dev, cfg=cfg, on_layer=writer,
                    on_block=echo if progress else None)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    threads = cfg.quantize_threads if dev.type == "cpu" else 0
    ckpt_hash = checkpoint_hash(str(weights.path)) if Path(model_ref).is_dir() else checkpoint_hash(model_ref)
    rows = []
    for qc in qcs:
        v = m.quantizations[qc.name]
        rows.append({
            "kind": PTQ.name, "checkpoint": model_ref, "checkpoint_hash": ckpt_hash,
            **ptq_fields(qc.name, qc, m, cfg, threads, repeats, repeat_vary),
            "calib_data": calib_data, "calib_samples": calib_samples, "calib_seq_len": calib_seq_len,
            "eval_data": eval_data or calib_data, "eval_hash": evald.token_hash("val", eval_seq_len, n_windows),
            "data_key": calib.data_hash, "streams": m.streams,
            "layers": [{k: val for k, val in r.items() if isinstance(val, (int, float, str))} for r in v.rows],
            **provenance(),
        })
    if writer is not None and export:
        rows[0]["export"] = {"format": export, "path": str(writer.close()), **({"fitted": fitted} if fitted else {})}
        if push_to_hub:
            rows[0]["export"]["hub"] = push(out, push_to_hub)
    elif writer is not None:
        v = m.quantizations[qcs[0].name]
        losses = [r["loss"] for r in v.rows if r.get("loss") is not None]
        errs = [r["output_error"] for r in v.rows if r.get("output_error") is not None]
        summary = dict(quantizer=qcs[0].name, layers=len(v.rows), seconds=v.seconds,
                       output_error=float(sum(errs)) if errs else None, loss=float(sum(losses)) if losses else None,
                       n_calibration=v.n_calibration)
        writer.close(v.rows, summary, git_sha())
    return QuantizeResult(tuple(rows), out)
