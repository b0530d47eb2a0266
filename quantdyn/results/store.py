"""The results store: a directory of JSONL part files, queried with DuckDB.

Every measurement is one row with provenance.  Rows are appended by writing
a new part file to a temporary name and renaming it into place, so a crash
never leaves a partial row, and workers (``--shard i/n``, torchrun ranks,
SLURM array tasks) writing to the same directory never conflict.  Each row
has an idempotency ``key``; writers skip keys that are already present, and
readers keep the first row of any duplicated key.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import Iterable

from quantdyn.errors import QuantdynError

DEFAULT_STORE = "results"


class ResultStore:
    def __init__(self, root: str | Path = DEFAULT_STORE, create: bool = True):
        self.root = Path(root)
        if create:
            self.root.mkdir(parents=True, exist_ok=True)
        elif not self.root.is_dir():
            raise QuantdynError(
                f"results store '{self.root}' does not exist; run `make demo` or `quantdyn sweep` first, or pass --store"
            )

    # ------------------------------------------------------------- writing
    def append(self, rows: Iterable[dict]) -> Path | None:
        rows = list(rows)
        if not rows:
            return None
        for r in rows:
            if "key" not in r:
                raise ValueError("every result row needs a 'key'")
        name = f"part-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-{uuid.uuid4().hex[:8]}.jsonl"
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".jsonl", dir=self.root)
        with os.fdopen(fd, "w") as f:
            for r in rows:
                f.write(json.dumps(r, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())
        final = self.root / name
        os.replace(tmp, final)
        return final

    # ------------------------------------------------------------- reading
    def parts(self) -> list[Path]:
        return sorted(p for p in self.root.glob("part-*.jsonl"))

    def _raw(self):
        for p in self.parts():
            for line in p.read_text().splitlines():
                if line.strip():
                    yield json.loads(line)

    def rows(self) -> list[dict]:
        """All rows, first occurrence of each key, in write order."""
        seen, out = set(), []
        for r in self._raw():
            if r["key"] in seen:
                continue
            seen.add(r["key"])
            out.append(r)
        return out

    def keys(self, field: str = "key") -> set[str]:
        """The values of ``field`` over every stored row that has it (default: the idempotency keys)."""
        return {r[field] for r in self._raw() if r.get(field) is not None}

    def query(self, where: str | None = None, columns: str = "*", order: str | None = None):
        """DuckDB query over the store; returns (column names, list of tuples)."""
        import duckdb

        if not self.parts():
            return [], []
        glob = str(self.root / "part-*.jsonl")
        sql = (
            f"SELECT {columns} FROM (SELECT * FROM read_json_auto('{glob}', union_by_name=true, "
            "format='newline_delimited', maximum_object_size=67108864) "
            "QUALIFY row_number() OVER (PARTITION BY key ORDER BY time) = 1)"
        )
        if where:
            sql += f" WHERE {where}"
        if order:
            sql += f" ORDER BY {order}"
        try:
            rel = duckdb.sql(sql)
            return rel.columns, rel.fetchall()
        except duckdb.Error as e:
            first = str(e).splitlines()[0]
            raise QuantdynError(f"query failed: {first} — check the --where expression and column names") from None
