"""The quantization error of paper A, and the measures the inference engines report beside it.

On held-out tokens in non-overlapping windows (the same windows for both models: a paired comparison),
with p = P_FP and q = P_Q the two models' next-token distributions and y the correct next token:

  CE(FP), CE(Q)                 mean next-token cross-entropy (nats)
  Δ CE  = CE(Q) − CE(FP)        paper A's quantization error; also ln(PPL(Q) / PPL(FP)), llama.cpp's "ln ratio"
  Δ PPL = exp CE(Q) − exp CE(FP);  PPL ratio = exp Δ CE
  KL(p ‖ q)                     per token: mean, and over all tokens median, p90, p99, p99.9 and max
  KL(q ‖ p)                     per token, mean
  top-K agreement, K = 1..5     the K most probable tokens of Q are those of FP, in the same order
                                (exllamav3 eval/model_diff.py; K = 1 is llama.cpp's "same top p")
  Δp = q(y) − p(y)              the correct token's probability change: mean, RMS, p1 and p99
  corr(log p(y), log q(y))      Pearson correlation over tokens of the correct token's log-probability
                                (llama.cpp's "Cor(ln(PPL(Q)), ln(PPL(base)))")
  KL by confidence              mean KL(p ‖ q) of the tokens in each bucket of FP's top-1 probability
                                (CONFIDENCE_EDGES), and the fraction of tokens in each

Means are over windows of per-window means (every window has the same number of tokens, so this is also the
mean over tokens); their SEs are over windows, and since every per-token quantity is a difference or a
divergence of the two models on the same token, those SEs are paired. Percentiles, the maximum, the correlation
and the confidence histogram are over all evaluated tokens and carry no SE. Percentiles interpolate linearly
between order statistics (numpy's default, and llama.cpp's ``percentile``).

Memory: logits are consumed a slice at a time (``ErrorTokens.add``); what is kept per variant is three float32
values per evaluated token (KL(p ‖ q), log q(y), and FP's log p(y) and confidence once for all variants), i.e.
about 8·N·T bytes per variant for N windows of T tokens (200 × 128 tokens: 200 KiB; 1000 × 2048: 16 MiB), plus
a few float64 values per window. Percentiles are then exact (a sort of N·T floats), not streamed estimates.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from quantdyn.evaluate.loss import autocast_for, model_device
from quantdyn.models.gpt import logits_of
from quantdyn.results.stats import mean_se

TOP_K = 5
"""Top-K agreement is measured for K = 1 .. TOP_K (exllamav3's model_diff default)."""
CONFIDENCE_EDGES = (0.0, 0.25, 0.5, 0.75, 0.95, 1.0)
"""Buckets of FP's top-1 probability for KL by confidence: [0, .25), [.25, .5), [.5, .75), [.75, .95), [.95, 1]
(exllamav3 eval/model_diff.py's buckets)."""
KL_PERCENTILES = {"kl_median": 0.5, "kl_p90": 0.9, "kl_p99": 0.99, "kl_p999": 0.999}
"""The KL(p ‖ q) percentiles of a row (over all evaluated tokens), as fractions."""
DELTA_P_PERCENTILES = {"delta_p_p1": 0.01, "delta_p_p99": 0.99}
"""The Δp percentiles of a row."""


@torch.no_grad()
def compare_models(
    fp_model: nn.Module,
    q_model: nn.Module,
    windows: torch.Tensor,
    fp_window_ce: torch.Tensor | None = None,
    batch_size: int = 16,
    dtype: str = "float32",
    detailed: bool = True,
) -> dict:
    """Δ CE, Δ PPL, KL, agreement and the rest of the module docstring of ``q_model`` against ``fp_model``.

    ``fp_window_ce`` (per-window FP CE from :func:`window_losses`) may be passed when already computed for this
    checkpoint; the FP forward is then needed only for the comparison. ``detailed=False``: only CE, KL mean and
    top-1 agreement (what rows held before the other measures)."""
    return compare_many(fp_model, {"q": q_model}, windows, fp_window_ce, batch_size, dtype, detailed)["q"]


class FPLogits:
    """What every quantized variant is compared with, computed once per slice of full-precision logits [S, T, V]."""

    def __init__(self, lf: torch.Tensor, y: torch.Tensor, top_k: int = TOP_K):
        self.log_probs = F.log_softmax(lf, -1)
        self.probs = self.log_probs.exp()
        self.top = lf.topk(top_k, -1).indices if top_k > 1 else lf.argmax(-1, keepdim=True)
        """FP's top-K token ids per position, most probable first [S, T, K]."""
        self.y = y
        self.lp_y = self.log_probs.gather(-1, y.unsqueeze(-1)).squeeze(-1)
        """log p(y) of the correct token [S, T]."""

    @property
    def window_ce(self) -> torch.Tensor:
        return (-self.lp_y).mean(1).double().cpu()

    @property
    def confidence(self) -> torch.Tensor:
        """FP's top-1 probability per position [S, T]."""
        return self.log_probs.gather(-1, self.top[..., :1]).squeeze(-1).exp()


def top_k_agreement(top: torch.Tensor, lq: torch.Tensor) -> torch.Tensor:
    """Whether Q's K most probable tokens are FP's ``top`` [S, T, K] (most probable first), in the same order, for
    every K up to ``top``'s last dimension -> bool [S, T, K].

    For each K: Q's logits at FP's first K tokens are in non-increasing order and the K-th of them is at least
    every other logit of Q. Ties count as agreement (tied logits have no order), so identical models agree
    everywhere. Works on ``lq`` [S, T, V] in place (five entries per position are overwritten and restored):
    one gather, two scatters and one max over the vocabulary, cheaper than an arg-max."""
    g = lq.gather(-1, top)
    lq.scatter_(-1, top, float("-inf"))
    rest = lq.amax(-1)  # the largest logit outside FP's top K
    lq.scatter_(-1, top, g)
    K = top.shape[-1]
    ordered = torch.ones_like(g, dtype=torch.bool)
    if K > 1:
        ordered[..., 1:] = (g[..., :-1] >= g[..., 1:]).cumprod(-1).bool()
    # the largest logit outside FP's first k tokens: outside all K, or among FP's tokens k+1..K
    outside = torch.flip(torch.cummax(torch.flip(torch.cat([g[..., 1:], rest.unsqueeze(-1)], -1), [-1]), -1).values, [-1])
    return ordered & (g >= outside)


class FPTokens:
    """The full-precision side of every comparison, accumulated over slices: per-window CE and, per token, the
    correct token's log-probability and FP's top-1 probability. ``window_ce`` given: the per-window FP CE to
    use instead of the accumulated one (computed before, e.g. by ``window_losses``)."""

    def __init__(self, window_ce: torch.Tensor | None = None) -> None:
        self._given_ce = window_ce
        self._ce: list[torch.Tensor] = []
        self._lp_y: list[torch.Tensor] = []
        self._conf: list[torch.Tensor] = []

    def add(self, fp: FPLogits, detailed: bool = True) -> None:
        self._ce.append(fp.window_ce)
        if detailed:
            self._lp_y.append(fp.lp_y.float().cpu())
            self._conf.append(fp.confidence.float().cpu())

    @property
    def window_ce(self) -> torch.Tensor:
        if self._given_ce is not None:
            return self._given_ce.double()
        return torch.cat(self._ce) if self._ce else torch.zeros(0, dtype=torch.float64)

    @property
    def lp_y(self) -> torch.Tensor:
        return torch.cat(self._lp_y) if self._lp_y else torch.zeros(0, 0)

    @property
    def confidence(self) -> torch.Tensor:
        return torch.cat(self._conf) if self._conf else torch.zeros(0, 0)


class ErrorTokens:
    """One quantized variant's errors, accumulated slice by slice (per window, and per token where a percentile
    or a correlation needs them): :meth:`add` consumes a slice's logits, :func:`summarize` turns the whole into
    a row's fields."""

    def __init__(self, detailed: bool = True) -> None:
        self.detailed = detailed
        self.ce_q: list[torch.Tensor] = []
        self.kl: list[torch.Tensor] = []
        self.kl_reverse: list[torch.Tensor] = []
        self.agree: list[torch.Tensor] = []
        self.lp_y: list[torch.Tensor] = []

    def add(self, fp: FPLogits, lq: torch.Tensor) -> None:
        """Compare a slice of Q's float32 logits [S, T, V] with FP's (``lq`` is consumed: overwritten in place)."""
        agree = top_k_agreement(fp.top, lq)
        lpq = F.log_softmax(lq, -1)
        del lq
        lp_y = lpq.gather(-1, fp.y.unsqueeze(-1)).squeeze(-1)
        d = fp.log_probs - lpq
        kl = torch.linalg.vecdot(fp.probs, d)  # KL(p ‖ q) per token, without a product tensor
        self.ce_q.append((-lp_y).mean(1).double().cpu())
        self.agree.append(agree.double().mean(1).cpu())
        if self.detailed:
            self.kl.append(kl.float().cpu())
            self.kl_reverse.append((-torch.linalg.vecdot(lpq.exp_(), d)).double().mean(1).cpu())
            self.lp_y.append(lp_y.float().cpu())
        else:
            self.kl.append(kl.double().mean(1).cpu())


def _quantiles(x: np.ndarray, named: dict[str, float]) -> dict[str, float]:
    if x.size == 0:
        return dict.fromkeys(named, math.nan)
    return {name: float(v) for name, v in zip(named, np.quantile(x, list(named.values())))}


def summarize(fp: FPTokens, q: ErrorTokens) -> dict:
    """The error fields of one quantized model (module docstring) from its accumulated values, paired over
    windows with FP's."""
    fp_ce = fp.window_ce.double()
    q_ce = torch.cat(q.ce_q)
    delta = q_ce - fp_ce
    ce_fp, ce_q = float(fp_ce.mean()), float(q_ce.mean())
    agree = torch.cat(q.agree)  # [N, K] per-window agreement fractions
    d_mean, d_se = mean_se(delta)
    row = {
        "ce_fp": ce_fp,
        "ce_q": ce_q,
        "delta_ce": d_mean,
        "delta_ce_se": d_se,
        "rel_delta_ce": d_mean / ce_fp if ce_fp else None,
        "delta_ppl": math.exp(ce_q) - math.exp(ce_fp),
    }
    if not q.detailed:
        kl = torch.cat(q.kl)
        return {**row, "kl": float(kl.mean()), "kl_se": mean_se(kl)[1], "top1_agree": float(agree[:, 0].mean()),
                "n_windows": len(q_ce), "window_delta": [round(float(v), 7) for v in delta]}
    kl_tok = torch.cat(q.kl)  # [N, T]
    kl_win = kl_tok.double().mean(1)
    kl_all = kl_tok.double().flatten().numpy()
    lp_f = fp.lp_y.double().flatten().numpy()
    lp_q = torch.cat(q.lp_y).double().flatten().numpy()
    dp = np.exp(lp_q) - np.exp(lp_f)
    dp_win = torch.from_numpy(dp.reshape(kl_tok.shape))
    ms_mean, ms_se = mean_se(dp_win.pow(2).mean(1))
    rms = math.sqrt(ms_mean)
    conf = fp.confidence.double().flatten().numpy()
    bucket = np.clip(np.searchsorted(CONFIDENCE_EDGES, conf, side="right") - 1, 0, len(CONFIDENCE_EDGES) - 2)
    n_b = np.bincount(bucket, minlength=len(CONFIDENCE_EDGES) - 1)
    kl_b = np.bincount(bucket, weights=kl_all, minlength=len(CONFIDENCE_EDGES) - 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        corr = float(np.corrcoef(lp_f, lp_q)[0, 1]) if lp_f.size > 1 else math.nan
    rev = torch.cat(q.kl_reverse)
    row.update({
        "ppl_ratio": math.exp(d_mean),
        "ppl_ratio_se": math.exp(d_mean) * d_se,
        "kl": float(kl_win.mean()),
        "kl_se": mean_se(kl_win)[1],
        **_quantiles(kl_all, KL_PERCENTILES),
        "kl_max": float(kl_all.max()) if kl_all.size else math.nan,
        "kl_reverse": float(rev.mean()),
        "kl_reverse_se": mean_se(rev)[1],
        "top1_agree": float(agree[:, 0].mean()),
        "top1_agree_se": mean_se(agree[:, 0])[1],
    })
    for k in range(1, agree.shape[1]):
        row[f"top{k + 1}_agree"] = float(agree[:, k].mean())
        row[f"top{k + 1}_agree_se"] = mean_se(agree[:, k])[1]
    row.update({
        "delta_p": float(dp.mean()),
        "delta_p_se": mean_se(dp_win.mean(1))[1],
        "delta_p_rms": rms,
        "delta_p_rms_se": ms_se / (2 * rms) if rms > 0 else math.nan,
        **_quantiles(dp, DELTA_P_PERCENTILES),
        "logprob_corr": corr,
        "kl_by_confidence": [float(s / n) if n else None for s, n in zip(kl_b, n_b)],
        "confidence_fraction": [float(n / max(1, bucket.size)) for n in n_b],
        "n_windows": len(q_ce),
        "n_tokens": int(kl_all.size),
        "window_delta": [round(float(v), 7) for v in delta],
        "window_kl": [float(f"{v:.7g}") for v in kl_win.tolist()],
    })
    return row


# ------------------------------------------------------------------ hidden states, block by block
SQNR_EPS = 1e-8
"""Added to the noise power of a token's SQNR (exllamav3's ``util/measures.py`` value), so that a token whose
hidden state is unchanged reads 10·log10(‖h‖² / 1e-8) dB rather than infinity."""


class HiddenError:
    """The error of one variant's hidden states against FP's at one block output, accumulated over batches
    [B, T, D], as exllamav3's eval/model_diff.py measures it per module:

    * relative Frobenius error: ‖H_Q − H_FP‖_F / ‖H_FP‖_F of each window's [T, D] hidden states, mean over
      windows;
    * cosine error: 1 − cos(h_Q, h_FP) of each token's hidden state, mean over tokens;
    * SQNR: 10·log10(‖h_FP‖² / (‖h_Q − h_FP‖² + SQNR_EPS)) dB of each token, mean over tokens.

    Sums in float64 (the differences of a bf16 floor are ~1e-3 of the states: float32 sums would blur them)."""

    def __init__(self) -> None:
        self.rel_fro = self.cos_err = self.sqnr = 0.0
        self.windows = self.tokens = 0

    def add(self, hq: torch.Tensor, hf: torch.Tensor) -> None:
        f = hf.double()
        q = hq.double()
        # per-token dot products by einsum: torch.linalg.vecdot takes a slow elementwise path in float64 on the
        # CPU (~200x slower at [16, 128, 128]; bench/metrics_cost.py found it dominating the walk at 14m)
        nf = torch.einsum("...d,...d->...", f, f)  # [B, T]
        nq = torch.einsum("...d,...d->...", q, q)
        dot = torch.einsum("...d,...d->...", q, f)
        q -= f
        nd = torch.einsum("...d,...d->...", q, q)
        self.rel_fro += float((nd.sum(-1) / nf.sum(-1).clamp_min(1e-300)).sqrt().sum())
        self.cos_err += float((1 - dot / (nq * nf).sqrt().clamp_min(1e-8)).sum())
        self.sqnr += float((10 * torch.log10(nf / (nd + SQNR_EPS))).sum())
        self.windows += nf.shape[0]
        self.tokens += nf.numel()

    def result(self) -> tuple[float, float, float]:
        """(relative Frobenius error, cosine error, SQNR in dB)."""
        return (self.rel_fro / max(1, self.windows), self.cos_err / max(1, self.tokens),
                self.sqnr / max(1, self.tokens))


@torch.no_grad()
def compare_many(
    fp_model: nn.Module,
    q_models: dict[str, nn.Module],
    windows: torch.Tensor,
    fp_window_ce: torch.Tensor | None = None,
    batch_size: int = 16,
    dtype: str = "float32",
    detailed: bool = True,
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
    fp_acc = FPTokens(fp_window_ce)
    acc = {k: ErrorTokens(detailed) for k in q_models}
    top_k = TOP_K if detailed else 1
    for i in range(0, len(windows), batch_size):
        x = windows[i : i + batch_size]
        with autocast_for(fp_dev, dtype):
            lf_home = logits_of(fp_model, x[:, :-1].to(fp_dev)).float()
        fp_home = FPLogits(lf_home, x[:, 1:].to(fp_dev), top_k)
        fp_acc.add(fp_home, detailed)
        for label, q in q_models.items():
            dev = model_device(q)
            with autocast_for(dev, dtype):
                lq = logits_of(q, x[:, :-1].to(dev)).float()
            fp = fp_home if dev == fp_dev else FPLogits(lf_home.to(dev), x[:, 1:].to(dev), top_k)
            acc[label].add(fp, lq)
    return {label: summarize(fp_acc, a) for label, a in acc.items()}
