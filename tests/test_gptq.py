"""GPTQ: golden fixtures from the reference, a slow textbook version, invariants."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from quantdyn.errors import QuantdynError
from quantdyn.quantize import QuantConfig, num_threads
from quantdyn.quantize.gptq import gptq, gptq_batch, group_aware_perm, hessian_update, stats_from
from quantdyn.quantize.primitives import dequantize_weight, fake_quantize, find_params, layer_loss
from quantdyn.quantize.rtn import rtn

pytestmark = pytest.mark.numerics  # rerun under other MKL code paths by `make test-isa`

GOLDEN = Path(__file__).parent / "fixtures" / "gptq_golden.safetensors"


def textbook_gptq(W, H, bits, sym, group_size=0, act_order=False, static_groups=False, damp_percent=0.01):
    """Column-by-column GPTQ (Frantar et al. 2022, Alg. 1 without lazy batching):
    every column's error is propagated to all later columns at once."""
    W, H = W.clone(), H.clone()
    C = W.shape[1]
    if not group_size:
        s, z = find_params(W, bits, sym)  # per-row grid from W before dead columns, as the reference
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    if static_groups:
        static = [find_params(W[:, a:a + group_size], bits, sym) for a in range(0, C, group_size)]
    perm = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(C)
    W, H = W[:, perm], H[perm][:, perm]
    H = H + damp_percent * torch.diag(H).mean() * torch.eye(C, dtype=H.dtype)
    U = torch.linalg.cholesky(torch.linalg.inv(H), upper=True)
    Q = torch.zeros_like(W)
    for i in range(C):
        if group_size and static_groups:
            s, z = static[int(perm[i]) // group_size]
        elif group_size and i % group_size == 0:
            s, z = find_params(W[:, i:i + group_size], bits, sym)
        Q[:, i] = fake_quantize(W[:, i:i + 1], s[:, None], z[:, None], 2**bits - 1)[:, 0]
        err = (W[:, i] - Q[:, i]) / U[i, i]
        W[:, i + 1:] -= err[:, None] * U[i, i + 1:][None, :]
    return Q[:, torch.argsort(perm)]


def correlated(R, C, seed=0, dtype=torch.float32, tokens=512):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(R, C, generator=g, dtype=torch.float64)
    mix = torch.eye(C, dtype=torch.float64) + 0.5 * torch.randn(C, C, generator=g, dtype=torch.float64) / C**0.5
    X = torch.randn(tokens, C, generator=g, dtype=torch.float64) * (0.3 + 2 * torch.rand(C, generator=g, dtype=torch.float64))
    X = X @ mix
    return W.to(dtype), (2 / tokens * X.T @ X).to(dtype)


def _golden_cases():
    from safetensors import safe_open

    with safe_open(str(GOLDEN), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return [(json.loads(meta[f"case{k}"]), {n: tensors[f"case{k}.{n}"] for n in ("W", "H", "Q", "codes")})
            for k in range(int(meta["cases"]))], tensors


def golden_weight_tolerance(r, n_columns: int) -> torch.Tensor:
    """Per-weight bound on |W_deq - W_ref| once the codes are known to be equal.

    With equal codes and integer zero-points, W_deq = scale * (code - zero) can only differ through the
    group's scale. Dynamic-group scales come from the range of weights already updated by GPTQ's error
    feedback, i.e. by GEMMs accumulating up to C = ``n_columns`` products, whose rounding error grows like
    sqrt(C) * eps relative to the scale (probabilistic bound, Higham, Accuracy and Stability, ch. 3) and
    differs in the last bits between BLAS code paths (AVX-512 / AVX2 / SSE4.2). The product with
    |code - zero| scales it, plus one rounding of the product: tol = 4 sqrt(C) eps scale (|code - zero| + 1).
    Measured under four MKL code paths: at most 1.4 sqrt(C) eps scale (|code - zero| + 1). A wrong decision
    moves a weight by a whole step (one scale, ~2^23 eps scale), far outside it."""
    g = r.g_idx.long()
    scale = r.scales[:, g].double()
    steps = (r.codes.double() - r.zeros[:, g].double()).abs()
    return 4 * n_columns**0.5 * torch.finfo(torch.float32).eps * scale * (steps + 1)


def test_golden_fixtures_bit_exact():
    """quantdyn's GPTQ makes exactly the reference's decisions (IST-DASLab/gptq; see tests/README.md):
    every integer code equal, dequantized weights equal within the scale-derived bound above (BLAS rounds
    the error-feedback GEMMs differently per CPU instruction set; the codes do not move)."""
    cases, tensors = _golden_cases()
    assert len(cases) >= 10
    for c, t in cases:  # made single-threaded: MKL's GEMM rounds differently per thread count
        cfg = QuantConfig(bits=c["bits"], sym=c["sym"], group_size=c["group_size"], act_order=c["act_order"],
                          static_groups=c["static_groups"], mse=c["mse"], damp_percent=c["damp_percent"],
                          block_size=c["block_size"])
        with num_threads(1):
            r = gptq(t["W"], t["H"], cfg)
        assert int((r.codes != t["codes"]).sum()) == 0, c
        assert torch.equal(r.zeros, r.zeros.round()), c  # integer zero-points: the bound's premise
        diff = (r.weight.double() - t["Q"].double()).abs()
        tol = golden_weight_tolerance(r, t["W"].shape[1])
        assert bool((diff <= tol).all()), (c, float((diff / tol).max()))
        # the stored layout reproduces the dequantized weight exactly on any machine (same elementwise ops)
        assert torch.equal(dequantize_weight(r.codes, r.scales, r.zeros, r.g_idx), r.weight), c
    # the reference's add_batch Hessian, streamed one sample at a time
    X, H_ref = tensors["case0.X"], tensors["case0.H"]
    H, n = None, 0
    for b in range(X.shape[0]):
        H, n = hessian_update(H, n, X[b:b + 1])
    # float sums of K = samples x tokens products: rounding bound 4 sqrt(K) eps (2/N) |X|^T |X| per entry
    # (entries with cancellation are small against their terms; measured max 0.16 of the sqrt(K) eps scale)
    flat = X.reshape(-1, X.shape[-1]).double()
    scale = 2 / X.shape[0] * flat.abs().T @ flat.abs()
    tol = 4 * flat.shape[0] ** 0.5 * torch.finfo(torch.float32).eps * scale
    assert bool(((H.double() - H_ref.double()).abs() <= tol).all())


def test_golden_tolerance_rejects_a_wrong_scale():
    """The bound is tight enough to catch a scale that is off by one part in 10^4 (a real bug)."""
    cases, _ = _golden_cases()
    c, t = next((c, t) for c, t in cases if c["group_size"] and not c["act_order"])
    cfg = QuantConfig(bits=c["bits"], sym=c["sym"], group_size=c["group_size"], damp_percent=c["damp_percent"],
                      block_size=c["block_size"], mse=c["mse"])
    with num_threads(1):
        r = gptq(t["W"], t["H"], cfg)
    wrong = dequantize_weight(r.codes, r.scales * (1 + 1e-4), r.zeros, r.g_idx)
    tol = golden_weight_tolerance(r, t["W"].shape[1])
    assert not bool(((wrong.double() - t["Q"].double()).abs() <= tol).all())


CASES = [
    dict(group_size=0),
    dict(group_size=0, act_order=True, sym=True),
    dict(group_size=64, block_size=64),               # grids start at block boundaries
    dict(group_size=32, block_size=32, act_order=True),
    dict(group_size=64, static_groups=True, act_order=True),  # static grids: any block size
    dict(group_size=128, bits=3),
]


@pytest.mark.parametrize("kw", CASES)
def test_fast_equals_textbook(kw):
    W, H = correlated(48, 256, seed=len(str(kw)), dtype=torch.float64)
    H[7, :] = 0
    H[:, 7] = 0  # a dead column
    cfg = QuantConfig(**{"bits": 4, **kw})
    fast = gptq(W, H, cfg)
    slow = textbook_gptq(W, H, cfg.bits, cfg.sym, cfg.group_size, cfg.act_order, cfg.static_groups, cfg.damp_percent)
    rel = float((fast.weight - slow).norm() / slow.norm())
    assert rel < 1e-5, rel
    assert torch.equal(fast.weight, dequantize_weight(fast.codes, fast.scales, fast.zeros, fast.g_idx))


@pytest.mark.parametrize("kw", [dict(group_size=0), dict(group_size=32), dict(group_size=64, static_groups=True),
                                dict(group_size=0, mse=True, sym=True), dict(group_size=48, bits=2)])
def test_identity_hessian_equals_rtn(kw):
    torch.manual_seed(0)
    W = torch.randn(32, 160)
    cfg = QuantConfig(**kw)
    g, r = gptq(W, torch.eye(160), cfg), rtn(W, cfg)
    assert torch.equal(g.weight, r.weight)
    assert torch.equal(g.codes, r.codes) and torch.equal(g.scales, r.scales) and torch.equal(g.g_idx, r.g_idx)


@pytest.mark.parametrize("kw", [dict(bits=3), dict(bits=4, act_order=True), dict(bits=2, group_size=0),
                                dict(bits=4, act_group_aware=True, sym=True)])
def test_gptq_loss_not_worse_than_rtn(kw):
    W, H = correlated(64, 256, seed=3)
    cfg = QuantConfig(**kw)
    g, r = gptq(W, H, cfg), rtn(W, cfg, H)
    assert layer_loss(W, g.weight, H) < layer_loss(W, r.weight, H)
    assert g.loss > 0 and r.loss == pytest.approx(layer_loss(W, r.weight, H))
    # the reference's accumulated loss is the objective under the damped Hessian
    Hd = H + cfg.damp_percent * torch.diag(H).mean() * torch.eye(256)
    assert g.loss == pytest.approx(layer_loss(W, g.weight, Hd), rel=1e-3)


def test_incremental_hessian_equals_batch():
    torch.manual_seed(0)
    X = torch.randn(12, 10, 24)
    H, n = None, 0
    for chunk in (X[:1], X[1:5], X[5:6], X[6:]):
        H, n = hessian_update(H, n, chunk)
    flat = X.reshape(-1, 24).double()
    assert n == 12
    torch.testing.assert_close(H.double(), 2 / 12 * flat.T @ flat, rtol=1e-5, atol=1e-5)
    s = stats_from(X)
    torch.testing.assert_close(s.H, H, rtol=1e-5, atol=1e-5)
    assert s.tokens == 120 and torch.allclose(s.abs_mean, X.abs().mean((0, 1)))


def test_modes_are_consistent_and_pure():
    W, H = correlated(32, 256, seed=5)
    W0, H0 = W.clone(), H.clone()
    for kw in [dict(act_order=True), dict(act_group_aware=True), dict(static_groups=True),
               dict(act_group_aware=True, static_groups=True), dict(act_order=True, static_groups=True)]:
        r = gptq(W, H, QuantConfig(group_size=64, **kw))
        assert torch.equal(r.weight, dequantize_weight(r.codes, r.scales, r.zeros, r.g_idx)), kw
        assert r.scales.shape == (32, 4)
    assert torch.equal(W, W0) and torch.equal(H, H0)
    perm = group_aware_perm(torch.tensor([1.0, 5.0, 2.0, 9.0, 0.0, 3.0]), 2)
    assert perm.tolist() == [3, 2, 1, 0, 5, 4]
    # act-order with dynamic groups: a column's group follows its quantization order
    r = gptq(W, H, QuantConfig(group_size=64, act_order=True))
    order = torch.argsort(torch.diag(H), descending=True)
    assert torch.equal(r.g_idx[order].long(), torch.arange(256) // 64)


def test_errors_and_damping():
    W, H = correlated(8, 32, seed=1)
    with pytest.raises(QuantdynError, match="does not match"):
        gptq(W, H[:16, :16], QuantConfig())
    Hn = H.clone()
    Hn[0, 1] = float("nan")
    with pytest.raises(QuantdynError, match="NaN"):
        gptq(W, Hn, QuantConfig())
    bad = -torch.eye(32)
    with pytest.raises(QuantdynError, match="damp_percent"):
        gptq(W, bad, QuantConfig(group_size=0))
    indefinite = torch.diag(torch.tensor([1.0] * 31 + [-0.015]))  # mean diag ~0.97: 1% damping is not enough
    r = gptq(W, indefinite, QuantConfig(group_size=0, damp_auto_increment=0.01))
    assert r.diagnostics["damp_percent"] > 0.01
    finite = stats_from(torch.ones(4, 32))  # finite inputs are accepted: 4 tokens of ones
    assert (finite.n, finite.tokens) == (1, 4) and torch.equal(finite.abs_mean, torch.ones(32))
    with pytest.raises(QuantdynError, match="NaN"):
        stats_from(torch.tensor([[float("inf"), 1.0]]))


@pytest.mark.parametrize("kw", [
    dict(bits=4, group_size=128), dict(bits=3, group_size=64), dict(bits=2, group_size=128, sym=True),
    dict(bits=4, group_size=0), dict(bits=4, group_size=128, mse=True), dict(bits=4, group_size=128, act_order=True),
    dict(bits=3, group_size=128, act_group_aware=True),
])
def test_graphed_block_buffers_give_the_eager_bits(kw, monkeypatch):
    """The CUDA-graph column loop (_GraphedBlock) reads each block through fixed buffers (the block's weights, its
    inverse-Hessian block, per-group grids) instead of views of the working matrix. Run without capturing on a CPU,
    it must give the eager loop's codes, grids and loss exactly (tests/gpu checks the captured graph on a GPU);
    the last, partial block (C = 1000) runs eagerly."""
    import quantdyn.quantize.gptq as gptq_mod

    g = torch.Generator().manual_seed(3)
    for R, C in ((64, 768), (48, 1024 if kw.get("act_group_aware") else 1000)):  # GAR: whole groups only
        W = torch.randn(R, C, generator=g) * 0.05
        X = torch.randn(2048, C, generator=g) * torch.linspace(0.2, 3.0, C)
        X[:, 7] = 0  # a dead column
        H = 2 * X.t() @ X / X.shape[0]
        cfg = QuantConfig(**kw)
        eager = gptq(W, H, cfg, cuda_graph=True)  # on a CPU the graph path is never taken by itself
        runs = []
        monkeypatch.setattr(gptq_mod, "_graph_capture_possible", lambda W: True)
        real_run = gptq_mod._GraphedBlock.run
        monkeypatch.setattr(gptq_mod._GraphedBlock, "run", lambda self, *a: runs.append(1) or real_run(self, *a))
        blocks = gptq(W, H, cfg, cuda_graph=True)
        monkeypatch.undo()
        assert len(runs) == C // cfg.block_size - 1  # every full block after the first
        for name in ("codes", "weight", "scales", "zeros", "g_idx"):
            assert torch.equal(getattr(blocks, name), getattr(eager, name)), name
        assert blocks.loss == eager.loss


# ----------------------------------------------------------------------------- several weights in one column loop
def _same_result(a, b) -> bool:
    return (all(torch.equal(getattr(a, n), getattr(b, n)) for n in ("codes", "weight", "scales", "zeros", "g_idx"))
            and a.loss == b.loss and a.diagnostics == b.diagnostics
            and (a.perm is None) == (b.perm is None) and (a.perm is None or torch.equal(a.perm, b.perm)))


def _loops(monkeypatch):
    """Record the stacks of every column loop gptq_batch runs: [[rows of each stack's members], ...]."""
    import quantdyn.quantize.gptq as gptq_mod

    seen = []
    real = gptq_mod._gptq_loop
    monkeypatch.setattr(gptq_mod, "_gptq_loop", lambda stacks, *a: seen.append(
        [[m.R for m in st.members] for st in stacks]) or real(stacks, *a))
    return seen


# one Hessian shared by weights of different heights with different per-row settings (q/k/v of two quantizers)
BATCH_SETTINGS = [
    [dict(bits=4, group_size=128), dict(bits=3, group_size=64), dict(bits=2, group_size=0, sym=False)],
    [dict(bits=4, group_size=128, mse=True), dict(bits=3, group_size=32, static_groups=True), dict(bits=8)],
    [dict(bits=4, group_size=64, act_order=True), dict(bits=3, group_size=128, act_order=True, static_groups=True),
     dict(bits=4, group_size=0, act_order=True)],
    [dict(bits=3, group_size=128, act_group_aware=True), dict(bits=4, group_size=128, act_group_aware=True),
     dict(bits=2, group_size=128, act_group_aware=True, sym=False)],
]


@pytest.mark.parametrize("settings", BATCH_SETTINGS)
@pytest.mark.parametrize("C", [384, 448])  # 448: a last, partial block of 64 columns
def test_batch_gives_every_weight_its_own_bits(settings, C, monkeypatch):
    """gptq_batch stacks the weights that share a Hessian (and its column order and damping) and runs stacks of
    equal height side by side in one column loop; each weight must come out bit for bit as gptq() alone gives it
    (codes, dequantized weight, grids, loss, diagnostics), whatever its neighbours' bits, groups or grids."""
    if any(kw.get("act_group_aware") for kw in settings) and C % 128:
        C = 512
    W1, H1 = correlated(64, C, seed=1)
    H1[9, :] = H1[:, 9] = 0  # a dead column
    W2, H2 = correlated(64, C, seed=2)
    g = torch.Generator().manual_seed(7)
    k1, v1, k2, v2 = (torch.randn(24, C, generator=g) * 0.3 for _ in range(4))
    problems = []
    for H, ws in ((H1, (W1, k1, v1)), (H2, (W2, k2, v2))):  # two Hessians: two stacks of equal height
        for W in ws:
            for kw in settings[:2]:
                problems.append((W, H, QuantConfig(**kw)))
        problems.append((ws[0], H, QuantConfig(**settings[2])))  # a third setting on one weight of each
    seen = _loops(monkeypatch)
    batched = gptq_batch(problems)
    monkeypatch.undo()
    for (W, H, cfg), got in zip(problems, batched):
        assert _same_result(got, gptq(W, H, cfg)), (cfg.name, W.shape)
    # one loop: a stack per Hessian (its weights' rows in the order given), the two side by side
    assert seen == [[[64, 64, 24, 24, 24, 24, 64]] * 2], seen


def test_batch_keeps_the_golden_codes():
    """The reference's codes for every golden case (tests/README.md), with the case's weight stacked beside a
    3-bit copy of itself on the same Hessian and a second stack (a copy of the Hessian) side by side."""
    cases, _ = _golden_cases()
    for c, t in cases:
        cfg = QuantConfig(bits=c["bits"], sym=c["sym"], group_size=c["group_size"], act_order=c["act_order"],
                          static_groups=c["static_groups"], mse=c["mse"], damp_percent=c["damp_percent"],
                          block_size=c["block_size"])
        other = QuantConfig(bits=3 if c["bits"] != 3 else 4, sym=c["sym"], group_size=c["group_size"],
                            act_order=c["act_order"], damp_percent=c["damp_percent"], block_size=c["block_size"])
        H2 = t["H"].clone()
        with num_threads(1):
            out = gptq_batch([(t["W"], t["H"], cfg), (t["W"], t["H"], other), (t["W"].flip(0), H2, cfg),
                              (t["W"], H2, other)])
        assert int((out[0].codes != t["codes"]).sum()) == 0, c
        assert torch.equal(out[0].weight, gptq(t["W"], t["H"], cfg).weight), c


@pytest.mark.parametrize("kw", [dict(bits=4, group_size=128), dict(bits=4, group_size=0),
                                dict(bits=4, group_size=128, mse=True), dict(bits=4, group_size=128, act_order=True)])
def test_graphed_block_buffers_give_the_eager_bits_for_a_batch(kw, monkeypatch):
    """The CUDA-graph column loop over a batch (two stacks of q/k/v-like weights of gptq4 and gptq3 beside them),
    run without capturing on a CPU: the eager batch's bits exactly, the last partial block eager."""
    import quantdyn.quantize.gptq as gptq_mod

    g = torch.Generator().manual_seed(5)
    C = 1000
    X = torch.randn(2048, C, generator=g) * torch.linspace(0.2, 3.0, C)
    H1, H2 = 2 * X.t() @ X / X.shape[0], 2 * X[:1024].t() @ X[:1024] / 1024
    Ws = [torch.randn(r, C, generator=g) * 0.05 for r in (48, 16, 16)]
    problems = [(W, H, QuantConfig(**{**kw, "bits": b})) for H in (H1, H2) for b in (4, 3) for W in Ws]
    eager = gptq_batch(problems, cuda_graph=True)  # on a CPU the graph path is never taken by itself
    runs = []
    monkeypatch.setattr(gptq_mod, "_graph_capture_possible", lambda W: True)
    real_run = gptq_mod._GraphedBlock.run
    monkeypatch.setattr(gptq_mod._GraphedBlock, "run", lambda self, *a: runs.append(1) or real_run(self, *a))
    graphed = gptq_batch(problems, cuda_graph=True)
    monkeypatch.undo()
    assert len(runs) == C // 128 - 1  # one loop: every full block after the first
    for a, b in zip(graphed, eager):
        assert _same_result(a, b)
