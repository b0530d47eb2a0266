"""Quantization grid, quantize/dequantize, RTN, configs and short names."""
from __future__ import annotations

import pytest
import torch

from quantdyn.errors import QuantdynError
from quantdyn.quantize import PRESETS, QUANTIZERS, QuantConfig, num_threads, parse_quantizer, quant_preset
from quantdyn.quantize.primitives import (
    check_bits,
    dequantize_codes,
    dequantize_weight,
    fake_quantize,
    find_params,
    group_index,
    group_params,
    quantize_codes,
    quantize_weight,
)
from quantdyn.quantize.rtn import rtn

pytestmark = pytest.mark.numerics  # rerun under other MKL code paths by `make test-isa`


def test_grid_asym_and_sym_by_hand():
    x = torch.tensor([[-1.0, 0.5, 2.0], [0.5, 1.0, 3.0], [0.0, 0.0, 0.0]])
    s, z = find_params(x, 2, sym=False)  # maxq 3
    # row 0: [-1, 2] -> scale 1, zero 1; row 1: [0, 3] (0 in range) -> scale 1, zero 0; row 2: [-1, 1]
    assert torch.equal(s, torch.tensor([1.0, 1.0, 2 / 3]))
    assert torch.equal(z, torch.tensor([1.0, 0.0, 2.0]))
    s, z = find_params(x, 2, sym=True)
    # row 0: max(|-1|, 2) = 2 -> [-2, 2], scale 4/3, zero (3+1)/2 = 2
    # row 1: no negative entry: the reference keeps xmin = 0 -> [0, 3], scale 1, zero 2
    assert torch.allclose(s, torch.tensor([4 / 3, 1.0, 2 / 3]))
    assert torch.equal(z, torch.tensor([2.0, 2.0, 2.0]))


def test_codes_clamp_and_round_half_even():
    s, z = torch.tensor([[1.0]]), torch.tensor([[1.0]])
    q = quantize_codes(torch.tensor([[-5.0, -0.5, 0.5, 1.5, 9.0]]), s, z, 3)
    assert q.tolist() == [[0.0, 1.0, 1.0, 3.0, 3.0]]


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("sym", [False, True])
def test_quantize_dequantize_exact_inverses_on_grid(bits, sym):
    torch.manual_seed(bits)
    W = torch.randn(16, 64) * torch.rand(16, 1) * 10
    scales, zeros = group_params(W, bits, sym, 16)
    g_idx = group_index(64, 16)
    codes = torch.randint(0, 2**bits, (16, 64), dtype=torch.uint8)
    grid_values = dequantize_weight(codes, scales, zeros, g_idx)
    assert torch.equal(quantize_weight(grid_values, scales, zeros, g_idx, bits), codes)
    again = dequantize_weight(quantize_weight(grid_values, scales, zeros, g_idx, bits), scales, zeros, g_idx)
    assert torch.equal(again, grid_values)
    # fake_quantize is idempotent
    fq = fake_quantize(W, scales[:, :1], zeros[:, :1], 2**bits - 1)
    assert torch.equal(fake_quantize(fq, scales[:, :1], zeros[:, :1], 2**bits - 1), fq)


def test_groups_partial_last_group_and_rtn_matches_manual():
    torch.manual_seed(0)
    W = torch.randn(8, 80)
    cfg = QuantConfig(method="rtn", bits=3, group_size=32)
    r = rtn(W, cfg)
    assert r.scales.shape == (8, 3) and r.g_idx.tolist() == [j // 32 for j in range(80)]
    for k, a in enumerate(range(0, 80, 32)):
        s, z = find_params(W[:, a:a + 32], 3, False)
        assert torch.equal(r.scales[:, k], s) and torch.equal(r.zeros[:, k], z)
        assert torch.equal(r.weight[:, a:a + 32], fake_quantize(W[:, a:a + 32], s[:, None], z[:, None], 7))
    assert torch.equal(r.weight, dequantize_weight(r.codes, r.scales, r.zeros, r.g_idx))
    assert int(r.codes.max()) <= 7


def test_per_row_and_mse_clipping_helps_heavy_tails():
    torch.manual_seed(1)
    W = torch.randn(32, 256)
    W[:, 0] = 25.0  # one outlier per row
    plain = rtn(W, QuantConfig(method="rtn", bits=3, group_size=0))
    clipped = rtn(W, QuantConfig(method="rtn", bits=3, group_size=0, mse=True))
    assert plain.scales.shape == (32, 1)
    err = lambda r: float(((r.weight - W).abs() ** 2.4).sum())
    assert err(clipped) < err(plain)
    assert clipped.diagnostics["clipped_fraction"] > 0 == plain.diagnostics["clipped_fraction"]


def test_dequantize_codes_formula():
    assert float(dequantize_codes(torch.tensor(5.0), torch.tensor(0.5), torch.tensor(2.0))) == 1.5


@pytest.mark.parametrize("bits", [1, 9, 0, 3.5, True])
def test_bad_bits_are_one_clear_error(bits):
    with pytest.raises(QuantdynError, match="bits"):
        check_bits(bits)
    if isinstance(bits, int) and not isinstance(bits, bool):
        with pytest.raises(QuantdynError, match="from 2 to 8"):
            QuantConfig(bits=bits)


def test_config_validation_and_nan():
    with pytest.raises(QuantdynError, match="group_size"):
        QuantConfig(group_size=-5)
    assert QuantConfig(group_size=None).group_size == 0
    with pytest.raises(QuantdynError, match="write 0"):  # GPTQModel's spelling of per-row groups; one spelling here
        QuantConfig(group_size=-1)
    with pytest.raises(QuantdynError, match="exclude"):
        QuantConfig(act_order=True, act_group_aware=True)
    with pytest.raises(QuantdynError, match="did you mean 'gptq'"):
        QuantConfig(method="gtpq")
    W = torch.randn(4, 8)
    W[1, 2] = float("nan")
    with pytest.raises(QuantdynError, match="NaN"):
        rtn(W, QuantConfig(method="rtn"))
    with pytest.raises(QuantdynError, match="empty"):
        rtn(torch.zeros(0, 8), QuantConfig(method="rtn"))


def test_short_names_presets_and_dicts():
    integer = [n for n in QUANTIZERS.names() if QUANTIZERS.get(n).format is None]
    assert integer == ["awq", "gptq", "rtn"]  # the deployment formats: tests/test_formats_config.py
    c = parse_quantizer("gptq3")
    assert (c.method, c.bits, c.group_size, c.sym, c.damp_percent, c.act_order) == ("gptq", 3, 128, False, 0.01, False)
    c = parse_quantizer("rtn2g64-sym")
    assert (c.method, c.bits, c.group_size, c.sym) == ("rtn", 2, 64, True)
    assert parse_quantizer("awq4g0").group_size == 0
    g = parse_quantizer("gptq4-gptqmodel")
    assert (g.sym, g.act_order, g.damp_percent, g.damp_auto_increment, g.true_sequential, g.static_groups) == (
        True, True, 0.05, 0.01, True, False)
    v5 = parse_quantizer("gptq3g64-gptqmodel-v5")
    assert (v5.act_order, v5.act_group_aware, v5.group_size, v5.bits) == (False, True, 64, 3)
    assert parse_quantizer({"preset": "gptqmodel", "bits": 3}) == quant_preset("gptqmodel", bits=3)
    assert parse_quantizer({"name": "gptq4", "sym": True}).sym is True
    ref = quant_preset("reference")
    assert ref == QuantConfig() and set(PRESETS) == {"reference", "gptqmodel", "gptqmodel-v5"}
    for bad, msg in [("gptq9", "from 2 to 8"), ("gpq4", "did you mean 'gptq'"), ("gptq4-gptqmodle", "gptqmodel"),
                     ("4bit", "cannot read"), ({"method": "rtn", "bitz": 4}, "did you mean 'bits'")]:
        with pytest.raises(QuantdynError, match=msg):
            parse_quantizer(bad)


def test_num_threads_restores():
    before = torch.get_num_threads()
    with num_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with num_threads(None):
        assert torch.get_num_threads() == before
