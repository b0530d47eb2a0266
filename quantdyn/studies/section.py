"""The answer of a report: what the rows say about the papers' claims, in sentences, a figure and a table.

Every report whose rows allow a finding opens with it — a study's (`quantdyn study`, `quantdyn demo`) and
any store's (`quantdyn report`, ``qd.write_report``) alike — and the same lines are printed beside it:

    answer(rows, ...)            -> Answer: the findings the rows allow (families_in), with the decay tables
    verdict_sentence(finding)    -> (statement, verdict, tone): one finding in words, its effect ± uncertainty in
                                    nats and relative to its reference, z and the verdict
    summary_lines(answer)        -> what `quantdyn demo`, `quantdyn study` and `quantdyn report` print
    lead_sections(answer, out)   -> the report's first section (verdicts, findings.png, the findings table) and
                                    the families' own figures; writes findings.json and findings.html
    write_report(store_or_run, out)  -> the report: its answer first (report/html.py's write_page with this
                                    module's lead); the one report writer (``qd.write_report``, `quantdyn report`,
                                    a study's report)

The verdicts are the one rule of :mod:`quantdyn.results.stats`, computed by :mod:`quantdyn.studies.findings`;
nothing here decides one.
"""
from __future__ import annotations

import html
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

from quantdyn.config import to_dict
from quantdyn.files import write_json_atomic, write_text_atomic
from quantdyn.report.html import write_page
from quantdyn.report.palette import Palette
from quantdyn.report.sections import Page, Section
from quantdyn.report.what_to_ship import decisions, ship_sections
from quantdyn.results.schema import PTQ, number
from quantdyn.results.stats import NOT_RESOLVED, OPPOSITE, REPRODUCED, format_estimate, uncertainty, verdict_of
from quantdyn.runs import is_cooldown, parse_branch
from quantdyn.ship.ship import summary_lines as decision_lines
from quantdyn.studies import findings as fd
from quantdyn.studies.families import FINDING_FAMILIES, FindingInputs, draw_figures, families_in, family_of
from quantdyn.studies.spec import FindingsSpec

COLUMNS = ("finding", "quantizer", "comparison", "metric", "effect ± uncertainty", "relative", "uncertainty parts",
           "beside", "verdict", "figure", "expected", "effect", "se", "se_windows", "se_seeds", "se_run", "se_jitter",
           "baseline", "baseline_of", "interval_lo", "interval_hi", "n_seeds", "z")

TITLE = "Findings: the papers' claims at this scale"
CAPTION = ("Each line above is one comparison the rows allow: its effect ± its combined uncertainty, in nats and "
           "relative to its reference, z = effect / uncertainty, and the verdict — 'reproduced' when |z| > 2 with "
           "the paper's sign, 'opposite' with the other sign, 'not resolved at this scale' otherwise (correlations: "
           "a 95 % bootstrap interval that excludes 0 or not). The figure shows the same: each bar spans ± 2 × the "
           "uncertainty, so a bar that crosses 0 is not resolved. How the uncertainty is combined: Uncertainty, at "
           "the end of the page.")
NO_FINDING = ("No finding", "these rows hold no decayed endpoint with its constant-LR control (cooldown --control), "
              "no peak-LR grid, no weight averages beside a cooldown and no Hessian or outlier analyses, so there is "
              "no claim to give a verdict on; the figures below show what was measured")


# ------------------------------------------------------------------ what the rows allow
def reference_branch_in(rows: Sequence[Mapping]) -> str | None:
    """The cooldown branch whose endpoint is "the decayed endpoint" of the averaging finding when no study spec
    names it: the one started latest (a study's default, StudySpec.averaging.reference_from_step)."""
    cool = {r.get("branch") for r in rows if PTQ.matches(r) and is_cooldown(r.get("branch"))}
    parsed = [(p.from_step, b) for b in cool if (p := parse_branch(b)) is not None]
    return max(parsed)[1] if parsed else None


def compute(rows: list[dict], runs: Sequence[str], families: Sequence[str], spec: FindingsSpec = FindingsSpec(),
            reference_branch: str | None = None, fp_windows: dict[str, list[float]] | None = None
            ) -> tuple[list[dict], dict]:
    """Every finding family in ``families`` (studies/families.py) from ``rows``, with the detail tables."""
    inputs = FindingInputs(rows, runs, spec, reference_branch, fp_windows)
    out: list[dict] = []
    details: dict = {}
    for name in families:
        found, detail = FINDING_FAMILIES.get(name).compute(inputs)
        out += found
        details.update(detail)
    return out, details


@dataclass(frozen=True)
class Answer:
    """What a report's rows say: the findings with their verdicts and the tables behind them."""

    found: list[dict]
    """Finding rows (studies/findings.py), each with effect, uncertainty in parts and verdict."""
    details: dict
    """Detail tables of the families, for their figures."""
    decay: list[dict]
    """results.stats.decay_table of every run: each decayed endpoint against its control, per seed."""
    across: list[dict]
    """findings.seed_summary of ``decay``: the same over runs that differ only by seed."""
    z: float
    """The verdict threshold."""
    repeats: dict[int, int]
    """Quantization repeats R of the PTQ rows read: {R: rows}."""
    notes: tuple[str, ...] = ()
    """Lines about runs left out (a diverged run ...)."""
    spec: dict = field(default_factory=dict)
    """What computed it (a study's spec, or the families and FindingsSpec a store's rows allowed), for
    findings.json."""
    title: str = ""
    """The study's one-line title, if any."""


def answer(rows: list[dict], runs: Sequence[str] | None = None, families: Sequence[str] | None = None,
           spec: FindingsSpec = FindingsSpec(), reference_branch: str | None = None,
           fp_windows: dict[str, list[float]] | None = None, notes: Sequence[str] = (), title: str = "",
           spec_dict: dict | None = None) -> Answer:
    """The findings of ``rows`` (a study passes its runs, families and spec; a store's report lets the rows
    decide: every run trained here (findings.trained_runs), families.families_in, the reference branch
    :func:`reference_branch_in`)."""
    rows = fd.with_fp_se(fd.dedupe(rows))
    if runs is None:
        runs = fd.trained_runs(rows)
    fams = tuple(families) if families is not None else families_in(rows)
    ref = reference_branch if reference_branch is not None else reference_branch_in(rows)
    found, details = compute(rows, runs, fams, spec, ref, fp_windows)
    tables = [t for run in runs for t in fd.decay_table(rows, run, spec.z)]
    notes = [*notes, *fd.unpaired_cooldowns(rows, runs)]  # a decayed endpoint left out says which row is missing
    reps = Counter(uncertainty(r).repeats for r in rows if PTQ.matches(r) and r.get("delta_ce") is not None)
    return Answer(found, details, tables, fd.seed_summary(tables, spec.z), spec.z, dict(sorted(reps.items())),
                  tuple(notes), spec_dict if spec_dict is not None else
                  {"families": list(fams), "findings": to_dict(spec), "reference_branch": ref}, title)


# ------------------------------------------------------------------ in words
def _relative(effect: float, baseline: float | None, se: float | None = None, z: float = fd.Z) -> str:
    """'+2.1 %' of a positive baseline ('' without one): two significant digits, at most one decimal above 1 %;
    with the effect's uncertainty ``se``, '+2.10 ± 0.40 %', printed as results.stats.format_estimate prints the
    effect in nats (the same digits rule, so the percentage never reads more precise than the effect), in plain
    digits: '+120 ± 150 %', never '+1.2e+02 ± 1.5e+02 %'."""
    b = number(baseline)
    if b is None or b <= 0:
        return ""
    pct = 100.0 * effect / b
    s = number(se)
    if s is not None and s > 0:
        et, st, _ = format_estimate(pct, 100.0 * s / b, z)
        if "e" in et + st:  # format_estimate's scientific form (an SE of 100 % or more): whole percent
            et, st = f"{pct:+.0f}", f"{100.0 * s / b:.0f}"
        return f"{et.lstrip('+-') if float(et) == 0 else et} ± {st} %"
    return f"{pct:+.0f} %" if abs(pct) >= 10 else f"{pct:+.1f} %" if abs(pct) >= 1 else f"{pct:+.2f} %"


def relative_text(f: Mapping) -> str:
    """'+2.10 ± 0.40 % of the control's Δ CE' for a finding whose baseline a ratio can be taken to (without an SE:
    '+2.1 % of ...'), '' otherwise: no positive baseline, or one not resolved from 0 (fd.relative_baseline)."""
    e = number(f.get("effect"))
    z = number(f.get("z_threshold")) or fd.Z
    b = fd.relative_baseline(f)
    rel = _relative(e, b, f.get("se"), z) if e is not None and b is not None else ""
    return f"{rel} of {f.get('baseline_of') or 'its reference'}" if rel else ""


def _unit(f: Mapping) -> str:
    return " nats" if f.get("metric") in ("Δ CE", "CE(quantized)") else ""


def verdict_sentence(f: Mapping, with_family: bool = False) -> tuple[str, str, str]:
    """One finding in words: (statement, verdict, tone), e.g. ("rtn3: the decayed endpoint cooldown-s200-d100-linear
    quantizes worse than its constant-LR control by +0.012 ± 0.004 nats (+2.1 ± 0.7 % of the control's Δ CE), z = +3.0",
    "decay raises the error (reproduced)", "yes"). The numbers carry the digits that make z agree with the verdict
    (results.stats.format_estimate). ``with_family``: name the runs the effect is averaged over (several families
    of seeds on one page)."""
    tone = verdict_of(f["verdict"]).tone
    q = f.get("quantizer") or ""
    head = (f"{f.get('seed_family')} · " if with_family and f.get("seed_family") else "") + (f"{q}: " if q else "")
    e = number(f.get("effect"))
    if e is None:
        return f"{head}{f['comparison']}", f["verdict"], tone
    if f.get("interval_lo") is not None or f.get("se") is None:
        return f"{head}{f['comparison']}: {f['metric']} {fd.format_effect(f)}", f["verdict"], tone
    z = number(f.get("z_threshold")) or fd.Z
    et, st, zt = format_estimate(e, f["se"], z)
    seeds = f"mean over {f['n_seeds']} seeds" if (f.get("n_seeds") or 1) > 1 else ""
    rel = relative_text(f)
    paren = "; ".join(x for x in (rel, seeds) if x)
    amount = f"{et} ± {st}{_unit(f)}" + (f" ({paren})" if paren else "")
    fam = family_of(f)
    own = fam.sentence(f, amount, z) if fam is not None and fam.sentence is not None else None
    what, verdict = own if own is not None else (f"{f['comparison']}: {f['metric']} {amount}", f["verdict"])
    return f"{head}{what}, z = {zt}", verdict, tone


def claim_heading(claim: str, found: Sequence[Mapping]) -> str:
    """A paper's claim with the count of each verdict over its comparisons, e.g. "A(a) LR decay raises the
    quantization error — 10 comparisons: 6 reproduced, 1 opposite, 3 not resolved at this scale"."""
    verdicts = Counter(f["verdict"] for f in found if f["finding"] == claim)
    n = sum(verdicts.values())
    counts = ", ".join(f"{verdicts[v]} {v}" for v in (REPRODUCED, OPPOSITE, NOT_RESOLVED) if verdicts[v])
    return f"{claim} — {n} comparison{'s' if n != 1 else ''}: {counts}"


def sentences(a: Answer) -> list[tuple[str, str, str, str]]:
    """Every finding of ``a`` in words, in the findings' order: (the paper's claim with its verdict counts,
    statement, verdict, tone) (:func:`claim_heading`, :func:`verdict_sentence`)."""
    fams = {f.get("seed_family") for f in a.found if f.get("seed_family")}
    return [(claim_heading(f["finding"], a.found), *verdict_sentence(f, with_family=len(fams) > 1))
            for f in a.found]


def _repeats_text(a: Answer) -> str:
    return "R = " + "/".join(map(str, a.repeats)) if a.repeats else "no PTQ rows"


TABLES_LINE = ("  (each comparison's uncertainty in its parts, and every run and seed apart: the report's findings "
               "table, findings.html and findings.csv)")


def summary_lines(a: Answer) -> list[str]:
    """What `quantdyn demo`, `quantdyn study` and `quantdyn report` print: each finding's verdict once, in a
    sentence (its effect ± uncertainty in nats and relative to its reference, z), then where the tables are (the
    decayed-minus-control table per run and seed and the findings table with the uncertainty's parts are the
    report's: printing them too said every verdict three times)."""
    lines = [f"Answer (z = effect / combined uncertainty, resolved when |z| > {a.z:g}; quantization repeats "
             f"{_repeats_text(a)}):"]
    claim = None
    for c, statement, verdict, _ in sentences(a):
        if c != claim:
            claim = c
            lines.append(f"  {c}:")
        lines.append(f"    {statement}: {verdict}")
    if not a.found:
        lines.append(f"  {NO_FINDING[0]}: {NO_FINDING[1]}.")
    else:
        lines.append(TABLES_LINE)
    lines += [f"  note: {n}" for n in a.notes]
    return lines


# ------------------------------------------------------------------ on the page
def beside_text(f: Mapping) -> str:
    """What a comparison of trained weights carries beside its effect (the league, the warmdown grid): the same
    pair's FP CE difference, the quantization error's own (Δ CE) difference where the family gives it, and what one
    step of the intervention costs beside the baseline's ('' for others)."""
    parts = []
    if f.get("d_ce_fp") is not None:
        se = f.get("d_ce_fp_se")
        parts.append(f"FP {f['d_ce_fp']:+.4f}" + (f" ± {se:.4f}" if se is not None else "") + " nats")
    if f.get("d_delta_ce") is not None:  # what is left is the quantization error's own difference
        se = f.get("d_delta_ce_se")
        parts.append(f"Δ CE {f['d_delta_ce']:+.5f}" + (f" ± {se:.5f}" if se is not None else ""))
    fb, fq = f.get("forward_backward_per_step"), f.get("fake_quant")
    if fb is not None:
        cost = f"{fb} forward/backward per step"
        if fq:
            cost += f", {fq} fake-quantized {f.get('fake_quant_per_step') or 1}x per step"
        parts.append("cost " + cost)
    return "; ".join(parts)


def table_rows(found: Sequence[dict]) -> list[dict]:
    """The findings as flat rows (for CSV and the report's table): the readable columns first, then the numbers."""
    def cell(f, c):
        if c == "effect ± uncertainty":
            return fd.format_effect(f)
        if c == "uncertainty parts":
            return fd.format_parts(f)
        if c == "relative":
            return relative_text(f) or None
        if c == "beside":
            return beside_text(f) or None
        return f.get(c)

    return [{c: cell(f, c) for c in COLUMNS} for f in found]


def _lead(a: Answer, drawn: Mapping[str, bool]) -> Section:
    title = TITLE + (f" — {a.title}" if a.title else "")
    if not a.found:
        return Section(title, "", [], "", sentences=[("", NO_FINDING[1][0].upper() + NO_FINDING[1][1:]
                                                      + "".join(f". Note: {n}" for n in a.notes),
                                                      NO_FINDING[0], "unresolved")])
    caption = CAPTION + f" Quantization repeats {_repeats_text(a)}." + "".join(f" Note: {n}." for n in a.notes)
    return Section(title, "findings.png" if drawn.get("findings.png") else "", table_rows(a.found), caption,
                   sentences=sentences(a), csv="findings.csv")


def _findings_page(lead: Section, drawn: Mapping[str, bool]) -> str:
    """findings.html: the answer alone (the verdicts, every figure of the findings, the table)."""
    items = "".join(f"<li>{html.escape(c)} — {html.escape(s)}: <b>{html.escape(v)}</b></li>"
                    for c, s, v, _ in lead.sentences)
    head = ("finding", "quantizer", "comparison", "metric", "effect ± uncertainty", "relative", "uncertainty parts",
            "beside", "verdict", "figure")
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(r.get(h) if r.get(h) is not None else '–'))}</td>"
                                    for h in head) + "</tr>" for r in lead.table)
    imgs = "".join(f"<img src='{html.escape(name)}' style='max-width:100%'>" for name, ok in drawn.items() if ok)
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>quantdyn findings</title><style>"
            "body{font-family:sans-serif;max-width:1200px;margin:2em auto;color:#222}table{border-collapse:collapse;"
            "font-size:12px}td,th{border:1px solid #ccc;padding:2px 6px;text-align:left}</style></head><body>"
            f"<h2 id='findings'>{html.escape(lead.title)}</h2><ul>{items}</ul>{imgs}<p>{html.escape(lead.caption)}</p>"
            + (f"<table><thead><tr>{''.join(f'<th>{h}</th>' for h in head)}</tr></thead><tbody>{body}</tbody></table>"
               if lead.table else "")
            + "<p>Numbers: <a href='findings.json'>findings.json</a>, <a href='findings.csv'>findings.csv</a>.</p>"
            "</body></html>")


def lead_sections(a: Answer, out: str | Path) -> list[Section]:
    """The report's first sections: the answer (each finding's verdict in a sentence, findings.png, the findings
    table as findings.csv), then the families' own figures. Draws the figures and writes findings.json and
    findings.html into ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    drawn = draw_figures(out, a.found, a.details) if a.found else {}
    lead = _lead(a, drawn)
    write_json_atomic(out / "findings.json", {"spec": a.spec, "findings": a.found, "notes": list(a.notes),
                                              "details": a.details})
    write_text_atomic(out / "findings.html", _findings_page(lead, drawn))
    more = [Section(fam.figure.title, fam.figure.file, list(a.details.get(fam.name) or []), fam.figure.caption)
            for fam in FINDING_FAMILIES.values() if fam.figure is not None and drawn.get(fam.figure.file)]
    return [lead, *more]


def write_report(store_or_run: str | Path, out_dir: str | Path, store: str | Path | None = None,
                 extra_sections: Sequence = (), answer_of: Answer | None = None,
                 echo: Callable[[str], None] | None = None) -> Path:
    """The report of a store or a run directory (report/html.py's write_page) opening with its answer: the
    findings ``answer_of`` holds (a study's), else those the report's rows allow (:func:`answer`). ``echo``:
    where the summary lines go (:func:`ship_lines` of each decision first, as the page opens with them, then
    :func:`summary_lines`; `quantdyn report` prints them). Returns index.html."""
    got: list[Answer] = []
    shipped_json: list[dict] = []

    def lead(rows: list[dict], out: Path) -> list[Section]:
        got.append(answer_of if answer_of is not None else answer(rows))
        shipped_json.extend(decisions(rows))
        shipped = ship_sections(Page(rows, out, Palette.for_rows(rows)))  # the decision, when `quantdyn ship` made one
        return shipped + lead_sections(got[0], out)

    page = write_page(store_or_run, out_dir, store=store, extra_sections=extra_sections, lead=lead)
    if echo is not None:
        for line in ship_lines(shipped_json) + summary_lines(got[0]):
            echo(line)
    return page


def ship_lines(shipped: Sequence[dict]) -> list[str]:
    """What `quantdyn ship` decided (each decision's ship.json), as ship prints it, a blank line after each: the
    summary of a study or a report that holds decisions leads with them."""
    return [line for s in shipped for line in [*decision_lines(s), ""]]


def markdown_table(found: Sequence[dict]) -> str:
    """The findings as a Markdown table (finding, quantizer, comparison, metric, effect ± uncertainty, parts,
    beside: FP and cost where the family gives them, verdict, figure), for docs written from a study's findings.json."""
    head = ("finding", "quantizer", "comparison", "metric", "effect ± uncertainty", "uncertainty parts", "beside",
            "verdict", "figure")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table_rows(found):
        cells = [str(r.get(h) if r.get(h) is not None else "–").replace("|", "\\|") for h in head]
        cells[7] = f"**{cells[7]}**" if cells[7] != NOT_RESOLVED else cells[7]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)

