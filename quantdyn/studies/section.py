"""The findings table as a report section: REPORT/findings.html, findings.json, findings.csv and figures.

``findings_section`` returns the section in the form the report's own sections take
((title, png, table, caption), as report/extra.py's ``sections``): the study passes it to
``report.html.write_report(..., extra_sections=[...])``.  ``write_findings`` writes the files beside it.
"""
from __future__ import annotations

import csv
import html
import io
from pathlib import Path
from typing import Sequence

from quantdyn.config import to_dict
from quantdyn.files import write_json_atomic, write_text_atomic
from quantdyn.studies import figures
from quantdyn.studies.findings import OPPOSITE, REPRODUCED, format_effect, format_parts
from quantdyn.studies.spec import StudySpec

COLUMNS = ("finding", "quantizer", "comparison", "metric", "effect ± uncertainty", "uncertainty parts", "verdict",
           "figure", "expected", "effect", "se", "se_windows", "se_seeds", "se_run", "se_jitter", "interval_lo",
           "interval_hi", "n_seeds", "z")

CAPTION = ("Each of the papers' findings measured in this study. Effect ± uncertainty (z): the uncertainty is the "
           "larger of the within-seed SE (paired over evaluation windows, plus the run-to-run SD of the "
           "quantization when it was repeated R > 1 times, plus the stable-phase jitter of Δ CE where a decayed "
           "endpoint is compared with its control, all in quadrature) and the between-seed SE (SD over seeds / √k); "
           "correlations carry a 95 % percentile-bootstrap interval. Verdict: an effect inside its uncertainty "
           "(|effect| ≤ z·SE, or an interval containing 0) is 'not resolved at this scale', never a direction; "
           "beyond it, 'reproduced' when its sign is the paper's, 'opposite' otherwise. Computed from the rows.")


def draw_figures(out: Path, found: list[dict], details: dict) -> dict[str, bool]:
    """The families' figures; returns which were drawn."""
    drawn = {"findings.png": figures.overview(found, out / "findings.png")}
    if details.get("peak_lr"):
        drawn["findings_peak_lr.png"] = figures.peak_lr(details["peak_lr"], out / "findings_peak_lr.png")
    if details.get("averaging"):
        drawn["findings_averaging.png"] = figures.averaging(details["averaging"], out / "findings_averaging.png")
    if details.get("sharpness"):
        drawn["findings_sharpness.png"] = figures.sharpness(details["sharpness"], out / "findings_sharpness.png")
    if any(f.get("family") == "predictors" for f in found):
        drawn["findings_predictors.png"] = figures.predictors(found, out / "findings_predictors.png")
    return drawn


def table_rows(found: Sequence[dict]) -> list[dict]:
    """The findings as flat rows (for CSV and the report's table): the readable columns first, then the numbers."""
    return [{c: (format_effect(f) if c == "effect ± uncertainty" else format_parts(f) if c == "uncertainty parts"
                 else f.get(c)) for c in COLUMNS} for f in found]


def findings_section(found: Sequence[dict], spec: StudySpec) -> tuple[str, str, list[dict], str]:
    """(title, figure, table, caption) — the form of report/extra.py's sections."""
    fig = "findings.png" if found else ""
    title = "Findings: the papers' claims at this scale" + (f" — {spec.title}" if spec.title else "")
    return title, fig, table_rows(found), CAPTION + f" Quantization repeats R = {spec.sweep.quant_repeats}."


def _csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(COLUMNS))
    w.writeheader()
    for r in rows:
        w.writerow({k: ("" if v is None else v) for k, v in r.items()})
    return buf.getvalue()


def _html(found: Sequence[dict], notes: Sequence[str], spec: StudySpec, drawn: dict[str, bool]) -> str:
    title, _, _, caption = findings_section(found, spec)
    colour = {REPRODUCED: "#1a7f37", OPPOSITE: "#b42318"}
    body = []
    for f in found:
        v = f["verdict"]
        fig = f.get("figure") or ""
        body.append(
            "<tr>" + "".join(f"<td style='text-align:left'>{html.escape(str(x))}</td>" for x in
                             (f["finding"], f.get("quantizer") or "–", f["comparison"], f["metric"]))
            + f"<td>{html.escape(format_effect(f))}</td><td style='text-align:left'>{html.escape(format_parts(f))}</td>"
            + f"<td style='color:{colour.get(v, '#555')};font-weight:bold'>{html.escape(v)}</td>"
            + f"<td><a href='{html.escape(fig)}'>{html.escape(fig)}</a></td></tr>")
    head = "".join(f"<th>{h}</th>" for h in ("finding", "quantizer", "comparison", "metric", "effect",
                                                "uncertainty (parts)", "verdict", "figure"))
    imgs = "".join(f"<img src='{html.escape(name)}' style='max-width:100%'>" for name, ok in drawn.items() if ok)
    note = "".join(f"<li>{html.escape(n)}</li>" for n in notes)
    return (f"<h2 id='findings'>{html.escape(title)}</h2><p>{html.escape(caption)}</p>"
            f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
            + (f"<ul>{note}</ul>" if note else "") + imgs
            + "<p>Numbers: <a href='findings.json'>findings.json</a>, <a href='findings.csv'>findings.csv</a>.</p>")


def write_findings(report_dir: str | Path, spec: StudySpec, found: list[dict], details: dict,
                   notes: Sequence[str] = ()) -> Path:
    """Write the figures, findings.json/.csv and findings.html under ``report_dir``; returns findings.html."""
    out = Path(report_dir)
    out.mkdir(parents=True, exist_ok=True)
    drawn = draw_figures(out, found, details)
    write_json_atomic(out / "findings.json", {"spec": to_dict(spec), "findings": found, "notes": list(notes),
                                              "details": details})
    write_text_atomic(out / "findings.csv", _csv(table_rows(found)))
    block = _html(found, notes, spec, drawn)
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>quantdyn findings</title><style>"
            "body{font-family:sans-serif;max-width:1200px;margin:2em auto;color:#222}table{border-collapse:collapse;"
            "font-size:12px}td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}</style></head><body>"
            f"{block}</body></html>")
    write_text_atomic(out / "findings.html", page)
    return out / "findings.html"


def markdown_table(found: Sequence[dict]) -> str:
    """The findings as a Markdown table (finding, quantizer, comparison, metric, effect ± uncertainty, parts,
    verdict, figure), for docs written from a study's findings.json."""
    head = ("finding", "quantizer", "comparison", "metric", "effect ± uncertainty", "uncertainty parts", "verdict",
            "figure")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table_rows(found):
        cells = [str(r.get(h) if r.get(h) is not None else "–").replace("|", "\\|") for h in head]
        cells[6] = f"**{cells[6]}**" if cells[6] != "not resolved at this scale" else cells[6]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
