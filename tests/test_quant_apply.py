"""quantize_model on tiny transformers models and quantdyn's GPT; adapters; quantdyn's quantized checkpoint, written
by the engine's writer."""
from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn as nn

from quantdyn.engine.measure import MeasureConfig, measure
from quantdyn.engine.walk import quantize_model
from quantdyn.engine.sinks import QuantizedCheckpointWriter
from quantdyn.errors import QuantdynError
from quantdyn.models.adapters import ADAPTERS, adapter_for, get_weight
from quantdyn.models.gpt import GPT, ModelConfig, logits_of, resolve_model_config
from quantdyn.quantize import QuantConfig
from quantdyn.quantize.rtn import rtn

pytestmark = pytest.mark.numerics  # rerun under other MKL code paths by `make test-isa`

V = 128


def tiny(kind: str) -> nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    kw = dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
              max_position_embeddings=64)
    gqa = dict(kw, num_key_value_heads=2)
    if kind == "gpt_neox":
        m = tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**kw))
    elif kind == "llama":
        m = tf.LlamaForCausalLM(tf.LlamaConfig(**gqa))
    elif kind == "qwen2":
        m = tf.Qwen2ForCausalLM(tf.Qwen2Config(**gqa))
    elif kind == "olmo2":
        m = tf.Olmo2ForCausalLM(tf.Olmo2Config(**gqa))
    elif kind == "gpt2":
        m = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                             bos_token_id=0, eos_token_id=0))
    elif kind == "quantdyn":
        m = GPT(resolve_model_config(ModelConfig(preset="tiny-2x64", vocab_size=V)))
    else:
        raise ValueError(kind)
    return m.eval()


def calib(n=8, L=24, seed=0):
    return torch.randint(0, V, (n, L), generator=torch.Generator().manual_seed(seed))


def block_linears(model):
    ad = adapter_for(model)
    return {f"{ad.blocks}.{b}.{n}": m for b, blk in enumerate(ad.get_blocks(model))
            for grp in ad.linear_groups(blk) for n, m in grp}


@pytest.mark.parametrize("kind", ["gpt_neox", "llama", "gpt2", "qwen2", "olmo2", "quantdyn"])
def test_quantize_model_on_tiny_models(kind):
    fp = tiny(kind)
    ids = calib()
    for spec, tol in [("gptq8", 0.02), ("gptq3-gptqmodel", None)]:
        q = copy.deepcopy(fp)
        res = quantize_model(q, ids, spec, progress=False)
        lin_fp, lin_q = block_linears(fp), block_linears(q)
        assert len(res.rows) == len(lin_q) and {r["layer"] for r in res.rows} == set(lin_q)
        for name in lin_q:  # every block linear changed, each onto its packed grid
            assert not torch.equal(lin_q[name].weight, lin_fp[name].weight), name
            assert res.packed[f"{name}.codes"].dtype == torch.uint8
        ad = adapter_for(q)
        for a, b in zip(ad.get_pre_block(fp), ad.get_pre_block(q)):
            for pa, pb in zip(a.parameters(), b.parameters()):
                assert torch.equal(pa, pb)
        assert torch.equal(ad.get_head(fp).weight, ad.get_head(q).weight)
        assert all(r["output_error"] > 0 for r in res.rows)  # every layer changed, so its outputs did too
        if tol is not None:
            with torch.no_grad():
                a, b = logits_of(fp, ids), logits_of(q, ids)
            assert float((a - b).norm() / a.norm()) < tol


def test_gpt2_conv1d_transposition():
    fp = tiny("gpt2")
    q = copy.deepcopy(fp)
    cfg = QuantConfig(method="rtn", bits=4, group_size=32)
    res = quantize_model(q, None, cfg, progress=False)  # RTN without data: no forward pass
    c_attn_fp, c_attn_q = fp.transformer.h[0].attn.c_attn, q.transformer.h[0].attn.c_attn
    assert c_attn_fp.weight.shape == (64, 192)  # Conv1D stores (in, out)
    direct = rtn(c_attn_fp.weight.data.t(), cfg)
    assert torch.equal(c_attn_q.weight.data, direct.weight.t())
    assert torch.equal(get_weight(c_attn_q), direct.weight)
    assert torch.equal(res.packed["transformer.h.0.attn.c_attn.codes"], direct.codes)
    assert res.rows[0]["out_features"] == 192 and res.rows[0]["output_error"] is None


def _write_quantized(model, spec, calib_ids, out, batch_size=8):
    """quantdyn's quantized checkpoint of ``model`` through the engine: measure(..., on_layer=writer)."""
    writer = QuantizedCheckpointWriter(out, model, spec, "q")
    try:
        m = measure(model, {"q": spec}, None, calib_ids, cfg=MeasureConfig(calib_batch_size=batch_size),
                    on_layer=writer)
    except BaseException:
        writer.abort()
        raise
    v = m.quantizations["q"]
    return writer.close(v.rows, {"layers": len(v.rows)}, "sha"), v


def test_true_sequential_awq_head_and_save(tmp_path):
    from safetensors.torch import load_file

    from quantdyn.models.hf_io import load_gpt

    fp = tiny("quantdyn")
    q = copy.deepcopy(fp)
    cfg = QuantConfig(method="awq", bits=4, group_size=32, true_sequential=True, quantize_head=True)
    res = quantize_model(q, calib(), cfg, progress=False, batch_size=3)
    assert not torch.equal(q.embed_out.weight, fp.embed_out.weight)
    assert torch.equal(q.gpt_neox.embed_in.weight, fp.gpt_neox.embed_in.weight)
    assert "embed_out.awq_scales" in res.packed and res.rows[-1]["block"] == -1
    # the engine's writer, fed from the untouched model, writes the model quantize_model made in place
    out, v = _write_quantized(fp, cfg, calib(), tmp_path / "q", batch_size=3)
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "quant_codes.safetensors", "quant_config.json"} <= files
    meta = json.loads((out / "quant_config.json").read_text())
    assert meta["quantizer"]["method"] == "awq" and len(meta["rows"]) == len(res.rows) == len(v.rows)
    assert meta["model_type"] == "quantdyn-gpt" and meta["config_hash"] and meta["git_sha"] == "sha"
    codes = load_file(str(out / "quant_codes.safetensors"))
    assert codes.keys() == res.packed.keys()
    for k, t in res.packed.items():
        assert torch.equal(codes[k], t), k  # the same decisions as quantize_model's
    back = load_gpt(out)
    ids = calib(2, 16, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(logits_of(back, ids), logits_of(q, ids))


def test_quantized_checkpoint_of_a_tied_head_and_of_a_lazy_checkpoint(tmp_path):
    """GPT-2 ties its head to the embedding: quantizing the head writes it untied (the embedding stays full
    precision); the same writer fed from the checkpoint on disk (LazyModel) writes the same tensors."""
    import transformers as tf

    from quantdyn.engine.lazy_model import LazyModel
    from quantdyn.models.weights import CheckpointWeights

    fp = tiny("gpt2")
    cfg = QuantConfig(method="rtn", bits=4, group_size=32, quantize_head=True)
    out, _ = _write_quantized(fp, cfg, None, tmp_path / "mem")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    back = tf.AutoModelForCausalLM.from_pretrained(out).eval()
    assert torch.equal(back.transformer.wte.weight, fp.transformer.wte.weight)
    assert not torch.equal(back.lm_head.weight, fp.lm_head.weight)
    fp.save_pretrained(tmp_path / "fp")
    lazy, _ = _write_quantized(LazyModel(CheckpointWeights(tmp_path / "fp")), cfg, None, tmp_path / "lazy")
    assert sorted(p.name for p in lazy.iterdir()) == sorted(p.name for p in out.iterdir())
    from safetensors import safe_open

    for name in ("model.safetensors", "quant_codes.safetensors"):
        with safe_open(str(lazy / name), "pt") as a, safe_open(str(out / name), "pt") as b:
            assert a.metadata() == b.metadata() and sorted(a.keys()) == sorted(b.keys()), name
            for k in a.keys():
                assert torch.equal(a.get_tensor(k), b.get_tensor(k)), (name, k)


def test_gpt2_tied_head_is_untied_when_quantized():
    q = tiny("gpt2")
    emb = q.transformer.wte.weight.detach().clone()
    quantize_model(q, calib(), QuantConfig(method="gptq", bits=4, quantize_head=True), progress=False)
    assert torch.equal(q.transformer.wte.weight, emb)
    assert not torch.equal(q.lm_head.weight, emb)


def test_user_errors():
    class Mamba(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = type("Cfg", (), {"model_type": "mamba"})()
            self.lin = nn.Linear(4, 4)

    with pytest.raises(QuantdynError, match="register one with"):
        quantize_model(Mamba(), calib(), "gptq4", progress=False)
    m = tiny("quantdyn")
    for bad in (None, torch.zeros(0, 8, dtype=torch.long), torch.randint(0, V, (0,))):
        with pytest.raises(QuantdynError, match="calibration"):
            quantize_model(copy.deepcopy(m), bad, "gptq4", progress=False)
    with pytest.raises(QuantdynError, match="vocabulary"):
        quantize_model(copy.deepcopy(m), torch.full((2, 8), V + 5), "gptq4", progress=False)
    bad_w = copy.deepcopy(m)
    with torch.no_grad():
        bad_w.gpt_neox.layers[1].mlp.dense_h_to_4h.weight[0, 0] = float("nan")
    with pytest.raises(QuantdynError, match="layers.1.mlp.dense_h_to_4h"):
        quantize_model(bad_w, calib(), "gptq4", progress=False)
    bad_act = copy.deepcopy(m)
    with torch.no_grad():
        bad_act.gpt_neox.embed_in.weight[3] = float("inf")
    with pytest.raises(QuantdynError, match="NaN or Inf"):
        quantize_model(bad_act, torch.full((2, 8), 3), "gptq4", progress=False)
    assert {"gpt_neox", "llama", "olmo", "olmo2", "gpt2", "qwen2"} <= set(ADAPTERS.names())


def _sliding_qwen2():
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.Qwen2Config(vocab_size=V, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64,
                         use_sliding_window=True, sliding_window=4,
                         layer_types=["full_attention", "sliding_attention"] * 2)
    return tf.Qwen2ForCausalLM(cfg).eval()


def _block_outputs(model, ids):
    """Each block's output in the model's own forward."""
    outs = []
    hooks = [b.register_forward_hook(lambda m, a, o: outs.append(o[0] if isinstance(o, tuple) else o))
             for b in adapter_for(model).get_blocks(model)]
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return outs


def test_per_layer_block_arguments_sliding_window():
    """Qwen2 passes its sliding-window layers another mask than its full layers: quantization and
    error propagation must call each block with its own arguments, not block 0's."""
    from propagation_reference import model_error_propagation

    from quantdyn.engine.blockwise import capture_inputs, same_value

    model, ids = _sliding_qwen2(), calib(4, 24)
    blocks = adapter_for(model).get_blocks(model)
    ref = _block_outputs(model, ids)
    with torch.no_grad():
        cap = capture_inputs(model, blocks, ids, torch.device("cpu"), batch_size=3, returns_tuple=False)
        hiddens, block_args = cap.hiddens, cap.args
        assert cap.per_layer and not same_value(block_args(1, 0), block_args(0, 0))  # sliding vs full mask
        outs = []
        for b, blk in enumerate(blocks):  # chaining the blocks as quantize_model does reproduces the forward
            hiddens = [blk(h, *block_args(b, i)[0], **block_args(b, i)[1]) for i, h in enumerate(hiddens)]
            hiddens = [h[0] if isinstance(h, tuple) else h for h in hiddens]
            outs.append(torch.cat(hiddens))
    for b in range(len(blocks)):
        torch.testing.assert_close(outs[b], ref[b], rtol=1e-5, atol=1e-5)
    rows = model_error_propagation(model, copy.deepcopy(model), ids, batch_size=4)
    for b, r in enumerate(rows):
        assert r["R"] == 0 and r["h_norm_sq"] == pytest.approx(float(ref[b].double().pow(2).sum()), rel=1e-5)
    q = copy.deepcopy(model)
    quantize_model(q, ids, "gptq8", progress=False)
    with torch.no_grad():
        a, b = logits_of(model, ids), logits_of(q, ids)
    assert float((a - b).norm() / a.norm()) < 0.02
