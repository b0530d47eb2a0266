"""Grids and sweeps on a SLURM cluster: an sbatch array script to submit by hand, or a
submission through ``submitit`` (the optional extra ``quantdyn[slurm]``).

    quantdyn grid CONFIG --vary optim.lr=1e-4,1e-3 --slurm --partition gpu --time 04:00:00 \
        --account proj --gpus-per-node 8 --nproc-per-node 8 --cpus-per-task 32 --max-parallel 4
        -> GRID_DIR/grid.sbatch (one array task per run; `sbatch GRID_DIR/grid.sbatch`)
    ... --slurm --submit        -> the same tasks submitted through submitit

One array task = one node: a grid task trains one run (``torchrun --standalone`` with
``nproc_per_node`` processes; a finished run exits at once, a partial one resumes), a sweep task
measures one shard (``quantdyn sweep ... --shard i/n``).  Every task writes into the same place
(the grid's run directories, the sweep's store), so a requeued or resubmitted array continues
where it stopped, and ``max_parallel`` throttles how many tasks run at once (``--array=0-N%M``).

:func:`array_script` writes every sbatch file (grid.py and :func:`sweep_script` give it their task's lines);
:func:`sweep_script` and :func:`submit_sweep` are what ``quantdyn sweep --slurm`` calls.
"""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from quantdyn.errors import QuantdynError

_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d{1,2}))?(?::(\d{1,2}))?$")


def parse_slurm_time(text: str) -> int:
    """A SLURM time limit ('90', 'MM:SS', 'HH:MM:SS', 'D-HH', 'D-HH:MM', 'D-HH:MM:SS') -> minutes (rounded up)."""
    m = _TIME.match(text.strip())
    if not m:
        raise QuantdynError(f"time limit '{text}' is not a SLURM time; use e.g. 04:00:00, 1-12:00:00 or 90 (minutes)")
    days, a, b, c = m.groups()
    if days is not None:  # D-HH[:MM[:SS]]
        h, mi, s = int(a), int(b or 0), int(c or 0)
        total_s = ((int(days) * 24 + h) * 60 + mi) * 60 + s
    elif c is not None:  # HH:MM:SS
        total_s = (int(a) * 60 + int(b)) * 60 + int(c)
    elif b is not None:  # MM:SS
        total_s = int(a) * 60 + int(b)
    else:  # minutes
        total_s = int(a) * 60
    if total_s <= 0:
        raise QuantdynError(f"time limit '{text}' must be positive")
    return -(-total_s // 60)


@dataclass(frozen=True)
class SlurmConfig:
    """Resources of one array task (one node) and how the array is run."""

    partition: str = ""
    """--partition ('' = the cluster's default)."""
    time: str = ""
    """--time limit per task, e.g. 04:00:00 or 1-00:00:00 ('' = the partition's default; submitit: 60 min)."""
    account: str = ""
    """--account to charge ('' = the user's default)."""
    qos: str = ""
    """--qos ('' = default)."""
    gpus_per_node: int = 0
    """GPUs per task (--gpus-per-node); 0 = nproc_per_node when training, none for a sweep."""
    cpus_per_task: int = 0
    """--cpus-per-task (0 = the cluster's default)."""
    mem_gb: int = 0
    """--mem in GB (0 = default)."""
    nproc_per_node: int = 1
    """Training processes per task (torchrun --nproc_per_node)."""
    max_parallel: int = 0
    """Array throttle: at most this many tasks run at once (--array=0-N%M); 0 = no limit."""
    constraint: str = ""
    """--constraint, e.g. 'h100' ('' = none)."""
    extra_sbatch: tuple[str, ...] = ()
    """More #SBATCH options, e.g. ('--exclusive', '--mail-type=END')."""
    setup: tuple[str, ...] = ()
    """Shell lines run before the task (module loads, `source .venv/bin/activate`)."""

    def __post_init__(self):
        if self.time:
            parse_slurm_time(self.time)
        for k in ("gpus_per_node", "cpus_per_task", "mem_gb", "max_parallel"):
            if getattr(self, k) < 0:
                raise QuantdynError(f"slurm {k.replace('_', '-')}={getattr(self, k)} must be >= 0")
        if self.nproc_per_node < 1:
            raise QuantdynError(f"--nproc-per-node {self.nproc_per_node} must be >= 1")
        if self.gpus_per_node and self.nproc_per_node > self.gpus_per_node:
            raise QuantdynError(
                f"--nproc-per-node {self.nproc_per_node} exceeds --gpus-per-node {self.gpus_per_node}; "
                "use one training process per GPU"
            )
        for name in ("partition", "account", "qos", "constraint"):
            v = getattr(self, name)
            if v and not re.fullmatch(r"[A-Za-z0-9_.,:+\-|&]+", v):
                raise QuantdynError(f"slurm {name} '{v}' has characters SLURM does not accept in names")


def array_script(cfg: SlurmConfig, *, name: str, n_tasks: int, log_dir: Path, about: str, body: str,
                 gpus: int | None = None, script: str = "THIS_FILE") -> str:
    """The sbatch script of an array of ``n_tasks`` one-node tasks (the one sbatch generator: grids and sweeps
    give their task's shell lines as ``body``, which reads ``$SLURM_ARRAY_TASK_ID``).

    Header: job name, array (throttled by ``max_parallel``), one node and task, the output file under
    ``log_dir``, ``gpus`` per node (default ``cfg.gpus_per_node``; 0 asks for none) and ``cfg``'s resources and
    extra #SBATCH lines; then ``set -euo pipefail``, ``cfg.setup`` and ``body``. ``about`` and ``script`` (the
    path to sbatch) go into the comment that says how to submit it."""
    if n_tasks < 1:
        raise QuantdynError("nothing to submit: the array has no tasks")
    gpus = cfg.gpus_per_node if gpus is None else gpus
    array = f"0-{n_tasks - 1}" + (f"%{cfg.max_parallel}" if cfg.max_parallel else "")
    header = [
        f"#SBATCH --job-name={job_name(name)}",
        f"#SBATCH --array={array}",
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --output={log_dir}/%x-%A_%a.out",
    ]
    if gpus:
        header.append(f"#SBATCH --gpus-per-node={gpus}")
    for flag, value in (("cpus-per-task", cfg.cpus_per_task), ("time", cfg.time), ("partition", cfg.partition),
                        ("account", cfg.account), ("qos", cfg.qos), ("constraint", cfg.constraint)):
        if value:
            header.append(f"#SBATCH --{flag}={value}")
    if cfg.mem_gb:
        header.append(f"#SBATCH --mem={cfg.mem_gb}G")
    header += [x if x.startswith("#SBATCH") else f"#SBATCH {x}" for x in cfg.extra_sbatch]
    lines = ["#!/bin/bash", f"# {about} (written by quantdyn).",
             f"# Submit: mkdir -p {shlex.quote(str(log_dir))} && sbatch {script}",
             *header, "set -euo pipefail", *cfg.setup, body.rstrip("\n")]
    return "\n".join(lines) + "\n"


def job_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.+\-_]+", "_", text).strip("_") or "quantdyn"


# ------------------------------------------------------------------------ sweeps
def sweep_commands(sweep_args: Sequence[str], shards: int, quantdyn: Sequence[str] = ("quantdyn",)) -> list[list[str]]:
    """The command of each shard: ``quantdyn sweep ARGS --shard i/n`` (ARGS must name the store)."""
    if shards < 1:
        raise QuantdynError(f"--shards {shards} must be >= 1")
    if any(a == "--shard" or a.startswith("--shard=") for a in sweep_args):
        raise QuantdynError("a SLURM sweep sets --shard itself (one shard per array task); drop --shard")
    return [[*quantdyn, "sweep", *sweep_args, "--shard", f"{i}/{shards}"] for i in range(shards)]


def sweep_script(sweep_args: Sequence[str], shards: int, cfg: SlurmConfig, workdir: str | Path,
                 quantdyn: str = "quantdyn", name: str = "sweep") -> str:
    """An sbatch array script with one task per sweep shard; every shard appends to the same store.

    ``sweep_args``: the arguments of ``quantdyn sweep`` (spec, --store, --quantizers ...), without --shard.
    ``workdir``: where the tasks run (relative paths in the arguments are relative to it) and logs go.
    """
    sweep_commands(sweep_args, shards)  # validates
    workdir = Path(workdir).resolve()
    args = " ".join(shlex.quote(str(a)) for a in sweep_args)
    body = (f"cd {shlex.quote(str(workdir))}\n"
            f'exec {quantdyn} sweep {args} --shard "$SLURM_ARRAY_TASK_ID/{shards}"\n')
    return array_script(cfg, name=name, n_tasks=shards, log_dir=workdir / "logs", body=body,
                        about=f"quantdyn sweep in {shards} shards, one array task each")


def run_command(argv: Sequence[str], cwd: str | None = None) -> int:
    """Run one task's command (what a submitit job executes); raise if it fails."""
    r = subprocess.run(list(argv), cwd=cwd)
    if r.returncode != 0:
        raise RuntimeError(f"command failed with exit code {r.returncode}: {shlex.join(map(str, argv))}")
    return r.returncode


def submit_sweep(sweep_args: Sequence[str], shards: int, cfg: SlurmConfig, folder: str | Path,
                 cluster: str | None = None, workdir: str | Path | None = None, name: str = "sweep") -> list:
    """Submit one submitit job per shard (an array); return the jobs. ``cluster='local'`` runs them here."""
    quantdyn = [sys.executable, "-m", "quantdyn.cli"]
    cmds = sweep_commands(sweep_args, shards, quantdyn)
    cwd = str(Path(workdir).resolve()) if workdir else None
    return submit(run_command, [(c, cwd) for c in cmds], cfg, folder, cluster=cluster, name=name, gpus=cfg.gpus_per_node)


# ------------------------------------------------------------------------ submitit
def _submitit():
    try:
        import submitit  # optional dependency: only cluster submission needs it
    except ImportError:
        raise QuantdynError(
            "submitting to SLURM needs the submitit package; run `pip install 'quantdyn[slurm]'` "
            "(or drop --submit and sbatch the written script)"
        ) from None
    return submitit


def make_executor(cfg: SlurmConfig, folder: str | Path, cluster: str | None = None, name: str = "quantdyn",
                  gpus: int = 0):
    """A submitit executor for one-node tasks with ``cfg``'s resources (cluster None = auto: SLURM
    where sbatch exists; 'local' = subprocesses on this machine, for tests)."""
    submitit = _submitit()
    ex = submitit.AutoExecutor(folder=str(folder), cluster=cluster)
    params: dict[str, Any] = dict(name=job_name(name), nodes=1, tasks_per_node=1,
                                  timeout_min=parse_slurm_time(cfg.time) if cfg.time else 60)
    if gpus:
        params["gpus_per_node"] = gpus
    if cfg.cpus_per_task:
        params["cpus_per_task"] = cfg.cpus_per_task
    if cfg.mem_gb:
        params["mem_gb"] = cfg.mem_gb
    slurm: dict[str, Any] = {"slurm_array_parallelism": cfg.max_parallel or 256}
    for k in ("partition", "account", "qos", "constraint"):
        if getattr(cfg, k):
            slurm[f"slurm_{k}"] = getattr(cfg, k)
    if cfg.setup:
        slurm["slurm_setup"] = list(cfg.setup)
    if cfg.extra_sbatch:
        extra = {}
        for line in cfg.extra_sbatch:
            opt = line.removeprefix("#SBATCH").strip().lstrip("-")
            key, _, value = opt.partition("=")
            extra[key.replace("-", "_")] = value or True
        slurm["slurm_additional_parameters"] = extra
    ex.update_parameters(**params, **slurm)  # submitit drops slurm_* options for the local executor
    return ex


def submit(fn: Callable, args_list: Sequence[tuple], cfg: SlurmConfig, folder: str | Path,
           cluster: str | None = None, name: str = "quantdyn", gpus: int = 0) -> list:
    """Submit ``fn(*args)`` for each args tuple as one array; return the submitit jobs."""
    if not args_list:
        raise QuantdynError("nothing to submit: the array has no tasks")
    ex = make_executor(cfg, folder, cluster, name, gpus)
    with ex.batch():
        jobs = [ex.submit(fn, *args) for args in args_list]
    return jobs
