"""Tiny GPT-NeoX and LLaMA checkpoints whose weights come from numpy's legacy RandomState (whose streams numpy
keeps stable across versions), so that tests/fixtures/gguf_llamacpp.json -- made once with llama.cpp from
exactly these weights -- stays valid on every machine (tests/test_formats_export.py)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn


@dataclass(frozen=True)
class ModelSpec:
    name: str
    model_type: str
    n_layer: int
    d: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seed: int

    def deep(self) -> "ModelSpec":
        """16 blocks: enough for llama.cpp's per-layer recipes (first/last eighth, every third, first sixteenth)."""
        return dataclasses.replace(self, name=f"{self.name}-deep", n_layer=16)


NEOX = ModelSpec("neox", "gpt_neox", 2, 256, 4, 4, 512, 256, 11)
LLAMA = ModelSpec("llama", "llama", 2, 256, 4, 2, 320, 256, 12)  # MLP width 320: ffn_down takes llama.cpp's fallback
WINDOWS = np.random.RandomState(3).randint(0, 256, (4, 65))
"""Evaluation windows [4, 65] (inputs: all but the last token)."""


def build_model(spec: ModelSpec) -> nn.Module:
    if spec.model_type == "gpt_neox":
        from quantdyn.models.gpt import GPT, ModelConfig, resolve_model_config

        model = GPT(resolve_model_config(ModelConfig(n_layer=spec.n_layer, d_model=spec.d, n_head=spec.heads,
                                                     d_ff=spec.ffn, max_seq_len=128, vocab_size=spec.vocab)))
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=spec.vocab, hidden_size=spec.d, intermediate_size=spec.ffn, num_hidden_layers=spec.n_layer,
            num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads, max_position_embeddings=128,
            bos_token_id=0, eos_token_id=0, tie_word_embeddings=False))
    return randomize(model, spec.seed)


def randomize(model: nn.Module, seed: int) -> nn.Module:
    """Weights from RandomState(seed) in parameter-name order: norms 1 + 0.1 N, biases 0.02 N, matrices 0.06 N."""
    rs = np.random.RandomState(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.from_numpy(rs.standard_normal(tuple(p.shape)).astype(np.float32))
            if p.dim() == 1:
                p.copy_(1 + 0.1 * noise if "norm" in name and name.endswith("weight") else 0.02 * noise)
            else:
                p.copy_(0.06 * noise)
    return model.eval()


def build_checkpoint(spec: ModelSpec, directory: Path) -> Path:
    """Write the model as an HF checkpoint directory (float32 safetensors, no tokenizer)."""
    model = build_model(spec)
    if spec.model_type == "gpt_neox":
        from quantdyn.models.hf_io import save_hf

        save_hf(model, directory)
    else:
        model.save_pretrained(directory, safe_serialization=True)
    return Path(directory)
