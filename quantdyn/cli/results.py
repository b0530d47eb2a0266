"""Commands that read results and run studies: results, report, scaling, study, demo."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from quantdyn.cli.app import app, echo_json


@app.command()
def results(
    store: str = typer.Option("results", "--store", help="Results store directory."),
    where: Optional[str] = typer.Option(None, "--where", help="SQL condition, e.g. \"bits = 3 AND branch = 'main'\""),
    csv: Optional[Path] = typer.Option(None, "--csv", help="Also write the rows as CSV."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON array of rows."),
    all_columns: bool = typer.Option(False, "--all", help="Every column (default: the main ones)."),
):
    """Print result rows (default: the store `make demo` wrote)."""
    from quantdyn.results.store import ResultStore

    st = ResultStore(store, create=False)
    main_cols = ("run, branch, kind, step, tokens, lr, quantizer, ce_fp, ce_q, delta_ce, delta_ce_se, kl, top1_agree")
    cols, rows = st.query(where, "* EXCLUDE (window_delta)" if (all_columns or as_json or csv) else main_cols,
                          order="run, branch, tokens, quantizer")
    recs = [dict(zip(cols, r)) for r in rows]
    if csv:
        import csv as _csv

        with open(csv, "w", newline="") as f:
            w = _csv.DictWriter(f, fieldnames=cols)
            w.writeheader()
            w.writerows(recs)
    if as_json:
        typer.echo(json.dumps(recs, default=str))
        return
    if not recs:
        typer.echo("no rows")
        return
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return "" if v is None else str(v)
    widths = [max(len(c), *(len(fmt(r[c])) for r in recs)) for c in cols]
    typer.echo("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for r in recs:
        typer.echo("  ".join(fmt(r[c]).ljust(w) for c, w in zip(cols, widths)))
    typer.echo(f"({len(recs)} rows)")


@app.command()
def report(
    store_or_run: Path = typer.Argument(Path("results"), help="A results store or a run directory."),
    out: Path = typer.Option(Path("report"), "--out", help="Output directory for index.html and PNGs."),
    store: Optional[str] = typer.Option(None, "--store", help="Store to read when given a run directory."),
):
    """Write the static HTML report with the papers' figures."""
    from quantdyn.report.html import write_report

    page = write_report(store_or_run, out, store=store)
    typer.echo(f"report: {page}")


@app.command()
def study(spec: Path = typer.Argument(..., help="Study spec YAML (see configs/kjv_cooldown_study.yaml)."),
          quiet: bool = typer.Option(False, "--quiet")):
    """A cooldown study: train (seeds), cooldowns + controls, sweep, report, endpoint-vs-control summary."""
    from quantdyn.study.demo import load_study_spec, run_study

    run_study(load_study_spec(spec), progress=not quiet, echo=typer.echo)


@app.command()
def demo(quiet: bool = typer.Option(False, "--quiet")):
    """The embedded default study: train, cooldowns + controls, sweep, report, summary."""
    from quantdyn.study.demo import run_demo

    run_demo(progress=not quiet, echo=typer.echo)


@app.command()
def scaling(
    store: str = typer.Argument("results", help="Results store with swept FP and QAT runs."),
    by: str = typer.Option("optim.name", "--by", help="Group runs by this key (optim.name, or a row column)."),
    all_checkpoints: bool = typer.Option(False, "--all-checkpoints", help="Every checkpoint, not only each run's last."),
    bootstrap: int = typer.Option(200, "--bootstrap", help="Bootstrap resamples for intervals."),
    as_json: bool = typer.Option(False, "--json"),
):
    """Fit L(N, D) = A(ρN)^-α + B·D^-β + E per group for FP and QAT runs; rows go to the store."""
    from quantdyn.study.scaling_study import fit_scaling

    rows = fit_scaling(store, by, all_checkpoints, bootstrap)
    if as_json:
        echo_json([{k: v for k, v in r.items() if k != "points"} for r in rows])
        return
    for r in rows:
        rho = f"  ρ={r['rho']:.3f}" + (f" [{r.get('rho_lo', float('nan')):.3f}, {r.get('rho_hi', float('nan')):.3f}]"
                                      if r["precision"] == "qat" else "")
        typer.echo(f"{r['group']:<16} {r['precision']:<4} A={r['A']:.3g} α={r['alpha']:.3f} B={r['B']:.3g} "
                   f"β={r['beta']:.3f} E={r['E']:.3f} ({r['n_points']} points){rho}")
