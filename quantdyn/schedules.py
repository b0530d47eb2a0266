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

Multi-phase schedules (public training runs: Pythia's clamped cosine, OLMo-2's
cosine over tokens then a linear stage 2, SmolLM3's WSD) are a
:class:`PhaseSchedule`: phases over one coordinate (steps or tokens), each
moving the LR from ``lr_start`` to ``lr_end`` along one of the same shapes the
trainer uses (``DECAY_SHAPES``)::

    s = PhaseSchedule((Phase("warmup", "linear", 0, 1430, 0.0, 6e-4),
                       Phase("cosine", "cosine", 1430, 144430, 6e-4, 0.0, floor=6e-5)))
    schedule_lr(72000, s), schedule_phase(72000, s), schedule_decaying(72000, s)

``phases_of(cfg, peak, total)`` writes a :class:`ScheduleConfig` as phases, so
both describe one family of curves (a test holds them equal step by step).

"Decaying" means one thing everywhere: past warmup (not in a phase that raises
the LR) and the LR below the peak.  A constant tail at a floor after a decay
(Pythia's min_lr clamp) still counts as decayed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

from quantdyn.errors import QuantdynError, unknown_name
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
        if self.name not in SCHEDULES:
            raise unknown_name("schedule", self.name, SCHEDULES.names())
        if self.warmup < 0 or self.decay < 0:
            raise QuantdynError("schedule.warmup and schedule.decay must be >= 0")
        if self.decay_shape not in DECAY_SHAPES:
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
    """Whether the LR of update ``step`` is decayed: past warmup and below the peak (for plots and summaries).

    The same definition as :func:`schedule_decaying` (the trainer's schedules have no floor); it depends on
    the shape only, not on the LR values."""
    if step < _steps(cfg.warmup, total):
        return False
    return lr_at(step, 1.0, replace(cfg, lr_end=0.0), total) < 1.0 - _REL_TOL


# ---------------------------------------------------------------------------------------------------------------
# Multi-phase schedules (public training runs)

_REL_TOL = 1e-12
"""Relative tolerance of "below the peak": an LR within this fraction of the peak is at the peak."""

PHASE_SHAPES = ("constant", *DECAY_SHAPES)
"""Shapes of a phase: constant, or one of the trainer's decay shapes (used upward for a warmup)."""

SCHEDULE_UNITS = ("steps", "tokens")


@dataclass(frozen=True)
class Phase:
    """One piece of a multi-phase schedule: from ``start`` to ``end`` the LR moves from ``lr_start`` to
    ``lr_end`` along ``shape``; after ``end`` it stays at ``lr_end`` until the next phase starts."""

    name: str = ""
    """Label in dry runs and plots: warmup, stable, cosine, decay, ... ('' = the shape's name)."""
    shape: str = "linear"
    """constant | linear | cosine | 1-sqrt: the remaining fraction of (lr_start - lr_end) at progress p,
    exactly as the trainer's decays (a warmup is a linear phase whose lr_end is above its lr_start)."""
    start: float = 0.0
    """Where the phase begins, in the schedule's unit; it applies until the next phase's start."""
    end: float = 0.0
    """Where the shape reaches lr_end (its horizon). May lie past the next phase's start or past the end of
    training: a truncated cosine (OLMo-2's stage 1 stops at 3.9T tokens of a 5T cosine)."""
    lr_start: float = 0.0
    """LR at ``start`` (absolute)."""
    lr_end: float = 0.0
    """LR at ``end`` (absolute); a constant phase has lr_end == lr_start."""
    floor: float = 0.0
    """The LR never goes below this inside the phase: GPT-NeoX/Megatron's ``max(lr, min_lr)`` clamp."""

    def __post_init__(self):
        if self.shape not in PHASE_SHAPES:
            raise unknown_name("phase shape", self.shape, PHASE_SHAPES)
        where = f"phase '{self.label}'"
        if min(self.lr_start, self.lr_end, self.floor) < 0:
            raise QuantdynError(f"{where}: lr_start, lr_end and floor must be >= 0")
        if self.shape == "constant":
            if self.lr_end != self.lr_start:
                raise QuantdynError(f"{where}: a constant phase needs lr_end == lr_start (got {self.lr_start:g} and "
                                    f"{self.lr_end:g}); use a linear phase to change the LR")
        elif not self.end > self.start:
            raise QuantdynError(f"{where}: end ({self.end:g}) must lie after start ({self.start:g})")

    @property
    def label(self) -> str:
        return self.name or self.shape

    @property
    def rising(self) -> bool:
        """A warmup (the LR goes up in this phase)."""
        return self.shape != "constant" and self.lr_end > self.lr_start


@dataclass(frozen=True)
class PhaseSchedule:
    """A learning-rate schedule as phases over one coordinate (steps or tokens trained)."""

    phases: tuple[Phase, ...] = ()
    """The phases in order of ``start``."""
    unit: str = "steps"
    """steps | tokens: what ``start``/``end`` and the position passed to the functions below count."""
    peak_lr: float = 0.0
    """The peak LR ("decaying" = below it); 0 = the largest LR any phase reaches."""

    def __post_init__(self):
        if not self.phases:
            raise QuantdynError("a phase schedule needs at least one phase")
        if self.unit not in SCHEDULE_UNITS:
            raise unknown_name("schedule unit", self.unit, SCHEDULE_UNITS)
        starts = [p.start for p in self.phases]
        if starts != sorted(starts):
            raise QuantdynError(f"schedule phases must be in order of start (got starts {starts})")
        if self.peak_lr < 0:
            raise QuantdynError("schedule peak_lr must be >= 0")

    @property
    def peak(self) -> float:
        return self.peak_lr or max(max(p.lr_start, p.lr_end) for p in self.phases)


def _phase_index(x: float, sched: PhaseSchedule) -> int:
    i = 0
    for k, p in enumerate(sched.phases):
        if p.start <= x:
            i = k
    return i


def _phase_value(x: float, p: Phase) -> tuple[float, bool]:
    """(LR, whether the floor binds) of phase ``p`` at ``x``."""
    if p.shape == "constant":
        lr = p.lr_start
    else:
        prog = min(1.0, max(0.0, (x - p.start) / (p.end - p.start)))
        lr = p.lr_end + (p.lr_start - p.lr_end) * DECAY_SHAPES[p.shape](prog)
    if lr < p.floor:
        return p.floor, True
    return lr, False


def schedule_state(x: float, sched: PhaseSchedule, peak: float | None = None) -> tuple[float, str, bool]:
    """(LR, phase label, decaying) at position ``x`` (steps or tokens trained, in ``sched.unit``).

    The label gets '-floor' where a floor clamp holds the LR; decaying = not in a rising phase, the LR below
    ``peak`` (default: the schedule's peak) and not held by a floor: a floor is a constant LR (GPT-NeoX's
    min_lr, e.g. Pythia's last ~20 % of steps), like a stable phase at a lower LR, not a decay."""
    p = sched.phases[_phase_index(x, sched)]
    lr, floored = _phase_value(x, p)
    top = sched.peak if peak is None else peak
    decaying = not floored and not (p.rising and x < p.end) and lr < top * (1.0 - _REL_TOL)
    return lr, p.label + ("-floor" if floored else ""), decaying


def schedule_lr(x: float, sched: PhaseSchedule) -> float:
    """The LR at position ``x``."""
    return schedule_state(x, sched)[0]


def schedule_decaying(x: float, sched: PhaseSchedule, peak: float | None = None) -> bool:
    """Whether the LR at ``x`` is decayed: past warmup, below the peak and not held by a floor."""
    return schedule_state(x, sched, peak)[2]


def schedule_curve(sched: PhaseSchedule, lo: float, hi: float, n: int = 400) -> list[tuple[float, float]]:
    """(position, LR) samples over [lo, hi] for plots, phase boundaries included."""
    if hi <= lo:
        return [(lo, schedule_lr(lo, sched))]
    xs = {lo + (hi - lo) * k / (n - 1) for k in range(n)}
    for p in sched.phases:
        xs.update(v for v in (p.start, p.end) if lo <= v <= hi)
    return [(x, schedule_lr(x, sched)) for x in sorted(xs)]


def phases_of(cfg: ScheduleConfig, peak: float, total: int) -> PhaseSchedule:
    """``cfg`` (the trainer's schedule) as phases over the 0-based update index, equal to :func:`lr_at`."""
    w = _steps(cfg.warmup, total)
    phases = [Phase("warmup", "linear", -1, w - 1, 0.0, peak)] if w > 0 else []
    if cfg.name == "constant":
        phases.append(Phase("stable", "constant", w, w, peak, peak))
    elif cfg.name in ("cosine", "linear"):
        phases.append(Phase(cfg.name, cfg.name, w, w + max(1, total - 1 - w), peak, cfg.lr_end))
    else:  # wsd
        start, d = wsd_bounds(cfg, total)
        if d == 0 or start > w:
            phases.append(Phase("stable", "constant", w, w, peak, peak))
        if d > 0:
            s0 = max(start - 1, w)  # the decay's progress is (step - start + 1) / d
            phases.append(Phase("decay", cfg.decay_shape, s0, start - 1 + d, peak, cfg.lr_end))
    return PhaseSchedule(tuple(phases), "steps", peak)


def _num(v: float) -> str:
    if v == 0:
        return "0"
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(v) >= div:
            return f"{v / div:.4g}{unit}"
    return f"{v:.4g}"


def lr_text(v: float) -> str:
    """An LR as people write it: 6e-4, 3e-5, 0.01, 0."""
    if v == 0:
        return "0"
    if abs(v) >= 1e-2:
        return f"{v:.3g}"
    mantissa, exp = f"{v:.2e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exp)}"


def floor_start(p: Phase) -> float | None:
    """Where the floor clamp of phase ``p`` starts to hold the LR (None: it never binds inside the phase)."""
    if p.shape == "constant" or not p.floor or min(p.lr_start, p.lr_end) >= p.floor:
        return None
    lo, hi = p.start, p.end  # the LR falls monotonically from lr_start: bisect its crossing of the floor
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _phase_value(mid, p)[1] is False else (lo, mid)
    return hi


def describe_phase(p: Phase) -> str:
    """One phase: its shape, the LR it goes between and where (a floor that binds is its end)."""
    if p.shape == "constant":
        return f"{p.label} {lr_text(p.lr_start)} from {_num(p.start)}"
    held = floor_start(p)
    if held is None:
        return f"{p.label} {lr_text(p.lr_start)} -> {lr_text(p.lr_end)} over {_num(p.start)}-{_num(p.end)}"
    return (f"{p.label} {lr_text(p.lr_start)} -> {lr_text(p.floor)} over {_num(p.start)}-{_num(held)}, "
            f"then {lr_text(p.floor)} (floor)")


def describe_schedule(sched: PhaseSchedule) -> str:
    """One line: each phase's shape, LRs and extent."""
    unit = "tok" if sched.unit == "tokens" else "steps"
    return "; ".join(describe_phase(p) for p in sched.phases) + f" [{unit}]"
