"""Where a measurement's time goes: wall seconds per phase, added up by the engine as it works.

The phases, each timed where the work happens (never nested, so they add up to at most the whole):

* ``read``            — reading tensors from the checkpoint files (``LazyModel.load``: positioned reads);
* ``convert``         — turning what was read into compute tensors: dtype conversion (bf16 -> fp32 when computing
                        in float32) and the move to the compute device;
* ``capture``         — running the embedding to capture every block's inputs (``blockwise.capture_inputs``);
* ``calib_forward``   — calibration forwards through the blocks, with the per-layer input statistics they collect
                        (GPTQ's Hessians H = 2/N Σ x xᵀ are accumulated here), and advancing each quantizer's
                        calibration stream through its quantized block;
* ``quantize_layers`` — the quantizer functions (GPTQ, RTN, AWQ, ...) on each layer (with what they compute
                        themselves: RTN's and AWQ's loss is the exact output error, in float64);
* ``diagnostics``     — the per-layer rows' output error ½ tr(ΔW H ΔWᵀ) and its reference ½ tr(W H Wᵀ): two
                        out x in x in products per layer, as much work as GPTQ itself;
* ``eval_forward``    — carrying the evaluation (probe) windows through the full-precision and quantized blocks
                        (and the propagation analysis when asked);
* ``head``            — final norm and head: logits, CE, KL and agreement per window.

:class:`PhaseTimer` is a plain accumulator; ``timer("read")`` is a context manager that adds the time spent
inside it.
"""
from __future__ import annotations

import contextlib
import time
from typing import Iterator

PHASES = ("read", "convert", "capture", "calib_forward", "quantize_layers", "diagnostics", "eval_forward", "head")


class PhaseTimer:
    """Wall seconds per phase of :data:`PHASES` (see module docstring)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        if phase not in self.seconds:
            raise ValueError(f"unknown phase '{phase}' (phases: {', '.join(PHASES)})")
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - t0


def time_phase(timer: PhaseTimer | None, phase: str) -> contextlib.AbstractContextManager:
    """``timer(phase)``, or nothing when there is no timer."""
    return timer(phase) if timer is not None else contextlib.nullcontext()
