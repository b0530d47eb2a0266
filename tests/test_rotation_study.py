"""Issue 37 end to end: the demo's study with rtn4 and w4a4 beside their rotated twins, at the smoke size. Every
number of the rotations family -- the decay effects, their difference and its uncertainty, the verdict, the
per-checkpoint gains -- is worked out again here with numpy from the stored rows alone (the paired window
differences, their SE, the stable-phase jitter as the residual SD of a least-squares line), not with the functions
under test. Point 3 (rotated against plain on the demo's checkpoints, paired over the windows) is checked where it
can fail: the rotation lowers W4A4's Δ CE (4-bit activations, whose outliers it spreads), and does not make RTN
4-bit resolvably worse (a wrong rotation -- weights rotated, inputs not -- would cost nats). That the rotation does
not *lower* RTN 4-bit's Δ CE at this size is a measurement, reported in docs/FINDINGS.md, not a claim of the code."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from quantdyn.results.store import ResultStore
from quantdyn.studies.pipeline import run_study
from quantdyn.studies.spec import load_study_spec

DEMO = Path(__file__).resolve().parents[1] / "quantdyn" / "studies" / "demo.yaml"
Z = 2.0  # the verdict threshold the study runs with (results/stats.py's default)
PAIRS = (("rtn4", "rtn4+had"), ("w4a4", "w4a4+had"))


def _mean_se(x) -> tuple[float, float]:
    x = np.asarray(x, dtype=np.float64)
    return float(x.mean()), float(x.std(ddof=1) / np.sqrt(x.size))


def _last(rows: list[dict], quantizer: str, branch: str) -> dict:
    mine = [r for r in rows if r["quantizer"] == quantizer and r["branch"] == branch]
    return max(mine, key=lambda r: r["tokens"])


def _jitter(rows: list[dict], plain: str, rotated: str) -> float:
    """The residual SD (n - 2 degrees of freedom) of Δ CE(rotated) - Δ CE(plain) about a least-squares line in
    tokens, over the main run's not-decaying checkpoints at the peak LR (numpy.polyfit)."""
    main = [r for r in rows if r["branch"] == "main" and not r["decaying"]]
    peak = max(r["lr"] for r in main)
    at = {(r["quantizer"], r["step"]): r for r in main if r["lr"] >= peak * (1 - 1e-6)}
    steps = sorted(s for q, s in at if q == plain and (rotated, s) in at)
    x = np.array([at[plain, s]["tokens"] for s in steps], dtype=np.float64)
    y = np.array([at[rotated, s]["delta_ce"] - at[plain, s]["delta_ce"] for s in steps])
    assert len(steps) >= 4
    residuals = y - np.polyval(np.polyfit(x, y, 1), x)
    return float(np.sqrt((residuals ** 2).sum() / (len(steps) - 2)))


@pytest.mark.e2e
def test_the_demo_with_rotations_measures_both_effects_and_the_gain(tmp_path):
    spec = load_study_spec(DEMO, [
        "scale=cpu-tiny", f"run.out_dir={tmp_path / 'runs'}", f"sweep.store={tmp_path / 'store'}",
        f"report={tmp_path / 'rep'}", "sweep.quantizers=[rtn4,rtn4+had,w4a4,w4a4+had]",
        "sweep.data.eval_windows=16", "findings.compute=[decay,rotations]", "run.train.eval_every=0",
        "ship.budget=0"])  # the demo's ship stage is test_ship's
    out = run_study(spec, progress=False, echo=lambda *a, **k: None)
    rows = [r for r in ResultStore(tmp_path / "store").rows() if r.get("kind") == "ptq"]
    details = json.loads((tmp_path / "rep" / "findings.json").read_text())["details"]
    assert (tmp_path / "rep" / "findings_rotations.png").is_file()
    _check(rows, [f for f in out["findings"] if f["family"] == "rotations"], details)


def _check(rows: list[dict], found: list[dict], details: dict) -> None:
    rotated = [r for r in rows if r["quantizer"].endswith("+had")]
    assert rotated and all(r["rotation"] == "had" and r["rotation_seed"] == 0 for r in rotated)
    assert {r["run"] for r in rows} == {"demo"} and all(r["quant_repeats"] == 1 for r in rows)  # one seed, R = 1
    assert all(len(r["window_delta"]) == 16 for r in rows)

    cooldowns = sorted({r["branch"] for r in rows if r["ckpt_kind"] == "cooldown"})
    assert len(cooldowns) == 2  # the demo's two branch points
    assert sorted((f["quantizer"], f["branch"]) for f in found) == sorted((rot, b) for _, rot in PAIRS for b in cooldowns)
    for f in found:
        plain, rot, branch, control = f["plain"], f["quantizer"], f["branch"], f["control"]
        assert dict(PAIRS)[plain] == rot and control == branch.replace("cooldown", "control").rsplit("-", 1)[0]
        ends = {(q, b): _last(rows, q, b) for q in (rot, plain) for b in (branch, control)}
        decay = {q: ends[q, branch]["delta_ce"] - ends[q, control]["delta_ce"] for q in (rot, plain)}
        windows = {k: np.asarray(r["window_delta"], dtype=np.float64) for k, r in ends.items()}
        paired = (windows[rot, branch] - windows[rot, control]) - (windows[plain, branch] - windows[plain, control])
        se = float(np.hypot(_mean_se(paired)[1], _jitter(rows, plain, rot)))
        effect = decay[rot] - decay[plain]
        assert f["decay_plain"] == pytest.approx(decay[plain], rel=1e-12, abs=1e-15)
        assert f["decay_rotated"] == pytest.approx(decay[rot], rel=1e-12, abs=1e-15)
        assert f["effect"] == pytest.approx(effect, rel=1e-9, abs=1e-15)
        assert f["se"] == pytest.approx(se, rel=1e-9)
        # the claim: the rotation shrinks the decay effect, so the difference has the opposite sign
        expected = "-" if decay[plain] >= 0 else "+"
        z = effect / se
        verdict = ("not resolved at this scale" if abs(z) <= Z else
                   "reproduced" if (z < 0) == (expected == "-") else "opposite")
        assert (f["expected"], f["verdict"]) == (expected, verdict), (f, z)

    # the gains: per checkpoint measured with both, Δ CE(rotated) - Δ CE(plain) and its SE paired over the windows
    z_by_pair = {}
    for plain, rot in PAIRS:
        of = {q: {(r["run"], r["branch"], r["step"]): r for r in rows if r["quantizer"] == q} for q in (plain, rot)}
        gains = {(g["run"], g["branch"], g["step"]): g for g in details["rotation_gains"] if g["plain"] == plain}
        assert sorted(gains) == sorted(of[plain]) == sorted(of[rot])
        by_checkpoint = {}
        for key, g in gains.items():
            p, r = of[plain][key], of[rot][key]
            assert (p["checkpoint_hash"], p["eval_hash"]) == (r["checkpoint_hash"], r["eval_hash"])
            d = np.asarray(r["window_delta"], dtype=np.float64) - np.asarray(p["window_delta"], dtype=np.float64)
            se = _mean_se(d)[1]
            diff = r["delta_ce"] - p["delta_ce"]
            assert g["quantizer"] == rot and g["paired"]
            assert g["difference"] == pytest.approx(diff, rel=1e-12, abs=1e-15)
            assert g["difference_se"] == pytest.approx(se, rel=1e-9)
            assert g["sign"] == (0 if abs(diff / se) <= Z else 1 if diff > 0 else -1), (key, diff, se)
            by_checkpoint[p["checkpoint_hash"]] = d
        # point 3: over the distinct checkpoints, window by window, the mean difference and its SE over the windows
        # (the windows are the independent draws; the checkpoints share them)
        mean, se = _mean_se(np.mean(list(by_checkpoint.values()), axis=0))
        z_by_pair[plain] = (mean, se, mean / se, len(by_checkpoint))
    # observed (2026-11-28, shared 2-core EPYC): w4a4 -0.0074 ± 0.0014 (z -5.4), rtn4 -0.00013 ± 0.00010 (z -1.4),
    # 9 distinct checkpoints each
    assert z_by_pair["w4a4"][2] < -Z, f"the rotation does not lower W4A4's Δ CE: {z_by_pair}"
    assert z_by_pair["rtn4"][2] <= Z, f"the rotation makes RTN 4-bit worse: {z_by_pair}"
