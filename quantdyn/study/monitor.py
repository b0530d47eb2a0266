"""In-training quantization monitor.

With ``monitor: {every: N, quantizers: [rtn4, gptq3]}`` in a run config the
trainer calls :func:`monitor_quantization` every N steps: the streamed engine
(``quantdyn.measure``) quantizes the current weights with each quantizer —
one block copy at a time, the model itself untouched — calibrated and evaluated
on the run's cached calibration and validation shards, and Δ CE (± its paired
SE) lands in the run's metrics.jsonl as ``dce_<quantizer>`` / ``dce_<quantizer>_se``.
"""
from __future__ import annotations

import torch

from quantdyn.data.prepare import TokenData
from quantdyn.measure.engine import MeasureConfig, measure
from quantdyn.quantize.config import parse_quantizer


@torch.no_grad()
def monitor_quantization(model, data: TokenData, cfg, seq_len: int) -> dict:
    """Δ CE of each configured quantizer on the current weights (model is left untouched)."""
    eval_ids = data.eval_windows(seq_len, cfg.eval_windows)
    calib_ids = data.calib_windows(cfg.calib_samples, seq_len, seed=0)
    device = next(model.parameters()).device
    m = measure(model, {spec: parse_quantizer(spec) for spec in cfg.quantizers}, eval_ids, calib_ids,
                device=device, cfg=MeasureConfig(quantize_threads=0))
    out: dict = {}
    for spec, row in m.metrics.items():
        out[f"dce_{spec}"] = row["delta_ce"]
        out[f"dce_{spec}_se"] = row["delta_ce_se"]
    return out
