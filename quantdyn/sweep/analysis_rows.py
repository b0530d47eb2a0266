"""Per-checkpoint analysis metrics as result rows, for `quantdyn analyze` and
sweeps with ``analysis: [hessian, outliers, propagation, curvature]``.

Each analysis returns one flat dict of scalars (so rows query and correlate
easily):
  hessian      hessian_trace, hessian_trace_se, hessian_trace_probes, hessian_top_eig
               (Hutchinson + power iteration on held-out windows)
  outliers     weight_/act_ {mmr, mmr_token, kurtosis, max_abs} _mean/_max over linear layers
  propagation  per quantizer Q: prop_R_final__Q (R_L, paper B's predictor),
               prop_gain_mean__Q, prop_B_sum__Q (new error summed over blocks)
  curvature    curvature_along_update: the early warning (issue 48.5) after the fact, the held-out loss's curvature
               along the update from the checkpoint the training reached it from (runs.predecessor: the run's
               previous checkpoint, a branch's branch point) to it, analysis/hessian.curvature_along as
               PTQMonitor.warn measures it in training (float32, eval mode, held-out windows, three forwards);
               curvature_from (that checkpoint, or "no predecessor (why)"), curvature_from_step, update_norm
               |w - w_prev|; None where the checkpoint has no predecessor
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from quantdyn.analysis.hessian import HessianConfig, curvature_along, hessian_metrics, next_token_loss
from quantdyn.analysis.outliers import outlier_metrics
from quantdyn.engine.measure import MeasureConfig, measure
from quantdyn.errors import unknown_name
from quantdyn.models.hf_io import load_causal_lm
from quantdyn.runs import checkpoint_info, predecessor

ANALYSES = ("hessian", "outliers", "propagation", "curvature")


@dataclass(frozen=True)
class AnalysisConfig:
    """Budgets of the per-checkpoint analyses."""

    windows: int = 8
    """Held-out windows for the Hessian and the curvature along the update (calibration windows for the others)."""
    hessian_probes: int = 50
    """Hutchinson probe budget (paper A: up to 200)."""
    hessian_eig_iters: int = 100
    """Power-iteration cap for the top eigenvalue (paper A: up to 1000)."""
    hessian_tol: float = 1e-3
    """Relative tolerance for both estimators (paper A: 1e-5; looser default for CPU budgets)."""


def check_analysis_names(names) -> None:
    for n in names:
        if n not in ANALYSES:
            raise unknown_name("analysis", n, ANALYSES)


def hessian_row(model, eval_ids: torch.Tensor, cfg: AnalysisConfig) -> dict:
    ids = eval_ids[: cfg.windows]
    hc = HessianConfig(trace_max_probes=cfg.hessian_probes, trace_tol=cfg.hessian_tol, top_k=1,
                       eig_max_iter=cfg.hessian_eig_iters, eig_tol=cfg.hessian_tol)
    batches = [ids[i : i + 4] for i in range(0, len(ids), 4)]
    m = hessian_metrics(model, batches, hc)
    return {"hessian_trace": m.get("trace"), "hessian_trace_se": m.get("trace_se"),
            "hessian_trace_probes": m.get("trace_probes"), "hessian_top_eig": (m.get("top_eigenvalues") or [None])[0],
            "hessian_seconds": m.get("seconds")}


def outliers_row(model, calib_ids: torch.Tensor, cfg: AnalysisConfig) -> dict:
    return dict(outlier_metrics(model, calib_ids[: cfg.windows]).aggregates)


def propagation_row(weights, calib_ids: torch.Tensor, quantizers: dict, cfg: AnalysisConfig, device="cpu",
                    mcfg=None) -> dict:
    """Paper B's R_L, mean gain and summed new error per quantizer, from one streamed walk (measure.engine)."""

    m = measure(weights, quantizers, None, calib_ids, device=device, cfg=mcfg or MeasureConfig(),
                propagation_ids=calib_ids[: cfg.windows])
    out = {}
    for label in quantizers:
        rows = m.propagation[label]
        gains = [r["gain"] for r in rows if r["gain"] is not None]
        out[f"prop_R_final__{label}"] = rows[-1]["R"]
        out[f"prop_gain_mean__{label}"] = sum(gains) / len(gains) if gains else None
        out[f"prop_B_sum__{label}"] = sum(r["B"] for r in rows)
    return out


def predecessor_of(ref) -> tuple[Path | None, str]:
    """The checkpoint ``ref`` (a directory, or hub-id@revision) was trained from, or None and why not
    (runs.predecessor; a checkpoint that is not a local directory has none)."""
    path = Path(str(ref))
    return predecessor(path) if path.is_dir() else (None, "not a local checkpoint of a quantdyn run")


def curvature_row(ckpt, eval_ids: torch.Tensor, cfg: AnalysisConfig, device="cpu", previous=None) -> dict:
    """The early warning (monitor ``warning_every``) of a stored checkpoint: the curvature of the held-out loss
    along the update from ``ckpt``'s predecessor to ``ckpt`` (``previous``: (path | None, why) as
    :func:`predecessor_of` gives it; found from the run directory when not given), on the first ``cfg.windows``
    evaluation windows, the model in float32 and eval mode: k = u^T H u, u = (w - w_prev) / |w - w_prev|
    (analysis/hessian.curvature_along, three forward passes). No predecessor: curvature_along_update None and
    ``curvature_from`` says why; the same weights as it, or another architecture: None too."""
    prev, why = previous if previous is not None else predecessor_of(ckpt)
    ids = eval_ids[: cfg.windows]
    out = {"curvature_along_update": None, "curvature_from": str(prev) if prev is not None else f"no predecessor "
           f"({why})", "curvature_from_step": checkpoint_info(prev).step if prev is not None else None,
           "update_norm": None, "curvature_slope": None, "curvature_h": None, "curvature_windows": len(ids),
           "curvature_seconds": None}
    if prev is None:
        return out
    t0 = time.perf_counter()
    model = load_causal_lm(ckpt, device=device).float().eval()
    named = list(model.named_parameters())
    before = dict(load_causal_lm(prev, device=device).float().named_parameters())
    if [n for n, _ in named] != list(before) or any(p.shape != before[n].shape for n, p in named):
        return {**out, "curvature_from": f"{prev}: another architecture"}
    direction = [p.detach() - before[n].detach() for n, p in named]
    del before
    norm = math.sqrt(sum(float(d.double().pow(2).sum()) for d in direction))
    out["update_norm"] = norm
    if not norm > 0:
        return out  # the same weights as its predecessor: no update to measure along
    ids = ids.to(device)
    with torch.no_grad():
        r = curvature_along(lambda: next_token_loss(model, ids), [p for _, p in named], direction)
    out.update(curvature_along_update=r["curvature"], curvature_slope=r["slope"], curvature_h=r["h"],
               curvature_seconds=time.perf_counter() - t0)
    return out


def analysis_rows(name: str, weights, data, calib_ids, eval_ids, quantizers: dict, cfg: AnalysisConfig,
                  device="cpu", mcfg=None, previous=None) -> dict:
    """One analysis of a checkpoint (``weights``: a reference or CheckpointWeights). The Hessian and outlier
    analyses need the whole model in memory (autograd, every layer's activations); propagation streams.
    ``previous``: curvature's predecessor as :func:`predecessor_of` gives it (found from the run when None)."""
    check_analysis_names([name])
    if name == "propagation":
        return propagation_row(weights, calib_ids, quantizers, cfg, device, mcfg)
    if name == "curvature":
        return curvature_row(getattr(weights, "path", weights), eval_ids, cfg, device, previous)

    model = load_causal_lm(getattr(weights, "path", weights), device=device)
    if name == "hessian":
        return hessian_row(model, eval_ids, cfg)
    return outliers_row(model, calib_ids, cfg)
