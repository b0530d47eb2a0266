"""The per-tensor sensitivity pass (engine/sensitivity.py) against what it predicts: true single-tensor
measurements (a whole `measure` per tensor with every other tensor in f16), whole-model measurements at one type,
and the rows, proxies and allocation built on it; auto@ inside measure().

The tolerances come from the pass's measured spread: the same model, windows and types with the label draws'
seed (SensitivityConfig.seed) 0..19, each against the same true measurements (``python tests/test_sensitivity.py``
prints them; 2026-11-28, a 2-core CPU, torch float32; the test itself runs seed 0):

* within-type Spearman of the single-tensor estimates against the measurements (8 tensors): q4_0 0.833..1.0
  (mean 0.931, sd 0.049), rtn3g32 0.905..1.0 (0.963, 0.026), q5_1 0.762..1.0 (0.923, 0.059), rtn3g32+had
  0.810..1.0 (0.927, 0.047); seed 0: 0.952, 0.952, 0.857, 0.857;
* estimate / measurement per (tensor, type): 0.566..1.784 over all 640; the spread is sampling, not bias: each
  (tensor, type)'s geometric mean over the 20 seeds is 0.92..1.10, and the median over a seed's 32 pairs
  0.926..1.094; seed 0: 0.582..1.496, median 0.978;
* the whole model at one type (interactions included) against its measurement, in the pass's own SEs:
  z = (estimate − measured) / SE in −3.44..2.09 over the 80 (seed, type) values (the SE comes from 12 windows,
  so z has Student's t tails with 11 degrees of freedom: 4 is its 99.8% two-sided point); seed 0: −3.44..1.21.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest
import torch
from plan_models import tiny_gpt, windows

from quantdyn.engine.measure import measure
from quantdyn.engine.sensitivity import SensitivityConfig, measure_sensitivity, spearman
from quantdyn.errors import QuantdynError
from quantdyn.quantize.plan import Plan, PlanTensor, write_plan

TYPES = ["q4_0", "rtn3g32", "q5_1", "rtn3g32+had"]
RANK_BOUND = {"q4_0": 0.80, "rtn3g32": 0.90, "q5_1": 0.75, "rtn3g32+had": 0.80}
"""Per type: the lowest within-type Spearman over seeds 0..19 (module docstring), rounded down to 0.05. A ranking
unrelated to the measurements reaches 0.75 over 8 tensors with probability 1.8% (0.8: 1.1%, 0.9: 0.23%; counted
over the 8! permutations), all four bounds together ~5e-9."""
RATIO_RANGE = (0.5, 2.0)
"""Estimate / measurement of every (tensor, type): the widest seen over seeds 0..19 was 0.566..1.784."""
MEDIAN_TOL = 0.15
"""|median ratio − 1| over the 32 pairs: seeds 0..19 gave 0.926..1.094 (sd 0.05; 3 sd)."""
WHOLE_Z = 4.0
"""|estimate − measured| of the whole model at one type, in the pass's SEs (module docstring)."""
DRAWS, N_WINDOWS = 4, 12


def _case(seed: int = 0):
    model = tiny_gpt()
    ids = windows(N_WINDOWS, 33, 3)
    sens = measure_sensitivity(model, TYPES, ids[:, :-1], cfg=SensitivityConfig(draws=DRAWS, seed=seed))
    return model, ids, sens


@pytest.fixture(scope="module")
def case():
    return _case()


@pytest.fixture(scope="module")
def truth(case):
    """(tensors, types): the true KL of each tensor alone in each type."""
    model, ids, sens = case
    return torch.tensor([[_alone(model, sens, j, k, ids) for k in TYPES] for j in range(len(sens.tensors))])


def test_each_type_ranks_the_tensors_as_their_true_measurements_do(case, truth):
    """8 tensors x 4 types, each measured by a whole model pass: within every type (the ranking an allocator relies
    on; pooling the types would let the types' own order supply the correlation) the single-tensor estimates rank the
    tensors as the measurements do, and every estimate sits within the spread measured over 20 seeds."""
    _, _, sens = case
    mean, _ = sens.single()
    for i, k in enumerate(TYPES):
        rho = spearman(mean[:, i], truth[:, i])
        assert rho is not None and rho >= RANK_BOUND[k], (k, rho, mean[:, i], truth[:, i])
    ratio = mean / truth
    assert float(ratio.min()) > RATIO_RANGE[0] and float(ratio.max()) < RATIO_RANGE[1], ratio
    assert abs(float(ratio.flatten().median()) - 1) <= MEDIAN_TOL, ratio


def test_the_whole_model_estimate_matches_its_measurement(case):
    """The interaction-aware estimate of all tensors at one type against the measured uniform quantizer."""
    model, ids, sens = case
    for i, k in enumerate(TYPES):
        est, est_se = sens.estimate([(j, i) for j in range(len(sens.tensors))])
        kl = measure(model, [k], ids, None).metrics[k]["kl"]
        assert abs(est - kl) <= WHOLE_Z * est_se, (k, est, est_se, kl)


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


def _alone(model, sens, j: int, k: str, ids) -> float:
    """The true KL of quantizing tensor j alone at type k (every other tensor f16), on the sensitivity windows."""
    plan = Plan(sens.model_type, sens.n_blocks, tuple(
        PlanTensor(t.name, t.block, t.path, t.shape, k if i == j else "f16") for i, t in enumerate(sens.tensors)))
    with tempfile.TemporaryDirectory() as tmp:
        label = f"plan:{write_plan(plan, Path(tmp) / 'one.json')}"
        return measure(model, {"x": label}, ids, None).metrics["x"]["kl"]


def _spread(seeds: int = 20) -> None:
    """The measured spread behind the tolerances (module docstring): the pass with seeds 0..seeds-1."""
    model, ids, sens = _case()
    true = torch.tensor([[_alone(model, sens, j, k, ids) for k in TYPES] for j in range(len(sens.tensors))])
    whole = [measure(model, [k], ids, None).metrics[k]["kl"] for k in TYPES]
    rho, ratio, z = [], [], []
    for seed in range(seeds):
        s = _case(seed)[2] if seed else sens
        mean, _ = s.single()
        rho.append([spearman(mean[:, i], true[:, i]) for i in range(len(TYPES))])
        ratio.append(mean / true)
        z.append([(e - w) / se for (e, se), w in
                  zip((s.estimate([(j, i) for j in range(len(s.tensors))]) for i in range(len(TYPES))), whole)])
    rho, ratio, z = torch.tensor(rho), torch.stack(ratio), torch.tensor(z)
    for i, k in enumerate(TYPES):
        print(f"{k}: Spearman {rho[:, i].min():.3f}..{rho[:, i].max():.3f} (mean {rho[:, i].mean():.3f}, sd "
              f"{rho[:, i].std():.3f}, seed 0 {rho[0, i]:.3f}); whole-model z {z[:, i].min():.2f}..{z[:, i].max():.2f}")
    med = ratio.flatten(1).median(1).values
    print(f"ratio {ratio.min():.3f}..{ratio.max():.3f} (seed 0 {ratio[0].min():.3f}..{ratio[0].max():.3f}); median per "
          f"seed {med.min():.3f}..{med.max():.3f} (sd {med.std():.3f}); per-pair geometric mean over seeds "
          f"{ratio.log().mean(0).exp().min():.3f}..{ratio.log().mean(0).exp().max():.3f}")


if __name__ == "__main__":  # PYTHONPATH=.:tests python tests/test_sensitivity.py [seeds]
    _spread(int(sys.argv[1]) if len(sys.argv) > 1 else 20)
