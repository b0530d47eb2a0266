"""Result rows of measurements: idempotency keys, calibration identity, quantizer fields.

Every command that stores measurements builds its rows here, so a row means the same thing
whichever command wrote it, and a rerun finds the rows it already wrote:

* ``row_key(checkpoint hash, what, eval hash)`` — the one hasher of row keys
  (sha256, 24 hex digits); ``what`` names the measurement (``fp``, ``ptq:<config hash>:<calib
  hash>``, ``interp:<alpha>|...``, ``analysis:...``);
* ``calib_hash(data hash, samples, seq_len, seed)`` — the identity of a calibration set;
* ``quantizer_fields`` / ``ptq_fields`` — what a PTQ row says about its quantizer, its error
  and how it was computed (batch size and threads while calibrating, timings).
"""
from __future__ import annotations

import hashlib

from quantdyn.config import config_hash
from quantdyn.measure.engine import MeasureConfig, Measurement
from quantdyn.quantize.config import QuantConfig
from quantdyn.quantize.config import row_fields as quantizer_fields


def row_key(ckpt_hash: str, what: str, eval_hash: str) -> str:
    """Idempotency key of a result row."""
    return hashlib.sha256(f"{ckpt_hash}|{what}|{eval_hash}".encode()).hexdigest()[:24]


def calib_hash(data_hash: str, samples: int, seq_len: int, seed: int) -> str:
    """Identity of a calibration set drawn from a token cache (``TokenData.calib_windows``)."""
    return hashlib.sha1(f"{data_hash}:{samples}:{seq_len}:{seed}".encode()).hexdigest()[:12]


def ptq_what(qc: QuantConfig, calib: str) -> str:
    """The ``what`` of a PTQ row's key."""
    return f"ptq:{config_hash(qc)}:{calib}"


def ptq_fields(label: str, qc: QuantConfig, m: Measurement, cfg: MeasureConfig, threads: int) -> dict:
    """Quantizer, error metrics, per-layer loss total and how it was computed, for one quantizer of a measurement."""
    v = m.quantizations[label]
    losses = [r.get("loss") for r in v.rows if r.get("loss") is not None]
    n_q = max(1, len(m.quantizations))
    return {
        **quantizer_fields(label, qc),
        **m.metrics[label],
        "layer_loss_sum": float(sum(losses)) if losses else None,
        "n_calibration": v.n_calibration,
        "t_quantize": v.seconds,
        "t_eval": m.t_eval / n_q,
        "eval_group": n_q,
        "calib_batch_size": cfg.calib_batch_size,
        "quantize_threads": threads,
        "compute_dtype": m.dtype,
    }
