"""Options that several commands share, defined once so that a flag means the same on every command.

``--quantizers`` (quantizer labels, comma-separated), ``--store`` (a results store directory), ``--out`` (where
the command writes its output: a file or a directory, said per command), ``--device`` (where to compute),
``--json``, ``--quiet``, ``--verbose``, and the SLURM options of the commands that can run on a cluster
(``grid``, ``sweep``); ``slurm_config`` turns those into a ``launch.slurm.SlurmConfig``.  Each factory
returns a fresh typer option; ``panel`` names the help section the option is listed in (app.SectionedCommand).
"""
from __future__ import annotations

from typing import Any, List, Optional

import typer

QUANTIZERS_HELP = ("Quantizer labels, comma-separated: <method><bits>[g<group>][-<preset or flag>...], e.g. "
                   "gptq3,rtn4g64,gptq4-gptqmodel.")
STORE_HELP = "Results store directory."
DEVICE_HELP = "Where to compute: auto | cpu | cuda | cuda:N."


def quantizers(default: Optional[str] = None, more: str = "", panel: Optional[str] = None) -> Any:
    return typer.Option(default, "--quantizers", help=f"{QUANTIZERS_HELP} {more}".strip(), rich_help_panel=panel)


def store(default: Optional[str] = "results", more: str = "", panel: Optional[str] = None) -> Any:
    return typer.Option(default, "--store", help=f"{STORE_HELP} {more}".strip(), rich_help_panel=panel)


def out(default: Any, what: str, panel: Optional[str] = None) -> Any:
    """``--out``: ``what`` says what this command writes there."""
    return typer.Option(default, "--out", help=f"Write {what}", rich_help_panel=panel)


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
GPUS = typer.Option(0, "--gpus-per-node", help="GPUs per task (grid: default --nproc-per-node).", rich_help_panel=SLURM)
CPUS = typer.Option(0, "--cpus-per-task", help="CPUs per task.", rich_help_panel=SLURM)
MEM_GB = typer.Option(0, "--mem-gb", help="Memory per task in GB.", rich_help_panel=SLURM)
MAX_PARALLEL = typer.Option(0, "--max-parallel", help="Array throttle: at most this many tasks at once.",
                            rich_help_panel=SLURM)
CONSTRAINT = typer.Option("", "--constraint", help="SLURM node constraint, e.g. h100.", rich_help_panel=SLURM)
SBATCH = typer.Option(None, "--sbatch", help="Extra #SBATCH option (repeatable), e.g. --sbatch=--exclusive",
                      rich_help_panel=SLURM)
SETUP = typer.Option(None, "--setup", help="Shell line run first in each task (repeatable).", rich_help_panel=SLURM)
SUBMIT = typer.Option(False, "--submit", help="Submit the array through submitit (pip install 'quantdyn[slurm]').",
                      rich_help_panel=SLURM)
CLUSTER = typer.Option("slurm", "--cluster", hidden=True, help="submitit cluster (local: run here, for tests).")


def slurm_config(partition: str, time_limit: str, account: str, qos: str, gpus: int, cpus: int, mem_gb: int,
                 max_parallel: int, constraint: str, sbatch_extra: Optional[List[str]], setup: Optional[List[str]],
                 nproc_per_node: int = 1):
    from quantdyn.launch.slurm import SlurmConfig

    return SlurmConfig(partition=partition, time=time_limit, account=account, qos=qos, gpus_per_node=gpus,
                       cpus_per_task=cpus, mem_gb=mem_gb, nproc_per_node=nproc_per_node, max_parallel=max_parallel,
                       constraint=constraint, extra_sbatch=tuple(sbatch_extra or ()), setup=tuple(setup or ()))


def require_sbatch(submit: bool, cluster: str) -> None:
    """--submit on a machine without SLURM: one line before anything is written."""
    import shutil

    from quantdyn.errors import QuantdynError

    if submit and cluster == "slurm" and not shutil.which("sbatch"):
        raise QuantdynError("--submit needs SLURM here (no sbatch on PATH); run on the cluster's login node, "
                            "or drop --submit and sbatch the written script there")


def split_list(text: Optional[str]) -> list[str]:
    """'a,b,,c' -> ['a', 'b', 'c'] (a comma-separated option; None -> [])."""
    return [x.strip() for x in (text or "").split(",") if x.strip()]
