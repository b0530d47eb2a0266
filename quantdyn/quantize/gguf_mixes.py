"""llama.cpp's per-tensor type recipes: the Q3_K_M / Q4_K_M / Q5_K_M mixes, the tensor categories they key on,
and the shape fallback of every block type.

Reference: ``llama_tensor_get_type`` and ``tensor_type_fallback`` in ``src/llama-quant.cpp``, read at
llama.cpp commit 0c1e570 (2026-10-01), for the dense, non-Falcon architectures quantdyn walks (GPT-NeoX,
LLaMA, GPT-2). tests/test_formats_gguf.py checks every tensor of 16-block models against the types
``llama_model_quantize`` gave them. The block types themselves are ``quantize.gguf``'s objects.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from quantdyn.errors import QuantdynError
from quantdyn.quantize.gguf import GGML_TYPES, QK_K
from quantdyn.registry import Registry

Rule = Callable[[int, int], str]
"""(layer, n_layers) -> the block type of a tensor of one category in that block."""

TENSOR_CATEGORY: dict[str, str] = {
    # GPT-NeoX / Pythia (and quantdyn's GPT)
    "attention.query_key_value": "attn_qkv", "attention.dense": "attn_output",
    "mlp.dense_h_to_4h": "ffn_up", "mlp.dense_4h_to_h": "ffn_down",
    # LLaMA-like (llama, olmo, qwen2)
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    # GPT-2
    "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output", "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down",
}
"""A block's layer (its path inside the block) -> the llama.cpp tensor name it becomes (``blk.N.<name>.weight``),
which is what llama.cpp's type recipe keys on; the head is ``output``."""


def tensor_category(name: str) -> str:
    """llama.cpp's category of a block layer path (``output`` for the head, ``other`` if unknown)."""
    return TENSOR_CATEGORY.get(name, "other")


def fallback_type(t: str, cols: int) -> str | None:
    """The type llama.cpp quantizes a tensor of row length ``cols`` with when ``t`` does not fit (the block
    type's ``fallback``: Q2_K/Q3_K -> Q4_0, Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, 32-weight blocks); None if
    ``t`` fits. Where even the fallback does not fit (rows not a multiple of 32) llama.cpp stores F16, which
    quantdyn refuses instead."""
    g = GGML_TYPES.get(t)
    if cols % g.block == 0:
        return None
    alt = g.fallback or t
    if cols % GGML_TYPES.get(alt).block:
        raise QuantdynError(f"rows of {cols} weights fit no GGUF block type (llama.cpp would store the tensor in F16; "
                            f"quantdyn does not emulate that): GGUF needs a multiple of 32")
    return alt


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's ``use_more_bits``: the first and last eighth of the blocks and every third in between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _more_bits(t: str) -> Rule:
    """Type ``t`` in the blocks where :func:`use_more_bits`, else the mix's default (None)."""
    return lambda i, n: t if use_more_bits(i, n) else None


@dataclass(frozen=True)
class Mix:
    """One of llama.cpp's ``LLAMA_FTYPE_MOSTLY_Q*_K_M`` recipes. A rule returns None for the mix's default."""

    name: str
    """quantdyn's label (``q4_k_m``)."""
    default: str
    """The block type of every tensor no rule names."""
    file_type: int
    """Its ``llama_ftype`` (``general.file_type`` of a GGUF file)."""
    attn_v: Rule
    """attn_v and attn_qkv (llama.cpp counts both as attn_v-like)."""
    ffn_down: Rule
    """ffn_down."""
    attn_output: Rule = lambda i, n: None
    """attn_output."""

    def type_for(self, category: str, layer: int, n_layers: int, cols: int) -> str:
        """The block type ``llama_tensor_get_type`` gives a tensor of ``category`` (:func:`tensor_category`, or
        ``output`` for the head) in block ``layer`` of ``n_layers``, before the shape fallback
        (:func:`fallback_type`). ``layer`` is also llama.cpp's running count of attn_v-like and ffn_down
        tensors when blocks are written in order. The head: Q6_K, or Q8_0 if its rows are not a multiple of
        256."""
        if category == "output":
            return "q8_0" if cols % QK_K else "q6_k"
        rule = {"attn_v": self.attn_v, "attn_qkv": self.attn_v, "ffn_down": self.ffn_down,
                "attn_output": self.attn_output}.get(category)
        return (rule(layer, n_layers) if rule else None) or self.default


MIXES: Registry[Mix] = Registry("GGUF mix")
"""llama.cpp's mixes, by quantdyn's label."""

for _mix in (
    # Q3_K_M: attn_v Q5_K in the first 2 blocks else Q4_K; ffn_down Q5_K in the first sixteenth else Q4_K;
    # attn_output Q4_K
    Mix("q3_k_m", "q3_k", 12, attn_v=lambda i, n: "q5_k" if i < 2 else "q4_k",
        ffn_down=lambda i, n: "q5_k" if i < n // 16 else "q4_k", attn_output=lambda i, n: "q4_k"),
    # Q4_K_M / Q5_K_M: attn_v and ffn_down Q6_K where use_more_bits
    Mix("q4_k_m", "q4_k", 15, attn_v=_more_bits("q6_k"), ffn_down=_more_bits("q6_k")),
    Mix("q5_k_m", "q5_k", 17, attn_v=_more_bits("q6_k"), ffn_down=_more_bits("q6_k")),
):
    MIXES.add(_mix.name, _mix)


def mix_type(mix: str, category: str, layer: int, n_layers: int, cols: int) -> str:
    """The block type llama.cpp's ``llama_tensor_get_type`` gives a tensor in the mix ``mix``
    (:meth:`Mix.type_for`)."""
    return MIXES.get(mix).type_for(category, layer, n_layers, cols)
