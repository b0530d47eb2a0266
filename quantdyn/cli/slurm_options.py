"""The SLURM options shared by every command that can run on a cluster (grid, sweep): one definition, so the
flags mean the same everywhere; ``slurm_config`` turns them into a ``study.slurm.SlurmConfig``."""
from __future__ import annotations

from typing import List, Optional

import typer

PARTITION = typer.Option("", "--partition", help="SLURM partition.")
TIME = typer.Option("", "--time", help="SLURM time limit per task, e.g. 04:00:00.")
ACCOUNT = typer.Option("", "--account", help="SLURM account to charge.")
QOS = typer.Option("", "--qos", help="SLURM QOS.")
GPUS = typer.Option(0, "--gpus-per-node", help="GPUs per task.")
CPUS = typer.Option(0, "--cpus-per-task", help="CPUs per task.")
MEM_GB = typer.Option(0, "--mem-gb", help="Memory per task in GB.")
MAX_PARALLEL = typer.Option(0, "--max-parallel", help="Array throttle: at most this many tasks at once.")
CONSTRAINT = typer.Option("", "--constraint", help="SLURM node constraint, e.g. h100.")
SBATCH = typer.Option(None, "--sbatch", help="Extra #SBATCH option (repeatable), e.g. --sbatch=--exclusive")
SETUP = typer.Option(None, "--setup", help="Shell line run first in each task (repeatable).")
SUBMIT = typer.Option(False, "--submit", help="With --slurm: submit the array through submitit (pip install 'quantdyn[slurm]').")
CLUSTER = typer.Option("slurm", "--cluster", hidden=True, help="submitit cluster (local: run here, for tests).")


def slurm_config(partition: str, time_limit: str, account: str, qos: str, gpus: int, cpus: int, mem_gb: int,
                 max_parallel: int, constraint: str, sbatch_extra: Optional[List[str]], setup: Optional[List[str]],
                 nproc_per_node: int = 1):
    from quantdyn.launch.slurm import SlurmConfig

    return SlurmConfig(partition=partition, time=time_limit, account=account, qos=qos, gpus_per_node=gpus,
                       cpus_per_task=cpus, mem_gb=mem_gb, nproc_per_node=nproc_per_node, max_parallel=max_parallel,
                       constraint=constraint, extra_sbatch=tuple(sbatch_extra or ()), setup=tuple(setup or ()))


def require_sbatch(submit: bool, cluster: str) -> None:
    import shutil

    from quantdyn.errors import QuantdynError

    if submit and cluster == "slurm" and not shutil.which("sbatch"):
        raise QuantdynError("--submit needs SLURM here (no sbatch on PATH); run on the cluster's login node, "
                            "or drop --submit and sbatch the written script there")
