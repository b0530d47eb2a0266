"""Linear interpolation between two checkpoints, with FP loss and the PTQ error at every point
(paper A: do the weights between a stable-phase and a decayed checkpoint quantize better?).

θ(α) = (1-α)·θ_A + α·θ_B is written as a checkpoint per α (``train/offline_averaging.py``),
then measured like any sweep point by the streamed engine (``quantdyn.engine.measure``): every
quantizer against full precision on the same held-out windows, with keys, so a rerun adds
only what is missing.
"""
from __future__ import annotations

import warnings

from pathlib import Path
from typing import Sequence

from quantdyn.engine.measure import MeasureConfig, measure
from quantdyn.engine.rows import ptq_fields, ptq_what
from quantdyn.errors import QuantdynError
from quantdyn.models.hf_io import checkpoint_hash
from quantdyn.quantize.catalogue import parse_quantizer
from quantdyn.results.schema import calib_hash as calib_identity
from quantdyn.results.schema import INTERPOLATION, row_key
from quantdyn.results.stats import mean_se
from quantdyn.runs import RunDir, alpha_name, in_checkpoints, interpolation_name
from quantdyn.runtime import provenance, resolve_device
from quantdyn.train.offline_averaging import (
    _as_ckpt,
    _model_limit,
    _token_data,
    endpoint_states,
    interpolation_run,
    write_interpolation,
)


def alpha_grid(steps: int) -> list[float]:
    """``steps`` evenly spaced α from 0 to 1 inclusive (steps >= 2)."""
    if steps < 2:
        raise QuantdynError(f"--steps {steps}: an interpolation needs at least 2 points (α = 0 and 1)")
    return [i / (steps - 1) for i in range(steps)]


def default_out(a: Path, b: Path) -> Path:
    """RUN_DIR/averages/interp-A-B for A in RUN_DIR/checkpoints/ (B named with its run when elsewhere)."""
    run = in_checkpoints(a)
    if run is None:
        raise QuantdynError(f"'{a}' is not inside a run's checkpoints/ directory; pass out=DIR for the interpolated models")
    return RunDir(run).average_dir(interpolation_name(a, b))


def interpolate_checkpoints(
    a: str | Path,
    b: str | Path,
    steps: int = 11,
    quantizers: Sequence[str] = ("rtn4",),
    *,
    out: str | Path | None = None,
    alphas: Sequence[float] | None = None,
    data=None,
    eval_seq_len: int = 128,
    eval_windows: int = 200,
    calib_samples: int = 32,
    calib_seq_len: int = 128,
    calib_seed: int = 0,
    batch_size: int = 16,
    device: str = "auto",
    quantize_threads: int = 1,
    progress: bool = False,
    n_eval_windows: int | None = None,
) -> list[dict]:
    """θ(α) = (1-α)·θ_A + α·θ_B at ``steps`` evenly spaced α in [0, 1] (or ``alphas``).

    Each θ(α) is written to ``OUT/alpha-A.AAAA`` (kind "interpolation", alpha and both endpoints in
    its metadata; OUT defaults to RUN_DIR/averages/interp-A-B when A is a run's checkpoint, so
    sweeps of that run visit the points). Returns one row per (α, quantizer): alpha, checkpoint,
    ce_fp (+ ce_fp_se) and the engine's Δ CE, KL, agreement (one FP row per α when ``quantizers``
    is empty). Eval/calibration windows come from ``data`` (a DataConfig) or from A's run data
    (validation split for evaluation, calibration split for PTQ). ``n_eval_windows`` is the old spelling of
    ``eval_windows`` (a DeprecationWarning).
    """
    if n_eval_windows is not None:
        warnings.warn("interpolate_checkpoints(n_eval_windows=...) is now eval_windows=...", DeprecationWarning,
                      stacklevel=2)
        eval_windows = n_eval_windows
    a, b = _as_ckpt(a), _as_ckpt(b)
    qcfgs = {(q if isinstance(q, str) else parse_quantizer(q).name): parse_quantizer(q) for q in quantizers}
    grid = [float(x) for x in alphas] if alphas is not None else alpha_grid(steps)
    if not grid:
        raise QuantdynError("no α values to interpolate at")
    if len({f"{x:.4f}" for x in grid}) != len(grid):
        raise QuantdynError(f"α values {grid} repeat at 4 decimals; give distinct values")
    out = Path(out) if out is not None else default_out(a, b)
    limit = _model_limit(a)
    if limit is not None and max(eval_seq_len, calib_seq_len) > limit:
        raise QuantdynError(
            f"eval/calibration sequence length {max(eval_seq_len, calib_seq_len)} exceeds the model's {limit} "
            "positions; use shorter windows"
        )
    model, sa, sb = endpoint_states(a, b)
    dev = resolve_device(device)
    td = _token_data(a, data, progress)
    eval_ids = td.eval_windows(eval_seq_len, eval_windows)
    calib_ids = td.calib_windows(calib_samples, calib_seq_len, calib_seed) if qcfgs else None
    eval_hash = td.token_hash("val", eval_seq_len, eval_windows)
    calib = calib_identity(td.data_hash, calib_samples, calib_seq_len, calib_seed)
    mcfg = MeasureConfig(batch_size=batch_size, quantize_threads=quantize_threads)
    run_name = interpolation_run(a, b)
    rows = []
    for alpha in grid:
        path = write_interpolation(model, sa, sb, alpha, a, b, out / alpha_name(alpha))
        m = measure(path, qcfgs, eval_ids, calib_ids, device=dev, cfg=mcfg)
        h = checkpoint_hash(str(path))
        fp_ce = m.fp_window_ce
        base = {
            "kind": INTERPOLATION.name, "alpha": alpha, "run": run_name, "branch": out.name, "checkpoint": str(path),
            "checkpoint_hash": h, "endpoint_a": str(a), "endpoint_b": str(b), "ce_fp": float(fp_ce.mean()),
            "ce_fp_se": mean_se(fp_ce)[1], "eval_hash": eval_hash, "calib_hash": calib, "data_key": td.data_hash,
            **provenance(),
        }
        if not qcfgs:
            rows.append({**base, "key": row_key(h, f"interp:{alpha!r}|fp", eval_hash), "quantizer": None,
                         "n_windows": len(fp_ce)})
        threads = quantize_threads if dev.type == "cpu" else 0
        for label, qc in qcfgs.items():
            rows.append({**base, **ptq_fields(label, qc, m, mcfg, threads),
                         "key": row_key(h, f"interp:{alpha!r}|{ptq_what(qc, calib)}", eval_hash)})
    return rows
