"""The interventions league (issue 48.4): each intervention's quantized CE minus the standard linear-decay
endpoint's, paired over windows, seeds combined, the verdict rule; FP CE and cost beside; one line for branches from
two checkpoints of one run; the study spec's interventions and nodecay entries checked before any work."""
from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import tiny_run_dict

from quantdyn.errors import QuantdynError
from quantdyn.studies.families import FINDING_FAMILIES, families_in
from quantdyn.studies.league import league_findings, step_cost
from quantdyn.studies.spec import spec_from_dict

STD = "cooldown-s8-d4-linear"
QAT = "cooldown-s8-d4-linear-qat-rtn4"
SAM = "cooldown-s8-d4-linear-sam0.05"
NOD = "nodecay-s8-d4-lawa-k2-p2"
N = 6


def _rows(shift: dict, fp_shift: dict, noise: float = 0.0):
    """Two seeds; per (seed, branch, quantizer) CE(q) windows = FP windows + Δ windows. ``shift[(branch, q)]`` is
    the branch's CE(q) offset from the standard (per seed: +seed*0.001), with a ± noise pattern over windows."""
    rows, fpw = [], {}
    base_fp = np.linspace(3.0, 3.5, N)
    pattern = np.array([1, -1] * (N // 2), dtype=float)
    for seed in (0, 1):
        run = f"lg-s{seed}"
        for b in (STD, QAT, SAM, NOD):
            ck = f"/x/{run}/{b}/step-12"
            fp = base_fp + fp_shift.get(b, 0.0)
            fpw[ck] = fp.tolist()
            rows.append({"kind": "fp", "run": run, "branch": b, "step": 12, "checkpoint": ck, "ce_fp": float(fp.mean()),
                         "ce_fp_se": float(fp.std(ddof=1) / math.sqrt(N))})
            for q, bits in (("rtn4", 4), ("gptq3", 3)):
                off = 0.0 if b == STD else shift[(b, q)] + seed * 0.001
                wd = 0.1 + off + noise * pattern * (1 if b != STD else 0) + 0.02 * np.arange(N) / N
                rows.append({"kind": "ptq", "run": run, "branch": b, "step": 12, "tokens": 1200, "quantizer": q,
                             "bits": bits, "checkpoint": ck, "ckpt_kind": "nodecay" if b == NOD else "cooldown",
                             "parent_step": 8, "ce_fp": float(fp.mean()), "delta_ce": float(wd.mean()),
                             "delta_ce_se": float(wd.std(ddof=1) / math.sqrt(N)), "window_delta": wd.tolist(),
                             "ce_q": float((fp + wd).mean()), "eval_hash": "e"})
    return rows, fpw


def test_league_by_hand():
    shift = {(QAT, "rtn4"): -0.05, (QAT, "gptq3"): -0.01, (SAM, "rtn4"): 0.0, (SAM, "gptq3"): -0.02,
             (NOD, "rtn4"): 0.03, (NOD, "gptq3"): 0.0}
    rows, fpw = _rows(shift, {QAT: 0.004, NOD: -0.01}, noise=0.002)
    assert families_in(rows) and "interventions" in families_in(rows)
    found, detail = league_findings(rows, ["lg-s0", "lg-s1"], fp_windows=fpw, z=2.0)
    assert len(detail["interventions"]) == 2 * 3 * 2 and len(found) == 3 * 2
    f = {(x["quantizer"], x["branch"]): x for x in found}
    # rtn4, QAT: per seed the CE(q) difference is -0.05 + seed*0.001 + the FP shift 0.004, its windows' spread the
    # ±0.002 pattern (SE 0.002*sqrt(N/(N-1))/sqrt(N)); seeds: mean, SE = max(within, between)
    per_seed = [-0.05 + 0.004, -0.05 + 0.001 + 0.004]
    se_w = 0.002 * math.sqrt(N / (N - 1)) / math.sqrt(N)
    within = math.sqrt(2 * se_w ** 2) / 2
    between = np.std(per_seed, ddof=1) / math.sqrt(2)
    x = f[("rtn4", QAT)]
    assert x["effect"] == pytest.approx(np.mean(per_seed), abs=1e-12)
    assert x["se"] == pytest.approx(max(within, between), rel=1e-9)
    assert x["verdict"] == "reproduced" and x["deployed_format"] is True and x["fake_quant"] == "rtn4"
    assert x["d_ce_fp"] == pytest.approx(0.004, abs=1e-12) and x["forward_backward_per_step"] == 1
    # the quantization error alone: the CE(q) shift without the FP's, paired window by window (no noise in it)
    assert x["d_delta_ce"] == pytest.approx(-0.05 + 0.0005, abs=1e-12)
    assert x["d_delta_ce"] + x["d_ce_fp"] == pytest.approx(x["effect"], abs=1e-12)
    assert f[("gptq3", QAT)]["deployed_format"] is False
    # the no-decay branch is worse by 0.03 (+ its FP shift -0.01): resolved against the claim
    assert f[("rtn4", NOD)]["effect"] == pytest.approx(0.03 + 0.0005 - 0.01, abs=1e-12)
    assert f[("rtn4", NOD)]["verdict"] == "opposite" and f[("rtn4", NOD)]["baseline_branch"] == STD
    assert f[("rtn4", SAM)]["forward_backward_per_step"] == 2 and f[("rtn4", SAM)]["fake_quant"] is None
    # SAM at rtn4: 0.0005 mean, per-seed 0 and 0.001, SE 0.0005 by the seeds: not resolved
    assert f[("rtn4", SAM)]["verdict"] == "not resolved at this scale"
    # sorted by the deployed quantity within each quantizer (quantizers most bits first)
    assert [x["branch"] for x in found if x["quantizer"] == "rtn4"] == [QAT, SAM, NOD]
    assert [x["quantizer"] for x in found] == ["rtn4"] * 3 + ["gptq3"] * 3


def test_the_findings_table_shows_fp_and_cost_beside_the_effect(tmp_path):
    """The league's lines in findings.html / findings.csv / the Markdown table carry the pair's FP difference and
    the step's cost beside the quantized effect (the issue's 'FP CE beside it; cost beside that')."""
    from quantdyn.studies.section import Answer, lead_sections, markdown_table, table_rows

    shift = {(b, q): -0.01 for b in (QAT, SAM, NOD) for q in ("rtn4", "gptq3")}
    rows, fpw = _rows(shift, {QAT: 0.004, NOD: -0.01}, noise=0.001)
    found, detail = league_findings(rows, ["lg-s0", "lg-s1"], fp_windows=fpw)
    by = {(r["quantizer"], f["branch"]): r["beside"] for r, f in zip(table_rows(found), found)}
    assert by[("rtn4", QAT)] == ("FP +0.0040 ± 0.0000 nats; Δ CE -0.00950 ± 0.00050; cost 1 forward/backward per step, "
                                 "rtn4 fake-quantized 1x per step")
    assert by[("gptq3", SAM)].startswith("FP +0.0000") and by[("gptq3", SAM)].endswith("cost 2 forward/backward per step")
    assert by[("rtn4", NOD)].startswith("FP -0.0100")
    md = markdown_table(found)
    assert md.splitlines()[0].split(" | ")[6] == "beside" and "cost 2 forward/backward per step" in md
    lead_sections(Answer(found=found, details=detail, decay=[], across=[], z=2.0, repeats={1: len(rows)}), tmp_path)
    page = (tmp_path / "findings.html").read_text()
    assert "<th>beside</th>" in page and "rtn4 fake-quantized 1x per step" in page


def test_branches_from_two_checkpoints_of_one_run_are_one_line():
    rows, fpw = _rows({(b, q): 0.0 for b in (QAT, SAM, NOD) for q in ("rtn4", "gptq3")}, {})
    other = [dict(r, branch="cooldown-s4-d8-linear-qat-rtn4", parent_step=4) for r in rows
             if r.get("branch") == QAT and r["run"] == "lg-s0"]
    with pytest.raises(QuantdynError) as e:
        league_findings(rows + other, ["lg-s0", "lg-s1"], fp_windows=fpw)
    assert "\n" not in str(e.value) and "from two checkpoints" in str(e.value) and "lg-s0" in str(e.value)


def test_costs_from_names():
    assert step_cost("cooldown-s8-d4-linear-sam0.05-qat-q4_k") == {
        "forward_backward_per_step": 2, "fake_quant": "q4_k", "fake_quant_per_step": 2, "average": None}
    assert step_cost(NOD) == {"forward_backward_per_step": 1, "fake_quant": None, "fake_quant_per_step": 0,
                              "average": "lawa-k2-p2"}


def test_league_figure(tmp_path):
    rows, fpw = _rows({(b, q): -0.01 for b in (QAT, SAM, NOD) for q in ("rtn4", "gptq3")}, {}, noise=0.001)
    found, detail = league_findings(rows, ["lg-s0", "lg-s1"], fp_windows=fpw)
    fam = FINDING_FAMILIES.get("interventions")
    assert fam.figure.draw(found, detail["interventions"], tmp_path / fam.figure.file)
    assert (tmp_path / "findings_interventions.png").stat().st_size > 1000
    assert not fam.figure.draw([], [], tmp_path / "none.png")


def _spec(tmp_path, data_cfg, **cooldowns):
    run = tiny_run_dict(tmp_path, data_cfg, steps=12, checkpoint_every=4)
    run["schedule"] = {"name": "constant", "warmup": 2}
    return {"run": run, "seeds": [0, 1], "cooldowns": {"decay_steps": 4, "control": True, **cooldowns}}


@pytest.mark.parametrize("cooldowns, says", [
    ({"from_steps": [4, 8], "interventions": ["qat.format=rtn4"]}, "give one from_step"),
    ({"from_steps": [8], "interventions": ["qat.format=gptq4"]}, "no fake-quantized training path"),
    ({"from_steps": [8], "interventions": ["optim.lr=1"]}, "cannot be set on a cooldown branch"),
    ({"from_steps": [8], "nodecay": ["lawa-k4-p2"]}, "must lie inside the branch"),
    ({"from_steps": [8], "nodecay": ["soup"]}, "name it lawa-kK-pP"),
])
def test_spec_checks_the_league_before_any_work(tmp_path, kjv_small, cooldowns, says):
    with pytest.raises(QuantdynError) as e:
        spec_from_dict(_spec(tmp_path, kjv_small[0], **cooldowns))
    assert says in str(e.value) and "\n" not in str(e.value)


def test_spec_with_a_league(tmp_path, kjv_small):
    s = spec_from_dict(_spec(tmp_path, kjv_small[0], from_steps=[8], nodecay=["lawa-k2-p2"],
                             interventions=["qat.format=rtn4", "optim.sam_rho=0.5 optim.sam_adaptive=true"]))
    assert "interventions" in s.finding_families
    assert s.cooldowns.intervention(s.cooldowns.interventions[1]).tag == "asam0.5"


@pytest.mark.e2e
def test_league_study_end_to_end(tmp_path, kjv_small):
    """A tiny league through run_study: the intervention branches trained, the QAT format added to the sweep,
    the interventions findings paired over windows (FP window losses computed) and the figure drawn."""
    import json

    from quantdyn.results.store import ResultStore
    from quantdyn.studies.pipeline import run_study

    run = tiny_run_dict(tmp_path / "runs", kjv_small[0], steps=8, checkpoint_every=4)
    run.update(name="lg", schedule={"name": "constant", "warmup": 1})
    spec = {"run": run, "seeds": [0, 1],
            "cooldowns": {"from_steps": [8], "decay_steps": 4, "control": True,
                          "interventions": ["qat.format=rtn4"], "nodecay": ["ema-0.9"]},
            "sweep": {"quantizers": ["rtn2"], "store": str(tmp_path / "store"),
                      "data": {"calib_samples": 4, "calib_seq_len": 32, "eval_windows": 12, "eval_seq_len": 32}},
            "findings": {"compute": ["interventions"]}, "report": str(tmp_path / "report")}
    run_study(spec, progress=False, echo=lambda *_: None)
    rows = ResultStore(tmp_path / "store").rows()
    assert {r["quantizer"] for r in rows if r["kind"] == "ptq"} == {"rtn2", "rtn4"}
    found = [f for f in json.loads((tmp_path / "report" / "findings.json").read_text())["findings"]
             if f["family"] == "interventions"]
    assert {(f["quantizer"], f["branch"]) for f in found} == {
        (q, b) for q in ("rtn2", "rtn4") for b in ("cooldown-s8-d4-linear-qat-rtn4", "nodecay-s8-d4-ema-0.9")}
    assert all(f["n_seeds"] == 2 and f["se_windows"] is not None for f in found)
    detail = json.loads((tmp_path / "report" / "findings.json").read_text())["details"]["interventions"]
    assert len(detail) == 2 * 2 * 2 and all(d["paired"] for d in detail)  # CE(q) paired window by window
    assert [f["deployed_format"] for f in found if f["branch"].endswith("qat-rtn4")].count(True) == 1
    assert (tmp_path / "report" / "findings_interventions.png").is_file()


def test_grid_values_read_back_what_the_grid_named():
    from quantdyn.launch.grid import expand_grid, grid_values

    keys = ["schedule.decay", "schedule.decay_shape"]
    for name, d in expand_grid({"name": "wd", "train": {"steps": 100}}, ["schedule.decay=0.1,0.33",
                                                                         "schedule.decay_shape=linear,1-sqrt"], seeds=2):
        v = grid_values(name, keys)
        assert v == {"schedule.decay": str(d["schedule"]["decay"]), "schedule.decay_shape": d["schedule"]["decay_shape"]}
    assert grid_values("wd-lr1e-3-s0", keys) is None and grid_values("wd", keys) is None


def test_warmdown_findings_by_hand():
    """Each length x shape against the 20 % linear run of its seed, final checkpoints paired over windows."""
    from quantdyn.studies.league import warmdown_findings

    base_fp = np.linspace(3.0, 3.5, N)
    pattern = np.array([1, -1] * (N // 2), dtype=float)
    shift = {"wd-decay0.2-shapelinear": 0.0, "wd-decay0.33-shapelinear": -0.02, "wd-decay0.2-shape1-sqrt": 0.01}
    rows, fpw = [], {}
    for seed in (0, 1):
        for fam, off in shift.items():
            run = f"{fam}-s{seed}"
            for step in (50, 100):
                ck = f"/x/{run}/step-{step}"
                fp = base_fp + (0.001 * seed if off else 0.0)
                fpw[ck] = fp.tolist()
                wd = 0.1 + (off if step == 100 else 0.5) + (0.003 * pattern if off else np.zeros(N))
                rows.append({"kind": "ptq", "run": run, "branch": "main", "step": step, "tokens": step * 10,
                             "quantizer": "rtn4", "bits": 4, "checkpoint": ck, "ckpt_kind": "checkpoint",
                             "ce_fp": float(fp.mean()), "delta_ce": float(wd.mean()), "window_delta": wd.tolist(),
                             "delta_ce_se": 0.01, "ce_q": float((fp + wd).mean()), "eval_hash": "e"})
    runs = sorted({r["run"] for r in rows})
    found, detail = warmdown_findings(rows, runs, fp_windows=fpw)
    f = {x["seed_family"]: x for x in found}
    assert set(f) == {"wd-decay0.33-shapelinear", "wd-decay0.2-shape1-sqrt"} and len(detail["warmdown"]) == 4
    x = f["wd-decay0.33-shapelinear"]
    # per seed: -0.02 + FP shift 0.001*seed; windows: the ±0.003 pattern
    per_seed = [-0.02, -0.02 + 0.001]
    se_w = 0.003 * math.sqrt(N / (N - 1)) / math.sqrt(N)
    assert x["effect"] == pytest.approx(np.mean(per_seed), abs=1e-12)
    assert x["se"] == pytest.approx(max(math.sqrt(2) * se_w / 2, np.std(per_seed, ddof=1) / math.sqrt(2)), rel=1e-9)
    assert x["verdict"] == "reproduced" and x["d_ce_fp"] == pytest.approx(0.0005, abs=1e-12)
    assert x["warmdown"] == {"schedule.decay": "0.33", "schedule.decay_shape": "linear"}
    assert f["wd-decay0.2-shape1-sqrt"]["verdict"] == "opposite"
    assert [y["seed_family"] for y in found] == ["wd-decay0.33-shapelinear", "wd-decay0.2-shape1-sqrt"]
    # without the 20 % linear run there is nothing to compare with
    assert warmdown_findings([r for r in rows if "0.2-shapelinear" not in r["run"]], runs)[0] == []
