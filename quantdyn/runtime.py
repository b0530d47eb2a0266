"""The process's runtime: device resolution, seeding, and the provenance every result row carries
(git SHA, hardware, library versions).

Nothing in quantdyn changes seeds, threads, TF32 or devices at import time.
"""
from __future__ import annotations

import logging
import os
import platform
import random
import subprocess
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from quantdyn.errors import QuantdynError

log = logging.getLogger("quantdyn")


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):  # torch's message lists every backend type; say what quantdyn takes
        raise QuantdynError(f"device '{name}' is not a device; use cpu, cuda, cuda:N or auto") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise QuantdynError(f"device '{name}' was asked for but no CUDA GPU is visible; use device=cpu")
    return dev


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@lru_cache(maxsize=1)
def git_sha() -> str:
    """SHA of the quantdyn source tree (with '-dirty' if modified), or 'unknown'."""
    here = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5
        ).stdout.strip()
        if not sha:
            return "unknown"
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here, capture_output=True, text=True, timeout=5,
        ).stdout.strip()
        return sha[:12] + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


@lru_cache(maxsize=1)
def hardware() -> str:
    """Short description of the machine for provenance."""
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    cpu = platform.processor() or platform.machine()
    return f"cpu {cpu} x{os.cpu_count()} threads={torch.get_num_threads()}"


def provenance() -> dict:
    """git SHA, hardware and time: the provenance fields of every result row."""
    import time

    return {"git_sha": git_sha(), "hardware": hardware(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
