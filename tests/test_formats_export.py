"""GGUF export: bit-exact with llama.cpp's own quantizer, loaded and run by llama.cpp.

tests/fixtures/gguf_llamacpp.json was made once with llama.cpp 0c1e570 (tests/fixtures/make_gguf_reference.py)
from the RandomState models of tests/formats_models.py: the sha256 of every tensor ``llama_model_quantize``
wrote for Q4_K_M from an F32 GGUF of the model, and llama.cpp's next-token log-probabilities of the F32 file
and of quantdyn's Q4_K_M export. Here quantdyn exports the same models again and must write the same bytes;
its fake-quantized model must predict what llama.cpp predicted from that file.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from formats_models import LLAMA, NEOX, WINDOWS, build_checkpoint, build_model

from quantdyn.engine.lazy_model import LazyModel
from quantdyn.engine.measure import measure
from quantdyn.engine.walk import quantize_model
from quantdyn.engine.sinks import ExportSink
from quantdyn.errors import QuantdynError
from quantdyn.models.gpt import logits_of
from quantdyn.models.weights import CheckpointWeights

FIX = json.loads((Path(__file__).parent / "fixtures" / "gguf_llamacpp.json").read_text())
SPECS = {"neox": NEOX, "llama": LLAMA}


def export(spec, tmp_path: Path, label: str = "q4_k_m") -> Path:
    ck = build_checkpoint(spec, tmp_path / spec.name)
    out = tmp_path / f"{spec.name}-{label}.gguf"
    source = LazyModel(CheckpointWeights(ck))
    sink = ExportSink("gguf", out, source, label, label, name="quantdyn-fixture")
    measure(source, {label: label}, None, None, on_layer=sink)
    return sink.close()


def next_token_logprobs(model) -> torch.Tensor:
    w = torch.from_numpy(WINDOWS).long()
    with torch.no_grad():
        lp = torch.log_softmax(logits_of(model, w[:, :-1]).double(), -1)
    return lp.gather(-1, w[:, 1:, None])[..., 0]


@pytest.fixture(scope="module", params=["neox", "llama"])
def exported(request, tmp_path_factory):
    spec = SPECS[request.param]
    return spec, export(spec, tmp_path_factory.mktemp("gguf"))


@pytest.mark.numerics
def test_export_is_byte_identical_to_llama_quantize(exported):
    """Every block tensor -- its type chosen by the Q4_K_M recipe or llama.cpp's fallback, and its bytes -- is
    what llama.cpp's own quantizer writes from the same weights."""
    gguf = pytest.importorskip("gguf")
    spec, path = exported
    reader = gguf.GGUFReader(str(path))
    ours = {t.name: [t.tensor_type.name, hashlib.sha256(np.ascontiguousarray(t.data).tobytes()).hexdigest()]
            for t in reader.tensors}
    ref = FIX["models"][spec.name]["llama_quantize_q4_k_m"]
    assert {k: v for k, v in ours.items() if k.startswith("blk.")} == ref
    assert ours["token_embd.weight"][0] == "F32" and ours["output.weight"][0] == "F32"  # head and embedding: FP
    assert str(reader.fields["general.architecture"].contents()) == ("gptneox" if spec.name == "neox" else "llama")
    assert reader.fields["quantdyn.quantizer"].contents() == "q4_k_m"


def test_fake_quantized_model_predicts_what_llama_cpp_predicts(exported):
    """llama.cpp's log-probabilities (fixture) against quantdyn's. FP: llama.cpp's F32 run differs from the
    model only by its tanh GELU / f16 KV cache (measured max 5e-4 nats). Q4_K_M: llama.cpp also rounds the
    activations to 8 bits (Q8_K) inside its matmuls, so the two stay a few 1e-3 apart -- far below the
    weight quantization effect both measure (quantdyn FP vs Q4_K_M)."""
    spec, _ = exported
    ref = FIX["models"][spec.name]
    fp = build_model(spec).float()
    lp_fp = next_token_logprobs(fp)
    assert (lp_fp - torch.tensor(ref["f32_logprobs"], dtype=torch.float64)).abs().max() < 5e-3
    quantize_model(fp, None, "q4_k_m", progress=False)
    lp_q = next_token_logprobs(fp)
    lp_llama = torch.tensor(ref["q4_k_m_logprobs"], dtype=torch.float64)
    gap, effect = (lp_llama - lp_q).abs(), (lp_q - lp_fp).abs()
    print(f"{spec.name}: |llama.cpp - quantdyn| mean {gap.mean():.2e} max {gap.max():.2e}; "
          f"|quantdyn Q4_K_M - FP| mean {effect.mean():.2e} max {effect.max():.2e}")
    assert gap.mean() < 0.25 * effect.mean() and gap.max() < 0.25 * effect.max()


def test_llama_cpp_runs_the_export(exported):
    """Where llama-cpp-python is installed (the fixture's maker; not CI): load the file quantdyn just wrote."""
    llama_cpp = pytest.importorskip("llama_cpp")
    spec, path = exported
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=128, logits_all=True, verbose=False, n_threads=2, n_batch=128)
    got = []
    for w in WINDOWS:
        llm.reset()
        llm.eval(w[:-1].tolist())
        lp = torch.log_softmax(torch.tensor(np.array(llm.scores[:len(w) - 1]), dtype=torch.float64), -1)
        got.append(lp.gather(-1, torch.tensor(w[1:])[:, None])[:, 0])
    want = torch.tensor(FIX["models"][spec.name]["q4_k_m_logprobs"], dtype=torch.float64)
    assert (torch.stack(got) - want).abs().max() < 1e-4  # the same file and llama.cpp: the same predictions


def test_refusals_before_anything_is_written(tmp_path):
    from quantdyn.export import open_export

    cfg = json.loads(json.dumps({"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2,
                                 "num_attention_heads": 4, "vocab_size": 256}))
    out = tmp_path / "m.gguf"
    for qc, mt, msg in [("nf4", "llama", "quantizer nf4 has no ggml type"),
                        ("gptq4", "llama", "quantizer gptq4 has no ggml type"),
                        ("q4_k_m", "gpt2", "model_type 'gpt2' is not supported")]:
        with pytest.raises(QuantdynError, match=msg):
            open_export("gguf", out, cfg, qc, mt)
        assert not out.exists() and list(tmp_path.iterdir()) == []
    out.write_bytes(b"keep me")
    with pytest.raises(QuantdynError, match="exists; choose a new --out"):
        open_export("gguf", out, cfg, "q4_k_m", "llama")
    assert out.read_bytes() == b"keep me"
    with pytest.raises(QuantdynError, match="integer grids; the format q4_k_m is exported with --export gguf"):
        open_export("gptq", tmp_path / "d", {**cfg, "architectures": ["LlamaForCausalLM"]}, "q4_k_m", "llama")
    w = open_export("gguf", tmp_path / "aborted.gguf", cfg, "q8_0", "llama")
    w.add_tensor("model.norm.weight", torch.ones(256))
    w.abort()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]  # no temporary file left behind


def test_cli_quantize_export_gguf(tmp_path, kjv_small, cli):
    from transformers import LlamaConfig, LlamaForCausalLM

    _, data = kjv_small
    torch.manual_seed(0)
    ck = tmp_path / "llama"
    LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                 bos_token_id=0, eos_token_id=0)).save_pretrained(ck)
    data.tokenizer.save_pretrained(str(ck))
    out = tmp_path / "m.gguf"
    short = ["--calib-samples", "4", "--calib-seq-len", "32", "--eval-seq-len", "32", "--eval-tokens", "1024", "--json"]
    r = cli("quantize", ck, "--quantizers", "q4_k_m", "--export", "gguf", "--out", out, *short)
    assert r.returncode == 0, r.stderr[-1500:]
    row = json.loads(r.stdout.strip().splitlines()[-1])
    assert row["export"] == {"format": "gguf", "path": str(out)} and row["quantizer"] == "q4_k_m"
    assert 4.5 < row["bits_per_weight"] < 6.6
    gguf = pytest.importorskip("gguf")
    reader = gguf.GGUFReader(str(out))
    tokens = reader.fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == 512 and len(reader.fields["tokenizer.ggml.merges"].data) > 0
    r = cli("quantize", ck, "--quantizers", "nf4", "--export", "gguf", "--out", tmp_path / "n.gguf", *short)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "no ggml type" in r.stderr
    assert not (tmp_path / "n.gguf").exists()


def test_tied_gpt_neox_gets_an_output_tensor(tmp_path):
    """llama.cpp's gptneox has no tied head: a tied checkpoint's export carries token_embd again as output."""
    gguf = pytest.importorskip("gguf")
    from quantdyn.models.gpt import GPT, ModelConfig, resolve_model_config
    from quantdyn.models.hf_io import save_hf

    torch.manual_seed(0)
    ck = save_hf(GPT(resolve_model_config(ModelConfig(n_layer=1, d_model=64, n_head=2, max_seq_len=64, vocab_size=96,
                                                      tie_embeddings=True))), tmp_path / "tied")
    source = LazyModel(CheckpointWeights(ck))
    sink = ExportSink("gguf", tmp_path / "t.gguf", source, "q8_0", "q8_0")
    measure(source, {"q8_0": "q8_0"}, None, None, on_layer=sink)
    tensors = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(str(sink.close())).tensors}
    assert np.array_equal(tensors["output.weight"], tensors["token_embd.weight"])
