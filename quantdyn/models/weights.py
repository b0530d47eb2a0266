"""Read a checkpoint's tensors lazily, one at a time, without loading the model.

A checkpoint reference is a local directory (``config.json`` plus ``model.safetensors``,
sharded ``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json``, or —
for old checkpoints — ``pytorch_model.bin`` files read with ``weights_only``), or a hub
model ``ID[@REVISION]`` resolved through ``huggingface_hub`` (downloaded once into its
cache; offline, the cache alone).

:class:`CheckpointWeights` indexes every tensor from the file headers, validates the
checkpoint before anything is computed (missing shards, truncated files, tensors whose
byte ranges run past the end of their file) and then reads one tensor at a time with
positioned reads into a fresh buffer: no file stays memory-mapped, so the process holds
only the tensors it asked for (one decoder block at a time in the streamed engine).

The safetensors format (8-byte little-endian header length, a JSON header of
``name -> {dtype, shape, data_offsets}`` relative to the end of the header, then the data)
is read here directly; writing goes through the ``safetensors`` package.
"""
from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from quantdyn.errors import QuantdynError

SAFE_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
if hasattr(torch, "float8_e4m3fn"):
    _DTYPES.update({"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2})

_MAX_HEADER = 100 * 2**20  # safetensors' own limit on the JSON header


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies: file, dtype, shape and absolute byte range (safetensors), or a
    key into a lazily loaded ``.bin`` state dict."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int = -1
    end: int = -1

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


def read_safetensors_header(path: Path) -> dict[str, TensorEntry]:
    """Index of the tensors of one safetensors file; a truncated or corrupt file is a one-line error."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise QuantdynError(f"'{path}' is truncated (no safetensors header); re-download or re-create it")
            (n,) = struct.unpack("<Q", raw)
            if n > _MAX_HEADER or 8 + n > size:
                raise QuantdynError(f"'{path}' is truncated or not a safetensors file (header of {n} bytes in a "
                                    f"{size}-byte file); re-download or re-create it")
            header = json.loads(f.read(n))
    except OSError as e:
        raise QuantdynError(f"cannot read '{path}': {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise QuantdynError(f"'{path}' has a corrupt safetensors header; re-download or re-create it") from None
    if not isinstance(header, dict):
        raise QuantdynError(f"'{path}' has a corrupt safetensors header; re-download or re-create it")
    base = 8 + n
    out: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _DTYPES[info["dtype"]]
            shape = tuple(int(s) for s in info["shape"])
            a, b = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise QuantdynError(f"'{path}': tensor '{name}' has an unreadable header entry "
                                f"(dtype {info.get('dtype') if isinstance(info, dict) else info!r}); "
                                "re-create the checkpoint") from None
        entry = TensorEntry(path, dtype, shape, base + a, base + b)
        if b < a or entry.end - entry.start != entry.nbytes:
            raise QuantdynError(f"'{path}': tensor '{name}' has a byte range that does not match its shape; "
                                "the file is corrupt — re-create it")
        if entry.end > size:
            raise QuantdynError(f"'{path}' is truncated: tensor '{name}' ends at byte {entry.end} but the file "
                                f"has {size}; re-download or re-create it")
        out[name] = entry
    return out


def _pread_tensor(e: TensorEntry) -> torch.Tensor:
    buf = bytearray(e.end - e.start)
    view = memoryview(buf)
    fd = os.open(e.file, os.O_RDONLY)
    try:
        got = 0
        while got < len(buf):
            k = os.preadv(fd, [view[got:]], e.start + got)
            if k <= 0:
                raise QuantdynError(f"'{e.file}' ended while reading a tensor; the file is truncated — re-create it")
            got += k
    finally:
        os.close(fd)
    if not buf:
        return torch.empty(e.shape, dtype=e.dtype)
    return torch.frombuffer(buf, dtype=e.dtype).reshape(e.shape)


class CheckpointWeights:
    """The tensors of one local checkpoint directory, read on demand (see module docstring)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.config = read_config(self.path)
        self._entries: dict[str, TensorEntry] = {}
        self._bin: dict[Path, dict] = {}
        self._index: dict[str, str] | None = None  # the shard index's weight_map, when there is one
        files = self._weight_files()
        for f in files:
            if f.suffix == ".safetensors":
                found = read_safetensors_header(f)
            else:
                found = {name: TensorEntry(f, t.dtype, tuple(t.shape)) for name, t in self._load_bin(f).items()
                         if isinstance(t, torch.Tensor)}
            for name, e in found.items():
                if name in self._entries:
                    raise QuantdynError(f"checkpoint '{self.path}': tensor '{name}' is in two files, "
                                        f"'{self._entries[name].file.name}' and '{f.name}'; keep it in one of them "
                                        "(and in the index) or re-create the checkpoint")
                self._entries[name] = e
        if not self._entries:
            raise QuantdynError(f"'{self.path}' holds no weight tensors; the checkpoint is incomplete — re-create it")
        if self._index is not None:
            self._check_index(self._index)

    # ------------------------------------------------------------------ files
    def _weight_files(self) -> list[Path]:
        p = self.path
        for index in (SAFE_INDEX, BIN_INDEX):
            if (p / index).is_file():
                try:
                    wmap = json.loads((p / index).read_text())["weight_map"]
                    names = sorted(set(wmap.values()))
                    if not all(isinstance(k, str) for k in wmap):
                        raise TypeError
                except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
                    raise QuantdynError(f"'{p / index}' is not a valid shard index; re-create the checkpoint") from None
                missing = [n for n in names if not (p / n).is_file()]
                if missing:
                    raise QuantdynError(f"checkpoint '{p}' is missing shard '{missing[0]}' named in {index}"
                                        f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; "
                                        "re-download or re-create it")
                seen: dict[tuple[int, int], str] = {}
                for n in names:  # two spellings of one file ('a', './a', a link to it) would read it twice
                    st = (p / n).stat()
                    other = seen.setdefault((st.st_dev, st.st_ino), n)
                    if other != n:
                        raise QuantdynError(f"'{p / index}' names the file '{other}' twice (also as '{n}'); "
                                            "list each shard once in the index")
                self._index = {k: os.path.normpath(v) for k, v in wmap.items()}
                return [p / n for n in names]
        single = sorted(p.glob("*.safetensors"))
        single = [f for f in single if f.name == "model.safetensors" or re.fullmatch(r"model-\d+-of-\d+\.safetensors", f.name)]
        if single:
            shards = [f for f in single if f.name != "model.safetensors"]
            if shards:  # shards without an index: all of them must be there
                total = int(re.fullmatch(r"model-\d+-of-(\d+)\.safetensors", shards[0].name).group(1))
                if len(shards) != total:
                    raise QuantdynError(f"checkpoint '{p}' has {len(shards)} of {total} safetensors shards and no "
                                        f"{SAFE_INDEX}; re-download or re-create it")
            return single
        if (p / "pytorch_model.bin").is_file():
            return [p / "pytorch_model.bin"]
        raise QuantdynError(f"'{p}' has no model.safetensors (or shards with {SAFE_INDEX}); "
                            "the checkpoint is incomplete — re-export it")

    def _check_index(self, wmap: dict[str, str]) -> None:
        """Every tensor the index names lies in the file it names (a tensor found in another file, or in no
        file, is a broken index: one line naming both files)."""
        for name, fname in wmap.items():
            e = self._entries.get(name)
            if e is None:
                raise QuantdynError(f"checkpoint '{self.path}': the shard index places tensor '{name}' in '{fname}', "
                                    "which does not hold it; re-create the index or the checkpoint")
            if os.path.normpath(e.file.relative_to(self.path)) != fname:
                raise QuantdynError(f"checkpoint '{self.path}': tensor '{name}' is in '{e.file.name}' but the shard "
                                    f"index places it in '{fname}'; re-create the index or the checkpoint")

    def _load_bin(self, f: Path) -> dict:
        if f not in self._bin:
            try:  # weights_only: a pickle cannot run code; mmap: tensors are read when touched
                sd = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
            except Exception as e:  # noqa: BLE001 - any unpickling failure is the user's file
                first = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise QuantdynError(f"'{f}' cannot be loaded safely ({first[:160]}); convert the checkpoint to "
                                    "safetensors") from None
            if not isinstance(sd, dict):
                raise QuantdynError(f"'{f}' does not hold a state dict; convert the checkpoint to safetensors")
            self._bin[f] = sd
        return self._bin[f]

    # ---------------------------------------------------------------- tensors
    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def entry(self, name: str) -> TensorEntry:
        return self._entries[name]

    def get(self, name: str) -> torch.Tensor:
        """One tensor, in the checkpoint's dtype, on the CPU, in its own memory."""
        e = self._entries[name]
        if e.start < 0:
            return self._load_bin(e.file)[name].clone()
        return _pread_tensor(e)

    def file_bytes(self) -> int:
        """Total size of the weight files."""
        return sum(f.stat().st_size for f in {e.file for e in self._entries.values()})

    def weight_dtype(self) -> torch.dtype:
        """The dtype most of the floating-point parameters are stored in (the compute dtype by default)."""
        count: dict[torch.dtype, int] = {}
        for e in self._entries.values():
            if e.dtype.is_floating_point and len(e.shape) == 2:
                count[e.dtype] = count.get(e.dtype, 0) + e.nbytes
        return max(count, key=count.get) if count else torch.float32


def read_config(path: Path) -> dict:
    """config.json of a checkpoint directory, with one-line errors."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise QuantdynError(f"'{path}' has no config.json; pass a checkpoint directory (HF format)")
    try:
        d = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise QuantdynError(f"'{cfg_file}' is not valid JSON; the checkpoint is corrupt — re-export it") from None
    if not isinstance(d, dict) or "model_type" not in d:
        raise QuantdynError(f"'{cfg_file}' names no model_type; the checkpoint is corrupt — re-export it")
    return d
