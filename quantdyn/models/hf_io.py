"""Hugging Face import/export.

quantdyn's GPT has transformers' GPTNeoXForCausalLM parameter names, so a
checkpoint directory is simply ``config.json`` (a GPTNeoXConfig) plus
``model.safetensors``; ``transformers.AutoModelForCausalLM.from_pretrained``
loads it.  Other model families are loaded through transformers itself.

Loading never unpickles code: weights come from safetensors only.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Iterator

import torch
import torch.nn as nn
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from quantdyn.errors import QuantdynError
from quantdyn.files import atomic_dir, read_json
from quantdyn.models.gpt import GPT, ModelConfig

WEIGHTS = "model.safetensors"


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' progress bars ("Loading weights", "Writing model shards") off inside the block, as before
    after it: a run writes a checkpoint every few minutes and shows its own progress."""
    from transformers.utils import logging as tf_logging

    was = tf_logging.is_progress_bar_enabled()
    tf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            tf_logging.enable_progress_bar()


def hf_config_dict(cfg: ModelConfig, bos_token_id: int = 0, eos_token_id: int = 0) -> dict:
    """The config.json of a GPTNeoXForCausalLM with quantdyn's shape."""
    from transformers import GPTNeoXConfig

    hf = GPTNeoXConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head,
        intermediate_size=cfg.ff_dim,
        hidden_act="gelu",
        rotary_pct=cfg.rotary_pct,
        rotary_emb_base=cfg.rotary_base,
        max_position_embeddings=cfg.max_seq_len,
        layer_norm_eps=cfg.layer_norm_eps,
        use_parallel_residual=cfg.parallel_residual,
        tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=True,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        initializer_range=cfg.init_std,
    )
    d = hf.to_dict()
    d["architectures"] = ["GPTNeoXForCausalLM"]
    # Older transformers read these flat keys; newer ones read rope_parameters.
    d["rotary_pct"] = cfg.rotary_pct
    d["rotary_emb_base"] = cfg.rotary_base
    return d


def model_config_from_hf(d: dict) -> ModelConfig:
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    return ModelConfig(
        vocab_size=int(d["vocab_size"]),
        n_layer=int(d["num_hidden_layers"]),
        d_model=int(d["hidden_size"]),
        n_head=int(d["num_attention_heads"]),
        d_ff=int(d.get("intermediate_size", 4 * d["hidden_size"])),
        max_seq_len=int(d.get("max_position_embeddings", 2048)),
        rotary_pct=float(rope.get("partial_rotary_factor", d.get("rotary_pct", 0.25))),
        rotary_base=float(rope.get("rope_theta", d.get("rotary_emb_base", 10000.0))),
        parallel_residual=bool(d.get("use_parallel_residual", True)),
        tie_embeddings=bool(d.get("tie_word_embeddings", False)),
        layer_norm_eps=float(d.get("layer_norm_eps", 1e-5)),
    )


def state_dict_for_save(model: nn.Module) -> dict[str, torch.Tensor]:
    """Contiguous CPU copies; tied weights saved once per name (safetensors refuses shared storage)."""
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in model.state_dict().items()}


def save_hf_into(model: GPT, directory: Path, bos_token_id: int = 0, eos_token_id: int = 0) -> None:
    """Write config.json + model.safetensors into an existing directory (no atomicity)."""
    if not isinstance(model, GPT):
        with quiet_transformers():
            model.save_pretrained(directory)
        return
    (directory / "config.json").write_text(
        json.dumps(hf_config_dict(model.config, bos_token_id, eos_token_id), indent=2)
    )
    sd = state_dict_for_save(model)
    if model.config.tie_embeddings:
        sd.pop("embed_out.weight", None)
    save_file(sd, str(directory / WEIGHTS), metadata={"format": "pt"})


def save_hf(model: nn.Module, out_dir: str | Path) -> Path:
    """Atomically write an HF checkpoint directory for ``model``."""
    out = Path(out_dir)
    with atomic_dir(out) as tmp:
        save_hf_into(model, tmp)
    return out


def read_config_json(path: Path) -> dict:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise QuantdynError(f"'{path}' has no config.json; pass a checkpoint directory (HF format)")
    return read_json(cfg_file, "the checkpoint is corrupt — re-export it")


def load_gpt(path: str | Path, map_location: str | torch.device = "cpu") -> GPT:
    """Load a GPT-NeoX checkpoint directory into quantdyn's GPT."""
    path = Path(path)
    d = read_config_json(path)
    if d.get("model_type") != "gpt_neox":
        raise QuantdynError(
            f"'{path}' holds a '{d.get('model_type')}' model, not gpt_neox; load it with load_causal_lm"
        )
    cfg = model_config_from_hf(d)
    weights = path / WEIGHTS
    if not weights.is_file():
        raise QuantdynError(f"'{path}' has no {WEIGHTS}; the checkpoint is incomplete — re-export it")
    try:
        sd = load_file(str(weights), device=str(map_location))
    except (SafetensorError, OSError) as e:
        raise QuantdynError(f"'{weights}' is corrupt ({e}); delete it and re-create the checkpoint") from None
    model = GPT(cfg)
    if cfg.tie_embeddings:
        sd.setdefault("embed_out.weight", sd.get("gpt_neox.embed_in.weight"))
    sd = {k: v for k, v in sd.items() if not k.endswith(("attention.bias", "attention.masked_bias", "rotary_emb.inv_freq"))}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise QuantdynError(
            f"'{weights}' does not match its config.json (missing {list(missing)[:3]}, unexpected "
            f"{list(unexpected)[:3]}); the checkpoint is corrupt or from another model"
        )
    return model.to(map_location)


def load_causal_lm(spec: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    """Load a model from a local directory or ``hub-id[@revision]``.

    GPT-NeoX checkpoints become quantdyn GPTs (fast, hook-free forward);
    every other family loads through transformers' AutoModelForCausalLM.
    """
    spec = str(spec)
    path = Path(spec)
    if path.is_dir():
        d = read_config_json(path)
        if d.get("model_type") == "gpt_neox":
            return load_gpt(path, device).to(dtype)
        return _auto_load(str(path), None, device, dtype)
    if path.exists():
        raise QuantdynError(f"'{spec}' is a file, not a checkpoint directory")
    if spec.startswith((".", "/", "~")) or os.sep in spec and spec.count("/") > 1:
        raise QuantdynError(f"checkpoint directory '{spec}' does not exist; check the path")
    repo, _, rev = spec.partition("@")
    return _auto_load(repo, rev or None, device, dtype)


def _auto_load(name: str, revision: str | None, device, dtype) -> nn.Module:
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(name, revision=revision, dtype=dtype, use_safetensors=None)
    except OSError as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise QuantdynError(
            f"cannot load model '{name}'{'@' + revision if revision else ''}: {msg} — check the name, "
            "revision and network (or pass a local checkpoint directory)"
        ) from None
    return model.to(device).eval()


def checkpoint_hash(ref: str) -> str:
    """Content hash of a local checkpoint's weights, or of hub-id@revision."""
    p = Path(ref)
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else []
    if not files:
        return hashlib.sha256(ref.encode()).hexdigest()[:16]
    h = hashlib.sha256()
    for f in files:
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()[:16]
