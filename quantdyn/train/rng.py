"""The random-number generators' state in a checkpoint: what a resume restores so that it continues exactly.

Data order needs no saved state (quantdyn/data/batches.py draws it from (seed, step)); what does is torch's
global generator (dropout, initialisation of anything built after the start) and numpy's global generator
(Kron's preconditioner updates draw from it).  Both are saved as tensors and plain numbers, so a
checkpoint's ``training_state.pt`` loads with ``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import numpy as np
import torch


def rng_states() -> dict:
    """The global generators' states, under the keys ``training_state.pt`` holds them (torch_rng, numpy_rng)."""
    return {"torch_rng": torch.get_rng_state(), "numpy_rng": numpy_rng_state()}


def restore_rng_states(saved: dict) -> None:
    """Set the global generators from what :func:`rng_states` saved (a key that is absent is left alone)."""
    if "torch_rng" in saved:
        torch.set_rng_state(saved["torch_rng"])
    if "numpy_rng" in saved:
        set_numpy_rng(saved["numpy_rng"])


def numpy_rng_state() -> dict:
    """numpy's global RNG state as tensors (loadable with weights_only=True)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos), "has_gauss": int(has_gauss),
            "gauss": float(gauss)}


def set_numpy_rng(d: dict) -> None:
    """numpy's global RNG state from :func:`numpy_rng_state`'s tensors."""
    np.random.set_state(("MT19937", d["keys"].numpy().astype(np.uint32), d["pos"], d["has_gauss"], d["gauss"]))
