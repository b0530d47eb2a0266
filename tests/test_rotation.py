"""Rotations before quantization (quantize/rotation.py, quantize/residual_rotation.py): the Hadamard matrices
against scipy's and compressed-tensors', the rotated statistics, a rotated layer against a reference built from
those matrices, the labels, R1's folded model against the original, and the one-line refusals."""
from __future__ import annotations

import copy
import dataclasses
import math
import re

import pytest
import scipy.linalg
import torch
import torch.nn as nn

from quantdyn.config import config_hash
from quantdyn.engine.blockwise import quantize_layer
from quantdyn.engine.measure import measure
from quantdyn.engine.walk import quantize_model
from quantdyn.errors import QuantdynError
from quantdyn.models.gpt import GPT, ModelConfig, resolve_model_config
from quantdyn.quantize.catalogue import QUANTIZERS, format_labels, parse_quantizer
from quantdyn.quantize.formats import int4_per_token
from quantdyn.quantize.gptq import gptq, gptq_batch, stats_from
from quantdyn.quantize.primitives import QuantResult
from quantdyn.quantize.residual_rotation import check_r1, check_rotations, rotate_model
from quantdyn.quantize.rotation import (
    fold_stats,
    hadamard_factor,
    hadamard_matrix,
    quantize_rotated,
    quantize_rotated_batch,
    rotate,
    rotate_stats,
    signs,
)
from quantdyn.quantize.rtn import rtn

F32_EPS = torch.finfo(torch.float32).eps


def _dense_R(n: int, seed: int) -> torch.Tensor:
    """R = D H / sqrt(n) from scipy's Sylvester matrix and the seed's signs (n a power of two), float64."""
    H = torch.tensor(scipy.linalg.hadamard(n), dtype=torch.float64)
    return signs(n, seed)[:, None] * H / math.sqrt(n)


# ----------------------------------------------------------------------------- the matrices
@pytest.mark.parametrize("n", [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024])
def test_power_of_two_is_scipys_sylvester_matrix(n):
    assert hadamard_factor(n) == 1
    assert torch.equal(hadamard_matrix(n), torch.tensor(scipy.linalg.hadamard(n), dtype=torch.float64))


@pytest.mark.parametrize("n", [12, 20, 24, 28, 36, 44, 52, 76, 100, 108, 148, 344, 576, 1536])
def test_other_widths_are_hadamard_matrices(n):
    H = hadamard_matrix(n, seed=1)
    assert set(H.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(H @ H.t(), n * torch.eye(n, dtype=torch.float64))  # integers: exact


def test_the_widths_of_real_models_factor_and_the_others_are_named():
    # (width, the non-Sylvester factor): LLaMA/OLMo-2 4096 and 11008 (Paley I over GF(7^3)), SmolLM 576, Qwen2.5
    # 896/4864/8960/18944, 1536 and 6144 = 2048 * 3, OLMo-2-13B's 13824
    expect = {4096: 1, 11008: 344, 576: 36, 896: 28, 4864: 76, 8960: 140, 18944: 148, 1536: 12, 6144: 12,
              13824: 108}
    assert {n: hadamard_factor(n) for n in expect} == expect
    for n in (3, 6, 10, 86, 172, 0):
        assert hadamard_factor(n) is None


@pytest.mark.parametrize("n", [2, 4, 8, 16, 64, 128, 256, 512, 1024])
@pytest.mark.parametrize("seed", [0, 5])
def test_random_hadamard_equals_compressed_tensors(n, seed):
    """compressed-tensors' random_hadamard_matrix draws its signs from the generator as quantdyn does, and for
    powers of two other than 32 its stored matrices are Sylvester's: the two matrices are equal."""
    ct = pytest.importorskip("compressed_tensors.transform.utils.hadamard",
                             reason="compressed-tensors with transforms not installed (pip install -e '.[export]')")
    theirs = ct.random_hadamard_matrix(n, torch.float64, gen=torch.Generator().manual_seed(seed))
    assert torch.equal(hadamard_matrix(n, seed), theirs)


@pytest.mark.parametrize("n", [64, 96, 1536])
def test_rotate_is_the_dense_product_and_is_undone(n):
    x = torch.randn(7, n, generator=torch.Generator().manual_seed(0))
    R = hadamard_matrix(n, 3) / math.sqrt(n)
    y = rotate(x, 3)
    tol = 8 * F32_EPS * math.log2(n) * float(x.abs().max()) * math.sqrt(n)  # float32 sums of ~log n steps
    assert float((y.double() - x.double() @ R).abs().max()) <= tol
    assert float((rotate(y, 3, inverse=True) - x).abs().max()) <= 2 * tol
    assert torch.allclose(y.norm(dim=1), x.norm(dim=1), rtol=1e-5)  # orthogonal


# ----------------------------------------------------------------------------- statistics
def _inputs(n: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    X = torch.randn(3, 40, n, generator=g)
    X[..., 5] *= 30.0  # an outlier channel
    return X


def test_the_rotated_hessian_is_that_of_the_rotated_inputs():
    X = _inputs()
    got = rotate_stats(stats_from(X), 7).H
    want = stats_from(rotate(X, 7)).H
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    # and it is R^T H R for the dense R
    R = hadamard_matrix(64, 7) / 8.0
    H = stats_from(X).H.double()
    assert torch.allclose(got.double(), R.t() @ H @ R, atol=1e-5 * float(H.abs().max()))


def test_awq_mean_abs_is_summed_from_the_rotated_inputs():
    X = _inputs()
    s = fold_stats(None, X, True, 7)
    s = fold_stats(s, X[:1], True, 7)
    rot = torch.cat([rotate(X, 7), rotate(X[:1], 7)]).reshape(-1, 64)
    assert torch.allclose(s.abs_sum, rot.abs().sum(0, dtype=torch.float64), rtol=1e-6)
    H = stats_from(torch.cat([X, X[:1]])).H  # H stays unrotated until the layer is quantized
    assert torch.allclose(s.H, H, atol=1e-5 * float(H.abs().max()))


# ----------------------------------------------------------------------------- a rotated layer
def test_rotated_rtn_codes_equal_the_reference_and_the_function_is_kept():
    """Q(W R) with R from scipy's matrix (float64: no code near a rounding tie moves) has the same codes; the
    result's weight is Q(W R) R^T, and an identity quantizer gives W back."""
    g = torch.Generator().manual_seed(4)
    W = torch.randn(16, 64, generator=g, dtype=torch.float64)
    W[:, 9] *= 25.0
    cfg = parse_quantizer("rtn4g32+had+seed3")
    res = quantize_rotated(lambda w, stats, c: rtn(w, c), W, None, cfg, "layer")
    R = _dense_R(64, 3)
    ref = rtn(W @ R, cfg)
    assert torch.equal(res.codes, ref.codes) and torch.allclose(res.scales, ref.scales, rtol=1e-12, atol=0)
    assert torch.allclose(res.weight, ref.weight @ R.t(), atol=1e-12)
    assert res.rotation_seed == 3 and res.diagnostics["rotation_seed"] == 3
    ident = quantize_rotated(lambda w, stats, c: QuantResult(w, *(torch.zeros(1),) * 4, bits=4), W, None, cfg, "l")
    assert torch.allclose(ident.weight, W, atol=1e-12)
    # incoherence: the rotation spreads the outlier column, so its rows' largest entry shrinks
    assert float((W @ R).abs().max()) < 0.5 * float(W.abs().max())


def test_quantizers_see_the_rotated_statistics():
    X = _inputs()
    seen = {}

    def spy(w, stats, c):
        seen["H"] = stats.H
        return rtn(w, c)

    W = torch.randn(8, 64, generator=torch.Generator().manual_seed(5))
    quantize_rotated(spy, W, stats_from(X), parse_quantizer("gptq4+had+seed1"), "layer")
    want = stats_from(rotate(X, 1)).H
    assert torch.allclose(seen["H"], want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_rotated_layers_sharing_a_hessian_batch_on_one_rotated_hessian():
    """The engine's batched GPTQ (q/k/v sharing one Hessian) with +had: both rotated layers get the same rotated
    Hessian object (so they still share one column loop), a plain layer its own unrotated one, and every result is
    what quantize_rotated / gptq give one at a time, bit for bit."""
    st = stats_from(_inputs())
    g = torch.Generator().manual_seed(6)
    Ws = [torch.randn(8, 64, generator=g) for _ in range(3)]
    cfgs = [parse_quantizer("gptq3+had+seed1")] * 2 + [parse_quantizer("gptq3")]
    seen = []
    out = quantize_rotated_batch(lambda ps: seen.append(ps) or gptq_batch(ps), list(zip(Ws, [st] * 3, cfgs)),
                                 ["q", "k", "v"])
    (ps,) = seen
    assert ps[0][1] is ps[1][1] and ps[0][1] is not st and ps[2][1] is st
    for W, c, res in zip(Ws, cfgs, out):
        ref = quantize_rotated(gptq, W, st, c, "x") if c.hadamard else gptq(W, st, c)
        assert torch.equal(res.codes, ref.codes) and torch.equal(res.weight, ref.weight)
        assert res.rotation_seed == (1 if c.hadamard else None)


def test_w4a4_with_had_quantizes_the_rotated_activations():
    torch.manual_seed(0)
    lin = nn.Linear(64, 16, bias=False)
    W = lin.weight.detach().clone()
    cfg = parse_quantizer("w4a4+had+seed2")
    res, _ = quantize_layer("l", lin, None, cfg, None)
    x = _inputs()[0]
    R = _dense_R(64, 2).float()
    Q = rtn(W @ R, cfg).weight  # the rotated weight's grid (w4a4: rtn4, group 128)
    want = int4_per_token(x @ R) @ Q.t()
    with torch.no_grad():
        got = lin(x)
    assert torch.allclose(got, want, atol=1e-4 * float(want.abs().max()))
    assert torch.allclose(res.weight, Q @ R.t(), atol=1e-5)


# ----------------------------------------------------------------------------- labels
def test_every_quantizer_takes_a_rotation_and_keeps_its_label():
    labels = ["rtn4", "gptq3", "awq4", "gptq4-gptqmodel"] + sorted(
        {QUANTIZERS.get(m).format.label for m in set(format_labels().values())})
    for base in labels:
        plain = parse_quantizer(base)
        for suffix in ("+had", "+had+seed7", "+r1", "+had+r1"):
            qc = parse_quantizer(base + suffix)
            assert qc.name == plain.name + suffix and parse_quantizer(qc.name) == qc
            assert dataclasses.replace(qc, hadamard=False, r1=False, rotation_seed=0) == plain
            assert config_hash(qc) != config_hash(plain)
    assert parse_quantizer("RTN4+SEED0+HAD").name == "rtn4+had"


@pytest.mark.parametrize("spec, msg", [
    ("rtn4+hda", "unknown rotation '\\+hda'.*did you mean 'had'"),
    ("rtn4+seed3", "seeds a rotation, but none is asked for"),
    ("+had", "no quantizer before it"),
    ("rtn4+had-head", "unknown rotation"),
])
def test_bad_rotation_labels_are_one_line(spec, msg):
    with pytest.raises(QuantdynError, match=msg) as e:
        parse_quantizer(spec)
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------- R1 and the refusals
def _hf(kind: str, tied: bool = True) -> nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    cls, conf = {"llama": (tf.LlamaForCausalLM, tf.LlamaConfig), "qwen2": (tf.Qwen2ForCausalLM, tf.Qwen2Config),
                 "qwen3": (tf.Qwen3ForCausalLM, tf.Qwen3Config), "olmo2": (tf.Olmo2ForCausalLM, tf.Olmo2Config)}[kind]
    m = cls(conf(vocab_size=96, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied)).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)  # norm scales that are not 1, so that folding them matters
    return m


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_r1_leaves_the_full_precision_logits_unchanged(kind):
    m = _hf(kind)
    ids = torch.randint(0, 96, (3, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = m(ids).logits
        r = rotate_model(copy.deepcopy(m), seed=3)
        got = r(ids).logits
    assert r.lm_head.weight is not r.model.embed_tokens.weight  # untied: the head took the final norm's scale
    tol = 64 * F32_EPS * float(ref.abs().max())  # a few float32 rounding steps per layer
    assert float((got - ref).abs().max()) <= tol
    # the embedding and the stream-reading weights really are rotated
    assert not torch.allclose(r.model.embed_tokens.weight, m.model.embed_tokens.weight, atol=1e-3)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_r1_in_a_measurement_is_the_rotated_model_quantized(kind):
    """The walk rotates each block's copy between the model's basis; quantizing the offline-rotated model gives
    the same quantized function (the head stays in full precision in both)."""
    m = _hf(kind)
    g = torch.Generator().manual_seed(2)
    ev, cal = torch.randint(0, 96, (8, 25), generator=g), torch.randint(0, 96, (8, 24), generator=g)
    walked = measure(m, ["rtn4+r1+seed3", "rtn4"], ev, cal).metrics
    offline = measure(rotate_model(copy.deepcopy(m), seed=3), ["rtn4"], ev, cal).metrics["rtn4"]
    assert abs(walked["rtn4+r1+seed3"]["ce_q"] - offline["ce_q"]) <= 1e-5
    assert walked["rtn4+r1+seed3"]["ce_q"] != walked["rtn4"]["ce_q"]  # the rotation changed what was quantized
    # in place, quantize_model rotates the whole model first: the same model again
    q = copy.deepcopy(m)
    quantize_model(q, cal, "rtn4+r1+seed3", progress=False)
    with torch.no_grad():
        lp = torch.log_softmax(q(ev[:, :-1]).logits.double(), -1)
    ce = float(-lp.gather(-1, ev[:, 1:, None]).mean())
    assert abs(ce - offline["ce_q"]) <= 1e-5


def test_r1_is_refused_where_it_is_not_exact_naming_the_architecture():
    gpt = GPT(resolve_model_config(ModelConfig(preset="tiny-2x64", vocab_size=64)))
    for model, name in ((gpt, "quantdyn-gpt normalises with LayerNorm"), (_hf("olmo2"), "olmo2 normalises the attention")):
        with pytest.raises(QuantdynError, match=name) as e:
            check_rotations(model, [parse_quantizer("rtn4+r1")])
        assert "\n" not in str(e.value)
        with pytest.raises(QuantdynError, match=name):
            rotate_model(model)
    check_rotations(gpt, [parse_quantizer("rtn4+had")])  # +had is fine there
    # an architecture nobody has shown R1 exact for is refused without a reason it may not have
    with pytest.raises(QuantdynError, match=r"mistral is not among them") as e:
        check_r1("mistral")
    assert "LayerNorm" not in str(e.value)


def test_had_on_a_width_without_a_hadamard_matrix_names_the_layer_before_any_work():
    import transformers as tf

    m = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=64, hidden_size=20, intermediate_size=10, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=2)).eval()
    calls = []
    with pytest.raises(QuantdynError, match=r"layer 'model.layers.0.mlp.down_proj' has 10 input features") as e:
        measure(m, ["rtn4+had"], torch.zeros(2, 9, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long),
                on_block=calls.append)
    assert "\n" not in str(e.value) and not calls  # nothing was measured
    measure(m, ["rtn4"], torch.zeros(2, 9, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))


def test_quantize_refuses_in_one_line_and_writes_nothing(hf_models, tmp_path, cli):
    short = ["--calib-seq-len", "32", "--eval-seq-len", "32", "--eval-tokens", "1024", "--calib-samples", "2"]
    out = ["--out", str(tmp_path / "o")]
    for model, q, extra, msg in ((hf_models["gpt2"], "rtn4+r1", [], "gpt2 normalises with LayerNorm"),
                                 (hf_models["llama"], "rtn4+r1", out, "does not write \\+r1 models"),
                                 (hf_models["llama"], "gptq4+had", [*out, "--export", "gptq"],
                                  "gptq checkpoints have no place for a rotation")):
        r = cli("quantize", str(model), "--quantizers", q, *short, *extra)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert re.search(msg, r.stderr), r.stderr
        assert not (tmp_path / "o").exists()


def test_sweep_refuses_a_rotation_the_model_cannot_take_before_any_work(tiny_checkpoint, tmp_path, cli):
    store = tmp_path / "store"
    r = cli("sweep", "--checkpoint", str(tiny_checkpoint), "--quantizers", "rtn4,rtn4+r1", "--store", str(store),
            "--quiet")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "quantdyn-gpt normalises with LayerNorm" in r.stderr and not store.exists()
