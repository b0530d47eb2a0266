"""Exports (quantdyn/export): bit packing against hand-made words and the libraries' own packers,
read-back of every format/quantizer exactly, loading through transformers with the same CE as
quantdyn's fake-quantized model, streaming/sharding/atomicity, bad input refused before anything
is written, and the hub push failing in one line offline."""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from quantdyn.engine.walk import quantize_model
from quantdyn.engine.writer import export_model
from quantdyn.errors import QuantdynError
from quantdyn.export import check_exportable, open_export, push_to_hub, read_export
from quantdyn.export.packing import pack_rows, unpack_rows
from quantdyn.models.gpt import GPT, ModelConfig, resolve_model_config
from quantdyn.quantize import parse_quantizer

V = 128


def _tiny(kind: str) -> nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    if kind == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                                bos_token_id=0, eos_token_id=0)).eval()
    if kind == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(
            vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, max_position_embeddings=64)).eval()
    return GPT(resolve_model_config(ModelConfig(preset="tiny-2x64", vocab_size=V))).eval()


def _ids(n: int, L: int, seed: int) -> torch.Tensor:
    return torch.randint(0, V, (n, L), generator=torch.Generator().manual_seed(seed))


_CACHE: dict = {}


def _quantized(kind: str, spec: str):
    """(fp model, fake-quantized model, ModelQuantization), cached per module run."""
    if (kind, spec) not in _CACHE:
        fp = _tiny(kind)
        q = copy.deepcopy(fp)
        res = quantize_model(q, _ids(8, 24, 0), spec, progress=False)
        _CACHE[kind, spec] = (fp, q, res)
    return _CACHE[kind, spec]


def _weights(model: nn.Module, res) -> dict[str, torch.Tensor]:
    """Quantized layers' weights as (out, in) (GPT-2's Conv1D stores them transposed)."""
    from quantdyn.models.adapters import get_weight

    names = {k.rsplit(".", 1)[0] for k in res.packed if k.endswith(".codes")}
    mods = dict(model.named_modules())
    return {n: get_weight(mods[n]).detach() for n in names}


# ----------------------------------------------------------------------------- packing


def test_pack_known_words():
    # 4 bits: code j of a word sits at shift 4j
    assert pack_rows(torch.arange(1, 9)[None], 4).tolist() == [[0x87654321]] or \
        pack_rows(torch.arange(1, 9)[None], 4).tolist() == [[0x87654321 - 2**32]]
    # 8 bits, int32 two's complement of the word 0xFF000102
    assert pack_rows(torch.tensor([[2, 1, 0, 255]]), 8).tolist() == [[0xFF000102 - 2**32]]
    # 3 bits: code 10 straddles words 0 and 1 (bits 30, 31 | 0), code 21 words 1 and 2 (bit 31 | 0, 1)
    c = torch.zeros(1, 32, dtype=torch.long)
    c[0, 10] = 0b111
    assert pack_rows(c, 3).tolist() == [[-(2**31) + 2**30, 1, 0]]
    c = torch.zeros(1, 32, dtype=torch.long)
    c[0, 21] = 0b101
    assert pack_rows(c, 3).tolist() == [[0, -(2**31), 0b10]]
    assert pack_rows(torch.full((1, 32), 7), 3).tolist() == [[-1, -1, -1]]
    # a partial group is zero-padded and cut to ceil(n * bits / 32) words
    assert pack_rows(torch.ones(1, 9, dtype=torch.long), 4).shape == (1, 2)


@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_roundtrip(bits):
    g = torch.Generator().manual_seed(bits)
    for n in (1, 7, 32, 40, 96, 131):
        c = torch.randint(0, 2**bits, (5, n), generator=g)
        p = pack_rows(c, bits)
        assert p.dtype == torch.int32 and p.shape == (5, -(-n * bits // 32))
        assert torch.equal(unpack_rows(p, bits, n), c.int())


def test_pack_refuses_out_of_range_codes():
    with pytest.raises(QuantdynError, match="outside"):
        pack_rows(torch.tensor([[16]]), 4)
    with pytest.raises(QuantdynError, match="cannot hold exactly"):
        unpack_rows(torch.zeros(1, 3, dtype=torch.int32), 4, 8)


def test_pack_matches_compressed_tensors():
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers",
                                  reason="compressed-tensors not installed (pip install -e '.[export]')")
    if not hasattr(helpers, "pack_to_int32"):
        pytest.skip("this compressed-tensors has no pack_to_int32")
    g = torch.Generator().manual_seed(0)
    for bits in (2, 3, 4, 5, 8):
        for n in (32, 40, 64, 7):
            c = torch.randint(0, 2**bits, (6, n), generator=g)
            signed = (c - 2 ** (bits - 1)).to(torch.int8)
            assert torch.equal(pack_rows(c, bits), helpers.pack_to_int32(signed, bits)), (bits, n)
            back = helpers.unpack_from_int32(pack_rows(c, bits), bits, torch.Size([6, n]))
            assert torch.equal(back.long() + 2 ** (bits - 1), c)


def test_pack_matches_gptqmodel():
    dq = pytest.importorskip("gptqmodel.utils.model_dequant",
                             reason="gptqmodel not installed: it pins numpy==2.2.6, so it lives in `make crosscheck`'s "
                                    "own environment")
    g = torch.Generator().manual_seed(0)
    for bits in (2, 3, 4, 8):
        c = torch.randint(0, 2**bits, (6, 64), generator=g)
        assert torch.equal(pack_rows(c, bits), dq.pack_cols(c, bits, pack_dtype=torch.int32))
        assert torch.equal(unpack_rows(pack_rows(c, bits), bits, 64), dq.unpack_cols(pack_rows(c, bits), bits))


# ----------------------------------------------------------------------------- read back exactly

CASES = [
    ("compressed-tensors", "rtn4g32"), ("compressed-tensors", "rtn8g0-sym"), ("compressed-tensors", "gptq4g32-sym"),
    ("compressed-tensors", "rtn3g32"), ("compressed-tensors", "gptq4g32-gar"),
    ("gptq", "rtn4g32-sym"), ("gptq", "gptq4g32"), ("gptq", "gptq4g32-gptqmodel"), ("gptq", "rtn8g0"),
    ("gptq", "rtn3g32-sym"), ("gptq", "gptq2g32-sym"),
]


@pytest.mark.parametrize("fmt,spec", CASES)
@pytest.mark.parametrize("kind", ["llama", "quantdyn"])
def test_export_reads_back_exactly(tmp_path, fmt, spec, kind):
    fp, q, res = _quantized(kind, spec)
    cfg = res.config
    opts = {"checkpoint_format": "gptq_v2"} if fmt == "gptq" and not cfg.sym else {}
    out = export_model(q, res, fmt, tmp_path / "x", **opts)
    r = read_export(out)
    weights = _weights(q, res)
    assert r.format == fmt and sorted(r.layer_names) == sorted(weights)
    for name, layer in r.layers():
        p = {k: res.packed[f"{name}.{k}"] for k in ("codes", "scales", "zeros", "g_idx")}
        assert torch.equal(layer.codes, p["codes"])                       # integer decisions: exactly
        assert torch.equal(layer.zeros, p["zeros"].float())
        assert torch.equal(layer.g_idx, p["g_idx"].int())
        W = weights[name].float()
        if fmt == "gptq":  # GPTQ stores float16 scales: the weight moves by at most |q - z| * |s| * 2^-11
            assert torch.equal(layer.scales, p["scales"].half().float())
            gi = p["g_idx"].long()
            bound = (p["codes"].float() - p["zeros"][:, gi]).abs() * p["scales"][:, gi].abs() * 2.0**-11
            assert bool(((layer.weight() - W).abs() <= bound).all())
        else:
            assert torch.equal(layer.scales, p["scales"])
            assert torch.equal(layer.weight(), W)                          # the fake-quantized weight, bit for bit
    # everything else is the model's own tensors, unchanged
    sd = {k: v for k, v in q.state_dict().items()}
    for name in r.names:
        if name.rsplit(".", 1)[0] not in weights and name in sd:
            assert torch.equal(r.tensor(name), sd[name]), name
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    prov = json.loads((out / "quantdyn_export.json").read_text())
    assert prov["quantizer"]["name"] == cfg.name and prov["layers"] == sorted(prov["layers"], key=prov["layers"].index)
    if fmt == "gptq":
        assert qc["quant_method"] == "gptq" and qc["bits"] == cfg.bits and qc["sym"] == cfg.sym
        assert qc["group_size"] == (cfg.group_size or -1)
        assert qc["desc_act"] == (cfg.act_order and not cfg.static_groups)
        assert qc["checkpoint_format"] == qc["format"] == opts.get("checkpoint_format", "gptq")
        assert (out / "quantize_config.json").is_file()
    else:
        w = qc["config_groups"]["group_0"]["weights"]
        assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
        assert (w["num_bits"], w["symmetric"], w["group_size"]) == (cfg.bits, cfg.sym, cfg.group_size or None)
        assert w["strategy"] == ("group" if cfg.group_size else "channel")


def test_gpt2_conv1d_exports_as_gptq(tmp_path):
    # Conv1D keeps (in, out) weights; the GPTQ tensors are laid out as for nn.Linear (GPTQModel transposes too)
    _, q, res = _quantized("gpt2", "rtn4g32-sym")
    r = read_export(export_model(q, res, "gptq", tmp_path / "x"))
    weights = _weights(q, res)
    assert r.layer_names == sorted(weights) and len(weights) == 8
    for name, layer in r.layers():
        assert torch.equal(layer.codes, res.packed[f"{name}.codes"])
        assert r.tensor(f"{name}.qweight").shape == (weights[name].shape[1] * 4 // 32, weights[name].shape[0])
        assert torch.allclose(layer.weight(), weights[name].float(), rtol=2.0**-10, atol=0)


def test_gptq_v1_stores_zero_minus_one(tmp_path):
    _, q, res = _quantized("llama", "rtn4g32-sym")
    out = export_model(q, res, "gptq", tmp_path / "x")
    r = read_export(out)
    name = r.layer_names[0]
    stored = unpack_rows(r.tensor(f"{name}.qzeros"), 4, res.packed[f"{name}.codes"].shape[0])
    assert bool((stored == 7).all())  # symmetric 4-bit zero point 8, minus one


def test_gptq_v1_refuses_zero_point_zero_and_v2_keeps_it(tmp_path):
    cfg = parse_quantizer("rtn4g32")
    codes = torch.randint(0, 16, (32, 64), dtype=torch.uint8)
    scales = torch.rand(32, 2) + 0.1
    zeros = torch.full((32, 2), 3.0)
    zeros[5, 1] = 0.0
    g_idx = torch.arange(64, dtype=torch.int32) // 32
    src = {"model_type": "llama"}
    w = open_export("gptq", tmp_path / "v1", src, cfg, "llama")
    with pytest.raises(QuantdynError, match="zero points equal to 0.*gptq_v2"):
        w.add_quantized("model.layers.0.mlp.up_proj", codes, scales, zeros, g_idx)
    w.abort()
    assert not (tmp_path / "v1").exists() and list(tmp_path.iterdir()) == []
    with open_export("gptq", tmp_path / "v2", src, cfg, "llama", checkpoint_format="gptq_v2") as w:
        w.add_quantized("model.layers.0.mlp.up_proj", codes, scales, zeros, g_idx)
    back = read_export(tmp_path / "v2").layer("model.layers.0.mlp.up_proj")
    assert torch.equal(back.zeros, zeros) and torch.equal(back.codes, codes)


# ----------------------------------------------------------------------------- transformers loads it


def _ce(model: nn.Module, ids: torch.Tensor) -> float:
    with torch.no_grad():
        out = model(ids)
        logits = out.logits if hasattr(out, "logits") else out
    return float(F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1)))


def _load(out, fmt, sym):
    import transformers as tf

    kw = {}
    if fmt == "compressed-tensors" and not sym:
        # transformers 5.23 + compressed-tensors 0.20 cannot keep asymmetric pack-quantized layers compressed (the
        # packed weight_zero_point does not fit the module they build: a size-mismatch error, also for
        # llm-compressor's own checkpoints); the dequantize-on-load path reads the same tensors
        kw["quantization_config"] = tf.CompressedTensorsConfig(dequantize=True)
    return tf.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, **kw).eval()


@pytest.mark.slow
@pytest.mark.parametrize("fmt,spec,kind", [
    ("compressed-tensors", "gptq4g32-sym", "llama"), ("compressed-tensors", "rtn4g32", "quantdyn"),
    ("compressed-tensors", "rtn8g0-sym", "quantdyn"), ("compressed-tensors", "gptq3g32", "llama"),
    ("gptq", "gptq4g32-gptqmodel", "llama"), ("gptq", "rtn4g32", "quantdyn"), ("gptq", "rtn8g0-sym", "llama"),
    ("gptq", "gptq3g32-sym", "quantdyn"),
])
def test_transformers_loads_export_with_same_ce(tmp_path, fmt, spec, kind):
    if fmt == "compressed-tensors":
        pytest.importorskip("compressed_tensors", reason="compressed-tensors not installed (pip install -e '.[export]')")
    else:
        pytest.importorskip("gptqmodel", reason="transformers loads GPTQ through gptqmodel, which pins numpy==2.2.6; "
                                                "it runs in `make crosscheck`'s own environment")
        pytest.importorskip("optimum", reason="transformers loads GPTQ through optimum")
    fp, q, res = _quantized(kind, spec)
    opts = {"checkpoint_format": "gptq_v2"} if fmt == "gptq" and not res.config.sym else {}
    out = export_model(q, res, fmt, tmp_path / "x", **opts)
    loaded = _load(out, fmt, res.config.sym)
    held_out = _ids(4, 48, 7)  # windows the calibration (seed 0) never saw
    ce_fq, ce_export, ce_fp = _ce(q, held_out), _ce(loaded, held_out), _ce(fp, held_out)
    assert abs(ce_export - ce_fq) < 1e-3, (ce_export, ce_fq)
    assert ce_fq != ce_fp  # the quantization did change the model, so the match means something


@pytest.mark.slow
def test_sharded_export_loads(tmp_path):
    pytest.importorskip("compressed_tensors", reason="compressed-tensors not installed (pip install -e '.[export]')")
    _, q, res = _quantized("llama", "rtn4g32-sym")
    out = export_model(q, res, "compressed-tensors", tmp_path / "x", max_shard_bytes=20_000)
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    r = read_export(out)
    for name, layer in r.layers():
        assert torch.equal(layer.codes, res.packed[f"{name}.codes"])
    held_out = _ids(2, 32, 7)
    assert abs(_ce(_load(out, "compressed-tensors", True), held_out) - _ce(q, held_out)) < 1e-3


# ----------------------------------------------------------------------------- refusals and atomicity


@pytest.mark.parametrize("fmt,spec,model_type,match", [
    ("gptq", "awq4", "llama", "no per-input-channel scales"),
    ("compressed-tensors", "awq4", "llama", "no per-input-channel scales"),
    ("gptq", "rtn5", "llama", "GPTQ checkpoints hold 2, 3, 4, 8 bits, not 5"),
    ("gptq", "rtn6", "llama", "GPTQ checkpoints hold 2, 3, 4, 8 bits"),
    ("compressed-tensors", "gptq4-act", "llama", "contiguous groups only"),
    ("gptq", "rtn4-head", "llama", "quantize_head"),
    ("compressed-tensors", "rtn4", "gpt2", "Conv1D"),
])
def test_refused_before_anything_is_written(tmp_path, fmt, spec, model_type, match):
    out = tmp_path / "out"
    with pytest.raises(QuantdynError, match=match) as e:
        open_export(fmt, out, {"model_type": model_type}, spec, model_type)
    assert "\n" not in str(e.value)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(QuantdynError, match=match):
        check_exportable(fmt, parse_quantizer(spec), model_type)


def test_act_order_is_fine_for_gptq_and_static_groups_for_compressed_tensors():
    assert check_exportable("gptq", parse_quantizer("gptq4-act"), "llama").desc_act
    assert not check_exportable("compressed-tensors", parse_quantizer("gptq4-act-static"), "llama").desc_act
    with pytest.raises(QuantdynError, match="float16 scales"):
        check_exportable("gptq", parse_quantizer("rtn4"), "llama", scale_dtype="float32")
    with pytest.raises(QuantdynError, match="unknown export format 'gptqq'.*did you mean 'gptq'"):
        check_exportable("gptqq", parse_quantizer("rtn4"), "llama")


def test_awq_scales_refused_at_layer(tmp_path):
    w = open_export("compressed-tensors", tmp_path / "o", {"model_type": "llama"}, "rtn4g32", "llama")
    with pytest.raises(QuantdynError, match="AWQ input scales"):
        w.add_quantized("a", torch.zeros(4, 64, dtype=torch.uint8), torch.ones(4, 2), torch.full((4, 2), 8.0),
                        torch.arange(64) // 32, awq_scales=torch.ones(64))
    w.abort()
    assert list(tmp_path.iterdir()) == []


def test_exception_inside_with_leaves_nothing_and_existing_export_is_replaced(tmp_path):
    _, q, res = _quantized("llama", "rtn4g32-sym")
    out = export_model(q, res, "compressed-tensors", tmp_path / "x")
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(RuntimeError, match="boom"):
        with open_export("compressed-tensors", out, {"model_type": "llama"}, "rtn4g32-sym", "llama") as w:
            w.add_tensor("model.norm.weight", torch.ones(64))
            raise RuntimeError("boom")
    assert sorted(p.name for p in out.iterdir()) == before and [p.name for p in tmp_path.iterdir()] == ["x"]
    export_model(q, res, "gptq", out)  # an earlier quantdyn export is replaced atomically
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "gptq"
    other = tmp_path / "notes"
    other.mkdir()
    (other / "a.txt").write_text("mine")
    with pytest.raises(QuantdynError, match="not a quantdyn export"):
        export_model(q, res, "gptq", other)
    assert (other / "a.txt").read_text() == "mine"


def test_writer_checks_shapes_and_duplicates(tmp_path):
    w = open_export("compressed-tensors", tmp_path / "o", {"model_type": "llama"}, "rtn4g32", "llama")
    codes, g = torch.zeros(4, 64, dtype=torch.uint8), torch.arange(64) // 32
    with pytest.raises(QuantdynError, match=r"scales has shape \(4, 3\), expected \(4, 2\)"):
        w.add_quantized("a", codes, torch.ones(4, 3), torch.zeros(4, 3), g)
    w.add_quantized("a", codes, torch.ones(4, 2), torch.zeros(4, 2), g)
    with pytest.raises(QuantdynError, match="twice"):
        w.add_tensor("a.weight_packed", torch.zeros(1))
    with pytest.raises(QuantdynError, match="written by the exporter"):
        w.add_file("config.json", b"{}")
    w.add_file("tokenizer.json", b"{}")
    out = w.close()
    assert (out / "tokenizer.json").read_bytes() == b"{}"
    with pytest.raises(QuantdynError, match="already closed"):
        w.add_tensor("b", torch.zeros(1))
    with pytest.raises(QuantdynError, match="already quantized"):
        open_export("gptq", tmp_path / "p", json.loads((out / "config.json").read_text()), "rtn4", "llama")


def test_push_to_hub_fails_in_one_line_offline(tmp_path, monkeypatch):
    _, q, res = _quantized("llama", "rtn4g32-sym")
    out = export_model(q, res, "compressed-tensors", tmp_path / "x")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(QuantdynError, match="offline mode is on") as e:
        push_to_hub(out, "someone/tiny-gptq")
    assert "\n" not in str(e.value)
    with pytest.raises(QuantdynError, match="not a quantized export|no config.json"):
        push_to_hub(tmp_path, "someone/x")
    os.environ.pop("HF_HUB_OFFLINE", None)
