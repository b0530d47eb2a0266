"""+had exported as compressed-tensors with its transform config (export/layouts.py: Rotations), loaded with
transformers and compressed-tensors' own transform machinery as a user of the library would, and the exports
that cannot hold a rotation refused in one line before anything is written."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from quantdyn.engine.measure import measure
from quantdyn.engine.sinks import ExportSink
from quantdyn.errors import QuantdynError
from quantdyn.export import check_exportable, open_export
from quantdyn.quantize.catalogue import parse_quantizer
from quantdyn.quantize.rotation import hadamard_matrix

V = 128
NEEDS_TRANSFORMS = ("compressed-tensors with transforms (compressed_tensors.transform: TransformConfig, "
                    "apply_transform_config, the random-hadamard factory; compressed-tensors >= 0.11) is needed to "
                    "load +had exports; pip install -e '.[export]'")


def _llama():
    import transformers as tf

    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                              num_key_value_heads=2, intermediate_size=128,
                                              max_position_embeddings=64)).eval()


def _ce(model, windows) -> float:
    with torch.no_grad():
        logits = model(windows[:, :-1]).logits
    return float(F.cross_entropy(logits.reshape(-1, V).double(), windows[:, 1:].reshape(-1)))


def test_had_export_loads_and_computes_what_quantdyn_measured(tmp_path):
    transform = pytest.importorskip("compressed_tensors.transform", reason=NEEDS_TRANSFORMS)
    if not hasattr(transform, "apply_transform_config"):
        pytest.skip(NEEDS_TRANSFORMS)
    import transformers as tf

    m = _llama()
    g = torch.Generator().manual_seed(1)
    calib, windows = torch.randint(0, V, (8, 24), generator=g), torch.randint(0, V, (8, 33), generator=g)
    spec = "rtn4g32+had+seed5"
    sink = ExportSink("compressed-tensors", tmp_path / "ct", m, spec, spec)
    ce_q = measure(m, {spec: spec}, windows, calib, on_layer=sink).metrics[spec]["ce_q"]
    out = sink.close()
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    scheme = qcfg["transform_config"]["config_groups"]["had"]
    assert scheme["type"] == "random-hadamard" and [a["location"] for a in scheme["apply"]] == ["input"]
    assert scheme["apply"][0]["targets"] == sorted(qcfg["config_groups"]["group_0"]["targets"])
    tensors = load_file(out / "model.safetensors")
    mats = {k: t for k, t in tensors.items() if k.endswith(".had_input.weight")}
    # once per width (64: q/k/v/o/gate/up, 128: down), each the ±1 matrix D H of the seed
    assert sorted(t.shape[0] for t in mats.values()) == [64, 128]
    for t in mats.values():
        assert torch.equal(t.double(), hadamard_matrix(t.shape[0], 5))
    loaded = tf.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    without = _ce(loaded, windows)
    if not any(n.endswith("had_input") for n, _ in loaded.named_modules()):  # this transformers leaves it to us
        transform.apply_transform_config(loaded, transform.TransformConfig.model_validate(qcfg["transform_config"]))
        without = None
    by_size = {t.shape[0]: t for t in mats.values()}
    n = 0
    for name, mod in loaded.named_modules():
        if name.endswith("had_input"):
            mod.weight.data.copy_(by_size[mod.weight.shape[0]])  # the checkpoint's matrix, as vLLM loads it
            n += 1
    assert n == 14  # every quantized linear of the 2 blocks
    got = _ce(loaded, windows)
    # float32 model, the same quantized weights; the rotation as a dense product instead of quantdyn's fast
    # transform: a few float32 roundings per layer, far below the difference the rotation makes
    assert abs(got - ce_q) <= 1e-5, (got, ce_q)
    if without is not None:
        assert abs(without - ce_q) > 10 * 1e-5


@pytest.mark.parametrize("fmt, spec, match", [
    ("gptq", "gptq4g32+had", "gptq checkpoints have no place for a rotation"),
    ("gguf", "q4_k_m+had", "gguf checkpoints have no place for a rotation"),
    ("compressed-tensors", "rtn4g32+r1", r"\+r1 models are not exported"),
    ("gptq", "rtn4g32+had+r1", r"\+r1 models are not exported"),
])
def test_exports_without_a_place_for_the_rotation_refuse_it(tmp_path, fmt, spec, match):
    with pytest.raises(QuantdynError, match=match) as e:
        open_export(fmt, tmp_path / "o", {"model_type": "llama"}, spec, "llama")
    assert "\n" not in str(e.value) and not (tmp_path / "o").exists()


def test_transform_matrix_once_per_width_when_the_layers_are_known():
    layers = {"a.q": (64, 64), "a.down": (64, 128), "b.q": (64, 64), "b.down": (64, 128)}
    st = check_exportable("compressed-tensors", parse_quantizer("rtn4g32+had"), "llama", layers=layers)
    assert st.transform_owners == frozenset({"a.q", "a.down"})
    assert check_exportable("compressed-tensors", parse_quantizer("rtn4g32"), "llama", layers=layers
                            ).transform_owners is None
