"""Start `quantdyn` command lines as child processes in a second each, so they can be killed at random points.

A plain ``python -m quantdyn.cli`` pays 2-6 s importing torch before it does anything, and a kill in that
time tests nothing.  Children here fork from a multiprocessing fork server that imported quantdyn and torch
once (and ran no torch op, so forking is safe); each child runs exactly what the console script runs,
``quantdyn.cli.main(argv)``, with its own working directory and stdout/stderr files.
"""
from __future__ import annotations

import multiprocessing
import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

# what train, cooldown and sweep import (a missing name is skipped by the fork server)
PRELOAD = ["torch", "torch._dynamo", "transformers", "transformers.models.auto.modeling_auto",
           "transformers.models.auto.tokenization_auto", "transformers.models.gpt_neox.configuration_gpt_neox",
           "tokenizers", "safetensors.torch", "quantdyn.cli", "quantdyn.data.prepare", "quantdyn.models.hf_io",
           "quantdyn.train.trainer", "quantdyn.train.branches", "quantdyn.sweep.sweep", "quantdyn.quantize",
           "quantdyn.evaluate.quant_error"]


def _child(argv: list[str], cwd: str, out: str, err: str, env: dict[str, str], fsize: int | None) -> None:
    os.environ.update(env)
    if fsize is not None:  # a disk that is full after `fsize` bytes per file (writes fail with EFBIG)
        import resource

        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | (0 if path.endswith(".fifo") else os.O_TRUNC), 0o644)
        os.dup2(f, fd)
        os.close(f)
    os.chdir(cwd)
    sys.argv = ["quantdyn", *argv]
    from quantdyn.cli import main

    main(argv)


def _copy_fifo(fifo: str, log: Path) -> None:
    with open(fifo, "rb") as src, open(log, "wb") as dst:
        shutil.copyfileobj(src, dst)


@dataclass
class Child:
    proc: multiprocessing.Process
    out: Path
    err: Path
    started: float
    readers: tuple = ()

    def wait(self, timeout: float = 300) -> int:
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            self.proc.kill()
            self.proc.join()
            raise TimeoutError(f"child {self.proc.pid} ran past {timeout} s; stderr: {self.stderr()[-2000:]}")
        self._drain()
        return self.proc.exitcode

    def kill9(self) -> None:
        self.proc.kill()  # SIGKILL
        self.proc.join()
        self._drain()

    def _drain(self) -> None:
        for t in self.readers:
            t.join(30)

    def stdout(self) -> str:
        return self.out.read_text(errors="replace")

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")


class Launcher:
    """Forks children that run one quantdyn command line each."""

    def __init__(self, logs: Path):
        self.ctx = multiprocessing.get_context("forkserver")
        self.ctx.set_forkserver_preload(PRELOAD)
        self.logs = Path(logs)
        self.logs.mkdir(parents=True, exist_ok=True)
        self.n = 0

    def start(self, argv: list[str], cwd: Path, fsize: int | None = None) -> Child:
        """Run ``argv`` in a child; with ``fsize``, every file it writes is limited to that many bytes
        (its stdout/stderr then go through FIFOs, which the limit does not touch, into the log files)."""
        self.n += 1
        out, err = self.logs / f"{self.n}.out", self.logs / f"{self.n}.err"
        readers: list[threading.Thread] = []
        targets = (str(out), str(err))
        if fsize is not None:
            targets = tuple(f"{p}.fifo" for p in targets)
            for fifo, log in zip(targets, (out, err)):
                os.mkfifo(fifo)
                t = threading.Thread(target=_copy_fifo, args=(fifo, log), daemon=True)
                t.start()
                readers.append(t)
        env = {k: v for k, v in os.environ.items() if k.startswith(("QUANTDYN_", "HF_", "OMP_", "MKL_"))}
        p = self.ctx.Process(target=_child, args=(list(argv), str(cwd), *targets, env, fsize), daemon=True)
        p.start()
        return Child(p, out, err, time.perf_counter(), tuple(readers))

    def run(self, argv: list[str], cwd: Path, timeout: float = 300, fsize: int | None = None) -> tuple[int, str, str]:
        c = self.start(argv, cwd, fsize)
        code = c.wait(timeout)
        return code, c.stdout(), c.stderr()
