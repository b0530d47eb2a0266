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

from quantdyn.evaluate.loss import autocast_for, ce_of_log_probs, model_device
from quantdyn.models.gpt import logits_of
from quantdyn.results.stats import mean_se


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
    return compare_many(fp_model, {"q": q_model}, windows, fp_window_ce, batch_size, dtype)["q"]


class FPLogits:
    """What every quantized variant is compared with, computed once per batch of full-precision logits."""

    def __init__(self, lf: torch.Tensor, y: torch.Tensor):
        self.log_probs = F.log_softmax(lf, -1)
        self.probs = self.log_probs.exp()
        self.top1 = lf.argmax(-1)
        self.y = y

    @property
    def window_ce(self) -> torch.Tensor:
        return ce_of_log_probs(self.log_probs, self.y)


def window_metrics(fp: FPLogits, lq: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per window (float64, CPU): CE of the quantized logits, KL(P_FP || P_Q) per token, top-1 agreement."""
    lpq = F.log_softmax(lq, -1)
    ce_q = ce_of_log_probs(lpq, fp.y)
    kl = (fp.probs * (fp.log_probs - lpq)).sum(-1).mean(1).double().cpu()
    agree = (fp.top1 == lq.argmax(-1)).double().mean(1).cpu()
    return ce_q, kl, agree


def summarize(fp_ce: torch.Tensor, q_ce: torch.Tensor, kl: torch.Tensor, agree: torch.Tensor) -> dict:
    """The error row of one quantized model from its per-window values (paired over windows)."""
    fp_ce = fp_ce.double()
    delta = q_ce - fp_ce
    ce_fp, ce_q = float(fp_ce.mean()), float(q_ce.mean())
    return {
        "ce_fp": ce_fp,
        "ce_q": ce_q,
        "delta_ce": float(delta.mean()),
        "delta_ce_se": mean_se(delta)[1],
        "rel_delta_ce": float(delta.mean()) / ce_fp if ce_fp else None,
        "delta_ppl": math.exp(ce_q) - math.exp(ce_fp),
        "kl": float(kl.mean()),
        "kl_se": mean_se(kl)[1],
        "top1_agree": float(agree.mean()),
        "n_windows": len(q_ce),
        "window_delta": [round(float(v), 7) for v in delta],
    }


@torch.no_grad()
def compare_many(
    fp_model: nn.Module,
    q_models: dict[str, nn.Module],
    windows: torch.Tensor,
    fp_window_ce: torch.Tensor | None = None,
    batch_size: int = 16,
    dtype: str = "float32",
) -> dict[str, dict]:
    """:func:`compare_models` for several quantized copies of one model -> {label: metrics}.

    Each batch of windows goes through the FP model once and through every
    quantized model, so the FP forward is shared (the results equal separate
    :func:`compare_models` calls). Whole in-memory models: for checkpoints use the
    streamed engine (``quantdyn.engine.measure``), which computes the same numbers block by block."""
    fp_dev = model_device(fp_model)
    fp_model.eval()
    for q in q_models.values():
        q.eval()
    fp_ce: list[torch.Tensor] = []
    acc: dict[str, list[list[torch.Tensor]]] = {k: [[], [], []] for k in q_models}
    for i in range(0, len(windows), batch_size):
        x = windows[i : i + batch_size]
        with autocast_for(fp_dev, dtype):
            lf_home = logits_of(fp_model, x[:, :-1].to(fp_dev)).float()
        fp_home = FPLogits(lf_home, x[:, 1:].to(fp_dev))
        fp_ce.append(fp_home.window_ce)
        for label, q in q_models.items():
            dev = model_device(q)
            with autocast_for(dev, dtype):
                lq = logits_of(q, x[:, :-1].to(dev)).float()
            fp = fp_home if dev == fp_dev else FPLogits(lf_home.to(dev), x[:, 1:].to(dev))
            for lst, v in zip(acc[label], window_metrics(fp, lq)):
                lst.append(v)
    fp_ce_t = fp_window_ce.double() if fp_window_ce is not None else torch.cat(fp_ce)
    return {label: summarize(fp_ce_t, *(torch.cat(v) for v in a)) for label, a in acc.items()}
