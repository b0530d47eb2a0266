"""Tiny models for the sensitivity / plan tests: quantdyn GPTs whose weights come from numpy's RandomState (stable
across versions) drawn wide enough (std 0.06) that 4-bit types move the KL measurably, and their windows."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

VOCAB = 128


def tiny_gpt(n_layer: int = 2, d: int = 64, seed: int = 5, vocab: int = VOCAB):
    from formats_models import randomize

    from quantdyn.models.gpt import GPT, ModelConfig, resolve_model_config

    return randomize(GPT(resolve_model_config(ModelConfig(n_layer=n_layer, d_model=d, n_head=2, max_seq_len=64,
                                                          vocab_size=vocab))), seed)


def tiny_checkpoint(directory: Path, **kw) -> Path:
    from quantdyn.models.hf_io import save_hf

    save_hf(tiny_gpt(**kw), directory)
    return Path(directory)


def windows(n: int, length: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.RandomState(seed).randint(0, VOCAB, (n, length))).long()
