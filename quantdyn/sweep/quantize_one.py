"""One model, one quantizer: what `quantdyn quantize` runs (through the streamed engine)."""
from __future__ import annotations

from pathlib import Path

from quantdyn.data.prepare import DataConfig, prepare_data
from quantdyn.engine.lazy_model import LazyModel, compute_dtype_of
from quantdyn.engine.measure import MeasureConfig, measure
from quantdyn.engine.rows import calibration_draws, ptq_fields, repeat_labels
from quantdyn.engine.writer import ExportSink, QuantizedCheckpointWriter
from quantdyn.errors import QuantdynError
from quantdyn.export import push_to_hub as push
from quantdyn.models.hf_io import checkpoint_hash
from quantdyn.quantize.config import parse_quantizer, quant_preset
from quantdyn.runtime import git_sha, provenance, resolve_device
from quantdyn.sources.hub import open_checkpoint


def quantize_one(
    model_ref: str, *, method: str = "gptq", bits: int = 4, group_size: int = 128, preset: str | None = None,
    calib_data: str = "builtin:kjv", calib_samples: int = 32, calib_seq_len: int = 128,
    eval_data: str | None = None, eval_tokens: int = 25600, eval_seq_len: int = 128,
    tokenizer: str | None = None, save: Path | None = None, device: str = "auto", progress: bool = True,
    threads: int = 1, dtype: str = "auto", max_memory: str = "", repeats: int = 1, repeat_vary: str = "draw",
    export: str | None = None, push_to_hub: str | None = None, echo=None,
    export_options: dict | None = None,
) -> dict:
    """Quantize ``model_ref`` (checkpoint directory or hub ``ID[@REV]``) and measure Δ CE, KL and agreement on
    held-out text; with ``save`` also write the fake-quantized checkpoint and its codes there (streamed).
    ``repeats`` R > 1 quantizes R times (calibration draw r: see measure.rows.calibration_draws) and reports the
    mean, the SD over repeats and the combined uncertainty; ``save`` keeps repeat 0. With ``export`` ('gptq' or
    'compressed-tensors') ``save`` receives a deployable checkpoint in that format instead (streamed too; what the
    format cannot hold is refused before any work), uploaded to ``push_to_hub`` (a repo id) when given; ``export_options`` are the format's options
    (GPTQ: checkpoint_format gptq | gptq_v2, scale_dtype; compressed-tensors: scale_dtype)."""

    base = {"method": method, "bits": bits, "group_size": group_size}
    qc = quant_preset(preset, **base) if preset else parse_quantizer(base)
    dev = resolve_device(device)
    if (export or push_to_hub) and save is None:
        raise QuantdynError("--export and --push-to-hub need --out DIR for the exported checkpoint")
    if export_options and not export:
        raise QuantdynError("--export-option sets an option of an export: add --export gptq|compressed-tensors")
    if push_to_hub and not export:
        raise QuantdynError("--push-to-hub uploads an export: add --export gptq|compressed-tensors")
    if repeats < 1:
        raise QuantdynError(f"--repeats {repeats} must be >= 1")
    if eval_tokens < eval_seq_len:
        raise QuantdynError(f"--eval-tokens {eval_tokens} is less than one window of --eval-seq-len {eval_seq_len}")
    weights = open_checkpoint(model_ref)  # validated before any data is prepared
    source = LazyModel(weights, compute_dtype_of(dtype))
    tok = tokenizer or (str(weights.path) if Path(model_ref).is_dir() else model_ref)
    calib = prepare_data(DataConfig(source=calib_data, tokenizer=tok), progress=progress)
    evald = calib if not eval_data or eval_data == calib_data else prepare_data(
        DataConfig(source=eval_data, tokenizer=tok), progress=progress)
    vocab = weights.config.get("vocab_size")
    if vocab is not None and calib.vocab_size > int(vocab):
        raise QuantdynError(
            f"tokenizer '{tok}' has {calib.vocab_size} tokens but the model only {vocab}; pass the model's own "
            "tokenizer with --tokenizer"
        )
    draws = calibration_draws(calib, calib_samples, calib_seq_len, 0, repeats, repeat_vary)
    labels = repeat_labels(qc.name, repeats)
    n_windows = eval_tokens // eval_seq_len
    eval_ids = evald.eval_windows(eval_seq_len, n_windows)
    cfg = MeasureConfig(quantize_threads=threads, dtype=dtype, max_memory=max_memory)
    writer = None
    if save is not None and export:
        writer = ExportSink(export, save, source, qc, qc.name, **(export_options or {}))
    elif save is not None:
        writer = QuantizedCheckpointWriter(save, source, qc, qc.name, weights.config.get("model_type", "?"))
    try:
        m = measure(source, {label: qc for label in labels}, eval_ids, dict(zip(labels, draws)), device=dev, cfg=cfg,
                    on_layer=writer,
                    progress=(echo if progress and echo else None))
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    v = m.quantizations[qc.name]
    row = {
        "kind": "ptq", "checkpoint": model_ref,
        "checkpoint_hash": checkpoint_hash(str(weights.path)) if Path(model_ref).is_dir() else checkpoint_hash(model_ref),
        **ptq_fields(qc.name, qc, m, cfg, threads if dev.type == "cpu" else 0, repeats, repeat_vary),
        "calib_data": calib_data, "calib_samples": calib_samples, "calib_seq_len": calib_seq_len,
        "eval_data": eval_data or calib_data, "eval_hash": evald.token_hash("val", eval_seq_len, n_windows),
        "data_key": calib.data_hash, "streams": m.streams,
        "layers": [{k: val for k, val in r.items() if isinstance(val, (int, float, str))} for r in v.rows],
        **provenance(),
    }
    if writer is not None and export:
        row["export"] = {"format": export, "path": str(writer.close())}
        if push_to_hub:
            row["export"]["hub"] = push(save, push_to_hub)
    elif writer is not None:
        losses = [r["loss"] for r in v.rows if r.get("loss") is not None]
        errs = [r["output_error"] for r in v.rows if r.get("output_error") is not None]
        summary = dict(quantizer=qc.name, layers=len(v.rows), seconds=v.seconds,
                       output_error=float(sum(errs)) if errs else None, loss=float(sum(losses)) if losses else None,
                       n_calibration=v.n_calibration)
        writer.close(v.rows, summary, git_sha())
    return row
