"""At a measured process's exit, write its peak GPU memory where the measuring parent reads it.

bench/crosscheck_race.py starts each pipeline in a fresh process with $QUANTDYN_RACE_GPU_PEAK naming a file;
``install()`` (called first thing in that process) registers an exit hook that writes
``{"allocated": bytes, "reserved": bytes}`` there: torch's caching allocator's max_memory_allocated and
max_memory_reserved summed over the GPUs, or nulls where CUDA was never used. Imports nothing heavy itself, so
that the process's host memory is the measured program's own.
"""
from __future__ import annotations

import atexit
import json
import os
import sys

ENV = "QUANTDYN_RACE_GPU_PEAK"


def _write(path: str) -> None:
    torch = sys.modules.get("torch")  # not imported by this module: only what the program itself loaded
    peak = {"allocated": None, "reserved": None}
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        n = range(torch.cuda.device_count())
        peak = {"allocated": sum(torch.cuda.max_memory_allocated(i) for i in n),
                "reserved": sum(torch.cuda.max_memory_reserved(i) for i in n)}
    with open(path, "w") as f:
        json.dump(peak, f)


def install() -> None:
    """Register the exit hook when $QUANTDYN_RACE_GPU_PEAK is set (a no-op otherwise)."""
    path = os.environ.get(ENV)
    if path:
        atexit.register(_write, path)
