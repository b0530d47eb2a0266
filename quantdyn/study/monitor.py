"""In-training quantization monitor.

With ``monitor: {every: N, quantizers: [rtn4, gptq3]}`` in a run config the
trainer calls :func:`monitor_quantization` every N steps: each quantizer runs
on a copy of the current weights, calibrated and evaluated on the run's
cached calibration and validation shards, and Δ CE (± its paired SE) lands in
the run's metrics.jsonl as ``dce_<quantizer>`` / ``dce_<quantizer>_se``.
"""
from __future__ import annotations

import copy

import torch

from quantdyn.data.prepare import TokenData
from quantdyn.evaluate.loss import window_losses
from quantdyn.evaluate.quant_error import compare_many
from quantdyn.quantize.apply import quantize_model
from quantdyn.quantize.config import parse_quantizer


@torch.no_grad()
def monitor_quantization(model, data: TokenData, cfg, seq_len: int) -> dict:
    """Δ CE of each configured quantizer on the current weights (model is left untouched)."""
    eval_ids = data.eval_windows(seq_len, cfg.eval_windows)
    calib_ids = data.calib_windows(cfg.calib_samples, seq_len, seed=0)
    was_training = model.training
    fp_ce = window_losses(model, eval_ids)
    qmodels = {}
    for spec in cfg.quantizers:
        qmodels[spec] = copy.deepcopy(model)
        quantize_model(qmodels[spec], calib_ids, parse_quantizer(spec), progress=False)
    metrics = compare_many(model, qmodels, eval_ids, fp_window_ce=fp_ce)
    out: dict = {}
    for spec, m in metrics.items():
        out[f"dce_{spec}"] = m["delta_ce"]
        out[f"dce_{spec}_se"] = m["delta_ce_se"]
    model.train(was_training)
    return out
