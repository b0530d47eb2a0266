"""The noise floor of a measurement: the full-precision model against itself with bf16 rounding injected.

A quantizer's error means little on its own when it is as small as what mere bf16 storage costs. As exllamav3's
qbench does, the floor is measured as one more variant of the same block walk (:class:`BF16NoiseFloor`, a
``BlockTransform``): a copy of every block whose weights are rounded to bf16 and whose output hidden state is
rounded to bf16 before it enters the next block, compared with FP by every error measure a quantizer gets. It
costs one extra block pass per block (like one more RTN quantizer), nothing else.

What it measures depends on the compute dtype (:func:`floor_rounding` names it in the row):

* float32 (or float16) compute: the cost of storing the weights in bf16 and handing bf16 activations from block
  to block. With a bf16 checkpoint computed in float32 (the CPU default) the weights are bf16 already and their
  rounding is a no-op: the floor is then the bf16 rounding of the block outputs alone.
* bf16 compute (a bf16 checkpoint on a GPU or a CPU with bf16 units): weights and block outputs are bf16 already,
  so rounding them would change nothing and the floor would be exactly 0. The floor variant instead computes
  each block in float32 from the same bf16 weights and rounds only its output to bf16: the floor is then the
  bf16 arithmetic inside the blocks, the rounding noise the reference itself carries.

The embedding, final norm and head stay full precision, as the quantizers leave them (``quantize_head`` aside).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from quantdyn.engine.blockwise import block_output
from quantdyn.quantize.catalogue import BlockTransform

NOISE_FLOOR_LABEL = "__noise_floor__"
"""The floor's label among a measurement's variants (never a quantizer's: labels have no underscores first)."""


def floor_rounding(compute_dtype: torch.dtype) -> str:
    """What the floor rounds when blocks compute in ``compute_dtype`` (the row's ``floor_rounding``)."""
    if compute_dtype == torch.bfloat16:
        return "float32 blocks, bf16 block outputs (bf16 compute: the floor is bf16 arithmetic inside blocks)"
    return "bf16 weights and block outputs"


def _float32(x):
    """``x`` with every floating tensor in it (nested in tuples, lists and dicts) as float32."""
    if isinstance(x, torch.Tensor):
        return x.float() if x.is_floating_point() else x
    if isinstance(x, (tuple, list)):
        return type(x)(_float32(v) for v in x)
    if isinstance(x, dict):
        return {k: _float32(v) for k, v in x.items()}
    return x


class _RoundedOutput(nn.Module):
    """A block whose output hidden state is rounded to bf16 (and given back in the stream's dtype); with
    ``float32`` it computes in float32 from float32 copies of its floating inputs."""

    def __init__(self, block: nn.Module, float32: bool):
        super().__init__()
        self.block = block
        self.float32 = float32

    def forward(self, x: torch.Tensor, *args, **kwargs):
        dtype = x.dtype
        if self.float32:
            x, args, kwargs = _float32((x, args, kwargs))
        out = self.block(x, *args, **kwargs)
        h = block_output(out).to(torch.bfloat16).to(dtype)
        return (h, *out[1:]) if isinstance(out, (tuple, list)) else h


class BF16NoiseFloor(BlockTransform):
    """The noise-floor variant of a walk (module docstring): bf16-rounded weights and block outputs, or, when the
    blocks compute in bf16, float32 blocks with bf16 outputs."""

    name = "noise-floor-bf16"

    def block(self, block: nn.Module) -> nn.Module:
        dtype = next((p.dtype for p in block.parameters() if p.is_floating_point()), torch.float32)
        if dtype == torch.bfloat16:
            return _RoundedOutput(block.float(), float32=True)
        with torch.no_grad():
            for p in block.parameters():
                if p.is_floating_point():
                    p.copy_(p.to(torch.bfloat16).to(p.dtype))
        return _RoundedOutput(block, float32=False)
