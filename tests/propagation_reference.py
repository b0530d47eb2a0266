"""The in-memory reference of paper B's error propagation, for the tests: two whole models (a full-precision one and
its quantized copy) run side by side with hooks, as the analysis was first written. The engine computes the same
sums inside its block walk (``measure(..., propagation_ids=...)``); tests hold the two against each other."""
from __future__ import annotations

import torch
import torch.nn as nn

from quantdyn.analysis.propagation import BlockFn, finalize_propagation, propagation_sums
from quantdyn.engine.blockwise import capture_inputs, first_block_inputs
from quantdyn.errors import QuantdynError
from quantdyn.models.adapters import adapter_for
from quantdyn.models.gpt import GPT


def add_sums(total: list[dict[str, float]] | None, new: list[dict[str, float]]) -> list[dict[str, float]]:
    """Element-wise sum of two :func:`propagation_sums` results (None = empty)."""
    if total is None:
        return [dict(s) for s in new]
    return [{k: t[k] + n[k] for k in t} for t, n in zip(total, new)]


def gpt_error_propagation(
    fp_model: nn.Module,
    q_model: nn.Module,
    ids: torch.Tensor,
    batch_size: int = 8,
) -> list[dict]:
    """:func:`error_propagation` for two quantdyn GPTs of the same shape.

    ``ids``: LongTensor [N, T]; run in chunks of ``batch_size`` in eval mode
    under ``torch.no_grad`` (modes restored after), sums accumulated over all
    tokens.  h_0 = ``fp_model``'s embedding of ``ids``, h^q_0 = ``q_model``'s
    (equal unless the quantizer touched the embedding).  Blocks are
    ``model.gpt_neox.layers`` called as ``block(h, rope)``.
    """

    for m, what in ((fp_model, "full-precision"), (q_model, "quantized")):
        if not isinstance(m, GPT):
            raise QuantdynError(f"error propagation: the {what} model is a {type(m).__name__}, not a quantdyn GPT")
    if fp_model.config.n_layer != q_model.config.n_layer or fp_model.config.d_model != q_model.config.d_model:
        raise QuantdynError("error propagation: the quantized model's shape differs from the full-precision model's")
    return model_error_propagation(fp_model, q_model, ids, batch_size)


def _call(block: nn.Module, rest: tuple, kwargs: dict) -> BlockFn:
    def f(h: torch.Tensor) -> torch.Tensor:
        out = block(h, *rest, **kwargs)
        return out[0] if isinstance(out, (tuple, list)) else out

    return f


def model_error_propagation(
    fp_model: nn.Module,
    q_model: nn.Module,
    ids: torch.Tensor,
    batch_size: int = 8,
) -> list[dict]:
    """:func:`error_propagation` for any model with a block adapter
    (``quantdyn.models.adapters``: quantdyn GPT, HF GPT-NeoX, Llama-like,
    GPT-2, ...) and its quantized copy of the same architecture.

    The inputs of every block (hidden states and the extra arguments the model
    passes to it: rotary tables / ``position_embeddings``, masks, which may
    differ per layer as in Qwen2's sliding-window layers) are captured with
    pre-hooks; h_0 and h^q_0 come from each model's own embedding, the extra
    arguments from ``fp_model`` and are passed to the same block of both.  Chunks of ``batch_size``
    sequences, eval mode, ``torch.no_grad``; sums accumulated over all tokens.
    """

    if ids.dim() != 2 or ids.size(0) == 0:
        raise QuantdynError(f"error propagation: ids must be token ids shaped [N, T], got {tuple(ids.shape)}")
    if batch_size < 1:
        raise QuantdynError(f"error propagation: batch_size={batch_size} must be >= 1")
    fp_blocks = adapter_for(fp_model).get_blocks(fp_model)
    q_blocks = adapter_for(q_model).get_blocks(q_model)
    device = next(fp_model.parameters()).device
    modes = (fp_model.training, q_model.training)
    total = None
    try:
        fp_model.eval()
        q_model.eval()
        with torch.no_grad():
            for i in range(0, ids.size(0), batch_size):
                x = ids[i : i + batch_size].to(device)
                h, (rest, kw) = first_block_inputs(fp_model, fp_blocks, x)
                tuple_out = isinstance(fp_blocks[0](h, *rest, **kw), (tuple, list))
                cap = capture_inputs(fp_model, fp_blocks, x, device, x.size(0), tuple_out)
                h0 = cap.hiddens[0]
                h0_q = first_block_inputs(q_model, q_blocks, x)[0]
                fp = [_call(b, *cap.args(k, 0)) for k, b in enumerate(fp_blocks)]
                qb = [_call(b, *cap.args(k, 0)) for k, b in enumerate(q_blocks)]
                total = add_sums(total, propagation_sums(fp, qb, h0, h0_q))
    finally:
        fp_model.train(modes[0])
        q_model.train(modes[1])
    return finalize_propagation(total)
