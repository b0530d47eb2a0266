"""Sharded safetensors files written one shard at a time (the one shard writer of quantized checkpoints).

Tensors are buffered until the next one would take the buffer past ``max_bytes``; the buffer is
then written under a temporary name. :meth:`Shards.finish` names the files the way transformers
does: ``STEM.safetensors`` when one file holds everything, else ``STEM-0000k-of-0000n.safetensors``
plus ``STEM.safetensors.index.json`` (``{"metadata": {"total_size": bytes}, "weight_map": {...}}``).
Both writers of quantized checkpoints use it: exports (``model``) and quantdyn's own quantized
checkpoints (``model`` and ``quant_codes``).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from quantdyn.errors import QuantdynError

DEFAULT_SHARD_BYTES = 2 * 1024**3
"""Largest shard (bytes of tensor data) held in memory before it is written."""


def cpu_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise QuantdynError(f"tensor '{name}' is a {type(t).__name__}, not a torch.Tensor")
    t = t.detach().to("cpu").contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():  # a view: safetensors wants its own storage
        t = t.clone()
    return t


class Shards:
    """One sharded safetensors checkpoint ``STEM*.safetensors`` inside ``directory`` (see module docstring)."""

    def __init__(self, directory: Path, stem: str, max_bytes: int = DEFAULT_SHARD_BYTES,
                 metadata: dict[str, str] | None = None):
        if max_bytes < 1:
            raise QuantdynError(f"max_shard_bytes={max_bytes} must be >= 1")
        self.directory, self.stem, self.max_bytes = Path(directory), stem, int(max_bytes)
        self.metadata = dict(metadata or {"format": "pt"})
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffer_bytes = 0
        self._files: list[tuple[Path, list[str]]] = []
        self.names: set[str] = set()
        """Every tensor name added so far."""
        self.total_bytes = 0
        """Bytes of tensor data added so far."""

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Add one tensor (copied to contiguous CPU memory); a name may be added once."""
        if name in self.names:
            raise QuantdynError(f"tensor '{name}' was added to the checkpoint twice")
        t = cpu_tensor(name, tensor)
        nbytes = t.numel() * t.element_size()
        if self._buffer and self._buffer_bytes + nbytes > self.max_bytes:
            self._flush()
        self.names.add(name)
        self._buffer[name] = t
        self._buffer_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        path = self.directory / f".{self.stem}-part{len(self._files):05d}.safetensors"
        save_file(self._buffer, str(path), metadata=self.metadata)
        self._files.append((path, list(self._buffer)))
        self._buffer, self._buffer_bytes = {}, 0

    def finish(self) -> dict[str, str]:
        """Write the last shard, give every file its final name (+ the index when sharded); return the weight map."""
        if self._buffer or not self._files:
            self._flush()
        n = len(self._files)
        weight_map: dict[str, str] = {}
        for k, (path, names) in enumerate(self._files, 1):
            final = f"{self.stem}.safetensors" if n == 1 else f"{self.stem}-{k:05d}-of-{n:05d}.safetensors"
            path.rename(self.directory / final)
            weight_map.update(dict.fromkeys(names, final))
        if n > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
            (self.directory / f"{self.stem}.safetensors.index.json").write_text(json.dumps(index, indent=2))
        return weight_map

    def drop(self) -> None:
        """Forget the buffered tensors (the directory they would go to is being discarded)."""
        self._buffer, self._buffer_bytes = {}, 0
