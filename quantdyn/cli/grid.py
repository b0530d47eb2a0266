"""``quantdyn grid``: train a grid of runs (a base config x varied keys x seeds), here or as a SLURM array."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from quantdyn.cli import options as opt
from quantdyn.cli.app import command

GRID = "Grid"


@command()
@opt.slurm_options
def grid(
    config: Path = typer.Argument(..., help="Base run config YAML."),
    overrides: Optional[List[str]] = typer.Argument(None, help="key=value overrides of the base config"),
    vary: List[str] = typer.Option(..., "--vary", help="KEY=v1,v2,... (repeatable), e.g. optim.lr=1e-4,1e-3",
                                   rich_help_panel=GRID),
    seeds: int = typer.Option(0, "--seeds", help="Seeds per combination (0 = the config's seed only).",
                              rich_help_panel=GRID),
    grid_dir: Optional[Path] = typer.Option(None, "--dir", help="Grid directory [default: OUT_DIR/NAME-grid].",
                                            rich_help_panel=GRID),
    dry_run: bool = typer.Option(False, "--dry-run", help="Show the expansion only.", rich_help_panel=GRID),
    nproc: int = typer.Option(1, "--nproc-per-node", help="Training processes (GPUs) per run.", rich_help_panel=GRID),
    script: bool = typer.Option(False, "--slurm", help="Write GRID_DIR/grid.sbatch (one array task per run) and "
                               "torchrun commands instead of running.", rich_help_panel=opt.SLURM),
    slurm: opt.SlurmOptions = None,
    quiet: bool = opt.quiet("Print nothing while training (one line per run at the end)."),
    verbose: bool = opt.verbose(),
):
    """Train a grid of runs: a base config x varied keys x seeds.

    The grid (e.g. LR x weight decay x seeds) runs here one run after another, or --slurm writes it as a SLURM
    array (--submit submits it through submitit). Finished runs are skipped, partial ones resumed."""
    from quantdyn.config import apply_overrides, load_yaml
    from quantdyn.launch.grid import format_grid, grid_manifest, run_grid, submit_grid, write_grid, write_launch_scripts
    from quantdyn.train.loggers import console_mode

    mode = console_mode(quiet, verbose)
    sl = slurm.config(nproc_per_node=nproc)
    base = apply_overrides(load_yaml(config), overrides or [])
    gdir = grid_dir or Path(base.get("out_dir", "runs")) / f"{base.get('name', 'run')}-grid"
    if dry_run:
        typer.echo(format_grid(grid_manifest(base, vary, seeds, gdir)))
        return
    opt.require_sbatch(slurm.submit, slurm.cluster)
    write_grid(base, vary, seeds, gdir)
    if script or slurm.submit:
        sb, cmds = write_launch_scripts(gdir, sl)
        if not slurm.submit:
            typer.echo(f"wrote {sb} and {cmds}; submit with: sbatch {sb}")
            return
        jobs = submit_grid(gdir, sl, cluster=slurm.cluster)
        typer.echo(f"submitted {len(jobs)} runs" + (f" (job {jobs[0].job_id.split('_')[0]})" if jobs else
                                                     " (every run already finished)") + f"; logs in {gdir / 'submitit'}")
        return
    for r in run_grid(gdir, progress=mode != "quiet", verbose=mode == "verbose"):
        typer.echo(f"{r['name']}: {r['status']} ({r['dir']})")
