"""Atomic writes of files and directories, with the permissions the user's umask asks for.

Everything quantdyn writes (checkpoints, token shards, manifests, result parts) goes through
these helpers: the data is written under a temporary name beside its final place and renamed
into place, so a crash never leaves a half-written file or directory under the final name.
``tempfile`` creates its files 0600 and directories 0700; they are opened up to what the
process umask allows (0644 / 0755 by default), so colleagues on a shared cluster can read a
run or a store.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import IO, Any, Iterator

from quantdyn.errors import QuantdynError


def current_umask() -> int:
    """The process umask (read without changing it for longer than one call)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _open_up(path: Path, directory: bool) -> None:
    mode = (0o777 if directory else 0o666) & ~current_umask()
    os.chmod(path, mode)


def _open_up_tree(root: Path) -> None:
    mask = current_umask()
    for dirpath, dirnames, filenames in os.walk(root):
        os.chmod(dirpath, 0o777 & ~mask)
        for f in filenames:
            p = os.path.join(dirpath, f)
            if not os.path.islink(p):
                os.chmod(p, 0o666 & ~mask)


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a temporary directory beside ``final``; rename it into place on success.

    An existing ``final`` is replaced only after the new one is complete; on an exception the
    temporary directory is removed and ``final`` is untouched.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        _open_up_tree(tmp)
        old = None
        if final.exists():
            old = final.parent / f".{final.name}.old-{os.getpid()}"
            os.rename(final, old)
        os.rename(tmp, final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def atomic_file(path: Path, mode: str = "w") -> Iterator[IO]:
    """Yield a file opened in ``mode`` under a temporary name beside ``path``; on success it is fsynced, given the
    permissions the umask allows and renamed to ``path``; on an exception it is removed and ``path`` is untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        _open_up(Path(tmp), directory=False)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (fsync, then rename)."""
    with atomic_file(path) as f:
        f.write(text)


def write_json_atomic(path: Path, data) -> None:
    """Write ``data`` as indented JSON to ``path`` atomically."""
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=False, default=str))


WRITE_KINDS = ("dir", "file", "new-dir")
"""How a command writes the path it is given, for :func:`ensure_writable`: ``dir``, into a directory (created when
missing: a results store, a report, a run); ``file``, one file replaced atomically (a temporary file beside it,
renamed: :func:`atomic_file`); ``new-dir``, a whole directory written beside its place and renamed in
(:func:`atomic_dir`: a quantized or exported model, a soup; or a file in its place: `quantize --export gguf`
writes one .gguf file; what the command accepts there is its own check)."""


def ensure_writable(path: str | Path, what: str, kind: str = "dir") -> Path:
    """Check that this process can write ``path`` the way a command will (``kind``: :data:`WRITE_KINDS`), before
    the command does any work; returns ``path`` as a Path. A path that cannot be written is one
    :class:`QuantdynError` line naming ``what`` (the option, e.g. ``--out``, or the spec key) and why.

    The question is put to the file system itself: a temporary file is created (and removed at once) in the
    directory that will receive the new entry — ``path`` itself for an existing directory written into, else
    the nearest existing ancestor of the new entry (where ``mkdir -p`` starts). Permission bits cannot answer it:
    root passes ``os.access`` everywhere, yet nobody can create files in /proc, /sys or on a read-only mount."""
    if kind not in WRITE_KINDS:
        raise ValueError(f"kind {kind!r} is not one of {WRITE_KINDS}")
    p = Path(path)
    fix = f"choose a place this user can write for {what}"
    if kind == "file" and p.is_dir():
        raise QuantdynError(f"{what} '{p}' is a directory; name a file")
    if kind == "dir" and p.exists() and not p.is_dir():
        raise QuantdynError(f"{what} '{p}' is a file; name a directory (or a path that does not exist yet)")
    here = p if (kind == "dir" and p.is_dir()) else p.parent
    here = here if str(here) else Path(".")
    while not here.exists() and here != here.parent:
        here = here.parent
    if not here.is_dir():
        raise QuantdynError(f"cannot write {what} '{p}': '{here}' is a file, not a directory; {fix}")
    try:
        fd, probe = tempfile.mkstemp(prefix=".quantdyn-write-check-", dir=here)
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise QuantdynError(f"cannot write {what} '{p}': '{here}' does not take new files ({reason}); {fix}") from None
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return p


def read_json(path: Path, fix: str) -> Any:
    """The JSON in ``path``; a file that is not valid JSON is one error line naming it and ``fix`` (what to do)."""
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError:
        raise QuantdynError(f"'{path}' is not valid JSON; {fix}") from None


def same_bytes(a: Path, b: Path, chunk: int = 1 << 22) -> bool:
    """Whether two files hold the same bytes (sizes first, then the contents)."""
    a, b = Path(a), Path(b)
    if a.stat().st_size != b.stat().st_size:
        return False
    with a.open("rb") as fa, b.open("rb") as fb:
        while True:
            x, y = fa.read(chunk), fb.read(chunk)
            if x != y:
                return False
            if not x:
                return True


def link_or_copy(src: Path, dst: Path) -> None:
    """``dst`` as a hard link to ``src`` (no second copy of a large file on disk), or a copy where the file system
    cannot link; ``dst`` must not exist. Files quantdyn writes are never changed in place, so a link is safe."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def share_if_identical(src: Path, dst: Path, check_bytes: bool = True) -> bool:
    """Replace ``dst`` by a hard link to ``src`` when both hold the same bytes (atomically: a link under a
    temporary name renamed over ``dst``); returns whether it did. Where links are impossible nothing changes.
    ``check_bytes=False``: the caller has established that both files hold the same content in another way."""
    src, dst = Path(src), Path(dst)
    if not (src.is_file() and dst.is_file()) or os.path.samefile(src, dst) or (check_bytes and not same_bytes(src, dst)):
        return False
    tmp = dst.parent / f".{dst.name}.link-{os.getpid()}"
    try:
        os.link(src, tmp)
    except OSError:
        return False
    os.replace(tmp, dst)
    return True
