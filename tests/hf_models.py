"""Tiny random-weight Hugging Face causal LMs of every family quantdyn trains (saved with a tokenizer as HF
directories), and the layout of a local HF hub cache that holds them under a repo id and revisions (what
downloads leave), so that ``id@revision`` references resolve offline (HF_HUB_OFFLINE=1) through the real
huggingface_hub and transformers code."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

ARCHITECTURES = ("llama", "olmo2", "olmo", "qwen2", "qwen3", "gpt_neox", "gpt2")
"""The families of issue 36, by transformers' model_type."""


def tiny_config(arch: str, vocab: int, tie: bool = False):
    """A 2-layer config of ``arch`` (hidden 32, 4 heads, 2 KV heads where the family has them)."""
    import transformers as tf

    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=128, tie_word_embeddings=tie, bos_token_id=0, eos_token_id=0)
    if arch == "gpt2":
        return tf.GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=4, n_positions=128, bos_token_id=0,
                             eos_token_id=0, tie_word_embeddings=True)
    if arch == "gpt_neox":
        return tf.GPTNeoXConfig(**common)
    cls = {"llama": tf.LlamaConfig, "olmo2": tf.Olmo2Config, "olmo": tf.OlmoConfig, "qwen2": tf.Qwen2Config,
           "qwen3": tf.Qwen3Config}[arch]
    return cls(**common, num_key_value_heads=2, **({"head_dim": 8} if arch == "qwen3" else {}))


def save_tiny(arch: str, directory: Path, tokenizer, seed: int = 0, tie: bool = False) -> Path:
    """A random-weight model of ``arch`` sized for ``tokenizer``, saved with it (float32 safetensors)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, len(tokenizer), tie))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return Path(directory)


def lay_out_hf_cache(cache: Path, repo: str, revisions: dict[str, Path]) -> None:
    """What downloads leave: blobs/<sha256>, snapshots/<commit>/<file> -> blob symlinks, refs/<revision>."""
    base = cache / f"models--{repo.replace('/', '--')}"
    for rev, src in revisions.items():
        commit = hashlib.sha1(f"{repo}@{rev}".encode()).hexdigest()
        snap = base / "snapshots" / commit
        snap.mkdir(parents=True)
        for f in sorted(src.iterdir()):
            data = f.read_bytes()
            blob = base / "blobs" / hashlib.sha256(data).hexdigest()
            blob.parent.mkdir(exist_ok=True)
            if not blob.exists():
                blob.write_bytes(data)
            (snap / f.name).symlink_to(os.path.relpath(blob, snap))
        (base / "refs").mkdir(exist_ok=True)
        (base / "refs" / rev).write_text(commit)


def point_hf_at(monkeypatch, cache: Path, offline: bool) -> None:
    """huggingface_hub and transformers read ``cache`` (HF_HOME its parent), offline or not."""
    import huggingface_hub.constants as c
    import transformers.utils.hub as th

    monkeypatch.setenv("HF_HOME", str(cache.parent))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(th, "HF_HUB_CACHE", str(cache), raising=False)
    monkeypatch.setattr(th, "TRANSFORMERS_CACHE", str(cache), raising=False)
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", offline)
