"""Error propagation (paper B): R = A + B + C exactly, gains, identical models."""
from __future__ import annotations

import copy

import pytest
import torch
from propagation_reference import gpt_error_propagation

from quantdyn.analysis.propagation import error_propagation
from quantdyn.errors import QuantdynError
from quantdyn.models.gpt import GPT, ModelConfig, resolve_model_config


def _blocks(seed: int, n: int, d: int, noise: float):
    g = torch.Generator().manual_seed(seed)
    Ws = [torch.randn(d, d, generator=g) / d**0.5 for _ in range(n)]
    Wq = [W + noise * torch.randn(d, d, generator=g) / d**0.5 for W in Ws]
    fp = [lambda h, W=W: h + torch.tanh(h @ W) for W in Ws]
    q = [lambda h, W=W: h + torch.tanh(h @ W) for W in Wq]
    return fp, q


def test_decomposition_is_exact_and_gain_uses_previous_R():
    fp, q = _blocks(0, 4, 16, noise=0.1)
    h0 = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(1))
    h0_q = h0 + 0.05 * torch.randn(h0.shape, generator=torch.Generator().manual_seed(2))
    rows = error_propagation(fp, q, h0, h0_q)
    assert [r["block"] for r in rows] == [0, 1, 2, 3]
    r0 = float(((h0_q - h0).double() ** 2).sum() / (h0.double() ** 2).sum())
    assert rows[0]["R_prev"] == pytest.approx(r0, rel=1e-12)
    for prev, r in zip([None] + rows[:-1], rows):
        assert r["A"] + r["B"] + r["C"] == pytest.approx(r["R"], rel=1e-12, abs=1e-15)
        assert r["C"] == pytest.approx(r["C_cross"] + r["C_interaction"], rel=1e-12, abs=1e-15)
        assert r["A"] > 0 and r["B"] > 0
        expected_prev = r0 if prev is None else prev["R"]
        assert r["gain"] == pytest.approx(r["A"] / expected_prev, rel=1e-12)


def test_identity_blocks_carry_the_input_error_with_gain_one():
    ident = [lambda h: h] * 3
    h0 = torch.randn(4, 8)
    rows = error_propagation(ident, ident, h0, h0 + 0.1)
    for r in rows:
        assert r["R"] == pytest.approx(rows[0]["R_prev"]) and r["A"] == pytest.approx(r["R"])
        assert r["B"] == 0 and r["C"] == 0 and r["gain"] == pytest.approx(1.0)


def test_identical_blocks_give_zero_and_undefined_gain():
    fp, _ = _blocks(0, 3, 8, noise=0.0)
    rows = error_propagation(fp, fp, torch.randn(2, 4, 8))
    for r in rows:
        assert r["R"] == r["A"] == r["B"] == r["C"] == 0.0
        assert r["gain"] is None and r["R_prev"] == 0.0
    with pytest.raises(QuantdynError, match="same architecture"):
        error_propagation(fp, fp[:2], torch.randn(2, 8))


def _round_blocks_(model: GPT, levels: int = 3) -> GPT:
    """A stand-in quantizer: per-row symmetric rounding of every block linear to 2·levels+1 values."""
    with torch.no_grad():
        for block in model.gpt_neox.layers:
            for m in block.modules():
                if isinstance(m, torch.nn.Linear):
                    step = m.weight.abs().amax(dim=1, keepdim=True) / levels
                    m.weight.copy_(torch.round(m.weight / step) * step)
    return model


def test_gpt_wrapper_quantized_copy():
    torch.manual_seed(0)
    fp = GPT(resolve_model_config(ModelConfig(vocab_size=64, n_layer=2, d_model=32, n_head=2, max_seq_len=32)))
    q = _round_blocks_(copy.deepcopy(fp))
    ids = torch.randint(0, 64, (5, 16), generator=torch.Generator().manual_seed(0))
    rows = gpt_error_propagation(fp, q, ids, batch_size=2)
    assert len(rows) == 2
    assert rows[0]["R_prev"] == 0.0 and rows[0]["gain"] is None  # embedding not quantized
    assert rows[0]["A"] == 0.0 and rows[0]["B"] > 0 and rows[0]["R"] == pytest.approx(rows[0]["B"])
    assert rows[1]["R_prev"] == rows[0]["R"] and rows[1]["gain"] == pytest.approx(rows[1]["A"] / rows[0]["R"])
    for r in rows:
        assert r["A"] + r["B"] + r["C"] == pytest.approx(r["R"], rel=1e-9, abs=1e-15)
    # accumulation over chunks == one batch
    one = gpt_error_propagation(fp, q, ids, batch_size=5)
    for a, b in zip(rows, one):
        assert a["R"] == pytest.approx(b["R"], rel=1e-6) and a["A"] == pytest.approx(b["A"], rel=1e-6)
    same = gpt_error_propagation(fp, copy.deepcopy(fp), ids)
    assert all(r["R"] == 0 and r["A"] == 0 and r["B"] == 0 and r["C"] == 0 for r in same)


def test_generic_wrapper_matches_gpt_wrapper_and_runs_on_hf_llama():
    from propagation_reference import model_error_propagation

    torch.manual_seed(0)
    fp = GPT(resolve_model_config(ModelConfig(vocab_size=64, n_layer=2, d_model=32, n_head=2, max_seq_len=32)))
    q = _round_blocks_(copy.deepcopy(fp))
    ids = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(0))
    for a, b in zip(model_error_propagation(fp, q, ids, batch_size=2), gpt_error_propagation(fp, q, ids, batch_size=2)):
        assert a.keys() == b.keys() and (a["gain"] is None) == (b["gain"] is None)
        for k in ("R", "A", "B", "C", "R_prev", "h_norm_sq"):
            assert a[k] == pytest.approx(b[k], rel=1e-9, abs=1e-15)

    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32))
    with torch.no_grad():
        hf_q = copy.deepcopy(hf)
        for layer in hf_q.model.layers:
            for m in layer.modules():
                if isinstance(m, torch.nn.Linear):
                    step = m.weight.abs().amax(dim=1, keepdim=True) / 3
                    m.weight.copy_(torch.round(m.weight / step) * step)
    rows = model_error_propagation(hf, hf_q, ids)
    assert len(rows) == 2 and rows[0]["B"] > 0 and rows[1]["A"] > 0
    for r in rows:
        assert r["A"] + r["B"] + r["C"] == pytest.approx(r["R"], rel=1e-9, abs=1e-15)
    same = model_error_propagation(hf, copy.deepcopy(hf), ids)
    assert all(r["R"] == 0 for r in same)
