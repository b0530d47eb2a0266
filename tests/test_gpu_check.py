"""bench/gpu_check.py, the one command of a GPU window: its CPU dry run (every step's code path on tiny shapes, on a
Python without the packages the GPU machine lacks), its time budget, and what it hands back through $OUT."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import gpu_check  # noqa: E402
from test_gpu_image import absent_env  # noqa: E402


def _run(args, tmp_path, env=None):
    return subprocess.run([sys.executable, "bench/gpu_check.py", *args, "--results-dir", str(tmp_path / "results"),
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, cwd=ROOT,
                          env=env or dict(os.environ), timeout=1500)


@pytest.mark.e2e
def test_dry_run_runs_every_step_without_the_absent_packages(tmp_path):
    """Both parts of the runbook (the default --part ab), on tiny shapes, on a Python without the packages the GPU
    machine lacks: every step ok (the race skips itself without GPTQModel), its figures where it records them."""
    r = _run(["--device", "cpu", "--dry-run"], tmp_path, env=absent_env())
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    files = sorted((tmp_path / "results").glob("*.json"))
    run = next(p for p in files if p.name.startswith("gpu_check-"))
    data = json.loads(run.read_text())
    assert data["mode"] == "dry-run" and data["machine"]["torch"] and "transformers" in data["machine"]
    assert data["load_avg"] and data["git_sha"]
    b = data["benches"]
    assert list(b) == [*gpu_check.PARTS["a"], *gpu_check.PARTS["b"]] and all(s["status"] == "ok" for s in b.values()), \
        {k: v["status"] for k, v in b.items()}
    assert "skipped" in b["tests"]["summary"]  # tests/gpu collect and skip with their reason on a CPU
    assert b["gptq_speed"]["figures"]["models"][0]["layers"] == 24  # pythia-14m: 6 blocks x 4 linears
    batched = b["gptq_speed"]["figures"]["batched"]
    assert batched and all(c["same_codes"] and c["batch_s"] > 0 for c in batched)
    assert b["sweep_cost"]["figures"]["large"]["n"] == 2
    assert "skipped" in b["race"]["output"] or "written" in b["race"]["output"]
    profile = json.loads(next(p for p in files if p.name.startswith("train_profile-")).read_text())
    assert [v["variant"] for v in profile["variants"]] == ["base", "loss_compiled"]
    # the table, and the files handed back: at most 8, flat, names the device tool accepts
    assert "step" in r.stdout and "train_profile" in r.stdout.split("step ", 1)[-1]
    out = sorted((tmp_path / "out").iterdir())
    assert {p.name for p in out} == {p.name for p in files} and len(out) <= gpu_check.OUT_FILES
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", p.name) and p.is_file() for p in out)


def test_budget_leaves_out_what_does_not_fit_and_says_how_to_run_it(tmp_path):
    """With 30 s of budget no GPU-sized step fits its estimate: none starts, each is recorded with the command
    that runs it in a later device command, and the exit status says the check is incomplete."""
    r = _run(["--device", "cpu", "--budget-s", "30", "--only", "gptq_speed,sweep_cost"], tmp_path)
    assert r.returncode == 1, r.stderr[-2000:]
    data = json.loads(next((tmp_path / "results").glob("gpu_check-*.json")).read_text())
    assert list(data["benches"]) == ["gptq_speed", "sweep_cost"]
    for name, s in data["benches"].items():
        assert s["status"] == "not started" and s["later"] == f"python3 bench/gpu_check.py --only {name}"
    assert "not started" in r.stdout and (tmp_path / "out" / next((tmp_path / "results").glob("*.json")).name).is_file()


def test_unknown_step_and_missing_gpu_are_one_line_errors(tmp_path):
    r = _run(["--only", "tests,trian"], tmp_path)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "unknown step(s) trian" in r.stderr
    import torch

    if not torch.cuda.is_available():
        r = _run([], tmp_path)
        assert r.returncode == 2 and "--device cpu --dry-run" in r.stderr and r.stderr.strip().count("\n") == 0


def test_every_step_has_a_gpu_and_a_dry_run_command_and_an_estimate():
    for dry in (False, True):
        cmds = gpu_check.commands("cuda" if not dry else "cpu", dry)
        assert list(cmds) == list(gpu_check.STEPS)
        for name, cmd in cmds.items():
            assert cmd[0] == sys.executable and (cmd[1] == "-m" or (ROOT / cmd[1]).is_file()), cmd
    assert set(gpu_check.ESTIMATE_S) == set(gpu_check.CAP_S) == set(gpu_check.STEPS)
    assert all(gpu_check.ESTIMATE_S[s] <= gpu_check.CAP_S[s] for s in gpu_check.STEPS)
    # each part (one runbook command of at most 6 minutes) fits the default budget, which leaves the command room
    # for the set-up line and the transfers
    for part in gpu_check.PARTS.values():
        assert sum(gpu_check.ESTIMATE_S[s] for s in part) <= gpu_check.DEFAULT_BUDGET_S < 360


def test_the_race_leaves_the_profile_its_turn():
    """In part b the race's limit (and its own --budget-s) leaves the profile's expected time; the profile gets
    what is left, and stops starting variants a minute before its limit."""
    args, limit = gpu_check.own_budget("race", 318, ["train_profile"], dry_run=False)
    assert limit == 318 - gpu_check.ESTIMATE_S["train_profile"]
    assert args == ["--budget-s", f"{limit - gpu_check.RACE_MARGIN_S:.0f}"]
    args, limit = gpu_check.own_budget("train_profile", 150, [], dry_run=False)
    assert limit == 150 and args == ["--budget-s", "80"]
    assert gpu_check.own_budget("tests", 318, ["gptq_speed", "sweep_cost"], False) == ([], 150)


def test_copy_out_keeps_the_newest_eight_files(tmp_path):
    paths = []
    for i in range(10):
        p = tmp_path / f"r{i}.json"
        p.write_text("{}")
        os.utime(p, (1000 + i, 1000 + i))
        paths.append(p)
    got = gpu_check.copy_out(paths, str(tmp_path / "out"))
    assert sorted(p.name for p in got) == sorted(f"r{i}.json" for i in range(2, 10))
    assert gpu_check.copy_out(paths, "") == []


def test_train_profile_dry_run_groups_every_kernel_and_refuses_unknown_variants(tmp_path, capsys):
    """bench/train_profile.py (the MFU investigation of issue 31) on this CPU with tiny shapes: every variant is
    timed, the profiled one's per-group times add up to its busy time, and the JSON holds both."""
    import train_profile

    assert train_profile.main(["--device", "cpu", "--dry-run", "--variants", "base,loss_compiled",
                               "--results-dir", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("train_profile-cpu-*-dry.json")
    doc = json.loads(path.read_text())
    assert [v["variant"] for v in doc["variants"]] == ["base", "loss_compiled"]
    assert all(v["tokens_per_s"] > 0 and v["batch"] == 2 for v in doc["variants"])
    p = doc["variants"][0]["profile"]
    assert p["busy_ms_per_step"] > 0 and p["top_kernels"]
    assert sum(p["groups_ms_per_step"].values()) == pytest.approx(p["busy_ms_per_step"], rel=1e-9)
    assert "profile" not in doc["variants"][1]
    assert train_profile.main(["--device", "cpu", "--dry-run", "--variants", "nope"]) == 2
    assert "unknown variant 'nope'" in capsys.readouterr().err
    assert train_profile.group_of("triton_red_fused__log_softmax_nll_loss_forward_0") == "cross-entropy"
    assert train_profile.group_of("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT") == "GEMM"
    assert train_profile.group_of("pytorch_flash::flash_fwd_kernel") == "attention"
