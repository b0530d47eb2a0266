"""SAM and ASAM (train/sam.py, optim.sam_rho / optim.sam_adaptive): the update rule on a quadratic worked out by
hand, the same trajectory as an independent implementation (pytorch-optimizer's SAM class), and in the trainer:
the cost it records, exact resume, and the bad inputs."""
import json

import numpy as np
import pytest
import torch
from conftest import tiny_run_dict

from quantdyn.config import from_dict
from quantdyn.errors import QuantdynError
from quantdyn.runs import latest_resumable
from quantdyn.train.checkpoint import read_metrics
from quantdyn.train.config import RunConfig
from quantdyn.train.sam import perturbed, sam_perturbation
from quantdyn.train.trainer import train


def _quadratic(seed=0, n=5):
    rng = np.random.default_rng(seed)
    M = rng.standard_normal((n, n))
    A = M @ M.T + n * np.eye(n)  # symmetric positive definite
    w = rng.standard_normal(n)
    return A, w


@pytest.mark.parametrize("adaptive", [False, True])
def test_sam_gradient_on_a_quadratic_equals_the_rule_worked_out_by_hand(adaptive):
    """L(w) = ½ wᵀAw: ∇L = Aw. SAM's gradient is A(w + ε), ε = ρ g/‖g‖ (ASAM: ρ w² g/‖|w| g‖), computed here in
    float64 numpy from the papers' formulas; the weights come back bit for bit."""
    A, w0 = _quadratic()
    rho = 0.3
    g = A @ w0
    if adaptive:
        eps = rho * w0**2 * g / np.linalg.norm(np.abs(w0) * g)
    else:
        eps = rho * g / np.linalg.norm(g)
    expected = A @ (w0 + eps)

    At = torch.tensor(A)
    w = torch.nn.Parameter(torch.tensor(w0))
    (0.5 * w @ At @ w).backward()
    assert np.allclose(w.grad.numpy(), g, rtol=1e-12)
    with perturbed([w], rho, adaptive):
        assert np.allclose(w.detach().numpy(), w0 + eps, rtol=1e-12, atol=0)
        assert w.grad is None  # cleared: the backward inside writes ∇L(w + ε)
        (0.5 * w @ At @ w).backward()
    assert torch.equal(w.detach(), torch.tensor(w0))  # restored exactly, not by subtracting ε
    # float64 throughout: a few ULPs of |A(w+ε)|
    assert np.allclose(w.grad.numpy(), expected, rtol=1e-12, atol=1e-12 * np.abs(A).sum())
    assert not np.allclose(expected, g, rtol=1e-3)  # the test would see a missing perturbation


def test_the_norm_is_global_over_all_parameters_and_a_zero_gradient_gives_no_step():
    a, b = torch.tensor([3.0, 0.0]), torch.tensor([[0.0, 4.0]])
    ea, eb = sam_perturbation([torch.ones(2), torch.ones(1, 2)], [a, b], rho=1.0, adaptive=False)
    # ‖(3, 0, 0, 4)‖ = 5: one norm over both tensors, not one per tensor
    assert torch.allclose(ea, torch.tensor([0.6, 0.0])) and torch.allclose(eb, torch.tensor([[0.0, 0.8]]))
    (ez,) = sam_perturbation([torch.ones(3)], [torch.zeros(3)], rho=0.05, adaptive=True)
    assert torch.equal(ez, torch.zeros(3))  # no NaN from 0/0


@pytest.mark.parametrize("adaptive,rho", [(False, 0.05), (True, 0.5)])
def test_a_few_steps_follow_pytorch_optimizers_sam(adaptive, rho):
    """Five AdamW steps of a small MLP under our SAM equal those of pytorch-optimizer's SAM class (an independent
    implementation of the same papers) to float32 rounding."""
    from pytorch_optimizer import SAM

    torch.manual_seed(0)
    x, y = torch.randn(64, 8), torch.randn(64, 1)

    def make():
        torch.manual_seed(1)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def loss_of(m):
        return torch.nn.functional.mse_loss(m(x), y)

    ours, ref = make(), make()
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = SAM(ref.parameters(), torch.optim.AdamW, rho=rho, adaptive=adaptive, lr=1e-2, weight_decay=0.1,
                  foreach=False)
    plain = make()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(5):
        opt.zero_grad()
        loss_of(ours).backward()
        with perturbed(list(ours.parameters()), rho, adaptive):
            loss_of(ours).backward()
        opt.step()

        ref_opt.zero_grad()
        loss_of(ref).backward()
        ref_opt.first_step(zero_grad=True)
        loss_of(ref).backward()
        ref_opt.second_step(zero_grad=True)

        plain_opt.zero_grad()
        loss_of(plain).backward()
        plain_opt.step()
    for p, q in zip(ours.parameters(), ref.parameters()):
        # AdamW's steps are ~lr = 1e-2 per weight; float32 summation order differs between the two: 1e-6 is 1e-4 of a step
        assert torch.allclose(p, q, atol=1e-6, rtol=0)
    # and SAM is not the plain update: it moves the weights by far more than the tolerance above
    assert max((p - r).abs().max() for p, r in zip(ours.parameters(), plain.parameters())) > 1e-4


def _run_cfg(tmp_path, data_cfg, name, **optim):
    d = tiny_run_dict(tmp_path, data_cfg, steps=8, checkpoint_every=4)
    d.update(name=name, optim=optim)
    return from_dict(RunConfig, d)


def test_sam_in_the_trainer_costs_two_passes_resumes_exactly_and_changes_the_run(tmp_path, kjv_small):
    from safetensors.torch import load_file

    data_cfg, _ = kjv_small
    full = train(_run_cfg(tmp_path, data_cfg, "full", sam_rho=0.05), progress=False)
    part = train(_run_cfg(tmp_path, data_cfg, "part", sam_rho=0.05), progress=False, stop_after=4)
    train(_run_cfg(tmp_path, data_cfg, "part", sam_rho=0.05), part, resume=latest_resumable(part), progress=False)
    plain = train(_run_cfg(tmp_path, data_cfg, "plain"), progress=False)

    assert json.loads((full / "run.json").read_text())["forward_backward_per_step"] == 2
    assert json.loads((plain / "run.json").read_text())["forward_backward_per_step"] == 1
    losses = lambda r: [(m["step"], m["train/loss"]) for m in read_metrics(r) if "train/loss" in m]  # noqa: E731
    assert losses(part) == losses(full)
    a, b, c = (load_file(r / "checkpoints/step-0000008/model.safetensors") for r in (full, part, plain))
    assert all(torch.equal(a[k], b[k]) for k in a)  # SAM holds no state of its own: the resume is exact
    assert any(not torch.equal(a[k], c[k]) for k in a)


@pytest.mark.parametrize("optim,needle", [
    ({"sam_rho": -0.1}, "sam_rho"),
    ({"sam_rho": float("nan")}, "sam_rho"),
    ({"sam_adaptive": True}, "sam_rho > 0"),
])
def test_bad_sam_settings_are_one_line(tmp_path, kjv_small, optim, needle):
    data_cfg, _ = kjv_small
    with pytest.raises(QuantdynError, match=needle):
        _run_cfg(tmp_path, data_cfg, "bad", **optim)
