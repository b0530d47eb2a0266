"""The finding families, each one registered object: what it needs (in a study spec and in a store's rows),
how it is computed, its figure with title and caption, and how its findings are said and labelled.

A study computes the families its spec has the inputs for (``findings.compute`` names some); a store's report
computes those whose inputs are in its rows (:func:`families_in`); the findings table, findings.json, the
answer's sentences, the overview figure and each family's own figure and report section all follow from the
registered :class:`FindingFamily`, in registration order (the order of the findings and of their sections).

Adding a family is one ``register_family(FindingFamily(...))`` at the end of this module, e.g. the rotations
family below::

    register_family(FindingFamily(
        name="rotations", about="the LR-decay effect with a rotation before quantizing minus without it",
        needs="cooldowns with control: true and a rotated quantizer beside its plain twin (rtn4 and rtn4+had)",
        in_spec=lambda spec: spec.cooldowns.control and bool(rot.rotation_pairs(list(spec.sweep.quantizers))),
        in_rows=lambda rows: bool(rot.rotation_pairs(sorted({str(r.get("quantizer")) for r in PTQ.select(rows)}))),
        compute=lambda i: rot.rotation_findings(i.rows, i.runs, i.spec.quantizers, i.spec.z),
        sentence=rot.rotation_sentence, label=rot.rotation_label,
        figure=FamilyFigure("findings_rotations.png", "Does a rotation remove the LR-decay effect?", "The decay ...",
                            draw=lambda found, detail, out: _rotation_figure().rotations(found, out))))

``compute`` returns (finding rows, {name: detail table}) like studies/findings.py's functions (rows from
:func:`quantdyn.studies.findings.finding_row` / ``correlation_row``, whose ``family`` is the family's name); the
detail table goes to findings.json and to the CSV of the family's figure.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from quantdyn.analysis.correlate import CorrelateConfig
from quantdyn.launch.grid import parse_vary
from quantdyn.registry import Registry
from quantdyn.results.schema import ANALYSIS, PTQ, number
from quantdyn.results.stats import decay_verdict, verdict_sign
from quantdyn.runs import control_of, is_cooldown
from quantdyn.studies import findings as fd
from quantdyn.studies import league
from quantdyn.studies import rotation_findings as rot

# A family reads a study's spec (studies/spec.py: StudySpec, its FindingsSpec), but spec.py imports this module to
# check the families a study names, so the spec's types are named in the docstrings, not imported (imports go one way).


@dataclass(frozen=True)
class FindingInputs:
    """What a family's ``compute`` reads."""

    rows: list[dict]
    """The rows, one per measurement (findings.dedupe) with the FP SE on PTQ rows (findings.with_fp_se)."""
    runs: Sequence[str]
    """The runs compared (a study's, or every run trained here)."""
    spec: Any
    """Which quantizers, the verdict's z, the bootstrap's size ...: the study's FindingsSpec (StudySpec.findings)."""
    reference_branch: str | None = None
    """The cooldown branch whose endpoint is "the decayed endpoint" (averaging; None: none)."""
    fp_windows: Mapping[str, Sequence[float]] | None = None
    """FP window CE per checkpoint (pairs CE(quantized) differences window by window), or None."""

    @property
    def correlate(self) -> CorrelateConfig:
        """The bootstrap of correlations as the spec sets it."""
        return CorrelateConfig(n_boot=self.spec.n_boot, ci=self.spec.ci, seed=self.spec.bootstrap_seed)


@dataclass(frozen=True)
class FamilyFigure:
    """A family's own figure: drawn after the answer's overview and shown as a report section of its own."""

    file: str
    """PNG name in the report directory (findings_<family>.png; the SVG and CSV share its stem)."""
    title: str
    """The report section's title."""
    caption: str
    """The report section's caption."""
    draw: Callable[[list[dict], list[dict], Path], bool]
    """(the family's findings, its detail table, the PNG path) -> whether it drew anything."""


@dataclass(frozen=True)
class FindingFamily:
    """One finding family (a paper's claim and the comparisons that test it)."""

    name: str
    """Its name: in findings.compute, in each finding row's ``family`` and in findings.json's details."""
    about: str
    """The claim it tests and what it compares, in one line."""
    needs: str
    """What a study needs for it (the error when findings.compute names it without them)."""
    in_spec: Callable[[Any], bool]
    """Whether a study spec (a StudySpec) has its inputs."""
    in_rows: Callable[[Sequence[Mapping]], bool]
    """Whether a store's rows have its inputs (a report without a spec computes it then)."""
    compute: Callable[[FindingInputs], tuple[list[dict], dict]]
    """rows -> (finding rows, {name: detail table})."""
    figure: FamilyFigure | None = None
    """Its own figure (None: its findings are drawn in the overview and the report's own figures only)."""
    sentence: Callable[[Mapping, str, float], tuple[str, str] | None] | None = None
    """(finding, 'effect ± uncertainty (relative)', z threshold) -> (what was found, the verdict in words) for
    the answer's sentences, or None for the default ('comparison: metric effect ± uncertainty', the verdict)."""
    label: Callable[[Mapping, bool], str | None] | None = None
    """(finding, name its seed family) -> its label in the overview figure, or None for the default."""
    panel_titles: Mapping[str, str] | None = None
    """The overview's panel title when a panel holds this family alone, per way of drawing ('rel', 'z')."""


FINDING_FAMILIES: Registry[FindingFamily] = Registry("finding family")
"""The finding families, in the order their findings and figures appear."""


def register_family(family: FindingFamily) -> FindingFamily:
    """Register ``family`` under its name (a name registered twice is an error)."""
    return FINDING_FAMILIES.add(family.name, family)


def families_in(rows: Sequence[Mapping]) -> tuple[str, ...]:
    """The finding families (FINDING_FAMILIES order) whose inputs are in ``rows``."""
    return tuple(f.name for f in FINDING_FAMILIES.values() if f.in_rows(rows))


def family_of(finding: Mapping) -> FindingFamily | None:
    """The registered family of a finding row (None for a family no longer registered)."""
    name = finding.get("family")
    return FINDING_FAMILIES.get(name) if name in FINDING_FAMILIES else None


def _figures():
    """studies/figures.py, imported when a figure is drawn: it imports matplotlib, which reading a study spec
    (this module's other use) does not need."""
    from quantdyn.studies import figures

    return figures


# ------------------------------------------------------------------ the families
def _trained_ptq(rows: Sequence[Mapping]) -> list[Mapping]:
    trained = set(fd.trained_runs(rows))
    return [r for r in rows if PTQ.matches(r) and r.get("run") in trained]


def _decay_in_rows(rows: Sequence[Mapping]) -> bool:
    """A cooldown branch and its control measured in one run trained here."""
    branches = {(r.get("run"), r.get("branch")) for r in _trained_ptq(rows)}
    return any(is_cooldown(b) and (run, control_of(b)) in branches for run, b in branches)


def _decay_sentence(f: Mapping, amount: str, z: float) -> tuple[str, str] | None:
    b = f.get("branch")
    if not b:
        return None
    sign = verdict_sign(number(f.get("effect")), f["se"], z)
    if sign > 0:
        what = f"the decayed endpoint {b} quantizes worse than its constant-LR control by {amount}"
    elif sign < 0:
        what = f"the decayed endpoint {b} quantizes better than its constant-LR control by {amount}"
    else:
        what = f"the decayed endpoint {b} and its constant-LR control differ by {amount}"
    return what, f"{decay_verdict(sign, z)} — {f['verdict']}"


def _decay_label(f: Mapping, with_family: bool) -> str | None:
    """Quantizer and cooldown branch (with the seed family when several share the figure)."""
    if not f.get("branch"):
        return None
    q = f"{f['quantizer']} · " if f.get("quantizer") else ""
    fam = f"{f['seed_family']} · " if with_family and f.get("seed_family") else ""
    return fam + q + f["branch"]


register_family(FindingFamily(
    name="decay", about="paper A (a), decayed endpoint minus its constant-LR control",
    needs="cooldowns with control: true",
    in_spec=lambda spec: spec.cooldowns.enabled and spec.cooldowns.control,
    in_rows=_decay_in_rows,
    compute=lambda i: fd.decay_findings(i.rows, i.runs, i.spec.quantizers, i.spec.z),
    sentence=_decay_sentence, label=_decay_label,
    panel_titles={"rel": "{claim}: each decayed endpoint minus its constant-LR control, as a percentage of {ref}",
                  "z": "{claim}: each decayed endpoint minus its constant-LR control, as z = difference / "
                       "uncertainty"}))

register_family(FindingFamily(
    name="peak_lr", about="paper A (b), Δ CE of the highest minus the lowest peak LR at matched FP loss and at "
                          "equal steps",
    needs="vary: [\"optim.lr=...\"] with at least two peak LRs",
    in_spec=lambda spec: "optim.lr" in [parse_vary(v)[0] for v in spec.vary],
    in_rows=lambda rows: len({number(r.get("peak_lr")) for r in _trained_ptq(rows)
                              if r.get("branch") == "main"} - {None}) >= 2,
    compute=lambda i: fd.peak_lr_findings(i.rows, i.runs, i.spec.quantizers, i.spec.matched_loss_levels,
                                          i.spec.matched_loss_from, i.spec.z, i.correlate),
    figure=FamilyFigure(
        "findings_peak_lr.png", "A(b) peak LR: Δ CE at matched FP loss",
        "Δ CE against FP loss, one colour per peak LR: each run's checkpoints faint, the values interpolated at the "
        "FP losses every run reaches marked (mean over seeds).",
        draw=lambda found, detail, out: _figures().peak_lr(detail, out))))

register_family(FindingFamily(
    name="averaging", about="paper A (c), LAWA and a soup of cooldown branches against the decayed endpoint at "
                            "equal tokens",
    needs="averaging (lawa or soup_cooldowns) and cooldowns",
    in_spec=lambda spec: spec.averaging.enabled and spec.cooldowns.enabled,
    in_rows=lambda rows: (any(r.get("ckpt_kind") in fd.AVERAGED for r in _trained_ptq(rows))
                          and any(is_cooldown(r.get("branch")) for r in _trained_ptq(rows))),
    compute=lambda i: ([], {}) if i.reference_branch is None else fd.averaging_findings(
        i.rows, i.runs, i.reference_branch, quantizers=i.spec.quantizers, z=i.spec.z, fp_windows=i.fp_windows),
    figure=FamilyFigure(
        "findings_averaging.png", "A(c) weight averages against the decayed endpoint",
        "Each average (and the constant-LR main checkpoint) minus the decayed endpoint at equal tokens: Δ CE and CE "
        "of the quantized model, one marker per seed ± its uncertainty, the mean as a bar.",
        draw=lambda found, detail, out: _figures().averaging(detail, out))))

register_family(FindingFamily(
    name="sharpness", about="paper A (d), Hessian trace / top eigenvalue through a cooldown and their correlation "
                            "with Δ CE",
    needs="sweep.analysis with hessian",
    in_spec=lambda spec: "hessian" in spec.sweep.analysis,
    in_rows=lambda rows: any(r.get("analysis") == "hessian" and is_cooldown(r.get("branch"))
                             for r in ANALYSIS.select(rows)),
    compute=lambda i: fd.sharpness_findings(i.rows, i.runs, i.spec.quantizers, i.spec.z, i.correlate),
    figure=FamilyFigure(
        "findings_sharpness.png", "A(d) Hessian trace and top eigenvalue through the cooldowns",
        "Hessian trace (± SE), top eigenvalue and Δ CE against tokens: main run (black), cooldown branches (red), "
        "constant-LR controls (blue, dashed).",
        draw=lambda found, detail, out: _figures().sharpness(detail, out))))

register_family(FindingFamily(
    name="predictors", about="paper B, Spearman of MMR, kurtosis and R_L with PTQ Δ CE across runs",
    needs="sweep.analysis with outliers and/or propagation",
    in_spec=lambda spec: bool({"outliers", "propagation"} & set(spec.sweep.analysis)),
    in_rows=lambda rows: any(k in fd.OUTLIER_METRICS or k.startswith("prop_") for r in ANALYSIS.select(rows)
                             for k in r),
    compute=lambda i: fd.predictor_findings(i.rows, i.runs, i.spec.quantizers, i.correlate),
    figure=FamilyFigure(
        "findings_predictors.png", "B: which metric predicts the quantization error",
        "Spearman ρ of each metric with Δ CE across final checkpoints, 95 % bootstrap intervals, one colour per "
        "quantizer.",
        draw=lambda found, detail, out: _figures().predictors(found, out))))

register_family(FindingFamily(
    name="early_warning", about="issue 48.5, Spearman of the curvature along the update (the cheap early warning) "
                                "with Δ CE over the checkpoints, the Hessian trace and R_L beside it; the curvature "
                                "through each cooldown against its constant-LR control",
    needs="sweep.analysis with curvature",
    in_spec=lambda spec: "curvature" in spec.sweep.analysis,
    in_rows=lambda rows: any(r.get("analysis") == "curvature" and number(r.get(fd.WARNING_METRIC)) is not None
                             for r in ANALYSIS.select(rows)),
    compute=lambda i: fd.early_warning_findings(i.rows, i.runs, i.spec.quantizers, i.correlate, i.spec.z),
    figure=FamilyFigure(
        fd.EARLY_WARNING_FIGURE, "Issue 48.5: the curvature along the update as an early warning",
        "Left: Δ CE of the first quantizer against the curvature of the held-out loss along the update from each "
        "checkpoint's predecessor (identical weights once), with its Spearman ρ and 95 % bootstrap interval. Right: "
        "the curvature against tokens: main run (black), cooldown branches (red), constant-LR controls (blue, "
        "dashed).",
        draw=lambda found, detail, out: _figures().early_warning(found, detail, out))))

register_family(FindingFamily(
    name="rotations", about="issue 37, the LR-decay effect with a rotation before quantizing minus without it",
    needs="cooldowns with control: true and sweep.quantizers with a rotated quantizer beside its plain twin "
          "(rtn4 and rtn4+had)",
    in_spec=lambda spec: (spec.cooldowns.enabled and spec.cooldowns.control
                          and bool(rot.rotation_pairs(list(spec.sweep.quantizers)))),
    in_rows=lambda rows: _decay_in_rows(rows) and bool(rot.rotation_pairs(
        sorted({str(r.get("quantizer")) for r in _trained_ptq(rows)}))),
    compute=lambda i: rot.rotation_findings(i.rows, i.runs, i.spec.quantizers, i.spec.z),
    sentence=rot.rotation_sentence, label=rot.rotation_label,
    figure=FamilyFigure(
        "findings_rotations.png", "Does a rotation remove the LR-decay effect?",
        "The decay effect (Δ CE of the decayed endpoint minus its constant-LR control) of each quantizer without "
        "(grey) and with a Hadamard rotation before quantizing (the verdict's colour), ± 2 × its uncertainty; beside "
        "them what the rotation does to it.",
        draw=lambda found, detail, out: _rotation_figure().rotations(found, out))))


register_family(FindingFamily(
    name="interventions", about="issue 48, each intervention's quantized CE minus the standard linear-decay "
                                "endpoint's from the same checkpoint at equal tokens (SAM, QAT in a format, no decay "
                                "+ averaging), FP CE and cost beside it",
    needs="cooldowns with interventions or nodecay",
    in_spec=lambda spec: bool(spec.cooldowns.interventions or spec.cooldowns.nodecay),
    in_rows=lambda rows: bool(league.league_branches(_trained_ptq(rows))),
    compute=lambda i: league.league_findings(i.rows, i.runs, i.spec.quantizers, i.spec.z, i.fp_windows),
    label=lambda f, with_family: (f"{f['seed_family']} · " if with_family and f.get("seed_family") else "")
    + f"{f['quantizer']} · {f['intervention']}" if f.get("intervention") else None,
    figure=FamilyFigure(
        league.FIGURE, "Interventions: quantized CE against FP CE",
        "Each intervention's difference from the standard linear-decay endpoint (same checkpoint, equal tokens), "
        "mean over seeds ± 2 × its uncertainty: FP CE across, CE of the quantized model up; one panel per "
        "quantizer, a diamond where a QAT branch is deployed with its own format. Below the dotted diagonal it buys "
        "more quantized than FP quality.",
        draw=lambda found, detail, out: _league_figure().league(found, out))))


register_family(FindingFamily(
    name="warmdown", about="issue 48.3, each warmdown length x shape of a grid against the 20 % linear warmdown: "
                           "the final checkpoints' quantized CE, FP CE beside it",
    needs="vary over schedule.decay and/or schedule.decay_shape, with the 20 % linear warmdown among the values",
    in_spec=lambda spec: bool(set(league.WARMDOWN_KEYS) & {parse_vary(v)[0] for v in spec.vary}),
    in_rows=lambda rows: bool(league.warmdown_points(fd.trained_runs(rows))[1]),
    compute=lambda i: league.warmdown_findings(i.rows, i.runs, i.spec.quantizers, i.spec.z, i.fp_windows),
    label=lambda f, with_family: f"{f['quantizer']} · " + " ".join(f"{k.rsplit('.', 1)[1]} {v}" for k, v in
                                                                  f["warmdown"].items()) if f.get("warmdown") else None))


def _league_figure():
    """studies/league_figure.py, imported when its figure is drawn (matplotlib)."""
    from quantdyn.studies import league_figure

    return league_figure


def _rotation_figure():
    """studies/rotation_figure.py, imported when its figure is drawn (matplotlib)."""
    from quantdyn.studies import rotation_figure

    return rotation_figure


# ------------------------------------------------------------------ what the answer asks of the families
def finding_label(f: Mapping, with_family: bool = False) -> str:
    """A finding's label in the overview figure: its family's (FindingFamily.label), else the default
    (studies/figures.py finding_label)."""
    fam = family_of(f)
    own = fam.label(f, with_family) if fam is not None and fam.label is not None else None
    return own if own is not None else _figures().finding_label(f, with_family)


def panel_title(rows: list[dict], mode: str) -> str | None:
    """The overview's title for a panel that holds one family alone, when the family words it
    (FindingFamily.panel_titles); None: the figure's own."""
    names = {f.get("family") for f in rows}
    fam = family_of(rows[0]) if len(names) == 1 and rows else None
    return (fam.panel_titles or {}).get(mode) if fam is not None else None


def draw_figures(out: Path, found: list[dict], details: Mapping) -> dict[str, bool]:
    """The answer's overview (findings.png) and each family's own figure, where the family has findings or a
    detail table; returns which were drawn."""
    drawn = {"findings.png": _figures().overview(found, out / "findings.png", finding_label, panel_title)}
    for fam in FINDING_FAMILIES.values():
        mine = [f for f in found if f.get("family") == fam.name]
        detail = list(details.get(fam.name) or [])
        if fam.figure is not None and (mine or detail):
            drawn[fam.figure.file] = fam.figure.draw(mine, detail, out / fam.figure.file)
    return drawn
