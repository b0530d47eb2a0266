"""GGUF block types and llama.cpp's mixes against llama.cpp itself and the ``gguf`` package.

References (tests/README.md, "GGUF reference fixtures"):
* tests/fixtures/gguf_reference.safetensors: the bytes ggml's ``ggml_quantize_chunk`` (llama.cpp 0c1e570)
  wrote for a 32 x 512 weight of varied rows, for every type without and with an importance matrix;
* tests/fixtures/gguf_llamacpp.json: the type ``llama_model_quantize`` gave every tensor of 16-block GPT-NeoX
  and LLaMA models under Q3_K_M / Q4_K_M / Q5_K_M;
* the ``gguf`` package's own ``quantize`` (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), run here.

The k-quants' scale searches compare float sums; quantdyn accumulates every sum in ggml's left-to-right
order, so no code may differ: the measured fraction of differing codes is 0 for every type (not merely
below the 0.1 % the issue allows), and these tests require exactly that.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from quantdyn.errors import QuantdynError
from quantdyn.quantize import gguf as qg
from quantdyn.quantize import gguf_mixes
from quantdyn.quantize.catalogue import TensorSite, config_for_tensor, parse_quantizer
from quantdyn.quantize.formats import imatrix_from_stats
from quantdyn.quantize.gptq import stats_update

FIX = Path(__file__).parent / "fixtures"
pytestmark = pytest.mark.numerics


@pytest.fixture(scope="module")
def reference():
    return load_file(str(FIX / "gguf_reference.safetensors"))


def dequant_bound(q: qg.GGUFQuant) -> torch.Tensor:
    """|W_a - W_b| allowed between two dequantizers of the same blocks that multiply in another order: ggml forms
    (d * sc) * L - dmin * m in float32, three roundings of at most half an ulp each, so the two results differ by
    at most 3 ulps of the largest term, |d sc L| + |dmin m| <= |W| + 2 |dmin m| (taken as 4 |W| + the block step)."""
    step, _ = q.step_and_zero()
    g = q.ggml.group
    return 3 * torch.finfo(torch.float32).eps * (4 * q.weight.abs() + step.repeat_interleave(g, 1).abs())


@pytest.mark.parametrize("t,with_imatrix", [(t, False) for t in qg.GGML_TYPES]
                         + [(t, True) for t in qg.GGML_TYPES if t != "q8_0"])  # ggml's Q8_0 ignores an imatrix
def test_block_types_bit_exact_against_ggml(reference, t, with_imatrix):
    W, im = reference["W"], reference["imatrix"]
    ref_bytes = reference[f"{t}.imatrix" if with_imatrix else f"{t}.ref"]
    q = qg.quantize_gguf(W, t, im if with_imatrix else None)
    ref = qg.unpack_gguf(ref_bytes, t, W.shape[1])
    differing = (q.codes != ref.codes).float().mean().item()
    assert differing == 0.0, f"{t}: {differing:.4%} of the codes differ from ggml's"
    for k in ref.fields:
        assert torch.equal(q.fields[k].view(torch.uint8) if q.fields[k].dtype == torch.float16 else q.fields[k],
                           ref.fields[k].view(torch.uint8) if ref.fields[k].dtype == torch.float16 else ref.fields[k]), k
    assert torch.equal(qg.pack_gguf(q), ref_bytes)  # every byte of every block
    assert torch.equal(qg.pack_gguf(ref), ref_bytes)  # unpack/pack is the identity on ggml's bytes
    gguf = pytest.importorskip("gguf")
    theirs = torch.from_numpy(gguf.quants.dequantize(ref_bytes.numpy(), getattr(gguf.GGMLQuantizationType, ref.ggml.name.upper())))
    assert ((q.weight - theirs).abs() <= dequant_bound(q)).all()


def test_dequant_bound_catches_a_wrong_scale(reference):
    """The bound above is tight enough to see a super-block scale off by one fp16 ulp."""
    q = qg.quantize_gguf(reference["W"], "q4_k")
    f = dict(q.fields)
    d = f["d"].clone()
    d.view(torch.int16)[0, 0] += 1
    f["d"] = d
    wrong = qg.dequantize_fields("q4_k", q.codes, f)
    assert not ((q.weight - wrong).abs() <= dequant_bound(q)).all()


@pytest.mark.parametrize("t", ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0"])
def test_legacy_types_equal_the_gguf_package(t):
    gguf = pytest.importorskip("gguf")
    g = torch.Generator().manual_seed(7)
    W = torch.cat([torch.randn(64, 256, generator=g) * 0.02, (torch.randn(64, 256, generator=g) * 0.02).bfloat16().float(),
                   torch.randint(-7, 8, (32, 256), generator=g) * 0.25])
    theirs = gguf.quants.quantize(W.numpy(), getattr(gguf.GGMLQuantizationType, t.upper()))
    assert torch.equal(qg.pack_gguf(qg.quantize_gguf(W, t)), torch.from_numpy(theirs))


def test_roundtrip_and_step_zero_layout():
    g = torch.Generator().manual_seed(3)
    W = torch.randn(8, 512, generator=g) * 0.05
    for t in qg.GGML_TYPES:
        q = qg.quantize_gguf(W, t)
        back = qg.unpack_gguf(qg.pack_gguf(q), t, 512)
        assert torch.equal(back.codes, q.codes) and torch.equal(back.weight, q.weight), t
        step, zero = q.step_and_zero()
        approx = step.repeat_interleave(q.ggml.group, 1) * (q.codes.float() - zero.repeat_interleave(q.ggml.group, 1))
        assert torch.allclose(approx, q.weight, rtol=0, atol=1e-5), t  # the generic (scale, zero) view of the blocks
        assert int(q.codes.max()) < 2 ** q.ggml.bits


def test_mix_recipes_equal_llama_quantize():
    """Every tensor of 16-block GPT-NeoX and LLaMA models gets the type llama.cpp's quantizer gave it."""
    ref = json.loads((FIX / "gguf_llamacpp.json").read_text())
    cat = {v: k for k, v in {**gguf_mixes.TENSOR_CATEGORY}.items()}  # gguf name -> a block path of that category
    cat.update({"attn_qkv": "attention.query_key_value", "attn_output": "attention.dense", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "ffn_gate": "mlp.gate_proj"})
    checked = 0
    for model, entry in ref["models"].items():
        for mix, types in entry["recipes_16_blocks"].items():
            for name, want in types.items():
                if want == "F32" or name.startswith("token_embd"):
                    continue  # 1-D tensors; quantdyn keeps embeddings in full precision
                shape_in = {"ffn_down": 320 if model == "llama" else 512}.get(name.split(".")[-2], 256)
                if name.startswith("output."):
                    site = TensorSite("lm_head", -1, 16, (256, 256))
                else:
                    block, role = int(name.split(".")[1]), name.split(".")[2]
                    site = TensorSite(cat[role], block, 16, (0, shape_in))
                cfg, notes = config_for_tensor(parse_quantizer(mix), site)
                assert cfg.method == want.lower(), (model, mix, name, cfg.method, want)
                checked += 1
    assert checked == 2 * 3 * (16 * 4 + 1) + 3 * 16 * 3  # NeoX 4 linears, LLaMA 7, per block; plus the heads


def test_fallback_is_recorded_and_impossible_rows_refused():
    cfg, notes = config_for_tensor(parse_quantizer("q4_k_m-imatrix"), TensorSite("mlp.down_proj", 2, 8, (256, 320)))
    assert cfg.method == "q5_0-imatrix" and notes["gguf_fallback_from"] == "q4_K"
    cfg, notes = config_for_tensor(parse_quantizer("q6_k"), TensorSite("mlp.down_proj", 0, 8, (256, 96)))
    assert cfg.method == "q8_0" and notes["gguf_fallback_from"] == "q6_K"
    with pytest.raises(QuantdynError, match=r"^layer mlp.dense_4h_to_h of block 2: rows of 100 weights fit no GGUF"):
        config_for_tensor(parse_quantizer("q4_k"), TensorSite("mlp.dense_4h_to_h", 2, 4, (64, 100)))
    with pytest.raises(QuantdynError, match="needs a multiple of 256"):
        qg.quantize_gguf(torch.randn(4, 320), "q4_k")  # the pure function refuses; the engine falls back first


def test_imatrix_is_mean_square_activation():
    """llama-imatrix's importance: per input column, sum of x^2 over tokens / tokens, from the walk's Hessian."""
    g = torch.Generator().manual_seed(0)
    X = torch.randn(3, 7, 16, generator=g) * torch.linspace(0.1, 3, 16)
    stats = None
    for x in X:
        stats = stats_update(stats, x[None])
    want = (X.reshape(-1, 16).double() ** 2).mean(0).float()
    assert torch.allclose(imatrix_from_stats(stats), want, rtol=1e-5)


def test_imatrix_changes_decisions_and_bad_imatrix_is_refused():
    g = torch.Generator().manual_seed(1)
    W = torch.randn(16, 256, generator=g) * 0.02
    im = torch.rand(256, generator=g) ** 4
    assert not torch.equal(qg.quantize_gguf(W, "q4_k").codes, qg.quantize_gguf(W, "q4_k", im).codes)
    # Q8_0 ignores it, as ggml does
    assert torch.equal(qg.quantize_gguf(W, "q8_0").codes, qg.quantize_gguf(W, "q8_0", im).codes)
    for bad, msg in [(torch.ones(255), "255 entries"), (-im, "non-negative"), (im * float("nan"), "finite")]:
        with pytest.raises(QuantdynError, match=msg):
            qg.quantize_gguf(W, "q4_k", bad)


def test_weighted_error_is_lower_with_the_imatrix():
    """The point of the importance matrix: the error weighted by it drops (on columns with large activations)."""
    g = torch.Generator().manual_seed(2)
    W = torch.randn(64, 512, generator=g) * 0.02
    im = torch.rand(512, generator=g) ** 6 * 100
    for t in ("q3_k", "q4_k", "q4_0"):
        plain, weighted = qg.quantize_gguf(W, t), qg.quantize_gguf(W, t, im)
        err = lambda q: float((((q.weight - W) ** 2) * im).sum())  # noqa: E731
        assert err(weighted) < err(plain), t


def test_a_block_type_is_one_consistent_object():
    """Everything the rest of quantdyn asks of a type comes from its object: the bytes pack() lays out fill
    exactly type_size per block, the fallback is a 32-weight type, file types are distinct, and the GGUF
    export and the quantizer catalogue list every registered type."""
    from quantdyn.export.gguf import _file_type
    from quantdyn.quantize.catalogue import QUANTIZERS

    W = torch.randn(2, 512, generator=torch.Generator().manual_seed(5)) * 0.03
    file_types = set()
    for t in qg.GGML_TYPES:
        g = qg.GGML_TYPES.get(t)
        assert g.name.lower() == t and g.bits_per_weight == g.type_size * 8 / g.block
        assert qg.pack_gguf(qg.quantize_gguf(W, t)).shape == (2, 512 // g.block * g.type_size), t
        assert g.fallback is None or qg.GGML_TYPES.get(g.fallback).block == qg.QK, t
        assert t in QUANTIZERS and (f"{t}-imatrix" in QUANTIZERS) == g.takes_imatrix and _file_type(t) == g.file_type
        file_types.add(g.file_type)
    for m in gguf_mixes.MIXES:
        assert m in QUANTIZERS and gguf_mixes.MIXES.get(m).default in qg.GGML_TYPES
        file_types.add(_file_type(m))
    assert len(file_types) == len(qg.GGML_TYPES) + len(gguf_mixes.MIXES)
