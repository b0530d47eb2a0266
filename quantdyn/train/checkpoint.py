"""Checkpoint directories of a run.

    RUN_DIR/
      config.yaml                 resolved RunConfig
      run.json                    run identity, parent link (cooldown branches), data cache
      metrics.jsonl               one row per log/eval event
      checkpoints/step-0000400/   HF checkpoint: config.json, model.safetensors, tokenizer files,
                                  quantdyn.json (step, tokens, lr, schedule, config, git SHA),
                                  training_state.pt (optimizer, step, RNG; loaded weights_only)
      branches/NAME/              child runs (cooldowns, constant-LR controls), same layout
      averages/NAME/              averaged checkpoints (LAWA, EMA, soups) as HF checkpoints

Every checkpoint is written to a temporary directory and renamed into place,
so a crash never leaves a half-written checkpoint under its final name; the
temporaries a killed process leaves (``.step-*.tmp-*``, ``.step-*.old-*``) are
removed when the run next starts (:func:`remove_stale_temporaries`).
"""
from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from quantdyn.errors import QuantdynError
from quantdyn.files import atomic_dir, write_json_atomic
from quantdyn.models.hf_io import save_hf_into
from quantdyn.train.loggers import shared_names

META = "quantdyn.json"
STATE = "training_state.pt"


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int
    tokens: int
    lr: float | None
    meta: dict


def step_name(step: int) -> str:
    """The directory name of the checkpoint at ``step`` (``step-0000400``)."""
    return f"step-{step:07d}"


@dataclass(frozen=True)
class RunDir:
    """Where each part of a run directory lives (the layout in this module's docstring): the one place
    that knows the names."""

    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    @property
    def config(self) -> Path:
        return self.path / "config.yaml"

    @property
    def info(self) -> Path:
        return self.path / "run.json"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def averages(self) -> Path:
        return self.path / "averages"

    @property
    def branches(self) -> Path:
        return self.path / "branches"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / step_name(step)

    def average(self, name: str, step: int) -> Path:
        return self.averages / name / step_name(step)

    def branch(self, name: str) -> "RunDir":
        return RunDir(self.branches / name)

    def status(self, steps: int) -> str:
        """'finished' (a checkpoint at ``steps`` or later), 'partial' (a resumable checkpoint before it) or
        'new' — what every "train, resume or skip" decision asks."""
        if any(c.step >= steps for c in list_checkpoints(self.path)):
            return "finished"
        return "partial" if latest_resumable(self.path) is not None else "new"

    def read_info(self) -> dict:
        """run.json ({} when the run has none yet); an unreadable one is one line."""
        if not self.info.is_file():
            return {}
        try:
            info = json.loads(self.info.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise QuantdynError(f"'{self.info}' is not valid JSON; restore it or remove the run directory") from None
        if not isinstance(info, dict):
            raise QuantdynError(f"'{self.info}' must hold a JSON object; restore it or remove the run directory")
        return info


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return RunDir(run_dir).checkpoint(step)


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


def read_meta(ckpt: Path) -> dict:
    p = Path(ckpt) / META
    if not p.is_file():
        return {}
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError:
        raise QuantdynError(f"'{p}' is corrupt (invalid JSON); delete the checkpoint directory and re-create it") from None


def load_training_state(ckpt: Path) -> dict:
    p = Path(ckpt) / STATE
    if not p.is_file():
        raise QuantdynError(f"checkpoint '{ckpt}' has no {STATE}; it cannot be resumed (choose another checkpoint)")
    try:
        return torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for a truncated/corrupt file
        raise QuantdynError(f"'{p}' is corrupt ({type(e).__name__}); resume from an earlier checkpoint") from None


def list_checkpoints(run_dir: Path) -> list[CheckpointInfo]:
    """The run's own checkpoints (not its branches), sorted by step."""
    root = RunDir(run_dir).checkpoints
    out = []
    if root.is_dir():
        for d in sorted(root.iterdir()):
            if d.is_dir() and d.name.startswith("step-") and (d / "model.safetensors").is_file():
                meta = read_meta(d)
                out.append(CheckpointInfo(d, int(meta.get("step", d.name[5:])), int(meta.get("tokens", 0)), meta.get("lr"), meta))
    return sorted(out, key=lambda c: c.step)


def latest_resumable(run_dir: Path) -> CheckpointInfo | None:
    for c in reversed(list_checkpoints(run_dir)):
        if (c.path / STATE).is_file():
            return c
    return None


def has_checkpoints(run_dir: Path) -> list[int]:
    """Steps of the checkpoints a run directory holds (any ``checkpoints/step-*`` directory)."""
    root = RunDir(run_dir).checkpoints
    if not root.is_dir():
        return []
    steps = []
    for d in root.iterdir():
        if d.is_dir() and d.name.startswith("step-") and d.name[5:].isdigit():
            steps.append(int(d.name[5:]))
    return sorted(steps)


def _stale(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    return [p for p in directory.iterdir() if p.name.startswith(".step-") and (".tmp-" in p.name or ".old-" in p.name)]


def remove_stale_temporaries(run_dir: Path) -> list[Path]:
    """Remove the half-written checkpoint directories a killed process left behind
    (``checkpoints/.step-*.tmp-*`` and ``.step-*.old-*``, the same under ``averages/*/``).

    Call only when no other process writes checkpoints of this run (at the start of training).
    Returns what was removed.
    """
    rd = RunDir(run_dir)
    found = _stale(rd.checkpoints)
    averages = rd.averages
    if averages.is_dir():
        for d in sorted(averages.iterdir()):
            found += _stale(d)
    for p in found:
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    return found


#: what a run directory holds that a fresh start of the run replaces (see :func:`clear_run`)
RUN_CONTENTS = ("checkpoints", "averages", "branches", "metrics.jsonl", "run.json", "config.yaml")


def clear_run(run_dir: Path) -> None:
    """Delete a run's checkpoints, averages, branches and logs (``train --overwrite``)."""
    run_dir = Path(run_dir)
    for name in RUN_CONTENTS:
        p = run_dir / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
