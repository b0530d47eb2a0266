"""quantdyn.studies: the typed study spec (unknown keys, bad values, overrides, scales), the findings and
their verdicts on synthetic rows (reproduced / opposite / not resolved, matched-loss interpolation, the
combined uncertainty), and one lean end-to-end study on a corpus the test writes."""
from __future__ import annotations

import math
import re

import numpy as np
import pytest
import yaml

from quantdyn.errors import QuantdynError
from quantdyn.studies import findings as fd
from quantdyn.studies.scales import SCALES, apply_scale
from quantdyn.studies.spec import StudySpec, demo_spec, load_study_spec, spec_from_dict


# ----------------------------------------------------------------------------------------------- the spec
def _base(**extra) -> dict:
    run = {"name": "x", "train": {"steps": 100, "checkpoint_every": 10}}
    return {"run": run, **extra}


def test_unknown_keys_name_the_key_and_suggest_one():
    with pytest.raises(QuantdynError, match=r"unknown config key 'seed' \(did you mean 'seeds'\?\)"):
        spec_from_dict(_base(seed=[0]))
    with pytest.raises(QuantdynError, match=r"unknown config key 'cooldowns.from_step' \(did you mean 'from_steps'"):
        spec_from_dict(_base(cooldowns={"from_step": [10]}))
    with pytest.raises(QuantdynError, match=r"'run.optm'.*did you mean 'optim'"):
        spec_from_dict(_base(run={"name": "x", "optm": {}}))
    with pytest.raises(QuantdynError, match=r"'averaging.lawa.windw'.*did you mean 'window'"):
        spec_from_dict(_base(averaging={"lawa": [{"windw": 2, "every": 10}]}))
    with pytest.raises(QuantdynError, match="no 'run' section"):
        spec_from_dict({"seeds": [0]})


@pytest.mark.parametrize("extra, message", [
    ({"cooldowns": {"from_steps": [10], "decay_steps": 5, "end_step": 50}}, "exactly one of decay_steps"),
    ({"cooldowns": {"from_steps": [15], "decay_steps": 5}}, "step 15 is not a stored checkpoint"),
    ({"cooldowns": {"from_steps": [40], "end_step": 30}}, "end_step=30 must lie after"),
    ({"cooldowns": {"from_steps": [10], "decay_steps": 5, "shape": "cosin"}}, "did you mean 'cosine'"),
    ({"findings": {"compute": ["peak-lr"]}}, "did you mean 'peak_lr'"),
    ({"findings": {"compute": ["peak_lr"]}}, "peak_lr needs vary"),
    ({"findings": {"compute": ["decay"]}}, "decay needs cooldowns with control"),
    ({"findings": {"compute": ["sharpness"]}}, "sharpness needs sweep.analysis with hessian"),
    ({"averaging": {"soup_cooldowns": True}, "cooldowns": {"from_steps": [10], "decay_steps": 5}},
     "soup_cooldowns needs cooldowns with end_step"),
    ({"averaging": {"lawa": [{"window": 2, "every": 15}]}}, "every=15 must be a multiple"),
    ({"averaging": {"lawa": [{"window": 2, "every": 30}]}}, "must divide the step the windows end at"),
    ({"averaging": {"lawa": [{"window": 0, "every": 10}]}}, "window \\(0\\) and every \\(10\\) must be >= 1"),
    ({"sweep": {"trajectory": {"run": "elsewhere"}}}, "remove sweep.trajectory"),
    ({"sweep": {"quantizers": ["gptq9"]}}, "bits=9 is not supported"),
    ({"seeds": [1, 1]}, "lists a seed twice"),
    ({"vary": ["optim.lrr=1e-3,3e-3"]}, "did you mean 'optim.lr'"),
    ({"scale": "pythia-16m"}, "did you mean 'pythia-160m'"),
    ({"findings": {"z": 0}}, "findings.z=0"),
])
def test_bad_values_fail_before_anything_runs(extra, message):
    with pytest.raises(QuantdynError, match=message):
        spec_from_dict(_base(**extra))


def test_overrides_shorthand_order_and_file_errors(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(_base(seeds=[0], sweep={"quant_repeats": 1})))
    s = load_study_spec(p, ["data.source=my.txt", "run.optim.lr=1e-3", "sweep.quant_repeats=3", "seeds=[0,1,2]"])
    assert s.run.data.source == "my.txt" and s.run.optim.lr == 1e-3
    assert s.sweep.quant_repeats == 3 and s.seeds == (0, 1, 2)
    # the scale is applied first, every other override after it: an override wins over the scale
    s = load_study_spec(p, ["run.train.batch_size=3", "scale=cpu-tiny"])
    assert s.scale == "cpu-tiny" and s.run.train.batch_size == 3 and s.run.train.steps == 5
    with pytest.raises(QuantdynError, match=r"s.yaml: unknown config key 'run.dat'"):
        load_study_spec(p, ["run.dat.source=x"])
    with pytest.raises(QuantdynError, match="not of the form key=value"):
        load_study_spec(p, ["data.source"])
    assert isinstance(demo_spec(), StudySpec) and demo_spec().sweep.quant_repeats == 1


def test_a_scale_on_the_command_line_writes_apart_from_the_files_own_outputs(tmp_path):
    # a smoke run of a study file must not land in (or be refused by) the full size's runs, store and report
    p = tmp_path / "s.yaml"
    base = _base(seeds=[0], sweep={"quant_repeats": 1, "store": "runs/x/results"}, report="report/x")
    base["run"]["out_dir"] = "runs/x"
    p.write_text(yaml.safe_dump(base))
    own = load_study_spec(p)
    assert (own.run.out_dir, own.sweep.store, own.report) == ("runs/x", "runs/x/results", "report/x")
    tiny = load_study_spec(p, ["scale=cpu-tiny"])
    assert (tiny.run.out_dir, tiny.sweep.store, tiny.report) == ("runs/x-cpu-tiny", "runs/x-cpu-tiny/results",
                                                                 "report/x-cpu-tiny")
    assert load_study_spec(p, ["scale=cpu"]).run.out_dir == "runs/x"  # the file's own scale: as written
    # a store outside the run directory gets the suffix too; paths on the command line win
    base["sweep"]["store"] = "stores/x"
    p.write_text(yaml.safe_dump(base))
    s = load_study_spec(p, ["scale=pythia-14m", "report=elsewhere"])
    assert (s.run.out_dir, s.sweep.store, s.report) == ("runs/x-pythia-14m", "stores/x-pythia-14m", "elsewhere")
    s = load_study_spec(p, ["run.out_dir=mine", "scale=cpu-tiny"])
    assert s.run.out_dir == "mine"
    # a file that declares its scale writes as written at that scale, apart at another one
    base["scale"] = "cpu-tiny"
    p.write_text(yaml.safe_dump(base))
    assert load_study_spec(p).run.out_dir == "runs/x"
    assert load_study_spec(p, ["scale=cpu-tiny"]).run.out_dir == "runs/x"
    assert load_study_spec(p, ["scale=cpu"]).run.out_dir == "runs/x-cpu"


def test_every_shipped_study_config_is_valid_at_every_scale():
    from pathlib import Path

    files = sorted(Path(__file__).parents[1].joinpath("configs", "studies").glob("*.yaml"))
    assert len(files) >= 5
    for f in files:
        text = f.read_text()
        assert "quant_repeats:" in text, f"{f.name} must state quant_repeats (R)"
        for scale in SCALES:
            s = load_study_spec(f, [f"scale={scale}"])
            assert s.scale == scale and s.findings.compute


def test_scale_keeps_the_study_shape():
    spec = {"run": {"model": {"n_layer": 4, "d_model": 128, "tie_embeddings": True},
                    "schedule": {"name": "wsd", "warmup": 40, "decay": 0.2},
                    "train": {"steps": 800, "checkpoint_every": 80, "eval_every": 80},
                    "monitor": {"every": 40, "warning_every": 20}},
            "cooldowns": {"from_steps": [400, 800], "decay_steps": 200},
            "averaging": {"lawa": [{"window": 4, "every": 160}], "at_step": 800}}
    out = apply_scale(spec, "pythia-160m")
    assert spec["run"]["model"]["n_layer"] == 4  # the input is not changed
    assert out["run"]["model"] == {"tie_embeddings": True, "preset": "pythia-160m", "max_seq_len": 2048}
    assert out["run"]["train"]["steps"] == 8000 and out["run"]["train"]["checkpoint_every"] == 800
    assert out["run"]["schedule"] == {"name": "wsd", "warmup": 400, "decay": 0.2}  # a fraction stays
    assert out["run"]["monitor"] == {"every": 400, "warning_every": 200}  # the early warning scales with the run
    assert out["cooldowns"] == {"from_steps": [4000, 8000], "decay_steps": 2000}
    assert out["averaging"]["lawa"] == [{"window": 4, "every": 1600}] and out["averaging"]["at_step"] == 8000
    assert out["sweep"]["data"]["calib_samples"] == 1024 and out["run"]["data"]["tokenizer"].startswith("Eleuther")
    assert apply_scale(spec, "cpu")["run"] == spec["run"]


# ----------------------------------------------------------------------------------------------- verdicts
def test_verdicts_follow_the_numbers():
    assert fd.verdict(0.05, 0.01, +1) == fd.REPRODUCED
    assert fd.verdict(-0.05, 0.01, +1) == fd.OPPOSITE
    assert fd.verdict(-0.05, 0.01, -1) == fd.REPRODUCED
    assert fd.verdict(0.019, 0.01, +1) == fd.NOT_RESOLVED  # inside 2 SE: no direction, whatever the sign
    assert fd.verdict(0.021, 0.01, +1) == fd.REPRODUCED
    assert fd.verdict(0.021, 0.01, +1, z=3) == fd.NOT_RESOLVED
    assert fd.verdict(0.5, float("nan"), +1) == fd.NOT_RESOLVED and fd.verdict(0.5, 0.0, +1) == fd.NOT_RESOLVED
    assert fd.interval_verdict(0.1, 0.5, +1) == fd.REPRODUCED and fd.interval_verdict(-0.5, -0.1, +1) == fd.OPPOSITE
    assert fd.interval_verdict(-0.1, 0.5, +1) == fd.NOT_RESOLVED
    assert fd.null_verdict(-0.2, 0.4) == fd.NOT_RESOLVED and fd.null_verdict(0.1, 0.4) == fd.OPPOSITE


def _ptq(run, branch, step, q, dce, wd=None, **kw):
    r = {"kind": "ptq", "run": run, "branch": branch, "step": step, "tokens": step * 100, "quantizer": q,
         "bits": int(q[-1]), "delta_ce": dce, "delta_ce_se": kw.pop("se", 0.001), "ce_fp": kw.pop("ce_fp", 4.0),
         "eval_hash": "e", "checkpoint": f"/r/{run}/{branch}/{step}", "quant_repeats": 1}
    if wd is not None:
        r["window_delta"] = list(wd)
    r["ce_q"] = r["ce_fp"] + dce
    r.update(kw)
    return r


def _decay_rows(run, diff, se=0.001, q="gptq3"):
    rng = np.random.default_rng(abs(hash(run)) % 1000)
    w = rng.normal(0.05, 0.01, 40)
    noise = rng.normal(0, se * math.sqrt(40), 40)
    dec = w + diff + noise
    return [_ptq(run, "main", s, q, 0.05, w) for s in (1, 2)] + [
        _ptq(run, "cooldown-s2-d2-linear", 4, q, float(dec.mean()), dec, ckpt_kind="cooldown", parent_step=2),
        _ptq(run, "control-s2-d2", 4, q, float(w.mean()), w, ckpt_kind="control", parent_step=2)]


@pytest.mark.parametrize("diffs, expected", [((0.02, 0.025, 0.018), fd.REPRODUCED),
                                             ((-0.02, -0.025, -0.018), fd.OPPOSITE),
                                             ((0.02, -0.025, 0.001), fd.NOT_RESOLVED)])
def test_decay_findings_on_synthetic_rows(diffs, expected):
    rows = [r for k, d in enumerate(diffs) for r in _decay_rows(f"f-s{k}", d)]
    out, detail = fd.decay_findings(rows, [f"f-s{k}" for k in range(3)])
    (f,) = out
    assert f["verdict"] == expected and f["n_seeds"] == 3 and f["quantizer"] == "gptq3"
    assert f["effect"] == pytest.approx(np.mean([t["difference"] for t in detail["decay"]]))
    assert f["se"] >= f["se_seeds"] and f["figure"] == "rainbow_f-s0.png"


# ----------------------------------------------------------------------------------------------- peak LR
def _curve(run, lr, seed, slope, losses, q="gptq3", n=30):
    """Main-run rows whose Δ CE = slope * (5 - FP loss) (+ shared window noise), peak_lr/seed as the sweep's."""
    rng = np.random.default_rng(seed)
    shape = rng.normal(0, 0.002, n)
    out = []
    for i, L in enumerate(losses):
        d = slope * (5.0 - L)
        out.append(_ptq(run, "main", 100 * (i + 1), q, d, d + shape, ce_fp=L, peak_lr=lr, seed=seed))
    return out


def test_interpolation_at_matched_loss():
    pts = _curve("a", 1e-3, 0, 0.1, [5.0, 4.6, 4.2, 4.0])
    v = fd.interpolate_at_loss(pts, 4.4)
    assert v["delta_ce"] == pytest.approx(0.06) and v["weight"] == pytest.approx(0.5) and v["steps"] == (200, 300)
    assert np.allclose(v["window_delta"], 0.5 * np.array(pts[1]["window_delta"]) + 0.5 * np.array(pts[2]["window_delta"]))
    assert fd.interpolate_at_loss(pts, 3.9) is None  # never reached
    # the first crossing in step order counts (a bump later in training is not used)
    bumpy = _curve("b", 1e-3, 0, 0.1, [5.0, 4.0, 4.5, 3.8])
    assert fd.interpolate_at_loss(bumpy, 4.4)["steps"] == (100, 200)
    assert fd.matched_levels([pts, _curve("c", 1e-2, 0, 0.05, [4.8, 4.3, 3.9])], 3) == \
        pytest.approx([4.0, 4.4, 4.8])
    assert fd.matched_levels([pts, _curve("d", 1e-2, 0, 0.05, [3.8, 3.5])], 3) == []  # no overlap


def test_peak_lr_findings_matched_loss_and_equal_steps():
    """Higher LR: less error at the same FP loss, but it reaches lower losses, so at equal steps it can have
    MORE error — the two comparisons must be told apart."""
    rows, runs = [], []
    for seed in (0, 1, 2):
        for lr, slope, losses in ((1e-3, 0.10, [5.0, 4.7, 4.4, 4.2]), (1e-2, 0.06, [4.9, 4.4, 3.9, 3.2])):
            run = f"p-lr{lr:g}-s{seed}"
            runs.append(run)
            rows += _curve(run, lr, seed, slope * (1 + 0.02 * seed), losses)
    out, detail = fd.peak_lr_findings(rows, runs, levels=4, from_fraction=0.0)
    matched = next(f for f in out if f["metric"] == "Δ CE" and "matched" in f["comparison"])
    equal = next(f for f in out if "equal steps" in f["finding"])
    assert matched["verdict"] == fd.REPRODUCED and matched["effect"] < 0
    # at FP loss L both are linear in L: mean over levels 4.2..4.9 of (0.06 - 0.10)(5 - L) (seed 0)
    assert matched["levels"] == pytest.approx([4.2 + 0.7 * j / 3 for j in range(4)])
    assert equal["effect"] > 0 and equal["verdict"] == fd.OPPOSITE  # 0.06*1.8 > 0.10*0.8
    assert matched["n_seeds"] == 3 and matched["se_seeds"] is not None
    assert any(d["level"] for d in detail["peak_lr"]) and any(not d["level"] for d in detail["peak_lr"])
    rho = next(f for f in out if f["metric"] == "Spearman ρ")
    assert rho["effect"] < -0.8 and rho["interval_hi"] is not None  # 2 LRs x 3 seeds: ties cap |ρ| below 1


# ----------------------------------------------------------------------------------------------- averaging
def test_averaging_findings_report_delta_ce_and_quantized_loss():
    rows, fp = [], {}
    rng = np.random.default_rng(3)
    for seed in (0, 1, 2):
        run = f"a-s{seed}"
        w = rng.normal(0.05, 0.01, 40)
        fpw = 3.5 + rng.normal(0, 0.3, 40)  # window difficulty, the same windows for every checkpoint
        ref = _ptq(run, "cooldown-s8-d2-linear", 10, "gptq3", float((w + 0.02).mean()), w + 0.02,
                   ce_fp=float(fpw.mean()), ckpt_kind="cooldown", quant_repeats=2, delta_ce_run_sd=0.002)
        lawa = _ptq(run, "lawa-k4-p2-offline", 10, "gptq3", float(w.mean()), w, ce_fp=float(fpw.mean()) + 0.1,
                    ckpt_kind="lawa", quant_repeats=2, delta_ce_run_sd=0.002)
        main = _ptq(run, "main", 10, "gptq3", float((w + 0.01).mean()), w + 0.01, ce_fp=float(fpw.mean()) + 0.15)
        rows += [ref, lawa, main]
        fp[ref["checkpoint"]] = list(fpw)
        fp[lawa["checkpoint"]] = list(fpw + 0.1)
    out, detail = fd.averaging_findings(rows, ["a-s0", "a-s1", "a-s2"], "cooldown-s8-d2-linear", fp_windows=fp)
    dce = next(f for f in out if f["metric"] == "Δ CE")
    ceq = next(f for f in out if f["metric"] == "CE(quantized)")
    assert len(out) == 2  # the constant-LR main checkpoint is context (detail table), not a finding
    assert dce["verdict"] == fd.REPRODUCED and dce["effect"] == pytest.approx(-0.02, abs=1e-9)
    # per seed sqrt(0.002²/2 + 0.002²/2) = 0.002; over 3 seeds sqrt(3 · 0.002²) / 3
    assert dce["se_run"] == pytest.approx(0.002 / math.sqrt(3))
    # the average quantizes with less error but deploys worse: CE(q) difference = +0.1 - 0.02
    assert ceq["effect"] == pytest.approx(0.08, abs=1e-9) and ceq["verdict"] == fd.OPPOSITE
    assert dce["d_ce_fp"] == pytest.approx(0.1)
    assert {d["checkpoint"] for d in detail["averaging"]} >= {"main (constant LR, no averaging)", "lawa-k4-p2-offline"}


# ----------------------------------------------------------------------------------------------- sharpness
def test_sharpness_findings_trace_differences_and_correlation():
    rows = []
    for seed in (0, 1):
        run = f"h-s{seed}"
        for branch, steps, trace in (("main", (1, 2, 3, 4), (10, 11, 12, 13)), ("cooldown-s4-d2-linear", (5, 6), (20, 30)),
                                     ("control-s4-d2", (5, 6), (13, 14))):
            for s, t in zip(steps, trace):
                kind = "cooldown" if branch.startswith("cooldown") else "control" if branch.startswith("control") else "checkpoint"
                rows.append({"kind": "analysis", "analysis": "hessian", "run": run, "branch": branch, "step": s,
                             "tokens": s * 100, "hessian_trace": t + seed, "hessian_trace_se": 0.5,
                             "hessian_top_eig": t / 10, "parent_step": 4 if branch != "main" else None})
                rows.append(_ptq(run, branch, s, "gptq3", 0.001 * t + 0.0001 * seed, ckpt_kind=kind))
    out, detail = fd.sharpness_findings(rows, ["h-s0", "h-s1"], cfg=fd.CorrelateConfig(n_boot=200))
    trace = next(f for f in out if f["metric"] == "Hessian trace" and "control" in f["comparison"])
    assert trace["effect"] == pytest.approx(16.0) and trace["se_windows"] == pytest.approx(math.hypot(0.5, 0.5) / math.sqrt(2))
    assert trace["verdict"] == fd.REPRODUCED
    start = next(f for f in out if f["metric"] == "Hessian trace" and "start" in f["comparison"])
    assert start["effect"] == pytest.approx(17.0)
    eig = next(f for f in out if f["metric"] == "top Hessian eigenvalue" and "control" in f["comparison"])
    assert eig["effect"] == pytest.approx(1.6) and eig["se_windows"] is None  # power iteration: no SE, not 0
    assert fd.format_parts(eig).startswith("windows n/a, seeds ")
    rho = next(f for f in out if f["metric"] == "Spearman ρ" and "trace" in f["comparison"])
    assert rho["effect"] > 0.9 and rho["verdict"] == fd.REPRODUCED and rho["n"] == 16
    assert len(detail["sharpness"]) == 16


# ----------------------------------------------------------------------------------------------- paper B
def _predictor_rows(mmr_of) -> list[dict]:
    """16 runs' final checkpoints: Δ CE rising with k, R_L tracking it, weight MMR = mmr_of(k, Δ CE)."""
    rng = np.random.default_rng(1)
    rows = []
    for k in range(16):
        run = f"o{k}-s{k % 2}"
        dce = 0.01 + 0.002 * k
        rows.append(_ptq(run, "main", 4, "rtn3", dce, optimizer=["adamw", "muon"][k % 2]))
        rows.append(_ptq(run, "main", 2, "rtn3", dce / 2))  # an earlier checkpoint: not used
        rows.append({"kind": "analysis", "analysis": "outliers", "run": run, "branch": "main", "step": 4,
                     "weight_mmr_mean": mmr_of(k, dce), "weight_kurtosis_mean": float(rng.normal(4, 1))})
        rows.append({"kind": "analysis", "analysis": "propagation", "run": run, "branch": "main", "step": 4,
                     "prop_R_final__rtn3": dce * 1.3 + float(rng.normal(0, 0.001)), "prop_R_final__gptq3": 99.0})
    return rows


def test_predictor_findings_rl_predicts_mmr_does_not():
    runs = [f"o{k}-s{k % 2}" for k in range(16)]
    # MMR symmetric about the middle run: rank correlation with Δ CE exactly 0, by construction
    out, detail = fd.predictor_findings(_predictor_rows(lambda k, dce: 10 + abs(k - 7.5)), runs,
                                        cfg=fd.CorrelateConfig(n_boot=300))
    rl = next(f for f in out if f["metric"] == "Spearman ρ" and "R_L" in f["comparison"])
    mmr = next(f for f in out if f["metric"] == "Spearman ρ" and "weight MMR" in f["comparison"])
    diff = next(f for f in out if f["metric"] == "Δ Spearman ρ" and "weight MMR" in f["comparison"])
    assert rl["verdict"] == fd.REPRODUCED and rl["effect"] > 0.9 and rl["n"] == 16
    # the paper's claim is "no association": an interval holding 0 does not contradict it (nor establish it)
    assert mmr["expected"] == "0" and mmr["effect"] == pytest.approx(0.0, abs=1e-12)
    assert mmr["interval_lo"] < 0 < mmr["interval_hi"] and mmr["verdict"] == fd.NOT_RESOLVED
    assert diff["verdict"] == fd.REPRODUCED and diff["interval_lo"] > 0
    assert len(detail["predictors"]) == 16 and all(d["prop_R_final"] != 99.0 for d in detail["predictors"])
    # an MMR that does track Δ CE contradicts the claim: "opposite", not "reproduced" (the sign +1 is not the claim)
    out, _ = fd.predictor_findings(_predictor_rows(lambda k, dce: 10 + 100 * dce), runs,
                                   cfg=fd.CorrelateConfig(n_boot=300))
    mmr = next(f for f in out if f["metric"] == "Spearman ρ" and "weight MMR" in f["comparison"])
    assert mmr["effect"] == pytest.approx(1.0) and mmr["interval_lo"] > 0 and mmr["verdict"] == fd.OPPOSITE


def test_format_table_says_what_was_compared():
    rows = [r for k, d in enumerate((0.02, 0.025, 0.018)) for r in _decay_rows(f"f-s{k}", d)]
    out, _ = fd.decay_findings(rows, ["f-s0", "f-s1", "f-s2"])
    text = "\n".join(fd.format_table(out))
    assert "A(a) LR decay raises the quantization error" in text and "reproduced" in text
    assert "seeds" in text and "run-to-run not measured (R=1)" in text and "rainbow_f-s0.png" in text
    assert fd.format_table([]) == ["  (no findings: the rows this study needs are missing)"]


# ----------------------------------------------------------------------------------------------- end to end
def _corpus(path):
    """A small corpus unlike KJV: numbered sentences from a fixed vocabulary (a Markov chain)."""
    rng = np.random.default_rng(7)
    words = ("the river cat moves under a quiet bridge while seven red lamps glow over old stone roads and "
             "people sing songs about winter markets harbours ships bread salt iron").split()
    trans = rng.dirichlet(np.ones(len(words)) * 0.3, size=len(words))
    docs, w = [], 0
    for d in range(300):
        sent = []
        for _ in range(120):
            w = rng.choice(len(words), p=trans[w])
            sent.append(words[w])
        docs.append(f"Record {d}.\n" + " ".join(sent) + ".")
    path.write_text("\n\n".join(docs))
    return path


def _verdict_of_numbers(f: dict) -> str:
    """The verdict a finding's own numbers give under the one rule (results/stats.py): an interval for correlations,
    effect against z·SE otherwise; "0" expected = a claim of no association."""
    if f["expected"] == "0":
        return fd.null_verdict(f["interval_lo"], f["interval_hi"])
    sign = +1 if f["expected"] == "+" else -1
    if f["interval_lo"] is not None or f["interval_hi"] is not None:
        return fd.interval_verdict(f["interval_lo"], f["interval_hi"], sign)
    return fd.verdict(f["effect"], f["se"], sign, f.get("z_threshold", fd.Z))


def _findings_table(page: str) -> list[tuple[str, str]]:
    """(comparison, verdict) of every row of the findings table of a report page (index.html or findings.html)."""
    import html

    start = re.search(r"<h2[^>]*>Findings: the papers", page).start()
    table = page[page.index("<table>", start):page.index("</table>", start)]
    head = [html.unescape(h) for h in re.findall(r"<th>(.*?)</th>", table)]
    rows = [[html.unescape(c) for c in re.findall(r"<td[^>]*>(.*?)</td>", tr)]
            for tr in re.findall(r"<tr>(.*?)</tr>", table.split("<tbody>")[1])]
    c, v = head.index("comparison"), head.index("verdict")
    return [(r[c], r[v]) for r in rows]


@pytest.mark.e2e
def test_averaging_and_sharpness_study_end_to_end_on_another_corpus(tmp_path):
    """The averaging study file at the cpu-tiny scale on a local text: LAWA + soup + Hessian + findings + report."""
    from pathlib import Path

    from quantdyn.results.store import ResultStore
    from quantdyn.studies.pipeline import run_study

    corpus = _corpus(tmp_path / "corpus.txt")
    cfg = Path(__file__).parents[1] / "configs" / "studies" / "averaging.yaml"
    spec = load_study_spec(cfg, [
        "scale=cpu-tiny", f"data.source={corpus}", "data.tokenizer=bpe:320", "seeds=[0]",
        f"run.out_dir={tmp_path / 'runs'}", f"sweep.store={tmp_path / 'store'}", f"report={tmp_path / 'rep'}",
        "sweep.quantizers=[rtn3,gptq3]", "sweep.data.eval_windows=16", "sweep.data.calib_samples=4",
        "sweep.analysis=[hessian]", "sweep.analysis_budget={windows: 2, hessian_probes: 3, hessian_eig_iters: 3}",
        "averaging.lawa=[{window: 2, every: 4}]", "findings.compute=[averaging,sharpness]", "findings.n_boot=50",
        "run.train.eval_every=0", "run.train.eval_windows=8"])
    assert spec.run.model.preset == "tiny-2x64" and spec.run.train.steps == 40
    lines: list[str] = []
    out = run_study(spec, progress=False, echo=lines.append)
    text = "\n".join(lines)
    rows = ResultStore(tmp_path / "store").rows()
    branches = {r["branch"] for r in rows if r.get("kind") == "ptq"}
    assert {"main", "lawa-k2-p4-offline", "soup-cooldowns", "cooldown-s32-d8-linear"} <= branches
    lawa = [r for r in rows if r.get("kind") == "ptq" and r["branch"] == "lawa-k2-p4-offline"]
    assert {r["step"] for r in lawa} == {40} and all(r["quant_repeats"] == 2 for r in lawa)
    rtn = [r for r in rows if r.get("kind") == "ptq" and r["quantizer"] == "rtn3"]
    assert all(r["delta_ce_run_sd"] == 0 for r in rtn)  # RTN uses no calibration: no run-to-run spread
    fams = {f["family"] for f in out["findings"]}
    assert fams == {"averaging", "sharpness"}
    avg = [f for f in out["findings"] if f["family"] == "averaging"]
    assert {f["metric"] for f in avg} == {"Δ CE", "CE(quantized)"}
    for f in out["findings"]:  # each verdict is the one rule applied to the numbers stored beside it
        assert f["verdict"] == _verdict_of_numbers(f), f
    assert all(f["se_run"] is not None for f in avg)  # R = 2: the run-to-run part is measured
    assert "A(c) weight averaging matches or beats LR decay" in text and "R = 2" in text
    import html

    page = html.unescape((tmp_path / "rep" / "index.html").read_text())
    assert "Findings: the papers' claims at this scale" in page
    # the report and findings.html show every finding, in order, with the verdict computed for it
    want = [(f["comparison"], f["verdict"]) for f in out["findings"]]
    for name in ("index.html", "findings.html"):
        assert _findings_table((tmp_path / "rep" / name).read_text()) == want, name
    assert (tmp_path / "rep" / "findings.json").is_file() and (tmp_path / "rep" / "findings.html").is_file()
    assert (tmp_path / "rep" / "findings_averaging.png").is_file() and (tmp_path / "rep" / "findings_sharpness.png").is_file()
    # a rerun trains nothing and measures nothing
    lines.clear()
    again = run_study(spec, progress=False, echo=lines.append)
    assert not any(line.startswith("[1/4] training") for line in lines)
    assert len(ResultStore(tmp_path / "store").rows()) == len(rows)
    assert [f["effect"] for f in again["findings"]] == [f["effect"] for f in out["findings"]]


def test_a_diverged_run_is_recorded_and_not_trained_again(tmp_path, monkeypatch):
    """Training that diverges (a peak LR too high) is recorded in REPORT/study.json and left out; a rerun does
    not train it again; with every run diverged the study ends in one line that says what to do."""
    import json

    import quantdyn.studies.pipeline as pipeline

    calls = []

    def diverging(cfg, run_dir, **kw):
        calls.append(cfg.name)
        raise QuantdynError("training diverged by step 3 (loss nan); lower optim.lr or check the data")

    monkeypatch.setattr(pipeline, "train", diverging)
    spec = spec_from_dict({"run": {"name": "d", "out_dir": str(tmp_path / "runs"), "train": {"steps": 8}},
                           "vary": ["optim.lr=1,10"], "sweep": {"store": str(tmp_path / "store")},
                           "report": str(tmp_path / "rep")})
    lines: list[str] = []
    with pytest.raises(QuantdynError, match="every run of the study diverged; lower the peak LR"):
        pipeline.run_study(spec, progress=False, echo=lines.append)
    assert calls == ["d-lr1", "d-lr10"] and any("left out of the study" in line for line in lines)
    state = json.loads((tmp_path / "rep" / "study.json").read_text())
    assert set(state["diverged"]) == {"d-lr1", "d-lr10"} and "step 3" in state["diverged"]["d-lr1"]
    lines.clear()
    with pytest.raises(QuantdynError, match="every run of the study diverged"):
        pipeline.run_study(spec, progress=False, echo=lines.append)
    assert calls == ["d-lr1", "d-lr10"] and sum("diverged before" in line for line in lines) == 2
    # any other training error is the user's to fix, not a divergence
    monkeypatch.setattr(pipeline, "train", lambda *a, **k: (_ for _ in ()).throw(QuantdynError("bad data path")))
    with pytest.raises(QuantdynError, match="bad data path"):
        pipeline.run_study(spec_from_dict({**{"run": {"name": "e", "out_dir": str(tmp_path / "runs")}},
                                           "report": str(tmp_path / "rep2")}), progress=False, echo=lines.append)
