"""Activation streams: the hidden states of one token set flowing through the blocks.

A block walk keeps, per variant (full precision, each quantizer) and per token set
(calibration, evaluation), the current hidden states as a list of batches. A
:class:`Stream` is that list; where its batches live is decided once per walk by a
:class:`StreamStore` from a memory budget: on the compute device, in host RAM, or — when
they do not fit, or on CPU when they are large (:data:`AUTO_SPILL_BYTES`) and a real disk is
there to take them — spilled to files in a temporary directory that is removed afterwards
(also after Ctrl-C or an error: the store is a context manager).

Entries are replaced, never modified in place, so two streams may share their batches
(every variant starts from the same block-0 inputs) without copying them.
"""
from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import torch

from quantdyn.errors import QuantdynError


class Stream:
    """A list of activation batches in memory (on one device) or spilled to disk."""

    def __init__(self, store: "StreamStore", name: str, where: str):
        self.store, self.name, self.where = store, name, where
        self._items: list = []

    def __len__(self) -> int:
        return len(self._items)

    def _path(self, i: int) -> Path:
        return self.store.spill_dir / f"{self.name}-{i:06d}.pt"

    def _put(self, i: int, t: torch.Tensor):
        if self.where == "disk":
            path = self._path(i)
            torch.save(t.detach().cpu(), path)
            return path
        return t.detach().to(self.store.device if self.where == "device" else "cpu")

    def append(self, t: torch.Tensor) -> None:
        self._items.append(None)
        self._items[-1] = self._put(len(self._items) - 1, t)

    def __getitem__(self, i: int) -> torch.Tensor:
        item = self._items[i]
        if isinstance(item, Path):
            return torch.load(item, map_location=self.store.device, weights_only=True)
        return item.to(self.store.device)

    def __setitem__(self, i: int, t: torch.Tensor) -> None:
        self._items[i] = self._put(i, t)

    def copy_from(self, other: "Stream") -> None:
        """Start as ``other``'s batches (shared in memory; copied on disk)."""
        self._items = []
        for i in range(len(other)):
            if self.where == other.where and self.where != "disk":
                self._items.append(other._items[i])
            else:
                self.append(other[i])

    def close(self) -> None:
        for item in self._items:
            if isinstance(item, Path):
                item.unlink(missing_ok=True)
        self._items = []


_LIBC = None


def trim_heap() -> None:
    """Give freed heap memory back to the OS (glibc ``malloc_trim``; a no-op elsewhere).

    A walk replaces every activation batch once per block; glibc serves such mid-sized tensors from its heap
    once its mmap threshold has grown, and keeps the freed pages, so resident memory creeps up to a multiple
    of the streams' size without this."""
    global _LIBC
    if _LIBC is None:
        try:
            import ctypes

            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


def _host_prefix() -> str:
    """Spill directories are named ``quantdyn-streams-HOST-PID-*``, so that a later walk can tell whose they are
    (the parent may be a filesystem that several nodes share); this is the part up to the pid."""
    host = "".join(c if c.isalnum() or c in "-." else "_" for c in socket.gethostname()) or "host"
    return f"quantdyn-streams-{host}-"


def _spill_prefix(pid: int) -> str:
    return f"{_host_prefix()}{pid}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


ORPHAN_AGE_S = 3600
"""A spill directory counts as orphaned only if nothing in it changed for this long: a walk rewrites its streams
every block, and the age check keeps a live walk safe where the pid test cannot see it (another PID namespace
with the same host name and a shared temporary directory)."""


def _last_change(d: Path) -> float:
    times = [d.stat().st_mtime]
    for f in d.iterdir():
        try:
            times.append(f.stat().st_mtime)
        except OSError:  # removed meanwhile
            pass
    return max(times)


def remove_orphaned_spills(parent: Path, min_age_s: float = ORPHAN_AGE_S) -> list[Path]:
    """Remove the spill directories in ``parent`` left by processes of this host that no longer run (a walk
    killed with SIGKILL, e.g. by the OOM killer, cannot remove its own) and unchanged for ``min_age_s``;
    returns them. Directories of other hosts, of live processes, recently changed ones and those of older,
    unnamed layouts are left alone."""
    host_prefix = _host_prefix()
    now = time.time()
    removed = []
    try:
        entries = list(parent.iterdir())
    except OSError:
        return removed
    for d in entries:
        if not d.name.startswith(host_prefix) or not d.is_dir():
            continue
        pid_part = d.name[len(host_prefix):].split("-", 1)[0]
        if not pid_part.isdigit() or int(pid_part) == os.getpid() or _pid_alive(int(pid_part)):
            continue
        try:
            if now - _last_change(d) < min_age_s:
                continue
        except OSError:
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed


def available_host_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else a conservative 4 GiB."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 * 2**30


def parse_bytes(text: str | int | float | None) -> int:
    """'8GB', '512MiB', '2e9', 0 or '' or 'auto' -> bytes (0 = automatic)."""
    if text in (None, "", "auto", 0):
        return 0
    if isinstance(text, (int, float)):
        return int(text)
    s = str(text).strip().upper().replace(" ", "")
    units = {"TIB": 2**40, "GIB": 2**30, "MIB": 2**20, "KIB": 2**10, "TB": 10**12, "GB": 10**9, "MB": 10**6,
             "KB": 10**3, "T": 2**40, "G": 2**30, "M": 2**20, "K": 2**10, "B": 1}
    for u, f in units.items():
        if s.endswith(u):
            num = s[: -len(u)]
            break
    else:
        num, f = s, 1
    try:
        value = float(num) * f
    except ValueError:
        raise QuantdynError(f"memory size '{text}' is not a size; write e.g. 8GB, 512MiB or 2e9") from None
    if value <= 0:
        raise QuantdynError(f"memory size '{text}' must be positive")
    return int(value)


def fmt_bytes(n: float) -> str:
    for unit, f in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= f:
            return f"{n / f:.2f} {unit}"
    return f"{int(n)} B"


AUTO_SPILL_BYTES = 256 * 2**20
"""On CPU with no explicit budget, streams larger than this go to disk even when RAM is free: spilling cost no
measurable time on a local disk (BENCHMARKS.md, 410m shape: 355 s spilled vs 364 s in memory, 0.96 vs 1.63 GiB
peak), the spilled files stay in the page cache, which the kernel can drop under pressure, and below this size
the saving is small next to the process itself (~0.3 GiB)."""

RAM_FILESYSTEMS = ("tmpfs", "ramfs")


def _mount_type(path: Path) -> str:
    """Filesystem type of the mount holding ``path`` (Linux /proc/mounts; '' where unknown)."""
    try:
        target = os.path.realpath(path)
        best, kind = "", ""
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mount = parts[1].replace("\\040", " ")
                inside = target == mount or target.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, kind = mount, parts[2]
        return kind
    except OSError:
        return ""


def ram_backed(path: Path) -> bool:
    """True when ``path`` lives on a RAM filesystem (tmpfs, ramfs): spilling there saves no memory."""
    return _mount_type(path) in RAM_FILESYSTEMS


class StreamStore:
    """Decides where a walk's streams live and owns the spill directory (see module docstring).

    ``need`` is the total bytes of all streams; ``budget`` the bytes they may take in memory
    (0 = automatic). Computing on a GPU, streams go to the device if they fit its budget (half of the free
    GPU memory), else to host RAM (half of the free RAM), else to disk. On CPU with an explicit budget they
    stay in memory if they fit it, else go to disk; with the automatic budget they go to disk if they exceed
    half the free RAM, or exceed :data:`AUTO_SPILL_BYTES` while the spill directory is on a real disk (not
    tmpfs/ramfs, where spilling saves nothing).
    """

    def __init__(self, device: torch.device, need: int, budget: int = 0, spill_dir: str | None = None,
                 force: str | None = None):
        self.device = torch.device(device)
        self._tmp: Path | None = None
        self._parent = spill_dir
        self.need = need
        if force:
            self.where = force
        elif self.device.type == "cuda":
            free = torch.cuda.mem_get_info(self.device)[0]
            gpu_budget = budget or free // 2
            host_budget = budget or available_host_bytes() // 2
            self.where = "device" if need <= gpu_budget else ("host" if need <= host_budget else "disk")
        elif budget:
            self.where = "device" if need <= budget else "disk"
        elif need > available_host_bytes() // 2:
            self.where = "disk"
        else:
            big = need > AUTO_SPILL_BYTES
            self.where = "disk" if big and not ram_backed(self._spill_parent()) else "device"
        self._streams: list[Stream] = []

    def _spill_parent(self) -> Path:
        return Path(self._parent or tempfile.gettempdir())

    @property
    def spill_dir(self) -> Path:
        if self._tmp is None:
            parent = self._spill_parent()
            remove_orphaned_spills(parent)
            self._tmp = Path(tempfile.mkdtemp(prefix=f"{_spill_prefix(os.getpid())}-", dir=parent))
        return self._tmp

    def new(self, name: str) -> Stream:
        s = Stream(self, f"{name}-{len(self._streams)}", self.where)
        self._streams.append(s)
        return s

    def close(self) -> None:
        for s in self._streams:
            s.close()
        self._streams = []
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> "StreamStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def describe(self) -> str:
        where = {"device": f"in memory ({self.device})", "host": "in host RAM",
                 "disk": f"spilled to {self._spill_parent()}"}[self.where]
        return f"activation streams {fmt_bytes(self.need)} {where}"
