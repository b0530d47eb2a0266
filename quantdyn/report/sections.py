"""What a section of the report is, and the registry of the report's own sections.

A :class:`Section` is one block of the page: a title, a figure, the table behind it, a caption (and, for the
answer, its verdicts in sentences). A :class:`ReportSection` is one registered kind of section: its name, the
row kind it reads (it is asked only when the rows hold that kind), and its builder, which draws its figures
into the report directory and returns its Sections (none when the rows do not allow them). The page asks every
registered section in the order they were registered (report/contents.py registers the report's own, in page
order), so adding a section to every report is one decorated builder::

    @report_section("sensitivity", kind=SENSITIVITY)     # a RowKind of results/schema.py
    def sensitivity(page: Page) -> list[Section]:
        table = draw_sensitivity_map(page.rows, page.out / "sensitivity.png")
        return [Section("Per-tensor sensitivity", "sensitivity.png", table, "...")] if table else []

or, for a section of one figure, one call::

    figure_section("sensitivity", "sensitivity.png", "Per-tensor sensitivity", "...", kind=SENSITIVITY,
                   draw=lambda page, png: draw_sensitivity_map(page.rows, png))
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from quantdyn.registry import Registry
from quantdyn.report.palette import Palette
from quantdyn.results.schema import RowKind


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
    heading per group ('' for none); tone is a Verdict's tone (results.stats VERDICTS: its colour). The
    report's first section states each finding's verdict this way, grouped by the papers' claims."""
    shown: list[dict] = field(default_factory=list)
    """A short table shown open under the figure (the full ``table`` is folded and in the CSV)."""
    csv: str = ""
    """File name of the CSV of ``table`` ('' = named after the figure, or after the title without one)."""


@dataclass(frozen=True)
class Page:
    """What a section's builder reads."""

    rows: list[dict]
    """Every row the report read."""
    out: Path
    """The report directory (figures are drawn into it)."""
    palette: Palette
    """The report's colours (one per quantizer and branch, the same in every figure)."""
    run_dir: Path | None = None
    """The run directory when the report is of one (its metrics.jsonl: the monitored Δ CE), else None."""


@dataclass(frozen=True)
class ReportSection:
    """One registered kind of report section."""

    name: str
    """Its name in REPORT_SECTIONS."""
    kind: RowKind | None
    """The row kind it reads: it is asked only when the rows hold one (None: asked for every report)."""
    build: Callable[[Page], Sequence[Section]]
    """Draws its figures into ``page.out`` and returns its sections, in page order (none: nothing to show)."""
    when: Callable[[Page], bool] | None = None
    """A further condition on the page (None: the row kind alone decides)."""

    def applies(self, page: Page) -> bool:
        """Whether this section is asked for ``page``."""
        return (self.kind is None or self.kind.present(page.rows)) and (self.when is None or self.when(page))


REPORT_SECTIONS: Registry[ReportSection] = Registry("report section")
"""The report's sections in page order (registration order): report/contents.py registers them."""


def report_section(name: str, kind: RowKind | None = None, when: Callable[[Page], bool] | None = None):
    """Register the decorated builder as the report section ``name`` (see the module docstring)."""

    def deco(build: Callable[[Page], Sequence[Section]]) -> Callable[[Page], Sequence[Section]]:
        REPORT_SECTIONS.add(name, ReportSection(name, kind, build, when))
        return build

    return deco


def figure_section(name: str, file: str, title: str, caption: str, draw: Callable[[Page, Path], list[dict]],
                   kind: RowKind | None = None, when: Callable[[Page], bool] | None = None) -> None:
    """Register the report section ``name`` of one figure: ``draw(page, path of file)`` draws it and returns the
    table behind it; the section (title, figure, table, caption) appears when that table is not empty."""

    def build(page: Page) -> list[Section]:
        table = draw(page, page.out / file)
        return [Section(title, file, table, caption)] if table else []

    REPORT_SECTIONS.add(name, ReportSection(name, kind, build, when))


def page_sections(page: Page) -> list[Section]:
    """Every registered section's Sections for ``page``, in registration order."""
    return [s for rs in REPORT_SECTIONS.values() if rs.applies(page) for s in rs.build(page)]
