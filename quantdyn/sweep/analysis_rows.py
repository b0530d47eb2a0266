"""Per-checkpoint analysis metrics as result rows, for `quantdyn analyze` and
sweeps with ``analysis: [hessian, outliers, propagation]``.

Each analysis returns one flat dict of scalars (so rows query and correlate
easily):
  hessian      hessian_trace, hessian_trace_se, hessian_trace_probes, hessian_top_eig
               (Hutchinson + power iteration on held-out windows)
  outliers     weight_/act_ {mmr, mmr_token, kurtosis, max_abs} _mean/_max over linear layers
  propagation  per quantizer Q: prop_R_final__Q (R_L, paper B's predictor),
               prop_gain_mean__Q, prop_B_sum__Q (new error summed over blocks)
  curvature    curvature_along_update (the early warning after the fact: the loss's curvature along the update
               from the checkpoint the training reached it from, runs.previous_checkpoint; three forwards),
               curvature_from (that checkpoint), update_norm; None where the checkpoint has no predecessor
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from quantdyn.analysis.hessian import HessianConfig, curvature_along, hessian_metrics, next_token_loss
from quantdyn.analysis.outliers import outlier_metrics
from quantdyn.engine.measure import MeasureConfig, measure
from quantdyn.errors import unknown_name
from quantdyn.models.hf_io import load_causal_lm
from quantdyn.runs import previous_checkpoint

ANALYSES = ("hessian", "outliers", "propagation", "curvature")


@dataclass(frozen=True)
class AnalysisConfig:
    """Budgets of the per-checkpoint analyses."""

    windows: int = 8
    """Held-out windows for the Hessian (and calibration windows for the others)."""
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


@torch.no_grad()
def curvature_row(path, eval_ids: torch.Tensor, cfg: AnalysisConfig, device="cpu") -> dict:
    """The early warning (monitor ``warning_every``) of a stored checkpoint: the loss's curvature along w − w_prev,
    w_prev the checkpoint the training reached it from, on the first ``cfg.windows`` held-out windows in float32,
    the model in evaluation mode. Without a predecessor (a run's first checkpoint, a checkpoint outside a run):
    None, and ``curvature_from`` says why."""
    prev = previous_checkpoint(path) if Path(path).is_dir() else None
    if prev is None:
        return {"curvature_along_update": None, "curvature_from": "no predecessor (a run's first checkpoint, or "
                "a checkpoint outside a run directory)", "update_norm": None}
    model = load_causal_lm(path, device=device).eval()
    before = dict(load_causal_lm(prev, device=device).named_parameters())
    named = list(model.named_parameters())
    if {n for n, _ in named} != set(before) or any(p.shape != before[n].shape for n, p in named):
        return {"curvature_along_update": None, "curvature_from": f"{prev}: another architecture", "update_norm": None}
    d = [p.detach() - before[n].detach() for n, p in named]
    norm = float(torch.sqrt(sum(x.double().pow(2).sum() for x in d)))
    if not norm > 0:
        return {"curvature_along_update": None, "curvature_from": str(prev), "update_norm": 0.0}
    ids = eval_ids[: cfg.windows].to(device)
    r = curvature_along(lambda: next_token_loss(model, ids), [p for _, p in named], d)
    return {"curvature_along_update": r["curvature"], "curvature_from": str(prev), "update_norm": norm}


def analysis_rows(name: str, weights, data, calib_ids, eval_ids, quantizers: dict, cfg: AnalysisConfig,
                  device="cpu", mcfg=None) -> dict:
    """One analysis of a checkpoint (``weights``: a reference or CheckpointWeights). The Hessian and outlier
    analyses need the whole model in memory (autograd, every layer's activations); propagation streams."""
    check_analysis_names([name])
    if name == "propagation":
        return propagation_row(weights, calib_ids, quantizers, cfg, device, mcfg)
    if name == "curvature":
        return curvature_row(Path(str(getattr(weights, "path", weights))), eval_ids, cfg, device)

    model = load_causal_lm(getattr(weights, "path", weights), device=device)
    if name == "hessian":
        return hessian_row(model, eval_ids, cfg)
    return outliers_row(model, calib_ids, cfg)
