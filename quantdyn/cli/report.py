"""``quantdyn report``: the static HTML report of a results store or a run."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from quantdyn.cli import options as opt
from quantdyn.cli.app import command


@command()
def report(
    store_or_run: Path = typer.Argument(Path("results"), help="A results store or a run directory."),
    out: Path = opt.out(Path("report"), "index.html and the figures to this directory."),
    store: Optional[str] = opt.store(None, "Read when the argument is a run directory [default: results].",
                                         writes=False),
):
    """Write the static HTML report of a results store or a run."""
    from quantdyn.studies.section import write_report

    page = write_report(store_or_run, out, store=store, echo=typer.echo)
    typer.echo(f"report: {page}")
