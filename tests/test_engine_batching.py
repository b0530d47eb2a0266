"""GPTQ layers quantized together in the engine (quantize/gptq.py ``gptq_batch``): q/k/v and gate/up (one input,
one Hessian) in one column loop per quantizer, and with ``WalkConfig.batch_quantizers`` every GPTQ quantizer's
layers of a block in one loop. Neither may change a bit of what the walk measures."""
from __future__ import annotations

import pytest
import torch

import quantdyn.engine.blockwise as blockwise
from quantdyn.engine.lazy_model import InMemoryModel
from quantdyn.engine.walk import WalkConfig, walk
from quantdyn.quantize.gptq import gptq

pytestmark = pytest.mark.numerics


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def _walk(model, batch_quantizers: bool | None, monkeypatch, one_at_a_time: bool = False):
    """Codes of every layer and the final hidden states of every variant; the sizes of the gptq_batch calls."""
    calls = []
    real = (lambda problems, **kw: [gptq(*p) for p in problems]) if one_at_a_time else blockwise.gptq_batch
    monkeypatch.setattr(blockwise, "gptq_batch", lambda problems, **kw: calls.append(len(problems)) or real(problems))
    g = torch.Generator().manual_seed(1)
    calib, ev = torch.randint(0, 256, (6, 32), generator=g), torch.randint(0, 256, (4, 32), generator=g)
    codes = {}
    quantizers = {"gptq4": "gptq4", "rtn3": "rtn3", "gptq3g32": "gptq3g32", "gptq4-act": "gptq4-act",
                  "gptq3+had": "gptq3+had"}  # a rotated GPTQ batches on its rotated weights and Hessians
    with walk(InMemoryModel(model), quantizers, calib, {"eval": ev}, "cpu",
              WalkConfig(calib_batch_size=4, batch_quantizers=batch_quantizers),
              on_layer=lambda label, full, res, m: codes.__setitem__((label, full), res.codes.clone())) as w:
        finals = {label: torch.cat([s[i] for i in range(len(s))]) for label, st in w.finals.items()
                  for s in [st["eval"]]}
        rows = {label: v.rows for label, v in w.variants.items()}
    monkeypatch.undo()
    return codes, finals, rows, calls


def test_stacked_layers_and_batched_quantizers_change_no_bit(monkeypatch):
    model = _llama()
    ref_codes, ref_finals, ref_rows, ref_calls = _walk(model, False, monkeypatch, one_at_a_time=True)
    for together in (False, True):
        codes, finals, rows, calls = _walk(model, together, monkeypatch)
        assert codes.keys() == ref_codes.keys() and len(codes) == 5 * 2 * 7  # 5 quantizers x 2 blocks x 7 linears
        assert all(torch.equal(codes[k], ref_codes[k]) for k in codes)
        assert finals.keys() == ref_finals.keys() and all(torch.equal(finals[k], ref_finals[k]) for k in finals)
        for label in rows:  # the rows too: loss, output error, grids' statistics, in the same layer order
            assert [r["layer"] for r in rows[label]] == [r["layer"] for r in ref_rows[label]]
            assert [r["loss"] for r in rows[label]] == [r["loss"] for r in ref_rows[label]]
            assert [r["output_error"] for r in rows[label]] == [r["output_error"] for r in ref_rows[label]]
        # per block and quantizer: q/k/v (3 weights) and gate/up (2) in one loop each (o and down alone); together:
        # each of the four sets for all four GPTQ quantizers at once
        per_block = [12, 4, 8, 4] if together else [3, 2] * 4
        assert calls == per_block * 2, calls


def test_sets_too_large_for_one_loop_are_split(monkeypatch):
    """Above GPTQ_BATCH_ENTRIES a set's layers go in one loop per quantizer, and above that one by one: the same
    bits either way, fewer layers per gptq_batch call."""
    model = _llama()
    ref_codes, ref_finals, _, _ = _walk(model, True, monkeypatch)
    # one quantizer's q/k/v: (64 + 32 + 32) x 64 = 8,192 entries, its o 4,096, gate/up 20,480, down 10,240: at a
    # cap of 8,192 each quantizer's q/k/v share a loop and the rest goes one by one; below 4,096 everything does
    for cap, per_block in ((128 * 64, [3, 3, 3, 3]), (64 * 64 - 1, [])):
        monkeypatch.setattr(blockwise, "GPTQ_BATCH_ENTRIES", cap)
        codes, finals, _, calls = _walk(model, True, monkeypatch)
        assert all(torch.equal(codes[k], ref_codes[k]) for k in ref_codes)
        assert all(torch.equal(finals[k], ref_finals[k]) for k in ref_finals)
        assert calls == per_block * 2, (cap, calls)
