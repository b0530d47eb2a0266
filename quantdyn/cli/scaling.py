"""``quantdyn scaling``: fit the scaling law L(N, D) per group of FP and QAT runs of a store."""
from __future__ import annotations

from typing import Optional

import typer

from quantdyn.cli import options as opt
from quantdyn.cli.app import command, deprecated, echo_json
from quantdyn.errors import QuantdynError


@command()
def scaling(
    store_arg: Optional[str] = typer.Argument(None, metavar="STORE", hidden=True, help="Old spelling of --store."),
    store_opt: Optional[str] = opt.store(None, "With swept FP and QAT runs [default: results]."),
    by: str = typer.Option("optim.name", "--by", help="Group runs by this key (optim.name, or a row column)."),
    all_checkpoints: bool = typer.Option(False, "--all-checkpoints", help="Every checkpoint, not only each run's last."),
    bootstrap: int = typer.Option(200, "--bootstrap", help="Bootstrap resamples for intervals."),
    as_json: bool = opt.as_json("the fits as a JSON array"),
):
    """Fit the scaling law of FP and QAT runs per group.

    L(N, D) = A(ρN)^-α + B·D^-β + E per group (e.g. per optimizer), with bootstrap intervals; rows go to the store."""
    from quantdyn.studies.scaling import fit_scaling

    if store_arg is not None:
        if store_opt is not None and store_arg != store_opt:
            raise QuantdynError(f"two stores given ('{store_arg}' and --store '{store_opt}'); give only --store")
        deprecated("scaling STORE", "use --store STORE")
    from quantdyn.files import ensure_writable

    store = store_opt or store_arg or "results"
    ensure_writable(store, "--store")  # the fits are stored there
    rows = fit_scaling(store, by, all_checkpoints, bootstrap)
    if as_json:
        echo_json([{k: v for k, v in r.items() if k != "points"} for r in rows])
        return
    for r in rows:
        rho = f"  ρ={r['rho']:.3f}" + (f" [{r.get('rho_lo', float('nan')):.3f}, {r.get('rho_hi', float('nan')):.3f}]"
                                      if r["precision"] == "qat" else "")
        typer.echo(f"{r['group']:<16} {r['precision']:<4} A={r['A']:.3g} α={r['alpha']:.3f} B={r['B']:.3g} "
                   f"β={r['beta']:.3f} E={r['E']:.3f} ({r['n_points']} points){rho}")
