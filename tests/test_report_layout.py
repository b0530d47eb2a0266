"""Every figure the report draws, checked as a reader sees it: no text outside the figure (nothing clipped),
an LR axis with its scale on every panel that draws the LR, and the rule that keeps a quantizer that dwarfs
the others from flattening them (one linear axis, a log axis, or small multiples)."""
from __future__ import annotations

import math
import random
from unittest import mock

import matplotlib
import pytest
from matplotlib.text import Text

from quantdyn.report import figures, output
from quantdyn.report.palette import LR_COLOR

matplotlib.use("Agg")

QUANTIZERS = {"rtn2": (2, "rtn", 1.6), "rtn3": (3, "rtn", 0.25), "gptq3": (3, "gptq", 0.12),
              "rtn4": (4, "rtn", 0.045), "gptq4": (4, "gptq", 0.012)}
"""label -> (bits, method, typical Δ CE): rtn2 dwarfs the others, as in the demo."""
DECAY_EFFECT = {"rtn2": 0.08, "rtn3": 0.06, "gptq3": -0.05, "rtn4": 0.02, "gptq4": 0.0}
"""The relative change of Δ CE at a decayed endpoint: resolved up, resolved down, not resolved."""
STEPS, EVERY, DECAY_FROM, COOLDOWNS, DECAY = 200, 25, 160, (100, 150), 50


def lr_of(step: int) -> float:
    """A WSD schedule: warmup to step 25, constant 3e-3, linear decay from step 160 to 0 at 200."""
    if step < 25:
        return 3e-3 * step / 25
    return 3e-3 if step <= DECAY_FROM else 3e-3 * (STEPS - step) / (STEPS - DECAY_FROM)


def noisy_study_rows(seeds=(0, 1), run="demo", root="/runs", windows=16, seed=1234) -> list[dict]:
    """FP and PTQ rows of a small WSD study as `quantdyn study` writes them: per seed a main run (checkpoints
    every 25 steps), cooldown branches from steps 100 and 150 with their constant-LR controls, a LAWA average
    at the last step, Hessian and outlier analyses; per-window Δ CE with a shared window difficulty (so pairing
    helps) and noise, the decay effects of DECAY_EFFECT, and one early gptq4 checkpoint below zero."""
    rng = random.Random(seed)
    rows: list[dict] = []
    for s in seeds:
        name = f"{run}-s{s}"
        points = [("main", "checkpoint", st, None) for st in range(EVERY, STEPS + 1, EVERY)]
        for f in COOLDOWNS:
            for st in (f + EVERY, f + DECAY):
                points += [(f"cooldown-s{f}-d{DECAY}-linear", "cooldown", st, f), (f"control-s{f}-d{DECAY}", "control",
                                                                                    st, f)]
        points.append(("lawa-k2-p25-offline", "lawa", STEPS, None))
        difficulty = {q: [rng.gauss(0, 0.15) for _ in range(windows)] for q in QUANTIZERS}
        for k, (branch, kind, step, parent) in enumerate(points):
            if kind == "cooldown":
                lr = 3e-3 * (parent + DECAY - step) / DECAY
            elif kind in ("control", "lawa"):
                lr = 3e-3
            else:
                lr = lr_of(step)
            decaying = kind == "cooldown" or (kind == "checkpoint" and step > DECAY_FROM)
            ce_fp = 6.0 - 0.9 * math.log10(step) - (0.05 if decaying else 0.0) + rng.gauss(0, 0.003)
            where = "checkpoints" if branch == "main" else f"branches/{branch}"
            base = {"run": name, "branch": branch, "ckpt_kind": kind, "step": step, "tokens": step * 512, "lr": lr,
                    "checkpoint": f"{root}/{name}/{where}/step-{step:07d}", "decaying": decaying, "peak_lr": 3e-3,
                    "seed": s, "parent_step": parent, "optimizer": "adamw", "eval_hash": "evalhash0001",
                    "calib_hash": "calibhash001", "data_key": "datakey-0abc", "git_sha": "0123456789ab",
                    "hardware": "cpu test x2", "time": f"2026-01-01T00:{k // 60:02d}:{k % 60:02d}"}
            key = f"{name}-{branch}-{step}"
            rows.append({**base, "key": key + "-fp", "kind": "fp", "ce_fp": ce_fp, "ce_fp_se": 0.02})
            for q, (bits, method, scale) in QUANTIZERS.items():
                effect = 1 + DECAY_EFFECT[q] * (step - parent) / DECAY if kind == "cooldown" else 1.0
                level = scale * (1 + 0.25 * step / STEPS) * effect * (1 + rng.gauss(0, 0.01))
                if q == "gptq4" and step == EVERY:
                    level = -0.002  # quantizing an early checkpoint can lower its loss
                wd = [level + scale * (d + rng.gauss(0, 0.01)) for d in difficulty[q]]
                d = sum(wd) / windows
                se = math.sqrt(sum((w - d) ** 2 for w in wd) / (windows - 1) / windows)
                rows.append({**base, "key": f"{key}-{q}", "kind": "ptq", "quantizer": q, "quantizer_spec": q,
                             "method": method, "bits": bits, "group_size": 128, "ce_fp": ce_fp, "ce_q": ce_fp + d,
                             "delta_ce": d, "delta_ce_se": se, "rel_delta_ce": d / ce_fp,
                             "delta_ppl": math.exp(ce_fp + d) - math.exp(ce_fp), "kl": abs(0.8 * d) + 1e-4,
                             "kl_se": 0.8 * se, "top1_agree": 1 / (1 + abs(d)), "n_windows": windows,
                             "window_delta": wd, "quant_config_hash": f"cfg-{q}", "compute_dtype": "float32",
                             "quant_repeats": 1, "delta_ce_run_sd": None, "delta_ce_total_se": se})
            if kind != "lawa":
                sharp = 40.0 * (1.3 if decaying else 1.0) * (1 + 0.2 * step / STEPS)
                rows.append({**base, "key": key + "-hessian", "kind": "analysis", "analysis": "hessian",
                             "hessian_trace": sharp + rng.gauss(0, 1), "hessian_trace_se": 1.0,
                             "hessian_top_eig": sharp / 8 + rng.gauss(0, 0.2)})
                rows.append({**base, "key": key + "-outliers", "kind": "analysis", "analysis": "outliers",
                             "weight_mmr_mean": 8 + rng.gauss(0, 1), "weight_kurtosis_mean": 3 + rng.gauss(0, 0.5)})
    return rows


# --------------------------------------------------------------------------- the checks, written once
def drawn_texts(fig) -> list[tuple[Text, object]]:
    """(text artist, its window extent) of every non-empty text the renderer draws in ``fig``."""
    seen: list[tuple[Text, object]] = []
    real = Text.draw

    def record(self, renderer):
        real(self, renderer)
        if self.get_visible() and self.get_text().strip():
            seen.append((self, self.get_window_extent(renderer)))

    with mock.patch.object(Text, "draw", record):
        fig.canvas.draw()
    return seen


def clipped_texts(fig, drawn=None, tol: float = 0.5) -> list[str]:
    """The texts of ``fig`` whose extent reaches outside the figure (a label cut at the edge), with where.
    ``drawn``: :func:`drawn_texts` of ``fig`` when already at hand."""
    box = fig.bbox
    return [f"{t.get_text()!r} at ({e.x0:.0f}, {e.y0:.0f})..({e.x1:.0f}, {e.y1:.0f}) outside {box.width:.0f} x "
            f"{box.height:.0f}" for t, e in (drawn if drawn is not None else drawn_texts(fig))
            if e.x0 < box.x0 - tol or e.y0 < box.y0 - tol or e.x1 > box.x1 + tol or e.y1 > box.y1 + tol]


def overlapping_texts(fig, drawn=None, tol: float = 1.0) -> list[str]:
    """Pairs of texts of ``fig`` drawn over each other (tick labels crowded on a short axis, a legend over a
    label), overlapping by more than ``tol`` pixels both ways. Texts at an angle other than 0 or 90 degrees
    (rotated tick labels) are left out: their rectangular extents overlap where their glyphs do not."""
    square = [(t, e) for t, e in (drawn if drawn is not None else drawn_texts(fig))
              if round(t.get_rotation()) % 90 == 0]
    return [f"{a.get_text()!r} over {b.get_text()!r}" for k, (a, ea) in enumerate(square) for b, eb in square[k + 1:]
            if min(ea.x1, eb.x1) - max(ea.x0, eb.x0) > tol and min(ea.y1, eb.y1) - max(ea.y0, eb.y0) > tol]


def is_lr_line(line) -> bool:
    hexed = matplotlib.colors.to_hex
    return hexed(line.get_color()) == hexed(LR_COLOR) and len(line.get_xdata()) > 1


def lr_axes_without_scale(fig, drawn=None) -> list[str]:
    """Axes that draw an LR line but show no LR scale: no "LR" y label, or no tick label drawn on that axis.
    ``drawn``: :func:`drawn_texts` of ``fig`` when already at hand."""
    drawn = {id(t) for t, _ in (drawn if drawn is not None else drawn_texts(fig))}
    bad = []
    for ax in fig.axes:
        if not any(is_lr_line(line) for line in ax.get_lines()):
            continue
        ticks = [t for tick in ax.yaxis.get_major_ticks() for t in (tick.label1, tick.label2)]
        if not ax.get_ylabel().startswith("LR") or id(ax.yaxis.label) not in drawn \
                or not any(id(t) in drawn for t in ticks):
            bad.append(f"axes at {ax.get_position().bounds} (ylabel {ax.get_ylabel()!r})")
    return bad


@pytest.fixture
def laid_out(monkeypatch):
    """Every figure the report and the findings lay out, kept (no files written: the checks need the layout,
    not the PNG): {file stem: Figure}."""
    kept = {}
    monkeypatch.setitem(matplotlib.rcParams, "figure.max_open_warning", 0)  # kept open until checked

    def keep(fig, out, top=0.0, bottom=0.0):
        output.layout_figure(fig, top, bottom)
        kept[output.figure_stem(out).name] = fig
        return output.figure_paths(out)

    for mod in ("quantdyn.report.figures", "quantdyn.report.accuracy", "quantdyn.report.optimizers",
                "quantdyn.report.predictors", "quantdyn.report.public_trajectories", "quantdyn.studies.figures"):
        monkeypatch.setattr(f"{mod}.save_figure", keep)
    yield kept
    import matplotlib.pyplot as plt

    for fig in kept.values():
        plt.close(fig)


def every_figure_rows(tmp_path) -> list[dict]:
    """Rows that make the report draw each of its figures: the noisy study (trajectories, cooldowns, seeds,
    averages, analyses), a second optimizer, downstream accuracy, scaling fits and a public trajectory."""
    from test_presets import _rows_of

    rows = noisy_study_rows(root=str(tmp_path / "runs"))
    ends = [r for r in rows if r["run"] == "demo-s0" and r["branch"] == "main" and r["step"] == STEPS]
    rows += [{**r, "run": "other-muon", "optimizer": "muon", "key": "m" + r["key"],
              "checkpoint": r["checkpoint"].replace("demo-s0", "other-muon")} for r in ends if r["kind"] != "analysis"]
    rows += [{"kind": "accuracy", "key": f"acc-{q}", "checkpoint": ends[0]["checkpoint"], "checkpoint_hash": "h",
              "quantizer": q, "task": "lambada_openai", "acc_drop": 0.01 * k, "acc_fp": 0.5, "acc_q": 0.5 - 0.01 * k,
              "acc_drop_se": 0.004} for k, q in enumerate(QUANTIZERS)]
    for r in rows:
        if r["kind"] == "ptq" and r["run"] == "demo-s0" and r["branch"] == "main" and r["step"] == STEPS:
            r["checkpoint_hash"] = "h"
    pts = [{"N": n, "D": 20 * n, "loss": 2 + 400 * n ** -0.34} for n in (1e6, 3e6, 1e7, 3e7, 1e8)]
    rows += [{"kind": "scaling", "key": f"sc-{p}", "group": "adamw", "precision": p, "A": 400.0, "alpha": 0.34,
              "B": 410.0, "beta": 0.28, "E": 1.7, "rho": 1.0 if p == "fp" else 0.8, "points": pts, "n_points": 5}
             for p in ("fp", "qat")]
    hub = _rows_of("pythia-160m", ("step1000", "step36000", "step72000", "step143000"))
    hub += _rows_of("olmo2-7b", ("stage1-step5000-tokens21B", "stage1-step928646-tokens3896B",
                                 "stage2-ingredient1-step5000-tokens21B", "stage2-ingredient1-step11931-tokens50B",
                                 "stage2-ingredient2-step11931-tokens50B", "main"))
    return rows + [{**r, "key": f"hub-{k}", "ce_q": r["ce_fp"] + r["delta_ce"]} for k, r in enumerate(hub)]


@pytest.mark.e2e  # every figure of the report laid out and checked: 11.6 s on an idle 2-core CPU
def test_no_figure_clips_its_text_and_every_lr_line_has_its_axis(tmp_path, laid_out):
    """(b) and (c) over every figure function: the report's own (trajectory, monitored panels, rainbow, seeds,
    loss vs Δ CE, averages, predictors, accuracy, optimizers, scaling, public trajectories) and the findings'
    (the answer's overview, peak LR, averaging, sharpness, predictors)."""
    from quantdyn.results.store import ResultStore
    from quantdyn.studies import figures as study_figures
    from quantdyn.studies.section import write_report

    ResultStore(tmp_path / "st").append(every_figure_rows(tmp_path))
    write_report(tmp_path / "st", tmp_path / "rep")
    monitored = figures.metric_panels(
        [{"step": s, "tokens": s * 512, "ce_fp": 4.0 - s / 100} for s in (50, 100)],
        {"rtn2": [{"step": s, "tokens": s * 512, "delta_ce": 1.0 + s / 100, "delta_ce_se": 0.02} for s in (50, 100)]},
        [(s * 512, lr_of(s)) for s in range(0, 201, 10)], tmp_path / "monitored_x", "run x: monitored")
    assert monitored
    detail = [{"quantizer": q, "run": f"lr{lr}-s0", "peak_lr": lr, "seed": 0, "ce_fp": 4 - k / 10,
               "delta_ce": (0.2 + k / 50) / (lr * 1e3), "step": 25 * k, "level": False}
              for q in ("rtn3", "gptq3") for lr in (1e-3, 3e-3) for k in range(1, 6)]
    detail += [{**d, "level": True, "ce_fp": 3.7} for d in detail if d["step"] == 50]
    assert study_figures.peak_lr(detail, tmp_path / "findings_peak_lr")
    corr = [{"family": "predictors", "metric": "Spearman ρ", "quantizer": q,
             "comparison": f"Spearman({m}, Δ CE) over 12 final checkpoints", "effect": e, "interval_lo": e - 0.3,
             "interval_hi": e + 0.2, "verdict": "not resolved at this scale"}
            for q in ("rtn3", "gptq3") for m, e in (("weight MMR", 0.1), ("R_L (propagated error)", 0.7))]
    assert study_figures.predictors(corr, tmp_path / "findings_predictors")
    want = {"trajectory_demo-s0", "trajectory_demo-s1", "rainbow_demo-s0", "rainbow_demo-s1", "seeds_demo",
            "loss_vs_dce", "averaging_vs_decay", "predictors", "accuracy_vs_dce", "optimizers", "scaling",
            "monitored_x", "findings", "findings_averaging", "findings_sharpness", "findings_peak_lr",
            "findings_predictors"}
    assert want <= set(laid_out), sorted(want - set(laid_out))
    public = [k for k in laid_out if "EleutherAI" in k or "OLMo" in k or "families" in k]
    assert len(public) >= 4, sorted(laid_out)  # each trajectory, the soup, the families side by side
    for name, fig in laid_out.items():
        texts = drawn_texts(fig)
        assert clipped_texts(fig, texts) == [], name
        assert overlapping_texts(fig, texts) == [], name
        assert lr_axes_without_scale(fig, texts) == [], name


def test_the_checks_catch_a_clipped_label_overlapping_ticks_and_an_lr_line_without_a_scale():
    """The three checks fail where they should: a y label pushed off the figure, tick labels crowded over each
    other, an LR line with hidden ticks."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(3, 2))
    ax.plot([0, 1], [0, 1])
    ax.set_ylabel("a label far too long to fit, and nothing lays the figure out " * 2)
    assert any("a label far too long" in c for c in clipped_texts(fig))
    fig2, ax2 = plt.subplots(figsize=(4, 3))
    ax2.plot([0, 1], [0, 1])
    output.overlay_lr(ax2, [[(0, 1e-3), (1, 0.0)]])
    output.layout_figure(fig2)
    assert clipped_texts(fig2) == [] and lr_axes_without_scale(fig2) == []
    fig2.axes[-1].tick_params(axis="y", labelright=False)
    assert lr_axes_without_scale(fig2)
    assert overlapping_texts(fig2) == []
    ax2.set_yticks([0.5, 0.51], ["0.5", "0.51"])
    assert overlapping_texts(fig2) == ["'0.5' over '0.51'"]
    plt.close(fig)
    plt.close(fig2)


# --------------------------------------------------------------------------- the small-multiples / log rule
def test_y_layout_rule_on_the_spread_of_the_quantizers():
    """(d) One linear axis while the sizes differ at most SHARED_SPREAD times; a log axis beyond it when every
    value is positive; small multiples by size otherwise, each panel again within SHARED_SPREAD."""
    lay = figures.y_layout({"a": [1.0, 2.0], "b": [0.45, 0.5]})
    assert lay == figures.YLayout("linear", (("a", "b"),))  # 2 / 0.5 <= SHARED_SPREAD
    lay = figures.y_layout({"rtn2": [1.5, 2.0], "rtn4": [0.04, 0.06], "gptq4": [0.01, 0.02]})
    assert lay == figures.YLayout("log", (("rtn2", "rtn4", "gptq4"),))
    lay = figures.y_layout({"rtn2": [1.5, 2.0], "rtn4": [0.04, 0.06], "gptq4": [0.01, 0.02]}, log_ok=False)
    assert lay.scale == "linear" and lay.groups == (("rtn2",), ("rtn4", "gptq4"))
    assert figures.SHARED_SPREAD == 5
    vals = {"rtn2": [1.5, 2.0], "rtn3": [0.2, 0.3], "gptq3": [0.1, 0.15], "rtn4": [0.04, 0.06],
            "gptq4": [-0.002, 0.015], "fp8": [0.0, 0.0]}
    lay = figures.y_layout(vals)  # a value <= 0: no log axis; split by size
    assert lay.scale == "linear" and lay.groups == (("rtn2",), ("rtn3", "gptq3", "rtn4"), ("gptq4", "fp8"))
    for g in lay.groups:  # within every panel the sizes differ at most SHARED_SPREAD times
        mags = [max(abs(v) for v in vals[q]) for q in g if max(abs(v) for v in vals[q]) > 0]
        assert max(mags) / min(mags) <= figures.SHARED_SPREAD
    # the boundary: exactly SHARED_SPREAD still shares an axis, a hair more does not
    assert figures.y_layout({"a": [-1.0], "b": [0.2]}).groups == (("a", "b"),)
    assert figures.y_layout({"a": [-1.0], "b": [0.1999]}).groups == (("a",), ("b",))
    assert figures.y_layout({"a": [3.0]}) == figures.YLayout("linear", (("a",),))


def test_trajectory_follows_the_rule_so_no_quantizer_is_flattened(tmp_path, laid_out):
    """The demo's case: rtn2 dwarfs the others and gptq4 dips below zero, so Δ CE is split into panels by size,
    each with its own y scale in which every curve spans a visible part of the height."""
    rows = noisy_study_rows(seeds=(0,))
    figures.trajectory(rows, "demo-s0", [(s * 512, lr_of(s)) for s in range(0, 201, 5)], tmp_path / "traj")
    fig = laid_out["traj"]
    dce = [a for a in fig.axes if a.get_ylabel() == "Δ CE (nats)"]
    assert len(dce) >= 2 and [t.get_text() for t in dce[0].get_legend().get_texts()] == ["rtn2"]
    for ax in dce:
        lo, hi = ax.get_ylim()
        for c in ax.containers:
            ys = c.lines[0].get_ydata()
            assert max(abs(y) for y in ys) >= (hi - lo) / figures.SHARED_SPREAD / 2, (ax.get_title(), c.get_label())
    assert any(a.get_ylabel() == "KL(FP ‖ Q) (nats/token) (log)" for a in fig.axes)  # positive: one log axis
    # the LR is drawn, with its axis, on every panel, not only the right-hand ones
    data_axes = [a for a in fig.axes if a.get_ylabel() and a.get_ylabel() != "LR"]
    assert sum(1 for a in fig.axes if a.get_ylabel() == "LR") == len(data_axes) >= 6
    assert lr_axes_without_scale(fig) == [] and clipped_texts(fig) == [] and overlapping_texts(fig) == []
    kl = next(a for a in fig.axes if a.get_ylabel().startswith("KL"))
    lo, hi = kl.get_ylim()
    assert math.log10(hi / lo) > figures.MINOR_LABEL_DECADES  # 3 decades: the powers of ten alone are labelled


def test_public_trajectories_follow_the_rule_too(tmp_path, laid_out):
    """A public trajectory whose quantizers differ 100x with a value below zero: Δ CE in panels of their own."""
    from test_presets import REPO, _rows_of

    from quantdyn.report.public_trajectories import error_vs_tokens

    rows = _rows_of("pythia-160m", ("step1000", "step36000", "step72000", "step143000"))
    for r in rows:
        if r["quantizer"] == "gptq3":
            r["delta_ce"] *= 100
    rows[0]["delta_ce"] = -0.001
    error_vs_tokens(rows, REPO, tmp_path / "pythia")
    fig = laid_out["pythia"]
    dce = [a for a in fig.axes if a.get_ylabel() == "Δ CE (nats)"]
    assert sorted(t.get_text() for a in dce for t in a.get_legend().get_texts()) == ["gptq3", "rtn4"]
    assert clipped_texts(fig) == [] and lr_axes_without_scale(fig) == []
