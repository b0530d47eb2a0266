"""GPTQ's column loop as a CUDA graph (quantize/gptq.py, ``_GraphedBlock``) gives the same bits as the eager loop
on the same GPU: the graph replays the same kernels in the same order, so codes, scales, zeros, dequantized weights
and the layer loss must be identical, not close; and it must actually have been used (more than one replay)."""
from __future__ import annotations

import pytest
import torch

import quantdyn.quantize.gptq as gptq_mod
from quantdyn.quantize.catalogue import QuantConfig
from quantdyn.quantize.gptq import gptq


def _layer(R: int, C: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(R, C, generator=g) * 0.05
    X = torch.randn(4096, C, generator=g) * torch.linspace(0.2, 3.0, C)  # uneven column scales
    X[:, 7] = 0  # one dead column
    H = 2 * X.t() @ X / X.shape[0]
    return W.cuda(), H.cuda()


@pytest.mark.parametrize("spec", [
    dict(bits=4, group_size=128), dict(bits=3, group_size=64), dict(bits=2, group_size=128, sym=True),
    dict(bits=4, group_size=0), dict(bits=4, group_size=128, mse=True), dict(bits=4, group_size=128, act_order=True),
    dict(bits=3, group_size=128, act_group_aware=True),
])
@pytest.mark.parametrize("shape", [(256, 768), (96, 1000)])  # 1000: a last, partial block runs eagerly
def test_graphed_column_loop_gives_the_eager_bits(spec, shape, monkeypatch, no_tf32):
    if spec.get("act_group_aware") and shape[1] % spec["group_size"]:
        shape = (shape[0], 1024)  # group-aware reordering needs whole groups
    W, H = _layer(*shape)
    cfg = QuantConfig(method="gptq", **spec)
    eager = gptq(W, H, cfg, cuda_graph=False)
    replays = []
    real_run = gptq_mod._GraphedBlock.run
    monkeypatch.setattr(gptq_mod._GraphedBlock, "run", lambda self, *a: replays.append(1) or real_run(self, *a))
    graphed = gptq(W, H, cfg, cuda_graph=True)
    assert len(replays) == shape[1] // cfg.block_size - 1  # every full block after the first
    assert torch.equal(graphed.codes, eager.codes)
    assert torch.equal(graphed.weight, eager.weight)
    assert torch.equal(graphed.scales, eager.scales) and torch.equal(graphed.zeros, eager.zeros)
    assert torch.equal(graphed.g_idx, eager.g_idx)
    assert graphed.loss == eager.loss


@pytest.mark.parametrize("spec", [dict(group_size=128), dict(group_size=0), dict(group_size=128, act_order=True),
                                  dict(group_size=128, mse=True)])
def test_batched_column_loop_gives_each_weight_its_own_bits(spec, monkeypatch, no_tf32):
    """gptq_batch on the GPU: q/k/v-like weights sharing a Hessian, gptq4 and gptq3 stacked, and a second
    Hessian's stack side by side — each weight's bits equal gptq() of it alone (the same element-wise kernels and
    one GEMM per weight), eager and as CUDA graphs, and the graphs were replayed."""
    from quantdyn.quantize.gptq import gptq_batch

    W, H = _layer(256, 1024)
    _, H2 = _layer(256, 1024, seed=1)
    parts = [W[:128], W[128:192], W[192:]]
    problems = [(w, h, QuantConfig(method="gptq", bits=b, **spec)) for h in (H, H2) for b in (4, 3) for w in parts]
    alone = [gptq(*p, cuda_graph=False) for p in problems]
    replays = []
    real_run = gptq_mod._GraphedBlock.run
    monkeypatch.setattr(gptq_mod._GraphedBlock, "run", lambda self, *a: replays.append(1) or real_run(self, *a))
    for graph in (False, True):
        got = gptq_batch(problems, cuda_graph=graph)
        for a, b in zip(got, alone):
            assert torch.equal(a.codes, b.codes) and torch.equal(a.weight, b.weight)
            assert torch.equal(a.scales, b.scales) and torch.equal(a.zeros, b.zeros) and a.loss == b.loss
    assert len(replays) == 1024 // 128 - 1  # one loop for all twelve weights
