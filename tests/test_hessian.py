"""Hessian trace / eigenvalues: known quadratics, and HVPs of a tiny GPT."""
from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from quantdyn.analysis.hessian import (
    HessianConfig,
    block_group,
    hessian_metrics,
    hutchinson_trace,
    hvp_from_loss,
    lanczos_top_eigenvalues,
    layer_type_group,
    next_token_loss,
    top_eigenvalues,
)
from quantdyn.errors import QuantdynError
from quantdyn.models.gpt import GPT, ModelConfig, resolve_model_config

pytestmark = pytest.mark.numerics  # rerun under other MKL code paths by `make test-isa`


def _spd(eigs: list[float], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(len(eigs), len(eigs), generator=g, dtype=torch.float64))
    return q @ torch.diag(torch.tensor(eigs, dtype=torch.float64)) @ q.T


def _matrix_hvp(A: torch.Tensor):
    return lambda vs: [A @ vs[0]]


def test_hutchinson_trace_of_quadratic_loss_matches_analytic():
    # loss = ½ θᵀAθ through autograd double backward; H = A
    n = 40
    g = torch.Generator().manual_seed(1)
    A = _spd((torch.rand(n, generator=g, dtype=torch.float64) * 5 + 0.5).tolist(), seed=2)
    theta = torch.randn(n, dtype=torch.float64, generator=g, requires_grad=True)
    hvp, stats = hvp_from_loss(lambda: 0.5 * theta @ A @ theta, [theta])
    out = hutchinson_trace(hvp, [theta], max_probes=200, tol=0.0, seed=0)
    exact = float(torch.trace(A))
    assert out["probes"] == 200 and stats["hvp_calls"] == 200
    assert abs(out["trace"] - exact) <= 4 * out["se"]
    assert out["se"] < 0.05 * exact


def test_hutchinson_exact_for_diagonal_and_groups_sum():
    # Rademacher probes are exact on a diagonal Hessian: vᵀDv = tr(D) for every v
    d1, d2 = torch.arange(1.0, 6.0, dtype=torch.float64), torch.tensor([10.0, 20.0], dtype=torch.float64)
    params = [torch.zeros(5, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)]
    hvp = lambda vs: [d1 * vs[0], d2 * vs[1]]
    out = hutchinson_trace(hvp, params, max_probes=50, tol=1e-5, min_probes=3, groups=[[0], [1]])
    assert out["trace"] == pytest.approx(45.0) and out["se"] == pytest.approx(0.0, abs=1e-12)
    assert out["converged"] and out["probes"] == 3
    assert [g["trace"] for g in out["groups"]] == pytest.approx([15.0, 30.0])


def test_power_iteration_top3_with_deflation():
    A = _spd([10.0, 7.0, 5.0, 3.0, 2.0, 1.0, 0.5, 0.2] + [0.1] * 12, seed=3)
    out = top_eigenvalues(_matrix_hvp(A), [torch.zeros(20, dtype=torch.float64)], k=3, max_iter=1000, tol=1e-7)
    assert all(out["converged"])
    assert out["eigenvalues"] == pytest.approx([10.0, 7.0, 5.0], rel=1e-4)
    # eigenvectors are unit and satisfy Av ≈ λv
    for lam, v in zip(out["eigenvalues"], out["eigenvectors"]):
        assert torch.linalg.vector_norm(A @ v[0] - lam * v[0]) < 1e-2


def test_power_iteration_default_tol_top1():
    A = _spd([4.0, 1.0, 0.5, 0.25], seed=4)
    out = top_eigenvalues(_matrix_hvp(A), [torch.zeros(4, dtype=torch.float64)], k=1)
    assert out["eigenvalues"][0] == pytest.approx(4.0, rel=1e-4)


def test_lanczos_top3_including_negative_spectrum():
    # indefinite: power iteration would pick -12 first; Lanczos gives the algebraic top
    A = _spd([9.0, 6.0, 4.0, 1.0, 0.0, -2.0, -12.0] + [0.3] * 13, seed=5)
    out = lanczos_top_eigenvalues(_matrix_hvp(A), [torch.zeros(20, dtype=torch.float64)], k=3, tol=1e-8)
    assert out["eigenvalues"] == pytest.approx([9.0, 6.0, 4.0], rel=1e-6)
    power = top_eigenvalues(_matrix_hvp(A), [torch.zeros(20, dtype=torch.float64)], k=1, tol=1e-9)
    assert power["eigenvalues"][0] == pytest.approx(-12.0, rel=1e-4)


def _tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(resolve_model_config(ModelConfig(vocab_size=64, n_layer=2, d_model=32, n_head=2, max_seq_len=32))).double()


def test_gpt_hvp_symmetric_and_matches_finite_differences():
    model = _tiny_gpt().eval()
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    params = [p for p in model.parameters()]

    def loss():
        with sdpa_kernel(SDPBackend.MATH):
            return next_token_loss(model, ids)

    hvp, _ = hvp_from_loss(loss, params)
    g = torch.Generator().manual_seed(1)
    v = [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in params]
    w = [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in params]
    hv, hw = hvp(v), hvp(w)
    vHw = sum((a * b).sum() for a, b in zip(v, hw)).item()
    wHv = sum((a * b).sum() for a, b in zip(w, hv)).item()
    assert vHw == pytest.approx(wHv, rel=1e-9, abs=1e-12)

    # central difference of the gradient along v: (g(θ+εv) − g(θ−εv)) / 2ε ≈ Hv
    def grad_at(shift: float):
        with torch.no_grad():
            for p, d in zip(params, v):
                p.add_(shift * d)
        try:
            return torch.autograd.grad(loss(), params)
        finally:
            with torch.no_grad():
                for p, d in zip(params, v):
                    p.sub_(shift * d)

    eps = 1e-6  # ‖v‖ ≈ 300, so the step is ≈ 3e-4 in θ
    fd = [(a - b) / (2 * eps) for a, b in zip(grad_at(eps), grad_at(-eps))]
    num = torch.sqrt(sum(((a - b) ** 2).sum() for a, b in zip(fd, hv)))
    den = torch.sqrt(sum((b**2).sum() for b in hv))
    assert float(num / den) < 1e-6


def test_hessian_metrics_on_tiny_gpt_with_groups():
    model = _tiny_gpt().float()
    model.train()
    batches = [torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    cfg = HessianConfig(trace_max_probes=12, trace_min_probes=4, top_k=2, eig_max_iter=30, groups="block", seed=0)
    out = hessian_metrics(model, batches, cfg)
    assert model.training  # restored
    assert out["n_batches"] == 2 and out["n_tokens"] == 2 * 2 * 15
    assert out["trace_probes"] <= 12 and out["trace_se"] > 0
    assert len(out["top_eigenvalues"]) == 2 and out["top_eigenvalues"][0] > 0
    assert set(out["groups"]) == {"embed", "block.0", "block.1", "other", "head"}
    assert sum(g["trace"] for g in out["groups"].values()) == pytest.approx(out["trace"], rel=1e-4)
    assert sum(g["n_params"] for g in out["groups"].values()) == out["n_params"]
    # recompute mode gives the same numbers from the same seed
    out2 = hessian_metrics(model, batches, HessianConfig(trace_max_probes=4, trace_min_probes=4, top_k=0, reuse_graph=False))
    out3 = hessian_metrics(model, batches, HessianConfig(trace_max_probes=4, trace_min_probes=4, top_k=0))
    assert out2["trace"] == pytest.approx(out3["trace"], rel=1e-4)


def test_group_functions_and_config_errors():
    assert block_group("gpt_neox.layers.3.attention.dense.weight") == "block.3"
    assert block_group("gpt_neox.embed_in.weight") == "embed"
    assert block_group("embed_out.weight") == "head"
    assert layer_type_group("gpt_neox.layers.3.attention.dense.weight") == "attention.dense"
    assert layer_type_group("transformer.h.0.mlp.c_fc.bias") == "mlp.c_fc"
    with pytest.raises(QuantdynError, match="did you mean 'block'"):
        HessianConfig(groups="blocks")
    with pytest.raises(QuantdynError):
        HessianConfig(eig_method="arnoldi")


def test_hessian_metrics_on_hf_model_sdpa():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32))
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    out = hessian_metrics(hf, ids, HessianConfig(trace_max_probes=3, trace_min_probes=3, top_k=1, eig_max_iter=5,
                                                 groups="block"))
    assert out["trace_probes"] == 3 and torch.isfinite(torch.tensor(out["trace"]))
    assert {"block.0", "block.1", "embed", "head"} <= set(out["groups"])
