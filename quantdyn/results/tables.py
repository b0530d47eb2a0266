"""Result rows as tables: a pandas DataFrame for notebooks, Parquet for everything else.

``load(store)`` returns one DataFrame row per stored row, with the store's own dedupe rule: the
first written row of each key (:meth:`ResultStore.rows`), in write order. Nested fields are
flattened into dotted columns: ``quant_config: {"bits": 3, "group_size": 128}`` becomes the
columns ``quant_config.bits`` and ``quant_config.group_size`` (``flatten=False`` keeps them as
dicts in one column). Lists (per-window deltas, histories) stay Python lists in one cell. A
field that only some rows have is missing (NaN/None) in the others.

Typical use::

    import quantdyn.results
    df = quantdyn.results.load("results")
    df[df.kind == "ptq"].pivot_table(index="step", columns="quantizer", values="delta_ce")

The store is plain JSONL, so DuckDB can read it without quantdyn (this keeps duplicates of a key;
quantdyn keeps the first written, which the QUALIFY clause reproduces)::

    SELECT * EXCLUDE (filename) FROM read_json_auto('results/part-*.jsonl', union_by_name=true,
        format='newline_delimited', filename=true)
    QUALIFY row_number() OVER (PARTITION BY key ORDER BY filename) = 1;
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from quantdyn.errors import QuantdynError
from quantdyn.files import current_umask
from quantdyn.results.store import ResultStore

if TYPE_CHECKING:
    import pandas as pd


def _store(store: ResultStore | str | Path) -> ResultStore:
    return store if isinstance(store, ResultStore) else ResultStore(store, create=False)


def _flat(row: dict, prefix: str = "") -> dict:
    out: dict = {}
    for k, v in row.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flat(v, name + "."))
        else:
            out[name] = v
    return out


def load(store: ResultStore | str | Path = "results", *, flatten: bool = True) -> "pd.DataFrame":
    """The store's rows as a DataFrame (one row per key, first written; nested dicts -> dotted columns).

    ``store``: a ResultStore or its directory. Unreadable lines are skipped with the store's warning.
    """
    import pandas as pd  # function-local: pandas is imported only by those who ask for tables

    rows = _store(store).rows()
    records = [_flat(r) for r in rows] if flatten else rows
    columns: dict[str, None] = {}
    for r in records:
        columns.update(dict.fromkeys(r))
    return pd.DataFrame.from_records(records, columns=list(columns))


def _parquet_safe(df: "pd.DataFrame") -> "pd.DataFrame":
    """Columns Arrow cannot type (ints mixed with strings, dicts of varying keys) become JSON text."""
    import pyarrow as pa  # function-local: as pandas

    df = df.copy()
    for col in df.columns:
        try:
            pa.array(df[col], from_pandas=True)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
            df[col] = [None if v is None else json.dumps(v, default=str) for v in df[col]]
    return df


def to_parquet(store: ResultStore | str | Path, path: str | Path, *, flatten: bool = True,
               keys: Iterable[str] | None = None) -> Path:
    """Write :func:`load`'s table (only the rows whose ``key`` is in ``keys``, when given) to a Parquet file
    atomically; return its path.

    A column whose values Arrow cannot hold in one type (e.g. a field that is a number in some rows
    and text in others) is written as JSON text, so no row is dropped."""
    path = Path(path)
    if path.is_dir():
        raise QuantdynError(f"'{path}' is a directory; pass a file name for the Parquet table")
    df = load(store, flatten=flatten)
    if keys is not None:
        df = df[df["key"].isin(set(keys))] if "key" in df.columns else df.iloc[0:0]
    df = _parquet_safe(df.reset_index(drop=True))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        df.to_parquet(tmp, index=False)
        os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise QuantdynError(f"cannot write '{path}': {e.strerror}; pass a writable path") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
