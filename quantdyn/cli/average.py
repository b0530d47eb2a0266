"""``quantdyn average lawa|soup``: weight averaging after training (LAWA over a run, model soups)."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from quantdyn.cli import options as opt
from quantdyn.cli.app import app, command
from quantdyn.errors import QuantdynError

average_app = typer.Typer(no_args_is_help=True, help="Average weights: LAWA over a run, or a model soup.")
app.add_typer(average_app, name="average")


@command("lawa", parent=average_app)
def average_lawa_cmd(
    run_dir: Path = typer.Argument(..., help="Run directory whose checkpoints to average."),
    window: int = typer.Option(..., "--window", help="K: checkpoints per average."),
    every: int = typer.Option(..., "--every", help="P: steps between averaged checkpoints."),
    out: Optional[Path] = opt.out(None, "the averaged checkpoints to this directory [default: "
                                  "RUN_DIR/averages/lawa-kK-pP-offline]."),
):
    """Average the last K checkpoints at every P steps (offline LAWA)."""
    from quantdyn.train.offline_averaging import average_lawa

    paths = average_lawa(run_dir, window, every, out=out)
    typer.echo(f"{len(paths)} LAWA checkpoints in {paths[0].parent if paths else out}")


@command("soup", parent=average_app)
def average_soup_cmd(
    checkpoints: List[str] = typer.Argument(..., help="Ingredients: checkpoint directories, hub id@revision or "
                                                      "preset points (smollm3-3b@REVISION), e.g. public revisions "
                                                      "or cooldown branches of one model."),
    out: Path = opt.out(..., "the soup checkpoint to this directory.", kind="new-dir"),
    greedy: bool = typer.Option(False, "--greedy", help="Add an ingredient only if held-out loss improves."),
    weights: Optional[str] = typer.Option(None, "--weights", help="Comma-separated weights (uniform if omitted)."),
):
    """Average checkpoints of different runs, seeds, branches or public revisions (a model soup).

    The soup is an HF checkpoint of the ingredients' architecture (their own transformers class)."""
    from quantdyn.sources.hub import resolve_checkpoint
    from quantdyn.sources.presets import preset_point
    from quantdyn.train.offline_averaging import make_soup

    w = None
    if weights:
        try:
            w = [float(x) for x in weights.split(",")]
        except ValueError:
            raise QuantdynError(f"--weights '{weights}' must be numbers separated by commas") from None
    points = [preset_point(c) for c in checkpoints]
    paths = [resolve_checkpoint(p.hub_ref if p is not None else c) for c, p in zip(checkpoints, points)]
    path = make_soup(paths, weights=w, greedy=greedy, out=out, refs=checkpoints)
    typer.echo(f"soup: {path}")
