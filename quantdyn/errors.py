"""User-facing errors.

Every error a user can cause (bad path, unknown key, bad bit width, corrupt
checkpoint, empty data) is raised as :class:`QuantdynError` with a message that
says what is wrong and what to do.  The CLI prints it as one line and exits 2;
library callers can catch it like any exception.
"""
from __future__ import annotations

import difflib
from typing import Iterable, Mapping, Sequence


class QuantdynError(Exception):
    """An error caused by input the user can fix; the message says how."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, a SLURM time limit or ``scancel``) raised as an interrupt, so that the cleanup every
    Ctrl-C path does (spilled streams, temporary files, the "how to go on" line) runs for it too."""

    exit_code = 143  # 128 + SIGTERM, what shells and schedulers expect


def did_you_mean(name: str, choices: Iterable[str], synonyms: Mapping[str, Sequence[str]] | None = None) -> str:
    """Return ' (did you mean 'x'?)' for the closest choice, or ''. Meaning ranks before spelling: with
    ``synonyms`` (a word, lower case without leading dashes -> the choices that mean it, best first), the first of
    those choices that exists wins (`--output` -> `--out`, `-q` -> `--quantizers`); else the closest spelling."""
    choices = [str(c) for c in choices]
    if synonyms:
        for c in synonyms.get(str(name).lstrip("-").lower(), ()):
            if c in choices:
                return f" (did you mean '{c}'?)"
    close = difflib.get_close_matches(str(name), choices, n=1, cutoff=0.5)
    return f" (did you mean '{close[0]}'?)" if close else ""


def unknown_name(kind: str, name: str, choices: Iterable[str]) -> QuantdynError:
    """Build the standard 'unknown X' error with did-you-mean and the valid names."""
    choices = sorted(choices)
    return QuantdynError(
        f"unknown {kind} '{name}'{did_you_mean(name, choices)}; choose one of: {', '.join(choices)}"
    )
