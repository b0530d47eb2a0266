"""The Typer application and the entry point; every user error ends as one line on stderr (exit 2)."""
from __future__ import annotations

import json
import sys

import typer

from quantdyn.errors import QuantdynError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="How training dynamics decide post-training quantization robustness.")


def echo_json(obj) -> None:
    typer.echo(json.dumps(obj, default=str))


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
