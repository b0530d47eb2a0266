"""Tokenize once into memory-mapped token shards with a manifest.

    data = prepare_data(DataConfig(source="builtin:kjv", tokenizer="bpe:4096"))
    data.train, data.val, data.calib      # np.memmap of token ids (EOS between documents)
    data.eval_windows(128, 400)           # LongTensor [n, 128], non-overlapping, from val
    data.calib_windows(32, 128, seed=0)   # LongTensor [32, 128] from the calibration split

A window is ``seq_len`` tokens everywhere (:func:`token_windows`, :func:`random_windows`): evaluated, its first
seq_len - 1 tokens are the inputs and its last seq_len - 1 the next-token targets.

Documents are split into train / validation / calibration by a seeded hash of
their text, so the split is deterministic, independent of document order and
streaming, and evaluation text is never trained on; the manifest records how
(``held_out``: method, seed, fractions, document counts and a digest of the
validation and calibration documents) and which split of the source was read.
Everything lands in a cache directory named by the hash of (source identity,
text field, split, tokenizer spec, budget); training, calibration and
evaluation all read the same shards, so nothing is re-tokenized per evaluation.

The source is read once: every document goes to its split's shard in the same
pass (a streamed ``hf:`` source that must first train a ``bpe`` tokenizer is
spooled to a local file during that one download).  Documents are tokenized in
batches by the Rust ``tokenizers`` backend, which encodes a batch on all cores.
Processes that prepare the same cache at once (several sweeps, SLURM array
tasks) take turns through a lock file, so one tokenizes and the others open
its result.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from quantdyn.config import config_hash, to_dict
from quantdyn.data.sources import resolve_source
from quantdyn.data.tokenizer import (
    gpt2_tokenizer,
    load_pretrained_tokenizer,
    parse_tokenizer_spec,
    tokenizer_hash,
    train_bpe,
)
from quantdyn.errors import QuantdynError
from quantdyn.files import atomic_dir, write_json_atomic
from quantdyn.progress import Progress

SPLITS = ("train", "val", "calib")


def default_cache_dir() -> Path:
    return Path(os.environ.get("QUANTDYN_CACHE", ".cache/quantdyn")) / "data"


@dataclass(frozen=True)
class DataConfig:
    """Where text comes from and how it becomes token shards."""

    source: str = "builtin:kjv"
    """builtin:kjv, a .txt/.jsonl/.parquet file or a folder of them, or hf:NAME[:CONFIG][:SPLIT][@REVISION]."""
    text_field: str = "text"
    """Field holding the text in .jsonl/.parquet/hf rows."""
    tokenizer: str = "bpe:4096"
    """bpe:VOCAB (trained on the train split), gpt2, or an HF tokenizer name/path."""
    val_fraction: float = 0.05
    """Fraction of documents held out for validation/evaluation."""
    calib_fraction: float = 0.02
    """Fraction of documents held out for PTQ calibration."""
    split_seed: int = 1234
    """Seed of the document-level split hash."""
    max_tokens: int = 0
    """Token budget for the train split (0 = all). Streaming sources stop reading at ~5 chars/token."""
    bpe_train_chars: int = 20_000_000
    """At most this many characters of train text are used to learn a bpe tokenizer."""
    cache_dir: str = ""
    """Shard cache directory ('' = $QUANTDYN_CACHE/data or .cache/quantdyn/data)."""

    def __post_init__(self):
        if not (0 < self.val_fraction < 1 and 0 < self.calib_fraction < 1):
            raise QuantdynError("data.val_fraction and data.calib_fraction must lie in (0, 1)")
        if self.val_fraction + self.calib_fraction >= 0.9:
            raise QuantdynError("data.val_fraction + data.calib_fraction must leave room for training (< 0.9)")
        if self.max_tokens < 0:
            raise QuantdynError("data.max_tokens must be >= 0")


def split_of(text: str, seed: int, val_fraction: float, calib_fraction: float) -> str:
    """Deterministic split of one document by a seeded hash of its text."""
    h = hashlib.blake2b(f"{seed}\x00{text}".encode("utf-8", "replace"), digest_size=8).digest()
    u = int.from_bytes(h, "big") / 2**64
    if u < val_fraction:
        return "val"
    if u < val_fraction + calib_fraction:
        return "calib"
    return "train"


@dataclass
class TokenData:
    """Token shards of one (source, tokenizer, split) on disk."""

    directory: Path
    manifest: dict
    tokenizer: object = field(repr=False)
    _mm: dict = field(default_factory=dict, repr=False)

    @property
    def eos_id(self) -> int:
        return int(self.manifest["eos_id"])

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["vocab_size"])

    @property
    def data_hash(self) -> str:
        return self.manifest["key"]

    def same_data(self, key: str | None) -> bool:
        """Whether a recorded data key (e.g. a checkpoint's ``data_key``) names these shards: their key,
        or the key the same config had before the source identity entered it."""
        return key is not None and key in (self.manifest["key"], self.manifest.get("legacy_key", self.manifest["key"]))

    def split(self, name: str) -> np.ndarray:
        if name not in SPLITS:
            raise QuantdynError(f"unknown split '{name}'; use one of {SPLITS}")
        if name not in self._mm:
            n = self.manifest["splits"][name]["tokens"]
            dtype = np.dtype(self.manifest["dtype"])
            if n == 0:
                self._mm[name] = np.zeros(0, dtype=dtype)
            else:
                self._mm[name] = np.memmap(self.directory / f"{name}.bin", dtype=dtype, mode="r", shape=(n,))
        return self._mm[name]

    @property
    def train(self) -> np.ndarray:
        return self.split("train")

    @property
    def val(self) -> np.ndarray:
        return self.split("val")

    @property
    def calib(self) -> np.ndarray:
        return self.split("calib")

    def eval_windows(self, seq_len: int, max_windows: int = 0, split: str = "val") -> torch.Tensor:
        """Non-overlapping windows [n, seq_len] of a split, in order (paper A's eval blocks; :func:`token_windows`)."""
        return token_windows(self.split(split), seq_len, max_windows, what=f"the {split} split",
                             hint="use more data, a larger data.val_fraction, or a shorter sequence length")

    def calib_windows(self, n: int, seq_len: int, seed: int = 0) -> torch.Tensor:
        """``n`` random windows [n, seq_len] from the calibration split (seeded; :func:`random_windows`)."""
        return random_windows(self.split("calib"), n, seq_len, seed, what="the calibration split",
                              hint="use more data or a larger data.calib_fraction")

    def token_hash(self, split: str, seq_len: int, max_windows: int = 0) -> str:
        """Identity of an evaluation set: shard key + split + windowing."""
        return hashlib.sha1(f"{self.data_hash}:{split}:{seq_len}:{max_windows}".encode()).hexdigest()[:12]


# ------------------------------------------------------------------ windows
# The one windowing of token streams. A window is ``seq_len`` consecutive tokens: the model reads all of them
# (calibration), or, evaluated, its first seq_len - 1 tokens are the inputs and its last seq_len - 1 the
# next-token targets (``engine.measure``'s windows [N, T+1] with T = seq_len - 1).


def _as_ids(tokens) -> np.ndarray | torch.Tensor:
    return tokens if isinstance(tokens, (np.ndarray, torch.Tensor)) else np.asarray(tokens)


def long_ids(t) -> torch.Tensor:
    """Token ids (a tensor, an array or a memory-mapped slice) as a CPU LongTensor."""
    if isinstance(t, torch.Tensor):
        return t.detach().to("cpu", torch.long)
    return torch.from_numpy(np.asarray(t, dtype=np.int64))


def token_windows(tokens, seq_len: int, max_windows: int = 0, what: str = "the token stream",
                  hint: str = "give more tokens or a shorter sequence length") -> torch.Tensor:
    """Consecutive non-overlapping windows [n, seq_len] of a 1-D token stream, in order, at most ``max_windows``
    (0 = as many as fit); a memory-mapped stream stays mapped (only the windows are read)."""
    toks = _as_ids(tokens)
    if seq_len < 2:
        raise QuantdynError(f"windows of {seq_len} token(s) hold no next-token target; use a sequence length >= 2")
    n = len(toks) // seq_len
    if max_windows:
        n = min(n, max_windows)
    if n == 0:
        raise QuantdynError(f"{what} has {len(toks)} tokens, fewer than one window of {seq_len}; {hint}")
    return long_ids(toks[: n * seq_len]).reshape(n, seq_len)


def random_windows(tokens, n: int, seq_len: int, seed: int = 0, what: str = "the token stream",
                   hint: str = "give more tokens") -> torch.Tensor:
    """``n`` windows [n, seq_len] of a 1-D token stream at seeded random offsets (calibration sequences)."""
    toks = _as_ids(tokens)
    if len(toks) <= seq_len:
        raise QuantdynError(f"{what} has {len(toks)} tokens, too few for windows of {seq_len}; {hint}")
    if n <= 0:
        raise QuantdynError("calibration set is empty: ask for at least 1 calibration sample")
    starts = np.random.default_rng(seed).integers(0, len(toks) - seq_len, size=n)
    return torch.stack([long_ids(toks[int(s) : int(s) + seq_len]) for s in starts])


def _limited(docs: Iterator[str], max_chars: int) -> Iterator[str]:
    seen = 0
    for d in docs:
        yield d
        seen += len(d)
        if max_chars and seen >= max_chars:
            return


def _build_tokenizer(cfg: DataConfig, doc_factory: Callable[[], Iterator[str]]):
    kind, vocab = parse_tokenizer_spec(cfg.tokenizer)
    if kind == "bpe":
        train_docs = (d for d in doc_factory()
                      if split_of(d, cfg.split_seed, cfg.val_fraction, cfg.calib_fraction) == "train")
        return train_bpe(_limited(train_docs, cfg.bpe_train_chars), vocab)
    if kind == "gpt2":
        return gpt2_tokenizer()
    return load_pretrained_tokenizer(cfg.tokenizer)


def encoder_of(tok) -> Callable[[list[str]], list[list[int]]]:
    """Batch encoder without special tokens: the Rust backend's ``encode_batch`` (parallel over
    documents on all cores) for fast tokenizers, the tokenizer's own call otherwise."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        from tokenizers import Tokenizer

        backend = Tokenizer.from_str(backend.to_str())  # a copy: a saved truncation/padding setting must not apply
        backend.no_truncation()
        backend.no_padding()
        return lambda batch: [e.ids for e in backend.encode_batch(batch, add_special_tokens=False)]
    return lambda batch: tok(batch, add_special_tokens=False)["input_ids"]


class _SplitWriter:
    """Token ids of one split, appended to ``path`` in batches, with a token budget (0 = none)."""

    BATCH_CHARS = 4_000_000
    BATCH_DOCS = 4096

    def __init__(self, path: Path, encode, dtype, eos: int, budget: int, progress):
        self.f = path.open("wb")
        self.encode, self.dtype, self.eos, self.budget, self.progress = encode, dtype, eos, budget, progress
        self.tokens = self.docs = self.chars = 0
        self.digest = hashlib.blake2b(digest_size=16)
        self.pending: list[str] = []
        self.pending_chars = 0

    @property
    def full(self) -> bool:
        return bool(self.budget) and self.tokens >= self.budget

    def add(self, doc: str) -> None:
        if self.full:
            return
        self.pending.append(doc)
        self.pending_chars += len(doc)
        if self.pending_chars >= self.BATCH_CHARS or len(self.pending) >= self.BATCH_DOCS:
            self.flush()

    def flush(self) -> None:
        if not self.pending or self.full:
            self.pending.clear()
            return
        ids = self.encode(self.pending)
        parts = []
        for doc, seq in zip(self.pending, ids):
            arr = np.asarray(seq + [self.eos], dtype=self.dtype)
            if self.budget and self.tokens + len(arr) > self.budget:
                arr = arr[: self.budget - self.tokens]
            parts.append(arr)
            self.tokens += len(arr)
            self.docs += 1
            self.chars += len(doc)
            self.digest.update(doc.encode("utf-8", "replace") + b"\x00")
            if self.full:
                break
        buf = np.concatenate(parts) if parts else np.zeros(0, dtype=self.dtype)
        self.f.write(buf.tobytes())
        self.progress.update(len(buf))
        self.pending.clear()
        self.pending_chars = 0

    def close(self) -> None:
        self.flush()
        self.f.close()


def _spool(docs: Iterator[str], path: Path) -> Callable[[], Iterator[str]]:
    """Write documents once to a local file; return a factory that reads them back."""
    with path.open("wb") as f:
        for d in docs:
            b = d.encode("utf-8", "surrogatepass")
            f.write(struct.pack("<Q", len(b)))
            f.write(b)

    def read() -> Iterator[str]:
        with path.open("rb") as f:
            while head := f.read(8):
                (n,) = struct.unpack("<Q", head)
                yield f.read(n).decode("utf-8", "surrogatepass")

    return read


@contextlib.contextmanager
def _cache_lock(lock_path: Path):
    """An exclusive lock on ``lock_path`` (advisory; a no-op where the filesystem has no locks)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, concurrent preparers only duplicate work (writes are atomic)
        yield
        return
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        except OSError:  # e.g. ENOLCK on a filesystem without locks
            pass
        yield


def prepare_data(cfg: DataConfig, progress: bool = True) -> TokenData:
    """Tokenize ``cfg.source`` into cached shards (once) and open them."""
    info, doc_factory = resolve_source(cfg.source, cfg.text_field)
    key_fields = {k: v for k, v in to_dict(cfg).items() if k != "cache_dir"}
    pretrained = None
    if parse_tokenizer_spec(cfg.tokenizer)[0] == "hf":
        # a pretrained tokenizer is identified by its content, not its path: every checkpoint
        # directory of a run carries the same tokenizer, and they share one token cache
        pretrained = load_pretrained_tokenizer(cfg.tokenizer)
        key_fields["tokenizer"] = f"hf:{tokenizer_hash(pretrained)}"
    key = config_hash({"source_identity": info.identity, **key_fields})
    # Caches made before the source identity entered the key were named by the config alone (the
    # identity was shadowed by the source spec); one of those is still used when the source is
    # unchanged since, so runs and result rows that recorded its key stay valid.
    legacy = config_hash(key_fields)
    root = Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir()
    directory = root / key
    if (directory / "manifest.json").is_file():
        return _open(directory)
    old = _open_legacy(root / legacy, info.identity)
    if old is not None:
        return old
    with _cache_lock(root / f".{key}.lock"):
        if (directory / "manifest.json").is_file():  # another process prepared it while we waited
            return _open(directory)
        _prepare(cfg, info, doc_factory, pretrained, key, legacy, directory, progress)
    return _open(directory)


def _open_legacy(directory: Path, identity: str) -> TokenData | None:
    try:
        manifest = json.loads((directory / "manifest.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return _open(directory) if manifest.get("source_identity") == identity else None


def _prepare(cfg: DataConfig, info, doc_factory, pretrained, key: str, legacy_key: str, directory: Path,
             progress: bool) -> None:
    max_chars = cfg.max_tokens * 5 if (cfg.max_tokens and info.kind == "hf") else 0

    def docs():
        return _limited(doc_factory(), max_chars) if max_chars else doc_factory()

    with atomic_dir(directory) as tmp:
        spool = None
        if pretrained is None and parse_tokenizer_spec(cfg.tokenizer)[0] == "bpe" and info.streaming:
            # the bpe tokenizer is learned before tokenizing: keep the one download on local disk
            spool = tmp / "source.spool"
            docs = _spool(docs(), spool)
        tok = pretrained if pretrained is not None else _build_tokenizer(cfg, docs)
        eos = tok.convert_tokens_to_ids(tok.eos_token)
        vocab = len(tok)
        dtype = np.uint16 if vocab <= 65535 else np.uint32
        encode = encoder_of(tok)
        with Progress(f"tokenizing {cfg.source}", unit="tok", enabled=progress, unit_scale=True) as bar:
            writers = {s: _SplitWriter(tmp / f"{s}.bin", encode, dtype, eos, cfg.max_tokens if s == "train" else 0, bar)
                       for s in SPLITS}
            try:
                for d in docs():
                    writers[split_of(d, cfg.split_seed, cfg.val_fraction, cfg.calib_fraction)].add(d)
            finally:
                for w in writers.values():
                    w.close()
        if spool is not None:
            spool.unlink()
        splits = {s: {"tokens": w.tokens} for s, w in writers.items()}
        if splits["train"]["tokens"] == 0:
            raise QuantdynError(
                f"data source '{cfg.source}' gave no training text; check that it is not empty and that "
                f"data.text_field='{cfg.text_field}' names the text"
            )
        for s in ("val", "calib"):
            if splits[s]["tokens"] == 0:
                raise QuantdynError(
                    f"data source '{cfg.source}' has too few documents for a {s} split; add documents or raise "
                    f"data.{'val' if s == 'val' else 'calib'}_fraction"
                )
        tok.save_pretrained(str(tmp / "tokenizer"))
        manifest = {
            "key": key,
            "legacy_key": legacy_key,
            "source": info.spec,
            "source_kind": info.kind,
            "source_identity": info.identity,
            "source_details": info.details,
            "config": to_dict(cfg),
            "tokenizer": cfg.tokenizer,
            "tokenizer_hash": tokenizer_hash(tok),
            "vocab_size": vocab,
            "eos_id": eos,
            "dtype": np.dtype(dtype).name,
            "splits": splits,
            "held_out": {
                "method": "document hash: blake2b(f'{split_seed}\\0{text}') / 2**64 < val_fraction -> val, "
                          "< val_fraction + calib_fraction -> calib, else train",
                "split_seed": cfg.split_seed,
                "val_fraction": cfg.val_fraction,
                "calib_fraction": cfg.calib_fraction,
                "source_split": info.details.get("split"),
                "source_revision": info.details.get("revision"),
                "documents": {s: w.docs for s, w in writers.items()},
                "chars": {s: w.chars for s, w in writers.items()},
                "train_budget_reached": writers["train"].full,
                "val_digest": writers["val"].digest.hexdigest(),
                "calib_digest": writers["calib"].digest.hexdigest(),
            },
        }
        write_json_atomic(tmp / "manifest.json", manifest)


def _open(directory: Path) -> TokenData:
    from transformers import AutoTokenizer

    try:
        manifest = json.loads((directory / "manifest.json").read_text())
        tok = AutoTokenizer.from_pretrained(str(directory / "tokenizer"))
    except (json.JSONDecodeError, OSError) as e:
        raise QuantdynError(f"token cache '{directory}' is corrupt ({type(e).__name__}); delete it and rerun") from None
    return TokenData(directory=directory, manifest=manifest, tokenizer=tok)


