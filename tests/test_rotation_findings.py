"""The rotations finding family (studies/rotation_findings.py): the decay effect with a rotation minus without,
paired over windows, its words, its registration, and the study file that computes it."""
from __future__ import annotations

import math
import statistics
from pathlib import Path

import numpy as np
import pytest

from quantdyn.studies import rotation_findings as rf
from quantdyn.studies.families import FINDING_FAMILIES, families_in
from quantdyn.studies.spec import load_study_spec

ROOT = Path(__file__).resolve().parents[1]
BRANCH, CONTROL = "cooldown-s40-d20-linear", "control-s40-d20"


def _rows(run: str, q: str, decay: float, seed: int, base: np.ndarray) -> list[dict]:
    """A run's rows for quantizer q: 6 stable main checkpoints, a cooldown endpoint whose per-window Δ CE is the
    control's plus ``decay``, with a little window noise of its own."""
    rng = np.random.default_rng(seed)
    rows = [{"kind": "ptq", "run": run, "branch": "main", "ckpt_kind": "checkpoint", "quantizer": q, "bits": 4,
             "step": 10 * (i + 1), "tokens": 1000 * (i + 1), "lr": 3e-3, "decaying": False,
             "delta_ce": 0.05 + 1e-4 * (-1) ** i, "delta_ce_se": 0.001} for i in range(6)]
    ctrl = base + rng.normal(0, 2e-4, base.size)
    for branch, kind, wd in ((BRANCH, "cooldown", ctrl + decay + rng.normal(0, 2e-4, base.size)),
                             (CONTROL, "control", ctrl)):
        rows.append({"kind": "ptq", "run": run, "branch": branch, "ckpt_kind": kind, "quantizer": q, "bits": 4,
                     "step": 60, "tokens": 60000, "lr": 0.0, "delta_ce": float(wd.mean()), "delta_ce_se": 0.001,
                     "window_delta": list(wd), "eval_hash": "e", "parent_step": 40})
    return rows


def _study(rot_decay: float) -> list[dict]:
    base = np.random.default_rng(0).normal(0.05, 0.01, 80)
    return [r for s in (0, 1) for q, d in (("rtn4", 0.01), ("rtn4+had", rot_decay))
            for r in _rows(f"cd-s{s}", q, d, 10 * s + len(q), base)]


def test_the_difference_is_paired_over_windows_and_the_seeds_combine():
    rows = _study(rot_decay=0.0)
    (t0,) = rf.rotation_table(rows, "cd-s0", [("rtn4", "rtn4+had")])
    by = {(r["quantizer"], r["branch"]): np.asarray(r["window_delta"]) for r in rows
          if r["run"] == "cd-s0" and r.get("window_delta")}
    inter = (by["rtn4+had", BRANCH] - by["rtn4+had", CONTROL]) - (by["rtn4", BRANCH] - by["rtn4", CONTROL])
    assert t0["paired"] and t0["difference"] == pytest.approx(float(inter.mean()), abs=1e-12)
    assert t0["difference_eval_se"] == pytest.approx(statistics.stdev(inter) / math.sqrt(inter.size))
    assert t0["decay_plain"] == pytest.approx(0.01, abs=2e-4) and t0["decay_rotated"] == pytest.approx(0, abs=2e-4)
    found, detail = rf.rotation_findings(rows, ["cd-s0", "cd-s1"], ["rtn4", "rtn4+had"])
    (f,) = found
    assert f["family"] == "rotations" and f["plain"] == "rtn4" and f["n_seeds"] == 2
    assert f["effect"] == pytest.approx(statistics.fmean(t["difference"] for t in detail["rotations"]))
    assert f["expected"] == "-" and f["verdict"] == "reproduced"  # the rotation shrank a positive decay effect
    assert rf.rotation_effect_words(f) == "removes the decay effect"


@pytest.mark.parametrize("rot_decay, words, verdict", [
    (0.01, "does not change the decay effect measurably", "not resolved at this scale"),
    (0.005, "shrinks the decay effect", "reproduced"),
    (0.02, "enlarges the decay effect", "opposite"),
    (-0.01, "reverses the decay effect", "reproduced"),
])
def test_what_the_rotation_does_is_said_from_the_numbers(rot_decay, words, verdict):
    (f,), _ = rf.rotation_findings(_study(rot_decay), ["cd-s0", "cd-s1"])
    assert rf.rotation_effect_words(f) == words and f["verdict"] == verdict
    what, says = rf.rotation_sentence(f, "x", 2.0)
    assert words in says and "rtn4+had against rtn4" in what


def test_pairs_are_rotated_labels_beside_their_plain_twins():
    assert rf.rotation_pairs(["gptq3", "gptq3+had", "rtn4+had", "nvfp4", "nvfp4+had+seed2", "w4a4+r1"]) == [
        ("gptq3", "gptq3+had"), ("nvfp4", "nvfp4+had+seed2")]
    assert rf.plain_twin("rtn4") is None and rf.plain_twin("not a label") is None


def test_the_family_is_registered_and_the_study_file_computes_it():
    assert "rotations" in FINDING_FAMILIES
    assert "rotations" in families_in(_study(0.0))
    assert "rotations" not in families_in([r for r in _study(0.0) if r["quantizer"] == "rtn4"])
    spec = load_study_spec(ROOT / "configs/studies/rotations.yaml")
    assert FINDING_FAMILIES.get("rotations").in_spec(spec)
    assert [p for p, _ in rf.rotation_pairs(list(spec.sweep.quantizers))] == ["gptq3", "rtn4", "nvfp4", "w4a4"]
    assert len(spec.seeds) >= 2 and spec.cooldowns.control and "rotations" in spec.findings.compute


def test_rotation_gains_pair_each_checkpoint_window_by_window():
    rng = np.random.default_rng(3)
    plain_w = rng.normal(0.05, 0.01, 60)
    rows = []
    for ck, shift in (("a", -0.004), ("b", 0.0), ("c", 0.003)):
        for q, wd in (("rtn4", plain_w), ("rtn4+had", plain_w + shift + rng.normal(0, 5e-4, 60))):
            rows.append({"kind": "ptq", "run": "demo", "branch": "main", "step": ord(ck), "quantizer": q,
                         "checkpoint_hash": ck, "eval_hash": "e", "delta_ce": float(wd.mean()),
                         "delta_ce_se": 0.001, "window_delta": list(wd)})
    rows.append({**rows[0], "checkpoint_hash": "only-plain"})  # no rotated twin: no line
    gains = rf.rotation_gains(rows, [("rtn4", "rtn4+had")])
    assert [g["step"] for g in gains] == [ord("a"), ord("b"), ord("c")]
    for g, (plain, rot) in zip(gains, zip(rows[0:6:2], rows[1:6:2])):
        diff = np.asarray(rot["window_delta"]) - np.asarray(plain["window_delta"])
        assert g["paired"] and g["difference"] == pytest.approx(float(diff.mean()), abs=1e-12)
        assert g["difference_se"] == pytest.approx(statistics.stdev(diff) / math.sqrt(diff.size))
    assert [g["sign"] for g in gains] == [-1, 0, 1]  # lower, within its uncertainty, higher
    _, detail = rf.rotation_findings(_study(0.0), ["cd-s0"], ["rtn4", "rtn4+had"])
    assert detail["rotation_gains"] == []  # rows without a checkpoint hash do not pair
