"""The ``quantdyn`` console script.  Subcommands only parse arguments and
call the library; every user error ends as one line on stderr (exit 2)."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer

from quantdyn.errors import QuantdynError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="How training dynamics decide post-training quantization robustness.")


def _echo_json(obj) -> None:
    typer.echo(json.dumps(obj, default=str))


# ------------------------------------------------------------------ train
@app.command()
def train(
    config: Optional[Path] = typer.Argument(None, help="Run config YAML (see configs/)."),
    overrides: Optional[List[str]] = typer.Argument(None, help="key=value overrides, e.g. optim.lr=1e-3"),
    resume: Optional[Path] = typer.Option(None, "--resume", help="Continue RUN_DIR from its last checkpoint."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress bar."),
):
    """Train a model: `quantdyn train CONFIG.yaml [key=value ...]` or `--resume RUN_DIR`."""
    from quantdyn.config import apply_overrides, from_dict, load_yaml
    from quantdyn.train.branches import load_run_config
    from quantdyn.train.checkpoint import latest_resumable
    from quantdyn.train.config import RunConfig
    from quantdyn.train.trainer import train as run_train

    if resume is not None:
        if config is not None:
            raise QuantdynError("give either CONFIG.yaml or --resume RUN_DIR, not both")
        cfg = load_run_config(resume)
        ckpt = latest_resumable(resume)
        if ckpt is None:
            raise QuantdynError(f"run '{resume}' has no resumable checkpoint yet; start it again with its config")
        info = json.loads((resume / "run.json").read_text()) if (resume / "run.json").is_file() else {}
        out = run_train(cfg, resume, resume=ckpt, parent=info.get("parent"), progress=not quiet)
    else:
        if config is None:
            raise QuantdynError("missing CONFIG.yaml; e.g. `quantdyn train configs/tiny.yaml` (or --resume RUN_DIR)")
        data = apply_overrides(load_yaml(config), overrides or [])
        cfg = from_dict(RunConfig, data)
        out = run_train(cfg, progress=not quiet)
    typer.echo(f"run directory: {out}")


@app.command()
def cooldown(
    run_dir: Path = typer.Argument(..., help="Parent run directory."),
    from_step: int = typer.Option(..., "--from-step", help="Stable-phase checkpoint step to branch from."),
    decay_steps: str = typer.Option(..., "--decay-steps", help="Decay lengths, comma-separated: 200,400"),
    shape: str = typer.Option("linear", "--shape", help="linear | cosine | 1-sqrt"),
    control: bool = typer.Option(False, "--control", help="Also run constant-LR control twins."),
    quiet: bool = typer.Option(False, "--quiet"),
):
    """Branch cooldowns (LR decay to lr_end) from a stable-phase checkpoint."""
    from quantdyn.train.branches import cooldown as run_cooldown

    try:
        ds = [int(x) for x in decay_steps.split(",") if x.strip()]
    except ValueError:
        raise QuantdynError(f"--decay-steps '{decay_steps}' must be integers separated by commas, e.g. 200,400") from None
    for p in run_cooldown(run_dir, from_step, ds, shape, control, progress=not quiet):
        typer.echo(f"branch: {p}")


def main() -> None:
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        app(standalone_mode=False)
    except QuantdynError as e:
        typer.echo(f"error: {e}", err=True)
        sys.exit(2)
    except (typer.Abort, KeyboardInterrupt):
        typer.echo("interrupted; rerun the same command to resume", err=True)
        sys.exit(130)
    except Exception as e:  # click usage errors
        import click

        if isinstance(e, click.exceptions.ClickException):
            e.show()
            sys.exit(e.exit_code)
        if isinstance(e, click.exceptions.Exit):
            sys.exit(e.exit_code)
        raise


if __name__ == "__main__":
    main()
