"""The results store: atomic appends under a lock, tolerant readers, one dedupe rule, quarantine."""
from __future__ import annotations

import json
import logging
import multiprocessing
import os
import stat

import pytest

from quantdyn.errors import QuantdynError
from quantdyn.results.store import QUARANTINE, ResultStore

BAD_LINES = [b"garbage that is not json", b"\xff\xfe{\"key\": \"u\"}", b"[1, 2, 3]", b'{"x": 1}', b'{"key": 7}']
TORN = b'{"key": "torn", "x": '


def _dirty_store(tmp_path):
    st = ResultStore(tmp_path / "st")
    st.append([{"key": "a", "x": 1}, {"key": "b", "x": 2}])
    p = st.append([{"key": "c", "x": 3}])
    with open(p, "ab") as f:
        f.write(b"\n".join(BAD_LINES) + b"\n" + TORN)  # ends without a newline: a write cut off
    return st, p


def test_rows_keys_and_query_agree(tmp_path):
    st = ResultStore(tmp_path / "st")
    st.append([{"key": "a", "x": 1, "time": "2026-01-02"}, {"key": "b", "x": 2}])
    # a later part re-stores key a (skip_stored=False writes it anyway) with an *earlier* time: the rule is
    # "first written wins", not "earliest time"
    st.append([{"key": "a", "x": 9, "time": "2000-01-01"}], skip_stored=False)
    assert len(st.parts()) == 2
    rows = st.rows()
    assert [(r["key"], r["x"]) for r in rows] == [("a", 1), ("b", 2)]
    cols, got = st.query(columns="key, x", order="key")
    assert got == [("a", 1), ("b", 2)]
    assert st.keys() == {"a", "b"}
    assert st.keys("x") == {1, 2, 9}  # keys(field) sees every stored row


def test_append_skips_stored_keys_and_repeats(tmp_path):
    st = ResultStore(tmp_path / "st")
    assert st.append([{"key": "a"}, {"key": "a", "v": 2}]) is not None
    assert st.append([{"key": "a"}]) is None  # nothing new: no empty part file
    assert [r["key"] for r in st.append_new([{"key": "a"}, {"key": "b"}])] == ["b"]
    lines = sum(len(p.read_text().splitlines()) for p in st.parts())
    assert lines == 2 and len(st.parts()) == 2
    assert st.append([]) is None


@pytest.mark.parametrize("row", [{"x": 1}, {"key": None}, {"key": ""}, {"key": 3}, ["key", "a"]])
def test_rows_without_a_key_are_refused_before_writing(tmp_path, row):
    st = ResultStore(tmp_path / "st")
    with pytest.raises(QuantdynError, match="key|mapping"):
        st.append([{"key": "ok"}, row])
    assert st.parts() == []


def test_readers_skip_bad_lines_and_warn_once(tmp_path, caplog):
    st, part = _dirty_store(tmp_path)
    with caplog.at_level(logging.WARNING, logger="quantdyn.results.store"):
        rows = st.rows()
        assert len(st.skipped) == len(BAD_LINES) + 1
        st.keys()
        st.query()
    assert [r["key"] for r in rows] == ["a", "b", "c"]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1  # one warning, not one per line or per read
    msg = warnings[0].getMessage()
    assert f"{part} line 2" in msg and "6 unreadable lines" in msg and "--check" in msg
    reasons = [b.reason for b in st.skipped]
    assert reasons[0].startswith("not valid JSON") and reasons[1] == "not UTF-8 text"
    assert "not an object" in reasons[2] and "without a 'key'" in reasons[3] and "without a 'key'" in reasons[4]
    assert reasons[5].startswith("cut off")
    assert st.keys() == {"a", "b", "c"}
    cols, got = st.query(columns="key, x", order="key")
    assert got == [("a", 1), ("b", 2), ("c", 3)]


def test_a_store_of_only_bad_lines_reads_empty(tmp_path):
    (tmp_path / "st").mkdir()
    (tmp_path / "st" / "part-x.jsonl").write_bytes(b"\x00\x00\x00\n")
    st = ResultStore(tmp_path / "st", create=False)
    assert st.rows() == [] and st.keys() == set() and st.query() == ([], [])
    assert len(st.skipped) == 1


def test_check_moves_bad_lines_to_quarantine(tmp_path):
    st, part = _dirty_store(tmp_path)
    before = st.rows()
    found = st.check()
    assert len(found.bad) == 6 and found.rows == 3 and part.read_bytes().count(b"garbage") == 1  # check alone changes nothing
    fixed = st.check(repair=True)
    assert len(fixed.bad) == 6 and fixed.quarantined == [tmp_path / "st" / QUARANTINE / part.name]
    q = fixed.quarantined[0].read_bytes()
    assert q == b"\n".join([*BAD_LINES, TORN]) + b"\n"  # the exact bytes, nothing lost
    assert st.rows() == before and st.skipped == []
    again = st.check()
    assert again.bad == [] and again.rows == 3 and "all lines readable" in again.summary(st.root, False)
    # a part holding only bad lines is removed once its lines are in quarantine
    lone = st.root / "part-99999999T000000-1-deadbeef.jsonl"
    lone.write_bytes(b"oops\n")
    st.check(repair=True)
    assert not lone.exists() and (st.root / QUARANTINE / lone.name).read_bytes() == b"oops\n"


def test_leftover_temporaries_are_removed_under_the_lock(tmp_path):
    st = ResultStore(tmp_path / "st")
    st.root.mkdir()
    orphan = st.root / ".part-20260101T000000.000000Z-1-abcdef01.jsonl.k2j3"
    orphan.write_text('{"key": "half')
    legacy = st.root / ".tmp-x.jsonl"
    legacy.write_text("")
    assert st.check().temporaries == [orphan, legacy]
    st.append([{"key": "a"}])  # a writer holds the lock while its temporary exists: any other one is orphaned
    assert not orphan.exists() and not legacy.exists()


def test_files_honour_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        st = ResultStore(tmp_path / "st")
        p = st.append([{"key": "a"}])
        assert stat.S_IMODE(p.stat().st_mode) == 0o644
        assert stat.S_IMODE((st.root / ".lock").stat().st_mode) == 0o644
        os.umask(0o077)
        p2 = st.append([{"key": "b"}])
        assert stat.S_IMODE(p2.stat().st_mode) == 0o600
    finally:
        os.umask(old)


def test_bad_store_paths_are_one_line(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(QuantdynError, match="is a file"):
        ResultStore(f)
    with pytest.raises(QuantdynError, match="does not exist"):
        ResultStore(tmp_path / "nope", create=False)
    with pytest.raises(QuantdynError, match="cannot create results store .*file' is not a writable directory"):
        ResultStore(f / "sub" / "store")


def test_a_store_is_created_at_its_first_write_not_before(tmp_path):
    """A command refused after opening its store (a bad checkpoint, bad data) must leave no empty store behind."""
    st = ResultStore(tmp_path / "a" / "store")
    assert not (tmp_path / "a").exists()
    assert st.rows() == [] and st.keys() == set()
    st.append([{"key": "k1"}])
    assert [r["key"] for r in ResultStore(tmp_path / "a" / "store", create=False).rows()] == ["k1"]


def _writer(root: str, worker: int, n: int) -> None:
    import time

    import quantdyn.results.store as store

    write = store.write_text_atomic

    def slow_write(path, text):  # widen the window between "which keys are stored?" and the rename
        time.sleep(0.002)
        write(path, text)

    store.write_text_atomic = slow_write
    st = ResultStore(root)
    for k in range(n):
        st.append([{"key": f"k{k}", "worker": worker}])


def test_concurrent_writers_store_each_key_once(tmp_path):
    root = str(tmp_path / "st")
    ResultStore(root)
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(root, w, 40)) for w in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    st = ResultStore(root)
    lines = [json.loads(x) for p in st.parts() for x in p.read_text().splitlines()]
    assert len(lines) == 40 and {r["key"] for r in lines} == {f"k{k}" for k in range(40)}


def test_disk_full_is_one_error_and_leaves_no_partial_part(tmp_path, monkeypatch):
    import errno

    import quantdyn.files as files

    st = ResultStore(tmp_path / "st")
    st.append([{"key": "a"}])
    real_fdopen = os.fdopen

    class Full:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.f.close()

        def write(self, text):
            self.f.write(text[: len(text) // 2])
            self.f.flush()
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files.os, "fdopen", lambda fd, mode="r": Full(real_fdopen(fd, mode)))
    with pytest.raises(QuantdynError, match="full.*rows stored before are kept"):
        st.append([{"key": "b", "blob": "x" * 1000}])
    monkeypatch.undo()
    assert sorted(p.name for p in st.root.iterdir() if p.name != ".lock") == [st.parts()[0].name]
    assert [r["key"] for r in st.rows()] == ["a"] and st.skipped == []
