"""Issue 48.5 as a first-class analysis: `quantdyn analyze --metrics curvature` / ``sweep.analysis: [curvature]``
(sweep/analysis_rows.py curvature_row) measures the held-out loss's curvature along the update from each checkpoint's
predecessor (runs.predecessor), and the ``early_warning`` finding family correlates it with Δ CE."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import tiny_run_dict

from quantdyn.analysis.hessian import curvature_along, next_token_loss
from quantdyn.config import from_dict
from quantdyn.models.hf_io import load_causal_lm
from quantdyn.runs import RunDir, predecessor
from quantdyn.train.branches import cooldown
from quantdyn.train.config import RunConfig
from quantdyn.train.trainer import train


@pytest.fixture
def run_with_branch(tmp_path, kjv_small):
    """A constant-LR run with checkpoints at steps 4 and 8, and a 4-step linear cooldown from step 4 (its one
    checkpoint at step 8)."""
    data_cfg, _ = kjv_small
    d = {**tiny_run_dict(tmp_path, data_cfg, steps=8, checkpoint_every=4), "name": "cv",
         "schedule": {"name": "constant", "warmup": 2}}
    run = train(from_dict(RunConfig, d), progress=False)
    cooldown(run, from_step=4, decay_steps=[4], shape="linear", control=False, progress=False)
    return run


def _direct(ckpt, prev, ids) -> tuple[float, float, float]:
    """curvature_along on (w_ckpt - w_prev) itself: (curvature, |w_ckpt - w_prev|, its float32 rounding bound)."""
    model = load_causal_lm(ckpt).eval()
    params = list(model.parameters())
    d = [p.detach() - q.detach() for p, q in zip(params, load_causal_lm(prev).parameters())]
    with torch.no_grad():
        r = curvature_along(lambda: next_token_loss(model, ids), params, d)
    # the three float32 losses each carry ~eps |L|: the second difference over h^2 is known to 4 eps |L| / h^2
    bound = 4 * torch.finfo(torch.float32).eps * abs(r["loss"]) / r["h"] ** 2
    return r["curvature"], math.sqrt(sum(float(x.double().pow(2).sum()) for x in d)), bound


def test_predecessors_from_the_run_layout(run_with_branch):
    run = run_with_branch
    main4, main8 = RunDir(run).checkpoint(4), RunDir(run).checkpoint(8)
    cool8 = RunDir(run).branch("cooldown-s4-d4-linear").checkpoint(8)
    assert predecessor(main8) == (main8.parent / "step-0000004", "")
    assert predecessor(cool8)[0] == run / "checkpoints" / "step-0000004"  # the branch point
    prev, why = predecessor(main4)
    assert prev is None and "first checkpoint" in why
    prev, why = predecessor(run)  # not a checkpoint of a run
    assert prev is None and "outside any run directory" in why


def _layout(root, steps, parent=None):
    """A run directory with empty weight files at ``steps`` (what predecessor reads: names, run.json)."""
    (root / "config.yaml").parent.mkdir(parents=True, exist_ok=True)
    (root / "config.yaml").write_text("name: x\n")
    (root / "run.json").write_text(json.dumps({"name": root.name, **({"parent": parent} if parent else {})}))
    for s in steps:
        c = RunDir(root).checkpoint(s)
        c.mkdir(parents=True)
        (c / "model.safetensors").write_bytes(b"")
    return RunDir(root)


def test_a_branch_copy_of_its_branch_point_and_a_missing_branch_point(tmp_path):
    """`quantdyn cooldown MODEL`'s layout: the experiment's step 0 is the branch point and each branch holds the same
    weights as its own step 0, whose update is the branch point's (none: the first checkpoint); a branch whose
    branch point is gone says so; an average has no predecessor."""
    exp = _layout(tmp_path / "exp", [0])
    link = {"run_dir": "../..", "from_step": 0, "kind": "cooldown"}
    br = _layout(exp.branches / "cooldown-s0-d8-linear", [0, 4, 8], link)
    assert predecessor(br.checkpoint(8)) == (br.checkpoint(4), "")
    assert predecessor(br.checkpoint(4)) == (exp.checkpoint(0), "")
    prev, why = predecessor(br.checkpoint(0))
    assert prev is None and "first checkpoint" in why
    gone = _layout(exp.branches / "control-s4-d4", [8], {**link, "from_step": 4})
    prev, why = predecessor(gone.checkpoint(8))
    assert prev is None and "branch point" in why and "step-0000004" in why
    avg = exp.average("ema-0.9", 0)  # an average counts as the run's checkpoint at its step: here the first
    avg.mkdir(parents=True)
    (avg / "model.safetensors").write_bytes(b"")
    assert predecessor(avg)[0] is None


def test_analyze_curvature_equals_curvature_along_the_update(run_with_branch, kjv_small, cli, tmp_path):
    """`quantdyn analyze RUN --metrics curvature`: main step 8 along w_8 - w_4, the cooldown's step 8 along
    w_cool8 - w_4 (its branch point), main step 4 (the run's first checkpoint) None with the reason; each equals
    curvature_along on that difference over the sweep's first 2 held-out windows."""
    run = run_with_branch
    store = tmp_path / "st"
    r = cli("analyze", run, "--metrics", "curvature", "--store", store, "--windows", "2", "--seq-len", "32",
            "--quiet", "--json")
    assert r.returncode == 0, r.stderr[-1500:]
    rows = {(x["branch"], x["step"]): x for x in json.loads(r.stdout.strip().splitlines()[-1])}
    assert set(rows) == {("main", 4), ("main", 8), ("cooldown-s4-d4-linear", 8)}
    assert all(x["analysis"] == "curvature" and x["git_sha"] is not None and x["checkpoint_hash"]
               for x in rows.values())
    first = rows[("main", 4)]
    assert first["curvature_along_update"] is None and first["curvature_from_step"] is None
    assert first["curvature_from"] == "no predecessor (the first checkpoint of its run)"
    ids = kjv_small[1].eval_windows(32, 8)[:2]
    main4 = RunDir(run).checkpoint(4)
    for key, ckpt in ((("main", 8), RunDir(run).checkpoint(8)),
                      (("cooldown-s4-d4-linear", 8), RunDir(run).branch("cooldown-s4-d4-linear").checkpoint(8))):
        row = rows[key]
        k, norm, bound = _direct(ckpt, main4, ids)
        assert row["curvature_from"] == str(main4) and row["curvature_from_step"] == 4, key
        assert row["curvature_windows"] == 2 and row["curvature_from_hash"]
        assert abs(row["curvature_along_update"] - k) <= bound, (key, row["curvature_along_update"], k, bound)
        assert row["update_norm"] == pytest.approx(norm, rel=1e-9)
    # the two updates differ (the cooldown's LR decays): a predecessor mix-up would show here
    assert rows[("main", 8)]["update_norm"] != pytest.approx(rows[("cooldown-s4-d4-linear", 8)]["update_norm"],
                                                             rel=1e-3)
    from quantdyn.results.schema import undocumented

    assert all(undocumented(x) == [] for x in rows.values())
    again = cli("analyze", run, "--metrics", "curvature", "--store", store, "--windows", "2", "--seq-len", "32",
                "--quiet")
    assert again.returncode == 0 and "analysis rows" in again.stdout


def test_an_unknown_metric_is_one_line(tmp_path, cli):
    r = cli("analyze", tmp_path, "--metrics", "curvatur", "--store", tmp_path / "st")
    assert r.returncode == 2 and "did you mean 'curvature'" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


# ------------------------------------------------------------------ the early_warning finding family
def _rows():
    """One run: main checkpoints at steps 100..500 (Δ CE rising), a cooldown from 300 to 500 and its control.
    The curvature rises with Δ CE everywhere (ρ = +1), the Hessian trace falls (ρ = −1), R_L exists at 4 of them.
    The control's step 400 has the main run's step-400 weights reached from the same predecessor: one point."""
    run, q = "r", "rtn4"
    cool, ctrl = "cooldown-s300-d200-linear", "control-s300-d200"
    #          branch, step, Δ CE, curvature, trace, R_L, weights
    pts = [("main", 100, 0.10, 1.0, 9.0, 0.5, "h1"), ("main", 200, 0.12, 2.0, 8.0, 0.7, "h2"),
           ("main", 300, 0.15, 3.0, 7.0, None, "h3"), ("main", 400, 0.16, 4.0, 6.0, 0.6, "h4"),
           ("main", 500, 0.18, 5.0, 5.0, 0.9, "h5"), (ctrl, 400, 0.16, 4.0, 6.0, None, "h4"),
           (ctrl, 500, 0.17, 4.5, 5.5, None, "h6"), (cool, 400, 0.20, 6.0, 4.0, None, "h7"),
           (cool, 500, 0.25, 7.0, 3.0, None, "h8")]
    prev = {"h1": None, "h2": "h1", "h3": "h2", "h4": "h3", "h5": "h4", "h6": "h4", "h7": "h3", "h8": "h7"}
    kinds = {"main": "checkpoint", ctrl: "control", cool: "cooldown"}
    rows = []
    for b, step, dce, k, tr, rl, h in pts:
        where = {"run": run, "branch": b, "step": step, "tokens": step * 1000, "checkpoint": f"{b}/{step}",
                 "checkpoint_hash": h, "ckpt_kind": kinds[b]}
        rows.append({"kind": "ptq", "key": f"p{b}{step}", **where, "quantizer": q, "bits": 4, "delta_ce": dce,
                     "delta_ce_se": 0.001, "ce_fp": 4.0, "ce_q": 4.0 + dce})
        rows.append({"kind": "analysis", "key": f"c{b}{step}", "analysis": "curvature", **where,
                     "curvature_along_update": None if prev[h] is None else k, "curvature_from_hash": prev[h]})
        rows.append({"kind": "analysis", "key": f"h{b}{step}", "analysis": "hessian", **where, "hessian_trace": tr})
        if rl is not None:
            rows.append({"kind": "analysis", "key": f"r{b}{step}", "analysis": "propagation", **where,
                         f"prop_R_final__{q}": rl})
    return rows


def test_the_family_correlates_the_curvature_with_delta_ce_beside_the_trace_and_r_l():
    from quantdyn.studies.families import FINDING_FAMILIES, FindingInputs, families_in
    from quantdyn.studies.spec import FindingsSpec

    rows = _rows()
    assert "early_warning" in families_in(rows)
    assert "early_warning" not in families_in([r for r in rows if r.get("analysis") != "curvature"])
    found, detail = FINDING_FAMILIES.get("early_warning").compute(FindingInputs(rows, ["r"], FindingsSpec(n_boot=200)))
    corr = {f["predictor"]: f for f in found if f["metric"] == "Spearman ρ"}
    assert set(corr) == {"curvature_along_update", "hessian_trace", "prop_R_final"}
    k, tr, rl = corr["curvature_along_update"], corr["hessian_trace"], corr["prop_R_final"]
    # main 200..500, control 500, cooldown 400 and 500: 7 checkpoints (main 100 has no predecessor, the control's
    # 400 is main 400 counted once)
    assert (k["n"], tr["n"], rl["n"]) == (7, 7, 3)
    assert k["effect"] == pytest.approx(1.0, abs=1e-12) and k["verdict"] == "reproduced"
    assert tr["effect"] == pytest.approx(-1.0, abs=1e-12) and tr["verdict"] == "opposite"
    assert not k["comparison"].startswith("beside") and tr["comparison"].startswith("beside it: ")
    # R_L at main 200, 400, 500: Δ CE 0.12 < 0.16 < 0.18 against R_L 0.7, 0.6, 0.9: ranks (2, 1, 3) vs (1, 2, 3)
    assert rl["effect"] == pytest.approx(0.5, abs=1e-12)
    assert all(f["family"] == "early_warning" and f["quantizer"] == "rtn4" for f in corr.values())
    assert sorted((d["branch"], d["step"]) for d in detail["early_warning"]) == [
        ("control-s300-d200", 500), ("cooldown-s300-d200-linear", 400), ("cooldown-s300-d200-linear", 500),
        ("main", 200), ("main", 300), ("main", 400), ("main", 500)]
    # along the trajectory: the cooldown's curvature and its control's, step by step; endpoint minus control
    traj = [(d["role"], d["step"], d["curvature_along_update"]) for d in detail["early_warning_trajectory"]]
    assert traj == [("cooldown", 400, 6.0), ("cooldown", 500, 7.0), ("control", 400, 4.0), ("control", 500, 4.5)]
    (end,) = [f for f in found if f["metric"] == "curvature along the update"]
    assert end["effect"] == pytest.approx(2.5, abs=1e-12) and end["branch"] == "cooldown-s300-d200-linear"
    assert end["verdict"] == "not resolved at this scale"  # one seed, and a finite difference has no SE


def test_a_study_with_the_curvature_analysis_has_the_family():
    from quantdyn.config import from_dict
    from quantdyn.studies.families import FINDING_FAMILIES
    from quantdyn.sweep.sweep import SweepConfig

    fam = FINDING_FAMILIES.get("early_warning")

    class Spec:  # the one field in_spec reads (a StudySpec's sweep)
        sweep = from_dict(SweepConfig, {"analysis": ["hessian", "curvature"]})

    assert fam.in_spec(Spec)
    Spec.sweep = from_dict(SweepConfig, {"analysis": ["hessian"]})
    assert not fam.in_spec(Spec)


def test_the_family_figure_draws_from_its_detail(tmp_path):
    from quantdyn.studies.families import FINDING_FAMILIES, FindingInputs
    from quantdyn.studies.spec import FindingsSpec

    fam = FINDING_FAMILIES.get("early_warning")
    found, detail = fam.compute(FindingInputs(_rows(), ["r"], FindingsSpec(n_boot=50)))
    out = tmp_path / fam.figure.file
    assert fam.figure.draw(found, detail["early_warning"], out) and out.stat().st_size > 0
    assert not fam.figure.draw([], [], tmp_path / "none.png") and not (tmp_path / "none.png").exists()


def test_the_documented_study_override_asks_for_the_family():
    """docs/studies.md's command: the sharpness study with the curvature analysis computes early_warning; naming
    the family without the analysis is one line saying what it needs."""
    from quantdyn.errors import QuantdynError
    from quantdyn.studies.spec import load_study_spec

    spec = Path(__file__).parents[1] / "configs" / "studies" / "sharpness.yaml"
    s = load_study_spec(spec, ["sweep.analysis=[hessian,curvature]",
                               "findings.compute=[decay,sharpness,early_warning]"])
    assert s.sweep.analysis == ("hessian", "curvature") and "early_warning" in s.finding_families
    with pytest.raises(QuantdynError, match="early_warning needs sweep.analysis with curvature"):
        load_study_spec(spec, ["findings.compute=[decay,sharpness,early_warning]"])
