"""SIGUSR1 stops a training run with a checkpoint of the step in progress.

SLURM sends SIGUSR1 before a task's time limit when the array was submitted with ``--signal USR1@SECONDS``
(``quantdyn grid --slurm``; launch/slurm.py passes it from the batch shell to the job step); ``kill -USR1
PID`` does the same by hand.  The trainer then finishes the optimizer step it is in, writes a checkpoint of
it (with the online averages, like any checkpoint), and raises :class:`StoppedOnSignal`; ``quantdyn train``
ends with one line and exit status 138 (128 + SIGUSR1), and ``quantdyn train --resume RUN_DIR`` (what a
requeued grid task runs) continues exactly from that step.  SIGTERM (``scancel``, ``scontrol requeue``, a
preemption) is different: it stops at once, and the run resumes from its last scheduled checkpoint.

Every process of a multi-process run gets the signal, but not necessarily between the same two optimizer
steps: the processes agree at the next step where they bring the loss to the host anyway (every step on the
CPU, the logged and checkpointed steps on a GPU), by a mean over the ranks of the flag "I was asked",
so all of them checkpoint the same step and none waits in a collective for another that has stopped.
"""
from __future__ import annotations

import signal
import threading

import torch

from quantdyn.train.distributed import mean_over_ranks

STOP_SIGNAL = signal.SIGUSR1


class StoppedOnSignal(KeyboardInterrupt):
    """The run checkpointed ``step`` and stopped because SIGUSR1 asked it to (a KeyboardInterrupt, so that
    the command line ends it the way it ends Ctrl-C: one line saying how to go on)."""

    exit_code = 128 + int(STOP_SIGNAL)

    def __init__(self, step: int):
        super().__init__(f"stopped on SIGUSR1 after checkpointing step {step}")
        self.step = step


class StopRequest:
    """While installed, SIGUSR1 marks this process as asked to stop; :meth:`agreed` says whether any process is."""

    def __init__(self):
        self.asked = False
        self._previous = None
        self._installed = False

    def install(self) -> "StopRequest":
        """Catch SIGUSR1 (only the main thread can set handlers; elsewhere the signal is left as it is)."""
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(STOP_SIGNAL, self._ask)
            self._installed = True
        return self

    def restore(self) -> None:
        """Put back the handler that was there before :meth:`install`."""
        if self._installed:
            signal.signal(STOP_SIGNAL, self._previous)
            self._installed = False

    def _ask(self, signum, frame) -> None:
        self.asked = True

    def agreed(self, device: torch.device) -> bool:
        """Whether any process was asked to stop: collective under torchrun, so every process calls it after
        the same optimizer steps."""
        return mean_over_ranks(1.0 if self.asked else 0.0, device) > 0
