"""Commands that train: train, cooldown, grid, average lawa|soup."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

from quantdyn.cli.app import app
from quantdyn.errors import QuantdynError


# ------------------------------------------------------------------ train
@app.command()
def train(
    config: Optional[Path] = typer.Argument(None, help="Run config YAML (see configs/)."),
    overrides: Optional[List[str]] = typer.Argument(None, help="key=value overrides, e.g. optim.lr=1e-3"),
    resume: Optional[Path] = typer.Option(None, "--resume", help="Continue RUN_DIR from its last checkpoint."),
    overwrite: bool = typer.Option(False, "--overwrite",
                                   help="Start again in a run directory that has checkpoints (deletes them)."),
    device: Optional[str] = typer.Option(None, "--device", help="auto | cpu | cuda | cuda:N (sets train.device)."),
    quiet: bool = typer.Option(False, "--quiet", help="Print nothing while training (errors and the run directory only)."),
    verbose: bool = typer.Option(False, "--verbose", help="Also print every logged row with all its metrics."),
):
    """Train a model: `quantdyn train CONFIG.yaml [key=value ...]` or `--resume RUN_DIR`.

    Several processes: `torchrun --nproc_per_node N -m quantdyn.cli train CONFIG [dist.strategy=fsdp2]`.
    """
    from dataclasses import replace

    from quantdyn.config import apply_overrides, from_dict, load_yaml
    from quantdyn.monitor import hooks_for
    from quantdyn.sources.hub import open_checkpoint
    from quantdyn.train.branches import load_run_config
    from quantdyn.train.checkpoint import RunDir, latest_resumable
    from quantdyn.train.config import RunConfig
    from quantdyn.train.loggers import console_mode
    from quantdyn.train.trainer import train as run_train

    mode = console_mode(quiet, verbose)

    if resume is not None:
        if config is not None:
            raise QuantdynError("give either CONFIG.yaml or --resume RUN_DIR, not both")
        if overwrite:
            raise QuantdynError("--overwrite starts a run again from CONFIG.yaml; it does not go with --resume")
        cfg = load_run_config(resume)
        if device:
            cfg = replace(cfg, train=replace(cfg.train, device=device))
        ckpt = latest_resumable(resume)
        if ckpt is None:
            raise QuantdynError(
                f"run '{resume}' has no resumable checkpoint yet; start it again with "
                f"`quantdyn train {resume / 'config.yaml'}`"
            )
        if ckpt.step >= cfg.train.steps:  # a requeued job, or a kill after the last checkpoint: nothing is lost
            open_checkpoint(ckpt.path)  # ... unless the final checkpoint is damaged: that is one line, exit 2
            typer.echo(f"run '{resume}' is already finished at step {ckpt.step} (train.steps={cfg.train.steps}); "
                       "nothing to do (raise train.steps in its config.yaml to train on)", err=True)
            typer.echo(f"run directory: {resume}")
            return
        info = RunDir(resume).read_info()
        run_dir = Path(resume)
        kwargs = dict(resume=ckpt, parent=info.get("parent"))
    else:
        if config is None:
            raise QuantdynError("missing CONFIG.yaml; e.g. `quantdyn train configs/tiny.yaml` (or --resume RUN_DIR)")
        data = apply_overrides(load_yaml(config), [*(overrides or []), *([f"train.device={device}"] if device else [])])
        cfg = from_dict(RunConfig, data)
        run_dir = Path(cfg.out_dir) / cfg.name
        kwargs = dict(overwrite=overwrite)
    hooks = hooks_for(cfg)  # the PTQ monitor of cfg.monitor (its quantizers are checked here)
    try:
        out = run_train(cfg, run_dir, progress=mode != "quiet", verbose=mode == "verbose", hooks=hooks, **kwargs)
    except KeyboardInterrupt as e:
        last = latest_resumable(run_dir)
        if last is not None:
            hint = f"continue from step {last.step} with `quantdyn train --resume {run_dir}`"
        elif resume is None:
            hint = "no checkpoint was written yet; rerun the same command to start again"
        else:
            hint = f"rerun `quantdyn train --resume {run_dir}`"
        typer.echo(f"interrupted; {hint}", err=True)
        sys.exit(getattr(e, "exit_code", 130))
    typer.echo(f"run directory: {out}")


@app.command()
def cooldown(
    run_dir: Path = typer.Argument(..., help="Parent run directory."),
    from_step: int = typer.Option(..., "--from-step", help="Stable-phase checkpoint step to branch from."),
    decay_steps: str = typer.Option(..., "--decay-steps", help="Decay lengths, comma-separated: 200,400"),
    shape: str = typer.Option("linear", "--shape", help="linear | cosine | 1-sqrt"),
    control: bool = typer.Option(False, "--control", help="Also run constant-LR control twins."),
    device: Optional[str] = typer.Option(None, "--device", help="auto | cpu | cuda | cuda:N (default: the run's)."),
    quiet: bool = typer.Option(False, "--quiet", help="Print nothing while training."),
    verbose: bool = typer.Option(False, "--verbose", help="Also print every logged row with all its metrics."),
):
    """Branch cooldowns (LR decay to lr_end) from a stable-phase checkpoint."""
    from quantdyn.monitor import hooks_for
    from quantdyn.train.branches import cooldown as run_cooldown
    from quantdyn.train.branches import load_run_config
    from quantdyn.train.loggers import console_mode

    mode = console_mode(quiet, verbose)

    try:
        ds = [int(x) for x in decay_steps.split(",") if x.strip()]
    except ValueError:
        raise QuantdynError(f"--decay-steps '{decay_steps}' must be integers separated by commas, e.g. 200,400") from None
    hooks = hooks_for(load_run_config(run_dir))  # the parent's monitor section, for every branch
    for p in run_cooldown(run_dir, from_step, ds, shape, control, progress=mode != "quiet", device=device,
                          hooks=hooks, verbose=mode == "verbose"):
        typer.echo(f"branch: {p}")



# ----------------------------------------------------------- averaging
average_app = typer.Typer(no_args_is_help=True, help="Weight averaging: LAWA over a run, model soups.")
app.add_typer(average_app, name="average")


@average_app.command("lawa")
def average_lawa_cmd(
    run_dir: Path = typer.Argument(..., help="Run directory whose checkpoints to average."),
    window: int = typer.Option(..., "--window", help="K: checkpoints per average."),
    every: int = typer.Option(..., "--every", help="P: steps between averaged checkpoints."),
    out: Optional[Path] = typer.Option(None, "--out", help="Default: RUN_DIR/averages/lawa-kK-pP-offline"),
):
    """Offline LAWA: at each step on the P grid, the mean of the last K checkpoints."""
    from quantdyn.train.offline_averaging import average_lawa

    paths = average_lawa(run_dir, window, every, out=out)
    typer.echo(f"{len(paths)} LAWA checkpoints in {paths[0].parent if paths else out}")


@average_app.command("soup")
def average_soup_cmd(
    checkpoints: List[str] = typer.Argument(..., help="Ingredient checkpoint directories."),
    out: Path = typer.Option(..., "--out"),
    greedy: bool = typer.Option(False, "--greedy", help="Add an ingredient only if held-out loss improves."),
    weights: Optional[str] = typer.Option(None, "--weights", help="Comma-separated weights (uniform if omitted)."),
):
    """Model soup over checkpoints of different runs, seeds or branches."""
    from quantdyn.train.offline_averaging import make_soup

    w = None
    if weights:
        try:
            w = [float(x) for x in weights.split(",")]
        except ValueError:
            raise QuantdynError(f"--weights '{weights}' must be numbers separated by commas") from None
    path = make_soup(checkpoints, weights=w, greedy=greedy, out=out)
    typer.echo(f"soup: {path}")


@app.command()
def grid(
    config: Path = typer.Argument(..., help="Base run config YAML."),
    vary: List[str] = typer.Option(..., "--vary", help="KEY=v1,v2,... (repeatable), e.g. optim.lr=1e-4,1e-3"),
    seeds: int = typer.Option(0, "--seeds", help="Seeds per combination (0 = the config's seed only)."),
    grid_dir: Optional[Path] = typer.Option(None, "--dir", help="Default: OUT_DIR/NAME-grid"),
    dry_run: bool = typer.Option(False, "--dry-run", help="Show the expansion only."),
    slurm: bool = typer.Option(False, "--slurm", help="Write GRID_DIR/grid.sbatch (one array task per run) + torchrun commands instead of running."),
    submit: bool = typer.Option(False, "--submit", help="With --slurm: submit the array through submitit (pip install 'quantdyn[slurm]')."),
    nproc: int = typer.Option(1, "--nproc-per-node", help="Training processes (GPUs) per run."),
    partition: str = typer.Option("", "--partition", help="SLURM partition."),
    time_limit: str = typer.Option("", "--time", help="SLURM time limit per run, e.g. 04:00:00."),
    account: str = typer.Option("", "--account", help="SLURM account to charge."),
    qos: str = typer.Option("", "--qos", help="SLURM QOS."),
    gpus: int = typer.Option(0, "--gpus-per-node", help="GPUs per run (default: --nproc-per-node)."),
    cpus: int = typer.Option(0, "--cpus-per-task", help="CPUs per run."),
    mem_gb: int = typer.Option(0, "--mem-gb", help="Memory per run in GB."),
    max_parallel: int = typer.Option(0, "--max-parallel", help="Array throttle: at most this many runs at once."),
    constraint: str = typer.Option("", "--constraint", help="SLURM node constraint, e.g. h100."),
    sbatch_extra: Optional[List[str]] = typer.Option(None, "--sbatch", help="Extra #SBATCH option (repeatable), e.g. --sbatch=--exclusive"),
    setup: Optional[List[str]] = typer.Option(None, "--setup", help="Shell line run first in each task (repeatable)."),
    cluster: str = typer.Option("slurm", "--cluster", hidden=True, help="submitit cluster (local: run here, for tests)."),
    overrides: Optional[List[str]] = typer.Argument(None, help="key=value overrides of the base config"),
    quiet: bool = typer.Option(False, "--quiet", help="Print nothing while training (one line per run at the end)."),
    verbose: bool = typer.Option(False, "--verbose", help="Also print every logged row with all its metrics."),
):
    """Expand a grid of runs (e.g. LR x weight decay x seeds) and run it, or write/submit a SLURM array."""
    import shutil

    from quantdyn.config import apply_overrides, load_yaml
    from quantdyn.launch.grid import format_grid, grid_manifest, run_grid, submit_grid, write_grid, write_launch_scripts
    from quantdyn.launch.slurm import SlurmConfig
    from quantdyn.train.loggers import console_mode

    mode = console_mode(quiet, verbose)
    if submit and not slurm:
        raise QuantdynError("--submit goes with --slurm (submit the grid's SLURM array through submitit)")
    sl = SlurmConfig(partition=partition, time=time_limit, account=account, qos=qos, gpus_per_node=gpus,
                     cpus_per_task=cpus, mem_gb=mem_gb, nproc_per_node=nproc, max_parallel=max_parallel,
                     constraint=constraint, extra_sbatch=tuple(sbatch_extra or ()), setup=tuple(setup or ()))
    base = apply_overrides(load_yaml(config), overrides or [])
    gdir = grid_dir or Path(base.get("out_dir", "runs")) / f"{base.get('name', 'run')}-grid"
    if dry_run:
        typer.echo(format_grid(grid_manifest(base, vary, seeds, gdir)))
        return
    if submit and cluster == "slurm" and not shutil.which("sbatch"):
        raise QuantdynError("--submit needs SLURM here (no sbatch on PATH); run on the cluster's login node, "
                            "or drop --submit and sbatch the written grid.sbatch there")
    write_grid(base, vary, seeds, gdir)
    if slurm:
        sb, cmds = write_launch_scripts(gdir, slurm=sl)
        if not submit:
            typer.echo(f"wrote {sb} and {cmds}; submit with: sbatch {sb}")
            return
        jobs = submit_grid(gdir, sl, cluster=cluster)
        typer.echo(f"submitted {len(jobs)} runs" + (f" (job {jobs[0].job_id.split('_')[0]})" if jobs else
                                                     " (every run already finished)") + f"; logs in {gdir / 'submitit'}")
        return
    for r in run_grid(gdir, progress=mode != "quiet", verbose=mode == "verbose"):
        typer.echo(f"{r['name']}: {r['status']} ({r['dir']})")
