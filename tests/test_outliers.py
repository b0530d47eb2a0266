"""Outlier metrics: exact values on known tensors, streaming == batch, models."""
from __future__ import annotations

import math

import pytest
import torch

from quantdyn.analysis.outliers import (
    OutlierConfig,
    kurtosis,
    max_to_mean_ratio,
    outlier_metrics,
)
from quantdyn.errors import QuantdynError
from quantdyn.models.gpt import GPT, ModelConfig, resolve_model_config


def per_token_max_to_mean_ratio(x: torch.Tensor) -> float:
    """The reference of the streamed act_mmr_token: mean over tokens (all leading dims) of max_j |x_tj| / mean_j |x_tj| over the last dim.
    Tokens whose row is all zero are skipped."""
    a = x.detach().abs().double().reshape(-1, x.shape[-1])
    mean = a.mean(dim=1)
    keep = mean > 0
    if not bool(keep.any()):
        return math.nan
    return float((a.max(dim=1).values[keep] / mean[keep]).mean())


def test_known_tensors():
    assert max_to_mean_ratio(torch.full((10,), -3.0)) == pytest.approx(1.0)
    assert max_to_mean_ratio(torch.tensor([1.0, -2.0, 3.0, -4.0])) == pytest.approx(4 / 2.5)
    # [1,2,3,4]: μ=2.5, m2=1.25, m4=2.5625 -> κ = 2.5625/1.5625 = 1.64
    assert kurtosis(torch.tensor([1.0, 2.0, 3.0, 4.0])) == pytest.approx(1.64)
    assert kurtosis(torch.tensor([1.0, 2.0, 3.0, 4.0]), excess=True) == pytest.approx(1.64 - 3)
    # symmetric two-point distribution: κ = 1 (the minimum)
    assert kurtosis(torch.tensor([-1.0, 1.0] * 50)) == pytest.approx(1.0)
    assert math.isnan(kurtosis(torch.ones(5)))
    x = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 4.0]])  # ratios 1 and 4
    assert per_token_max_to_mean_ratio(x) == pytest.approx(2.5)


def test_gaussian_and_laplace_kurtosis():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(200_000, generator=g, dtype=torch.float64)
    assert kurtosis(z) == pytest.approx(3.0, abs=0.05)  # SE ≈ sqrt(24/n) ≈ 0.011
    torch.manual_seed(0)
    lap = torch.distributions.Laplace(0.0, 1.0).sample((200_000,)).double()
    assert kurtosis(lap, excess=True) == pytest.approx(3.0, abs=0.3)  # Laplace: excess 3


def _tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(resolve_model_config(ModelConfig(vocab_size=64, n_layer=2, d_model=32, n_head=2, max_seq_len=32)))


def test_gpt_rows_and_streaming_equals_batch():
    model = _tiny_gpt()
    ids = torch.randint(0, 64, (5, 16), generator=torch.Generator().manual_seed(0))
    rows, agg = outlier_metrics(model, ids, OutlierConfig(batch_size=2))  # 3 chunks
    assert [r["layer"] for r in rows] == [
        f"gpt_neox.layers.{i}.{n}"
        for i in range(2)
        for n in ("attention.query_key_value", "attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")
    ]
    # direct computation on the whole calibration set
    captured = {}
    layer = model.gpt_neox.layers[1].mlp.dense_4h_to_h
    h = layer.register_forward_pre_hook(lambda m, a: captured.setdefault("x", a[0].detach().clone()))
    with torch.no_grad():
        model(ids)
    h.remove()
    x = captured["x"]
    row = rows[7]
    assert row["act_tokens"] == 5 * 16
    assert row["act_mmr"] == pytest.approx(max_to_mean_ratio(x), rel=1e-9)
    assert row["act_mmr_token"] == pytest.approx(per_token_max_to_mean_ratio(x), rel=1e-9)
    assert row["act_kurtosis"] == pytest.approx(kurtosis(x), rel=1e-9)
    assert row["act_max_abs"] == pytest.approx(float(x.abs().max()))
    assert row["weight_kurtosis"] == pytest.approx(kurtosis(layer.weight))
    assert agg["n_layers"] == 8
    assert agg["act_kurtosis_max"] == pytest.approx(max(r["act_kurtosis"] for r in rows))
    assert agg["weight_mmr_mean"] == pytest.approx(sum(r["weight_mmr"] for r in rows) / 8)
    with_head, _ = outlier_metrics(model, None, OutlierConfig(activations=False, include_head=True))
    assert len(with_head) == 9 and "act_mmr" not in with_head[0]
    with pytest.raises(QuantdynError, match="calib_ids"):
        outlier_metrics(model, None)


def test_hf_gpt2_conv1d_layers():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=2))
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    rows, agg = outlier_metrics(model, ids)
    names = [r["layer"] for r in rows]
    assert names == ["transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj", "transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.c_proj"]
    assert rows[0]["in_features"] == 32 and rows[0]["out_features"] == 96
    assert rows[2]["act_tokens"] == 16 and all(math.isfinite(r["act_kurtosis"]) for r in rows)
