"""Issue 37 end to end: the demo's study with rtn4 beside rtn4+had, at the smoke size. The decay and rotations
families are computed from what was measured, every rotations verdict is the one rule applied to its own numbers,
and rotated RTN 4-bit against RTN 4-bit on the demo's checkpoints (point 3) is checked: where the rotation does not
lower Δ CE the test says by how much, with its uncertainty (an expected failure, never a tuned demo). At the smoke
size it does not (2026-11-28: -0.0002 ± 0.0001 nats over 10 checkpoints); the same comparison at the demo's own
size is in docs/FINDINGS.md."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np
import pytest

from quantdyn.results.stats import Z, verdict_sign
from quantdyn.results.store import ResultStore
from quantdyn.studies import findings as fd
from quantdyn.studies import rotation_findings as rf
from quantdyn.studies.pipeline import run_study
from quantdyn.studies.spec import load_study_spec

DEMO = Path(__file__).resolve().parents[1] / "quantdyn" / "studies" / "demo.yaml"


@pytest.mark.e2e
def test_the_demo_with_rotations_measures_both_effects_and_the_gain(tmp_path):
    spec = load_study_spec(DEMO, [
        "scale=cpu-tiny", f"run.out_dir={tmp_path / 'runs'}", f"sweep.store={tmp_path / 'store'}",
        f"report={tmp_path / 'rep'}", "sweep.quantizers=[rtn4,rtn4+had]",
        "sweep.data.eval_windows=16", "findings.compute=[decay,rotations]", "run.train.eval_every=0"])
    out = run_study(spec, progress=False, echo=lambda *a, **k: None)
    rows = [r for r in ResultStore(tmp_path / "store").rows() if r.get("kind") == "ptq"]
    rotated = [r for r in rows if r["quantizer"].endswith("+had")]
    assert rotated and all(r["rotation"] == "had" and r["rotation_seed"] == 0 for r in rotated)

    found = [f for f in out["findings"] if f["family"] == "rotations"]
    assert {f["quantizer"] for f in found} == {"rtn4+had"}
    assert len(found) == len(spec.cooldowns.from_steps)  # per pair and cooldown branch
    for f in found:  # the verdict and the words are the rule applied to the numbers stored beside them
        assert f["verdict"] == fd.verdict(f["effect"], f["se"], -1 if f["decay_plain"] >= 0 else 1, Z)
        assert f["effect"] == pytest.approx(f["decay_rotated"] - f["decay_plain"], abs=1e-9)
    assert (tmp_path / "rep" / "findings_rotations.png").is_file()
    details = json.loads((tmp_path / "rep" / "findings.json").read_text())["details"]

    # point 3: rotated RTN 4-bit against RTN 4-bit on every checkpoint of the demo, paired over the windows
    gains = [g for g in details["rotation_gains"] if g["plain"] == "rtn4"]
    assert len(gains) == sum(r["quantizer"] == "rtn4" for r in rows) and all(g["paired"] for g in gains)
    for g in gains:
        assert g["sign"] == verdict_sign(g["difference"], g["difference_se"], Z)
    diffs = np.array([g["difference"] for g in gains])
    mean, spread = float(diffs.mean()), statistics.stdev(diffs) / len(diffs) ** 0.5
    lower, higher = sum(g["sign"] < 0 for g in gains), sum(g["sign"] > 0 for g in gains)
    if not (mean + Z * spread < 0 and higher == 0):
        pytest.xfail(f"rotated RTN 4-bit is not lower than RTN 4-bit on the demo's checkpoints at the smoke size: "
                     f"Δ CE(rtn4+had) − Δ CE(rtn4) = {mean:+.4f} ± {spread:.4f} nats (mean over {len(gains)} "
                     f"checkpoints ± its SE); lower at {lower}, higher at {higher} of them by more than {Z:g} paired SE")
