"""Progress of long work: a tqdm bar on a terminal, plain periodic lines anywhere else.

A bar's carriage returns turn a log file (``make demo > log``, CI, SLURM's output file) into one line of
tens of thousands of characters; off a terminal :class:`Progress` writes instead one plain line at most
every ``every_s`` seconds, or every ``every_n`` units (done/total, the latest values set with
:meth:`Progress.set_postfix`, rate, elapsed, ETA), and one at the end.  The one progress implementation:
sweeps, tokenizing and training (``train.loggers.show_logged`` puts a run's loss and LR on it) all use it.
"""
from __future__ import annotations

import sys
import time
from typing import Iterable, Iterator, TextIO, TypeVar

T = TypeVar("T")

__all__ = ["Progress", "progress", "duration"]


def duration(seconds: float) -> str:
    """1h02m, 3m05s, 12.3s."""
    if seconds >= 3600:
        return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"
    if seconds >= 60:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{seconds:.1f}s"


def _amount(x: float, scale: bool) -> str:
    if abs(x) < 100 and x != int(x):
        return f"{x:.3g}"
    if not scale:
        return f"{x:,.0f}"
    for unit, f in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= f:
            return f"{x / f:.2f}{unit}"
    return f"{x:.0f}"


class Progress:
    """Counts work done.  ``enabled`` False: silent.  ``tty`` None: whether ``stream`` is a terminal.

    ``initial``: work already done before (a resumed run), counted but not in the rate.  Off a terminal a plain
    line is written every ``every_s`` seconds, or every ``every_n`` units when that is given."""

    def __init__(self, desc: str, total: int | None = None, enabled: bool = True, unit: str = "it",
                 unit_scale: bool = False, stream: TextIO | None = None, every_s: float = 30.0,
                 tty: bool | None = None, initial: int = 0, every_n: int = 0):
        self.desc, self.total, self.enabled, self.unit, self.unit_scale = desc, total, enabled, unit, unit_scale
        self.stream = stream or sys.stderr
        self.every_s, self.every_n = every_s, max(0, every_n)
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)()) if tty is None else tty
        self.n = self.initial = self.last_n = initial
        self.t0 = self.last = time.perf_counter()
        self.postfix: dict[str, str] = {}
        self.bar = None
        self.closed = False
        if enabled and self.tty:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, unit_scale=unit_scale,
                            file=self.stream, dynamic_ncols=True)

    def line(self, final: bool = False) -> str:
        elapsed = time.perf_counter() - self.t0
        done = _amount(self.n, self.unit_scale)
        parts = [f"{done}/{_amount(self.total, self.unit_scale)} {self.unit}" if self.total is not None
                 else f"{done} {self.unit}"]
        if self.total:
            parts[0] += f" ({100.0 * self.n / self.total:.0f}%)"
        parts += [f"{k} {v}" for k, v in self.postfix.items()]
        worked = self.n - self.initial
        if elapsed > 0 and worked:
            parts.append(f"{_amount(worked / elapsed, self.unit_scale)} {self.unit}/s")
        parts.append(("took " if final else "elapsed ") + duration(elapsed))
        if not final and self.total and worked:
            parts.append("eta " + duration(elapsed / worked * max(0, self.total - self.n)))
        return f"{self.desc}: " + ", ".join(parts)

    def set_postfix(self, values: dict[str, str]) -> None:
        """Values to show beside the count (e.g. a training loss): kept until set again."""
        self.postfix.update(values)
        if self.bar is not None:
            self.bar.set_postfix(self.postfix, refresh=False)

    def update(self, n: int = 1) -> None:
        self.n += n
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(n)
            return
        now = time.perf_counter()
        due = self.n - self.last_n >= self.every_n if self.every_n else now - self.last >= self.every_s
        if due and (self.total is None or self.n < self.total):  # the end has its own line (close)
            self.last, self.last_n = now, self.n
            print(self.line(), file=self.stream, flush=True)

    def write(self, text: str) -> None:
        """A line of its own that does not break the bar (nothing when disabled)."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def note(self, text: str) -> None:
        """A line of its own, after the description: ``desc: text``."""
        self.write(f"{self.desc}: {text}")

    def close(self, summary: bool = True) -> None:
        """Close the bar; off a terminal write the final line (done, rate, time taken) unless ``summary`` is
        False (work that ended in an error)."""
        if self.closed:
            return
        self.closed = True
        if self.bar is not None:
            self.bar.close()
        elif self.enabled and summary:
            print(self.line(final=True), file=self.stream, flush=True)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress(items: Iterable[T], desc: str, total: int | None = None, enabled: bool = True, unit: str = "it",
             **kw) -> Iterator[T]:
    """``items`` with a :class:`Progress` counting them (the end line is written when they run out)."""
    if total is None:
        try:
            total = len(items)  # type: ignore[arg-type]
        except TypeError:
            total = None
    with Progress(desc, total=total, enabled=enabled, unit=unit, **kw) as p:
        for x in items:
            yield x
            p.update()
