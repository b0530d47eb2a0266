"""Issue 46.5: how stable an allocated plan is. With R calibration draws the sensitivity pass runs once per draw;
``plan_stability`` says how many tensors change type between the draws' plans and the spread of the plan's KL,
beside the checkpoint's bf16 noise floor — checked against plans allocated on each draw on its own."""
from __future__ import annotations

import pytest
import torch

from plan_models import tiny_gpt, windows
from quantdyn.engine.measure import measure
from quantdyn.engine.rows import repeat_labels
from quantdyn.quantize.catalogue import parse_quantizer
from quantdyn.quantize.plan import plan_of
from quantdyn.ship.ship import answer_lines, plan_stability

LABEL = "auto@4.6:q4_0,q5_1"


def _alone(model, ev, calib):
    """The plan and KL that one draw gives when it is allocated and measured by itself."""
    m = measure(model, {LABEL: parse_quantizer(LABEL)}, ev, {LABEL: calib})
    return plan_of(parse_quantizer(m.plans[LABEL]["plan_label"])).assignment(), m.metrics[LABEL]["kl"]


def test_plan_stability_counts_the_tensors_that_change_type_between_draws():
    model, ev = tiny_gpt(n_layer=2, d=64), windows(4, 65, 1)
    draws = [windows(8, 32, s) for s in (2, 3, 4)]
    labels = repeat_labels(LABEL, 3)
    qc = parse_quantizer(LABEL)
    m = measure(model, {v: qc for v in labels}, ev, dict(zip(labels, draws)), noise_floor=True)
    st = plan_stability(m, LABEL, 3)
    alone = [_alone(model, ev, d) for d in draws]
    base = alone[0][0]
    expected = [sum(base[t] != p[t] for t in base) for p, _ in alone[1:]]
    assert st["draws"] == 3 and st["n_tensors"] == len(base) == 8
    assert st["changed_tensors"] == expected
    assert max(expected) > 0  # these draws do move the plan: a count stuck at 0 would fail here
    # the KL of each draw's plan is the one measured when that draw is allocated alone (same computation; the
    # tolerance covers only float summation order, relative 1e-5 of values ~3e-3)
    for got, (_, kl) in zip(st["kl"], alone):
        assert got == pytest.approx(kl, rel=1e-5)
    assert st["kl_sd"] == pytest.approx(torch.tensor(st["kl"], dtype=torch.float64).std().item(), rel=1e-9)
    assert st["floor_kl"] is not None and st["floor_kl"] > 0


def test_one_draw_has_no_stability_to_report():
    model, ev = tiny_gpt(n_layer=2, d=64), windows(4, 65, 1)
    m = measure(model, {LABEL: parse_quantizer(LABEL)}, ev, {LABEL: windows(8, 32, 2)})
    assert plan_stability(m, LABEL, 1) is None


def test_the_answer_says_how_stable_the_shipped_plan_is():
    report = {"artifact": {"name": "main@600", "made": "checkpoint"}, "quantizer": "auto@4.5", "bits_per_weight": 4.5,
              "ce_q": 3.1, "ce_q_se": 0.01, "tied": [], "naive": None, "z": 2.0,
              "export": {"path": "x.gguf", "format": "gguf", "sha256": "0" * 64},
              "chosen_plan_stability": {"draws": 3, "n_tensors": 210, "changed_tensors": [7, 12],
                                        "kl": [0.010, 0.012, 0.011], "kl_sd": 0.001, "floor_kl": 0.0004}}
    line = next(x for x in answer_lines(report) if x.startswith("plan stability"))
    assert line == ("plan stability over 3 calibration draws: 7, 12 of 210 tensors change type from draw 0's plan; "
                    "its KL 0.011 ± 0.001 (sd over draws), against a bf16 noise floor of 0.0004")
    report["chosen_plan_stability"] = None
    assert not any(x.startswith("plan stability") for x in answer_lines(report))
