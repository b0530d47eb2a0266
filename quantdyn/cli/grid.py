"""``quantdyn grid``: train a grid of runs (a base config x varied keys x seeds), here or as a SLURM array."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from quantdyn.cli import options as opt
from quantdyn.cli.app import command, plural

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
    on_slurm: bool = typer.Option(False, "--slurm", help="Submit the grid to SLURM instead of training here: "
                                  "GRID_DIR/grid.sbatch, one array task per run, submitted with sbatch; prints the "
                                  "job id and how to follow and resume it.", rich_help_panel=opt.SLURM),
    slurm: opt.SlurmOptions = None,
    quiet: bool = opt.quiet("Print nothing while training (one line per run at the end)."),
    verbose: bool = opt.verbose(),
):
    """Train a grid of runs: a base config x varied keys x seeds.

    The grid (e.g. LR x weight decay x seeds) runs here one run after another, or --slurm submits it as a SLURM
    array. Finished runs are skipped, partial ones resumed."""
    from quantdyn.config import apply_overrides, load_yaml
    from quantdyn.launch.grid import format_grid, grid_manifest, run_grid
    from quantdyn.train.loggers import console_mode

    mode = console_mode(quiet, verbose)
    sl = slurm.config(nproc_per_node=nproc)
    base = apply_overrides(load_yaml(config), overrides or [])
    gdir = grid_dir or Path(base.get("out_dir", "runs")) / f"{base.get('name', 'run')}-grid"
    if dry_run:
        typer.echo(format_grid(grid_manifest(base, vary, seeds, gdir)))
        return
    if slurm.wanted(on_slurm):
        return _grid_on_slurm(base, vary, seeds, gdir, sl, slurm.write_only)
    from quantdyn.files import ensure_writable
    from quantdyn.launch.grid import write_grid

    ensure_writable(gdir, "--dir" if grid_dir else "the grid directory (the config's out_dir)")
    write_grid(base, vary, seeds, gdir)
    for r in run_grid(gdir, progress=mode != "quiet", verbose=mode == "verbose"):
        typer.echo(f"{r['name']}: {r['status']} ({r['dir']})")


def _grid_on_slurm(base: dict, vary: list[str], seeds: int, gdir: Path, sl, write_only: bool) -> None:
    """Submit the grid as an sbatch array (one task per run); with --write-only write it only. Every refusal (no
    sbatch, a grid directory the tasks cannot write, a job SLURM would not take) is one line before anything is
    written or submitted."""
    from quantdyn.launch import slurm as launch
    from quantdyn.launch.grid import grid_manifest, slurm_script, unfinished_runs, write_grid, write_launch_scripts

    if not write_only:
        launch.require_sbatch()
    launch.check_writable(gdir, "grid directory", "--dir")
    manifest = grid_manifest(base, vary, seeds, gdir)
    if not write_only:
        launch.check_submission(slurm_script(manifest, sl))
    write_grid(base, vary, seeds, gdir)
    sb, cmds = write_launch_scripts(gdir, sl)
    if write_only:
        typer.echo(f"wrote {sb} and {cmds}; submit with: sbatch {sb}")
        return
    left = unfinished_runs(manifest)
    if not left:
        typer.echo(f"every run of {gdir} has finished; nothing submitted")
        return
    job = launch.submit(sb)
    n = len(manifest["runs"])
    for line in launch.submitted_lines(
            job, n, f"{plural(n, 'run')} of {gdir} ({len(left)} to train or resume)", gdir / "logs", gdir.name,
            watch=f"ls {gdir}/runs/*/checkpoints",
            resume=f"the same command again (finished runs exit at once, partial ones resume), or `sbatch {sb}`"):
        typer.echo(line)
