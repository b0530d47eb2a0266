"""`quantdyn sweep/grid --slurm` on a real SLURM cluster: a one-node cluster of this machine (Debian's slurm-wlm
and munge, started by tools/slurm_cluster.sh on ports of its own and stopped at the end of the module).

Arrays are submitted, tasks cancelled (`scancel`), requeued (`scontrol requeue`) and warned of their time
limit (SIGUSR1 to the batch shell, what `--signal USR1@120` makes SLURM send), and the work they leave
behind is resumed: every sweep row once with the numbers of a one-process sweep, grid runs ending in the
checkpoints of uninterrupted runs, a 2-process FSDP2 run under srun + torchrun on the loss curve of one
process. Where the cluster cannot start (not root, no apt-get) the module skips with one line; CI sets
QUANTDYN_REQUIRE_SLURM=1, which turns that skip into a failure.

The jobs run with OMP_NUM_THREADS=1, like this process (conftest sets one torch thread): the same
arithmetic in the same order, so sweep rows and final checkpoints compare exactly.
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import tiny_run_dict
from safetensors.torch import load_file

from quantdyn.config import from_dict
from quantdyn.launch.grid import read_grid, run_grid, write_grid
from quantdyn.runs import list_checkpoints
from quantdyn.train.config import RunConfig
from quantdyn.train.trainer import train

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = ROOT / "tools" / "slurm_cluster.sh"


def _free_port_pair() -> int:
    """A port p with p and p + 1 free (slurmctld, slurmd)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no two free ports in a row")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """This module's cluster: its directory; SLURM_CONF points the clients (and the CLI) at it."""
    d = tmp_path_factory.mktemp("slurm")
    env = dict(os.environ, QUANTDYN_SLURM_DIR=str(d), QUANTDYN_SLURM_PORT=str(_free_port_pair()))
    t0 = time.perf_counter()
    r = subprocess.run(["bash", str(CLUSTER), "start"], env=env, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        reason = "no SLURM test cluster: " + ((r.stderr.strip().splitlines() or ["tools/slurm_cluster.sh failed"])[-1])
        if os.environ.get("QUANTDYN_REQUIRE_SLURM") == "1":
            pytest.fail(f"{reason} (QUANTDYN_REQUIRE_SLURM=1: these tests must run)", pytrace=False)
        pytest.skip(reason)
    mp = pytest.MonkeyPatch()
    mp.setenv("SLURM_CONF", str(d / "slurm.conf"))
    mp.setenv("OMP_NUM_THREADS", "1")
    print(f"SLURM test cluster up in {time.perf_counter() - t0:.1f} s: {_run('sinfo', '--version').strip()}")
    try:
        yield d
    finally:
        mp.undo()
        subprocess.run(["bash", str(CLUSTER), "stop"], env=env, timeout=120)


def _run(*args: str) -> str:
    r = subprocess.run(list(args), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, (args, r.stderr)
    return r.stdout


def _jobs() -> set[str]:
    return set(_run("squeue", "-h", "-r", "-o", "%i").split())


def _wait(condition, timeout: float, what: str, every: float = 0.02):
    deadline = time.time() + timeout
    while not (got := condition()):
        assert time.time() < deadline, f"waited {timeout:.0f} s for {what}"
        time.sleep(every)
    return got


def _wait_done(job: str, timeout: float = 240) -> None:
    """Until no task of the array is pending, running or completing (a requeued task is pending)."""
    _wait(lambda: not _run("squeue", "-h", "-r", "-j", job, "-o", "%i").strip(), timeout, f"job {job} to end", 0.5)


def _job_id(stdout: str) -> str:
    m = re.search(r"^submitted job (\d+): ", stdout, re.M)
    assert m, stdout
    job = m.group(1)
    assert f"follow:  squeue -j {job}" in stdout and "\nresume:  " in stdout
    return job


def _log(log_dir: Path, job: str, task: int) -> str:
    return "".join(p.read_text() for p in log_dir.glob(f"*-{job}_{task}.out"))


# ------------------------------------------------------------------ sweeps
def _raw_rows(store: Path) -> list[dict]:
    """Every line of every part file, each of which must be one whole JSON row (no torn line)."""
    rows = []
    for part in sorted(store.glob("part-*.jsonl")):
        for i, line in enumerate(part.read_text().splitlines()):
            rows.append(json.loads(line))  # a torn line fails here
            assert rows[-1].get("key"), (part, i)
    return rows


def _stored_steps(store: Path) -> set[int]:
    try:
        return {r["step"] for r in _raw_rows(store) if r["kind"] == "ptq"}
    except FileNotFoundError:  # a part renamed into place while we listed
        return set()


def test_sweep_array_cancelled_and_requeued_stores_every_row_once(slurm, tmp_path, kjv_small, cli):
    """`sweep --slurm --shards 2`; task 1 is cancelled after its first checkpoint's rows and task 0 requeued
    after its first; the requeued task finishes, the same command submitted again finishes task 1's shard:
    every (checkpoint, quantizer) once, every line whole, the numbers of a one-process sweep."""
    data_cfg, _ = kjv_small
    d = tiny_run_dict(tmp_path, data_cfg, steps=48, checkpoint_every=2)  # 24 checkpoints: 12 per task
    d["name"] = "sw"
    run = train(from_dict(RunConfig, d), progress=False)
    steps = [c.step for c in list_checkpoints(run)]
    shard_of = {s: i % 2 for i, s in enumerate(steps)}  # --shard i/2: every 2nd checkpoint from the i-th
    spec = tmp_path / "sweep.yaml"
    spec.write_text(yaml.safe_dump({"data": {"calib_samples": 4, "calib_seq_len": 32, "eval_windows": 16,
                                             "eval_seq_len": 32}}))
    sweep = ["sweep", spec, "--run", run, "--quantizers", "rtn4,rtn3"]
    ref = tmp_path / "ref"
    r = cli(*sweep, "--store", ref, "--quiet")
    assert r.returncode == 0, r.stderr

    store = tmp_path / "store"
    r = cli(*sweep, "--store", store, "--slurm", "--shards", "2")
    assert r.returncode == 0, r.stderr
    job = _job_id(r.stdout)
    assert f"quantdyn results --store {store}" in r.stdout

    def shard_steps(i):
        return {s for s in _stored_steps(store) if shard_of[s] == i}

    at_requeue = None

    def stop_each_task_after_its_first_rows():  # whichever task gets there first is stopped first
        nonlocal at_requeue
        if at_requeue is None and shard_steps(0):
            _run("scontrol", "requeue", f"{job}_0")
            at_requeue = shard_steps(0)
        if not cancelled and shard_steps(1):
            _run("scancel", f"{job}_1")
            cancelled.append(True)
        return at_requeue is not None and cancelled

    cancelled: list[bool] = []
    _wait(stop_each_task_after_its_first_rows, 180, "both tasks' first rows")
    _wait_done(job)
    logs = store / "slurm" / "logs"
    assert "(restart 1)" in _log(logs, job, 0), _log(logs, job, 0)  # task 0 ran twice
    assert len(at_requeue) < len(steps) // 2  # ... and was requeued mid-work
    done_1 = shard_steps(1)
    assert shard_steps(0) == set(steps[0::2]) and 0 < len(done_1) < len(steps) // 2, done_1  # task 1: cancelled

    r = cli(*sweep, "--store", store, "--slurm", "--shards", "2")  # the printed way to resume
    assert r.returncode == 0, r.stderr
    _wait_done(_job_id(r.stdout))
    rows = _raw_rows(store)
    assert len(rows) == len({x["key"] for x in rows})  # every row exactly once
    ptq = sorted((x["step"], x["quantizer"]) for x in rows if x["kind"] == "ptq")
    assert ptq == sorted((s, q) for s in steps for q in ("rtn4", "rtn3"))
    r = cli("results", "--store", store, "--json")
    assert r.returncode == 0 and len(json.loads(r.stdout)) == len(rows)

    # the numbers of the one-process sweep, to the bit (timings and the write time aside)
    want = {x["key"]: x for x in _raw_rows(ref)}
    assert want.keys() == {x["key"] for x in rows}
    for x in rows:
        diff = {k for k in set(x) | set(want[x["key"]])
                if not (k == "time" or k.startswith("t_")) and x.get(k) != want[x["key"]].get(k)}
        assert not diff, (x["key"], sorted(diff))


# ------------------------------------------------------------------ grids
def _weights(ck: Path) -> dict[str, torch.Tensor]:
    return load_file(str(ck / "model.safetensors"))


def _assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), (a, b, k)


def test_grid_tasks_warned_and_requeued_resume_to_the_checkpoints_of_uninterrupted_runs(slurm, tmp_path, kjv_small,
                                                                                          cli):
    """`grid --slurm`: two runs as array tasks. After each run's first checkpoint, task 1 gets the time-limit
    warning (SIGUSR1 to its batch shell): the trainer checkpoints its step, the task requeues itself and
    resumes from there; task 0 is requeued with `scontrol requeue` (SIGTERM) and resumes from its last
    checkpoint. Both end with the final weights of the same runs trained here without a stop."""
    data_cfg, _ = kjv_small
    # checkpoints at step 5 and the last one only: the step the warning stops at is one of its own. 200 steps:
    # the stops land mid-run also where a step takes 7 ms (a tiny model on an idle machine)
    steps, first = 200, 5
    base = tiny_run_dict(tmp_path, data_cfg, steps=steps, checkpoint_every=0, checkpoint_tokens=[first * 4 * 32])
    base["name"] = "g"
    base["train"]["device"] = "cpu"  # asks SLURM for no GPUs
    vary = ["optim.lr=1e-3,3e-3"]
    write_grid(base, vary, 0, tmp_path / "ref")
    run_grid(tmp_path / "ref", progress=False)

    cfg = tmp_path / "base.yaml"
    cfg.write_text(yaml.safe_dump(base))
    g = tmp_path / "grid"
    r = cli("grid", cfg, "--vary", vary[0], "--dir", g, "--slurm", "--time", "10")
    assert r.returncode == 0, r.stderr
    job = _job_id(r.stdout)
    text = (g / "grid.sbatch").read_text()
    assert "#SBATCH --signal=B:USR1@120" in text and "#SBATCH --requeue" in text and "#SBATCH --gpus-per-node" not in text
    runs = read_grid(g)["runs"]
    firsts = [Path(x["dir"]) / "checkpoints" / f"step-{first:07d}" / "model.safetensors" for x in runs]

    _wait(firsts[1].exists, 180, "run 1's first checkpoint")
    _run("scancel", "--batch", "--signal=USR1", f"{job}_1")  # what SLURM sends 120 s before the time limit
    _wait(firsts[0].exists, 180, "run 0's first checkpoint")
    _run("scontrol", "requeue", f"{job}_0")
    _wait_done(job)

    log0, log1 = _log(g / "logs", job, 0), _log(g / "logs", job, 1)
    assert "SIGUSR1" in log1 and f"requeueing task {job}_1" in log1, log1
    for log in (log0, log1):
        restarted = log.split("(restart 1)", 1)
        assert len(restarted) == 2 and " train --resume " in restarted[1].splitlines()[0], log  # resumed, not new
    # run 1 checkpointed the step the warning reached (SIGTERM, run 0: no checkpoint of its own)
    assert [c.step for c in list_checkpoints(runs[0]["dir"])] == [first, steps]
    saved = [c.step for c in list_checkpoints(runs[1]["dir"])]
    assert len(saved) == 3 and saved[0] == first and first < saved[1] < steps and saved[2] == steps, saved
    assert f" train --resume {runs[1]['dir']}" in log1
    for x in runs:
        final = Path(x["dir"]) / "checkpoints" / f"step-{steps:07d}"
        _assert_same_weights(final, tmp_path / "ref" / "runs" / x["name"] / "checkpoints" / f"step-{steps:07d}")


def test_fsdp2_two_processes_under_srun_and_torchrun_match_one_process(slurm, tmp_path, kjv_small, cli):
    """`grid --slurm --nproc-per-node 2` with dist.strategy=fsdp2: the sbatch script starts torchrun with srun,
    the rendezvous at the job's node from SLURM's variables; warned mid-run, both processes checkpoint the
    same step and the requeued task resumes; the loss curve is the one-process run's (tests/test_fsdp.py)."""
    from test_fsdp import EVERY, _assert_same_curve, _curve, _run_dict

    data_cfg, _ = kjv_small
    steps = 120  # long enough that the warning lands mid-run also on an idle machine
    ref = train(from_dict(RunConfig, _run_dict(tmp_path, data_cfg, "ref", 4, "ddp", steps)), progress=False)
    base = _run_dict(tmp_path, data_cfg, "f", 2, "fsdp2", steps)  # 2 processes x 2 sequences = 1 x 4
    # checkpoints at step EVERY and the last one only: the step the warning stops at is one of its own
    base["train"].update(device="cpu", checkpoint_every=0, checkpoint_tokens=[EVERY * 4 * 32])
    cfg = tmp_path / "fsdp.yaml"
    cfg.write_text(yaml.safe_dump(base))
    g = tmp_path / "grid"
    r = cli("grid", cfg, "--vary", f"seed={base['seed']}", "--dir", g, "--slurm", "--nproc-per-node", "2",
            "--cpus-per-task", "2")
    assert r.returncode == 0, r.stderr
    job = _job_id(r.stdout)
    text = (g / "grid.sbatch").read_text()
    assert "-m torch.distributed.run" in text and "--rdzv_endpoint=" in text and "SLURM_JOB_NODELIST" in text
    run = Path(read_grid(g)["runs"][0]["dir"])
    _wait((run / "checkpoints" / f"step-{EVERY:07d}" / "model.safetensors").exists, 240, "the first checkpoint")
    _run("scancel", "--batch", "--signal=USR1", f"{job}_0")
    _wait_done(job, 300)

    log = _log(g / "logs", job, 0)
    assert f"requeueing task {job}_0" in log, log
    restarted = log.split("(restart 1)", 1)
    assert len(restarted) == 2 and " train --resume " in restarted[1].splitlines()[0], log  # stopped mid-run
    done = [c.step for c in list_checkpoints(run)]  # both processes checkpointed the same step and stopped
    assert len(done) == 3 and done[0] == EVERY and EVERY < done[1] < steps and done[2] == steps, done
    meta = json.loads((run / "checkpoints" / f"step-{steps:07d}" / "quantdyn.json").read_text())
    assert (meta["world_size"], meta["dist_strategy"]) == (2, "fsdp2")
    _assert_same_curve(_curve(ref), _curve(run))


# ------------------------------------------------------------------ bad input
def test_refused_submissions_are_one_line_and_submit_nothing(slurm, tmp_path, cli, kjv_small):
    """A partition or account SLURM refuses, a store or grid directory the tasks cannot write: one line, exit 2,
    nothing written, no job."""
    data_cfg, _ = kjv_small
    ck = tmp_path / "ck"
    ck.mkdir()
    cfg = tmp_path / "base.yaml"
    cfg.write_text(yaml.safe_dump({**tiny_run_dict(tmp_path, data_cfg), "train": {"device": "cpu"}}))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    before = _jobs()
    cases = [
        (["sweep", "--checkpoint", ck, "--store", tmp_path / "s1", "--slurm", "--partition", "nope"],
         "SLURM refuses the job: invalid partition specified: nope", tmp_path / "s1"),
        (["sweep", "--checkpoint", ck, "--store", tmp_path / "s2", "--slurm", "--partition", "restricted",
          "--account", "other"], "Invalid account or account/partition combination specified", tmp_path / "s2"),
        (["sweep", "--checkpoint", ck, "--store", blocker / "store", "--slurm"],
         f"store '{blocker / 'store'}' cannot be created", blocker),
        (["grid", cfg, "--vary", "optim.lr=1e-3,3e-3", "--dir", tmp_path / "g1", "--slurm", "--partition", "nope"],
         "invalid partition specified: nope", tmp_path / "g1"),
        (["grid", cfg, "--vary", "optim.lr=1e-3", "--dir", blocker / "g", "--slurm"],
         f"grid directory '{blocker / 'g'}' cannot be created", blocker),
    ]
    for args, message, untouched in cases:
        r = cli(*args)
        assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)
        assert not untouched.exists() or untouched.is_file(), untouched
    assert _jobs() == before
