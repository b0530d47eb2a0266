"""``quantdyn study``: a study spec -> runs, cooldowns, averages, sweep, report and findings with verdicts."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from quantdyn.cli import options as opt
from quantdyn.cli.app import command


@command()
def study(
    spec: Path = typer.Argument(..., help="Study spec YAML (see configs/studies/ and configs/kjv_cooldown_study.yaml)."),
    overrides: Optional[List[str]] = typer.Argument(None, help="key=value overrides of the spec, e.g. "
                                                    "run.data.source=my.txt sweep.quant_repeats=3 "
                                                    "scale=pythia-160m (data.source=... means run.data.source)"),
    store: Optional[str] = opt.store(None, "[default: the spec's sweep.store]"),
    out: Optional[Path] = opt.out(None, "the report to this directory [default: the spec's report]."),
    device: Optional[str] = opt.device(None, "For training and sweeps [default: the spec's]."),
    quiet: bool = opt.quiet("No progress; stage lines, the findings and errors only."),
):
    """Run a study from its spec, from training to findings.

    Train (seeds, grid), branch cooldowns and their controls, average, sweep, write the report and the findings
    table with verdicts; every stage skips what is done."""
    import quantdyn.studies.pipeline as pipeline
    from quantdyn.studies.spec import load_study_spec

    spec_ = load_study_spec(spec, [*(overrides or []), *option_overrides(store, out, device)])
    check_places(spec_)
    pipeline.run_study(spec_, progress=not quiet, echo=typer.echo)


def check_places(spec) -> None:
    """Every place a study writes (its runs' out_dir, the store, the report, the ship decisions) checked writable
    before any work (files.ensure_writable: one line naming the spec key, or the option that set it)."""
    from quantdyn.files import ensure_writable

    for path, what in ((spec.run.out_dir, "run.out_dir"), (spec.sweep.store, "--store (sweep.store)"),
                       (spec.report, "--out (report)")) + (((spec.ship.out, "ship.out"),) if spec.ship.enabled else ()):
        ensure_writable(path, what)


def option_overrides(store: Optional[str], out: Optional[Path], device: Optional[str]) -> list[str]:
    """The command line's --store, --out and --device as spec overrides (applied after the user's own)."""
    extra = []
    if store is not None:
        extra.append(f"sweep.store={store}")
    if out is not None:
        extra.append(f"report={out}")
    if device is not None:
        extra += [f"sweep.device={device}", f"run.train.device={device}"]
    return extra
