"""Fixtures of the fault-injection suite: a fast launcher of `quantdyn` processes, one tiny run trained
once, its cooldown branch and its sweep (the uninterrupted references every trial is compared with), and
the tally that tests/faults/README.md reports."""
from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml
from conftest import tiny_run_dict

TALLY: Counter = Counter()
"""trials / survived / rows_lost / rows_duplicated per fault, printed at the end of the session."""

SWEEP_DATA = {"calib_samples": 4, "calib_seq_len": 32, "eval_windows": 12, "eval_seq_len": 32}
MEASURED = ("ce_fp", "ce_q", "delta_ce", "delta_ce_se", "kl", "top1_agree")


def pytest_terminal_summary(terminalreporter):
    if not TALLY:
        return
    faults = sorted({k.split(":")[0] for k in TALLY})
    terminalreporter.write_sep("-", "fault injection (tests/faults)")
    for f in faults:
        killed = f"  (killed {TALLY[f + ':killed']})" if f.endswith("kill -9") else ""
        terminalreporter.write_line(
            f"{f:<32} trials {TALLY[f + ':trials']:>4}  survived {TALLY[f + ':survived']:>4}  "
            f"rows lost {TALLY[f + ':rows_lost']}  rows duplicated {TALLY[f + ':rows_duplicated']}{killed}")


@pytest.fixture(scope="session")
def launcher(tmp_path_factory):
    from faults._launch import Launcher

    launcher = Launcher(tmp_path_factory.mktemp("fault-logs"))
    code, out, err = launcher.run(["--version"], tmp_path_factory.getbasetemp())  # boots the fork server
    assert code == 0, err
    return launcher


@pytest.fixture(scope="session")
def fault_root(tmp_path_factory):
    return tmp_path_factory.mktemp("faults")


def write_run_config(directory: Path, data_cfg, name: str = "t") -> Path:
    d = tiny_run_dict(directory, data_cfg, steps=12, checkpoint_every=4)
    d["name"] = name
    p = directory / f"{name}.yaml"
    p.write_text(yaml.safe_dump(d))
    return p


def write_sweep_spec(directory: Path, run: Path, store: Path, quantizers=("rtn4", "gptq3")) -> Path:
    p = directory / f"sweep-{store.name}.yaml"
    p.write_text(yaml.safe_dump({"trajectory": {"run": str(run)}, "quantizers": list(quantizers),
                                 "store": str(store), "data": SWEEP_DATA}))
    return p


@pytest.fixture(scope="session")
def reference(launcher, fault_root, kjv_small):
    """The uninterrupted runs: train (12 steps, checkpoints every 4), a cooldown branch with its control, a
    sweep of every checkpoint; with the wall time each took in a child process."""
    data_cfg, _ = kjv_small
    root = fault_root / "ref"
    root.mkdir()
    cfg = write_run_config(root, data_cfg)
    times = {}
    t0 = time.perf_counter()
    code, _, err = launcher.run(["train", str(cfg), "--quiet"], root)
    times["train"] = time.perf_counter() - t0
    assert code == 0, err
    run = root / "t"
    parent = fault_root / "parent"  # the run before any cooldown, copied for every cooldown trial
    shutil.copytree(run, parent)
    t0 = time.perf_counter()
    code, _, err = launcher.run(cooldown_argv(run), root)
    times["cooldown"] = time.perf_counter() - t0
    assert code == 0, err
    store = root / "store"
    spec = write_sweep_spec(root, run, store)
    code, out, err = launcher.run(["sweep", str(spec), "--quiet"], root)
    assert code == 0, err
    # time a second sweep into a scratch store: the trials find the full-precision losses cached, as it does
    t0 = time.perf_counter()
    code, out, err = launcher.run(["sweep", str(write_sweep_spec(root, run, root / "scratch")), "--quiet"], root)
    times["sweep"] = time.perf_counter() - t0
    assert code == 0, err
    return {"root": root, "config": cfg, "run": run, "parent": parent, "store": store, "times": times,
            "rows": store_rows(store)}


def cooldown_argv(run: Path) -> list[str]:
    return ["cooldown", str(run), "--from-step", "8", "--decay-steps", "4", "--control", "--quiet"]


def store_lines(store: Path) -> list[dict]:
    """Every readable row line of a store (duplicates included)."""
    out = []
    for p in sorted(Path(store).glob("part-*.jsonl")):
        for line in p.read_bytes().splitlines():
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if isinstance(r, dict) and isinstance(r.get("key"), str):
                out.append(r)
    return out


def store_rows(store: Path) -> dict[str, dict]:
    return {r["key"]: r for r in reversed(store_lines(store))}  # first written wins


def compare_rows(got_store: Path, ref: dict[str, dict], fault: str) -> None:
    """Same keys as the reference, no key stored twice, the same measurements; tallied."""
    lines = store_lines(got_store)
    got = store_rows(got_store)
    lost = len(set(ref) - set(got))
    TALLY[f"{fault}:rows_lost"] += lost
    TALLY[f"{fault}:rows_duplicated"] += len(lines) - len(got)
    assert lost == 0, f"{lost} rows lost"
    assert set(got) == set(ref), "rows the reference does not have"
    assert len(lines) == len(got), f"{len(lines) - len(got)} rows stored twice"
    for k, r in ref.items():
        for f in MEASURED:
            a, b = r.get(f), got[k].get(f)
            if isinstance(a, float) and isinstance(b, float):
                assert math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9), (k, f, a, b)
            else:
                assert a == b, (k, f, a, b)


def final_weights(run: Path) -> dict:
    from safetensors.torch import load_file

    steps = sorted((run / "checkpoints").glob("step-*"))
    return load_file(str(steps[-1] / "model.safetensors"))


def assert_bit_exact(a: dict, b: dict) -> None:
    import torch

    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def n_trials(default: int) -> int:
    """Trials per fault; QUANTDYN_FAULT_TRIALS scales them (e.g. 10 for a longer soak)."""
    return int(os.environ.get("QUANTDYN_FAULT_TRIALS", default))
