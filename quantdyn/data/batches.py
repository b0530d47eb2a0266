"""Training batches as a pure function of (seed, step).

The global batch of optimizer step ``s`` is drawn from ``np.random.default_rng([seed, s])`` (:func:`batch_starts`)
and sliced per process and micro-batch by the trainer, so a resumed run, a cooldown branch and a 2-process
DDP or FSDP2 run see exactly the batches a single uninterrupted process would.

    starts = batch_starts(len(data.train), seq_len, seed, step, batch_size * grad_accum * processes)
    x, y = get_batch(data.train, starts[:batch_size], seq_len)     # inputs and next-token targets
"""
from __future__ import annotations

import numpy as np
import torch

from quantdyn.errors import QuantdynError


def batch_starts(n_tokens: int, seq_len: int, seed: int, step: int, count: int, stream: int = 0) -> np.ndarray:
    """Start offsets of the ``count`` sequences of step ``step``'s global batch: a pure function of (seed, step).
    ``stream`` > 0 draws an independent sequence of batches (the optimizer-state estimate's), stream 0 the run's."""
    if n_tokens <= seq_len + 1:
        raise QuantdynError(
            f"the train split has {n_tokens} tokens, fewer than one sequence of {seq_len + 1}; "
            "use more data or a shorter train.seq_len"
        )
    rng = np.random.default_rng([seed, step] if stream == 0 else [seed, step, stream])
    return rng.integers(0, n_tokens - seq_len - 1, size=count)


def get_batch(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets (len(starts), seq_len) of the sequences at ``starts``."""
    rows = np.stack([np.asarray(tokens[s : s + seq_len + 1], dtype=np.int64) for s in starts])
    t = torch.from_numpy(rows)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()
