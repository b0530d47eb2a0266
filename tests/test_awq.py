"""AWQ: activation-aware scales beat RTN on outlier channels; the FP function is unchanged."""
from __future__ import annotations

import pytest
import torch

from quantdyn.errors import QuantdynError
from quantdyn.quantize import QuantConfig
from quantdyn.quantize.awq import awq, awq_scales, awq_search, fold_into_norm
from quantdyn.quantize.gptq import stats_from
from quantdyn.quantize.primitives import dequantize_weight, layer_loss
from quantdyn.quantize.rtn import rtn

pytestmark = pytest.mark.numerics  # rerun under other MKL code paths by `make test-isa`


def outlier_layer(seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(4, 128, 256, generator=g)
    X[..., :6] *= 30.0  # a few salient input channels
    W = torch.randn(96, 256, generator=g) * 0.05
    return W, X


@pytest.mark.parametrize("kw", [dict(bits=3), dict(bits=4, awq_clip=False), dict(bits=4, group_size=0, sym=True)])
def test_awq_error_not_worse_than_rtn(kw):
    W, X = outlier_layer()
    st = stats_from(X)
    cfg = QuantConfig(method="awq", **kw)
    a = awq(W, st, cfg)
    r = rtn(W, QuantConfig(method="rtn", **kw), st.H)
    la, lr = layer_loss(W, a.weight, st.H), layer_loss(W, r.weight, st.H)
    assert la < lr
    assert a.loss == pytest.approx(la) and a.diagnostics["awq_alpha"] > 0
    # the direct output error agrees with the Hessian form
    flat = X.reshape(-1, 256)
    direct = float(((flat @ (W - a.weight).T) ** 2).sum()) / X.shape[0]
    assert direct == pytest.approx(la, rel=1e-3)


def test_search_starts_at_rtn_and_scales_are_normalised():
    W, X = outlier_layer(1)
    st = stats_from(X)
    cfg = QuantConfig(method="awq", bits=4)
    s, alpha, losses = awq_search(W, st, cfg)
    assert len(losses) == cfg.awq_grid and losses[0] == pytest.approx(rtn(W, cfg, st.H).loss, rel=1e-4)
    assert min(losses) < losses[0]
    assert float(s.max() * s.min()) == pytest.approx(1.0, rel=1e-5)
    assert torch.equal(awq_scales(st.abs_mean, 0.0), torch.ones(256))
    # X or its statistics give the same answer
    s2, alpha2, _ = awq_search(W, X, cfg)
    assert alpha2 == alpha and torch.allclose(s2, s)


def test_codes_quantize_scaled_weight_and_divide_back():
    W, X = outlier_layer(2)
    a = awq(W, X, QuantConfig(method="awq", bits=4, group_size=64))
    s = a.awq_scales
    assert torch.allclose(dequantize_weight(a.codes, a.scales, a.zeros, a.g_idx) / s, a.weight)
    assert a.codes.shape == W.shape and a.scales.shape == (96, 4)


def test_folded_fp_function_unchanged():
    torch.manual_seed(0)
    ln = torch.nn.LayerNorm(64)
    with torch.no_grad():
        ln.weight.uniform_(0.5, 2.0)
        ln.bias.normal_()
    lin = torch.nn.Linear(64, 32)
    x = torch.randn(10, 64)
    s = awq_scales(torch.rand(64) * 10 + 0.1, 0.5)
    ref = lin(ln(x))
    w2, b2 = fold_into_norm(ln.weight.data, ln.bias.data, s)
    folded = torch.nn.functional.layer_norm(x, (64,), w2, b2) @ (lin.weight * s).T + lin.bias
    torch.testing.assert_close(folded, ref, rtol=1e-5, atol=1e-5)
    # quantized: awq()'s divide-back weight and the deployable pair (norm folded by its s, Q(W·diag(s)) as the
    # weight) compute the same outputs, so the rows measure the model one would deploy
    x_ln = ln(x).detach()
    a = awq(lin.weight.data, torch.cat([x_ln] * 8), QuantConfig(method="awq", bits=3, group_size=32))
    w2, b2 = fold_into_norm(ln.weight.data, ln.bias.data, a.awq_scales)
    deployed = torch.nn.functional.layer_norm(x, (64,), w2, b2) @ dequantize_weight(
        a.codes, a.scales, a.zeros, a.g_idx).T + lin.bias
    torch.testing.assert_close(deployed, x_ln @ a.weight.T + lin.bias, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(a.awq_scales, torch.ones(64))  # a real rescaling, not the identity


def test_awq_needs_statistics():
    W, _ = outlier_layer()
    with pytest.raises(QuantdynError, match="calibration"):
        awq(W, None, QuantConfig(method="awq"))
    with pytest.raises(QuantdynError, match="in_features"):
        awq(W, torch.randn(8, 100), QuantConfig(method="awq"))
