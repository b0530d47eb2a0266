"""Commands that read results and run studies: results, report, scaling, study, demo.

Names shared with every other command: ``--store`` (a results store), ``--out`` (an output file or
directory), ``--device`` (where computation runs).  Old spellings stay as hidden aliases:
``results --csv FILE`` (= ``--out FILE.csv``), ``scaling STORE`` (= ``--store STORE``).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from quantdyn.cli.app import app, echo_json
from quantdyn.errors import QuantdynError


@app.command()
def results(
    store: str = typer.Option("results", "--store", help="Results store directory."),
    where: Optional[str] = typer.Option(None, "--where", help="SQL condition, e.g. \"bits = 3 AND branch = 'main'\""),
    out: Optional[Path] = typer.Option(None, "--out", help="Also write the rows to this file: .csv, .json, .jsonl "
                                       "or .parquet (every column; nested fields as dotted columns)."),
    parquet: Optional[Path] = typer.Option(None, "--parquet", help="Also write the rows (every column) to this "
                                           "Parquet file; the same as --out FILE.parquet."),
    csv: Optional[Path] = typer.Option(None, "--csv", hidden=True, help="Old spelling of --out FILE.csv."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON array of rows."),
    all_columns: bool = typer.Option(False, "--all", help="Every column (default: the main ones)."),
    check: bool = typer.Option(False, "--check", help="Check every line of the store instead; move unreadable "
                               "lines to STORE/quarantine/ and remove temporary files left by killed writers."),
):
    """Print result rows (default: the store `make demo` wrote), or check the store with --check."""
    from quantdyn.files import write_text_atomic
    from quantdyn.results.store import ResultStore

    st = ResultStore(store, create=False)
    if check:
        typer.echo(st.check(repair=True).summary(st.root, repair=True))
        return
    if parquet is not None:
        if out is not None or csv is not None:
            raise QuantdynError("give one output file: --parquet FILE or --out FILE, not both")
        out = parquet if parquet.suffix else parquet.with_suffix(".parquet")
        if out.suffix.lower() != ".parquet":
            raise QuantdynError(f"--parquet '{parquet}': name a .parquet file")
    target, fmt = _output(out, csv)
    cols, rows = st.query(where)
    recs = sorted((dict(zip(cols, r)) for r in rows), key=lambda r: tuple(_sort_key(r.get(c)) for c in _ORDER))
    cols = [c for c in cols if c != "window_delta"] if (all_columns or as_json or target) else \
        [c for c in _MAIN_COLUMNS if c in cols]  # a store holds the columns its rows have
    recs = [{c: r[c] for c in cols} for r in recs]
    if target is not None and fmt == "parquet":
        from quantdyn.results.tables import to_parquet  # pandas/pyarrow only for this output

        to_parquet(st, target, keys=[r["key"] for r in recs] if where else None)
    elif target is not None:
        write_text_atomic(target, _render(recs, cols, fmt))
    if as_json:
        typer.echo(json.dumps(recs, default=str))
        return
    if not recs:
        typer.echo("no rows")
        return
    def fmt_cell(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return "" if v is None else str(v)
    widths = [max(len(c), *(len(fmt_cell(r[c])) for r in recs)) for c in cols]
    typer.echo("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for r in recs:
        typer.echo("  ".join(fmt_cell(r[c]).ljust(w) for c, w in zip(cols, widths)))
    typer.echo(f"({len(recs)} rows)" + (f"; written to {target}" if target is not None else ""))


_FORMATS = {".csv": "csv", ".json": "json", ".jsonl": "jsonl", ".parquet": "parquet"}
_MAIN_COLUMNS = ("run", "branch", "kind", "step", "tokens", "lr", "quantizer", "ce_fp", "ce_q", "delta_ce", "delta_ce_se",
                 "kl", "top1_agree")
_ORDER = ("run", "branch", "tokens", "quantizer")


def _sort_key(v) -> tuple:
    """Numbers before text before missing values, so columns of mixed rows sort without errors."""
    if v is None:
        return (2, "")
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return (0, v)
    return (1, str(v))


def _output(out: Optional[Path], csv: Optional[Path]) -> tuple[Optional[Path], str]:
    """The file to write rows to and its format (checked before any work)."""
    if out is not None and csv is not None:
        raise QuantdynError("give --out FILE (the --csv spelling is old), not both")
    if csv is not None:
        return csv, "csv"
    if out is None:
        return None, ""
    fmt = _FORMATS.get(out.suffix.lower())
    if fmt is None:
        raise QuantdynError(f"--out '{out}': name a .csv, .json, .jsonl or .parquet file")
    if out.is_dir():
        raise QuantdynError(f"--out '{out}' is a directory; name a file, e.g. {out / ('rows' + out.suffix)}")
    return out, fmt


def _render(recs: list[dict], cols: list[str], fmt: str) -> str:
    if fmt == "json":
        return json.dumps(recs, default=str, indent=1)
    if fmt == "jsonl":
        return "".join(json.dumps(r, default=str) + "\n" for r in recs)
    import csv as _csv
    import io

    buf = io.StringIO()
    w = _csv.DictWriter(buf, fieldnames=cols)
    w.writeheader()
    w.writerows(recs)
    return buf.getvalue()


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
def study(spec: Path = typer.Argument(..., help="Study spec YAML (see configs/studies/ and configs/kjv_cooldown_study.yaml)."),
          overrides: Optional[List[str]] = typer.Argument(None, help="key=value overrides of the spec, e.g. "
                                                          "run.data.source=my.txt sweep.quant_repeats=3 "
                                                          "scale=pythia-160m (data.source=... means run.data.source)"),
          store: Optional[str] = typer.Option(None, "--store", help="Results store (default: the spec's sweep.store)."),
          out: Optional[Path] = typer.Option(None, "--out", help="Report directory (default: the spec's report)."),
          device: Optional[str] = typer.Option(None, "--device", help="Device for training and sweeps "
                                               "(auto, cpu, cuda, cuda:N; default: the spec's)."),
          quiet: bool = typer.Option(False, "--quiet", help="No progress; stage lines, the findings and errors only.")):
    """A study: train (seeds, grid), cooldowns + controls, averages, sweep, report, findings table with verdicts."""
    import quantdyn.studies.pipeline as pipeline
    from quantdyn.studies.spec import load_study_spec

    spec_ = load_study_spec(spec, [*(overrides or []), *_option_overrides(store, out, device)])
    pipeline.run_study(spec_, progress=not quiet, echo=typer.echo)


@app.command()
def demo(overrides: Optional[List[str]] = typer.Argument(None, help="key=value overrides of the embedded spec, "
                                                         "e.g. sweep.quant_repeats=3"),
         store: Optional[str] = typer.Option(None, "--store", help="Results store (default: results)."),
         out: Optional[Path] = typer.Option(None, "--out", help="Report directory (default: report)."),
         device: Optional[str] = typer.Option(None, "--device", help="Device for training and sweeps "
                                              "(auto, cpu, cuda, cuda:N; default: auto)."),
         quiet: bool = typer.Option(False, "--quiet", help="No progress; stage lines, the findings and errors only.")):
    """The embedded default study: train, cooldowns + controls, sweep, report, summary and findings."""
    import quantdyn.studies.pipeline as pipeline
    from quantdyn.studies.spec import demo_spec

    spec_ = demo_spec([*(overrides or []), *_option_overrides(store, out, device)])
    pipeline.run_study(spec_, progress=not quiet, echo=typer.echo)


def _option_overrides(store: Optional[str], out: Optional[Path], device: Optional[str]) -> list[str]:
    """The command line's --store, --out and --device as spec overrides (applied after the user's own)."""
    extra = []
    if store is not None:
        extra.append(f"sweep.store={store}")
    if out is not None:
        extra.append(f"report={out}")
    if device is not None:
        extra += [f"sweep.device={device}", f"run.train.device={device}"]
    return extra


@app.command()
def scaling(
    store_arg: Optional[str] = typer.Argument(None, metavar="STORE", help="Old spelling of --store."),
    store_opt: Optional[str] = typer.Option(None, "--store", help="Results store with swept FP and QAT runs "
                                            "[default: results]."),
    by: str = typer.Option("optim.name", "--by", help="Group runs by this key (optim.name, or a row column)."),
    all_checkpoints: bool = typer.Option(False, "--all-checkpoints", help="Every checkpoint, not only each run's last."),
    bootstrap: int = typer.Option(200, "--bootstrap", help="Bootstrap resamples for intervals."),
    as_json: bool = typer.Option(False, "--json"),
):
    """Fit L(N, D) = A(ρN)^-α + B·D^-β + E per group for FP and QAT runs; rows go to the store."""
    from quantdyn.studies.scaling import fit_scaling

    if store_arg is not None and store_opt is not None and store_arg != store_opt:
        raise QuantdynError(f"two stores given ('{store_arg}' and --store '{store_opt}'); give only --store")
    rows = fit_scaling(store_opt or store_arg or "results", by, all_checkpoints, bootstrap)
    if as_json:
        echo_json([{k: v for k, v in r.items() if k != "points"} for r in rows])
        return
    for r in rows:
        rho = f"  ρ={r['rho']:.3f}" + (f" [{r.get('rho_lo', float('nan')):.3f}, {r.get('rho_hi', float('nan')):.3f}]"
                                      if r["precision"] == "qat" else "")
        typer.echo(f"{r['group']:<16} {r['precision']:<4} A={r['A']:.3g} α={r['alpha']:.3f} B={r['B']:.3g} "
                   f"β={r['beta']:.3f} E={r['E']:.3f} ({r['n_points']} points){rho}")
