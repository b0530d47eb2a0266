"""The per-tensor sensitivity pass (engine/sensitivity.py) against what it predicts: true single-tensor
measurements (a whole `measure` per tensor with every other tensor in f16), whole-model measurements at one type,
and the rows, proxies and allocation built on it; auto@ inside measure()."""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from plan_models import tiny_gpt, windows

from quantdyn.engine.measure import measure
from quantdyn.engine.sensitivity import SensitivityConfig, measure_sensitivity, spearman
from quantdyn.errors import QuantdynError
from quantdyn.quantize.plan import Plan, PlanTensor, write_plan

TYPES = ["q4_0", "rtn3g32", "q5_1"]


@pytest.fixture(scope="module")
def case():
    model = tiny_gpt()
    ids = windows(12, 33, 3)
    sens = measure_sensitivity(model, TYPES, ids[:, :-1], cfg=SensitivityConfig(draws=4))
    return model, ids, sens


def _alone(model, sens, j: int, k: str, ids) -> float:
    """The true KL of quantizing tensor j alone at type k (every other tensor f16), on the sensitivity windows."""
    plan = Plan(sens.model_type, sens.n_blocks, tuple(
        PlanTensor(t.name, t.block, t.path, t.shape, k if i == j else "f16") for i, t in enumerate(sens.tensors)))
    with tempfile.TemporaryDirectory() as tmp:
        label = f"plan:{write_plan(plan, Path(tmp) / 'one.json')}"
        return measure(model, {"x": label}, ids, None).metrics["x"]["kl"]


def test_the_additive_prediction_ranks_true_single_tensor_measurements(case):
    """8 tensors x 3 types, each measured by a whole model pass: the pass's single-tensor estimates (from one
    forward and one backward pass) rank them as the measurements do, and sit near them in value (a second-order
    estimate: a few tens of percent at these 3-5 bit errors)."""
    model, ids, sens = case
    mean, se = sens.single()
    pred, true = [], []
    for j in range(len(sens.tensors)):
        for i, k in enumerate(TYPES):
            pred.append(float(mean[j, i]))
            true.append(_alone(model, sens, j, k, ids))
    pred, true = torch.tensor(pred), torch.tensor(true)
    assert spearman(pred, true) >= 0.9, (pred, true)
    ratio = pred / true
    assert float(ratio.median()) == pytest.approx(1.0, abs=0.3) and float(ratio.min()) > 0.3 and float(ratio.max()) < 3


def test_group_and_whole_model_estimates_match_measurements(case):
    """The interaction-aware estimate of all tensors at one type against the measured uniform quantizer."""
    model, ids, sens = case
    for i, k in enumerate(TYPES):
        est, est_se = sens.estimate([(j, i) for j in range(len(sens.tensors))])
        kl = measure(model, [k], ids, None).metrics[k]["kl"]
        assert abs(est - kl) <= 3 * est_se + 0.3 * kl, (k, est, est_se, kl)


def test_rows_proxies_and_determinism(case):
    model, ids, sens = case
    rows = sens.rows({"checkpoint": "x"})
    by = {}
    for r in rows:
        by.setdefault(r["scope"], []).append(r)
    n_t, n_k = len(sens.tensors), len(TYPES)
    assert len(by["tensor"]) == n_t * n_k and len(by["group"]) == 2 * 2 * n_k and len(by["model"]) == n_k
    assert {r["tensor_group"] for r in by["group"]} == {"attn", "mlp"}
    for g in by["group"]:  # a group's additive sum is its members' own predictions
        members = [r["kl_pred"] for r in by["tensor"] if r["block"] == g["block"] and r["tensor_group"] ==
                   g["tensor_group"] and r["type"] == g["type"]]
        assert g["kl_pred_additive"] == pytest.approx(sum(members), rel=1e-9)
    assert all(r["layer_loss"] > 0 and r["fisher_diag"] > 0 and r["bits_per_weight"] > 0 for r in by["tensor"])
    rc = sens.rank_correlations()
    assert set(rc) == {f"{p}{s}" for p in ("layer_loss", "fisher_diag") for s in ["", *(f"@{k}" for k in TYPES)]}
    assert rc["fisher_diag"] > 0.8  # the diagonal of the same Fisher: close to the full quadratic form
    again = measure_sensitivity(model, TYPES, ids[:, :-1], cfg=SensitivityConfig(draws=4))
    assert torch.equal(again.s, sens.s)  # the label draws are seeded
    other = measure_sensitivity(model, TYPES[:1], ids[:, :-1], cfg=SensitivityConfig(draws=4, seed=1))
    assert not torch.equal(other.s[..., 0], sens.s[..., 0])


def test_allocation_spends_the_budget_on_the_sensitive_tensors(case):
    model, ids, sens = case
    plan, alloc = sens.plan(4.6, ("rtn3g32", "q5_1"))
    assert plan.bits_per_weight() <= 4.6 and alloc.method == "knapsack-dp"
    mean, _ = sens.single()
    k3, k5 = TYPES.index("rtn3g32"), TYPES.index("q5_1")
    gain = {t.name: float(mean[j, k3] - mean[j, k5]) / (t.shape[0] * t.shape[1]) for j, t in enumerate(sens.tensors)}
    up = [t.name for t in plan.tensors if t.type == "q5_1"]
    down = [t.name for t in plan.tensors if t.type == "rtn3g32"]
    assert up and down and min(gain[n] for n in up) >= 0.5 * max(gain[n] for n in down)
    with pytest.raises(QuantdynError, match="budget 9 bits per weight is outside what"):
        sens.plan(9.0, ("rtn3g32", "q5_1"))


def test_auto_allocates_inside_measure_and_the_rows_say_what(case):
    model, ids, _ = case
    calib = windows(8, 32, 9)
    m = measure(model, ["auto@5:q4_0,q5_1,rtn3g32", "q4_0"], ids, calib)
    label = "auto@5:q4_0,q5_1,rtn3g32"
    summary = m.plans[label]
    assert summary["plan_label"].startswith("plan:auto#") and summary["plan_bits_per_weight"] <= 5
    rows = m.quantizations[label].rows
    assert {r["plan_type"] for r in rows} <= {"q4_0", "q5_1", "rtn3g32"}
    assert m.metrics[label]["kl"] < m.metrics["q4_0"]["kl"]  # 0.5 more bits per weight, spent where it matters
    with pytest.raises(QuantdynError, match="budget 2 bits per weight is outside"):
        measure(model, ["auto@2:q4_0,q5_1"], ids, calib)
    with pytest.raises(QuantdynError, match="needs calibration windows"):
        measure(model, ["auto@5:q4_0,q5_1"], ids, None)
