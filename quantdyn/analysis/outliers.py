"""Outlier statistics of linear layers: max-to-mean ratio, kurtosis, max |x|.

Paper B ("Beyond Outliers", arXiv 2509.23500) tests whether the usual outlier
metrics predict post-training-quantization damage (they do not, across
optimizers).  This module computes them, per linear layer, for the weight and
for the layer's input activations on calibration tokens.

Definitions (x = the tensor's entries, n of them; for activations the input
is viewed as tokens × features, X ∈ R^{N×d}):

* ``mmr`` — max-to-mean ratio over the whole tensor:
  MMR(x) = max_i |x_i| / mean_i |x_i|.  A constant vector has MMR 1; the ratio
  is >= 1 always.
* ``mmr_token`` (activations only) — per-token MMR averaged over tokens:
  (1/N) Σ_t max_j |X_tj| / mean_j |X_tj|.
* ``kurtosis`` — Pearson (not excess) kurtosis over all entries:
  κ = E[(x − μ)^4] / σ^4 with population moments (μ = mean, σ² = E[(x − μ)²],
  no small-sample correction).  A Gaussian has κ = 3.
* ``excess_kurtosis`` = κ − 3 (0 for a Gaussian).
* ``max_abs`` = max_i |x_i|.

Linear layers are ``nn.Linear`` and transformers' GPT-2 ``Conv1D`` (weight
stored transposed, (in, out); its input is the same token × feature matrix).
Activations are captured by forward hooks (removed afterwards) and reduced on
the fly to float64 power sums, so memory does not grow with the number of
calibration tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn

from quantdyn.errors import QuantdynError
from quantdyn.models.gpt import logits_of


@dataclass(frozen=True)
class OutlierConfig:
    """Which layers and tensors to measure."""

    weights: bool = True
    """Measure each layer's weight."""
    activations: bool = True
    """Measure each layer's input activations on the calibration tokens."""
    include_head: bool = False
    """Also measure the output head (lm_head / embed_out).  Off by default, as
    PTQ (GPTQ, RTN in papers A and B) leaves the head in full precision."""
    batch_size: int = 8
    """Calibration sequences per forward pass."""

    def __post_init__(self):
        if not (self.weights or self.activations):
            raise QuantdynError("outliers: weights and activations are both off; nothing to measure")
        if self.batch_size < 1:
            raise QuantdynError(f"outliers.batch_size={self.batch_size} must be >= 1")


class OutlierMetrics(NamedTuple):
    """Per-layer rows and model-level aggregates."""

    rows: list[dict]
    """One dict per linear layer: layer, type, in_features, out_features,
    weight_{mmr,kurtosis,excess_kurtosis,max_abs}, act_{mmr,mmr_token,kurtosis,
    excess_kurtosis,max_abs}, act_tokens (keys of switched-off parts absent)."""
    aggregates: dict
    """'<metric>_mean' and '<metric>_max' over layers for every metric column,
    plus 'n_layers'."""


# ----------------------------------------------------------------------------
# tensor statistics


def max_to_mean_ratio(x: torch.Tensor) -> float:
    """MMR = max|x| / mean|x| over all entries (inf if mean|x| = 0 < max|x|, nan if x = 0)."""
    a = x.detach().abs().double().flatten()
    if a.numel() == 0:
        raise QuantdynError("max_to_mean_ratio of an empty tensor")
    m = float(a.mean())
    mx = float(a.max())
    return mx / m if m > 0 else (math.nan if mx == 0 else math.inf)


def kurtosis(x: torch.Tensor, excess: bool = False) -> float:
    """Pearson kurtosis E[(x−μ)^4]/σ^4 over all entries (population moments);
    ``excess=True`` subtracts 3.  nan for a constant tensor."""
    a = x.detach().double().flatten()
    d = a - a.mean()
    m2 = float((d * d).mean())
    if m2 == 0:
        return math.nan
    k = float((d**4).mean()) / (m2 * m2)
    return k - 3.0 if excess else k


class _Moments:
    """Streaming float64 statistics of a token × feature stream.

    Power sums of (x − s) for a shift s fixed from the first chunk (its mean),
    which keeps the central moments accurate when |μ| ≫ σ."""

    def __init__(self):
        self.n = 0
        self.shift: float | None = None
        self.s1 = self.s2 = self.s3 = self.s4 = 0.0
        self.abs_sum = 0.0
        self.max_abs = 0.0
        self.tok_ratio_sum = 0.0
        self.tok_count = 0

    def update(self, x: torch.Tensor) -> None:
        x = x.detach().double().reshape(-1, x.shape[-1])
        if self.shift is None:
            self.shift = float(x.mean())
        d = x - self.shift
        d2 = d * d
        self.n += x.numel()
        self.s1 += float(d.sum())
        self.s2 += float(d2.sum())
        self.s3 += float((d2 * d).sum())
        self.s4 += float((d2 * d2).sum())
        a = x.abs()
        self.abs_sum += float(a.sum())
        self.max_abs = max(self.max_abs, float(a.max()))
        mean = a.mean(dim=1)
        keep = mean > 0
        self.tok_ratio_sum += float((a.max(dim=1).values[keep] / mean[keep]).sum())
        self.tok_count += int(keep.sum())

    def result(self) -> dict:
        n = self.n
        mean_abs = self.abs_sum / n
        m1 = self.s1 / n  # mean of d; central moments of x = those of d
        c2 = self.s2 / n - m1**2
        c4 = self.s4 / n - 4 * m1 * self.s3 / n + 6 * m1**2 * self.s2 / n - 3 * m1**4
        k = c4 / (c2 * c2) if c2 > 0 else math.nan
        mmr = self.max_abs / mean_abs if mean_abs > 0 else (math.nan if self.max_abs == 0 else math.inf)
        return {
            "mmr": mmr,
            "mmr_token": self.tok_ratio_sum / self.tok_count if self.tok_count else math.nan,
            "kurtosis": k,
            "excess_kurtosis": k - 3.0,
            "max_abs": self.max_abs,
        }


# ----------------------------------------------------------------------------
# model level


def linear_layers(model: nn.Module, include_head: bool = False) -> list[tuple[str, nn.Module]]:
    """(name, module) of every nn.Linear / transformers Conv1D, in module order;
    the output head (``get_output_embeddings()`` or ``embed_out``) only if asked."""
    kinds: tuple[type, ...] = (nn.Linear,)
    try:  # GPT-2 style models; transformers is optional here
        from transformers.pytorch_utils import Conv1D

        kinds = kinds + (Conv1D,)
    except ImportError:  # pragma: no cover - transformers is a dependency of quantdyn
        pass
    head = None
    if hasattr(model, "get_output_embeddings"):
        head = model.get_output_embeddings()
    elif hasattr(model, "embed_out"):
        head = model.embed_out
    return [
        (n, m) for n, m in model.named_modules()
        if isinstance(m, kinds) and (include_head or m is not head)
    ]


def _features(m: nn.Module) -> tuple[int, int]:
    if isinstance(m, nn.Linear):
        return m.in_features, m.out_features
    w = m.weight  # Conv1D: (in, out)
    return int(w.shape[0]), int(w.shape[1])


def outlier_metrics(
    model: nn.Module, calib_ids: torch.Tensor | None = None, cfg: OutlierConfig = OutlierConfig()
) -> OutlierMetrics:
    """Outlier statistics of every linear layer of ``model`` (quantdyn GPT or HF).

    ``calib_ids``: LongTensor [N, T] of calibration tokens, run in chunks of
    ``cfg.batch_size`` under ``torch.no_grad`` in eval mode (restored after);
    needed when ``cfg.activations``.  See the module docstring for the exact
    definitions.  Returns :class:`OutlierMetrics` (rows, aggregates).
    """

    layers = linear_layers(model, cfg.include_head)
    if not layers:
        raise QuantdynError("outliers: the model has no nn.Linear / Conv1D layers to measure")
    rows: list[dict] = []
    for name, m in layers:
        fin, fout = _features(m)
        row = {"layer": name, "type": type(m).__name__, "in_features": fin, "out_features": fout}
        if cfg.weights:
            w = m.weight
            row.update(
                weight_mmr=max_to_mean_ratio(w),
                weight_kurtosis=kurtosis(w),
                weight_excess_kurtosis=kurtosis(w, excess=True),
                weight_max_abs=float(w.detach().abs().max()),
            )
        rows.append(row)

    if cfg.activations:
        if calib_ids is None or calib_ids.dim() != 2 or calib_ids.numel() == 0:
            raise QuantdynError("outliers: activations need calibration token ids shaped [N, T]; pass calib_ids")
        stats = {name: _Moments() for name, _ in layers}

        def hook_for(name: str):
            def hook(mod, args, kwargs=None):
                stats[name].update(args[0])

            return hook

        handles = [m.register_forward_pre_hook(hook_for(n)) for n, m in layers]
        was_training = model.training
        device = layers[0][1].weight.device
        try:
            model.eval()
            with torch.no_grad():
                for i in range(0, calib_ids.size(0), cfg.batch_size):
                    logits_of(model, calib_ids[i : i + cfg.batch_size].to(device))
        finally:
            for h in handles:
                h.remove()
            model.train(was_training)
        for row in rows:
            s = stats[row["layer"]]
            if s.n == 0:  # layer not on the forward path (e.g. unused head)
                continue
            row.update({f"act_{k}": v for k, v in s.result().items()})
            row["act_tokens"] = s.n // row["in_features"]

    return OutlierMetrics(rows, aggregate(rows))


def aggregate(rows: list[dict]) -> dict:
    """'<col>_mean' and '<col>_max' over layers for every weight_*/act_* metric
    column (nan/inf-free values only; a column with none is left out)."""
    cols = list(dict.fromkeys(k for r in rows for k in r if k.startswith(("weight_", "act_")) and k != "act_tokens"))
    out: dict = {"n_layers": len(rows)}
    for c in cols:
        vals = [r[c] for r in rows if c in r and math.isfinite(r[c])]
        if vals:
            out[f"{c}_mean"] = sum(vals) / len(vals)
            out[f"{c}_max"] = max(vals)
    return out
