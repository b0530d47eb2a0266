"""The quantization error of paper A, and its companions.

On held-out tokens in non-overlapping windows (the same windows for both
models — a paired comparison):
  CE(FP), CE(Q)                 mean next-token cross-entropy (nats)
  Δ CE  = CE(Q) − CE(FP)        paper A's quantization error
  Δ PPL = exp CE(Q) − exp CE(FP)
  KL(P_FP ‖ P_Q)                mean per token
  top-1 agreement               fraction of tokens whose argmax agrees
Standard errors are over windows (paired for Δ CE), so two checkpoints'
errors can be compared against their uncertainty.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from quantdyn.evaluate.loss import autocast_for, model_device, window_losses
from quantdyn.models.gpt import logits_of


def _se(x: torch.Tensor) -> float:
    return float(x.std(unbiased=True) / math.sqrt(len(x))) if len(x) > 1 else float("nan")


@torch.no_grad()
def compare_models(
    fp_model: nn.Module,
    q_model: nn.Module,
    windows: torch.Tensor,
    fp_window_ce: torch.Tensor | None = None,
    batch_size: int = 16,
    dtype: str = "float32",
) -> dict:
    """Δ CE, Δ PPL, KL and agreement of ``q_model`` against ``fp_model``.

    ``fp_window_ce`` (per-window FP CE from :func:`window_losses`) may be
    passed when already computed for this checkpoint; the FP forward is then
    needed only for KL and agreement.
    """
    dev = model_device(q_model)
    fp_dev = model_device(fp_model)
    q_ce, fp_ce, kl, agree = [], [], [], []
    fp_model.eval()
    q_model.eval()
    for i in range(0, len(windows), batch_size):
        x = windows[i : i + batch_size]
        with autocast_for(dev, dtype):
            lq = logits_of(q_model, x[:, :-1].to(dev)).float()
        with autocast_for(fp_dev, dtype):
            lf = logits_of(fp_model, x[:, :-1].to(fp_dev)).float().to(dev)
        y = x[:, 1:].to(dev)
        q_ce.append(F.cross_entropy(lq.transpose(1, 2), y, reduction="none").mean(1).double().cpu())
        fp_ce.append(F.cross_entropy(lf.transpose(1, 2), y, reduction="none").mean(1).double().cpu())
        lpf, lpq = F.log_softmax(lf, -1), F.log_softmax(lq, -1)
        kl.append((lpf.exp() * (lpf - lpq)).sum(-1).mean(1).double().cpu())
        agree.append((lf.argmax(-1) == lq.argmax(-1)).double().mean(1).cpu())
    q_ce_t, kl_t, agree_t = torch.cat(q_ce), torch.cat(kl), torch.cat(agree)
    fp_ce_t = fp_window_ce.double() if fp_window_ce is not None else torch.cat(fp_ce)
    delta = q_ce_t - fp_ce_t
    ce_fp, ce_q = float(fp_ce_t.mean()), float(q_ce_t.mean())
    return {
        "ce_fp": ce_fp,
        "ce_q": ce_q,
        "delta_ce": float(delta.mean()),
        "delta_ce_se": _se(delta),
        "delta_ppl": math.exp(ce_q) - math.exp(ce_fp),
        "kl": float(kl_t.mean()),
        "kl_se": _se(kl_t),
        "top1_agree": float(agree_t.mean()),
        "n_windows": len(windows),
        "window_delta": [round(float(v), 7) for v in delta],
    }


def fp_metrics(model: nn.Module, windows: torch.Tensor, batch_size: int = 16, dtype: str = "float32") -> dict:
    ce = window_losses(model, windows, batch_size, dtype)
    return {"ce_fp": float(ce.mean()), "ce_fp_se": _se(ce), "ppl_fp": math.exp(float(ce.mean())),
            "n_windows": len(windows), "window_ce": [round(float(v), 7) for v in ce]}
