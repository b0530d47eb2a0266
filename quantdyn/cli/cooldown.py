"""``quantdyn cooldown``: branch LR cooldowns (and constant-LR controls) from a stable-phase checkpoint."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from quantdyn.cli import options as opt
from quantdyn.cli.app import command
from quantdyn.errors import QuantdynError


@command()
def cooldown(
    run_dir: Path = typer.Argument(..., help="Parent run directory."),
    from_step: int = typer.Option(..., "--from-step", help="Stable-phase checkpoint step to branch from."),
    decay_steps: str = typer.Option(..., "--decay-steps", help="Decay lengths, comma-separated: 200,400"),
    shape: str = typer.Option("linear", "--shape", help="linear | cosine | 1-sqrt"),
    control: bool = typer.Option(False, "--control", help="Also run constant-LR control twins."),
    device: Optional[str] = opt.device(None, "[default: the run's]"),
    quiet: bool = opt.quiet("Print nothing while training."),
    verbose: bool = opt.verbose(),
):
    """Branch LR cooldowns from a stable-phase checkpoint.

    Each branch decays the LR to lr_end over its decay length; --control adds a constant-LR twin of each."""
    from quantdyn.monitor import hooks_for
    from quantdyn.train.branches import cooldown as run_cooldown
    from quantdyn.train.config import load_run_config
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
