"""The ``quantdyn`` console script.  Subcommands only parse arguments and
call the library; every user error ends as one line on stderr (exit 2).

Commands live in modules named for what they do (training, measuring,
results); importing this package registers them on :data:`app`.
"""
from quantdyn.cli import training, measuring, results, trajectories  # noqa: F401, I001  (registers the commands, in pipeline order)
from quantdyn.cli.app import app, main

__all__ = ["app", "main"]
