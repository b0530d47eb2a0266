"""One model, one quantizer: what `quantdyn quantize` runs."""
from __future__ import annotations

import copy
import time
from pathlib import Path

import torch

from quantdyn.config import config_hash, to_dict
from quantdyn.data.prepare import DataConfig, prepare_data
from quantdyn.errors import QuantdynError
from quantdyn.runtime import resolve_device
from quantdyn.runtime import provenance
from quantdyn.models.hf_io import checkpoint_hash


def quantize_one(
    model_ref: str, *, method: str = "gptq", bits: int = 4, group_size: int = 128, preset: str | None = None,
    calib_data: str = "builtin:kjv", calib_samples: int = 32, calib_seq_len: int = 128,
    eval_data: str | None = None, eval_tokens: int = 25600, eval_seq_len: int = 128,
    tokenizer: str | None = None, save: Path | None = None, device: str = "auto", progress: bool = True,
    threads: int = 1,
) -> dict:
    from quantdyn.evaluate.quant_error import compare_models
    from quantdyn.models.hf_io import load_causal_lm
    from quantdyn.quantize.apply import num_threads, quantize_model, save_quantized
    from quantdyn.quantize.config import parse_quantizer, quant_preset

    base = {"method": method, "bits": bits, "group_size": group_size}
    qc = quant_preset(preset, **base) if preset else parse_quantizer(base)
    dev = resolve_device(device)
    if eval_tokens < eval_seq_len:
        raise QuantdynError(f"--eval-tokens {eval_tokens} is less than one window of --eval-seq-len {eval_seq_len}")
    model = load_causal_lm(model_ref, device=dev)
    tok = tokenizer or model_ref.split("@")[0]
    calib = prepare_data(DataConfig(source=calib_data, tokenizer=tok), progress=progress)
    evald = calib if not eval_data or eval_data == calib_data else prepare_data(
        DataConfig(source=eval_data, tokenizer=tok), progress=progress)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is not None and calib.vocab_size > vocab:
        raise QuantdynError(
            f"tokenizer '{tok}' has {calib.vocab_size} tokens but the model only {vocab}; pass the model's own "
            "tokenizer with --tokenizer"
        )
    calib_ids = calib.calib_windows(calib_samples, calib_seq_len)
    eval_ids = evald.eval_windows(eval_seq_len, eval_tokens // eval_seq_len)
    qmodel = copy.deepcopy(model)
    t0 = time.perf_counter()
    with num_threads(threads if dev.type == "cpu" else torch.get_num_threads()):
        res = quantize_model(qmodel, calib_ids, qc, device=dev, progress=progress)
    t_q = time.perf_counter() - t0
    m = compare_models(model, qmodel, eval_ids)
    row = {
        "kind": "ptq", "checkpoint": model_ref, "checkpoint_hash": checkpoint_hash(model_ref.split("@")[0])
        if Path(model_ref).is_dir() else checkpoint_hash(model_ref),
        "quantizer": qc.name, "method": qc.method, "bits": qc.bits, "group_size": qc.group_size,
        "quant_config": to_dict(qc), "quant_config_hash": config_hash(qc),
        "calib_data": calib_data, "calib_samples": calib_samples, "calib_seq_len": calib_seq_len,
        "eval_data": eval_data or calib_data, "eval_hash": evald.token_hash("val", eval_seq_len, eval_tokens // eval_seq_len),
        "data_key": calib.data_hash, **m, "t_quantize": t_q,
        "layers": [{k: v for k, v in r.items() if isinstance(v, (int, float, str))} for r in getattr(res, "rows", [])],
        **provenance(),
    }
    if save is not None:
        save_quantized(qmodel, res, qc, save)
        if hasattr(calib.tokenizer, "save_pretrained"):
            calib.tokenizer.save_pretrained(str(save))
    return row
