"""Deployable outputs of per-tensor plans (export/plans.py, export/gguf.py, export/llama_quantize.py): integer plans
as compressed-tensors (loaded with plain from_pretrained, compared with quantdyn's fake-quantized model as the
existing exports are) and as GPTQ with GPTQModel's ``dynamic`` overrides, the llm-compressor recipe, and GGUF plans
with per-tensor types (bytes against llama.cpp's own quantizer given the ``--tensor-type`` arguments, the fixture
of tests/fixtures/gguf_llamacpp.json ``plans``, made by tools/gguf_plan_fixture.py)."""
from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from test_export import _NEEDS, Walked, _ids, _tiny, check_export_loads

from quantdyn.engine.lazy_model import LazyModel
from quantdyn.engine.measure import measure
from quantdyn.engine.sinks import ExportSink
from quantdyn.export.llama_quantize import llama_quantize_args, tensor_type_lines
from quantdyn.models.weights import CheckpointWeights
from quantdyn.quantize.plan import Plan, PlanTensor, read_plan, write_plan

FIX = Path(__file__).parent / "fixtures"
LLAMA_LAYERS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                "mlp.up_proj", "mlp.down_proj")


def _llama_plan(model, types, tmp: Path) -> str:
    tensors = []
    for b, block in enumerate(model.model.layers):
        for path in LLAMA_LAYERS:
            w = block.get_submodule(path).weight
            tensors.append(PlanTensor(f"model.layers.{b}.{path}", b, path, tuple(w.shape), types[len(tensors) % len(types)]))
    return f"plan:{write_plan(Plan('llama', len(model.model.layers), tuple(tensors)), tmp / 'plan.json')}"


INT_TYPES = ["rtn4g32", "rtn3g32-sym", "f16", "gptq4g32-sym", "rtn8g32"]
SYM_TYPES = ["rtn4g32-sym", "rtn3g32-sym", "f16", "gptq4g32-sym", "rtn8g32-sym"]
_WALKS: dict = {}


def _int_plan(types, tmp: Path):
    if tuple(types) not in _WALKS:
        fp = _tiny("llama")
        label = _llama_plan(fp, types, tmp)
        _WALKS[tuple(types)] = label, Walked(fp, [label], _ids(8, 24, 0))
    return _WALKS[tuple(types)]


@pytest.fixture(scope="module")
def int_plan(tmp_path_factory):
    return _int_plan(INT_TYPES, tmp_path_factory.mktemp("plan"))


@pytest.mark.parametrize("types", [
    pytest.param(SYM_TYPES, id="symmetric"),
    pytest.param(INT_TYPES, id="asymmetric", marks=pytest.mark.xfail(strict=True, reason=(
        "transformers 5.24 loads asymmetric compressed-tensors checkpoints through its dequantize path "
        "(quantization_config 'dequantize': true, export/layouts.py), and that path decompresses every dense module "
        "with ONE config group's scheme (integrations/compressed_tensors.get_dense_scheme): a second asymmetric "
        "scheme's packed zero points come out the wrong size (vLLM and compressed-tensors themselves read the "
        "groups per module)"))),
])
@pytest.mark.e2e
def test_int_plan_as_compressed_tensors_loads_as_a_user_would(types, tmp_path_factory, tmp_path):
    for module, reason in _NEEDS["compressed-tensors"]:
        pytest.importorskip(module, reason=reason)
    label, walk = _int_plan(types, tmp_path_factory.mktemp("plan"))
    out = walk.export(label, "compressed-tensors", tmp_path / "ct")
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    schemes = {(g["weights"]["num_bits"], g["weights"]["symmetric"], g["weights"]["group_size"])
               for g in cfg["config_groups"].values()}
    sym = types is SYM_TYPES
    assert schemes == ({(4, True, 32), (3, True, 32), (8, True, 32)} if sym
                       else {(4, False, 32), (3, True, 32), (4, True, 32), (8, False, 32)})
    assert ("dequantize" in cfg) == (not sym)
    assert cfg["ignore"] == sorted(n for n, t in _assignment(label).items() if t == "f16")
    targets = [t for g in cfg["config_groups"].values() for t in g["targets"]]
    assert sorted(targets + cfg["ignore"]) == sorted(_assignment(label))  # every layer once
    check_export_loads(walk, label, "compressed-tensors", out, _ids(8, 49, 7))  # CE within 1e-5, weights equal
    recipe = yaml.safe_load((out / "recipe.yaml").read_text())["quant_stage"]["quant_modifiers"]
    assert set(recipe) == {"GPTQModifier", "QuantizationModifier"}
    gptq_targets = [t for g in recipe["GPTQModifier"]["config_groups"].values() for t in g["targets"]]
    rtn_targets = [t for g in recipe["QuantizationModifier"]["config_groups"].values() for t in g["targets"]]
    a = _assignment(label)
    assert sorted(gptq_targets) == sorted(n for n, t in a.items() if t.startswith("gptq"))
    assert sorted(rtn_targets) == sorted(n for n, t in a.items() if t.startswith("rtn"))


def _assignment(label: str) -> dict[str, str]:
    return read_plan(label.removeprefix("plan:")).assignment()


def test_int_plan_as_gptq_has_one_dynamic_override_per_layer_off_the_base(int_plan, tmp_path):
    label, walk = int_plan
    out = walk.export(label, "gptq", tmp_path / "gptq", checkpoint_format="gptq_v2")
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    a = _assignment(label)
    from quantdyn.quantize import parse_quantizer

    for name, t in a.items():
        hits = [(k, v) for k, v in cfg["dynamic"].items() if re.search(k[2:], name)]
        if t == "f16":
            assert hits == [(f"-:^{re.escape(name)}$", {})], name
            continue
        qc = parse_quantizer(t)
        if (qc.bits, qc.group_size, qc.sym) == (cfg["bits"], cfg["group_size"], cfg["sym"]):
            assert hits == [], name  # the base scheme
        else:
            assert len(hits) == 1 and hits[0][0].startswith("+:") and hits[0][1] == {
                "bits": qc.bits, "group_size": qc.group_size, "sym": qc.sym, "desc_act": False}, name
    with __import__("safetensors").safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    for name, t in a.items():  # f16 layers dense, the others packed
        assert (f"{name}.weight" in keys) == (t == "f16") and (f"{name}.qweight" in keys) == (t != "f16"), name


@pytest.mark.xfail(strict=True, raises=RuntimeError, reason=(
    "transformers 5.24 loads GPTQ through optimum 2.3.0's GPTQQuantizer, which has no `dynamic`: every layer is built "
    "with the base scheme (bits, group size) and f16 layers as quantized, so the per-layer overrides' tensors do not "
    "fit (ignore_mismatched_sizes) -- seen when CI first ran this test in the crosscheck venv (issue 47); `dynamic` "
    "is GPTQModel's own format (GPTQModel.load), not checked here: it needs a tokenizer the test model lacks"))
def test_int_plan_as_gptq_loads_as_a_user_would(int_plan, tmp_path):
    for module, reason in _NEEDS["gptq"]:
        pytest.importorskip(module, reason=reason)
    label, walk = int_plan
    out = walk.export(label, "gptq", tmp_path / "gptq", checkpoint_format="gptq_v2")
    check_export_loads(walk, label, "gptq", out, _ids(8, 49, 7))


def test_a_gguf_type_in_an_int_plan_is_refused_before_anything_is_written(tmp_path):
    fp = _tiny("llama")
    label = _llama_plan(fp, ["rtn4g32", "q4_0"], tmp_path)
    with pytest.raises(Exception, match="hold integer grids; plan:.* has type q4_0: export a plan of GGUF types"):
        ExportSink("gptq", tmp_path / "x", fp, label, label)
    assert not (tmp_path / "x").exists()


# ----------------------------------------------------------------------------- GGUF plans against llama.cpp

def gguf_plan(spec) -> Plan:
    """The fixture's plan of a tests/formats_models.py model: the types cycle through q3_k, q4_k, q5_k, q6_k, q8_0,
    f16 over the tensors, a type a tensor cannot hold replaced by q5_0 (LLaMA's 320-wide ffn_down)."""
    from formats_models import build_model

    model = build_model(spec)
    cycle = ["q3_k", "q4_k", "q5_k", "q6_k", "q8_0", "f16"]
    prefix, layers = (("gpt_neox.layers", ("attention.query_key_value", "attention.dense", "mlp.dense_h_to_4h",
                                            "mlp.dense_4h_to_h")) if spec.model_type == "gpt_neox"
                      else ("model.layers", LLAMA_LAYERS))
    blocks = model.blocks if spec.model_type == "gpt_neox" else model.model.layers
    tensors = []
    for b, block in enumerate(blocks):
        for path in layers:
            shape = tuple(block.get_submodule(path).weight.shape)
            t = cycle[len(tensors) % len(cycle)]
            if t.endswith("_k") and shape[1] % 256:
                t = "q5_0"
            tensors.append(PlanTensor(f"{prefix}.{b}.{path}", b, path, shape, t))
    return Plan(spec.model_type, len(blocks), tuple(tensors))


def export_gguf_plan(spec, tmp: Path) -> Path:
    from formats_models import build_checkpoint

    ck = build_checkpoint(spec, tmp / spec.name)
    label = f"plan:{write_plan(gguf_plan(spec), tmp / f'{spec.name}-plan.json')}"
    out = tmp / f"{spec.name}-plan.gguf"
    source = LazyModel(CheckpointWeights(ck))
    sink = ExportSink("gguf", out, source, label, label, name="quantdyn-fixture")
    measure(source, {label: label}, None, None, on_layer=sink)
    return sink.close()


def _tensors(path: Path) -> dict:
    """Every tensor of a GGUF file: its type and the sha256 of its bytes."""
    gguf = pytest.importorskip("gguf")
    return {t.name: [t.tensor_type.name, hashlib.sha256(np.ascontiguousarray(t.data).tobytes()).hexdigest()]
            for t in gguf.GGUFReader(str(path)).tensors}


DERIVED = {
    "attention.key_length": lambda kv, a: kv[f"{a}.embedding_length"] // kv[f"{a}.attention.head_count"],
    "attention.value_length": lambda kv, a: kv[f"{a}.embedding_length"] // kv[f"{a}.attention.head_count"],
    "rope.freq_base": lambda kv, a: 10000.0,
}
"""Hyperparameters llama.cpp derives when a GGUF file lacks them (src/llama-model.cpp, load_hparams: n_embd_head_k
and _v = n_embd / n_head, rope_freq_base 10000), and what it derives."""


def _hparams(path: Path) -> dict:
    gguf = pytest.importorskip("gguf")
    r = gguf.GGUFReader(str(path))
    arch = r.fields["general.architecture"].contents()
    return {f.name: f.contents() for f in r.fields.values() if f.name.startswith(f"{arch}.")}


@pytest.mark.e2e
@pytest.mark.numerics
@pytest.mark.parametrize("name", ["neox", "llama"])
def test_gguf_plan_is_byte_identical_to_llama_quantize_with_its_tensor_types(tmp_path, name):
    """quantdyn's GGUF of the plan holds, tensor for tensor (every tensor, names included), the type and bytes
    llama.cpp's ``llama-quantize`` wrote with exactly the ``--tensor-type`` arguments quantdyn gives, from the F32 GGUF
    llama.cpp's own converter (convert_hf_to_gguf.py) made of the same HF checkpoint, and the hyperparameters that
    converter wrote (fixture made with llama.cpp 0c1e570 by tools/gguf_plan_fixture.py: nothing of quantdyn's writer
    is in it, so a tensor name or a q/k row order both sides got wrong would show here)."""
    from formats_models import LLAMA, NEOX

    spec = {"neox": NEOX, "llama": LLAMA}[name]
    entry = json.loads((FIX / "gguf_llamacpp.json").read_text())["plans"][name]
    plan = gguf_plan(spec)
    assert llama_quantize_args(plan) == entry["args"]  # the command line llama.cpp was run with
    path = export_gguf_plan(spec, tmp_path)
    assert _tensors(path) == entry["llama_quantize"]
    assert {t.split("=")[1] for t in tensor_type_lines(plan)} >= {"q3_K", "q4_K", "f16"}
    ours, theirs = _hparams(path), entry["converter_hparams"]
    arch = spec.model_type.replace("_", "")  # gpt_neox -> gptneox, llama
    for key in sorted(set(ours) | set(theirs)):
        short = key.removeprefix(f"{arch}.")
        got = ours[key] if key in ours else DERIVED[short](ours, arch)
        want = theirs[key] if key in theirs else DERIVED[short](theirs, arch)
        assert got == want, (key, got, want)


def test_gguf_plan_loads_in_llama_cpp(tmp_path):
    """Where llama-cpp-python is installed: llama.cpp runs quantdyn's plan GGUF and predicts what it predicted when
    the fixture was made (and what quantdyn's fake-quantized model predicts, within llama.cpp's own activation
    rounding)."""
    pytest.importorskip("llama_cpp")
    from formats_models import NEOX

    sys.path.insert(0, str(FIX))
    from make_gguf_reference import llama_logprobs  # llama.cpp's log-probabilities, as the fixture was made

    got = torch.tensor(llama_logprobs(export_gguf_plan(NEOX, tmp_path)), dtype=torch.float64)
    want = torch.tensor(json.loads((FIX / "gguf_llamacpp.json").read_text())["plans"]["neox"]["logprobs"])
    assert (got - want).abs().max() < 1e-4


@pytest.mark.e2e
@pytest.mark.numerics
def test_gguf_plan_holds_each_tensor_in_its_type_and_the_arguments_name_each_tensor_once(tmp_path):
    """Without llama.cpp: every block tensor of the plan's GGUF has the plan's type (f16 entries as F16, equal to the
    float16 weights), and each ``--tensor-type`` pattern matches exactly its own tensor among the file's tensors
    (llama.cpp matches them with regex_search, first match wins)."""
    from formats_models import LLAMA, build_model

    gguf = pytest.importorskip("gguf")
    plan = gguf_plan(LLAMA)
    path = export_gguf_plan(LLAMA, tmp_path)
    reader = gguf.GGUFReader(str(path))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    from quantdyn.export.gguf import gguf_tensor_name

    model = build_model(LLAMA)
    w = dict(model.named_parameters())
    for t in plan.tensors:
        name = gguf_tensor_name("llama", f"{t.name}.weight")
        assert types[name] == ("F16" if t.type == "f16" else t.type.upper()), (name, t.type)
        if t.type == "f16" and ".attn_q." not in name and ".attn_k." not in name:  # q/k rows are permuted for rope
            data = next(np.asarray(x.data) for x in reader.tensors if x.name == name)
            assert np.array_equal(data, w[f"{t.name}.weight"].detach().half().numpy()), name
    lines = tensor_type_lines(plan)
    for line in lines:
        pattern, ggml = line.rsplit("=", 1)
        hits = [n for n in types if re.search(pattern, n.lower())]
        assert len(hits) == 1 and hits[0].startswith("blk."), (pattern, hits)
    args = llama_quantize_args(plan)
    assert args[:4] == ["--token-embedding-type", "f32", "--output-tensor-type", "f32"]
    assert args[4::2][:len(lines)] == ["--tensor-type"] * len(lines) and args[5:5 + 2 * len(lines):2] == lines


@pytest.mark.e2e
def test_the_fake_quantized_plan_predicts_what_llama_cpp_predicts_from_its_gguf(tmp_path):
    """llama.cpp's log-probabilities of quantdyn's plan GGUF (fixture) against quantdyn's own fake-quantized model:
    within a quarter of the quantization effect, mean and max, as for Q4_K_M (llama.cpp also rounds activations to
    8 bits inside its matmuls)."""
    from formats_models import NEOX, build_model
    from test_formats_export import next_token_logprobs

    from quantdyn.engine.walk import quantize_model

    ref = json.loads((FIX / "gguf_llamacpp.json").read_text())
    fp = build_model(NEOX).float()
    lp_fp = next_token_logprobs(fp)
    label = f"plan:{write_plan(gguf_plan(NEOX), tmp_path / 'p.json')}"
    quantize_model(fp, None, label, progress=False)
    lp_q = next_token_logprobs(fp)
    lp_llama = torch.tensor(ref["plans"]["neox"]["logprobs"], dtype=torch.float64)
    gap, effect = (lp_llama - lp_q).abs(), (lp_q - lp_fp).abs()
    assert gap.mean() < 0.25 * effect.mean() and gap.max() < 0.25 * effect.max()
