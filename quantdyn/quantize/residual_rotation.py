"""The residual-stream rotation (QuaRot's R1, label ``+r1``) and what a model allows of the rotations.

R1 rotates the hidden state h of every token by the same orthogonal R (quantize/rotation.py, the width of the
residual stream) and folds it into the weights offline, so that the rotated model computes the same function:

* the embedding's rows: E -> E R;
* every layer that reads the stream after a norm (q, k, v; gate, up; the head): the norm's scale γ is folded into
  its weight (out, in) first and set to 1, then the input features rotated: W -> (W diag(γ)) R;
* every layer that writes into the stream (o_proj, down_proj): W -> Rᵀ W, its bias b -> b R.

It is exact for pre-norm models whose norm is an RMSNorm: with γ = 1, RMSNorm(h R) = RMSNorm(h) R because an
orthogonal R keeps the root mean square of every row. Registered as exact: ``llama``, ``qwen2`` and ``qwen3``
(their blocks name the layers as above; qwen3's per-head q/k norms act on the projections' outputs, which R1
leaves unchanged). Refused with one line, before anything is measured:

* LayerNorm models (quantdyn's own GPT, GPT-NeoX, GPT-2, OLMo-1's non-parametric LayerNorm): LayerNorm subtracts
  each row's mean, and the mean of h R is not that of h. SliceGPT (Ashkboos et al. 2024) makes them exact by
  subtracting the mean inside the weights (the embedding's rows and every stream-writing layer centred) and
  replacing each LayerNorm by an RMSNorm; quantdyn does not do that rewrite (the model would no longer be a
  GPT-NeoX checkpoint), so ``+r1`` is refused there and ``+had``, the per-layer rotation, is what those models get.
* OLMo-2: its RMSNorms sit after the attention and the MLP, on the residual branch (h + norm(attn(h))), so the
  stream's rotation would have to pass through a norm of the branch's output; it does not commute with it.

In a measurement (the engine's block walk) each quantizer's copy of a block is rotated and wrapped
(:class:`ResidualRotated`): it receives the stream in the model's own basis, rotates it, runs the rotated block
and rotates its output back. The quantized layers inside see exactly what the fully rotated model feeds them,
while the streams, the per-block error maps and the head stay in the model's basis (the head, when quantized
with ``-head``, gets R on its input as ``+had`` would, the final norm's scale left unfolded).
:func:`rotate_model` is the offline rotation of a whole model in memory (what a deployment would load).
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn

from quantdyn.errors import QuantdynError
from quantdyn.models.adapters import adapter_for, get_weight, model_type_of
from quantdyn.quantize.catalogue import QuantConfig
from quantdyn.quantize.rotation import check_width, rotate

R1_LAYOUTS: dict[str, dict[str, tuple[str, ...]]] = {
    "llama": {"input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
              "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj"),
              "writes": ("self_attn.o_proj", "mlp.down_proj")},
}
R1_LAYOUTS["qwen2"] = R1_LAYOUTS["qwen3"] = R1_LAYOUTS["llama"]
"""Model types where R1 is exact: {norm: the layers reading it, "writes": the layers writing the stream}."""

_LAYERNORM = "normalises with LayerNorm, whose mean subtraction does not commute with a rotation of the stream"
_WHY_NOT = {
    "olmo2": "olmo2 normalises the attention and MLP outputs (RMSNorm on the residual branch, after the layer), "
             "which a rotation of the residual stream cannot pass",
    **{mt: f"{mt} {_LAYERNORM}" for mt in ("quantdyn-gpt", "gpt_neox", "gpt2", "olmo")},
}
"""Why R1 is not exact, for the architectures known not to allow it."""


def check_r1(model_type: str) -> None:
    """One line naming the architecture when R1 is not exact for it."""
    if model_type in R1_LAYOUTS:
        return
    why = _WHY_NOT.get(model_type, f"{model_type} is not among them (an architecture is added to R1_LAYOUTS once "
                                   "R1 is shown exact for it)")
    raise QuantdynError(f"+r1 (residual-stream rotation) is exact only for RMSNorm pre-norm models "
                        f"({', '.join(sorted(R1_LAYOUTS))}); {why}; use +had (every layer's input rotated) instead")


def _sub(root: nn.Module, path: str) -> nn.Module:
    for part in path.split("."):
        root = getattr(root, part)
    return root


def check_rotations(model: nn.Module, quantizers: Iterable[QuantConfig]) -> None:
    """Refuse, before any work and in one line naming the layer or the architecture, a rotation the model
    cannot take: ``+had`` on a layer whose width has no supported Hadamard matrix, ``+r1`` where it is not
    exact. ``model`` may be a skeleton (parameters on the meta device)."""
    qcs = [q for q in quantizers if isinstance(q, QuantConfig) and (q.hadamard or q.r1)]
    if not qcs:
        return
    adapter = adapter_for(model)
    if any(q.r1 for q in qcs):
        check_r1(model_type_of(model))
        emb = adapter.get_pre_block(model)[0]
        check_width(int(emb.weight.shape[1]), f"the residual stream ({adapter.pre_block[0]})")
    if any(q.hadamard for q in qcs):
        for b, block in enumerate(adapter.get_blocks(model)):
            for name, m in (x for grp in adapter.linear_groups(block) for x in grp):
                check_width(int(get_weight(m).shape[1]), f"layer '{adapter.blocks}.{b}.{name}'")
        if any(q.hadamard and q.quantize_head for q in qcs):
            check_width(int(get_weight(adapter.get_head(model)).shape[1]), f"the head '{adapter.head}'")


# ----------------------------------------------------------------------------- fusing R1 into weights


@torch.no_grad()
def _fold_reader(norm: nn.Module, readers: list[nn.Module], seed: int) -> None:
    """W -> (W diag(γ)) R for every layer reading ``norm``'s output; γ -> 1."""
    gamma = norm.weight.detach().to(torch.float64)
    for m in readers:
        W = get_weight(m).to(torch.float64)
        m.weight.copy_(rotate(W * gamma, seed).to(m.weight.dtype))
    norm.weight.fill_(1.0)


@torch.no_grad()
def _fold_writer(m: nn.Module, seed: int) -> None:
    """W -> Rᵀ W (the output rows rotated), b -> b R."""
    W = get_weight(m).to(torch.float64)
    m.weight.copy_(rotate(W.t().contiguous(), seed).t().to(m.weight.dtype))
    if getattr(m, "bias", None) is not None:
        m.bias.copy_(rotate(m.bias.to(torch.float64), seed).to(m.bias.dtype))


def rotate_block(block: nn.Module, model_type: str, seed: int) -> nn.Module:
    """Fold R1 into one decoder block in place (module docstring) and return it."""
    check_r1(model_type)
    layout = R1_LAYOUTS[model_type]
    for norm, readers in layout.items():
        if norm != "writes":
            _fold_reader(_sub(block, norm), [_sub(block, p) for p in readers], seed)
    for p in layout["writes"]:
        _fold_writer(_sub(block, p), seed)
    return block


class ResidualRotated(nn.Module):
    """A block rotated by R1, between the model's own basis: ``forward(h, ...) = block_R(h R, ...) Rᵀ``."""

    def __init__(self, block: nn.Module, seed: int):
        super().__init__()
        self.block = block
        self.seed = seed

    def forward(self, hidden: torch.Tensor, *args, **kwargs):
        out = self.block(rotate(hidden.float(), self.seed).to(hidden.dtype), *args, **kwargs)
        first = out[0] if isinstance(out, (tuple, list)) else out
        back = rotate(first.float(), self.seed, inverse=True).to(first.dtype)
        return (back, *out[1:]) if isinstance(out, (tuple, list)) else back


def residual_rotated_block(block: nn.Module, model_type: str, seed: int) -> ResidualRotated:
    """``block`` (a copy the caller owns) rotated in place and wrapped (module docstring)."""
    return ResidualRotated(rotate_block(block, model_type, seed), seed)


@torch.no_grad()
def rotate_model(model: nn.Module, seed: int = 0) -> nn.Module:
    """Fold R1 into a whole model in memory, in place: embedding, every block, the final norm into the head. A
    tied head is untied (it takes the final norm's scale, the embedding does not). Returns the model."""
    mt = model_type_of(model)
    check_r1(mt)
    adapter = adapter_for(model)
    emb = adapter.get_pre_block(model)[0]
    head = adapter.get_head(model)
    if head.weight is emb.weight:
        head.weight = nn.Parameter(head.weight.detach().clone())
        if hasattr(getattr(model, "config", None), "tie_word_embeddings"):
            model.config.tie_word_embeddings = False
    check_width(int(emb.weight.shape[1]), f"the residual stream ({adapter.pre_block[0]})")
    emb.weight.copy_(rotate(emb.weight.to(torch.float64), seed).to(emb.weight.dtype))
    for block in adapter.get_blocks(model):
        rotate_block(block, mt, seed)
    _fold_reader(adapter.get_final_norm(model), [head], seed)
    return model

