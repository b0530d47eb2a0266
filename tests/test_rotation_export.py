"""+had exported as compressed-tensors with its transform config (export/layouts.py: Rotations), loaded with
transformers and compressed-tensors' own transform machinery as a user of the library would, and the exports
that cannot hold a rotation refused in one line before anything is written."""
from __future__ import annotations

import json
import math

import pytest
import scipy.linalg
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from quantdyn.engine.measure import measure
from quantdyn.engine.sinks import ExportSink
from quantdyn.errors import QuantdynError
from quantdyn.export import check_exportable, open_export
from quantdyn.quantize.catalogue import parse_quantizer
from quantdyn.quantize.rotation import signs

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


def _logits(model, windows) -> torch.Tensor:
    with torch.no_grad():
        return model(windows[:, :-1]).logits.double()


def _ce(model, windows) -> float:
    return float(F.cross_entropy(_logits(model, windows).reshape(-1, V), windows[:, 1:].reshape(-1)))


def _f32_ulp(x: float) -> float:
    return math.ulp(float(torch.tensor(x, dtype=torch.float32))) * 2 ** 29  # float64 ulp -> float32's (52 - 23 bits)


def _plain(out, weights: dict[str, torch.Tensor]):
    """A plain transformers model of the checkpoint's architecture (no quantization, no transform) holding
    ``weights``: independent of what ``from_pretrained`` does with the quantization and transform configs."""
    import transformers as tf

    cfg = tf.AutoConfig.from_pretrained(str(out))
    del cfg.quantization_config
    model = tf.LlamaForCausalLM(cfg).eval()
    model.load_state_dict(weights, strict=True)
    return model


def test_had_export_loads_and_computes_what_quantdyn_measured(tmp_path):
    transform = pytest.importorskip("compressed_tensors.transform", reason=NEEDS_TRANSFORMS)
    if not hasattr(transform, "apply_transform_config"):
        pytest.skip(NEEDS_TRANSFORMS)
    import transformers as tf

    m = _llama()
    g = torch.Generator().manual_seed(1)
    calib, windows = torch.randint(0, V, (8, 24), generator=g), torch.randint(0, V, (8, 33), generator=g)
    fp_logits = _logits(m, windows)
    spec = "rtn4g32+had+seed5"
    sink = ExportSink("compressed-tensors", tmp_path / "ct", m, spec, spec)
    ce_q = measure(m, {spec: spec}, windows, calib, on_layer=sink).metrics[spec]["ce_q"]
    out = sink.close()
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    (scheme_name, scheme), = qcfg["transform_config"]["config_groups"].items()
    assert scheme["type"] == "random-hadamard" and not scheme["randomize"]
    (apply,) = scheme["apply"]
    assert apply["location"] == "input" and not apply["inverse"] and not apply["ignore"]
    targets = apply["targets"]
    assert targets == sorted(qcfg["config_groups"]["group_0"]["targets"])
    assert len(targets) == 14  # every quantized linear of the 2 blocks: q k v o gate up down
    tensors = load_file(out / "model.safetensors")
    mats = {k: t for k, t in tensors.items() if k.endswith(f".{scheme_name}_input.weight")}
    # compressed-tensors names a transform <module>.<scheme>_<location>; the layers of one width share one matrix
    # (tied), which save_pretrained stores once, under the first of them in the model's module order
    widths = {t: tensors[f"{t}.weight_shape"][1].item() for t in targets}
    first = {}
    for t, _ in m.named_modules():
        if t in widths:
            first.setdefault(widths[t], t)
    assert sorted(mats) == sorted(f"{t}.{scheme_name}_input.weight" for t in first.values())
    assert sorted(first) == [64, 128]  # q/k/v/o/gate/up read 64 features, down 128
    by_width = {w: mats[f"{t}.{scheme_name}_input.weight"].double() for w, t in first.items()}
    for w, M in by_width.items():
        # ±1 with M Mᵀ = n I (exact in float64) and, row by row, the seed's signs times Sylvester's Hadamard
        # matrix (scipy's, not quantdyn's fast transform)
        assert torch.equal(M @ M.T, w * torch.eye(w, dtype=torch.float64))
        assert torch.equal(M, torch.diag(signs(w, 5)) @ torch.tensor(scipy.linalg.hadamard(w), dtype=torch.float64))

    loaded = tf.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    decompressed = {k: v for k, v in loaded.state_dict().items() if f".{scheme_name}_input." not in k}
    # the transform as the saved config defines it, by hand: each target's input x -> x M / sqrt(n), so its
    # stored (rotated, quantized) weight W' acts as the plain weight W' Mᵀ / sqrt(n)
    by_hand = dict(decompressed)
    for t in targets:
        W = decompressed[f"{t}.weight"].double()
        by_hand[f"{t}.weight"] = (W @ by_width[widths[t]].T / math.sqrt(widths[t])).float()
    by_hand, without = _plain(out, by_hand), _plain(out, decompressed)

    # the transform as compressed-tensors builds it from the saved config, its matrices loaded by name from the
    # checkpoint (whether or not this transformers already did both while loading)
    if not any(n.endswith(f"{scheme_name}_input") for n, _ in loaded.named_modules()):
        transform.apply_transform_config(loaded, transform.TransformConfig.model_validate(qcfg["transform_config"]))
        result = loaded.load_state_dict(mats, strict=False)
        assert not result.unexpected_keys
    built = {n: mod.weight for n, mod in loaded.named_modules() if n.endswith(f"{scheme_name}_input")}
    assert sorted(built) == sorted(f"{t}.{scheme_name}_input" for t in targets)
    for n, w in built.items():
        assert torch.equal(w.double(), by_width[w.shape[0]])

    # float32 models, the same quantized weights; the rotation as a dense product instead of quantdyn's fast
    # transform: a few float32 roundings per layer, within 16 float32 ulps of the CE (observed: 0.2 ulp both ways)
    tol = 16 * _f32_ulp(ce_q)
    got = {"by hand": _ce(by_hand, windows), "compressed-tensors": _ce(loaded, windows)}
    for how, ce in got.items():
        assert abs(ce - ce_q) <= tol, (how, ce, ce_q, tol)
    # the rotation matters: without it the model strays from the full-precision one it was quantized from. This
    # untrained model's CE on the random windows is ln(128) give or take either way, so the CE is taken against the
    # FP model's own greedy tokens: per token, that without the transform exceeds that with it, the mean
    # difference at least 10 standard errors above zero (observed: 0.16 nats, 19.5 standard errors)
    labels = fp_logits.argmax(-1).reshape(-1)
    def token_ce(model):
        return F.cross_entropy(_logits(model, windows).reshape(-1, V), labels, reduction="none")
    d = token_ce(without) - token_ce(by_hand)
    z = float(d.mean() / (d.std() / math.sqrt(d.numel())))
    assert z > 10, z


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
