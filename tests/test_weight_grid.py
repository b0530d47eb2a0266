"""Is a checkpoint already quantized underneath (analysis/grid.py, issue 50.8)?

The counts asserted here are the figures the module's threshold rests on: float weights have 32 distinct values
in almost every 32-weight block in float32, float16 and bfloat16; a q4_0- or RTN4-dequantized weight at most 16
(median 13); a blockwise 8-level grid at most 8. Through measure(): a model dequantized from q4_0 is said to be on
a 4-bit grid in its rows and the CLI summary, a float model is not."""
from __future__ import annotations

import pytest
import torch

from quantdyn.analysis.grid import (GRID_MAX_LEVELS, block_levels, grid_bits, grid_verdict, median_levels,
                                    rows_grid_note)
from quantdyn.engine.blockwise import quantize_weight
from quantdyn.quantize.catalogue import parse_quantizer

STD = 0.02  # a GPT-style init, the scale real checkpoints' weights have


def gaussian(out=256, n_in=1024, seed=0, dtype=torch.float32):
    return (torch.randn(out, n_in, generator=torch.Generator().manual_seed(seed)) * STD).to(dtype)


def minmax_grid(W: torch.Tensor, levels: int) -> torch.Tensor:
    """Each 32-weight block rounded to ``levels`` evenly spaced values between its min and max."""
    B = W.reshape(-1, 32)
    lo, hi = B.min(1, keepdim=True).values, B.max(1, keepdim=True).values
    step = (hi - lo) / (levels - 1)
    return (((B - lo) / step).round() * step + lo).reshape(W.shape)


def test_block_levels_counts_exactly():
    W = torch.tensor([[0.0] * 16 + [1.0] * 16 + list(range(32))], dtype=torch.float32)  # 2 blocks
    assert block_levels(W).tolist() == [2, 32]
    assert block_levels(W[:, :40]).tolist() == [2]  # the 8-weight remainder is left out
    assert block_levels(W[:, :31]).numel() == 0 and median_levels(W[:, :31]) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_float_weights_are_not_a_grid(dtype):
    for W in (gaussian(dtype=dtype), gaussian(dtype=dtype) * 0.05):  # small magnitudes collide most in bf16
        levels = block_levels(W).float()
        assert levels.median() == 32
        assert levels.quantile(0.01) >= 29  # bf16's 8-bit mantissa: a few collisions, far from 24
    assert grid_verdict({"a": median_levels(gaussian(dtype=torch.bfloat16))}) == (32.0, None)


@pytest.mark.parametrize("quantizer", ["q4_0", "rtn4g32"])
def test_four_bit_dequantized_weights_are_a_four_bit_grid(quantizer):
    W = gaussian()
    res = quantize_weight(W.clone(), None, parse_quantizer(quantizer), "w")
    for dtype in (torch.float32, torch.bfloat16):
        levels = block_levels(res.weight.to(dtype))
        assert levels.max() <= 16  # the grid's 2^4 values, never more
        assert 10 <= levels.float().median() <= 14  # ~13 of 16 occur in 32 Gaussian weights
        assert grid_verdict({"w": median_levels(res.weight.to(dtype))})[1] == "4-bit grid"


def test_eight_levels_are_three_bits_and_a_six_bit_grid_gets_no_verdict():
    assert grid_verdict({"w": median_levels(minmax_grid(gaussian(), 8))}) == (8.0, "3-bit grid")
    levels32, verdict32 = grid_verdict({"w": median_levels(minmax_grid(gaussian(), 32))})
    assert verdict32 == "5-bit grid" and levels32 <= GRID_MAX_LEVELS
    levels64, verdict64 = grid_verdict({"w": median_levels(minmax_grid(gaussian(), 64))})
    assert levels64 > GRID_MAX_LEVELS and verdict64 is None
    assert [grid_bits(x) for x in (2, 4, 8, 13, 16, 19)] == [1, 2, 3, 4, 4, 5]


def test_model_verdict_is_the_median_over_tensors():
    assert grid_verdict({"a": 13.0, "b": 13.0, "c": 32.0}) == (13.0, "4-bit grid")
    assert grid_verdict({"a": 13.0, "b": 32.0, "c": 32.0}) == (32.0, None)
    assert grid_verdict({"a": None}) == (None, None)


def test_rows_note_names_the_gridded_checkpoints_only_when_some_are():
    q4 = {"checkpoint": "q4", "weight_grid_levels": 13.0, "weight_grid": "4-bit grid"}
    fp = {"checkpoint": "fp", "weight_grid_levels": 32.0, "weight_grid": None}
    assert rows_grid_note([fp, {"checkpoint": "old"}]) is None
    all_q4 = rows_grid_note([q4, q4])
    assert all_q4.startswith("weights already on a ~4-bit grid (13 distinct values per 32-weight block)")
    assert "every error here is relative to that grid" in all_q4
    assert "1 of 2 checkpoints: q4" in rows_grid_note([q4, fp])


def test_measure_says_a_q4_dequantized_model_is_on_a_grid_and_a_float_model_is_not():
    from quantdyn.engine.measure import measure
    from quantdyn.engine.rows import grid_fields, ptq_fields
    from quantdyn.engine.measure import MeasureConfig
    from quantdyn.engine.walk import quantize_model
    from quantdyn.models.gpt import GPT, ModelConfig, resolve_model_config

    torch.manual_seed(0)
    model = GPT(resolve_model_config(ModelConfig(n_layer=2, d_model=64, n_head=4, max_seq_len=32, vocab_size=64)))
    windows = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(1))
    fp = measure(model, ["rtn8"], windows)
    assert grid_fields(fp)["weight_grid"] is None and grid_fields(fp)["weight_grid_levels"] == 32
    quantize_model(model, None, "q4_0", progress=False)
    m = measure(model, ["rtn8"], windows)
    assert len(m.weight_levels) == 2 * 4  # every block linear of both blocks: qkv, proj, fc, out
    assert all(v <= 16 for v in m.weight_levels.values())
    row = ptq_fields("rtn8", parse_quantizer("rtn8"), m, MeasureConfig(), 1)
    assert row["weight_grid"] == "4-bit grid" and row["weight_grid_levels"] <= 14
    assert all(r["weight_grid_levels"] <= 16 for r in m.quantizations["rtn8"].rows)  # per tensor, in layer rows


def _store(root, grid: bool):
    from quantdyn.results.store import ResultStore

    rows = [{"key": f"k{i}", "kind": "ptq", "run": "r", "branch": "main", "step": i, "tokens": 10 * i,
             "checkpoint": f"ck{i}", "quantizer": q, "ce_fp": 3.0, "ce_q": 3.1, "delta_ce": 0.1, "delta_ce_se": 0.01,
             "kl": 0.02, "top1_agree": 0.9, "weight_grid_levels": 13.0 if grid else 32.0,
             "weight_grid": "4-bit grid" if grid else None}
            for i, q in ((1, "rtn4"), (2, "rtn4+had"))]
    ResultStore(root).append(rows)
    return root


def test_results_and_the_report_say_it_once_and_only_on_a_grid(cli, tmp_path):
    from quantdyn.report.html import write_page

    said = "weights already on a ~4-bit grid (13 distinct values per 32-weight block): every error here"
    for grid in (True, False):
        st = _store(tmp_path / f"st{grid}", grid)
        r = cli("results", "--store", st)
        assert r.returncode == 0, r.stderr
        assert (r.stdout.splitlines()[-1].startswith(f"note: {said}")) is grid
        r = cli("results", "--store", st, "--out", tmp_path / f"rows{grid}.csv")
        assert (said in r.stdout) is grid and len(r.stdout.splitlines()) == 1 + grid
        page = write_page(st, tmp_path / f"report{grid}").read_text()
        assert page.count("Weights already on a ~4-bit grid") == int(grid)


def test_quantize_says_it_once_on_a_q4_dequantized_checkpoint(cli, hf_models, tmp_path):
    deq = tmp_path / "q4deq"
    args = ("--calib-samples", 2, "--calib-seq-len", 32, "--eval-tokens", 256, "--eval-seq-len", 64, "--quiet")
    assert cli("quantize", hf_models["llama"], "--quantizers", "q4_0", "--out", deq, *args).returncode == 0
    for ckpt, said in ((deq, 1), (hf_models["llama"], 0)):
        r = cli("quantize", ckpt, "--quantizers", "rtn4,rtn8", *args)
        assert r.returncode == 0, r.stderr
        assert r.stdout.count("note: weights already on a ~4-bit grid") == said, r.stdout
