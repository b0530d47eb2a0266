"""Quantization-aware training (quantdyn/train/qat.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from quantdyn.errors import QuantdynError
from quantdyn.models.gpt import GPT, ModelConfig, resolve_model_config
from quantdyn.quantize.primitives import find_params, quantize_codes, rtn_weight
from quantdyn.train.qat import (
    GAUSSIAN_OPTIMAL_CLIP,
    QATConfig,
    QATLinear,
    fake_quant_forward,
    fake_quantize_weight,
    fake_quantize_weights_,
    gaussian_optimal_clip,
    hadamard_block_size,
    hadamard_matrix,
    hadamard_transform,
    minmax_fake_quant,
    prepare_qat,
    quest_fake_quant,
    strip_qat,
)


def tiny_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(resolve_model_config(ModelConfig(vocab_size=64, n_layer=2, d_model=32, n_head=2, max_seq_len=32)))


def lm_loss(model, idx):
    logits = model(idx[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), idx[:, 1:].reshape(-1))


@pytest.mark.parametrize("n", [2, 32, 128])
def test_hadamard_is_orthogonal(n):
    H = hadamard_matrix(n, torch.float64)
    torch.testing.assert_close(H @ H.T, torch.eye(n, dtype=torch.float64))
    x = torch.randn(5, 3 * n, dtype=torch.float64)
    torch.testing.assert_close(hadamard_transform(hadamard_transform(x, n), n), x)  # its own inverse
    torch.testing.assert_close(hadamard_transform(x, n).norm(dim=-1), x.norm(dim=-1))


def test_hadamard_block_falls_back_to_power_of_two_divisor():
    assert hadamard_block_size(512, 128) == 128
    assert hadamard_block_size(96, 128) == 32
    assert hadamard_block_size(32, 128) == 32
    with pytest.raises(QuantdynError, match="no even divisor"):
        hadamard_block_size(129, 128)
    with pytest.raises(QuantdynError, match="power of two"):
        QATConfig(hadamard_block=100)


def test_gaussian_clip_table_matches_numeric_optimum():
    assert GAUSSIAN_OPTIMAL_CLIP[4] == pytest.approx(2.514, abs=1e-3)
    for b in (2, 4):
        assert gaussian_optimal_clip(b, points=100_001, iters=40) == pytest.approx(GAUSSIAN_OPTIMAL_CLIP[b], abs=2e-3)


def test_minmax_ste_gradient_is_identity():
    x = torch.randn(4, 64, requires_grad=True)
    minmax_fake_quant(x, 4).mul(torch.arange(64.0)).sum().backward()
    torch.testing.assert_close(x.grad, torch.arange(64.0).expand(4, 64))


def _rtn_rows(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """PTQ's round-to-nearest (quantize/primitives.py, asymmetric, one group per row) of every row of the last
    dim: (dequantized values, uint8 codes), both shaped like ``x``."""
    W_hat, codes, *_ = rtn_weight(x.reshape(-1, x.shape[-1]), bits, sym=False, group_size=0)
    return W_hat.reshape(x.shape), codes.reshape(x.shape)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_minmax_qat_is_ptq_rtn_on_the_same_grid(bits):
    """QAT's 'ste' fake quantization (weights per output row, activations per token) is PTQ's RTN grid of
    quantize/primitives.py: the same values bit for bit and the same integer codes."""
    torch.manual_seed(bits)
    W = torch.randn(48, 64) * torch.logspace(-3, 1, 48).unsqueeze(1)  # rows of very different ranges
    W[0] = 0.0  # an all-zero row
    W[1] = W[1].abs()  # a row with no negative entry
    x = torch.randn(2, 5, 64)  # (batch, tokens, features)
    cfg = QATConfig(method="ste", w_bits=bits, a_bits=bits)
    for t, qat in ((W, fake_quantize_weight(W, cfg)), (x, minmax_fake_quant(x, bits))):
        values, codes = _rtn_rows(t, bits)
        assert torch.equal(qat, values)
        rows = t.reshape(-1, t.shape[-1])
        scales, zeros = find_params(rows, bits, sym=False)
        qat_codes = quantize_codes(qat.reshape(rows.shape), scales.unsqueeze(1), zeros.unsqueeze(1), 2**bits - 1)
        assert torch.equal(qat_codes.to(torch.uint8).reshape(t.shape), codes)
    lin = nn.Linear(64, 48)
    lin.weight.data.copy_(W)
    with torch.no_grad():  # the QAT layer is the plain linear on RTN'd inputs and weights
        expected = F.linear(_rtn_rows(x, bits)[0], _rtn_rows(W, bits)[0], lin.bias)
        assert torch.equal(QATLinear.from_linear(lin, cfg)(x), expected)


def test_minmax_grid_by_hand():
    """2 bits on [-1, 2]: scale 1, zero 1, levels -1, 0, 1, 2 (0.5 rounds to even); a row >= 0 keeps 0 as its
    lowest level; an all-zero row stays zero."""
    x = torch.tensor([[-1.0, 0.0, 0.5, 2.0], [0.0, 0.9, 1.6, 3.0], [0.0, 0.0, 0.0, 0.0]])
    expected = torch.tensor([[-1.0, 0.0, 0.0, 2.0], [0.0, 1.0, 2.0, 3.0], [0.0, 0.0, 0.0, 0.0]])
    assert torch.equal(minmax_fake_quant(x, 2), expected)
    assert torch.equal(minmax_fake_quant(x.unsqueeze(0), 2), expected.unsqueeze(0))  # per token along the last dim


def test_quest_trust_mask_gradient():
    torch.manual_seed(0)
    x = torch.randn(8, 128)
    x[:, 0] = 20.0  # outliers beyond the clipping scale
    x.requires_grad_(True)
    quest_fake_quant(x, 4, trust_mask=True).sum().backward()
    s = GAUSSIAN_OPTIMAL_CLIP[4] * x.detach().pow(2).mean(-1, keepdim=True).sqrt()
    inside = x.detach().abs() <= s
    assert (~inside).any() and inside.any()
    torch.testing.assert_close(x.grad, inside.float())  # identity inside, zero outside
    x.grad = None
    quest_fake_quant(x, 4, trust_mask=False).sum().backward()
    torch.testing.assert_close(x.grad, torch.ones_like(x))


def test_quest_grid_has_2_to_the_bits_levels():
    x = torch.randn(1, 4096)
    assert torch.unique(quest_fake_quant(x, 4)).numel() == 16


def test_quest_beats_minmax_on_gaussian_at_4_bits():
    torch.manual_seed(0)
    W = torch.randn(256, 1024)
    mse_quest = (fake_quantize_weight(W, QATConfig(method="quest", w_bits=4)) - W).pow(2).mean()
    mse_minmax = (fake_quantize_weight(W, QATConfig(method="ste", w_bits=4)) - W).pow(2).mean()
    assert mse_quest < 0.8 * mse_minmax, (mse_quest, mse_minmax)


@pytest.mark.parametrize("method", ["quest", "ste"])
def test_qat_model_trains_and_strips(method):
    model = tiny_gpt()
    names = [n for n, _ in model.named_parameters()]
    cfg = QATConfig(method=method, w_bits=4, a_bits=4)
    prepare_qat(model, cfg)
    assert [n for n, _ in model.named_parameters()] == names
    assert sum(isinstance(m, QATLinear) for m in model.modules()) == 8  # 4 linears x 2 blocks
    assert type(model.embed_out) is nn.Linear  # head stays full precision
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    idx = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(10):
        loss = lm_loss(model, idx)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses
    state = model.state_dict()
    strip_qat(model)
    assert not any(isinstance(m, QATLinear) for m in model.modules())
    assert [n for n, _ in model.named_parameters()] == names
    plain = tiny_gpt(seed=5)
    plain.load_state_dict(state)  # a QAT checkpoint loads into a plain model (strict)
    torch.testing.assert_close(plain(idx), model(idx))


def test_fake_quantize_weights_is_the_weight_only_qat_forward():
    idx = torch.randint(0, 64, (2, 16))
    cfg = QATConfig(method="quest", w_bits=4, a_bits=None)
    qat = prepare_qat(tiny_gpt(), cfg)
    deployed = fake_quantize_weights_(tiny_gpt(), cfg)
    with torch.no_grad():
        torch.testing.assert_close(deployed(idx), qat(idx), atol=1e-5, rtol=1e-4)


def test_fake_quant_forward_context_restores_the_model():
    model = tiny_gpt()
    idx = torch.randint(0, 64, (2, 16))
    cfg = QATConfig(method="quest", w_bits=4, a_bits=4)
    with torch.no_grad():
        ref = model(idx)
        with fake_quant_forward(model, cfg) as m:
            wa = m(idx)
        after = model(idx)
        qat = prepare_qat(tiny_gpt(), cfg)(idx)
    torch.testing.assert_close(wa, qat)
    torch.testing.assert_close(after, ref)
    assert not torch.allclose(wa, ref)
    assert not any(isinstance(m, QATLinear) for m in model.modules())


def test_config_errors():
    with pytest.raises(QuantdynError, match="did you mean 'quest'"):
        QATConfig(method="qest")
    with pytest.raises(QuantdynError, match="w_bits"):
        QATConfig(w_bits=9)
