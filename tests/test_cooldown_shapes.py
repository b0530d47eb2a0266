"""Every accepted ``cooldowns.shape`` walks the whole way: the trainer names a cooldown branch and its
control twin, the study spec names them the same, and the findings (decay table and finding, sharpness)
and the report (rainbow table, palette) each find the control of every decayed branch.

Uses only entry points that predate results/schema.py (branch_configs, CooldownSpec, decay_table,
decay_findings, sharpness_findings, rainbow_table, Palette), so it runs unchanged on older code: before
the branch-name format had one home, findings parsed names with an rsplit that cut ``1-sqrt`` in two and
silently dropped those branches while the report still drew them.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from quantdyn.report.figures import rainbow_table
from quantdyn.report.palette import Palette
from quantdyn.schedules import DECAY_SHAPES, ScheduleConfig
from quantdyn.studies import findings as fd
from quantdyn.studies.spec import CooldownSpec
from quantdyn.train.branches import branch_configs
from quantdyn.train.config import RunConfig

FROM, DECAY, QS = 40, 20, ("rtn3", "gptq4")


def _parent() -> RunConfig:
    cfg = RunConfig(name="walk")
    return replace(cfg, schedule=ScheduleConfig(name="constant", warmup=5),
                   train=replace(cfg.train, steps=80))


def _rows(run: str, cooldown: str, control: str) -> list[dict]:
    """A main run with stable-phase checkpoints, a cooldown branch and its control: PTQ rows (decayed endpoint
    clearly worse than its control, paired over windows) and Hessian analysis rows."""
    rng = np.random.default_rng(0)
    base = rng.normal(0.05, 0.01, 64)
    rows = []

    def add(branch, kind, step, shift, lr, decaying, trace):
        for k, q in enumerate(QS):
            wd = base * (k + 1) + shift + rng.normal(0, 1e-4, 64)
            rows.append({"kind": "ptq", "run": run, "branch": branch, "ckpt_kind": kind, "step": step,
                         "tokens": step * 1000, "lr": lr, "decaying": decaying, "quantizer": q, "bits": int(q[-1]),
                         "delta_ce": float(wd.mean()), "delta_ce_se": float(wd.std(ddof=1) / 8),
                         "window_delta": [float(v) for v in wd], "eval_hash": "e", "quant_repeats": 1,
                         "ce_fp": 4.0, "ce_q": 4.0 + float(wd.mean()), "parent_step": FROM if branch != "main" else None,
                         "checkpoint": f"/runs/{run}/{branch}/{step}"})
        rows.append({"kind": "analysis", "analysis": "hessian", "run": run, "branch": branch, "step": step,
                     "tokens": step * 1000, "hessian_trace": trace, "hessian_trace_se": 0.1, "hessian_top_eig": trace / 10,
                     "parent_step": FROM if branch != "main" else None})

    for i, step in enumerate((10, 20, 30, 40, 50, 60)):
        add("main", "checkpoint", step, 0.001 * (i % 2), 3e-3, False, 10.0 + i)
    add(cooldown, "cooldown", FROM + DECAY, 0.02, 0.0, True, 30.0)
    add(control, "control", FROM + DECAY, 0.0, 3e-3, False, 16.0)
    return rows


@pytest.mark.parametrize("shape", sorted(DECAY_SHAPES))
def test_every_decay_shape_finds_its_control_in_findings_and_report(shape):
    assert CooldownSpec(from_steps=(FROM,), decay_steps=DECAY, shape=shape, control=True).shape == shape  # accepted
    cool_cfg, ctrl_cfg = branch_configs(_parent(), FROM, DECAY, shape)
    cooldown, control = cool_cfg.name, ctrl_cfg.name
    spec = CooldownSpec(from_steps=(FROM,), decay_steps=DECAY, shape=shape, control=True)
    assert (spec.branch_name(FROM), spec.control_name(FROM)) == (cooldown, control)  # the study names them alike
    assert cooldown != control and shape in cooldown

    runs = ["walk-s0", "walk-s1"]
    rows = [r for run in runs for r in _rows(run, cooldown, control)]

    # findings: the decay table pairs every quantizer's decayed endpoint with its control ...
    for run in runs:
        table = fd.decay_table(rows, run)
        assert {(t["quantizer"], t["branch"]) for t in table} == {(q, cooldown) for q in QS}, shape
        assert all(t["difference"] == pytest.approx(0.02, abs=1e-3) for t in table)
    found, _ = fd.decay_findings(rows, runs)
    assert {f["quantizer"] for f in found} == set(QS) and all(f["verdict"] == fd.REPRODUCED for f in found), shape
    # ... and the sharpness finding compares the decayed endpoint's Hessian with its control's
    sharp, _ = fd.sharpness_findings(rows, runs, cfg=fd.CorrelateConfig(n_boot=0))
    vs_control = [f for f in sharp if f["metric"] == "Hessian trace" and "control" in f["comparison"]]
    assert len(vs_control) == 1 and vs_control[0]["effect"] == pytest.approx(14.0), shape

    # report: the rainbow table pairs them too, and the palette gives a control its twin's colour
    for run in runs:
        table = rainbow_table(rows, run)
        assert {(t["quantizer"], t["branch"]) for t in table} == {(q, cooldown) for q in QS}, shape
    palette = Palette.for_rows(rows)
    assert palette.branch(control) == palette.branch(cooldown) != palette.branch("main")
