"""The static HTML page of a report: the answer first, then one section per figure, then the uncertainty and
the provenance.

The page reads top to bottom as a person asks: the first section is the caller's answer (``lead``: a study's
findings, each verdict in a sentence with its figure; :mod:`quantdyn.studies.section` builds it from the
rows), then the registered sections (report/sections.py REPORT_SECTIONS, report/contents.py: PNG shown, SVG
and the CSV of the numbers behind it linked beside it, a short table of what the figure concludes shown under
it, the full table folded), then how the uncertainty was combined, then the provenance block.

``write_page(STORE_OR_RUN, OUT, lead=...)`` reads a results store, or a run directory (its rows in the store
given, default ``results``, and its metrics.jsonl: a run trained with the in-training monitor gets the
monitored Δ CE against steps with its LR, beside the same figure from a sweep's rows when the store has
them). Files in OUT: index.html, every figure as <name>.png (print dpi) + <name>.svg + <name>.csv, rows.json
(the rows the report read) and provenance.json (everything the provenance block lists, unabridged). The
report, with its answer as the lead, is :func:`quantdyn.studies.section.write_report` (``qd.write_report``,
`quantdyn report`).
"""
from __future__ import annotations

import html
import json
import math
import re
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

from quantdyn.analysis.grid import rows_grid_note
from quantdyn.errors import QuantdynError
from quantdyn.files import write_json_atomic, write_text_atomic
from quantdyn.report import contents  # noqa: F401  (registers the report's own sections, in page order)
from quantdyn.report import provenance, uncertainty
from quantdyn.report.monitored import monitored_points
from quantdyn.report.output import figure_paths, figure_stem, table_columns, write_csv
from quantdyn.report.palette import Palette
from quantdyn.report.sections import Page, Section, page_sections
from quantdyn.results.schema import PTQ
from quantdyn.results.stats import EVAL, RUN, TONES, repeats
from quantdyn.results.stats import uncertainty as row_uncertainty
from quantdyn.results.store import ResultStore
from quantdyn.runs import RunDir
from quantdyn.train.checkpoint import read_metrics


Lead = Callable[[list[dict], Path], Sequence[Section]]
"""The caller's first sections: called with the rows the report read and its directory (after the checks,
once the directory exists), returns the sections that open the page."""


def _fmt(v) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        if math.isnan(v):
            return "–"
        return f"{v:.4g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.3e}"
    return html.escape(str(v))


def _table(rows: list[dict], limit: int = 400) -> str:
    if not rows:
        return "<p><em>no rows</em></p>"
    cols = table_columns(rows)
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{_fmt(r.get(c))}</td>" for c in cols) + "</tr>" for r in rows[:limit])
    more = f"<p><em>first {limit} of {len(rows)} rows; all in the CSV</em></p>" if len(rows) > limit else ""
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>{more}"


def resolve_input(store_or_run: str | Path, store: str | Path | None) -> tuple[ResultStore | None, Path | None]:
    """(store, run directory) of the report's argument: a run directory (a config.yaml in it) reads its rows
    from ``store`` (default ``results``), or none when that store does not exist and the run was monitored;
    any other directory is a store."""
    p = Path(store_or_run)
    if RunDir(p).is_run:
        st = Path(store or "results")
        if not st.is_dir() and monitored_points(read_metrics(p))[1]:
            return None, p
        return ResultStore(st, create=False), p
    if p.is_dir():
        return ResultStore(p, create=False), None
    raise QuantdynError(f"'{p}' is neither a results store nor a run directory; pass one (default store: results)")


VERDICT_RULE = (
    "How a verdict is reached (one rule for every number on this page, quantdyn.results.stats): z = effect / its "
    "combined uncertainty, and the effect is resolved when |z| > 2. Within one run the uncertainty is "
    "√(windows² + run-to-run² + jitter²): the SE of the difference paired over the evaluation windows, the "
    "run-to-run SD of the quantization when it was repeated (R > 1; not measured with R = 1), and, where a "
    "decayed endpoint is compared with its control along a trajectory, the stable-phase jitter of Δ CE (the SD of "
    "the run's constant-LR checkpoints about a line through them). Over k seeds each part is combined as "
    "√(Σ part²) / k, and the uncertainty is the larger of that and the seeds' own SE (SD over seeds / √k). "
    "Correlations carry a 95 % bootstrap interval instead: resolved when it excludes 0. An unresolved effect is "
    "reported as such, never as a direction.")


def _uncertainty_summary(rows: list[dict]) -> str:
    """The page's closing notes on uncertainty: the verdict rule and whether the quantization was repeated."""
    ptq = [r for r in rows if PTQ.matches(r) and r.get("delta_ce") is not None]
    if not ptq:
        return ""
    reps = Counter(repeats(r) for r in ptq)
    doms = Counter(r.get("uncertainty_dominant") or row_uncertainty(r).dominant for r in ptq)
    rs = ", ".join(f"R = {k}: {n} rows" for k, n in sorted(reps.items()))
    if set(reps) == {1}:
        said = ("No row repeats its quantization (R = 1): every error bar and z in this report covers the "
                "evaluation windows (paired SE), and the stable-phase jitter where a decayed endpoint meets its "
                "control, but not the run-to-run spread of the quantization itself. Re-quantizing a checkpoint "
                "(another calibration draw, another float order) can move Δ CE by more than that; measure it with "
                "quant_repeats R > 1 (--repeats R).")
    else:
        said = (f"Quantization repeats: {rs}. Error bars and z use the combined SE = √(SE_eval² + SD_run²/R); "
                f"the run-to-run part dominates in {doms.get(RUN, 0)} of {len(ptq)} PTQ rows, the "
                f"evaluation windows in {doms.get(EVAL, 0)}.")
    body = "".join(f"<p>{html.escape(p)}</p>" for p in (VERDICT_RULE, said))
    return f"<section id='uncertainty'><h2>Uncertainty</h2>{body}</section>"


CSS = """body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222;line-height:1.35}
table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}
table.prov th,table.prov td{text-align:left;vertical-align:top}table.prov td{font-size:12px}
h2{margin-top:1.6em;border-bottom:1px solid #ddd}.small,.dl,.unc,.sub{font-size:13px;color:#444}.n{color:#777}
figure{margin:0.6em 0}figure img{max-width:100%;border:1px solid #eee}code{font-size:12px}
ul.verdicts{list-style:none;padding-left:0;font-size:15px}ul.verdicts li{margin:0.35em 0;padding-left:1.2em;
text-indent:-1.2em}ul.verdicts .dot{display:inline-block;width:1.2em;text-indent:0}
section.answer{border:1px solid #ddd;border-radius:6px;padding:0 1em 0.6em;background:#fcfcfc}
section.answer h2{margin-top:0.6em}section.answer h3{margin:0.8em 0 0.2em;font-size:15px;color:#333}
table.shown td:first-child,table.shown td:nth-child(2){text-align:left}
@media print{section{break-inside:avoid}details{display:none}}"""


def _slug(title: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", title).strip("_").lower()[:48] or "table"


def _sentences_html(sentences: Sequence[tuple[str, str, str, str]]) -> str:
    out, group, items = [], None, []

    def flush():
        if items:
            out.append(f"<ul class='verdicts'>{''.join(items)}</ul>")
            items.clear()

    for g, statement, verdict, tone in sentences:
        if g != group:
            flush()
            group = g
            if g:
                out.append(f"<h3>{html.escape(g)}</h3>")
        colour = TONES.get(tone, TONES["unresolved"])
        items.append(f"<li><span class='dot' style='color:{colour}'>●</span>{html.escape(statement)}: "
                     f"<b style='color:{colour}'>{html.escape(verdict)}</b></li>")
    flush()
    return "".join(out)


def _section_html(k: int, s: Section, out: Path, used: set[str], css_class: str = "") -> str:
    """A section's HTML; writes the CSV of its table beside its figure (named ``s.csv``, else after the figure,
    or after the title for a section without one or whose figure another section already named its CSV after)."""
    links = []
    png = None
    if s.figure:
        stem = figure_stem(s.figure)
        png, svg = (p.name for p in figure_paths(stem))
        csv_name = f"{stem.name}.csv"
        links.append(f"<a href='{html.escape(png)}'>PNG</a>")
        if (out / svg).is_file():
            links.append(f"<a href='{html.escape(svg)}'>SVG</a>")
    else:
        csv_name = f"{_slug(s.title)}.csv"
    csv_name = s.csv or csv_name
    if csv_name in used:
        base = _slug(s.title)
        csv_name = next(n for n in (f"{base}.csv", *(f"{base}_{i}.csv" for i in range(2, 1000))) if n not in used)
    if s.table:
        used.add(csv_name)
        write_csv(s.table, out / csv_name)
        links.append(f"<a href='{html.escape(csv_name)}' download>CSV</a> ({len(s.table)} rows, "
                     f"{len(table_columns(s.table))} columns)")
    note = uncertainty.note(s.table)
    cls = f" class='{css_class}'" if css_class else ""
    return (f"<section id='s{k}'{cls}><h2>{html.escape(s.title)}</h2>" + _sentences_html(s.sentences)
            + (f"<figure><img src='{html.escape(png)}' alt='{html.escape(s.title)}'></figure>" if png else "")
            + (f"<p>{html.escape(s.caption)}</p>" if s.caption else "")
            + (_table(s.shown).replace("<table>", "<table class='shown'>", 1) if s.shown else "")
            + (f"<p class='unc'>{html.escape(note)}</p>" if note else "")
            + (f"<p class='dl'>Download: {' · '.join(links)}</p>" if links else "")
            + (f"<details><summary>all numbers ({len(s.table)} rows)</summary>{_table(s.table)}</details>"
               if s.table else "") + "</section>")


def report_rows(store_or_run: str | Path, store: str | Path | None = None
                ) -> tuple[ResultStore | None, Path | None, list[dict]]:
    """(store, run directory, rows) of a report of ``store_or_run`` (see :func:`resolve_input`): a run
    directory's rows are those of its checkpoints. Raises the user's error when there is nothing to report
    (no rows, and no monitored Δ CE in a run's metrics.jsonl), before anything is written."""
    st, run_dir = resolve_input(store_or_run, store)
    rows = st.rows() if st is not None else []
    if run_dir is not None:
        prefix = str(run_dir.resolve())
        rows = [r for r in rows if str(Path(r.get("checkpoint", "")).resolve()).startswith(prefix)]
    monitored = run_dir is not None and bool(monitored_points(read_metrics(run_dir))[1])
    if not rows and not monitored:
        where = f"'{st.root}'" if st is not None else "no store"
        hint = (" and its metrics.jsonl has no monitored Δ CE (train with monitor: {every: N, quantizers: [...]})"
                if run_dir is not None else "")
        raise QuantdynError(f"no result rows found in {where}{' for ' + str(run_dir) if run_dir else ''}{hint}; "
                            "run a sweep first")
    return st, run_dir, rows


def write_page(store_or_run: str | Path, out_dir: str | Path, store: str | Path | None = None,
               extra_sections: Sequence[Section | tuple] = (), lead: Lead | None = None) -> Path:
    """Write the report of a store or a run directory into ``out_dir``; returns the path of index.html.

    The page: the caller's first sections (``lead``, called with the rows and ``out_dir``: a study's findings,
    the answer; then ``extra_sections``, as :class:`Section` or (title, figure file name in ``out_dir`` or "",
    table, caption)), the registered sections (REPORT_SECTIONS), the uncertainty notes and the provenance. The
    rows are checked before anything is written. :func:`quantdyn.studies.section.write_report` is this page with
    the findings the rows allow as its lead."""
    st, run_dir, rows = report_rows(store_or_run, store)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    palette = Palette.for_rows(rows)
    first = list(lead(rows, out)) if lead is not None else []
    first += [s if isinstance(s, Section) else Section(*s) for s in extra_sections]
    sections = first + page_sections(Page(rows, out, palette, run_dir))
    prov = provenance.collect(rows, st.root if st is not None else None, run_dir)
    used: set[str] = set()
    # the report's own sections name their CSVs first; a caller's section that shows one of their figures
    # gets a CSV named after its title (unless it names its own)
    named = [k for k in range(len(first)) if sections[k].csv]
    order = named + list(range(len(first), len(sections))) + [k for k in range(len(first)) if k not in named]
    html_of = {k: _section_html(k, sections[k], out, used, "answer" if k == 0 and sections[k].sentences else "")
               for k in order}
    lead_n = 1 if first and first[0].sentences else 0  # the answer opens the page; the contents follow it
    toc = "".join(f"<li><a href='#s{k}'>{html.escape(s.title)}</a></li>" for k, s in enumerate(sections)
                  if k >= lead_n)
    n_fig = sum(1 for s in sections if s.figure)
    unc = _uncertainty_summary(rows)
    grid_said = rows_grid_note(rows)  # weights dequantized from a low-bit format: every error is relative to it
    grid = f"\n<p class='unc'><b>Note:</b> {html.escape(grid_said[0].upper() + grid_said[1:])}.</p>" if grid_said else ""
    unc_link = " <a href='#uncertainty'>uncertainty</a> ·" if unc else ""
    source = html.escape(str(st.root if st is not None else run_dir))
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>quantdyn report</title>
<style>{CSS}</style></head><body>
<h1>quantdyn report</h1><p class='sub'>{source} · {len(rows)} rows · {n_fig} figures ·
written {html.escape(prov['date'])} ·{unc_link} <a href='#provenance'>provenance</a></p>{grid}
{"".join(html_of[k] for k in range(lead_n))}
<section id='contents'><h2>Figures</h2><ol>{toc}</ol></section>
{"".join(html_of[k] for k in range(lead_n, len(sections)))}
{unc}
{provenance.to_html(prov)}
</body></html>"""
    write_json_atomic(out / "provenance.json", prov)
    write_text_atomic(out / "rows.json", json.dumps([{k: v for k, v in r.items() if k not in ("window_delta", "window_kl")}
                                                     for r in rows], default=str))
    write_text_atomic(out / "index.html", page)
    return out / "index.html"
