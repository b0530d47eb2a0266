"""A finding family and a report section are each one registered object: registering one (and nothing else)
puts its findings in the answer, findings.json, the sentences and the printout, its figure with its title
and caption on the page, and a section on every report whose rows hold its row kind — in registration order."""
from __future__ import annotations

import json

import pytest
from test_report_figures import study_rows

from quantdyn.report import sections as report_sections
from quantdyn.report.output import save_figure, subplots
from quantdyn.report.sections import REPORT_SECTIONS, Page, ReportSection, Section
from quantdyn.results.schema import ACCURACY, PTQ
from quantdyn.results.stats import REPRODUCED, Effect
from quantdyn.results.store import ResultStore
from quantdyn.studies import families, section
from quantdyn.studies.families import FINDING_FAMILIES, FamilyFigure, FindingFamily
from quantdyn.studies.findings import finding_row

CAPTION = "Toy caption: one bar per quantizer."


def _draw(found, detail, out) -> bool:
    fig, ax = subplots(figsize=(3, 2))
    ax.bar(range(len(detail)), [d["delta_ce"] for d in detail])
    save_figure(fig, out)
    return True


def _toy_compute(i):
    """One finding per quantizer: its last main Δ CE against 0, resolved (a toy claim)."""
    out, detail = [], []
    for q in sorted({r["quantizer"] for r in PTQ.select(i.rows)}):
        last = max((r for r in PTQ.select(i.rows) if r["quantizer"] == q and r["branch"] == "main"),
                   key=lambda r: r["step"])
        eff = Effect(last["delta_ce"], 1e-4, None, None, None, 1, (last["delta_ce"],))
        out.append(finding_row("T toy claim", "toy", q, "last main checkpoint − 0", "Δ CE", eff, +1, i.spec.z,
                               "findings_toy.png"))
        detail.append({"quantizer": q, "delta_ce": last["delta_ce"]})
    return out, {"toy": detail}


TOY = FindingFamily(
    name="toy", about="a toy claim", needs="ptq rows", in_spec=lambda spec: True,
    in_rows=lambda rows: PTQ.present(rows), compute=_toy_compute,
    figure=FamilyFigure("findings_toy.png", "T: the toy family's figure", CAPTION, draw=_draw),
    sentence=lambda f, amount, z: (f"the toy effect is {amount}", f"toy says {f['verdict']}"))


def _toy_section(page: Page) -> list[Section]:
    n = len(PTQ.select(page.rows))
    return [Section("Toy section: rows counted", "", [{"ptq rows": n}], f"{n} ptq rows.")]


@pytest.fixture
def registered(monkeypatch):
    """The toy family and two toy sections registered for one test (the registries are restored after)."""
    monkeypatch.setitem(FINDING_FAMILIES._entries, "toy", TOY)
    monkeypatch.setitem(REPORT_SECTIONS._entries, "toy", ReportSection("toy", PTQ, _toy_section))
    monkeypatch.setitem(REPORT_SECTIONS._entries, "toy_accuracy",
                        ReportSection("toy_accuracy", ACCURACY, lambda page: [Section("Toy accuracy", "", [], "")]))


def test_a_registered_family_and_section_reach_every_output(tmp_path, registered, monkeypatch):
    names = [s.name for s in REPORT_SECTIONS.values()]
    assert names[-2:] == ["toy", "toy_accuracy"] and names[0] == "monitored"  # after every built-in section
    # the page of the toy sections alone (the built-in ones draw the same as ever: test_report_equivalence)
    monkeypatch.setattr(REPORT_SECTIONS, "_entries", {k: REPORT_SECTIONS.get(k) for k in names[-2:]})
    rows = [r for r in study_rows() if r["branch"] == "main" and r.get("quantizer") in (None, "rtn4", "rtn2")]
    ResultStore(tmp_path / "st").append(rows)
    assert families.families_in(rows) == ("toy",)  # none of the built-in families has its inputs here
    printed: list[str] = []
    page = section.write_report(tmp_path / "st", tmp_path / "rep", echo=printed.append).read_text()
    saved = json.loads((tmp_path / "rep" / "findings.json").read_text())
    toy = [f for f in saved["findings"] if f["family"] == "toy"]
    assert [f["quantizer"] for f in toy] == ["rtn2", "rtn4"] and saved["details"]["toy"]
    assert all(f["verdict"] == REPRODUCED for f in toy)
    # said (the family's own sentence), printed, drawn, captioned, after the answer
    assert "the toy effect is +" in page and "toy says reproduced" in page
    assert any("the toy effect is" in line and "toy says reproduced" in line for line in printed)
    assert (tmp_path / "rep" / "findings_toy.png").is_file() and (tmp_path / "rep" / "findings_toy.csv").is_file()
    assert "T: the toy family&#x27;s figure" in page and CAPTION in page
    assert page.index("T: the toy family") > page.index("<section id='contents'>")
    # the section: asked because the rows hold ptq rows; the one that reads accuracy rows is not
    assert f"{len(PTQ.select(rows))} ptq rows." in page and "Toy accuracy" not in page


def test_registering_a_name_twice_or_asking_an_unknown_one_says_so():
    with pytest.raises(ValueError, match="registered twice"):
        families.register_family(FINDING_FAMILIES.get("decay"))
    with pytest.raises(ValueError, match="registered twice"):
        report_sections.report_section("runs")(lambda page: [])
    from quantdyn.errors import QuantdynError

    with pytest.raises(QuantdynError, match="did you mean 'sharpness'"):
        FINDING_FAMILIES.get("sharpnes")
