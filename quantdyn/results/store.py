"""The results store: a directory of JSONL part files, queried with DuckDB.

Layout (this module is its only owner)::

    STORE/
      part-<UTC time>-<pid>-<id>.jsonl   one or more result rows, one JSON object per line
      .lock                              advisory lock file, held by writers (fcntl.flock)
      quarantine/<part name>             lines `quantdyn results --check` moved out of that part

Every measurement is one row with provenance and an idempotency ``key`` (a non-empty string).

Writing. :meth:`ResultStore.append` writes one batch of rows as one new part file: it is written under a
temporary name and renamed into place, so a crash never leaves a partial batch under a part name, and a
full disk ends in one :class:`QuantdynError` with the temporary file removed and every earlier part kept.
Writers take an exclusive lock on ``STORE/.lock`` and, under it, drop rows whose key is already stored,
so two workers (``--shard``, torchrun ranks, SLURM array tasks, or two sweeps of one shard by mistake)
never store a key twice.  Files are created with the permissions the umask allows (quantdyn.files).

Reading. :meth:`rows`, :meth:`keys` and :meth:`query` read the same rows and keep the same one per key:
**the first written**, i.e. part files in name order (names begin with the UTC write time) and lines in
file order.  Lines that are not result rows -- torn or cut off by a crash or a full disk, garbage, not
UTF-8, JSON that is not an object, an object without a ``key`` -- are skipped and counted
(:attr:`ResultStore.skipped`), and one warning names the store, the first such file and line, and the fix:
``quantdyn results --check`` (:meth:`ResultStore.check` with ``repair=True``) moves them into
``STORE/quarantine/``.
"""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import tempfile
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterable, Iterator

from quantdyn.errors import QuantdynError
from quantdyn.files import write_text_atomic

try:  # advisory locks; absent on Windows, where concurrent writers may store a key twice (readers dedupe)
    import fcntl
except ImportError:  # pragma: no cover - not on Linux/macOS
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

DEFAULT_STORE = "results"
QUARANTINE = "quarantine"
_LOCK = ".lock"
_DISK_FULL = {errno.ENOSPC, errno.EFBIG, getattr(errno, "EDQUOT", errno.ENOSPC)}


class StoreWriteError(QuantdynError):
    """The store cannot be written (full disk, no permission): every later write would fail the same way,
    so a caller looping over work should stop rather than go on to the next item."""


@dataclass(frozen=True)
class BadLine:
    """A line of a part file that is not a result row."""

    path: Path
    """The part file."""
    line: int
    """1-based line number."""
    reason: str
    """What is wrong with it, in words."""

    def __str__(self) -> str:
        return f"{self.path} line {self.line}: {self.reason}"


@dataclass
class StoreCheck:
    """What :meth:`ResultStore.check` found (and, with repair, did)."""

    parts: int = 0
    """Part files read."""
    rows: int = 0
    """Distinct keys (the rows readers return)."""
    duplicates: int = 0
    """Stored rows whose key an earlier row already has (readers skip them; not an error)."""
    bad: list[BadLine] = field(default_factory=list)
    """Lines that are not result rows."""
    quarantined: list[Path] = field(default_factory=list)
    """Quarantine files the bad lines were moved to (repair only)."""
    temporaries: list[Path] = field(default_factory=list)
    """Leftover temporary part files of writers that died (removed on repair)."""

    def summary(self, root: Path, repair: bool) -> str:
        """One line for the user."""
        s = f"results store '{root}': {self.parts} part files, {self.rows} rows"
        if self.duplicates:
            s += f" ({self.duplicates} duplicate rows, ignored by readers)"
        if self.bad:
            if repair:
                s += f"; moved {len(self.bad)} unreadable lines to {root / QUARANTINE}"
            else:
                s += f"; {len(self.bad)} unreadable lines (first: {self.bad[0]})"
        if self.temporaries:
            verb = "removed" if repair else "found"
            s += f"; {verb} {len(self.temporaries)} leftover temporary files"
        if not self.bad and not self.temporaries:
            s += "; all lines readable"
        return s


# ------------------------------------------------------------------ parsing part files


def _parse_line(raw: bytes, torn: bool) -> dict | str:
    """A result row, or the reason the line is not one."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return "not UTF-8 text"
    try:
        row = json.loads(text)
    except ValueError:
        return "cut off (no end of line: a write was interrupted)" if torn else "not valid JSON (torn or garbage)"
    if not isinstance(row, dict):
        return f"JSON {type(row).__name__}, not an object"
    key = row.get("key")
    if not isinstance(key, str) or not key:
        return "a row without a 'key'"
    return row


def _read_part(path: Path) -> tuple[list[tuple[int, dict]], list[BadLine]]:
    """(line number, row) for every readable row of one part file, and its bad lines."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:  # removed between listing and reading (check() emptied it)
        return [], []
    except OSError as e:
        raise QuantdynError(f"cannot read results part '{path}': {e.strerror}; check its permissions") from None
    lines = data.split(b"\n")
    torn_last = not data.endswith(b"\n")
    rows, bad = [], []
    for i, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        got = _parse_line(raw, torn=torn_last and i == len(lines))
        if isinstance(got, str):
            bad.append(BadLine(path, i, got))
        else:
            rows.append((i, got))
    return rows, bad


@dataclass(frozen=True)
class _PartSummary:
    signature: tuple
    keys: tuple[str, ...]
    bad: tuple[BadLine, ...]


# Part files never change after the rename (check() replaces one by a new file, with a new signature), so
# their keys and bad lines are cached per process: a writer re-reads only the parts added since its last look.
_SUMMARIES: dict[str, _PartSummary] = {}
_WARNED: set[tuple[str, int]] = set()
_UNLOCKED: set[str] = set()


def _signature(path: Path) -> tuple | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _summarise(path: Path, rows: list[tuple[int, dict]], bad: list[BadLine], sig: tuple | None) -> _PartSummary:
    s = _PartSummary(sig or (), tuple(r["key"] for _, r in rows), tuple(bad))
    if sig is not None:
        _SUMMARIES[str(path)] = s
    return s


def _part_summary(path: Path) -> _PartSummary:
    sig = _signature(path)
    cached = _SUMMARIES.get(str(path))
    if cached is not None and sig is not None and cached.signature == sig:
        return cached
    rows, bad = _read_part(path)
    return _summarise(path, rows, bad, sig)


# ------------------------------------------------------------------ the store


class ResultStore:
    """A results store directory (see the module docstring for layout, writing and reading rules)."""

    def __init__(self, root: str | Path = DEFAULT_STORE, create: bool = True):
        self.root = Path(root)
        self.skipped: list[BadLine] = []
        """Lines the last read skipped because they are not result rows."""
        if self.root.exists() and not self.root.is_dir():
            raise QuantdynError(f"results store '{self.root}' is a file, not a directory; pass a directory with --store")
        if create:  # checked now, created at the first write: a command refused later leaves nothing behind
            if not self.root.is_dir():
                ancestor = next((a for a in self.root.absolute().parents if a.exists()), None)
                if ancestor is None or not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
                    raise QuantdynError(f"cannot create results store '{self.root}': '{ancestor}' is not a writable "
                                        "directory; pass a writable directory with --store")
        elif not self.root.is_dir():
            raise QuantdynError(
                f"results store '{self.root}' does not exist; run `make demo` or `quantdyn sweep` first, or pass --store"
            )

    # ------------------------------------------------------------- writing
    def append(self, rows: Iterable[dict], *, skip_stored: bool = True) -> Path | None:
        """Store ``rows`` as one new part file, atomically; return its path (None if nothing was written).

        Under the store's lock, rows whose key is already stored (or repeated earlier in ``rows``) are
        dropped unless ``skip_stored=False``, which writes every row as given (e.g. to add a field to a
        stored row; readers keep the first row of a key).  Rows without a string ``key`` are refused
        before anything is written.  A full disk raises QuantdynError, leaving no partial part file and
        every part stored before intact."""
        return self._write(rows, skip_stored)[0]

    def append_new(self, rows: Iterable[dict]) -> list[dict]:
        """Store the rows whose key is not stored yet (checked under the lock); return the rows written."""
        return self._write(rows, True)[1]

    def _write(self, rows: Iterable[dict], skip_stored: bool) -> tuple[Path | None, list[dict]]:
        rows = list(rows)
        for n, r in enumerate(rows):
            if not isinstance(r, dict):
                raise QuantdynError(f"result row {n} is a {type(r).__name__}, not a mapping; nothing was stored")
            key = r.get("key")
            if not isinstance(key, str) or not key:
                raise QuantdynError(
                    f"result row {n} has no 'key' (got {key!r}); every row needs a non-empty string key so reruns "
                    "can skip it; nothing was stored"
                )
        if not rows:
            return None, []
        with self._lock() as locked:
            if locked:
                self._remove_temporaries()
            if skip_stored:
                stored = self._stored_keys()
                fresh = []
                for r in rows:
                    if r["key"] not in stored:
                        stored.add(r["key"])
                        fresh.append(r)
                rows = fresh
            if not rows:
                return None, []
            text = "".join(json.dumps(r, default=str) + "\n" for r in rows)
            stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%f")
            path = self.root / f"part-{stamp}Z-{os.getpid()}-{uuid.uuid4().hex[:8]}.jsonl"
            try:
                write_text_atomic(path, text)  # removes its temporary file if the write fails
            except OSError as e:
                if e.errno in _DISK_FULL:
                    raise StoreWriteError(
                        f"results store '{self.root}' is full ({e.strerror}) while writing {len(rows)} rows; free "
                        "space and rerun the same command (rows stored before are kept, these were not written)"
                    ) from None
                raise StoreWriteError(f"cannot write to results store '{self.root}': {e.strerror}; "
                                      "pass a writable directory with --store") from None
            _summarise(path, [(0, r) for r in rows], [], _signature(path))
            return path, rows

    @contextlib.contextmanager
    def _lock(self) -> Iterator[bool]:
        """Exclusive advisory lock on STORE/.lock, released by the kernel if the process dies.

        Yields whether the lock is held: without fcntl (Windows) or on a file system that refuses
        flock (Lustre mounted without -o flock), writers go on unlocked; two of them may then store a
        key twice (readers keep the first), and leftover temporary files are left to --check."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.root / _LOCK, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as e:
            raise StoreWriteError(f"cannot write to results store '{self.root}': {e.strerror}; "
                                "pass a writable directory with --store") from None
        try:
            held = False
            if fcntl is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX)
                    held = True
                except OSError as e:
                    if str(self.root) not in _UNLOCKED:
                        _UNLOCKED.add(str(self.root))
                        log.warning("results store '%s': cannot lock %s (%s); writing without the lock",
                                    self.root, _LOCK, e.strerror)
            yield held
        finally:
            os.close(fd)

    def _temporaries(self) -> list[Path]:
        # '.part-*' from write_text_atomic; '.tmp-*.jsonl' from quantdyn before the store lock existed
        return sorted([*self.root.glob(".part-*.jsonl.*"), *self.root.glob(".tmp-*.jsonl")])

    def _remove_temporaries(self) -> list[Path]:
        """Remove temporary part files of writers that died; only call under the lock (writers write
        their temporary file while holding it, so any that exists now is orphaned)."""
        found = self._temporaries()
        for p in found:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
        return found

    def _stored_keys(self) -> set[str]:
        keys: set[str] = set()
        for p in self.parts():
            keys.update(_part_summary(p).keys)
        return keys

    # ------------------------------------------------------------- reading
    def parts(self) -> list[Path]:
        """The part files, in write order."""
        return sorted(p for p in self.root.glob("part-*.jsonl") if p.is_file())

    def _raw(self) -> Iterator[dict]:
        """Every readable row in write order (duplicates included); bad lines go to :attr:`skipped`."""
        skipped: list[BadLine] = []
        self.skipped = skipped
        try:
            for p in self.parts():
                sig = _signature(p)
                rows, bad = _read_part(p)
                _summarise(p, rows, bad, sig)
                skipped.extend(bad)
                for _, r in rows:
                    yield r
        finally:
            self._warn(skipped)

    def _warn(self, bad: list[BadLine]) -> None:
        """One warning per read that meets bad lines not warned about before in this process."""
        new = [b for b in bad if (str(b.path), b.line) not in _WARNED]
        if not new:
            return
        _WARNED.update((str(b.path), b.line) for b in bad)
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        log.warning("results store '%s': skipped %d unreadable line%s (%s%s); `quantdyn results --check --store %s` "
                    "moves them to %s", self.root, len(bad), "" if len(bad) == 1 else "s", bad[0], more, self.root,
                    self.root / QUARANTINE)

    def rows(self) -> list[dict]:
        """All rows, the first written of each key, in write order."""
        seen, out = set(), []
        for r in self._raw():
            if r["key"] in seen:
                continue
            seen.add(r["key"])
            out.append(r)
        return out

    def keys(self, field: str = "key") -> set[str]:
        """The values of ``field`` over every stored row that has it (default: the idempotency keys)."""
        if field == "key":
            summaries = [_part_summary(p) for p in self.parts()]
            self.skipped = [b for s in summaries for b in s.bad]
            self._warn(self.skipped)
            return {k for s in summaries for k in s.keys}
        return {r[field] for r in self._raw() if r.get(field) is not None}

    def query(self, where: str | None = None, columns: str = "*", order: str | None = None):
        """DuckDB query over the store's rows (first written of each key); returns (column names, tuples).

        Bad lines are left out as :meth:`rows` leaves them out: parts holding any are read through cleaned
        temporary copies, and the number of rows DuckDB read is checked against the rows the store holds."""
        import duckdb  # function-local: a second-long import, needed only by SQL queries

        parts = self.parts()
        summaries = [_part_summary(p) for p in parts]
        self.skipped = [b for s in summaries for b in s.bad]
        self._warn(self.skipped)
        expected = sum(len(s.keys) for s in summaries)
        if not expected:
            return [], []
        with tempfile.TemporaryDirectory(prefix="quantdyn-query-") as tmp:
            files = []
            for p, s in zip(parts, summaries):
                if not s.keys:
                    continue
                if not s.bad:
                    files.append(p)
                    continue
                clean = Path(tmp) / p.name  # same name: keeps the part's place in write order
                rows, _ = _read_part(p)
                clean.write_text("".join(json.dumps(r, default=str) + "\n" for _, r in rows))
                files.append(clean)
            listed = ", ".join("'" + str(f).replace("'", "''") + "'" for f in files)
            con = duckdb.connect()
            try:
                try:
                    con.execute(
                        f"CREATE TEMP TABLE raw AS SELECT * FROM read_json_auto([{listed}], union_by_name=true, "
                        "format='newline_delimited', maximum_object_size=67108864, filename='__part_file')"
                    ).fetchall()
                    got = con.execute("SELECT count(*) FROM raw").fetchall()[0][0]
                except duckdb.Error as e:
                    first = str(e).splitlines()[0]
                    raise QuantdynError(f"results store '{self.root}' cannot be read by DuckDB: {first}; run "
                                        f"`quantdyn results --check --store {self.root}`") from None
                if got != expected:
                    raise QuantdynError(f"results store '{self.root}': DuckDB read {got} rows but the part files hold "
                                        f"{expected}; run `quantdyn results --check --store {self.root}`")
                sql = (f"SELECT {columns} FROM (SELECT * EXCLUDE (__part_file) FROM raw QUALIFY row_number() OVER "
                       "(PARTITION BY key ORDER BY parse_filename(__part_file), rowid) = 1)")
                if where:
                    sql += f" WHERE {where}"
                if order:
                    sql += f" ORDER BY {order}"
                try:
                    rel = con.sql(sql)
                    return rel.columns, rel.fetchall()
                except duckdb.Error as e:
                    first = str(e).splitlines()[0]
                    raise QuantdynError(f"query failed: {first} — check the --where expression and column names") from None
            finally:
                con.close()

    # ------------------------------------------------------------- checking
    def check(self, repair: bool = False) -> StoreCheck:
        """Read every part file; with ``repair``, move unreadable lines to STORE/quarantine/<part name>
        (the part is rewritten without them, under the same name) and remove leftover temporary files.

        The quarantine file is written and synced before the part is replaced, so a crash in between
        leaves the lines in both places, never in neither."""
        out = StoreCheck()
        with self._lock() if repair else contextlib.nullcontext():
            out.temporaries = self._remove_temporaries() if repair else self._temporaries()
            seen: set[str] = set()
            for p in self.parts():
                rows, bad = _read_part(p)
                out.parts += 1
                for _, r in rows:
                    if r["key"] in seen:
                        out.duplicates += 1
                    seen.add(r["key"])
                out.bad.extend(bad)
                if repair and bad:
                    out.quarantined.append(self._quarantine(p, rows, bad))
            out.rows = len(seen)
        if repair:
            self.skipped = []
        return out

    def _quarantine(self, part: Path, rows: list[tuple[int, dict]], bad: list[BadLine]) -> Path:
        lines = part.read_bytes().split(b"\n")
        qdir = self.root / QUARANTINE
        qdir.mkdir(exist_ok=True)
        qfile = qdir / part.name
        with open(qfile, "ab") as f:
            for b in bad:
                f.write(lines[b.line - 1] + b"\n")
            f.flush()
            os.fsync(f.fileno())
        if rows:
            keep = b"".join(lines[i - 1] + b"\n" for i, _ in rows).decode("utf-8")
            write_text_atomic(part, keep)
        else:
            part.unlink()
        _SUMMARIES.pop(str(part), None)
        return qfile
