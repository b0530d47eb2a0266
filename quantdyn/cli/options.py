"""Options that several commands share, defined once so that a flag means the same on every command.

``--quantizers`` (quantizer labels, comma-separated), ``--store`` (a results store directory), ``--out`` (where
the command writes its output: a file or a directory, said per command), ``--device`` (where to compute),
``--json``, ``--quiet``, ``--verbose``, and the SLURM options of the commands that can run on a cluster
(``grid``, ``sweep``: the :func:`slurm_options` decorator adds them, and ``SlurmOptions.config`` turns them into
a ``launch.slurm.SlurmConfig``).  Each factory
returns a fresh typer option; ``panel`` names the help section the option is listed in (app.SectionedCommand).

Every option that names a place the command writes (``--out``, a written ``--store``; a new command gets it by
using these factories, or :func:`writable` as the callback of its own path option) is checked while the command
line is read, before any work: files.ensure_writable creates and removes a probe file there, so an unwritable or
read-only place is one line, exit 2, instead of a traceback after the work. Places a command learns later (a
spec's store, a config's out_dir) are checked by the command with files.ensure_writable once it knows them.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

import typer

QUANTIZERS_HELP = ("Quantizer labels, comma-separated: <method><bits>[g<group>][-<preset or flag>...], e.g. "
                   "gptq3,rtn4g64,gptq4-gptqmodel, or a deployment format: GGUF q8_0, q6_k, q5_k_m, q4_k_m, "
                   "q4_0, q3_k_m, q2_k ... (each also -imatrix), fp8, fp8-channel, w8a8-fp8, w4a4, nf4, mxfp4, "
                   "nvfp4 (docs/quantizers.md); any of them rotated first with +had or +r1, e.g. rtn4+had "
                   "(docs/rotations.md); or a per-tensor plan: plan:FILE (quantdyn allocate), auto@BUDGET:TYPE,... "
                   "(allocated per checkpoint; list it last).")
STORE_HELP = "Results store directory."
DEVICE_HELP = "Where to compute: auto | cpu | cuda | cuda:N."


ENGINE_CONFIG = "engine/measure.py:MeasureConfig"
"""The engine's settings (read as text: -h does not import torch)."""
DATA_CONFIG = "sweep/sweep.py:SweepDataConfig"
"""The calibration and evaluation sizes."""


def config_option(config: str, name: str, default: Any, flag: Optional[str] = None, more: str = "",
                  panel: Optional[str] = None, **kw) -> Any:
    """An option that sets config field ``name`` of ``config`` (``"module.py:Class"``): its help is the field's
    docstring (config.field_docs), so it is written once, where the field is."""
    from quantdyn.config import field_docs

    text = field_docs(config)[name].replace("``", "") + (f" {more}" if more else "")
    return typer.Option(default, flag or "--" + name.replace("_", "-"), help=text, rich_help_panel=panel, **kw)


def quantizers(default: Optional[str] = None, more: str = "", panel: Optional[str] = None) -> Any:
    return typer.Option(default, "--quantizers", help=f"{QUANTIZERS_HELP} {more}".strip(), rich_help_panel=panel,
                        callback=check_labels)


def check_labels(text: Optional[str]) -> Optional[str]:
    """``--quantizers``: every label is parsed while the command line is read, before the command imports torch
    (a mistyped label is one line in a second); returns the text unchanged."""
    from quantdyn.quantize.catalogue import parse_quantizer

    for label in split_quantizers(text):
        parse_quantizer(label)
    return text


def writable(kind: str = "dir") -> Callable:
    """A typer callback that checks, while the command line is read (before the command imports torch or does any
    work), that the option's path can be written as ``kind`` (files.ensure_writable: ``dir``, ``file`` or
    ``new-dir``): an unwritable place is one line, exit 2. None and '' (nothing to write) pass."""
    def check(ctx: typer.Context, param: typer.CallbackParam, value: Any) -> Any:
        if value not in (None, "") and not ctx.resilient_parsing:
            from quantdyn.files import ensure_writable

            ensure_writable(value, (param.opts or [param.name])[0], kind)
        return value

    return check


def store(default: Optional[str] = "results", more: str = "", panel: Optional[str] = None, writes: bool = True,
          **kw) -> Any:
    """``--store``; ``writes``: the command stores rows there, so the store is checked writable before any work
    (:func:`writable`); False where the command only reads it."""
    return typer.Option(default, "--store", help=f"{STORE_HELP} {more}".strip(), rich_help_panel=panel,
                        callback=writable("dir") if writes else None, **kw)


def out(default: Any, what: str, panel: Optional[str] = None, kind: str = "dir", **kw) -> Any:
    """``--out``: ``what`` says what this command writes there; ``kind`` how (files.WRITE_KINDS: into a directory,
    one file, or a whole directory renamed into place); the place is checked writable before any work
    (:func:`writable`)."""
    return typer.Option(default, "--out", help=f"Write {what}", rich_help_panel=panel, callback=writable(kind), **kw)


def device(default: Optional[str] = "auto", more: str = "", panel: Optional[str] = None) -> Any:
    return typer.Option(default, "--device", help=f"{DEVICE_HELP} {more}".strip(), rich_help_panel=panel)


def as_json(what: str = "the result rows as a JSON array") -> Any:
    return typer.Option(False, "--json", help=f"Print {what} instead of a table.")


def quiet(what: str = "No progress lines; the results and errors only.") -> Any:
    return typer.Option(False, "--quiet", help=what)


def verbose(what: str = "Also print every logged row with all its metrics.") -> Any:
    return typer.Option(False, "--verbose", help=what)


# ------------------------------------------------------------------------------------------------- SLURM
SLURM = "SLURM (with --slurm)"

PARTITION = typer.Option("", "--partition", help="SLURM partition.", rich_help_panel=SLURM)
TIME = typer.Option("", "--time", help="SLURM time limit per task, e.g. 04:00:00.", rich_help_panel=SLURM)
ACCOUNT = typer.Option("", "--account", help="SLURM account to charge.", rich_help_panel=SLURM)
QOS = typer.Option("", "--qos", help="SLURM QOS.", rich_help_panel=SLURM)
GPUS = typer.Option(0, "--gpus-per-node", help="GPUs per task (grid: default --nproc-per-node; none for runs on "
                    "train.device=cpu).", rich_help_panel=SLURM)
CPUS = typer.Option(0, "--cpus-per-task", help="CPUs per task.", rich_help_panel=SLURM)
MEM_GB = typer.Option(0, "--mem-gb", help="Memory per task in GB.", rich_help_panel=SLURM)
MAX_PARALLEL = typer.Option(0, "--max-parallel", help="Array throttle: at most this many tasks at once.",
                            rich_help_panel=SLURM)
CONSTRAINT = typer.Option("", "--constraint", help="SLURM node constraint, e.g. h100.", rich_help_panel=SLURM)
SBATCH = typer.Option(None, "--sbatch", help="Extra #SBATCH option (repeatable), e.g. --sbatch=--exclusive",
                      rich_help_panel=SLURM)
SETUP = typer.Option(None, "--setup", help="Shell line run first in each task (repeatable).", rich_help_panel=SLURM)
SIGNAL = typer.Option("USR1@120", "--signal", help="SIG@SECONDS: SLURM warns a task SECONDS before its time limit "
                      "(SIG: USR1 or USR2); the task stops cleanly (a training run checkpoints its step) and "
                      "requeues itself. none: no warning.", rich_help_panel=SLURM)
WRITE_ONLY = typer.Option(False, "--write-only", help="With --slurm: write the sbatch script and submit nothing "
                          "(no SLURM needed here); it prints the sbatch command.", rich_help_panel=SLURM)
SUBMIT = typer.Option(False, "--submit", hidden=True, help="Old spelling of --slurm (which submits with sbatch).")


_SLURM_PARAMS: tuple[tuple[str, Any, Any], ...] = (
    ("write_only", bool, WRITE_ONLY), ("partition", str, PARTITION), ("time_limit", str, TIME),
    ("account", str, ACCOUNT), ("qos", str, QOS), ("gpus", int, GPUS), ("cpus", int, CPUS), ("mem_gb", int, MEM_GB),
    ("max_parallel", int, MAX_PARALLEL), ("constraint", str, CONSTRAINT), ("signal", str, SIGNAL),
    ("sbatch_extra", Optional[List[str]], SBATCH), ("setup", Optional[List[str]], SETUP), ("submit", bool, SUBMIT),
)


@dataclass(frozen=True)
class SlurmOptions:
    """The SLURM options of one command line (what :func:`slurm_options` hands the command)."""

    write_only: bool
    partition: str
    time_limit: str
    account: str
    qos: str
    gpus: int
    cpus: int
    mem_gb: int
    max_parallel: int
    constraint: str
    signal: str
    sbatch_extra: Optional[List[str]]
    setup: Optional[List[str]]
    submit: bool

    def wanted(self, slurm_flag: bool) -> bool:
        """Whether the command goes to SLURM: --slurm, or its old spelling --submit (with a note)."""
        if self.submit:
            from quantdyn.cli.app import deprecated

            deprecated("--submit", "use --slurm, which now submits the array with sbatch")
        if self.write_only and not (slurm_flag or self.submit):
            from quantdyn.errors import QuantdynError

            raise QuantdynError("--write-only goes with --slurm: add --slurm to write the sbatch script")
        return slurm_flag or self.submit

    def config(self, nproc_per_node: int = 1):
        """The ``launch.slurm.SlurmConfig`` of these options (checked: a bad time limit is one line)."""
        from quantdyn.launch.slurm import SlurmConfig

        return SlurmConfig(partition=self.partition, time=self.time_limit, account=self.account, qos=self.qos,
                           gpus_per_node=self.gpus, cpus_per_task=self.cpus, mem_gb=self.mem_gb,
                           nproc_per_node=nproc_per_node, max_parallel=self.max_parallel, constraint=self.constraint,
                           extra_sbatch=tuple(self.sbatch_extra or ()), setup=tuple(self.setup or ()),
                           signal=self.signal)


def slurm_options(command: Callable) -> Callable:
    """Decorate a command with the SLURM options (grid and sweep: one definition of the flags): typer sees them
    as the command's parameters in place of its ``slurm`` parameter, and the command receives them as one
    ``slurm: SlurmOptions`` argument."""
    sig = inspect.signature(command, eval_str=True)
    params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in sig.parameters.values()]
    at = [p.name for p in params].index("slurm")
    names = [name for name, _, _ in _SLURM_PARAMS]
    added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=tp)
             for name, tp, info in _SLURM_PARAMS]

    @functools.wraps(command)
    def run(**kwargs):
        slurm = SlurmOptions(**{name: kwargs.pop(name) for name in names})
        return command(**kwargs, slurm=slurm)

    run.__signature__ = sig.replace(parameters=params[:at] + added + params[at + 1:])
    return run


def split_list(text: Optional[str]) -> list[str]:
    """'a,b,,c' -> ['a', 'b', 'c'] (a comma-separated option; None -> [])."""
    return [x.strip() for x in (text or "").split(",") if x.strip()]


def split_quantizers(text: Optional[str]) -> list[str]:
    """``--quantizers``: labels split at commas, except that an ``auto@BUDGET:TYPE,TYPE,...`` label takes every item
    after it as one of its candidate types, up to the next ``auto@`` or ``plan:`` label (so list auto@ labels last):
    'q4_k_m,auto@4.5:q3_k,q4_k' -> ['q4_k_m', 'auto@4.5:q3_k,q4_k']."""
    out: list[str] = []
    in_auto = False
    for item in split_list(text):
        starts = item.lower().startswith(("auto@", "plan:"))
        if in_auto and not starts:
            out[-1] += f",{item}"
            continue
        out.append(item)
        in_auto = item.lower().startswith("auto@")
    return out
