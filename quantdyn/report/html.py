"""The static HTML report: the answer first, then one section per figure, then the uncertainty and the
provenance.

The page reads top to bottom as a person asks: the first section is the caller's answer (``lead``: a study's
findings, each verdict in a sentence with its figure; :mod:`quantdyn.studies.section` builds it from the
rows), then the figures (PNG shown, SVG and the CSV of the numbers behind it linked beside it, a short table
of what the figure concludes shown under it, the full table folded), then how the uncertainty was combined,
then the provenance block.

``write_report(STORE_OR_RUN, OUT)`` reads a results store, or a run directory (its rows in the store given,
default ``results``, and its metrics.jsonl: a run trained with the in-training monitor gets the monitored
Δ CE against steps with its LR, beside the same figure from a sweep's rows when the store has them).
Files in OUT: index.html, every figure as <name>.png (print dpi) + <name>.svg + <name>.csv, rows.json (the
rows the report read) and provenance.json (everything the provenance block lists, unabridged).
"""
from __future__ import annotations

import html
import json
import math
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from quantdyn.errors import QuantdynError
from quantdyn.files import write_json_atomic, write_text_atomic
from quantdyn.report import figures, provenance, public_trajectories, uncertainty
from quantdyn.report.extra import sections
from quantdyn.report.monitored import monitored_points
from quantdyn.report.output import figure_paths, figure_stem, table_columns, write_csv
from quantdyn.report.palette import Palette
from quantdyn.results.stats import Z, format_estimate
from quantdyn.results.store import ResultStore
from quantdyn.runs import RunDir
from quantdyn.train.checkpoint import read_metrics


@dataclass
class Section:
    """One figure of the report with the rows behind it."""

    title: str
    figure: str
    """File name of the PNG in the report directory (the SVG and CSV share its stem); "" for a table alone
    (its CSV is named after the title)."""
    table: list[dict]
    caption: str
    sentences: Sequence[tuple[str, str, str, str]] = ()
    """What the section concludes, each (group, statement, verdict, tone), listed above its figure under a
    heading per group ('' for none); tone is one of TONES (the colour of the verdict). The report's first
    section states each finding's verdict this way, grouped by the papers' claims."""
    shown: list[dict] = field(default_factory=list)
    """A short table shown open under the figure (the full ``table`` is folded and in the CSV)."""
    csv: str = ""
    """File name of the CSV of ``table`` ('' = named after the figure, or after the title without one)."""


TONES = {"yes": "#1a7f37", "no": "#b42318", "unresolved": "#6e6e6e"}
"""Verdict colours: resolved with the paper's sign (green), against it (red), not resolved (grey)."""

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


def lr_curve_of(run_dir: Path | None) -> list[tuple[int, float]]:
    """(tokens, LR) of every logged step of a run (its metrics.jsonl)."""
    if run_dir is None:
        return []
    return [(r["train/tokens"], r["train/lr"]) for r in read_metrics(run_dir)
            if r.get("train/lr") is not None and r.get("train/tokens") is not None]


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


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def _run_dir_of(rows: list[dict], run: str) -> Path | None:
    ck = next((r["checkpoint"] for r in rows if r.get("run") == run and r.get("branch") == "main"
               and r.get("checkpoint")), None)
    if not ck:
        return None
    rd = Path(ck).parent.parent
    return rd if RunDir(rd).metrics.is_file() else None


TRAJECTORY_CAPTION = (
    "Top left: full-precision loss (black). Other panels, per quantizer: Δ CE = CE(quantized) − CE(FP), "
    "the relative error Δ CE / CE(FP) (paper A), Δ PPL, KL(FP ‖ quantized) per token and top-1 agreement with "
    "the FP model. Where one quantizer's values are more than 5× another's, a panel is drawn on a log scale, "
    "or, when it holds values ≤ 0, split into panels of quantizers of similar size, each with its own scale. "
    "Grey: learning rate, on the right-hand axis of every panel; top axis: training step.")


RAINBOW_CAPTION = (
    "Each colour is a cooldown branch started from a stable-phase checkpoint; the dashed line of the same colour "
    "is its control twin at constant LR for the same tokens (a control branched while the main run is itself at "
    "constant LR coincides with it: same weights, data and LR, so it hides behind the black line). The table "
    "under the figure gives each decayed endpoint minus its control, paired over evaluation windows, ± its "
    "combined uncertainty: the evaluation windows, the run-to-run spread of the quantization (when it was "
    "repeated) and the stable-phase jitter of Δ CE (the scatter of one checkpoint about the trend of the run's "
    "constant-LR checkpoints) in quadrature; z = difference / uncertainty, and |z| > 2 resolves a direction.")


def decay_verdicts(table: list[dict], z: float = Z) -> list[dict]:
    """A decay table (results.stats.decay_table) in short, for the page: per quantizer and cooldown branch, the
    decayed endpoint's and its control's Δ CE, their difference ± the combined uncertainty, z and the verdict,
    printed with the digits that make z and the verdict agree (results.stats.format_estimate)."""
    out = []
    for t in table:
        e, s, zt = format_estimate(t["difference"], t["difference_se"], z)
        out.append({"quantizer": t["quantizer"], "cooldown branch": t["branch"],
                    "Δ CE decayed": f"{t['delta_ce_decayed']:.4f}", "Δ CE control": f"{t['delta_ce_control']:.4f}",
                    "difference ± uncertainty": f"{e} ± {s}", "z": zt, "verdict": t["verdict"]})
    return out


def _monitored_section(run: str, run_dir: Path, out: Path, palette: Palette, beside: bool) -> Section | None:
    metrics = read_metrics(run_dir)
    fp, series, lr = monitored_points(metrics)
    if not series:
        return None
    safe = _safe(run)
    f = out / f"monitored_{safe}.png"
    order = sorted(series, key=lambda q: (-(int(m.group(1)) if (m := re.search(r"(\d+)", q)) else 0), q))
    table = figures.metric_panels(fp, {q: series[q] for q in order}, lr, f,
                                  f"{run}: quantization error monitored during training", palette)
    every = sorted({p["step"] for pts in series.values() for p in pts})
    cap = ("From the run's metrics.jsonl: what the in-training monitor measured on the current weights at "
           f"{len(every)} steps, per quantizer, with the validation loss (black) and the LR (grey); the same "
           "figure as a sweep's. The monitor calibrates and evaluates on sets of its own, usually smaller than a "
           "sweep's, so its levels can differ from the sweep's rows; its error bars are the paired SE over its "
           "evaluation windows.")
    if beside:
        cap += " The figure above is the same run from the sweep's result rows."
    return Section(f"Run {run}: quantization error monitored during training", f.name, table, cap)


def _sections(rows: list[dict], out: Path, run_dir: Path | None, palette: Palette) -> list[Section]:
    sections: list[Section] = []
    runs = sorted({r["run"] for r in rows if r.get("kind") in ("fp", "ptq") and r.get("run")})
    monitored_done = set()
    for run in runs:
        rd = run_dir if run_dir is not None else _run_dir_of(rows, run)
        safe = _safe(run)
        f1 = out / f"trajectory_{safe}.png"
        if any(r.get("kind") == "ptq" and r.get("run") == run and (r.get("branch") or "main") == "main" for r in rows):
            t1 = figures.trajectory(rows, run, lr_curve_of(rd), f1, palette)
            sections.append(Section(f"Run {run}: loss and quantization error along training", f1.name, t1,
                                    TRAJECTORY_CAPTION))
            if rd is not None and rd.resolve() not in monitored_done:
                mon = _monitored_section(run, rd, out, palette, beside=True)
                if mon:
                    sections.append(mon)
                    monitored_done.add(rd.resolve())
        f2 = out / f"rainbow_{safe}.png"
        t2 = figures.rainbow(rows, run, f2, palette)
        if t2:
            sections.append(Section(
                f"Run {run}: cooldown branches vs constant-LR controls", f2.name, t2, RAINBOW_CAPTION,
                shown=decay_verdicts(t2)))
    if run_dir is not None and run_dir.resolve() not in monitored_done:
        run = run_dir.name
        mon = _monitored_section(run, run_dir, out, palette, beside=False)
        if mon:
            sections.insert(0, mon)
    for family, members in figures.seed_families(rows).items():
        f5 = out / f"seeds_{_safe(family)}.png"
        t5 = figures.seeds(rows, family, members, f5, palette)
        if t5:
            sections.append(Section(
                f"{family}: spread over {len(members)} seeds", f5.name, t5,
                f"Runs {', '.join(members)} differ only by seed. Mean Δ CE over the seeds at the steps they all "
                "have; error bars are the SD over seeds (with two seeds, |a − b|/√2), which includes each seed's "
                "own quantization noise; faint lines the single seeds. Solid: main run and cooldown branches; "
                "dashed: controls."))
    if any(r.get("kind") == "ptq" for r in rows):
        f3 = out / "loss_vs_dce.png"
        color_key = figures.varied_key(rows) if len(runs) > 1 else "branch"
        t3 = figures.loss_vs_dce(rows, f3, color_key=color_key, palette=palette)
        sections.append(Section("Δ CE against full-precision loss", f3.name, t3,
                                f"One marker per {color_key} (paper A, Figure 6); lower-left is better."
                                + (" Hollow markers: constant-LR controls." if color_key == "branch" else "")))
        f4 = out / "averaging_vs_decay.png"
        t4 = figures.averaging_vs_decay(rows, f4, palette)
        if t4:
            sections.append(Section(
                "Weight averaging against the decayed endpoint", f4.name, t4,
                "Per bit width: Δ CE of each run's decayed endpoint (black) and of its latest averaged checkpoints "
                "(LAWA, EMA, soups; each in its branch's colour). The table also gives FP and quantized CE: a lower "
                "Δ CE at a much higher loss is not a better model."))
    sections += [Section(*s) for s in _extra_sections(rows, out, palette)]
    return sections


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
    ptq = [r for r in rows if r.get("kind") == "ptq" and r.get("delta_ce") is not None]
    if not ptq:
        return ""
    reps = Counter(uncertainty.repeats(r) for r in ptq)
    doms = Counter(r.get("uncertainty_dominant") or uncertainty.parts(r).dominant for r in ptq)
    rs = ", ".join(f"R = {k}: {n} rows" for k, n in sorted(reps.items()))
    if set(reps) == {1}:
        repeats = ("No row repeats its quantization (R = 1): every error bar and z in this report covers the "
                   "evaluation windows (paired SE), and the stable-phase jitter where a decayed endpoint meets its "
                   "control, but not the run-to-run spread of the quantization itself. Re-quantizing a checkpoint "
                   "(another calibration draw, another float order) can move Δ CE by more than that; measure it with "
                   "quant_repeats R > 1 (--repeats R).")
    else:
        repeats = (f"Quantization repeats: {rs}. Error bars and z use the combined SE = √(SE_eval² + SD_run²/R); "
                   f"the run-to-run part dominates in {doms.get(uncertainty.RUN, 0)} of {len(ptq)} PTQ rows, the "
                   f"evaluation windows in {doms.get(uncertainty.EVAL, 0)}.")
    body = "".join(f"<p>{html.escape(p)}</p>" for p in (VERDICT_RULE, repeats))
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


def write_report(store_or_run: str | Path, out_dir: str | Path, store: str | Path | None = None,
                 extra_sections: Sequence[Section | tuple] = (), lead: Lead | None = None) -> Path:
    """Write the report of a store or a run directory into ``out_dir``; returns the path of index.html.

    The page: the caller's first sections (``lead``, called with the rows and ``out_dir``: a study's findings,
    the answer; then ``extra_sections``, as :class:`Section` or (title, figure file name in ``out_dir`` or "",
    table, caption)), the report's own figures, the uncertainty notes and the provenance. The rows are checked
    before anything is written. :func:`quantdyn.studies.section.write_report_with_findings` is this report with
    the findings the rows allow as its lead."""
    st, run_dir, rows = report_rows(store_or_run, store)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    palette = Palette.for_rows(rows)
    first = list(lead(rows, out)) if lead is not None else []
    first += [s if isinstance(s, Section) else Section(*s) for s in extra_sections]
    sections = first + _sections(rows, out, run_dir, palette)
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
    unc_link = " <a href='#uncertainty'>uncertainty</a> ·" if unc else ""
    source = html.escape(str(st.root if st is not None else run_dir))
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>quantdyn report</title>
<style>{CSS}</style></head><body>
<h1>quantdyn report</h1><p class='sub'>{source} · {len(rows)} rows · {n_fig} figures ·
written {html.escape(prov['date'])} ·{unc_link} <a href='#provenance'>provenance</a></p>
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


def _extra_sections(rows: list[dict], out: Path, palette: Palette | None = None):
    """Sections contributed by other studies (predictors, accuracy, optimizers, public trajectories) when their
    rows exist."""

    return sections(rows, out) + public_trajectories.sections(rows, out, palette)
