"""Hugging Face hub references and the local HF cache: the one home of all hub code.

A checkpoint reference is a local directory, a checkpoint of a quantdyn run by step (``RUN_DIR@latest``,
``RUN_DIR@-100``, ``RUN_DIR@400``: runs.py resolves those) or a hub model ``ID[@REVISION]``; :func:`resolve_checkpoint` turns
it into a local directory (the cached snapshot, downloaded once; offline, the cache alone) and
:func:`open_checkpoint` indexes its tensors (:class:`~quantdyn.models.weights.CheckpointWeights`). For
trajectories: the revisions a repo has (on the hub, or in the cache when offline or unreachable), whether a
revision is cached, and eviction of a measured revision from the cache. Offline mode is read in one place,
:func:`hub_offline` (``HF_HUB_OFFLINE`` as huggingface_hub reads it: 1/ON/YES/TRUE).
"""
from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path

from quantdyn.errors import QuantdynError
from quantdyn.models.weights import CheckpointWeights
from quantdyn.runs import RunDir, resolve_run_reference

log = logging.getLogger(__name__)


def hub_offline() -> bool:
    """Whether huggingface_hub is in offline mode (HF_HUB_OFFLINE)."""
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")
    return bool(constants.HF_HUB_OFFLINE) or env


def hub_cache_dir() -> Path:
    """The HF hub cache huggingface_hub uses now (HF_HUB_CACHE / HF_HOME)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _repo_cache(repo: str) -> Path:
    return hub_cache_dir() / f"models--{repo.replace('/', '--')}"


def cached_refs(repo: str) -> list[str]:
    """Branch and tag names of ``repo`` that the local HF cache holds (refs/<name> files)."""
    refdir = _repo_cache(repo) / "refs"
    if not refdir.is_dir():
        return []
    return sorted(p.relative_to(refdir).as_posix() for p in refdir.rglob("*") if p.is_file())


def _ref_commit(repo: str, revision: str) -> str | None:
    if re.fullmatch(r"[0-9a-f]{40}", revision):
        return revision
    ref = _repo_cache(repo) / "refs" / revision
    try:
        return ref.read_text().strip() or None
    except OSError:
        return None


def cached_snapshot(repo: str, revision: str) -> Path | None:
    """The local snapshot directory of ``repo@revision`` if the HF cache holds it with a config.json."""
    commit = _ref_commit(repo, revision)
    snap = _repo_cache(repo) / "snapshots" / commit if commit else None
    return snap if snap is not None and (snap / "config.json").exists() else None


def _network_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean "the hub cannot be reached": OSError (connection, timeout, offline mode, requests),
    HTTP errors from the hub (5xx), and the transport errors of the HTTP client huggingface_hub uses."""
    from huggingface_hub.errors import HfHubHTTPError

    errs: list[type[BaseException]] = [OSError, HfHubHTTPError]
    for mod in ("httpx", "httpx2"):  # whichever client huggingface_hub has imported
        err = getattr(sys.modules.get(mod), "TransportError", None)
        if isinstance(err, type) and issubclass(err, BaseException):
            errs.append(err)
    return tuple(errs)


def hub_refs(repo: str) -> tuple[list[str], str]:
    """(branch and tag names of ``repo``, where they came from: 'hub' | 'cache').

    Offline (HF_HUB_OFFLINE=1) the hub is not contacted; with the hub unreachable, one warning line and the
    local cache's refs.  A repo the hub does not know, or no refs anywhere, is one line naming the repo."""
    if hub_offline():
        names = cached_refs(repo)
        if not names:
            raise QuantdynError(f"no revision of '{repo}' is in the local HF cache ({hub_cache_dir()}) and "
                                "HF_HUB_OFFLINE=1: unset HF_HUB_OFFLINE to list them on the hub, or pass --revisions")
        return names, "cache"
    from huggingface_hub import list_repo_refs
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        refs = list_repo_refs(repo)
    except GatedRepoError:
        raise QuantdynError(f"hub repo '{repo}' is gated: accept its terms on huggingface.co and log in "
                            "(`hf auth login`)") from None
    except RepositoryNotFoundError:
        raise QuantdynError(f"hub repo '{repo}' does not exist or is private: check the id, or log in "
                            "(`hf auth login`)") from None
    except _network_errors() as e:  # an unreachable hub (DNS, refused, timeout, 5xx): say so, use the cache
        names = cached_refs(repo)
        if not names:
            raise QuantdynError(f"cannot list the revisions of '{repo}': the hub is unreachable ({type(e).__name__}) "
                                "and the local HF cache has none; check the network, or pass --revisions") from None
        log.warning("hub unreachable for '%s' (%s): listing %d revisions from the local HF cache; set "
                    "HF_HUB_OFFLINE=1 to skip the hub", repo, type(e).__name__, len(names))
        return names, "cache"
    return [r.name for r in [*refs.branches, *refs.tags]], "hub"


def list_revisions(repo: str, pattern: str) -> list[str]:
    """Branches and tags of a hub repo matching ``pattern``; offline or unreachable, those in the local HF cache."""
    try:
        rx = re.compile(pattern)
    except re.error as e:
        raise QuantdynError(f"revision pattern '{pattern}' is not a valid regex ({e})") from None
    names, source = hub_refs(repo)
    found = [n for n in names if rx.fullmatch(n) or rx.search(n)]
    if not found:
        raise QuantdynError(f"no revision of '{repo}' matches '{pattern}' ({len(names)} refs seen on the {source}); "
                            "check the pattern")
    return found


def evict_revision(repo: str, revision: str) -> int:
    """Delete one revision's files from the HF cache (snapshot, its refs, blobs no other revision uses).

    Returns the bytes freed (0 when the cache does not hold it).  Uses huggingface_hub's cache scanner, so the
    cache stays consistent for huggingface_hub and transformers."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    commit = _ref_commit(repo, revision)
    try:
        info = scan_cache_dir(hub_cache_dir())
    except CacheNotFound:
        return 0
    for cached in info.repos:
        if cached.repo_id != repo or cached.repo_type != "model":
            continue
        hashes = [r.commit_hash for r in cached.revisions if r.commit_hash == commit or revision in r.refs]
        if not hashes:
            return 0
        strategy = info.delete_revisions(*hashes)
        freed = strategy.expected_freed_size
        strategy.execute()
        return freed
    return 0


# ------------------------------------------------------------------- references
_HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "tokenizer*"]
"""The files of a hub revision that quantdyn downloads (snapshot_download's allow_patterns)."""


def _wanted(name: str) -> bool:
    import fnmatch

    return any(fnmatch.fnmatch(name, pat) for pat in _HUB_FILES)


def revision_size(repo: str, revision: str) -> int | None:
    """Bytes of the files quantdyn reads from ``repo@revision``: from the local HF cache when it holds the
    revision, else from the hub's file list (one request); None when neither can tell (offline, unreachable)."""
    snap = cached_snapshot(repo, revision)
    if snap is not None:
        return sum(f.stat().st_size for f in snap.rglob("*") if f.is_file() and _wanted(f.relative_to(snap).as_posix()))
    if hub_offline():
        return None
    from huggingface_hub import HfApi

    try:
        info = HfApi().model_info(repo, revision=revision, files_metadata=True, timeout=10)
    except (*_network_errors(), ValueError):
        return None
    sizes = [s.size for s in info.siblings or [] if _wanted(s.rfilename)]
    return sum(sizes) if sizes and None not in sizes else None


def is_hub_ref(ref: str) -> bool:
    """Whether ``ref`` names a hub model (``org/name[@revision]``) rather than a local path."""
    if Path(ref).exists():
        return False
    if ref.startswith((".", "/", "~")):
        return False
    repo = ref.partition("@")[0]
    return repo.count("/") <= 1 and bool(re.fullmatch(r"[\w.\-]+(/[\w.\-]+)?", repo))


def resolve_checkpoint(ref: str | Path) -> Path:
    """A local directory for a checkpoint reference (hub refs: the cached snapshot, downloaded if needed).

    Offline (``HF_HUB_OFFLINE=1``) a revision missing from the cache is one line naming the repo
    and revision and the command that downloads it; no retries.
    """
    ref = resolve_run_reference(ref)
    p = Path(ref).expanduser()
    if p.is_dir() and RunDir(p).is_run and not (p / "config.json").is_file():
        raise QuantdynError(f"'{ref}' is a quantdyn run, not one checkpoint: name one, e.g. {ref}@latest (its last), "
                            f"{ref}@-100 (100 steps before its end) or {ref}@STEP")
    if p.is_dir():
        return p
    if p.exists():
        raise QuantdynError(f"'{ref}' is a file, not a checkpoint directory")
    if not is_hub_ref(ref):
        raise QuantdynError(f"checkpoint directory '{ref}' does not exist; check the path")
    repo, _, rev = ref.partition("@")
    return _hub_snapshot(repo, rev or None)


def _hub_snapshot(repo: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    what = f"{repo}@{revision}" if revision else repo
    try:  # the cache first: no network round trip for what is already here
        return Path(snapshot_download(repo, revision=revision, allow_patterns=_HUB_FILES, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    except (OSError, ValueError):
        pass
    offline = hub_offline()
    get = f"`hf download {repo}{' --revision ' + revision if revision else ''}`"
    if offline:
        raise QuantdynError(f"model '{what}' is not in the local Hugging Face cache and HF_HUB_OFFLINE is set; "
                            f"download it first with {get}")
    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=_HUB_FILES))
    except RevisionNotFoundError:
        raise QuantdynError(f"revision '{revision}' of '{repo}' does not exist on the hub; check the name") from None
    except RepositoryNotFoundError:
        raise QuantdynError(f"model '{repo}' does not exist on the hub (or needs a token); check the id") from None
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise QuantdynError(f"cannot download '{what}': {first[:200]} — check the network, or download it with "
                            f"{get}") from None


def open_checkpoint(ref: str | Path) -> CheckpointWeights:
    """Resolve a reference and index its tensors (validated; nothing large is read)."""
    return CheckpointWeights(resolve_checkpoint(ref))
