"""QAT with a deployment format's own fake quantization (qat.format; issue 48.2): the forward is the model the
engine deploys with that label, the gradient reaches the latent weights unchanged, Q(W) is computed once per
state of the weights, and formats without a training path are refused in one line."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from quantdyn.engine.walk import quantize_model
from quantdyn.errors import QuantdynError
from quantdyn.models.gpt import GPT, ModelConfig, resolve_model_config
from quantdyn.train.qat import QATConfig, QATLinear, fake_quantizations, prepare_qat, strip_qat


def gpt(d_model: int = 256, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(resolve_model_config(ModelConfig(vocab_size=64, n_layer=2, d_model=d_model, n_head=2,
                                                max_seq_len=16)))


def loss_of(model, idx):
    logits = model(idx[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), idx[:, 1:].reshape(-1))


# d_model 256: q4_k's rows fit its 256-weight block in the MLP's input (1024) and the attention's (256); q4_k_m
# gives tensors different types by place; nvfp4 needs multiples of 16
@pytest.mark.parametrize("label", ["rtn4", "rtn3g64", "q4_k", "q4_k_m", "nvfp4"])
def test_forward_is_the_engine_deployed_model(label):
    """The QAT forward equals the plain model after the engine's in-place quantization with the same label."""
    plain = gpt()
    idx = torch.randint(0, 64, (2, 16))
    deployed = copy.deepcopy(plain)
    quantize_model(deployed, None, label, progress=False)
    qat = prepare_qat(copy.deepcopy(plain), QATConfig(format=label))
    n_qat = sum(isinstance(m, QATLinear) for m in qat.modules())
    assert n_qat == 2 * 4  # every block linear (4 per GPT-NeoX block), not the head
    with torch.no_grad():
        a, b, fp = qat(idx), deployed(idx), plain(idx)
    # the same Q(W) in float32 on the same input: equal to a few float32 ULPs of the logits
    tol = 64 * torch.finfo(torch.float32).eps * float(b.abs().max())
    assert float((a - b).abs().max()) <= tol
    assert float((a - fp).abs().max()) > 100 * tol  # and the quantization does change the forward


def test_gradient_is_straight_through():
    """dL/dW_latent = dL/dW evaluated at W = Q(W) (identity STE), for every quantized weight."""
    plain = gpt(d_model=64)
    idx = torch.randint(0, 64, (2, 16))
    qat = prepare_qat(copy.deepcopy(plain), QATConfig(format="rtn4"))
    deployed = copy.deepcopy(plain)
    quantize_model(deployed, None, "rtn4", progress=False)
    loss_of(qat, idx).backward()
    loss_of(deployed, idx).backward()
    qnames = {n + ".weight" for n, m in qat.named_modules() if isinstance(m, QATLinear)}
    assert len(qnames) == 8
    grads = dict(deployed.named_parameters())
    for n, p in qat.named_parameters():
        g = grads[n].grad
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-6 * float(g.abs().max()))
    # the latent weights are not the quantized ones: the gradient flowed to full-precision parameters
    w = dict(qat.named_parameters())[sorted(qnames)[0]]
    assert float((w.detach() - grads[sorted(qnames)[0]].detach()).abs().max()) > 0


def test_q_of_w_once_per_weight_state():
    """Forwards at the same weights share Q(W); an optimizer step (a new weight state) computes it again."""
    model = prepare_qat(gpt(d_model=64), QATConfig(format="rtn4"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx = torch.randint(0, 64, (2, 16))
    loss_of(model, idx).backward()
    loss_of(model, idx).backward()  # a second micro-batch at the same weights
    assert fake_quantizations(model) == 8
    opt.step()
    opt.zero_grad()
    loss = loss_of(model, idx)
    assert fake_quantizations(model) == 16
    # and the forward after the step uses Q of the new weights, not the cached old ones
    check = copy.deepcopy(strip_qat(copy.deepcopy(model)))
    quantize_model(check, None, "rtn4", progress=False)
    torch.testing.assert_close(loss, loss_of(check, idx), rtol=1e-5, atol=0)


def test_checkpoint_names_unchanged():
    model = gpt(d_model=64)
    names = set(model.state_dict())
    assert set(prepare_qat(model, QATConfig(format="nvfp4")).state_dict()) == names


@pytest.mark.parametrize("label, why", [("gptq4", "needs calibration"), ("awq4", "needs calibration"),
                                        ("w4a4", "quantizes activations"), ("rtn4+had", "rotation"),
                                        ("q4_k-imatrix", "needs calibration"), ("rtn4-head", "head")])
def test_formats_without_a_training_path_are_one_line(label, why):
    with pytest.raises(QuantdynError) as e:
        QATConfig(format=label)
    msg = str(e.value)
    assert "\n" not in msg and why in msg
    assert "rtn<bits>" in msg and "q4_k" in msg and "nvfp4" in msg  # it names the formats that have one


def test_format_fixes_the_other_fields():
    c = QATConfig(format="RTN4g128")
    assert (c.method, c.format, c.w_bits, c.a_bits, c.label) == ("format", "rtn4", 4, None, "rtn4")
    assert QATConfig(format="rtn3g64").w_bits == 3
    with pytest.raises(QuantdynError, match="weights only"):
        QATConfig(format="rtn4", a_bits=8)
    with pytest.raises(QuantdynError, match="4-bit weights by definition"):
        QATConfig(format="nvfp4", w_bits=3)
    with pytest.raises(QuantdynError, match="needs qat.format"):
        QATConfig(method="format")
    assert QATConfig().label == "quest-w4a4"


def test_format_qat_is_refused_under_fsdp2():
    from quantdyn.config import from_dict
    from quantdyn.train.config import RunConfig

    with pytest.raises(QuantdynError, match="fsdp2 shards"):
        from_dict(RunConfig, {"qat": {"format": "rtn4"}, "dist": {"strategy": "fsdp2"}})
    assert from_dict(RunConfig, {"qat": {"format": "rtn4"}}).qat.format == "rtn4"
