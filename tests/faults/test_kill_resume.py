"""kill -9 at seeded random points of `quantdyn train`, `quantdyn cooldown` and `quantdyn sweep`, then resume:
train and cooldown end with bit-exact final weights, sweeps with the same rows, none lost or stored twice."""
from __future__ import annotations

import random
import shutil
import time

import pytest

from faults.conftest import (
    TALLY,
    assert_bit_exact,
    compare_rows,
    cooldown_argv,
    final_weights,
    n_trials,
    write_run_config,
    write_sweep_spec,
)

SEED = 18


class Killer:
    """SIGKILLs a command after a seeded uniform random share (5-95 %) of its expected wall time; the
    expectation starts at the reference run's time and shrinks to any trial that finished first (warm file
    caches make later runs faster), so nearly every trial is a kill."""

    def __init__(self, launcher, t_ref: float, seed: int):
        self.launcher, self.t_ref, self.rng = launcher, t_ref, random.Random(seed)

    def __call__(self, argv, cwd) -> bool:
        """Whether the command was killed (False: it finished first)."""
        child = self.launcher.start(argv, cwd)
        child.proc.join(self.rng.uniform(0.05, 0.95) * self.t_ref)
        if child.proc.exitcode is not None:
            assert child.proc.exitcode == 0, child.stderr()
            self.t_ref = min(self.t_ref, time.perf_counter() - child.started)
            return False
        child.kill9()
        return True


def trials(kills: int, fault: str):
    """Trial numbers until ``kills`` trials were real kills (a command that finished before its kill time
    counts as a trial, not a kill), at most twice as many."""
    trial = 0
    while TALLY[f"{fault}:killed"] < kills and trial < 2 * kills:
        yield trial
        trial += 1


def no_leftover_temporaries(run):
    return [p for p in run.rglob(".step-*") if ".tmp-" in p.name or ".old-" in p.name]


@pytest.mark.e2e
def test_train_killed_and_resumed_is_bit_exact(launcher, reference, fault_root, kjv_small):
    data_cfg, _ = kjv_small
    kill = Killer(launcher, reference["times"]["train"], SEED)
    want = final_weights(reference["run"])
    for trial in trials(n_trials(4), "train kill -9"):
        d = fault_root / f"train-{trial}"
        d.mkdir()
        cfg = write_run_config(d, data_cfg)
        run = d / "t"
        TALLY["train kill -9:trials"] += 1
        killed = kill(["train", str(cfg), "--quiet"], d)
        TALLY["train kill -9:killed"] += killed
        from quantdyn.runs import latest_resumable

        if not killed:
            code, err = 0, ""
        elif latest_resumable(run) is not None:
            code, _, err = launcher.run(["train", "--resume", str(run), "--quiet"], d)
        else:  # killed before the first checkpoint: start again
            code, _, err = launcher.run(["train", str(cfg), "--quiet"], d)
            if code == 2 and "--overwrite" in err:
                code, _, err = launcher.run(["train", str(cfg), "--overwrite", "--quiet"], d)
        assert code == 0, err
        assert_bit_exact(final_weights(run), want)
        assert not no_leftover_temporaries(run)
        TALLY["train kill -9:survived"] += 1


@pytest.mark.e2e
def test_cooldown_killed_and_rerun_is_bit_exact(launcher, reference, fault_root):
    kill = Killer(launcher, reference["times"]["cooldown"], SEED + 1)
    branches = sorted((reference["run"] / "branches").iterdir())
    want = {b.name: final_weights(b) for b in branches}
    for trial in trials(n_trials(4), "cooldown kill -9"):
        d = fault_root / f"cooldown-{trial}"
        d.mkdir()
        run = d / "t"
        shutil.copytree(reference["parent"], run)
        TALLY["cooldown kill -9:trials"] += 1
        TALLY["cooldown kill -9:killed"] += kill(cooldown_argv(run), d)
        code, _, err = launcher.run(cooldown_argv(run), d)  # the same command again
        assert code == 0, err
        for name, w in want.items():
            assert_bit_exact(final_weights(run / "branches" / name), w)
        assert not no_leftover_temporaries(run)
        TALLY["cooldown kill -9:survived"] += 1


@pytest.mark.e2e
def test_sweep_killed_and_rerun_loses_and_duplicates_nothing(launcher, reference, fault_root):
    kill = Killer(launcher, reference["times"]["sweep"], SEED + 2)
    for trial in trials(n_trials(4), "sweep kill -9"):
        d = fault_root / f"sweep-{trial}"
        d.mkdir()
        store = d / "store"
        spec = write_sweep_spec(d, reference["run"], store)
        TALLY["sweep kill -9:trials"] += 1
        TALLY["sweep kill -9:killed"] += kill(["sweep", str(spec), "--quiet"], d)
        code, _, err = launcher.run(["sweep", str(spec), "--quiet"], d)
        assert code == 0, err
        compare_rows(store, reference["rows"], "sweep kill -9")
        TALLY["sweep kill -9:survived"] += 1


@pytest.mark.e2e
def test_two_sweeps_of_one_shard_store_each_row_once(launcher, reference, fault_root):
    d = fault_root / "concurrent"
    d.mkdir()
    store = d / "store"
    spec = write_sweep_spec(d, reference["run"], store)
    TALLY["two sweeps, one shard:trials"] += 1
    a = launcher.start(["sweep", str(spec), "--quiet"], d)
    b = launcher.start(["sweep", str(spec), "--quiet"], d)
    assert a.wait() == 0, a.stderr()
    assert b.wait() == 0, b.stderr()
    compare_rows(store, reference["rows"], "two sweeps, one shard")
    TALLY["two sweeps, one shard:survived"] += 1
