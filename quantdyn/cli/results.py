"""``quantdyn results``: print, export or check the rows of a results store."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from quantdyn.cli import options as opt
from quantdyn.cli.app import command, deprecated
from quantdyn.errors import QuantdynError


@command()
def results(
    store: str = opt.store("results", writes=False),
    where: Optional[str] = typer.Option(None, "--where", help="SQL condition, e.g. \"bits = 3 AND branch = 'main'\""),
    out: Optional[Path] = opt.out(None, "the rows to this file as well: .csv, .json, .jsonl or .parquet (every "
                                  "column; nested fields as dotted columns); prints a one-line summary instead of the table.",
                                  kind="file"),
    parquet: Optional[Path] = typer.Option(None, "--parquet", help="Also write the rows (every column) to this "
                                           "Parquet file; the same as --out FILE.parquet.",
                                           callback=opt.writable("file")),
    csv: Optional[Path] = typer.Option(None, "--csv", hidden=True, help="Old spelling of --out FILE.csv.",
                                       callback=opt.writable("file")),
    as_json: bool = opt.as_json(),
    all_columns: bool = typer.Option(False, "--all", help="Every column in the table (default: the main ones; a "
                                     "file from --out and --json always hold every column)."),
    columns: Optional[str] = typer.Option(None, "--columns", help="Comma-separated columns to show instead of "
                                          "the main ones, e.g. quantizer,kl_p99,top5_agree (any row field: "
                                          "quantdyn.results.schema.FIELDS)."),
    check: bool = typer.Option(False, "--check", help="Check every line of the store instead; move unreadable "
                               "lines to STORE/quarantine/ and remove temporary files left by killed writers."),
):
    """Print the rows of a results store, or check it.

    The default store is the one `make demo` wrote; --where selects rows, --out writes them to a file, --check
    checks every line of the store instead."""
    from quantdyn.files import ensure_writable, write_text_atomic
    from quantdyn.results.store import ResultStore

    if csv is not None:
        deprecated("results --csv FILE", "use --out FILE.csv")
    st = ResultStore(store, create=False)
    if check:
        ensure_writable(st.root, "--store")  # --check moves unreadable lines to STORE/quarantine/
        typer.echo(st.check(repair=True).summary(st.root, repair=True))
        return
    if parquet is not None:
        if out is not None or csv is not None:
            raise QuantdynError("give one output file: --parquet FILE or --out FILE, not both")
        out = parquet if parquet.suffix else parquet.with_suffix(".parquet")
        if out.suffix.lower() != ".parquet":
            raise QuantdynError(f"--parquet '{parquet}': name a .parquet file")
    target, fmt = _output(out, csv)
    asked = _asked_columns(columns)
    cols, rows = st.query(where)
    recs = sorted((dict(zip(cols, r)) for r in rows), key=lambda r: tuple(_sort_key(r.get(c)) for c in _ORDER))
    if asked:
        for c in asked:  # a field the schema knows but rows lack: one line naming it, its cells empty
            lacking = sum(1 for r in recs if r.get(c) is None)
            if lacking:
                typer.echo(f"note: {c}: {lacking} of {len(recs)} rows lack it (written before the field existed, or "
                           "of a kind that has none); shown empty", err=True)
    every = asked or [c for c in cols if c != "window_delta"]  # what a file and --json get
    # the terminal: the main columns (a store holds the columns its rows have), every one with --all
    cols = asked or (every if all_columns else [c for c in _MAIN_COLUMNS if c in cols])
    if target is not None and fmt == "parquet":
        from quantdyn.results.tables import to_parquet  # pandas/pyarrow only for this output

        to_parquet(st, target, keys=[r["key"] for r in recs] if where else None)
    elif target is not None:
        write_text_atomic(target, _render([{c: r.get(c) for c in every} for r in recs], every, fmt))
    if as_json:
        typer.echo(json.dumps([{c: r.get(c) for c in every} for r in recs], default=str))
        return
    if target is not None:  # the rows are in the file: one line here, not the table
        shape = "every column" if fmt == "parquet" else f"{len(every)} columns"  # parquet: the store's own columns
        typer.echo(f"wrote {len(recs)} rows ({shape}) to {target}"
                   + (f" (rows where {where})" if where else ""))
        from quantdyn.analysis.grid import rows_grid_note

        if (grid := rows_grid_note(recs)) is not None:
            typer.echo(f"note: {grid}")
        return
    from quantdyn.analysis.grid import rows_grid_note

    grid = rows_grid_note(recs)
    recs = [{c: r.get(c) for c in cols} for r in recs]
    if not recs:
        typer.echo("no rows")
        return
    widths = [max(len(c), *(len(fmt_cell(r[c])) for r in recs)) for c in cols]
    typer.echo("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for r in recs:
        typer.echo("  ".join(fmt_cell(r[c]).ljust(w) for c, w in zip(cols, widths)))
    more = "" if all_columns or asked else "; --columns A,B or --all for more columns"
    typer.echo(f"({len(recs)} rows{more})")
    if grid is not None:
        typer.echo(f"note: {grid}")


def fmt_cell(v) -> str:
    """A table cell: floats to 4 significant digits, a list as its length (per-window values: --out or --json)."""
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        return f"[{len(v)} values]"
    if isinstance(v, dict):
        return f"{{{len(v)} fields}}"
    return "" if v is None else str(v)


_FORMATS = {".csv": "csv", ".json": "json", ".jsonl": "jsonl", ".parquet": "parquet"}
_MAIN_COLUMNS = ("run", "branch", "kind", "step", "tokens", "lr", "quantizer", "ce_fp", "ce_q", "delta_ce", "delta_ce_se",
                 "kl", "top1_agree")
_ORDER = ("run", "branch", "tokens", "quantizer")


def _asked_columns(columns: Optional[str]) -> list[str]:
    """The --columns list, each a row field the schema describes (else one line with a did-you-mean)."""
    if not columns:
        return []
    from quantdyn.results.schema import describe

    asked = [c.strip() for c in columns.split(",") if c.strip()]
    for c in asked:
        describe(c)  # QuantdynError: no result-row field 'x'; did you mean ...
    return asked


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
