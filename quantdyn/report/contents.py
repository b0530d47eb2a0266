"""The report's own sections, in page order: each one builder registered with ``@report_section``
(report/sections.py), named for what it shows, with the row kind it reads.

  monitored             a run directory's monitored Δ CE, when no sweep row of the run is in the store
  runs                  per run: loss and Δ CE along training (and its monitored Δ CE beside), the cooldown
                        branches against their constant-LR controls
  seeds                 runs that differ only by seed: their spread
  loss_vs_dce           Δ CE against the FP loss, one marker per varied setting (ptq rows)
  averaging_vs_decay    weight averages against the decayed endpoint (ptq rows)
  predictors            which metric predicts the quantization error (analysis rows)
  accuracy              downstream accuracy drop against Δ CE (accuracy rows)
  optimizers            per optimizer at the end of each run (several optimizers, or qat rows)
  scaling               scaling laws per optimizer, FP and QAT (scaling rows)
  error_maps            per-block error maps and KL by confidence (ptq rows that carry them)
  sensitivity           per-tensor sensitivity along training and what the decay did to it (sensitivity rows)
  public_trajectories   public checkpoints along their training (ptq rows of hub presets)

The answer (a study's findings) opens the page before these: the caller's lead (report/html.py write_page); where
the rows hold a decision of `quantdyn ship`, "What to ship" (report/what_to_ship.py) opens it before the answer
(studies/section.py write_report).
"""
from __future__ import annotations

import re
from pathlib import Path

from quantdyn.report import error_maps, figures, public_trajectories, sensitivity_maps
from quantdyn.report.accuracy import accuracy_vs_dce
from quantdyn.report.monitored import monitored_points
from quantdyn.report.optimizers import optimizer_figure, optimizer_table, scaling_figure
from quantdyn.report.palette import Palette
from quantdyn.report.predictors import predictor_figure, predictor_rows
from quantdyn.report.sections import Page, Section, figure_section, report_section
from quantdyn.results.schema import ACCURACY, ANALYSIS, FP, PTQ, QAT, SCALING, SENSITIVITY
from quantdyn.results.stats import Z, format_estimate
from quantdyn.runs import RunDir
from quantdyn.train.checkpoint import read_metrics


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def _runs(rows: list[dict]) -> list[str]:
    """The runs with FP or PTQ rows."""
    return sorted({r["run"] for r in rows if (FP.matches(r) or PTQ.matches(r)) and r.get("run")})


def _has_main_ptq(rows: list[dict], run: str) -> bool:
    return any(PTQ.matches(r) and r.get("run") == run and (r.get("branch") or "main") == "main" for r in rows)


def _run_dir_of(rows: list[dict], run: str) -> Path | None:
    ck = next((r["checkpoint"] for r in rows if r.get("run") == run and r.get("branch") == "main"
               and r.get("checkpoint")), None)
    if not ck:
        return None
    rd = Path(ck).parent.parent
    return rd if RunDir(rd).metrics.is_file() else None


def lr_curve_of(run_dir: Path | None) -> list[tuple[int, float]]:
    """(tokens, LR) of every logged step of a run (its metrics.jsonl)."""
    if run_dir is None:
        return []
    return [(r["train/tokens"], r["train/lr"]) for r in read_metrics(run_dir)
            if r.get("train/lr") is not None and r.get("train/tokens") is not None]


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


def decay_table_shown(table: list[dict], z: float = Z) -> list[dict]:
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


# ------------------------------------------------------------------ the sections, in page order
@report_section("monitored", when=lambda page: page.run_dir is not None
                and not any(_has_main_ptq(page.rows, run) for run in _runs(page.rows)))
def monitored(page: Page) -> list[Section]:
    """The report of a run directory whose sweep rows are not in the store: its monitored Δ CE alone (with
    sweep rows, the runs section shows it beside the run's trajectory)."""
    mon = _monitored_section(page.run_dir.name, page.run_dir, page.out, page.palette, beside=False)
    return [mon] if mon else []


@report_section("runs")
def runs(page: Page) -> list[Section]:
    """Per run: loss and Δ CE along training (with the monitored Δ CE of its run directory beside it), and its
    cooldown branches against their constant-LR controls."""
    rows, out, palette = page.rows, page.out, page.palette
    found: list[Section] = []
    monitored_done = set()
    for run in _runs(rows):
        rd = page.run_dir if page.run_dir is not None else _run_dir_of(rows, run)
        safe = _safe(run)
        f1 = out / f"trajectory_{safe}.png"
        if _has_main_ptq(rows, run):
            t1 = figures.trajectory(rows, run, lr_curve_of(rd), f1, palette)
            found.append(Section(f"Run {run}: loss and quantization error along training", f1.name, t1,
                                 TRAJECTORY_CAPTION))
            if rd is not None and rd.resolve() not in monitored_done:
                mon = _monitored_section(run, rd, out, palette, beside=True)
                if mon:
                    found.append(mon)
                    monitored_done.add(rd.resolve())
        f2 = out / f"rainbow_{safe}.png"
        t2 = figures.rainbow(rows, run, f2, palette)
        if t2:
            found.append(Section(f"Run {run}: cooldown branches vs constant-LR controls", f2.name, t2,
                                 RAINBOW_CAPTION, shown=decay_table_shown(t2)))
    return found


@report_section("seeds")
def seeds(page: Page) -> list[Section]:
    """Runs that differ only by seed: the mean Δ CE over seeds and their spread."""
    found = []
    for family, members in figures.seed_families(page.rows).items():
        f5 = page.out / f"seeds_{_safe(family)}.png"
        t5 = figures.seeds(page.rows, family, members, f5, page.palette)
        if t5:
            found.append(Section(
                f"{family}: spread over {len(members)} seeds", f5.name, t5,
                f"Runs {', '.join(members)} differ only by seed. Mean Δ CE over the seeds at the steps they all "
                "have; error bars are the SD over seeds (with two seeds, |a − b|/√2), which includes each seed's "
                "own quantization noise; faint lines the single seeds. Solid: main run and cooldown branches; "
                "dashed: controls."))
    return found


@report_section("loss_vs_dce", kind=PTQ)
def loss_vs_dce(page: Page) -> list[Section]:
    """Δ CE against the FP loss, one marker per varied setting (per branch with one run)."""
    f3 = page.out / "loss_vs_dce.png"
    color_key = figures.varied_key(page.rows) if len(_runs(page.rows)) > 1 else "branch"
    t3 = figures.loss_vs_dce(page.rows, f3, color_key=color_key, palette=page.palette)
    return [Section("Δ CE against full-precision loss", f3.name, t3,
                    f"One marker per {color_key} (paper A, Figure 6); lower-left is better."
                    + (" Hollow markers: constant-LR controls." if color_key == "branch" else ""))]


figure_section(
    "averaging_vs_decay", "averaging_vs_decay.png", "Weight averaging against the decayed endpoint",
    "Per bit width: Δ CE of each run's decayed endpoint (black) and of its latest averaged checkpoints (LAWA, EMA, "
    "soups; each in its branch's colour). The table also gives FP and quantized CE: a lower Δ CE at a much higher "
    "loss is not a better model.",
    draw=lambda page, png: figures.averaging_vs_decay(page.rows, png, page.palette), kind=PTQ)


def _predictor_table(page: Page, png: Path) -> list[dict]:
    """Correlations of every stored metric with Δ CE across checkpoints (none unless the figure was drawn)."""
    corr = predictor_rows(page.rows)
    return corr if corr and predictor_figure(page.rows, corr, png) else []


figure_section(
    "predictors", "predictors.png", "Which metric predicts the quantization error?",
    "Spearman and Pearson correlation (95 % bootstrap intervals) of each stored metric with Δ CE across the "
    "checkpoints of this study, per quantizer; scatter plots of the strongest. Paper B finds outlier metrics (MMR, "
    "kurtosis) fail across optimizers while the propagated error R_L predicts; paper A links Δ CE to the Hessian "
    "trace and top eigenvalue.",
    draw=_predictor_table, kind=ANALYSIS)

figure_section(
    "accuracy", "accuracy_vs_dce.png", "Downstream accuracy drop against Δ CE",
    "Accuracy of the quantized model minus the full-precision one, per task, against Δ CE across checkpoints "
    "(paper A, Figure 4).",
    draw=lambda page, png: accuracy_vs_dce(page.rows, png), kind=ACCURACY)


def _optimizer_table(page: Page, png: Path) -> list[dict]:
    """Per run's final checkpoint, grouped by optimizer (none unless the figure was drawn)."""
    table = optimizer_table(page.rows)
    return table if table and optimizer_figure(table, png) else []


figure_section(
    "optimizers", "optimizers.png", "Optimizers under quantization",
    "Per run's final checkpoint: FP loss, PTQ Δ CE per quantizer, the deployed QAT loss, outlier metrics (MMR, "
    "kurtosis) and the propagated error R_L (paper B).",
    draw=_optimizer_table,
    when=lambda page: len({r.get("optimizer") for r in page.rows if r.get("optimizer")}) > 1 or QAT.present(page.rows))

figure_section(
    "scaling", "scaling.png", "Scaling laws per optimizer, full precision and QAT",
    "L(N, D) = A(ρN)^-α + B·D^-β + E fitted to FP points, then ρ alone to QAT points; ρ < 1 is the parameter "
    "efficiency lost under quantization (paper B).",
    draw=lambda page, png: scaling_figure(page.rows, png), kind=SCALING)


@report_section("error_maps", kind=PTQ)
def error_maps_section(page: Page) -> list[Section]:
    """Per run: where in the network the error appears, and KL by the model's confidence."""
    return [Section(*s) for s in error_maps.sections(page.rows, page.out, page.palette)]


@report_section("sensitivity", kind=SENSITIVITY)
def sensitivity_section(page: Page) -> list[Section]:
    """Per run: the sensitivity map of its tensor groups along training, and which groups its cooldowns made more
    sensitive than their controls."""
    return [Section(*s) for s in sensitivity_maps.sections(page.rows, page.out)]


@report_section("public_trajectories", kind=PTQ)
def public_trajectories_section(page: Page) -> list[Section]:
    """Public checkpoints (hub presets) along their training, their soups, and the families side by side."""
    return [Section(*s) for s in public_trajectories.sections(page.rows, page.out, page.palette)]
