"""Writing a run's checkpoints and reading its logged rows; where they go is :mod:`quantdyn.runs`.

A checkpoint (``RUN_DIR/checkpoints/step-N``, see quantdyn/runs.py) is an HF checkpoint directory with
quantdyn's metadata (``quantdyn.json``) and, for a resumable one, ``training_state.pt`` (optimizer, step,
RNG; loaded with weights_only).  Every checkpoint is written to a temporary directory and renamed into
place, so a crash never leaves a half-written checkpoint under its final name.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from quantdyn.errors import QuantdynError
from quantdyn.files import atomic_dir, write_json_atomic
from quantdyn.models.hf_io import save_hf_into
from quantdyn.runs import META, STATE, RunDir
from quantdyn.train.loggers import shared_names


def read_metrics(run_dir: Path) -> list[dict]:
    """The rows of RUN_DIR/metrics.jsonl ([] when there is none; train/loggers.py writes them), with the shared
    metric names (``train/loss``, ``val/loss``, ``train/lr`` ...) also for files written before 0.2, which held
    ``train_loss``, ``val_loss``, ``lr`` ... (loggers.shared_names).  A line that is not a JSON object — the
    torn last line of a killed run — is skipped."""
    p = RunDir(run_dir).metrics
    if not p.is_file():
        return []
    out = []
    for line in p.read_bytes().decode("utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            out.append(shared_names(row))
    return out


def save_checkpoint(
    directory: Path,
    model: torch.nn.Module,
    meta: dict,
    tokenizer=None,
    training_state: dict | None = None,
) -> Path:
    """Atomically write an HF checkpoint + quantdyn metadata (+ training state)."""
    directory = Path(directory)
    with atomic_dir(directory) as tmp:
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is not None and hasattr(model, "config") and not hasattr(model, "save_pretrained"):
            save_hf_into(model, tmp, bos_token_id=eos, eos_token_id=eos)
        else:
            save_hf_into(model, tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        write_json_atomic(tmp / META, {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **meta})
        if training_state is not None:
            torch.save(training_state, tmp / STATE)
    return directory


def load_training_state(ckpt: Path) -> dict:
    p = Path(ckpt) / STATE
    if not p.is_file():
        raise QuantdynError(f"checkpoint '{ckpt}' has no {STATE}; it cannot be resumed (choose another checkpoint)")
    try:
        return torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for a truncated/corrupt file
        raise QuantdynError(f"'{p}' is corrupt ({type(e).__name__}); resume from an earlier checkpoint") from None


def same_training_state(a: Path, b: Path) -> bool:
    """Whether two checkpoints' training states hold the same values (every tensor bit for bit, its dtype and
    shape, every other value and its type): a state loaded and saved again can differ in its bytes (pickle's
    memo of shared objects) while holding the same state."""
    def same(x, y) -> bool:
        if type(x) is not type(y):
            return False
        if isinstance(x, torch.Tensor):
            return x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
        if isinstance(x, dict):
            return list(x) == list(y) and all(same(x[k], y[k]) for k in x)
        if isinstance(x, (list, tuple)):
            return len(x) == len(y) and all(same(u, v) for u, v in zip(x, y))
        return x == y

    return same(load_training_state(a), load_training_state(b))
