"""Issue 48.5: the cheap early warning, the curvature along the optimizer's update from three losses
(analysis/hessian.curvature_along), and the monitor that logs it every N steps."""
from __future__ import annotations

import math

import pytest
import torch

from plan_models import tiny_gpt, windows
from quantdyn.analysis.hessian import curvature_along, hvp_from_loss, next_token_loss


def test_on_a_quadratic_the_curvature_along_d_is_u_A_u():
    g = torch.Generator().manual_seed(0)
    m = torch.randn(12, 12, generator=g, dtype=torch.float64)
    A = m @ m.T + torch.eye(12, dtype=torch.float64)
    w = torch.randn(12, generator=g, dtype=torch.float64)
    d = torch.randn(12, generator=g, dtype=torch.float64)
    before = w.clone()
    got = curvature_along(lambda: 0.5 * w @ A @ w, [w], [d])
    u = d / d.norm()
    exact = float(u @ A @ u)
    # a quadratic has no truncation error: only rounding, ~4 eps |L| / h^2 with eps 2.2e-16
    tol = 8 * 2.2e-16 * abs(got["loss"]) / got["h"] ** 2 + 1e-12 * exact
    assert abs(got["curvature"] - exact) <= tol, (got, exact)
    assert got["slope"] == pytest.approx(float(A @ w @ u), rel=1e-8)
    assert torch.equal(w, before)


def test_on_a_tiny_gpt_it_agrees_with_the_hessian_vector_product():
    """In float64 it agrees with uᵀ(H u) from the double-backward path: at rel_step 1e-3 the error was 5.7e-5
    relative (truncation, O(h²)); at 1e-4 it is 100x smaller and rounding (4 ε |L| / h² ≈ 2.5e-9 against a
    curvature of 6.6e-4: 4e-6 relative) dominates, so 1e-5 relative bounds both. The weights are left as they were."""
    model = tiny_gpt(n_layer=1, d=32).double()
    ids = windows(2, 33, 3)
    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    g = torch.Generator().manual_seed(1)
    d = [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in params]
    got = curvature_along(lambda: next_token_loss(model, ids), params, d, rel_step=1e-4)
    norm = math.sqrt(sum(float(x.pow(2).sum()) for x in d))
    u = [x / norm for x in d]
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):  # the fused kernels have no double backward
        hvp, _ = hvp_from_loss(lambda: next_token_loss(model, ids), params)
        exact = sum(float((a * b).sum()) for a, b in zip(u, hvp(u)))
    assert got["curvature"] == pytest.approx(exact, rel=1e-5)
    assert all(torch.equal(p, b) for p, b in zip(params, before))


def test_a_zero_direction_is_one_line():
    from quantdyn.errors import QuantdynError

    w = torch.ones(3)
    with pytest.raises(QuantdynError, match="direction is zero"):
        curvature_along(lambda: w.sum(), [w], [torch.zeros(3)])


def test_the_monitor_logs_the_curvature_along_the_update_since_the_previous_warning():
    """warning_every=2 over 6 steps: step 2 keeps the weights, steps 4 and 6 log the curvature along w_4 - w_2 and
    w_6 - w_4 (equal to curvature_along on those differences); the model is left as it was, in its mode."""
    from quantdyn.monitor.ptq import PTQMonitor
    from quantdyn.train.loggers import WARN_CURVATURE

    torch.manual_seed(0)
    model = tiny_gpt(n_layer=1, d=32)
    ev = windows(6, 33, 4)
    mon = PTQMonitor(["rtn4"], eval_ids=ev, every=0, warning_every=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    kept, logged = {}, {}
    for step in range(1, 7):
        loss = next_token_loss(model, windows(4, 33, 10 + step))
        opt.zero_grad()
        loss.backward()
        opt.step()
        kept[step] = [p.detach().clone() for p in model.parameters()]
        model.train()
        out = mon.step(model, step)
        assert model.training and all(torch.equal(p, k) for p, k in zip(model.parameters(), kept[step]))
        if out:
            logged[step] = out[WARN_CURVATURE]
            assert "ptq/rtn4/delta_ce" not in out  # every=0: the warning alone
    assert sorted(logged) == [4, 6]
    model.eval()
    for s in (4, 6):
        d = [a - b for a, b in zip(kept[s], kept[s - 2])]
        with torch.no_grad():
            for p, k in zip(model.parameters(), kept[s]):
                p.copy_(k)
        ref = curvature_along(lambda: next_token_loss(model, ev[:4]), list(model.parameters()), d)
        assert logged[s] == ref["curvature"] and math.isfinite(logged[s])


def test_off_by_default_and_bad_settings_are_one_line():
    from quantdyn.errors import QuantdynError
    from quantdyn.monitor.ptq import PTQMonitor

    mon = PTQMonitor(["rtn4"], eval_ids=windows(2, 33, 4), every=3)
    assert [s for s in range(1, 10) if mon.due(s)] == [3, 6, 9]
    with pytest.raises(QuantdynError, match="measure nothing"):
        PTQMonitor(["rtn4"], eval_ids=windows(2, 33, 4), every=0)
    with pytest.raises(QuantdynError, match="warning_every=-1"):
        PTQMonitor(["rtn4"], eval_ids=windows(2, 33, 4), every=1, warning_every=-1)


def test_a_run_config_turns_it_on(tmp_path, kjv_small):
    """monitor.warning_every in a run's config: the trainer logs warn/curvature_along_update from the second
    warning step on, and nothing of the PTQ monitor when monitor.every is 0."""
    from conftest import tiny_run_dict
    from quantdyn.config import from_dict
    from quantdyn.train.config import RunConfig
    from quantdyn.train.checkpoint import read_metrics
    from quantdyn.train.trainer import train
    from quantdyn.monitor import hooks_for

    d = tiny_run_dict(tmp_path, kjv_small[0], steps=6, checkpoint_every=6)
    d["monitor"] = {"warning_every": 2}
    cfg = from_dict(RunConfig, d)
    run = train(cfg, progress=False, hooks=hooks_for(cfg))
    rows = [r for r in read_metrics(run) if "warn/curvature_along_update" in r]
    assert [r["step"] for r in rows] == [4, 6]
    assert all(math.isfinite(r["warn/curvature_along_update"]) for r in rows)
    assert not any(k.startswith("ptq/") for r in read_metrics(run) for k in r)


def test_a_warning_alone_reads_no_calibration_data():
    """The early warning evaluates on held-out windows only: a warning-only monitor never asks for calibration."""
    from quantdyn.monitor.ptq import PTQMonitor

    asked = []
    model = tiny_gpt(n_layer=1, d=32)
    mon = PTQMonitor(["rtn4"], eval_ids=windows(4, 33, 4), calib_ids=lambda: asked.append(1) or windows(4, 33, 5),
                     every=0, warning_every=1)
    for step in (1, 2):
        with torch.no_grad():
            next(model.parameters()).add_(0.01)
        mon.step(model, step)
    assert mon.history and not asked


def test_one_monitor_over_two_branches_never_spans_them():
    """The commands that branch (quantdyn cooldown, study) give every branch the same monitor: branch B's first
    warning after branch A ended (a step that does not follow A's last warning) only keeps B's weights; its
    next warning is the curvature along B's own update."""
    from quantdyn.monitor.ptq import PTQMonitor
    from quantdyn.train.loggers import WARN_CURVATURE

    torch.manual_seed(0)
    ev = windows(6, 33, 4)
    mon = PTQMonitor(["rtn4"], eval_ids=ev, every=0, warning_every=2)
    start = tiny_gpt(n_layer=1, d=32)
    logged = {}
    for branch, lr in (("a", 0.5), ("b", 0.05)):
        model = tiny_gpt(n_layer=1, d=32)
        model.load_state_dict(start.state_dict())
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        for step in range(11, 17):  # both branches over steps 11..16, from the same point
            loss = next_token_loss(model, windows(4, 33, 10 + step))
            opt.zero_grad()
            loss.backward()
            opt.step()
            out = mon.step(model, step)
            if out:
                logged[(branch, step)] = out[WARN_CURVATURE]
    assert sorted(logged) == [("a", 14), ("a", 16), ("b", 14), ("b", 16)]


def test_the_curvature_analysis_measures_the_update_from_each_checkpoints_predecessor(tmp_path, kjv_small):
    """analysis `curvature` (quantdyn analyze --metrics curvature, sweep.analysis): a main checkpoint's update is
    from the run's previous checkpoint, a branch's first checkpoint's from its branch point, an average's from
    the run's checkpoint before its step; the value is curvature_along on that difference; a run's first
    checkpoint has none and says so."""
    from conftest import tiny_run_dict
    from quantdyn.config import from_dict
    from quantdyn.models.hf_io import load_causal_lm
    from quantdyn.runs import RunDir, predecessor
    from quantdyn.sweep.analysis_rows import AnalysisConfig, analysis_rows
    from quantdyn.train.branches import cooldown
    from quantdyn.train.config import RunConfig
    from quantdyn.train.trainer import train

    d = tiny_run_dict(tmp_path, kjv_small[0], steps=8, checkpoint_every=4)
    d["schedule"] = {"name": "constant", "warmup": 1}
    run = train(from_dict(RunConfig, d), progress=False)
    cooldown(run, 4, [4], "linear", progress=False)
    rd = RunDir(run)
    branch = rd.branch("cooldown-s4-d4-linear")
    main4, main8, end = rd.checkpoint(4), rd.checkpoint(8), branch.checkpoint(8)
    assert predecessor(main4)[0] is None and predecessor(main8)[0] == main4
    assert predecessor(end)[0] == main4  # the branch point
    avg = rd.average("lawa-k2-p4", 8)
    avg.mkdir(parents=True)
    assert predecessor(avg)[0] == main4 and predecessor(tmp_path)[0] is None

    ev = torch.as_tensor(windows(8, 33, 7)).long()
    cfg = AnalysisConfig(windows=6)
    for ckpt, prev in ((main8, main4), (end, main4)):
        row = analysis_rows("curvature", ckpt, None, None, ev, {}, cfg)
        model, before = load_causal_lm(ckpt).eval(), load_causal_lm(prev)
        params = list(model.parameters())
        diff = [p.detach() - q.detach() for p, q in zip(params, before.parameters())]
        with torch.no_grad():
            ref = curvature_along(lambda: next_token_loss(model, ev[:6]), params, diff)["curvature"]
        assert row["curvature_along_update"] == pytest.approx(ref, rel=1e-6), ckpt
        assert row["curvature_from"] == str(prev) and row["update_norm"] > 0
    first = analysis_rows("curvature", main4, None, None, ev, {}, cfg)
    assert first["curvature_along_update"] is None and "no predecessor" in first["curvature_from"]


def test_the_early_warning_family_ranks_checkpoints_beside_trace_and_rl():
    """findings.early_warning_findings on hand-made rows: the curvature rises with Δ CE (ρ = +1, resolved), the
    Hessian trace runs against it (ρ = −1) and R_L is beside it for this quantizer only; identical weights (one
    checkpoint hash under two names) count once; checkpoints without the warning are left out."""
    from quantdyn.studies.families import FINDING_FAMILIES, families_in
    from quantdyn.studies.findings import early_warning_findings

    rows = []
    for i, (branch, step) in enumerate([("main", 2), ("main", 4), ("main", 6), ("cooldown-s4-d2-linear", 6),
                                        ("control-s4-d2", 6)]):
        h = "same" if branch == "control-s4-d2" else f"h{i}"  # the control equals main@6 here
        dce = 0.01 * (i + 1)
        rows.append({"kind": "ptq", "run": "r", "branch": branch, "step": step, "quantizer": "rtn4",
                     "checkpoint_hash": h if branch != "main" or step != 6 else "same", "delta_ce": dce,
                     "delta_ce_se": 0.001, "ce_fp": 3.0})
        rows.append({"kind": "analysis", "analysis": "curvature", "run": "r", "branch": branch, "step": step,
                     "curvature_along_update": None if step == 2 else 0.1 * (i + 1)})
        rows.append({"kind": "analysis", "analysis": "hessian", "run": "r", "branch": branch, "step": step,
                     "hessian_trace": 10.0 - i})
        rows.append({"kind": "analysis", "analysis": "propagation", "run": "r", "branch": branch, "step": step,
                     "prop_R_final__rtn4": 0.5 + 0.1 * i, "prop_R_final__gptq3": 0.0})
    assert "early_warning" in families_in(rows)
    found, detail = early_warning_findings(rows, ["r"])
    assert [p["step"] for p in detail["early_warning"]] == [4, 6, 6]  # step 2 has no warning, the control is main@6
    by = {f["predictor"]: f for f in found}
    assert by["curvature_along_update"]["effect"] == pytest.approx(1.0)
    assert by["curvature_along_update"]["verdict"] == "reproduced" and by["curvature_along_update"]["n"] == 3
    assert by["hessian_trace"]["effect"] == pytest.approx(-1.0)
    assert by["prop_R_final"]["effect"] == pytest.approx(1.0)
    assert FINDING_FAMILIES.get("early_warning").compute is not None
