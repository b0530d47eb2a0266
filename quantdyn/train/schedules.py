"""Learning-rate schedules as pure functions of the step (nanoGPT's get_lr).

    lr = lr_at(step, peak_lr, ScheduleConfig(name="wsd", warmup=0.01, decay=0.2), total_steps)

Shapes (t = step):
  warmup:   linear from 0 to peak over ``warmup`` steps (fraction of total if < 1)
  constant: peak after warmup
  cosine:   peak -> lr_end by half a cosine over the steps after warmup
  linear:   peak -> lr_end linearly over the steps after warmup
  wsd:      warmup, stable at peak, then a decay of ``decay`` steps (fraction of
            total if < 1) starting at ``decay_start`` (default: total - decay),
            shaped linear, cosine or 1-sqrt (Hägele et al. 2024), to lr_end.
Because schedules are pure, sweeps and reports recompute the LR of any
checkpoint from its recorded schedule spec.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from quantdyn.errors import QuantdynError
from quantdyn.registry import Registry


@dataclass(frozen=True)
class ScheduleConfig:
    """A learning-rate schedule; peak LR is optim.lr."""

    name: str = "wsd"
    """constant | cosine | linear | wsd."""
    warmup: float = 0.01
    """Warmup length: a fraction of total steps if < 1, else a step count (paper A: 1 %)."""
    decay: float = 0.2
    """WSD decay length: a fraction of total steps if < 1, else a step count (paper A: 20 %)."""
    decay_start: int = -1
    """WSD step at which the decay starts; -1 = total_steps - decay (cooldown branches set it)."""
    decay_shape: str = "linear"
    """WSD decay shape: linear | cosine | 1-sqrt."""
    lr_end: float = 0.0
    """LR at the end of a decay (absolute value; paper A: 0)."""

    def __post_init__(self):
        if self.warmup < 0 or self.decay < 0:
            raise QuantdynError("schedule.warmup and schedule.decay must be >= 0")
        if self.decay_shape not in DECAY_SHAPES:
            from quantdyn.errors import unknown_name

            raise unknown_name("schedule.decay_shape", self.decay_shape, DECAY_SHAPES)
        if self.lr_end < 0:
            raise QuantdynError("schedule.lr_end must be >= 0")


def _steps(x: float, total: int) -> int:
    return int(round(x * total)) if x < 1 else int(x)


DECAY_SHAPES: dict[str, Callable[[float], float]] = {
    # progress p in [0, 1] -> remaining fraction of (peak - lr_end)
    "linear": lambda p: 1.0 - p,
    "cosine": lambda p: 0.5 * (1.0 + math.cos(math.pi * p)),
    "1-sqrt": lambda p: 1.0 - math.sqrt(p),
}

SCHEDULES: Registry[Callable[[int, float, ScheduleConfig, int], float]] = Registry("schedule")


def _warmup(step: int, peak: float, cfg: ScheduleConfig, total: int) -> float | None:
    w = _steps(cfg.warmup, total)
    if w > 0 and step < w:
        return peak * (step + 1) / w
    return None


@SCHEDULES.register("constant")
def constant(step: int, peak: float, cfg: ScheduleConfig, total: int) -> float:
    w = _warmup(step, peak, cfg, total)
    return peak if w is None else w


def _anneal(step: int, peak: float, cfg: ScheduleConfig, total: int, shape: str) -> float:
    w = _warmup(step, peak, cfg, total)
    if w is not None:
        return w
    start = _steps(cfg.warmup, total)
    p = min(1.0, max(0.0, (step - start) / max(1, total - 1 - start)))
    return cfg.lr_end + (peak - cfg.lr_end) * DECAY_SHAPES[shape](p)


@SCHEDULES.register("cosine")
def cosine(step: int, peak: float, cfg: ScheduleConfig, total: int) -> float:
    return _anneal(step, peak, cfg, total, "cosine")


@SCHEDULES.register("linear")
def linear(step: int, peak: float, cfg: ScheduleConfig, total: int) -> float:
    return _anneal(step, peak, cfg, total, "linear")


def wsd_bounds(cfg: ScheduleConfig, total: int) -> tuple[int, int]:
    """(decay_start, decay_steps) of a WSD schedule."""
    d = _steps(cfg.decay, total)
    start = cfg.decay_start if cfg.decay_start >= 0 else total - d
    return start, d


@SCHEDULES.register("wsd")
def wsd(step: int, peak: float, cfg: ScheduleConfig, total: int) -> float:
    w = _warmup(step, peak, cfg, total)
    if w is not None:
        return w
    start, d = wsd_bounds(cfg, total)
    if step < start or d == 0:
        return peak
    p = min(1.0, (step - start + 1) / d)
    return cfg.lr_end + (peak - cfg.lr_end) * DECAY_SHAPES[cfg.decay_shape](p)


def lr_at(step: int, peak: float, cfg: ScheduleConfig, total: int) -> float:
    """The LR used for the optimizer update of ``step`` (0-based)."""
    return SCHEDULES.get(cfg.name)(step, peak, cfg, total)


def is_decaying(step: int, cfg: ScheduleConfig, total: int) -> bool:
    """Whether ``step`` lies in a decay phase (for plots and summaries)."""
    if cfg.name == "constant":
        return False
    if cfg.name == "wsd":
        start, d = wsd_bounds(cfg, total)
        return d > 0 and step >= start
    return step >= _steps(cfg.warmup, total)
