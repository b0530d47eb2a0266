"""Block discovery for causal LMs: which modules to walk, in which order.

One :class:`FamilyAdapter` per model family, registered in ``ADAPTERS`` under
the Hugging Face ``config.model_type`` (quantdyn's own GPT is recognised with
``isinstance`` and uses the GPT-NeoX layout). An adapter names, as dotted paths:

* ``blocks``      the ModuleList of transformer blocks;
* ``pre_block``   the modules that run before block 0 (embeddings, dropout and,
                  for transformers >= 5 models, the rotary embedding whose
                  ``position_embeddings`` the base model passes to every layer);
* ``final_norm`` and ``head``;
* ``sequential``  the linear layers of one block in true-sequential groups
                  (layers of a group see the same input and are quantized together).

Weights are always handled as (out_features, in_features): :func:`get_weight`
and :func:`set_weight` transpose GPT-2's ``Conv1D`` (stored in x out).

To support another family, register an adapter before quantizing::

    from quantdyn.models.adapters import ADAPTERS, FamilyAdapter
    ADAPTERS.add("mistral", FamilyAdapter(
        blocks="model.layers", pre_block=("model.embed_tokens", "model.rotary_emb"),
        final_norm="model.norm", head="lm_head",
        sequential=(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                    ("self_attn.o_proj",), ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))))
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from quantdyn.errors import QuantdynError, did_you_mean
from quantdyn.models.gpt import GPT
from quantdyn.registry import Registry


def _conv1d_type():
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # transformers absent: no Conv1D layers can exist
        return ()
    return Conv1D


def is_quantizable(module: nn.Module) -> bool:
    """nn.Linear or transformers' Conv1D."""
    c1 = _conv1d_type()
    return isinstance(module, nn.Linear) or (bool(c1) and isinstance(module, c1))


def get_weight(module: nn.Module) -> torch.Tensor:
    """The weight as (out_features, in_features) (a transposed view for Conv1D)."""
    c1 = _conv1d_type()
    if c1 and isinstance(module, c1):
        return module.weight.data.t()
    if isinstance(module, nn.Linear):
        return module.weight.data
    raise QuantdynError(f"cannot quantize a {type(module).__name__}; adapters must name nn.Linear or Conv1D layers")


@torch.no_grad()
def set_weight(module: nn.Module, W: torch.Tensor) -> None:
    """Write W (out_features, in_features) into the module, in its dtype and layout."""
    c1 = _conv1d_type()
    target = module.weight
    if c1 and isinstance(module, c1):
        W = W.t()
    if W.shape != target.shape:
        raise QuantdynError(f"weight of shape {tuple(W.shape)} does not fit {type(module).__name__} {tuple(target.shape)}")
    target.data.copy_(W.to(device=target.device, dtype=target.dtype))


def _resolve(root: nn.Module, path: str, what: str) -> nn.Module:
    mod = root
    for part in path.split("."):
        if not hasattr(mod, part):
            names = [n for n, _ in mod.named_children()]
            raise QuantdynError(
                f"{what} '{path}' not found in {type(root).__name__} (no '{part}'{did_you_mean(part, names)}); "
                f"the model does not match its adapter"
            )
        mod = getattr(mod, part)
    return mod


@dataclass(frozen=True)
class FamilyAdapter:
    """Where the blocks, embeddings, norm, head and per-block linears of a family live."""

    blocks: str
    """Dotted path of the ModuleList of blocks, from the *ForCausalLM model."""
    pre_block: tuple[str, ...]
    """Modules that run before block 0 (moved to the compute device while capturing its inputs)."""
    final_norm: str
    """Final normalisation before the head."""
    head: str
    """Output projection (lm_head)."""
    sequential: tuple[tuple[str, ...], ...]
    """Linear layers of a block (paths relative to the block) in true-sequential groups."""

    def get_blocks(self, model: nn.Module) -> nn.ModuleList:
        blocks = _resolve(model, self.blocks, "block list")
        if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
            raise QuantdynError(f"'{self.blocks}' of {type(model).__name__} is not a non-empty ModuleList of blocks")
        return blocks

    def get_pre_block(self, model: nn.Module) -> list[nn.Module]:
        return [_resolve(model, p, "pre-block module") for p in self.pre_block]

    def get_final_norm(self, model: nn.Module) -> nn.Module:
        return _resolve(model, self.final_norm, "final norm")

    def get_head(self, model: nn.Module) -> nn.Module:
        return _resolve(model, self.head, "head")

    def linear_groups(self, block: nn.Module) -> list[list[tuple[str, nn.Module]]]:
        """[(name, module), ...] per true-sequential group; every quantizable layer of the
        block must appear exactly once (else the adapter is out of date: an error)."""
        groups = [[(p, _resolve(block, p, "layer")) for p in grp] for grp in self.sequential]
        named = [n for grp in groups for n, _ in grp]
        for n, m in (x for grp in groups for x in grp):
            if not is_quantizable(m):
                raise QuantdynError(f"adapter names '{n}', a {type(m).__name__}, not a linear layer")
        found = [n for n, m in block.named_modules() if n and is_quantizable(m)]
        missing = sorted(set(found) - set(named))
        if missing or len(set(named)) != len(named):
            raise QuantdynError(
                f"adapter's sequential groups {named} do not cover the block's linear layers {found}; "
                f"fix the adapter registered for this model type"
            )
        return groups


_LLAMA_LIKE = FamilyAdapter(
    blocks="model.layers",
    pre_block=("model.embed_tokens", "model.rotary_emb"),
    final_norm="model.norm",
    head="lm_head",
    sequential=(
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        ("self_attn.o_proj",),
        ("mlp.gate_proj", "mlp.up_proj"),
        ("mlp.down_proj",),
    ),
)

_NEOX_SEQUENTIAL = (
    ("attention.query_key_value",), ("attention.dense",), ("mlp.dense_h_to_4h",), ("mlp.dense_4h_to_h",)
)

ADAPTERS: Registry[FamilyAdapter] = Registry("model adapter")
ADAPTERS.add("gpt_neox", FamilyAdapter(
    blocks="gpt_neox.layers",
    pre_block=("gpt_neox.embed_in", "gpt_neox.emb_dropout", "gpt_neox.rotary_emb"),
    final_norm="gpt_neox.final_layer_norm",
    head="lm_head",  # transformers >= 5 names it lm_head (checkpoints keep 'embed_out', converted on load)
    sequential=_NEOX_SEQUENTIAL,
))
for _name in ("llama", "olmo", "olmo2", "qwen2", "qwen3"):
    ADAPTERS.add(_name, _LLAMA_LIKE)
ADAPTERS.add("gpt2", FamilyAdapter(
    blocks="transformer.h",
    pre_block=("transformer.wte", "transformer.wpe", "transformer.drop"),
    final_norm="transformer.ln_f",
    head="lm_head",
    sequential=(("attn.c_attn",), ("attn.c_proj",), ("mlp.c_fc",), ("mlp.c_proj",)),
))

QUANTDYN_GPT = FamilyAdapter(
    blocks="gpt_neox.layers",
    pre_block=("gpt_neox.embed_in", "gpt_neox.rotary"),
    final_norm="gpt_neox.final_layer_norm",
    head="embed_out",
    sequential=_NEOX_SEQUENTIAL,
)
"""quantdyn's own GPT (GPT-NeoX layout; rotary tables computed by ``gpt_neox.rotary``)."""


def model_type_of(model: nn.Module) -> str:
    """'quantdyn-gpt' for quantdyn's GPT, else the HF ``config.model_type``."""
    if isinstance(model, GPT):
        return "quantdyn-gpt"
    mt = getattr(getattr(model, "config", None), "model_type", None)
    if not mt:
        raise QuantdynError(
            f"cannot tell the family of a {type(model).__name__} (no config.model_type); pass quantdyn's GPT "
            f"or a transformers causal LM"
        )
    return str(mt)


def hf_model_type(model_type: str) -> str:
    """The HF ``model_type`` on disk of a model whose :func:`model_type_of` is ``model_type``: quantdyn's GPT is
    saved as GPT-NeoX (models/hf_io.py), every other model as itself."""
    return "gpt_neox" if model_type == "quantdyn-gpt" else model_type


def adapter_for(model: nn.Module) -> FamilyAdapter:
    """The adapter of ``model`` (by isinstance for quantdyn's GPT, else by config.model_type)."""
    mt = model_type_of(model)
    if mt == "quantdyn-gpt":
        return QUANTDYN_GPT
    if mt not in ADAPTERS:
        raise QuantdynError(
            f"no block adapter for model_type '{mt}'{did_you_mean(mt, ADAPTERS.names())} "
            f"(supported: {', '.join(ADAPTERS.names())}); register one with "
            f"quantdyn.models.adapters.ADAPTERS.add('{mt}', FamilyAdapter(...))"
        )
    return ADAPTERS.get(mt)
