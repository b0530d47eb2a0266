"""Grids and sweeps on a SLURM cluster: one sbatch array script, submitted with ``sbatch``.

    quantdyn grid CONFIG --vary optim.lr=1e-4,1e-3 --slurm --partition gpu --time 04:00:00 \
        --account proj --nproc-per-node 8 --cpus-per-task 32 --max-parallel 4
        -> GRID_DIR/grid.sbatch, submitted: one array task per run; prints the job id and how to follow it
    quantdyn sweep SPEC.yaml --slurm --shards 8      -> STORE/slurm/sweep.sbatch, one array task per shard
    ... --slurm --write-only                          -> the script only, to submit later (`sbatch FILE`)

One array task = one node.  A grid task trains one run (a finished run exits at once, a partial one
resumes from its last checkpoint; ``nproc_per_node`` > 1: ``srun`` + ``torchrun`` with the rendezvous
at the job's first node, from SLURM's variables); a sweep task measures one shard (``quantdyn sweep ...
--shard i/n``).  Every task writes into the same place (the grid's run directories, the sweep's store),
so a requeued or resubmitted array continues where it stopped, and ``max_parallel`` throttles how many
tasks run at once (``--array=0-N%M``).

Stopping and requeueing (``signal``, ``--signal USR1@120``): SLURM sends SIGUSR1 to the task's batch
shell 120 s before its time limit (``#SBATCH --signal=B:USR1@120``); the shell passes the task's stop
signal to the job step (a training run: SIGUSR1, on which the trainer checkpoints the step in progress
and stops, train/stop_signal.py; a sweep: SIGTERM, which ends it after its last stored row) and, once
the step has ended, requeues the array task (``scontrol requeue JOB_TASK``; the script says
``--requeue``), which then resumes.  ``scancel`` and ``scontrol requeue`` send SIGTERM: the task stops at
once and a resubmitted or requeued task resumes from the last checkpoint or stored row.

Before anything is written, :func:`check_submission` asks SLURM whether it would take the job
(``sbatch --test-only``): a partition, account, QOS or resource SLURM refuses is one line, and nothing
is submitted.  :func:`array_script` writes every sbatch file (grid.py and :func:`sweep_script` give it
the lines that choose their task's command); :func:`submit` submits one and returns the job id.
"""
from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from quantdyn.errors import QuantdynError
from quantdyn.files import ensure_writable

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
    """--time limit per task, e.g. 04:00:00 or 1-00:00:00 ('' = the partition's default)."""
    account: str = ""
    """--account to charge ('' = the user's default)."""
    qos: str = ""
    """--qos ('' = default)."""
    gpus_per_node: int = 0
    """GPUs per task (--gpus-per-node); 0 = a grid's nproc_per_node (none when its runs train with
    train.device=cpu), none for a sweep."""
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
    signal: str = "USR1@120"
    """SIG@SECONDS: SLURM sends SIG (USR1 or USR2) to the task's batch shell SECONDS before its time limit,
    and the task stops cleanly and requeues itself (module docstring); '' or 'none': no signal."""

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
        warn = parse_signal(self.signal)
        if warn and self.time and warn[1] >= 60 * parse_slurm_time(self.time):
            raise QuantdynError(f"--signal {self.signal} comes before the task starts: its {warn[1]} s are not shorter "
                                f"than --time {self.time}; give fewer seconds or more time")



_SIGNAL = re.compile(r"^(?:SIG)?(USR1|USR2)@(\d+)$")


def parse_signal(text: str) -> tuple[str, int] | None:
    """'USR1@120' -> ('USR1', 120): the signal SLURM sends SECONDS before the time limit; '' or 'none' -> None.

    Only USR1 and USR2: SIGTERM is what ``scancel`` and ``scontrol requeue`` send, and a task must not take
    a cancel for a warning and requeue itself."""
    if text.strip().lower() in ("", "none"):
        return None
    m = _SIGNAL.match(text.strip().upper())
    if not m or int(m.group(2)) < 1:
        raise QuantdynError(f"--signal '{text}' is not SIG@SECONDS with SIG USR1 or USR2, e.g. USR1@120 "
                            "(or none)")
    return m.group(1), int(m.group(2))


def array_script(cfg: SlurmConfig, *, name: str, n_tasks: int, log_dir: Path, about: str, choose: str,
                 stop_signal: str, gpus: int | None = None, script: str = "THIS_FILE") -> str:
    """The sbatch script of an array of ``n_tasks`` one-node tasks (the one sbatch generator).

    ``choose``: shell lines that read ``$SLURM_ARRAY_TASK_ID`` and set the bash array ``TASK`` to the
    command the task runs (or ``exit 0`` when there is nothing left to do). The script runs ``TASK`` as a
    job step (``srun``); on ``cfg.signal``'s warning it sends ``stop_signal`` (TERM, or USR1 for a
    trainer) to the step, waits for it to end and requeues the task (module docstring).

    Header: job name, array (throttled by ``max_parallel``), one node and task, requeueable, the output
    file under ``log_dir`` (appended to by a requeued task), ``gpus`` per node (default
    ``cfg.gpus_per_node``; 0 asks for none), the signal and ``cfg``'s resources and extra #SBATCH lines;
    then ``set -euo pipefail`` and ``cfg.setup``. ``about`` and ``script`` (the path to sbatch) go into the
    comment that says how to submit it by hand."""
    if n_tasks < 1:
        raise QuantdynError("nothing to submit: the array has no tasks")
    gpus = cfg.gpus_per_node if gpus is None else gpus
    warn = parse_signal(cfg.signal)
    array = f"0-{n_tasks - 1}" + (f"%{cfg.max_parallel}" if cfg.max_parallel else "")
    header = [
        f"#SBATCH --job-name={job_name(name)}",
        f"#SBATCH --array={array}",
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --output={log_dir}/%x-%A_%a.out",
        "#SBATCH --open-mode=append",
        "#SBATCH --requeue",
    ]
    if warn:
        header.append(f"#SBATCH --signal=B:{warn[0]}@{warn[1]}")
    if gpus:
        header.append(f"#SBATCH --gpus-per-node={gpus}")
    for flag, value in (("cpus-per-task", cfg.cpus_per_task), ("time", cfg.time), ("partition", cfg.partition),
                        ("account", cfg.account), ("qos", cfg.qos), ("constraint", cfg.constraint)):
        if value:
            header.append(f"#SBATCH --{flag}={value}")
    if cfg.mem_gb:
        header.append(f"#SBATCH --mem={cfg.mem_gb}G")
    header += [x if x.startswith("#SBATCH") else f"#SBATCH {x}" for x in cfg.extra_sbatch]
    trap = "" if not warn else f"""STOPPING=0
stop_and_requeue() {{
  STOPPING=1
  echo "quantdyn: SIG{warn[0]} at $(date +%FT%T) (the time limit is near): stopping task $THIS_TASK to requeue it"
  scancel --signal={stop_signal} "$THIS_TASK"
}}
trap stop_and_requeue {warn[0]}
"""
    requeue = "" if not warn else """if [ "$STOPPING" = 1 ]; then
  echo "quantdyn: requeueing task $THIS_TASK; it goes on where it stopped"
  scontrol requeue "$THIS_TASK" || echo "quantdyn: SLURM refused to requeue $THIS_TASK; submit the array again"
fi
"""
    run = f"""THIS_TASK="${{SLURM_ARRAY_JOB_ID}}_${{SLURM_ARRAY_TASK_ID}}"
{trap}echo "quantdyn: task $THIS_TASK (restart ${{SLURM_RESTART_COUNT:-0}}) on $(hostname) at $(date +%FT%T): ${{TASK[*]}}"
# the task runs as a job step; srun of some SLURM versions (22.05) does not pass on the job's CPUs and GPUs
srun --ntasks=1 --kill-on-bad-exit=1 ${{SLURM_CPUS_PER_TASK:+--cpus-per-task=$SLURM_CPUS_PER_TASK}} \\
  ${{SLURM_GPUS_PER_NODE:+--gpus-per-node=$SLURM_GPUS_PER_NODE}} "${{TASK[@]}}" &
STEP=$!
# a trapped signal ends `wait` early: wait again until the step has really ended
while :; do wait "$STEP" && STATUS=0 || STATUS=$?; kill -0 "$STEP" 2>/dev/null || break; done
{requeue}exit "$STATUS"
"""
    lines = ["#!/bin/bash", f"# {about} (written by quantdyn).",
             f"# Submit by hand: mkdir -p {shlex.quote(str(log_dir))} && sbatch {script}",
             *header, "set -euo pipefail", *cfg.setup, choose.rstrip("\n"), run.rstrip("\n")]
    return "\n".join(lines) + "\n"


def job_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.+\-_]+", "_", text).strip("_") or "quantdyn"


def quantdyn_command(python: str = sys.executable) -> str:
    """How a task starts quantdyn: this interpreter (the venv quantdyn runs in; on a cluster, a path on the
    shared file system) with ``-m quantdyn.cli``, so a task needs no activated environment."""
    return f"{shlex.quote(python)} -m quantdyn.cli"


# ------------------------------------------------------------------------ sweeps
def sweep_script(sweep_args: Sequence[str], shards: int, cfg: SlurmConfig, workdir: str | Path,
                 log_dir: str | Path, quantdyn: str | None = None, name: str = "sweep") -> str:
    """An sbatch array script with one task per sweep shard; every shard appends to the same store.

    ``sweep_args``: the arguments of ``quantdyn sweep`` (spec, --store, --quantizers ...), without --shard.
    ``workdir``: where the tasks run (relative paths in the arguments are relative to it); ``log_dir``: where
    their output goes. A stopped task ends its sweep with SIGTERM (the rows stored so far stay; the requeued
    task skips them).
    """
    if shards < 1:
        raise QuantdynError(f"--shards {shards} must be >= 1")
    if any(a == "--shard" or a.startswith("--shard=") for a in sweep_args):
        raise QuantdynError("a SLURM sweep sets --shard itself (one shard per array task); drop --shard")
    workdir, log_dir = Path(workdir).resolve(), Path(log_dir).resolve()
    args = " ".join(shlex.quote(str(a)) for a in sweep_args)
    choose = (f"cd {shlex.quote(str(workdir))}\n"
              f'TASK=({quantdyn or quantdyn_command()} sweep {args} --shard "$SLURM_ARRAY_TASK_ID/{shards}")\n')
    return array_script(cfg, name=name, n_tasks=shards, log_dir=log_dir, choose=choose, stop_signal="TERM",
                        about=f"quantdyn sweep in {shards} shards, one array task each")


# ------------------------------------------------------------------------ submitting
def require_sbatch() -> None:
    """No SLURM here: one line before anything is written."""
    if not shutil.which("sbatch"):
        raise QuantdynError("--slurm needs SLURM's sbatch, which is not on PATH here; run on the cluster's login "
                            "node, or add --write-only to write the script and sbatch it there")


def check_writable(path: str | Path, what: str, flag: str) -> Path:
    """``path`` resolved; one line if it cannot be created or written here (the tasks run as this user, so what
    this process cannot write they cannot either)."""
    p = Path(path).resolve()
    probe = p
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise QuantdynError(f"{what} '{path}' cannot be created: '{probe}' is not a directory; choose another {flag}")
    try:  # a probe file, not os.access: root passes os.access even where no file can be made (files.ensure_writable)
        ensure_writable(p, flag)
    except QuantdynError:
        raise QuantdynError(f"{what} '{path}' cannot be written ('{probe}' is not writable for this user, and the "
                            f"jobs run as this user); choose another {flag}") from None
    return p


def _sbatch(args: Sequence[str], script_text: str | None = None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["sbatch", *args], input=script_text, capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        require_sbatch()
        raise
    except subprocess.TimeoutExpired:
        raise QuantdynError("sbatch did not answer within 120 s; is the SLURM controller up? (`sinfo`)") from None


def _refusal(r: subprocess.CompletedProcess) -> str:
    lines = [x.strip().removeprefix("sbatch: error: ").removeprefix("sbatch: ") for x in
             (r.stderr or r.stdout or "").splitlines() if x.strip()]
    return "; ".join(dict.fromkeys(lines)) or f"sbatch exited with status {r.returncode}"


def check_submission(script_text: str) -> None:
    """Ask SLURM whether it would take this job (``sbatch --test-only``, the script on stdin); nothing is
    submitted. A refused partition, account, QOS or resource request is one line."""
    r = _sbatch(["--test-only"], script_text)
    if r.returncode != 0:
        raise QuantdynError(f"SLURM refuses the job: {_refusal(r)}; check --partition, --account, --qos and the "
                            "resources (`sinfo`, `sacctmgr show assoc user=$USER`)")


def submit(script: str | Path) -> str:
    """``sbatch SCRIPT``; return the job id."""
    r = _sbatch(["--parsable", str(script)])
    if r.returncode != 0:
        raise QuantdynError(f"SLURM refused the job: {_refusal(r)}")
    job = r.stdout.strip().split(";")[0]
    if not job.isdigit():
        raise QuantdynError(f"sbatch answered '{r.stdout.strip()}' instead of a job id; look at `squeue --me`")
    return job


def submitted_lines(job: str, n_tasks: int, what: str, log_dir: Path, name: str, watch: str,
                    resume: str) -> list[str]:
    """What ``--slurm`` prints once the array is submitted: the job id, how to follow it and how to resume."""
    logs = shlex.quote(str(log_dir)) + f"/{job_name(name)}-{job}_*.out"
    return [f"submitted job {job}: {n_tasks} array task{'s' if n_tasks != 1 else ''}, {what}",
            f"follow:  squeue -j {job}   |   tail -f {logs}   |   {watch}",
            f"resume:  {resume}; a task stopped by its time limit requeues itself"]
