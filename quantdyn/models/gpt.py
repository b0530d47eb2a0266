"""The GPT-NeoX / Pythia model, in one file (nanoGPT's spirit).

Architecture (Black et al. 2022; Biderman et al. 2023):
  x = embed_in(idx)
  for each block:  x = x + attn(ln1(x)) + mlp(ln2(x))      (parallel residual)
                   or x = x + attn(ln1(x)); x = x + mlp(ln2(x))  (sequential)
  logits = embed_out(final_layer_norm(x))                    (untied by default)
Attention uses rotary embeddings on the first ``rotary_pct`` of each head's
dimensions, with the "rotate half" convention, and PyTorch SDPA.

Module and parameter names equal those of transformers' GPTNeoXForCausalLM,
so ``state_dict()`` *is* an HF checkpoint (see ``models/hf_io.py``) and
``transformers`` loads it as GPTNeoXForCausalLM with equal logits
(tests/test_model.py asserts it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from quantdyn.errors import QuantdynError, unknown_name

_DEFAULTS: dict = dict(vocab_size=0, n_layer=4, d_model=128, n_head=4, d_ff=0, max_seq_len=2048, rotary_pct=0.25,
                       rotary_base=10000.0, parallel_residual=True, tie_embeddings=False, layer_norm_eps=1e-5,
                       init_std=0.02)


@dataclass(frozen=True)
class ModelConfig:
    """The model of a run: the shape of quantdyn's GPT-NeoX/Pythia model, or (``hf``) a Hugging Face checkpoint.

    With a ``preset`` every field left unset (None) comes from the preset, else from the default in its
    docstring, and every field set explicitly wins — also when it equals the default (``n_layer: 4`` with
    a 6-layer preset gives 4 layers). Without a preset, unset fields take their defaults at once. With
    ``hf`` no shape field is given: the architecture, weights and tokenizer are the checkpoint's."""

    preset: str | None = None
    """Name of a preset (see PRESETS); explicit fields below override it."""
    vocab_size: int | None = None
    """Vocabulary size; 0 (default) = take it from the tokenizer (rounded up to a multiple of 64)."""
    n_layer: int | None = None
    """Number of transformer blocks (default 4)."""
    d_model: int | None = None
    """Residual width (hidden_size; default 128)."""
    n_head: int | None = None
    """Attention heads; must divide d_model (default 4)."""
    d_ff: int | None = None
    """MLP width; 0 (default) = 4 * d_model (Pythia)."""
    max_seq_len: int | None = None
    """Largest context (max_position_embeddings; default 2048)."""
    rotary_pct: float | None = None
    """Fraction of each head's dimensions that get rotary embeddings (Pythia: 0.25, the default)."""
    rotary_base: float | None = None
    """RoPE base (rotary_emb_base; default 10000)."""
    parallel_residual: bool | None = None
    """Pythia's parallel attention+MLP residual (default true)."""
    tie_embeddings: bool | None = None
    """Share input embedding and output head (Pythia: untied, the default)."""
    layer_norm_eps: float | None = None
    """LayerNorm epsilon (default 1e-5)."""
    init_std: float | None = None
    """Std of the normal initialisation (default 0.02); output projections get init_std / sqrt(2 * n_layer)."""
    hf: str = ""
    """Train a Hugging Face causal LM instead of a GPT of this shape: a local HF checkpoint directory, a hub id,
    id@revision, or a preset point (smollm3-3b@REVISION). Its own transformers class, weights, config and
    tokenizer; checkpoints are written in its own format (models/causal_lm.py)."""

    def __post_init__(self):
        if self.hf:
            given = [k for k in ("preset", *_DEFAULTS) if getattr(self, k) is not None]
            if given:
                raise QuantdynError(f"model.hf '{self.hf}' takes the model's shape from the checkpoint; drop "
                                    f"model.{given[0]}")
            return
        if self.preset is None:
            for k, v in _DEFAULTS.items():
                if getattr(self, k) is None:
                    object.__setattr__(self, k, v)
        for k in ("n_layer", "d_model", "n_head"):
            v = getattr(self, k)
            if v is not None and v < 1:
                raise QuantdynError(f"model: {k}={v} must be a positive integer")
        if self.d_model is not None and self.n_head is not None and self.d_model % self.n_head:
            raise QuantdynError(f"model: n_head={self.n_head} must divide d_model={self.d_model}")
        if self.rotary_pct is not None and not 0.0 <= self.rotary_pct <= 1.0:
            raise QuantdynError(f"model: rotary_pct={self.rotary_pct} must lie in [0, 1]")
        for k in ("vocab_size", "d_ff"):
            v = getattr(self, k)
            if v is not None and v < 0:
                raise QuantdynError(f"model: {k}={v} must be >= 0 (0 = derived)")
        if self.max_seq_len is not None and self.max_seq_len < 1:
            raise QuantdynError(f"model: max_seq_len={self.max_seq_len} must be >= 1")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def ff_dim(self) -> int:
        return self.d_ff or 4 * self.d_model

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rotary_pct)

    def shape(self) -> tuple:
        """What makes two configs' weights interchangeable (ignores preset name and init)."""
        return (self.vocab_size, self.n_layer, self.d_model, self.n_head, self.ff_dim, self.rotary_dim,
                self.rotary_base, self.parallel_residual, self.tie_embeddings, self.layer_norm_eps)


# Pythia's published shapes (Biderman et al. 2023, Table 1) and tiny CPU shapes.
PRESETS: dict[str, dict] = {
    "pythia-14m": dict(n_layer=6, d_model=128, n_head=4, max_seq_len=2048, vocab_size=50304),
    "pythia-70m": dict(n_layer=6, d_model=512, n_head=8, max_seq_len=2048, vocab_size=50304),
    "pythia-160m": dict(n_layer=12, d_model=768, n_head=12, max_seq_len=2048, vocab_size=50304),
    "pythia-410m": dict(n_layer=24, d_model=1024, n_head=16, max_seq_len=2048, vocab_size=50304),
    "pythia-1b": dict(n_layer=16, d_model=2048, n_head=8, max_seq_len=2048, vocab_size=50304),
    "tiny-2x64": dict(n_layer=2, d_model=64, n_head=2, max_seq_len=512),
    "tiny-4x128": dict(n_layer=4, d_model=128, n_head=4, max_seq_len=512),
    "tiny-4x256": dict(n_layer=4, d_model=256, n_head=4, max_seq_len=512),
}


def resolve_model_config(cfg: ModelConfig, vocab_size: int | None = None) -> ModelConfig:
    """Apply the preset (every explicitly set field wins) and fill vocab_size."""
    if cfg.hf:
        raise QuantdynError(f"model.hf '{cfg.hf}' has no GPT shape to resolve; models.causal_lm.run_model reads it")
    fields = dict(_DEFAULTS)
    if cfg.preset is not None:
        if cfg.preset not in PRESETS:
            raise unknown_name("model preset", cfg.preset, PRESETS)
        fields.update(PRESETS[cfg.preset])
    for k in _DEFAULTS:
        v = getattr(cfg, k)
        if v is not None and (cfg.preset is not None or v != _DEFAULTS[k]):
            fields[k] = v
    if fields.get("vocab_size", 0) == 0:
        if vocab_size is None:
            raise QuantdynError("model.vocab_size is 0 and no tokenizer gives it; set model.vocab_size")
        fields["vocab_size"] = int(math.ceil(vocab_size / 64) * 64)
    return ModelConfig(preset=cfg.preset, **fields)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rotary(nn.Module):
    """cos/sin tables for positions 0..T-1 over the rotary dimensions."""

    def __init__(self, rotary_dim: int, base: float):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, T: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.arange(T, device=device, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq.to(device))  # (T, rd/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, rd)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head, self.head_dim, self.rotary_dim = cfg.n_head, cfg.head_dim, cfg.rotary_dim
        self.query_key_value = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.dense = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        B, T, C = x.shape
        # GPT-NeoX packs q,k,v per head: (B, T, H, 3*hd) -> (B, H, T, 3*hd)
        qkv = self.query_key_value(x).view(B, T, self.n_head, 3 * self.head_dim).transpose(1, 2)
        q, k, v = qkv.chunk(3, dim=-1)  # each (B, H, T, hd)
        rd = self.rotary_dim
        if rd:
            cos, sin = rope  # (T, rd)
            q = torch.cat((q[..., :rd] * cos + rotate_half(q[..., :rd]) * sin, q[..., rd:]), dim=-1)
            k = torch.cat((k[..., :rd] * cos + rotate_half(k[..., :rd]) * sin, k[..., rd:]), dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, hd)
        return self.dense(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(cfg.d_model, cfg.ff_dim)
        self.dense_4h_to_h = nn.Linear(cfg.ff_dim, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.parallel = cfg.parallel_residual
        self.input_layernorm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.attention = Attention(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        a = self.attention(self.input_layernorm(x), rope)
        if self.parallel:
            return x + a + self.mlp(self.post_attention_layernorm(x))
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x))


class Trunk(nn.Module):
    """Named like transformers' GPTNeoXModel so parameter names match."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_in = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.final_layer_norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.rotary = Rotary(cfg.rotary_dim, cfg.rotary_base)


class GPT(nn.Module):
    """GPT-NeoX causal LM. ``forward(idx)`` returns full logits (B, T, V)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.vocab_size <= 0:
            raise QuantdynError("GPT needs a resolved config (vocab_size > 0); call resolve_model_config")
        self.config = cfg
        self.gpt_neox = Trunk(cfg)
        self.embed_out = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.embed_out.weight = self.gpt_neox.embed_in.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.config.init_std
        out_std = std / math.sqrt(2 * self.config.n_layer)
        for name, p in self.named_parameters():
            if p.dim() == 1:
                if name.endswith("layernorm.weight") or name.endswith("final_layer_norm.weight"):
                    nn.init.ones_(p)
                else:
                    nn.init.zeros_(p)
            elif name.endswith("attention.dense.weight") or name.endswith("dense_4h_to_h.weight"):
                nn.init.normal_(p, 0.0, out_std)
            else:
                nn.init.normal_(p, 0.0, std)

    @property
    def blocks(self) -> nn.ModuleList:
        return self.gpt_neox.layers

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        if T > self.config.max_seq_len:
            raise QuantdynError(f"sequence of {T} tokens exceeds model.max_seq_len={self.config.max_seq_len}")
        x = self.gpt_neox.embed_in(idx)  # (B, T, C)
        rope = self.gpt_neox.rotary(T, x.device, x.dtype)
        for block in self.gpt_neox.layers:
            x = block(x, rope)
        return self.embed_out(self.gpt_neox.final_layer_norm(x))  # (B, T, V)

    def num_params(self, non_embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.gpt_neox.embed_in.weight.numel()
        return n


def logits_of(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    """Full logits (B, T, V) from a quantdyn GPT or any HF causal LM."""
    out = model(idx)
    if isinstance(out, torch.Tensor):
        return out
    return out.logits
