"""Faults of the results store and of the files a sweep reads: torn, garbage and truncated lines in part
files, a full disk during a sweep and during a store append, truncated safetensors checkpoints."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from faults.conftest import TALLY, compare_rows, store_lines, write_sweep_spec
from quantdyn.results.store import QUARANTINE

GARBAGE = [
    b'{"key": "torn-in-the-middle", "x": 1, "y"',  # a write cut off, then more rows appended after it
    b"\x00\x00\x00\x00\x00\x00",  # zero-filled block after a power loss
    b"\xff\xfe\xfd not utf-8",
    b"[1, 2, 3]",  # JSON, not an object
    b'{"kind": "ptq", "delta_ce": 0.1}',  # a row without a key
    b"<<<<<<< merge conflict",
]


def damage(store: Path, drop: int) -> list[Path]:
    """Delete the last ``drop`` parts (work the sweep must redo) and write garbage into the others: a bad
    line in the middle of one, bad lines and a truncated last line (no newline) at the end of another."""
    parts = sorted(store.glob("part-*.jsonl"))
    for p in parts[len(parts) - drop:]:
        p.unlink()
    kept = parts[: len(parts) - drop]
    assert len(kept) >= 2
    lines = kept[0].read_bytes().split(b"\n")
    kept[0].write_bytes(b"\n".join([lines[0], GARBAGE[0], *lines[1:]]))
    with open(kept[1], "ab") as f:
        f.write(b"\n".join(GARBAGE[1:]) + b"\n" + b'{"key": "truncated", "ce_q": 3.')
    return kept


def one_line_error(code: int, err: str) -> list[str]:
    """Exit 2, every stderr line an `error:` line, no traceback; returns the lines."""
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert lines and all(x.startswith("error: ") for x in lines), err
    return lines


def tmp_files(store: Path) -> list[Path]:
    return [p for p in store.iterdir() if p.name.startswith((".part-", ".tmp-"))]


@pytest.mark.e2e
def test_sweep_resumes_over_torn_and_garbage_lines(launcher, reference, fault_root):
    d = fault_root / "garbage"
    d.mkdir()
    store = d / "store"
    shutil.copytree(reference["store"], store)
    kept = damage(store, drop=2)
    TALLY["torn/garbage lines:trials"] += 1
    spec = write_sweep_spec(d, reference["run"], store)
    code, out, err = launcher.run(["sweep", str(spec), "--quiet"], d)
    assert code == 0, err
    warning = [x for x in err.splitlines() if x.startswith("results store")]
    assert len(warning) == 1 and f"{kept[0]} line 2" in warning[0] and "7 unreadable lines" in warning[0], err
    compare_rows(store, reference["rows"], "torn/garbage lines")
    # the readers a user meets next: results, report; then the quarantine
    code, out, err = launcher.run(["results", "--store", str(store), "--json"], d)
    assert code == 0 and out.startswith("["), err
    code, out, err = launcher.run(["report", str(store), "--out", str(d / "report")], d)
    assert code == 0 and (d / "report" / "index.html").is_file(), err
    code, out, err = launcher.run(["results", "--store", str(store), "--check"], d)
    assert code == 0 and "moved 7 unreadable lines" in out, err
    quarantined = b"".join(p.read_bytes() for p in (store / QUARANTINE).iterdir())
    assert all(g in quarantined for g in GARBAGE) and b'"truncated"' in quarantined
    code, out, err = launcher.run(["results", "--store", str(store), "--check"], d)
    assert "all lines readable" in out and not err
    compare_rows(store, reference["rows"], "torn/garbage lines")
    TALLY["torn/garbage lines:survived"] += 1


@pytest.mark.e2e
def test_disk_full_during_a_sweep_rlimit(launcher, reference, fault_root):
    """RLIMIT_FSIZE: every write past 64 bytes fails (EFBIG), as on a full disk."""
    d = fault_root / "full-rlimit"
    d.mkdir()
    store = d / "store"
    shutil.copytree(reference["store"], store)
    parts = sorted(store.glob("part-*.jsonl"))
    for p in parts[2:]:
        p.unlink()
    before = {p.name: p.read_bytes() for p in parts[:2]}
    spec = write_sweep_spec(d, reference["run"], store)
    TALLY["disk full (RLIMIT_FSIZE):trials"] += 1
    code, _, err = launcher.run(["sweep", str(spec), "--quiet"], d, fsize=64)
    lines = one_line_error(code, err)
    assert any("is full" in x for x in lines), err
    assert tmp_files(store) == []  # the partial part file is removed
    assert {p.name: p.read_bytes() for p in store.glob("part-*.jsonl")} == before  # what was stored is kept
    code, _, err = launcher.run(["sweep", str(spec), "--quiet"], d)  # space again: the rerun completes
    assert code == 0, err
    compare_rows(store, reference["rows"], "disk full (RLIMIT_FSIZE)")
    TALLY["disk full (RLIMIT_FSIZE):survived"] += 1


@pytest.fixture
def tiny_tmpfs(tmp_path):
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or r.returncode}); the RLIMIT_FSIZE test covers it")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.e2e
def test_disk_full_midway_through_a_sweep_tmpfs(launcher, reference, fault_root, tiny_tmpfs):
    """A 12 KiB tmpfs holds the first parts of the sweep, then ENOSPC; after growing it the rerun completes."""
    d = fault_root / "full-tmpfs"
    d.mkdir()
    store = tiny_tmpfs / "store"
    spec = write_sweep_spec(d, reference["run"], store)
    TALLY["disk full (12 KiB tmpfs):trials"] += 1
    code, _, err = launcher.run(["sweep", str(spec), "--quiet"], d)
    lines = one_line_error(code, err)
    assert any("is full" in x and "No space left" in x for x in lines), err
    assert tmp_files(store) == []
    stored = store_lines(store)
    assert 0 < len(stored) < len(reference["rows"]), len(stored)  # full midway: some parts made it
    subprocess.run(["mount", "-o", "remount,size=4m", str(tiny_tmpfs)], check=True)
    code, _, err = launcher.run(["sweep", str(spec), "--quiet"], d)
    assert code == 0, err
    compare_rows(store, reference["rows"], "disk full (12 KiB tmpfs)")
    TALLY["disk full (12 KiB tmpfs):survived"] += 1


APPEND = """
import sys
from quantdyn.errors import QuantdynError
from quantdyn.results.store import ResultStore
try:
    ResultStore(sys.argv[1]).append([{"key": "big", "blob": "x" * 100_000}])
except QuantdynError as e:
    print(e, file=sys.stderr)
    sys.exit(2)
"""


def _limit(nbytes):
    def set_limit():
        import resource

        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))
    return set_limit


def test_disk_full_during_a_store_append(tmp_path):
    from quantdyn.results.store import ResultStore

    st = ResultStore(tmp_path / "st")
    st.append([{"key": f"k{i}", "v": i} for i in range(50)])
    before = {p.name: p.read_bytes() for p in st.parts()}
    TALLY["disk full, store append:trials"] += 1
    r = subprocess.run([sys.executable, "-c", APPEND, str(st.root)], capture_output=True, text=True,
                       preexec_fn=_limit(4096), timeout=120)
    assert r.returncode == 2 and "is full" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert tmp_files(st.root) == [] and {p.name: p.read_bytes() for p in st.parts()} == before
    assert len(ResultStore(st.root).rows()) == 50
    TALLY["disk full, store append:rows_lost"] += 50 - len(ResultStore(st.root).rows())
    TALLY["disk full, store append:survived"] += 1


def test_disk_full_writing_results_out_is_one_line(tmp_path):
    from quantdyn.results.store import ResultStore

    st = ResultStore(tmp_path / "st")
    st.append([{"key": f"k{i}", "run": "r", "blob": "x" * 200} for i in range(50)])
    r = subprocess.run([sys.executable, "-m", "quantdyn", "results", "--store", str(st.root), "--out",
                        str(tmp_path / "rows.csv")], capture_output=True, text=True, preexec_fn=_limit(2048),
                       timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("error: disk full") and len(r.stderr.splitlines()) == 1, r.stderr
    assert not (tmp_path / "rows.csv").exists() and not list(tmp_path.glob(".rows.csv.*"))


def _truncate(path: Path, keep: float) -> None:
    os.truncate(path, int(path.stat().st_size * keep))


@pytest.mark.e2e
@pytest.mark.parametrize("keep", [0.5, 0.0001])
def test_truncated_safetensors_are_named_in_one_line(launcher, reference, fault_root, keep):
    d = fault_root / f"truncated-{keep}"
    d.mkdir()
    ck = d / "ck"
    shutil.copytree(sorted((reference["run"] / "checkpoints").glob("step-*"))[-1], ck)
    _truncate(ck / "model.safetensors", keep)
    TALLY["truncated safetensors:trials"] += 3
    named = str(ck / "model.safetensors")
    code, _, err = launcher.run(["quantize", str(ck), "--method", "rtn", "--calib-samples", "2"], d)
    assert named in one_line_error(code, err)[0] and len(err.strip().splitlines()) == 1, err
    TALLY["truncated safetensors:survived"] += 1
    code, _, err = launcher.run(["sweep", "--checkpoint", str(ck), "--store", str(d / "st"), "--quiet"], d)
    assert named in one_line_error(code, err)[0], err  # one line per skipped checkpoint, then the count
    assert not list((d / "st").glob("part-*.jsonl"))
    TALLY["truncated safetensors:survived"] += 1
    run = d / "run"
    shutil.copytree(reference["parent"], run)
    last = sorted((run / "checkpoints").glob("step-*"))[-1]
    _truncate(last / "model.safetensors", keep)
    code, _, err = launcher.run(["train", "--resume", str(run), "--quiet"], d)
    lines = one_line_error(code, err)
    assert len(lines) == 1 and str(last / "model.safetensors") in lines[0], err
    TALLY["truncated safetensors:survived"] += 1
