"""The ``quantdyn`` console script.  Subcommands only parse arguments and
call the library; every user error ends as one line on stderr (exit 2).

Command X lives in ``cli/X.py`` (``average lawa|soup`` in ``cli/average.py``); ``cli/app.py`` holds the
application and the error handling, ``cli/options.py`` the options several commands share.  Importing this
package registers the commands on :data:`app`, in pipeline order; it imports no torch (``quantdyn -h`` stays
fast: commands import the library inside their functions).
"""
from quantdyn.cli import (  # noqa: F401, I001  (registers the commands, in pipeline order)
    train, cooldown, average, grid, quantize, check_export, allocate, sweep, ship, analyze, interpolate, eval, results,
    report, study,
    demo, scaling, trajectories,
)
from quantdyn.cli.app import app, main

__all__ = ["app", "main"]
