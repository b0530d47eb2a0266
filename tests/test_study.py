"""`quantdyn study` end to end on a tiny spec (two seeds), the cross-seed summary, the jitter and the findings."""
import math

import pytest
import yaml
from conftest import tiny_run_dict

from quantdyn.errors import QuantdynError
from quantdyn.results.stats import stable_jitter
from quantdyn.results.store import ResultStore
from quantdyn.studies.findings import seed_summary
from quantdyn.studies.pipeline import run_study
from quantdyn.studies.spec import load_study_spec


def _spec(tmp_path, data_cfg):
    run = tiny_run_dict(tmp_path / "runs", data_cfg, steps=8, checkpoint_every=4)
    run["name"] = "st"
    run["schedule"] = {"name": "constant", "warmup": 1}
    return {
        "run": run,
        "seeds": [0, 1],
        "cooldowns": {"from_steps": [4], "decay_steps": 4, "shape": "linear", "control": True},
        "sweep": {"quantizers": ["rtn2", "rtn4"], "store": str(tmp_path / "store"),
                  "data": {"calib_samples": 4, "calib_seq_len": 32, "eval_windows": 12, "eval_seq_len": 32}},
        "report": str(tmp_path / "report"),
    }


@pytest.mark.e2e
def test_study_two_seeds_end_to_end_and_resume(tmp_path, kjv_small):
    spec = _spec(tmp_path, kjv_small[0])
    lines: list[str] = []
    out = run_study(spec, progress=False, echo=lines.append)
    rows = ResultStore(tmp_path / "store").rows()
    ptq = [r for r in rows if r["kind"] == "ptq"]
    # per seed: main steps 4, 8 + cooldown 8 + control 8 = 4 checkpoints x 2 quantizers
    assert len(ptq) == 16 and {r["run"] for r in ptq} == {"st-s0", "st-s1"}
    assert {r["seed"] for r in ptq} == {0, 1}
    assert len(out["table"]) == 4  # 2 runs x 2 quantizers x 1 branch
    for t in out["table"]:
        end = [r for r in ptq if r["run"] == t["run"] and r["quantizer"] == t["quantizer"] and r["step"] == 8]
        dec = next(r for r in end if r["ckpt_kind"] == "cooldown")
        ctl = next(r for r in end if r["branch"].startswith("control-"))
        assert t["difference"] == pytest.approx(dec["delta_ce"] - ctl["delta_ce"], abs=1e-6)
        assert t["difference_se"] > 0 and t["stable_jitter"] is None  # only 2 stable checkpoints here
    across = out["across_seeds"]
    assert len(across) == 2 and all(a["n_seeds"] == 2 for a in across)
    for a in across:
        ts = [t for t in out["table"] if t["quantizer"] == a["quantizer"]]
        assert a["difference"] == pytest.approx(sum(t["difference"] for t in ts) / 2)
        assert a["within_se"] == pytest.approx(math.hypot(*(t["difference_se"] for t in ts)) / 2)
        assert a["between_se"] == pytest.approx(abs(ts[0]["difference"] - ts[1]["difference"]) / 2)
        assert a["difference_se"] == max(a["within_se"], a["between_se"])
    text = "\n".join(lines)
    # each verdict once, in a sentence with its mean over the seeds; the per-seed tables are the report's (issue 50)
    assert "mean over 2 seeds" in text and "st-s1" in text and "Across seeds" not in text
    assert (tmp_path / "report" / "index.html").is_file()
    pngs = {p.name for p in (tmp_path / "report").glob("*.png")}
    assert {f"{k}_st-s{s}.png" for k in ("trajectory", "rainbow") for s in (0, 1)} | {"seeds_st.png"} <= pngs, pngs
    assert "st: spread over 2 seeds" in (tmp_path / "report" / "index.html").read_text()
    # a rerun trains nothing and writes no rows
    lines.clear()
    again = run_study(spec, progress=False, echo=lines.append)
    assert not any(line.startswith("[1/4]") for line in lines)
    assert len(ResultStore(tmp_path / "store").rows()) == len(rows)
    assert again["table"] == out["table"]


def test_study_spec_errors(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump({"run": {}, "seed": [0]}))
    with pytest.raises(QuantdynError, match="unknown config key 'seed'.*seeds"):
        load_study_spec(p)
    p.write_text(yaml.safe_dump({"seeds": [0]}))
    with pytest.raises(QuantdynError, match="no 'run' section"):
        load_study_spec(p)


def test_stable_jitter_is_detrended_and_uses_only_peak_lr_main_checkpoints():
    def row(step, lr, dce, branch="main", decaying=False):
        return {"branch": branch, "step": step, "tokens": 100 * step, "lr": lr, "delta_ce": dce,
                "decaying": decaying}

    noise = [0.002, -0.001, -0.002, 0.001, 0.0]
    rows = [row(1, 1e-4, 9.0)]  # warmup
    rows += [row(10 * (i + 1), 3e-3, 0.01 + 0.003 * i + e) for i, e in enumerate(noise)]  # drift + noise
    rows += [row(60, 1e-3, 5.0, decaying=True), row(70, 3e-3, 7.0, branch="control-s40-d20")]
    import numpy as np

    x = np.array([1000.0 * (i + 1) for i in range(5)])
    y = np.array([0.01 + 0.003 * i + e for i, e in enumerate(noise)])
    res = y - np.polyval(np.polyfit(x, y, 1), x)
    assert stable_jitter(rows) == pytest.approx(float(np.sqrt((res ** 2).sum() / 3)))
    assert stable_jitter(rows) < 0.003  # the drift is not counted as jitter
    assert stable_jitter(rows[:4]) is None  # fewer than 4 stable checkpoints


def test_seed_summary_needs_two_runs_and_flags_disagreement():
    t = [{"run": "x-s0", "quantizer": "rtn2", "branch": "b", "difference": 0.02, "difference_se": 0.003},
         {"run": "x-s1", "quantizer": "rtn2", "branch": "b", "difference": -0.01, "difference_se": 0.004},
         {"run": "x-s0", "quantizer": "gptq3", "branch": "b", "difference": 0.01, "difference_se": 0.001}]
    (a,) = seed_summary(t)
    assert a["quantizer"] == "rtn2" and a["difference"] == pytest.approx(0.005)
    assert a["within_se"] == pytest.approx(0.0025) and a["between_se"] == pytest.approx(0.015)
    assert a["difference_se"] == pytest.approx(0.015) and not a["same_sign"]  # the seeds' spread dominates
    assert a["min"] == -0.01 and a["max"] == 0.02
    t[1] = {**t[1], "difference": 0.0201}  # seeds agree: the window SE dominates
    (a,) = seed_summary(t)
    assert a["difference_se"] == pytest.approx(a["within_se"]) and a["same_sign"]


def test_seed_families_and_seed_table(tmp_path):
    from quantdyn.report.figures import seed_families, seeds

    def row(run, seed, step, dce, branch="main"):
        return {"kind": "ptq", "run": run, "seed": seed, "step": step, "tokens": step * 10, "branch": branch,
                "quantizer": "rtn2", "bits": 2, "delta_ce": dce, "delta_ce_se": 0.001}

    rows = [row("a-s0", 0, 1, 0.10), row("a-s0", 0, 2, 0.20), row("a-s1", 1, 1, 0.14), row("a-s1", 1, 2, 0.22),
            row("a-s1", 1, 3, 0.30), row("b-lr1e-3", 0, 1, 0.5), row("c-s5", 5, 1, 0.4)]
    fam = seed_families(rows)
    assert fam == {"a": ["a-s0", "a-s1"]}  # b has no seed suffix, c has one seed
    t = seeds(rows, "a", fam["a"], tmp_path / "s.png")
    assert [r["step"] for r in t] == [1, 2]  # step 3 exists for one seed only
    assert t[0]["delta_ce_mean"] == pytest.approx(0.12) and t[0]["delta_ce_seed_sd"] == pytest.approx(0.04 / math.sqrt(2))
    assert (tmp_path / "s.png").is_file()


def test_demo_and_study_commands_run_the_pipeline(tmp_path, monkeypatch):
    """`quantdyn demo` runs the embedded spec and `quantdyn study` a file's (with overrides), through run_study."""
    from typer.testing import CliRunner

    import quantdyn.studies.pipeline as pipeline
    from quantdyn.cli import app
    from quantdyn.studies.spec import StudySpec, demo_spec

    seen = []
    monkeypatch.setattr(pipeline, "run_study", lambda spec, progress=True, echo=print: seen.append(spec) or {})
    runner = CliRunner()
    assert runner.invoke(app, ["demo", "--quiet"]).exit_code == 0
    spec = seen[-1]
    assert isinstance(spec, StudySpec) and spec == demo_spec()
    assert spec.cooldowns.control and len(spec.cooldowns.from_steps) >= 2
    assert {"rtn2", "rtn3", "gptq3", "gptq4", "rtn4"} <= set(spec.sweep.quantizers)
    assert spec.sweep.quant_repeats == 1 and spec.findings.compute == ("decay",)
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump({"run": {"name": "x"}, "seeds": [0, 1]}))
    assert runner.invoke(app, ["study", str(p), "--quiet"]).exit_code == 0
    assert seen[-1].run.name == "x" and seen[-1].seeds == (0, 1)
    r = runner.invoke(app, ["study", str(p), "data.source=other.txt", "sweep.quant_repeats=3", "seeds=[4]", "--quiet"])
    assert r.exit_code == 0, r.output
    assert seen[-1].run.data.source == "other.txt" and seen[-1].sweep.quant_repeats == 3 and seen[-1].seeds == (4,)


def test_a_studys_monitor_section_reaches_the_run_and_every_branch(tmp_path, kjv_small):
    """A study's run with monitor.warning_every: the main run and each cooldown branch and control log the early
    warning (the study once trained without hooks: the section was silently ignored); each branch's first
    warning step only keeps its weights, so no update spans two branches."""
    from quantdyn.config import from_dict
    from quantdyn.studies import pipeline
    from quantdyn.studies.spec import spec_from_dict
    from quantdyn.train.checkpoint import read_metrics
    from quantdyn.train.config import RunConfig

    d = _spec(tmp_path, kjv_small[0])
    d["run"]["monitor"] = {"warning_every": 2}
    spec = spec_from_dict(d)
    run_dir = tmp_path / "runs" / "st"
    cfg = from_dict(RunConfig, {**d["run"], "name": "st"})
    assert pipeline._train(cfg, run_dir, False, lambda s: None) is None
    pipeline._cooldowns(spec, run_dir, "st", False, lambda s: None)
    key = "warn/curvature_along_update"
    assert [r["step"] for r in read_metrics(run_dir) if key in r] == [4, 6, 8]
    branches = sorted(p for p in (run_dir / "branches").iterdir())
    assert len(branches) == 2
    for b in branches:  # from step 4 to 8: step 6 keeps the weights, step 8 measures the update 6 -> 8
        assert [r["step"] for r in read_metrics(b) if key in r] == [8], b.name
