"""Cooldown branches: the "same model, cooldowns at different token budgets"
experiment of paper A (Figure 5), with constant-LR control twins.

From a stable-phase checkpoint at step S of a parent run, each branch decays
the LR to lr_end over D steps (a WSD schedule with decay_start = S); its
control twin continues at the constant peak LR for the same D steps.  A
decayed endpoint and its control share weights, optimizer state, data order
and token count, so their quantization errors differ only by the decay.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Sequence

from quantdyn.errors import QuantdynError
from quantdyn.runs import (
    BRANCH_PARENT,
    CheckpointInfo,
    RunDir,
    checkpoint_info,
    control_branch,
    cooldown_branch,
    is_resumable,
    latest_resumable,
    list_checkpoints,
    remove_stale_temporaries,
)
from quantdyn.schedules import ScheduleConfig, _steps, lr_at
from quantdyn.train.config import RunConfig, load_run_config
from quantdyn.train.trainer import train


def branch_configs(parent: RunConfig, from_step: int, decay_steps: int, shape: str) -> tuple[RunConfig, RunConfig]:
    """(cooldown, control) configs for one decay length, named as quantdyn.runs names branches."""
    total = parent.train.steps
    warmup = _steps(parent.schedule.warmup, total)
    peak = parent.optim.lr
    if abs(lr_at(from_step - 1, peak, parent.schedule, total) - peak) > 1e-12 * max(peak, 1.0):
        raise QuantdynError(
            f"step {from_step} is not in the parent's stable phase (LR {lr_at(from_step - 1, peak, parent.schedule, total):.3g}"
            f" != peak {peak:.3g}); branch from a checkpoint after warmup and before the decay"
        )
    if decay_steps < 1:
        raise QuantdynError("--decay-steps must be positive")
    steps = from_step + decay_steps
    train = replace(parent.train, steps=steps, checkpoint_tokens=())
    sched = ScheduleConfig(name="wsd", warmup=warmup, decay=decay_steps, decay_start=from_step,
                           decay_shape=shape, lr_end=parent.schedule.lr_end)
    cool = replace(parent, name=cooldown_branch(from_step, decay_steps, shape), schedule=sched, train=train)
    ctrl = replace(parent, name=control_branch(from_step, decay_steps),
                   schedule=ScheduleConfig(name="constant", warmup=warmup), train=train)
    return cool, ctrl


def run_branch(cfg: RunConfig, branch_dir: Path, source: CheckpointInfo, parent: dict, progress: bool = True,
               hooks: Sequence = (), verbose: bool = False) -> Path:
    """Train one branch from ``source``; resume or skip if it already ran. ``hooks``: the trainer's step
    hooks (e.g. ``quantdyn.monitor.hooks_for(cfg)``)."""
    if RunDir(branch_dir).status(cfg.train.steps) == "finished":
        return branch_dir

    partial = latest_resumable(branch_dir)
    kw = dict(parent=parent, progress=progress, hooks=hooks, verbose=verbose)
    if partial is not None and partial.step > source.step:
        return train(cfg, branch_dir, resume=partial, **kw)
    return train(cfg, branch_dir, init_from=source, **kw)


def cooldown(
    run_dir: Path, from_step: int, decay_steps: list[int], shape: str = "linear", control: bool = False,
    progress: bool = True, device: str | None = None, hooks: Sequence = (), verbose: bool = False,
) -> list[Path]:
    """Start cooldown branches (and control twins) from the run's checkpoint at ``from_step``.

    device: overrides the parent's train.device for the branches (e.g. 'cpu', 'cuda:1').
    hooks:  the trainer's step hooks for every branch, e.g. the PTQ monitor of the parent's config:
            ``hooks=quantdyn.monitor.hooks_for(load_run_config(run_dir))`` (the branches share its data).
    Half-written checkpoints that a killed cooldown left in a branch are removed first.
    """
    run_dir = Path(run_dir)
    parent_cfg = load_run_config(run_dir)
    if device:
        parent_cfg = replace(parent_cfg, train=replace(parent_cfg.train, device=device))
    ckpt = RunDir(run_dir).checkpoint(from_step)
    if not is_resumable(ckpt):
        have = [c.step for c in list_checkpoints(run_dir)]
        raise QuantdynError(
            f"run '{run_dir}' has no resumable checkpoint at step {from_step} (checkpoints: {have}); "
            "pick one of those steps with --from-step"
        )
    source = checkpoint_info(ckpt, from_step)
    out = []
    for d in decay_steps:
        cool, ctrl = branch_configs(parent_cfg, from_step, d, shape)
        pairs = [(cool, "cooldown")] + ([(ctrl, "control")] if control else [])
        for cfg, kind in pairs:
            bdir = RunDir(run_dir).branch(cfg.name).path
            remove_stale_temporaries(bdir)
            parent = {"run_dir": BRANCH_PARENT, "run": parent_cfg.name, "from_step": from_step, "kind": kind,
                      "decay_steps": d, "shape": shape if kind == "cooldown" else "constant"}
            out.append(run_branch(cfg, bdir, source, parent, progress, hooks=hooks, verbose=verbose))
    return out
