"""Optimizer table, registry and builder (quantdyn/train/optimizers.py)."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from quantdyn.config import from_dict
from quantdyn.errors import QuantdynError
from quantdyn.models.gpt import GPT, ModelConfig, resolve_model_config
from quantdyn.train.optimizers import (
    OPTIMIZERS,
    CombinedOptimizer,
    GroupRule,
    OptimConfig,
    build_optimizer,
    newton_schulz,
    optimizer_eval_mode,
    optimizer_train_mode,
    param_group_table,
)

NAMES = OPTIMIZERS.names()


def tiny_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(resolve_model_config(ModelConfig(vocab_size=64, n_layer=2, d_model=32, n_head=2, max_seq_len=32)))


def lm_loss(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    logits = model(idx[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), idx[:, 1:].reshape(-1))


def test_registry_has_the_paper_optimizers():
    assert set(NAMES) == {"adamw", "muon", "scion", "soap", "shampoo", "kron", "lion", "schedulefree_adamw"}


@pytest.mark.parametrize("name", NAMES)
def test_decreases_loss_on_linear_regression(name):
    torch.manual_seed(0)
    X = torch.randn(256, 16)
    W_true = 0.2 * torch.randn(8, 16)
    Y = X @ W_true.T
    model = nn.Linear(16, 8)
    opt = build_optimizer(model, OptimConfig(name=name, lr=2e-2, weight_decay=0.0))
    losses = []
    for _ in range(25):
        loss = F.mse_loss(model(X), Y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize("name", NAMES)
def test_decreases_loss_on_tiny_gpt(name):
    model = tiny_gpt()
    idx = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(1))
    opt = build_optimizer(model, OptimConfig(name=name))
    losses = []
    for _ in range(10):
        loss = lm_loss(model, idx)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(np.isfinite(losses))
    assert losses[-1] < losses[0] - 0.05, losses


def test_newton_schulz_matches_svd_orthogonalisation():
    torch.manual_seed(0)
    G = torch.randn(48, 32, dtype=torch.float64)
    U, S, Vh = torch.linalg.svd(G, full_matrices=False)
    polar = U @ Vh
    # cubic iteration converges to U V^T
    O = newton_schulz(G, steps=40, coefficients=(1.5, -0.5, 0.0), dtype=torch.float64)
    torch.testing.assert_close(O, polar, atol=1e-6, rtol=0)
    # Muon's quintic (5 steps): same singular vectors, singular values near 1
    Oq = newton_schulz(G, steps=5)
    s = torch.linalg.svdvals(Oq)
    assert 0.6 < s.min() and s.max() < 1.3, s
    assert torch.linalg.matrix_norm(Oq - polar, ord=2) < 0.4
    cos = (Oq * polar).sum() / (Oq.norm() * polar.norm())
    assert cos > 0.97


def test_newton_schulz_is_the_one_torch_muon_uses():
    muon_mod = pytest.importorskip("torch.optim._muon")
    ref = getattr(muon_mod, "_zeropower_via_newtonschulz", None)
    if ref is None:
        pytest.skip("torch.optim.Muon's Newton-Schulz is not reachable in this torch version")
    torch.manual_seed(1)
    G = torch.randn(64, 24)
    theirs = ref(G, (3.4445, -4.7750, 2.0315), 5, 1e-7).float()
    ours = newton_schulz(G, steps=5, dtype=torch.bfloat16).float()
    torch.testing.assert_close(ours, theirs, atol=0, rtol=0)  # same ops in bfloat16: bitwise equal
    ours32 = newton_schulz(G, steps=5).float()  # float32 differs only by bfloat16 rounding
    assert (theirs - ours32).norm() / theirs.norm() < 0.1


def test_param_group_table_assigns_groups_and_weight_decay():
    model = tiny_gpt()
    rows = {r["name"]: r for r in param_group_table(model, OptimConfig(name="muon"))}
    assert rows["gpt_neox.embed_in.weight"]["group"] == "embedding"
    assert rows["embed_out.weight"]["group"] == "head"
    for name, r in rows.items():
        if "norm" in name or name.endswith(".bias"):
            assert r["group"] == "no_decay" and r["weight_decay"] == 0.0, name
        if name.endswith(("query_key_value.weight", "attention.dense.weight", "dense_h_to_4h.weight",
                          "dense_4h_to_h.weight")):
            assert r["group"] == "hidden_matrix" and r["optimizer"] == "muon" and r["weight_decay"] == 0.1
    # paper B: AdamW outside the hidden matrices; the vocabulary never reaches the matrix optimizer
    assert {r["optimizer"] for r in rows.values() if r["group"] != "hidden_matrix"} == {"adamw"}
    assert len(rows) == len(list(model.parameters()))


def test_groups_carry_the_lr_contract_and_share_dicts():
    model = tiny_gpt()
    opt = build_optimizer(model, OptimConfig(name="muon"))
    assert isinstance(opt, CombinedOptimizer) and isinstance(opt, torch.optim.Optimizer)
    inner = [g for o in opt.optimizers.values() for g in o.param_groups]
    assert len(inner) == len(opt.param_groups) and all(a is b for a, b in zip(inner, opt.param_groups))
    assert [g["group_name"] for g in opt.param_groups] == ["hidden_matrix", "embedding", "head", "no_decay"]
    assert all(isinstance(g["lr_scale"], float) for g in opt.param_groups)
    # lr = 0 everywhere (set through the combined groups) -> no parameter moves
    before = [p.detach().clone() for p in model.parameters()]
    for g in opt.param_groups:
        g["lr"] = 0.0 * g["lr_scale"]
    lm_loss(model, torch.randint(0, 64, (2, 16))).backward()
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_optimizer_lr_scale_and_weight_decay_product():
    cfg = OptimConfig(name="lion")
    rows = param_group_table(tiny_gpt(), cfg)
    hid = next(r for r in rows if r["group"] == "hidden_matrix")
    assert hid["lr_scale"] == pytest.approx(0.1) and hid["weight_decay"] == pytest.approx(1.0)


def test_unknown_names_raise_with_did_you_mean():
    with pytest.raises(QuantdynError, match="did you mean 'muon'"):
        OptimConfig(name="moun")
    with pytest.raises(QuantdynError, match="did you mean 'precondition_frequency'"):
        OptimConfig(name="soap", extra={"precondition_frequncy": 5})
    with pytest.raises(QuantdynError, match="set optim.betas"):
        OptimConfig(name="adamw", extra={"betas": [0.9, 0.99]})
    with pytest.raises(QuantdynError, match="did you mean 'no_decay'"):
        from_dict(OptimConfig, {"groups": [{"name": "no_decy"}]})


def test_from_dict_fills_group_table():
    cfg = from_dict(OptimConfig, {"name": "soap", "groups": [{"name": "embedding", "lr_scale": 2}],
                                  "extra": {"precondition_frequency": 4}})
    assert [r.name for r in cfg.groups] == ["hidden_matrix", "embedding", "head", "no_decay"]
    assert cfg.groups[1].lr_scale == 2.0 and cfg.groups[3].wd_scale == 0.0
    opt = build_optimizer(tiny_gpt(), cfg)
    assert opt.optimizers["soap"].param_groups[0]["precondition_frequency"] == 4


def test_matrix_only_optimizer_on_vectors_is_refused():
    cfg = OptimConfig(name="adamw", groups=(GroupRule("no_decay", optimizer="muon", wd_scale=0.0),))
    with pytest.raises(QuantdynError, match="2-D weights only"):
        build_optimizer(tiny_gpt(), cfg)


# Small preconditioner periods so the round trip covers preconditioner state.
ROUND_TRIP_EXTRA = {
    "soap": {"precondition_frequency": 2},
    "shampoo": {"preconditioning_compute_steps": 2, "start_preconditioning_step": 2},
}


@pytest.mark.parametrize("name", NAMES)
def test_state_round_trip_is_exact(name):
    cfg = OptimConfig(name=name, extra=ROUND_TRIP_EXTRA.get(name, {}))
    batches = [torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(s)) for s in range(5)]

    def train(model, opt, steps):
        for idx in steps:
            opt.zero_grad(set_to_none=True)
            lm_loss(model, idx).backward()
            opt.step()

    def seeded_step(model, opt, idx):  # Kron draws from the global torch and numpy RNGs
        torch.manual_seed(123)
        np.random.seed(123)
        train(model, opt, [idx])

    model = tiny_gpt()
    opt = build_optimizer(model, cfg)
    train(model, opt, batches[:4])
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
    seeded_step(model, opt, batches[4])

    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)  # checkpoints hold tensors and plain values only
    resumed = tiny_gpt(seed=99)
    resumed.load_state_dict(ckpt["model"])
    opt2 = build_optimizer(resumed, cfg)
    opt2.load_state_dict(ckpt["optim"])
    seeded_step(resumed, opt2, batches[4])
    for (n, a), b in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), n


def test_schedulefree_train_eval_modes():
    model = tiny_gpt()
    opt = build_optimizer(model, OptimConfig(name="schedulefree_adamw"))
    for s in range(3):
        opt.zero_grad()
        lm_loss(model, torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(s))).backward()
        opt.step()
    y = [p.detach().clone() for p in model.parameters()]
    optimizer_eval_mode(opt)
    assert any(not torch.equal(a, b) for a, b in zip(y, model.parameters()))
    optimizer_train_mode(opt)
    for a, b in zip(y, model.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    # no-op for the others
    m2 = tiny_gpt()
    before = [p.detach().clone() for p in m2.parameters()]
    opt2 = build_optimizer(m2, OptimConfig(name="muon"))
    optimizer_eval_mode(opt2)
    optimizer_train_mode(opt2)
    assert all(torch.equal(a, b) for a, b in zip(before, m2.parameters()))


def test_combined_param_groups_stay_live_after_load_state_dict():
    """Setting group['lr'] through the combined optimizer must reach the inner ones after a resume."""
    model = tiny_gpt()
    opt = build_optimizer(model, OptimConfig(name="muon"))
    state = opt.state_dict()
    opt2 = build_optimizer(tiny_gpt(), OptimConfig(name="muon"))
    opt2.load_state_dict(state)
    inner = [g for o in opt2.optimizers.values() for g in o.param_groups]
    assert len(opt2.param_groups) == len(inner) and all(a is b for a, b in zip(opt2.param_groups, inner))
    for g in opt2.param_groups:
        g["lr"] = 0.123
    assert all(g["lr"] == 0.123 for g in inner)
