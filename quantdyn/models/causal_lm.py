"""The model a run trains: quantdyn's GPT built from a shape, or any Hugging Face causal LM read from a checkpoint.

    model = run_model(cfg.model, vocab_size)        # GPTModel (model.n_layer, ...) | HFModel (model.hf: REF)
    module = model.initial(device)                  # GPT: the seeded initialisation; HF: the checkpoint's weights
    logits = model.logits(module, x)                # (B, T, V), also through DDP/FSDP2/compile wrappers
    model.blocks(module)                            # the decoder layers: FSDP2 units, activation checkpointing
    model.from_state(state_dict)                    # a whole model on the CPU (gathered weights, averages)
    model.load(path, device)                        # a checkpoint of this run, its shape checked

``model.hf`` names a local HF checkpoint directory, a hub id or ``id@revision``; transformers loads it (its own
class, e.g. LlamaForCausalLM: the HF cache, HF_HUB_OFFLINE), in float32 for training (master weights; bf16
autocast computes in bf16 where asked). Preset points (``smollm3-3b@REV``) are turned into their hub
``id@revision`` above this layer (sources/presets.py) before a run config reaches the trainer. Checkpoints of
an HF run are written by the model's own ``save_pretrained``: the same architecture, loadable by
``AutoModelForCausalLM.from_pretrained`` without quantdyn.

What the trainer needs from a family is where its decoder layers are: the block adapters of
models/adapters.py (llama, olmo, olmo2, qwen2, qwen3, gpt_neox, gpt2 ...). A REF that is not a causal LM, a
family without an adapter, or a quantized checkpoint is refused in one line before anything is written.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from quantdyn.errors import QuantdynError
from quantdyn.models.adapters import ADAPTERS, adapter_for
from quantdyn.models.gpt import GPT, ModelConfig, resolve_model_config
from quantdyn.models.hf_io import load_gpt, quiet_transformers

# config.json keys that decide whether two checkpoints' weights mean the same thing
ARCH_KEYS = (
    "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "intermediate_size", "head_dim", "hidden_act", "rotary_pct", "partial_rotary_factor", "rotary_emb_base",
    "rope_theta", "use_parallel_residual", "tie_word_embeddings", "layer_norm_eps", "rms_norm_eps",
    "n_embd", "n_layer", "n_head", "n_inner",
)


def split_ref(ref: str) -> tuple[str, str | None]:
    """(name or directory, revision or None) of ``id@revision``; a local directory has no revision."""
    if Path(ref).expanduser().exists():
        return str(Path(ref).expanduser()), None
    name, _, rev = ref.partition("@")
    return name, rev or None


class RunModel:
    """What the trainer asks of the model it trains (one subclass per kind of model section)."""

    vocab_size: int
    max_positions: int

    def initial(self, device: torch.device) -> nn.Module:  # pragma: no cover - interface
        raise NotImplementedError

    def from_state(self, state: dict[str, torch.Tensor]) -> nn.Module:  # pragma: no cover - interface
        raise NotImplementedError

    def load(self, path: Path, device: torch.device) -> nn.Module:  # pragma: no cover - interface
        raise NotImplementedError

    def logits(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def blocks(self, module: nn.Module) -> nn.ModuleList:
        """The decoder layers of ``module`` (one FSDP2 unit each; what activation checkpointing recomputes)."""
        return adapter_for(module).get_blocks(module)

    @property
    def from_checkpoint(self) -> bool:
        """Whether the run starts from a checkpoint's weights (model.hf): such a run writes its start as step 0."""
        return False


@dataclass(frozen=True)
class GPTModel(RunModel):
    """quantdyn's own GPT-NeoX of a shape (models/gpt.py)."""

    config: ModelConfig
    """The resolved shape (vocab_size filled in)."""

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def max_positions(self) -> int:
        return self.config.max_seq_len

    def initial(self, device: torch.device) -> nn.Module:
        return GPT(self.config).to(device)

    def from_state(self, state: dict[str, torch.Tensor]) -> nn.Module:
        whole = GPT(self.config)
        whole.load_state_dict(state)
        return whole

    def load(self, path: Path, device: torch.device) -> nn.Module:
        from quantdyn.config import to_dict

        src = load_gpt(path, device)
        if src.config.shape() != self.config.shape():
            raise QuantdynError(
                f"checkpoint '{path}' has model shape {to_dict(src.config)} but the config asks for "
                f"{to_dict(self.config)}; resume with the run's own config.yaml"
            )
        return src

    def logits(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return module(x)

    def blocks(self, module: nn.Module) -> nn.ModuleList:
        return module.blocks


@dataclass(frozen=True)
class HFModel(RunModel):
    """A Hugging Face causal LM read from ``ref`` (its own transformers class)."""

    ref: str
    """model.hf as given (a directory, a hub id or id@revision)."""
    config: dict = field(compare=False, hash=False, repr=False)
    """Its config.json (transformers' ``to_dict``)."""

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    @property
    def max_positions(self) -> int:
        c = self.config
        return int(c.get("max_position_embeddings") or c.get("n_positions") or 1 << 30)

    @property
    def model_type(self) -> str:
        return str(self.config.get("model_type"))

    @property
    def from_checkpoint(self) -> bool:
        return True

    def _config(self):
        from transformers import AutoConfig

        return AutoConfig.for_model(**self.config)

    def initial(self, device: torch.device) -> nn.Module:
        return _from_pretrained(self.ref).to(device)

    def from_state(self, state: dict[str, torch.Tensor]) -> nn.Module:
        from transformers import AutoModelForCausalLM

        try:
            from transformers.initialization import no_init_weights
        except ImportError:  # older transformers: the random initialisation is only slower
            no_init_weights = contextlib.nullcontext
        with no_init_weights():
            whole = AutoModelForCausalLM.from_config(self._config(), dtype=torch.float32)
        whole.tie_weights()  # skipped with the initialisation: tied embeddings stay one tensor
        load_weights(whole, state, f"the weights of '{self.ref}'")
        return whole.eval()

    def load(self, path: Path, device: torch.device) -> nn.Module:
        saved = read_causal_lm_config(str(path))
        for k in ARCH_KEYS:
            if saved.get(k) != self.config.get(k):
                raise QuantdynError(
                    f"checkpoint '{path}' is not a checkpoint of model.hf '{self.ref}' ({k}: {saved.get(k)!r} vs "
                    f"{self.config.get(k)!r}); resume with the run's own config.yaml"
                )
        return _from_pretrained(str(path)).to(device)

    def logits(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return module(input_ids=x, use_cache=False).logits


def run_model(cfg: ModelConfig, vocab_size: int | None = None) -> RunModel:
    """The model a run config's model section describes: ``hf`` set -> :class:`HFModel`, else the GPT of
    the shape (``vocab_size``: the tokenizer's, for model.vocab_size 0)."""
    if cfg.hf:
        return HFModel(cfg.hf, read_causal_lm_config(cfg.hf))
    return GPTModel(resolve_model_config(cfg, vocab_size))


def _config_of(ref: str) -> dict:
    from transformers import AutoConfig

    name, rev = split_ref(ref)
    try:
        return AutoConfig.from_pretrained(name, revision=rev).to_dict()
    except (OSError, ValueError, KeyError) as e:
        first = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise QuantdynError(f"cannot read the config of model '{ref}': {first} — pass a local HF checkpoint "
                            "directory, a hub id or id@revision (offline: one in the local HF cache; preset points "
                            "are resolved by the quantdyn commands)") from None


def read_causal_lm_config(ref: str) -> dict:
    """config.json of ``ref``, checked to be a causal LM that quantdyn can train (one line otherwise)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL

    d = dict(_config_of(str(ref)))
    mt = d.get("model_type")
    archs = d.get("architectures") or []
    if mt not in CAUSAL or (archs and not any(a in CAUSAL.values() for a in archs)):
        raise QuantdynError(f"model '{ref}' is not a causal language model ({mt or 'no model_type'}"
                            f"{', ' + archs[0] if archs else ''}); pass a *ForCausalLM checkpoint")
    if d.get("quantization_config"):
        method = (d["quantization_config"] or {}).get("quant_method", "quantized")
        raise QuantdynError(f"model '{ref}' is a {method} checkpoint, whose weights cannot be trained; pass the "
                            "full-precision checkpoint it was made from")
    if mt not in ADAPTERS:
        raise QuantdynError(f"quantdyn cannot train model type '{mt}' of '{ref}': it knows the decoder layers of "
                            f"{', '.join(ADAPTERS.names())} (register one in quantdyn.models.adapters.ADAPTERS)")
    return d


def _from_pretrained(ref: str) -> nn.Module:
    from transformers import AutoModelForCausalLM

    name, rev = split_ref(ref)
    try:
        with quiet_transformers():
            model = AutoModelForCausalLM.from_pretrained(name, revision=rev, dtype=torch.float32)
    except (OSError, ValueError) as e:
        first = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise QuantdynError(f"cannot load the weights of model '{ref}': {first} — check the checkpoint (offline: "
                            "download it first)") from None
    model.config.use_cache = False  # training: no KV cache
    return model.train()


def load_weights(model: nn.Module, state: dict[str, torch.Tensor], what: str) -> None:
    """``state`` into ``model``; a tied output head may be absent from ``state`` (it is the embedding)."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and getattr(model.config, "tie_word_embeddings", False):
        tied = {n for n, p in model.named_parameters(remove_duplicate=False) if p is head.weight}
    if set(missing) - tied or unexpected:
        raise QuantdynError(f"{what} do not fit the model (missing {sorted(set(missing) - tied)[:3]}, unexpected "
                            f"{sorted(unexpected)[:3]})")


def checkpoint_blocks(blocks: nn.ModuleList) -> None:
    """Activation checkpointing: each block's forward keeps only its inputs and recomputes its activations in
    the backward (torch.utils.checkpoint, non-reentrant). The blocks keep their names and parameters (a
    checkpoint of the run is unchanged); applied before FSDP2 wraps them."""
    for block in blocks:
        forward = block.forward
        block.forward = functools.partial(checkpoint, forward, use_reentrant=False)
