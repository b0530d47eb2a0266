"""A Measurement turned into result-row fields.

Every command that stores measurements builds its PTQ fields here, so a row means the same thing
whichever command wrote it; what each field means, the row keys (``row_key``) and the calibration
identity (``calib_hash``) live in :mod:`quantdyn.results.schema`:

* ``ptq_what`` — the ``what`` of a PTQ row's key (quantizer config, calibration set, repeats);
* ``calibration_draws`` / ``repeat_labels`` — the calibration sets and engine labels of R repeats;
* ``quantizer_fields`` / ``ptq_fields`` — what a PTQ row says about its quantizer, its error,
  its storage cost (``storage_fields``: bits per weight, GGUF fallbacks, a plan's per-tensor types; an ``auto@``
  quantizer's allocated plan) and how it was computed
  (batch size and threads while calibrating, timings, seconds per phase), and whether its Δ CE sits
  inside its checkpoint's noise floor;
* ``grid_fields`` — whether the checkpoint's weights already lie on a low-bit grid (``weight_grid_levels``,
  ``weight_grid``: analysis/grid.py), on every row of a measured checkpoint;
* ``floor_fields`` — the bf16 noise floor of a checkpoint as the fp row stores it (``floor_<field>``).
"""
from __future__ import annotations

import math
import statistics

import torch

from quantdyn.analysis.grid import grid_verdict
from quantdyn.config import config_hash
from quantdyn.engine.measure import MeasureConfig, Measurement
from quantdyn.errors import unknown_name
from quantdyn.quantize.catalogue import QuantConfig
from quantdyn.quantize.catalogue import row_fields as quantizer_fields
from quantdyn.results.schema import number
from quantdyn.results.stats import EVAL, combined_se, dominant, floor_difference, mean_se, within_noise_floor


REPEAT_VARY = ("draw", "order", "both")


def ptq_what(qc: QuantConfig, calib: str, repeats: int = 1, vary: str = "draw") -> str:
    """The ``what`` of a PTQ row's key (repeated quantizations are another measurement than a single one)."""
    return f"ptq:{config_hash(qc)}:{calib}" + (f":R{repeats}:{vary}" if repeats > 1 else "")


def repeat_labels(label: str, repeats: int) -> list[str]:
    """The engine labels of one quantizer's repeats (repeat 0 is the quantizer's own label)."""
    return [label] + [f"{label}#r{r}" for r in range(1, repeats)]


def calibration_draws(data, samples: int, seq_len: int, seed: int, repeats: int, vary: str = "draw") -> list:
    """The calibration set of each repeat: ``draw`` takes windows with seed + r, ``order`` keeps repeat 0's
    windows in a permuted order (seeded by r: only the float summation order changes), ``both`` does both.
    Repeat 0 is always the plain draw with ``seed``, so R = 1 is exactly the unrepeated measurement."""
    if vary not in REPEAT_VARY:
        raise unknown_name("repeat variation", vary, REPEAT_VARY)
    base = data.calib_windows(samples, seq_len, seed)
    out = [base]
    for r in range(1, repeats):
        ids = data.calib_windows(samples, seq_len, seed + r) if vary in ("draw", "both") else base
        if vary in ("order", "both"):
            ids = ids[torch.randperm(len(ids), generator=torch.Generator().manual_seed(r))]
        out.append(ids)
    return out


def _mean_of(values: list):
    """The mean over repeats of one error field: numbers averaged, lists of numbers averaged element by element
    (None where a repeat has none), anything else taken from the first repeat."""
    if all(number(v) is not None for v in values):
        return statistics.fmean(number(v) for v in values)
    if all(isinstance(v, list) for v in values) and len({len(v) for v in values}) == 1:
        return [_mean_of([v[i] for v in values]) for i in range(len(values[0]))]
    if any(v is None for v in values):
        return None
    return values[0]


def _combine_repeats(ms: list[dict]) -> dict:
    """One row's error fields from R repeats: means, the SD over repeats and the combined uncertainty (every
    other field, e.g. the KL percentiles and per-block maps, the mean over repeats)."""
    R = len(ms)
    wd = torch.tensor([m["window_delta"] for m in ms], dtype=torch.float64).mean(0)
    ce_fp = ms[0]["ce_fp"]
    dce = [m["delta_ce"] for m in ms]
    mean = statistics.fmean(dce)
    run_sd = statistics.stdev(dce)
    se = mean_se(wd)[1]
    ce_q = statistics.fmean(m["ce_q"] for m in ms)
    return {
        **{k: _mean_of([m.get(k) for m in ms]) for k in ms[0]},
        "ce_fp": ce_fp, "ce_q": ce_q, "delta_ce": mean, "delta_ce_se": se,
        "rel_delta_ce": mean / ce_fp if ce_fp else None,
        "delta_ppl": math.exp(ce_q) - math.exp(ce_fp),
        "kl": statistics.fmean(m["kl"] for m in ms), "kl_se": statistics.fmean(m["kl_se"] for m in ms),
        "top1_agree": statistics.fmean(m["top1_agree"] for m in ms), "n_windows": ms[0]["n_windows"],
        "window_delta": [round(float(v), 7) for v in wd],
        "delta_ce_repeats": dce, "delta_ce_run_sd": run_sd, "kl_run_sd": statistics.stdev(m["kl"] for m in ms),
        "quant_repeats": R, "delta_ce_total_se": combined_se(se, run_sd, R),
        "uncertainty_dominant": dominant(se, run_sd / math.sqrt(R)),
        **({"ppl_ratio": math.exp(mean), "ppl_ratio_se": math.exp(mean) * se, "n_tokens": ms[0]["n_tokens"]}
           if "ppl_ratio" in ms[0] else {}),
    }


def storage_fields(layer_rows: list[dict]) -> dict:
    """What the quantized layers cost to store: ``bits_per_weight`` (scales included, as each format stores them;
    weighted by the layers' sizes, the head too when it is quantized) and ``format_fallbacks`` (GGUF tensors whose
    rows did not fit their type and took llama.cpp's fallback: ``{layer: "q4_K->q5_0"}``, None if none)."""
    known = [(r["out_features"] * r["in_features"], r["bits_per_weight"]) for r in layer_rows
             if r.get("bits_per_weight") is not None and r.get("out_features") and r.get("in_features")]
    bpw = sum(n * b for n, b in known) / sum(n for n, _ in known) if known else None
    fallbacks = {r.get("layer"): f"{r['gguf_fallback_from']}->{r.get('gguf_type')}" for r in layer_rows
                 if r.get("gguf_fallback_from")}
    plan_types = {r.get("layer"): r["plan_type"] for r in layer_rows if r.get("plan_type")}
    return {"bits_per_weight": bpw, "format_fallbacks": fallbacks or None,
            **({"plan_types": plan_types} if plan_types else {})}


def grid_fields(m: Measurement) -> dict:
    """``weight_grid_levels`` (median over the quantizable tensors of their median distinct values per 32-weight
    block) and ``weight_grid`` ("4-bit grid", or None for float weights) of the measured checkpoint."""
    levels, verdict = grid_verdict(m.weight_levels)
    return {"weight_grid_levels": levels, "weight_grid": verdict}


def floor_fields(floor: dict | None) -> dict:
    """The bf16 noise floor of a checkpoint (``Measurement.noise_floor``) as the fp row stores it: every error
    field prefixed ``floor_`` (its CE(FP) is the row's own ce_fp, not repeated); {} without a floor."""
    if not floor:
        return {}
    return {(k if k.startswith("floor_") else f"floor_{k}"): v for k, v in floor.items() if k != "ce_fp"}


def ptq_fields(label: str, qc: QuantConfig, m: Measurement, cfg: MeasureConfig, threads: int, repeats: int = 1,
               vary: str = "draw", floor: dict | None = None) -> dict:
    """Quantizer, error metrics, per-layer loss total and how it was computed, for one quantizer of a measurement.

    With ``repeats`` R > 1 the measurement holds R variants of the quantizer (``repeat_labels``), each calibrated
    on its own draw (``calibration_draws``): the row gives the means over repeats, ``delta_ce_se`` of the
    per-window deltas averaged over repeats, ``delta_ce_run_sd`` (SD over repeats: what re-quantizing the
    same checkpoint changes), ``delta_ce_total_se`` = sqrt(delta_ce_se² + delta_ce_run_sd² / R) (the
    uncertainty of the reported mean) and which of the two dominates.

    ``within_noise_floor`` compares the row's Δ CE with the checkpoint's noise floor (``results/stats.py``):
    ``floor`` is the fp row's floor fields (``floor_fields``), by default those of ``m.noise_floor``; without a
    floor the verdict is None."""
    labels = repeat_labels(label, repeats)
    vs = [m.quantizations[x] for x in labels]
    losses = [r.get("loss") for r in vs[0].rows if r.get("loss") is not None]
    n_q = max(1, len(m.quantizations))
    if repeats > 1:
        errors = _combine_repeats([m.metrics[x] for x in labels])
    else:
        errors = {**m.metrics[label], "quant_repeats": 1, "delta_ce_run_sd": None,
                  "delta_ce_total_se": m.metrics[label]["delta_ce_se"], "uncertainty_dominant": EVAL}
    floor_row = floor if floor is not None else floor_fields(m.noise_floor)
    above = floor_difference(errors, floor_row)
    return {
        **quantizer_fields(label, qc),
        **errors,
        "within_noise_floor": within_noise_floor(errors, floor_row),
        "delta_ce_floor_z": number(above.z) if above is not None else None,
        **storage_fields(vs[0].rows),
        **grid_fields(m),
        **m.plans.get(label, {}),  # an auto@ quantizer: the plan it allocated on this checkpoint
        "repeat_vary": vary if repeats > 1 else None,
        "layer_loss_sum": float(sum(losses)) if losses else None,
        "n_calibration": vs[0].n_calibration,
        "t_quantize": sum(v.seconds for v in vs),
        "t_eval": m.t_eval * len(labels) / n_q,
        "eval_group": n_q,
        # where the time of the whole measurement (all eval_group quantizers together) went: t_read, t_convert,
        # t_capture, t_calib_forward, t_quantize_layers, t_diagnostics, t_eval_forward, t_head, t_total
        # (engine/phases.py)
        **{f"t_{phase}": seconds for phase, seconds in m.phase_seconds.items()},
        "calib_batch_size": cfg.calib_batch_size,
        "quantize_threads": threads,
        "compute_dtype": m.dtype,
    }
