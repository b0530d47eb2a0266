"""The report leads with the answer: the first section of any report whose rows allow a finding states each
verdict in a sentence (with its figure), the figures follow, the uncertainty and the provenance close the
page; `quantdyn report` prints the summary `quantdyn demo` prints, then the path."""
from __future__ import annotations

import html
import re

import pytest
from test_report_layout import noisy_study_rows

from quantdyn.report.contents import RAINBOW_CAPTION
from quantdyn.report.html import VERDICT_RULE
from quantdyn.results.store import ResultStore
from quantdyn.studies import findings as fd
from quantdyn.studies import section
from quantdyn.studies.findings import NOT_RESOLVED, OPPOSITE, REPRODUCED


def decay_rows(root) -> list[dict]:
    """Two seeds, two cooldowns with their controls, five quantizers (no averages or analyses: a lean store)."""
    return [r for r in noisy_study_rows(root=str(root)) if r["kind"] in ("fp", "ptq") and r["ckpt_kind"] != "lawa"]


def page_parts(page: str) -> tuple[str, list[str]]:
    """(the text of the first <section> after the title, the ids of every section in page order)."""
    after_title = page[page.index("</h1>"):]
    first = re.search(r"<section\b[^>]*>(.*?)</section>", after_title, re.S).group(1)
    return html.unescape(re.sub(r"<[^>]+>", "", first)), re.findall(r"<section id='([^']+)'", page)


@pytest.mark.e2e  # a whole report of a decay study: 5.8 s on an idle 2-core CPU (the fast tier's rule: ~5 s)
def test_report_of_a_store_opens_with_the_verdicts_and_prints_the_demo_summary(tmp_path, cli):
    rows = decay_rows(tmp_path / "runs")
    ResultStore(tmp_path / "st").append(rows)
    res = cli("report", tmp_path / "st", "--out", tmp_path / "rep")
    assert res.returncode == 0, res.stderr
    page_path = tmp_path / "rep" / "index.html"
    answer = section.answer(ResultStore(tmp_path / "st").rows())
    # the same summary as the demo prints (one function), then the path
    assert res.stdout.splitlines() == section.summary_lines(answer) + [f"report: {page_path}"]
    assert len(answer.found) == 10 and {f["verdict"] for f in answer.found} == {REPRODUCED, OPPOSITE, NOT_RESOLVED}
    first, ids = page_parts(page_path.read_text())
    # (a) the first section after the title holds every finding's verdict, in a sentence
    assert "Findings: the papers' claims at this scale" in first
    for f in answer.found:
        statement, verdict, _ = section.verdict_sentence(f)
        assert f"{statement}: {verdict}" in first, statement
        assert f["quantizer"] in statement and f["branch"] in statement and "nats" in statement
        assert "% of the control's Δ CE" in statement and "z = " in statement
    rtn3 = next(f for f in answer.found if f["quantizer"] == "rtn3" and "s100" in f["branch"])
    statement, verdict, tone = section.verdict_sentence(rtn3)
    assert statement.startswith("rtn3: the decayed endpoint cooldown-s100-d50-linear quantizes worse than its "
                                "constant-LR control by +") and verdict.startswith("decay raises the error")
    assert tone == "yes"
    gptq4 = next(f for f in answer.found if f["quantizer"] == "gptq4")
    assert section.verdict_sentence(gptq4)[1].startswith("within uncertainty") and gptq4["verdict"] == NOT_RESOLVED
    assert "<img src='findings.png'" in page_path.read_text().split("<section id='contents'>")[0]
    # then the figures, then the uncertainty notes and the provenance, at the end
    assert ids[0] == "s0" and ids[1] == "contents" and ids[-2:] == ["uncertainty", "provenance"]
    tail = html.unescape(page_path.read_text().split("<section id='uncertainty'>")[1])
    assert VERDICT_RULE in tail and "stable-phase jitter" in VERDICT_RULE and "run-to-run" in VERDICT_RULE
    # the rainbow's caption names every part of the uncertainty, and its short table is shown, not folded
    assert "stable-phase jitter" in RAINBOW_CAPTION and "run-to-run" in RAINBOW_CAPTION
    rainbow = page_path.read_text().split("cooldown branches vs constant-LR controls</h2>")[1].split("</section>")[0]
    shown = rainbow.split("<details>")[0]
    assert "<table class='shown'>" in shown and "decay raises the error" in html.unescape(shown)
    for name in ("findings.csv", "findings.json", "findings.html", "findings.png", "findings.svg"):
        assert (tmp_path / "rep" / name).is_file(), name


def test_a_report_without_a_finding_says_so_first(tmp_path, cli):
    """A store with no comparison a verdict needs: the first section says there is none (nothing invented)."""
    rows = [r for r in decay_rows(tmp_path / "runs") if r["branch"] == "main" and r["run"] == "demo-s0"]
    ResultStore(tmp_path / "st").append(rows)
    res = cli("report", tmp_path / "st", "--out", tmp_path / "rep")
    assert res.returncode == 0, res.stderr
    first, _ = page_parts((tmp_path / "rep" / "index.html").read_text())
    assert section.NO_FINDING[0] in first and "constant-LR control" in first
    assert res.stdout.splitlines()[1].startswith(f"  {section.NO_FINDING[0]}")


def test_families_the_rows_allow():
    rows = noisy_study_rows(seeds=(0,))
    assert section.families_in(rows) == ("decay", "averaging", "sharpness", "predictors")
    assert section.families_in([r for r in rows if r["kind"] in ("fp", "ptq") and r["ckpt_kind"] != "lawa"]) \
        == ("decay",)
    no_controls = [r for r in rows if not r["branch"].startswith("control")]
    assert "decay" not in section.families_in(no_controls) and "sharpness" in section.families_in(no_controls)
    assert section.reference_branch_in(rows) == "cooldown-s150-d50-linear"  # the latest cooldown
    two_lrs = [{**r, "run": "b-s0", "peak_lr": 1e-3} for r in rows] + rows
    assert "peak_lr" in section.families_in(two_lrs)
    hub = [{**r, "run": "EleutherAI/pythia-160m", "ckpt_kind": "hub", "peak_lr": 6e-4} for r in rows
           if r["branch"] == "main"]
    assert "peak_lr" not in section.families_in(rows + hub)  # a public model is measured, not compared
    assert fd.trained_runs(rows + hub) == ["demo-s0"]


def test_sentences_digits_agree_with_the_verdict():
    """A difference just past the threshold reads as resolved, with the digits that show it."""
    f = {"finding": "A(a) LR decay raises the quantization error", "family": "decay", "quantizer": "rtn3",
         "branch": "cooldown-s200-d100-linear", "comparison": "demo: decayed endpoint − constant-LR control",
         "metric": "Δ CE", "effect": 0.00201, "se": 0.001, "z_threshold": 2.0, "n_seeds": 1, "baseline": 0.5,
         "baseline_of": "the control's Δ CE", "verdict": REPRODUCED}
    statement, verdict, tone = section.verdict_sentence(f)
    # the percentage of the control carries the digits of the effect in nats, with its own uncertainty
    assert "+0.00201 ± 0.00100 nats (+0.402 ± 0.200 % of the control's Δ CE), z = +2.01" in statement
    assert verdict == "decay raises the error — reproduced" and tone == "yes"
    g = {**f, "effect": 0.0019, "verdict": NOT_RESOLVED}
    statement, verdict, tone = section.verdict_sentence(g)
    assert "and its constant-LR control differ by" in statement and verdict.startswith("within uncertainty")
    assert tone == "unresolved"
    # an effect far inside its uncertainty: the percentage is no more precise than the nats beside it
    h = {**f, "effect": -0.00003, "se": 0.0036, "baseline": 0.0135, "verdict": NOT_RESOLVED}
    statement, _, _ = section.verdict_sentence(h)
    assert "differ by 0.0000 ± 0.0036 nats (0 ± 27 % of the control's Δ CE), z = 0.0" in statement  # no sign on a zero


@pytest.mark.e2e
def test_the_demo_and_the_report_print_one_summary(tmp_path, kjv_small, cli):
    """A tiny study (two seeds, a cooldown with its control): the summary the study prints is the one
    `quantdyn report` prints over its store."""
    from test_study import _spec

    from quantdyn.studies.pipeline import run_study

    lines: list[str] = []
    run_study(_spec(tmp_path, kjv_small[0]), progress=False, echo=lines.append)
    res = cli("report", tmp_path / "store", "--out", tmp_path / "rep2")
    assert res.returncode == 0, res.stderr
    printed = res.stdout.splitlines()[:-1]
    start = lines.index(printed[0])
    assert lines[start:start + len(printed)] == printed
    assert printed[0].startswith("Answer") and any("A(a) LR decay raises the quantization error" in x for x in printed)
    first, _ = page_parts((tmp_path / "report" / "index.html").read_text())
    assert "Findings: the papers' claims at this scale" in first and "constant-LR control" in first


def test_a_filter_that_leaves_out_the_main_run_keeps_the_decay_finding():
    """Issue 50.9: `sweep --tokens-range 1:` of a cooldown experiment from a checkpoint stores its branches but not
    the branch point (the run's only main checkpoint): the decayed endpoints still pair with their controls; a
    cooldown without its control says which row is missing."""
    rows = [r for r in decay_rows("runs") if r["run"] == "demo-s0"]
    branches_only = [r for r in rows if r["branch"] != "main"]
    pairs = {(t["quantizer"], t["branch"]) for t in fd.decay_table(rows, "demo-s0")}
    assert len(pairs) == 10  # five quantizers x two cooldowns
    a = section.answer(branches_only)
    assert {(f["quantizer"], f["branch"]) for f in a.found} == pairs
    assert {(t["quantizer"], t["branch"]) for t in a.decay} == pairs and not a.notes
    # the control of one cooldown left out: the other still pairs, and the note names the missing branch
    no_ctrl = [r for r in branches_only if r["branch"] != "control-s100-d50"]
    a = section.answer(no_ctrl)
    assert {b for _, b in {(f["quantizer"], f["branch"]) for f in a.found}} == {"cooldown-s150-d50-linear"}
    assert len(a.notes) == 1 and "cooldown-s100-d50-linear has no constant-LR control" in a.notes[0] \
        and "control-s100-d50" in a.notes[0]
    # no control at all: no finding, and the summary says which rows are missing
    only_cool = [r for r in branches_only if not r["branch"].startswith("control")]
    a = section.answer(only_cool)
    lines = section.summary_lines(a)
    assert not a.found and any(section.NO_FINDING[0] in x for x in lines)
    assert sum("has no constant-LR control" in x for x in lines) == 2
