"""``quantdyn demo``: the embedded default study, end to end on a CPU."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from quantdyn.cli import options as opt
from quantdyn.cli.app import command
from quantdyn.cli.study import check_places, option_overrides


@command()
def demo(
    overrides: Optional[List[str]] = typer.Argument(None, help="key=value overrides of the embedded spec, "
                                                    "e.g. sweep.quant_repeats=3"),
    store: Optional[str] = opt.store(None, "[default: results]"),
    out: Optional[Path] = opt.out(None, "the report to this directory [default: report]."),
    device: Optional[str] = opt.device(None, "For training and sweeps [default: auto]."),
    quiet: bool = opt.quiet("No progress; stage lines, the findings and errors only."),
):
    """Run the embedded default study and print its findings.

    Train, branch cooldowns and their controls, sweep, write the report, then the summary and the findings."""
    import quantdyn.studies.pipeline as pipeline
    from quantdyn.studies.spec import demo_spec

    spec_ = demo_spec([*(overrides or []), *option_overrides(store, out, device)])
    check_places(spec_)
    pipeline.run_study(spec_, progress=not quiet, echo=typer.echo)
