"""bench/floor.py, the floor beside `quantdyn quantize` and `quantdyn sweep` (issue 40): on tiny shapes its plain
transformers script and quantdyn's two commands must measure the same thing — the same tokens, the same CE of the
full-precision model and the same Δ CE of each quantizer (one algorithm, different code) — or the cost comparison
compares different work."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.e2e
def test_floor_and_quantdyn_measure_the_same_work(tmp_path):
    out = tmp_path / "floor.json"
    r = subprocess.run([sys.executable, "bench/floor.py", "--quick", "--shapes", "llama-tiny", "--sets", "rtn4,gptq4+rtn3",
                        "--work", str(tmp_path / "work"), "--out", str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=1200)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    doc = json.loads(out.read_text())
    assert doc["machine"]["cpu"] and [c["quantizers"] for c in doc["cases"]] == [["rtn4"], ["gptq4", "rtn3"]]
    for case in doc["cases"]:
        best = case["best"]
        assert set(best) == {"floor", "quantize", "sweep"}
        for side, b in best.items():
            # the floor's FP CE is the engine's within bf16 arithmetic (the same model, other kernels and batching)
            assert abs(b["ce_fp"] - best["floor"]["ce_fp"]) < 2e-3, (side, b["ce_fp"], best["floor"]["ce_fp"])
            for q, d in b["delta_ce"].items():
                assert abs(d - best["floor"]["delta_ce"][q]) < 5e-3, (side, q, d, best["floor"]["delta_ce"][q])
            assert b["wall"] > 0 and abs(sum(b["phases"].values()) - b["wall"]) < 1e-6 * b["wall"] + 1e-9
        assert case["ratio"]["floor"] == 1.0 and case["cpu_ratio"]["floor"] == 1.0
        gptq = case["best"]["floor"]["child"]["quantizers"].get("gptq4")
        assert gptq is None or gptq["calib_s"] > 0  # GPTQ's floor pays its sequential calibration
