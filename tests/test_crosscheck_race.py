"""bench/crosscheck_race.py's machinery that runs without GPTQModel (the race itself needs the crosscheck venv or
the race bundle): its usage errors, the budget that kills a child's whole process group, and the peak GPU memory
a child reports at exit."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RACE = ROOT / "bench" / "crosscheck_race.py"
#: a child's first statement in the race: the exit hook that reports its peak GPU memory
HOOK = f"import sys; sys.path.insert(0, {str(ROOT / 'bench')!r}); import gpu_peak_at_exit; gpu_peak_at_exit.install()"


@pytest.fixture(scope="module")
def race():
    sys.path.insert(0, str(ROOT / "bench"))
    import crosscheck_race

    return crosscheck_race


def test_race_device_errors_are_one_line():
    """crosscheck_race.py's usage errors (before anything is trained or written): one line, exit status 2."""
    import torch

    cases = [["--device", "tpu"], ["--sizes", "70m,9b"]]
    if not torch.cuda.is_available():
        cases.append(["--device", "cuda"])
    for args in cases:
        r = subprocess.run([sys.executable, str(RACE), *args], capture_output=True,
                           text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)
        assert r.stderr.startswith("crosscheck_race: --"), r.stderr


def test_a_child_past_the_budget_is_killed_with_its_children(race, tmp_path):
    """measured(timeout=...) kills the child's process group (a grandchild too) and says so; the figures up to the
    kill are kept."""
    pidfile = tmp_path / "grandchild.pid"
    code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
            f" open({str(pidfile)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    t = time.perf_counter()
    m = race.measured([sys.executable, "-c", code], timeout=3)
    assert m["timed_out"] and 3 <= m["wall_s"] < 30 and time.perf_counter() - t < 30
    grandchild = int(pidfile.read_text())
    for _ in range(50):  # the kill reaches the grandchild; it may take a moment to be reaped by init
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        if Path(f"/proc/{grandchild}/stat").read_text().split()[2] == "Z":
            break
        time.sleep(0.1)
    else:
        pytest.fail("the grandchild survived the kill")
    ok = race.measured([sys.executable, "-c", "print('RESULT {}')"], timeout=60)
    assert not ok["timed_out"] and ok["stdout"].strip() == "RESULT {}"
    with pytest.raises(SystemExit):
        race.measured([sys.executable, "-c", "raise SystemExit(3)"], timeout=60)


def test_a_child_reports_its_peak_gpu_memory_at_exit(race):
    """The exit hook writes what measured() reads: nulls where CUDA was never used (as on this CPU); the hook
    imports nothing heavy itself (the measured host memory stays the program's own)."""
    hook = HOOK
    m = race.measured([sys.executable, "-c", hook + "; print('torch' in sys.modules)"])
    assert m["stdout"].strip() == "False"
    assert m["gpu_peak_allocated_bytes"] is None and m["gpu_peak_reserved_bytes"] is None
    m = race.measured([sys.executable, "-c", hook + "; import torch; x = torch.ones(4)"])
    assert m["gpu_peak_allocated_bytes"] is None  # torch imported, CUDA not used: no GPU figure
    m = race.measured([sys.executable, "-c", "pass"])  # a child without the hook: no file, no figure
    assert m["gpu_peak_allocated_bytes"] is None


def test_the_exit_hook_writes_the_peak(tmp_path):
    import torch

    hook = HOOK
    out = tmp_path / "peak.json"
    env = {**os.environ, "QUANTDYN_RACE_GPU_PEAK": str(out)}
    subprocess.run([sys.executable, "-c", hook + "; import torch; x = torch.ones(4)"], check=True, env=env)
    assert json.loads(out.read_text()) == {"allocated": None, "reserved": None}
    if torch.cuda.is_available():  # on a GPU machine: 1 MiB allocated and freed still counts as the peak
        subprocess.run([sys.executable, "-c", hook + "; import torch; x = torch.ones(2**18, device='cuda'); del x"],
                       check=True, env=env)
        peak = json.loads(out.read_text())
        assert peak["allocated"] >= 2**20 and peak["reserved"] >= peak["allocated"]
