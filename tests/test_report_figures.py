"""Report figures on rows built here: metric panels, one colour per quantizer/branch in every figure,
page-sized PNG (print dpi) + valid SVG, and error bars = the combined uncertainty of repeated quantizations."""
from __future__ import annotations

import math
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
from matplotlib.colors import to_hex
from PIL import Image

from quantdyn.report import figures, output, uncertainty
from quantdyn.report.accuracy import accuracy_vs_dce
from quantdyn.report.palette import QUANTIZER_COLORS, Palette, hashed_color, quantizer_color
from quantdyn.results import stats
from quantdyn.runs import control_of

QUANTIZERS = {"gptq3": (3, "gptq", 0.3), "rtn4": (4, "rtn", 0.1), "rtn2": (2, "rtn", 2.0)}


def lr_at(step: int) -> float:
    return 3e-3 if step <= 300 else 3e-3 * (400 - step) / 100


def study_rows(run: str = "demo", root: str = "/runs", repeats: int = 3, run_sd: float = 0.02, seed: int = 0,
               cooldown_from: int = 200) -> list[dict]:
    """A WSD run (main steps 100..400, decaying after 300), one cooldown branch from ``cooldown_from`` with its
    constant-LR control, FP + PTQ rows of three quantizers with every stored metric; GPTQ rows repeat their
    quantization ``repeats`` times (delta_ce_run_sd = run_sd * scale), RTN rows do not (R = 1)."""
    rows = []
    pts = [("main", "checkpoint", s, None) for s in (100, 200, 300, 400)]
    pts += [(f"cooldown-s{cooldown_from}-d100-linear", "cooldown", cooldown_from + 100, cooldown_from),
            (f"control-s{cooldown_from}-d100", "control", cooldown_from + 100, cooldown_from)]
    for k, (branch, kind, step, parent) in enumerate(pts):
        decaying = branch.startswith("cooldown") or (branch == "main" and step > 300)
        ce_fp = 5.0 - math.log10(step) - (0.1 if decaying else 0.0)
        where = "checkpoints" if branch == "main" else f"branches/{branch}"
        base = {"run": run, "branch": branch, "ckpt_kind": kind, "checkpoint": f"{root}/{run}/{where}/step-{step:07d}",
                "step": step, "tokens": step * 1000, "lr": 0.0 if branch.startswith("cooldown") else lr_at(step),
                "decaying": decaying, "peak_lr": 3e-3, "seed": seed, "parent_step": parent,
                "eval_hash": "evalhash0001", "calib_hash": "calibhash001", "data_key": "datakey-0abc",
                "git_sha": "0123456789ab", "hardware": "cpu test x2", "time": f"2026-01-01T00:00:{k:02d}"}
        rows.append({**base, "key": f"{run}-{branch}-{step}-fp", "kind": "fp", "ce_fp": ce_fp, "ce_fp_se": 0.01})
        for q, (bits, method, scale) in QUANTIZERS.items():
            d = scale * (1 + step / 400) * (1.4 if decaying else 1.0)
            se = 0.01 * scale
            R = repeats if method == "gptq" else 1
            sd = run_sd * scale if R > 1 else None
            wd = [d + se * math.sqrt(8) * (-1) ** i * (1 + i % 3) / 1.6 for i in range(8)]
            rows.append({**base, "key": f"{run}-{branch}-{step}-{q}", "kind": "ptq", "quantizer": q,
                         "quantizer_spec": q, "method": method, "bits": bits, "group_size": 128, "ce_fp": ce_fp,
                         "ce_q": ce_fp + d, "delta_ce": d, "delta_ce_se": se, "rel_delta_ce": d / ce_fp,
                         "delta_ppl": math.exp(ce_fp + d) - math.exp(ce_fp), "kl": 0.8 * d, "kl_se": 0.8 * se,
                         "top1_agree": 1 / (1 + d), "n_windows": 8, "window_delta": wd,
                         "quant_config_hash": f"cfg-{q}", "compute_dtype": "float32", "quant_repeats": R,
                         "delta_ce_run_sd": sd, "kl_run_sd": 0.8 * sd if sd else None,
                         "delta_ce_total_se": math.sqrt(se ** 2 + (sd or 0.0) ** 2 / R)})
    return rows


@pytest.fixture
def drawn(monkeypatch):
    """Keep every figure the report modules save: {file stem: Figure}."""
    kept = {}
    real = output.save_figure

    def keep(fig, out, **kw):
        kept[output.figure_stem(out).name] = fig
        return real(fig, out, **kw)

    for mod in ("quantdyn.report.figures", "quantdyn.report.accuracy", "quantdyn.report.public_trajectories"):
        monkeypatch.setattr(f"{mod}.save_figure", keep)
    return kept


def line_colors(fig) -> dict[str, set[str]]:
    """Legend label -> colours of the data lines/markers carrying it, over every panel of ``fig``."""
    out: dict[str, set[str]] = {}
    for ax in fig.axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            line = handle[0] if isinstance(handle, tuple) or hasattr(handle, "lines") else handle
            out.setdefault(label, set()).add(to_hex(line.get_color()))
    return out


def errorbar_halfwidths(ax, label: str) -> list[float]:
    """Half the length of each error bar of the errorbar series ``label`` on ``ax``."""
    for c in ax.containers:
        if c.get_label() == label and getattr(c, "has_yerr", False):
            segs = c.lines[2][0].get_segments()
            return [abs(s[1][1] - s[0][1]) / 2 for s in segs]
    raise AssertionError(f"no error bars labelled {label}")


# --------------------------------------------------------------------------- palette
def test_quantizer_colors_are_fixed_for_common_labels_and_hashed_stably_for_others():
    assert quantizer_color("gptq3") == QUANTIZER_COLORS["gptq3"] == "#d62728"
    common = [quantizer_color(q) for q in QUANTIZER_COLORS]
    assert len(set(common)) == len(common)  # the table has one colour per label
    odd = ["rtn4g64", "gptq4-gptqmodel", "awq4-sym"]
    assert all(quantizer_color(q) == hashed_color(q) and quantizer_color(q) not in common for q in odd)
    assert len({quantizer_color(q) for q in odd}) == 3
    # the same in another interpreter with another string-hash salt: across reports
    code = "from quantdyn.report.palette import quantizer_color as c; print([c(q) for q in %r])" % odd
    seen = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": s}).stdout.strip() for s in ("1", "2")}
    assert seen == {str([quantizer_color(q) for q in odd])}


def test_deployment_formats_drawn_together_get_colours_told_apart():
    """The formats study draws q4_k_m, q3_k_m, fp8, nf4, nvfp4 and gptq4 in one panel: hashed colours put fp8 and
    q3_k_m on the same purple (2026-11-24), so every registered format has a fixed colour, and those drawn together
    (a study's set; a format and its -imatrix variant) differ by a clear RGB distance."""
    from quantdyn.quantize.catalogue import QUANTIZERS

    formats = [q for q in QUANTIZERS if q not in ("awq", "gptq", "rtn")]
    assert all(q in QUANTIZER_COLORS for q in formats if not q.endswith("-imatrix"))

    def rgb(c):
        return [int(c[i:i + 2], 16) for i in (1, 3, 5)]

    def dist(a, b):
        return sum((x - y) ** 2 for x, y in zip(rgb(quantizer_color(a)), rgb(quantizer_color(b)))) ** 0.5

    together = ["q4_k_m", "q3_k_m", "fp8", "nf4", "nvfp4", "gptq4", "rtn4", "gptq3", "rtn3", "mxfp4", "q8_0"]
    closest = min(dist(a, b) for i, a in enumerate(together) for b in together[i + 1:])
    assert closest > 60, closest
    assert all(dist(q, f"{q}-imatrix") > 60 for q in ("q4_k_m", "q3_k_m", "q4_k", "q2_k", "q6_k"))


def test_branch_palette_orders_cooldowns_and_gives_controls_their_twins_colour():
    names = ["main", "cooldown-s400-d100-linear", "control-s400-d100", "cooldown-s200-d100-linear",
             "control-s200-d100", "lawa-k3-p10", "soup"]
    p = Palette.for_branches(names)
    assert p.branch("main") == "#000000"
    assert p.branch("control-s200-d100") == p.branch("cooldown-s200-d100-linear")
    assert p.branch("control-s400-d100") == p.branch("cooldown-s400-d100-linear")
    assert p.branch("cooldown-s200-d100-linear") != p.branch("cooldown-s400-d100-linear")
    assert len({p.branch(b) for b in names}) == 5  # main, two cooldown pairs, lawa, soup
    assert Palette.for_branches(reversed(names)).branches == p.branches  # order of appearance does not matter
    assert control_of("cooldown-s8-d4-linear") == "control-s8-d4"


def test_same_quantizer_and_branch_colours_in_every_figure(tmp_path, drawn):
    rows = study_rows()
    pal = Palette.for_rows(rows)
    figures.trajectory(rows, "demo", [], tmp_path / "traj.png", pal)
    figures.rainbow(rows, "demo", tmp_path / "rainbow.png", pal)
    figures.loss_vs_dce(rows, tmp_path / "loss.png", color_key="branch", palette=pal)
    acc = [{"kind": "accuracy", "checkpoint_hash": "h", "quantizer": q, "task": "t", "acc_drop": 0.01,
            "acc_fp": 0.5, "acc_q": 0.49, "acc_drop_se": 0.005} for q in QUANTIZERS]
    ptq = [{**r, "checkpoint_hash": "h"} for r in rows if r["kind"] == "ptq" and r["step"] == 400
           and r["branch"] == "main"]
    accuracy_vs_dce(acc + ptq, tmp_path / "acc.png")
    traj, rain, loss, accf = (line_colors(drawn[k]) for k in ("traj", "rainbow", "loss", "acc"))
    for q in QUANTIZERS:  # a quantizer's colour: the trajectory panels and the accuracy figure
        assert traj[q] == accf[q] == {quantizer_color(q)}
    cd, ctl = "cooldown-s200-d100-linear", "control-s200-d100"
    assert rain[cd] == loss[cd] == {pal.branch(cd)}  # a branch's colour: rainbow and loss-vs-ΔCE
    assert rain[f"{ctl} (constant LR)"] == loss[ctl] == {pal.branch(cd)}  # the control wears its twin's colour
    assert rain["main run"] == loss["main"] == {"#000000"}
    assert_page_figures(tmp_path, ("traj", "rainbow", "loss", "acc"))


def assert_page_figures(where, stems) -> None:
    """Each figure: a page-wide PNG at print dpi, not a strip, no taller than a page; and a valid SVG."""
    for stem in stems:
        png, svg = where / f"{stem}.png", where / f"{stem}.svg"
        with Image.open(png) as im:
            w, h = im.size
            dpi = im.info.get("dpi", (0, 0))[0]
        assert round(dpi) >= 200 and w == round(output.PAGE_WIDTH * output.PRINT_DPI), (stem, w, dpi)
        assert 0.3 < h / w and h <= output.MAX_HEIGHT * output.PRINT_DPI, (stem, w, h)
        root = ET.parse(svg).getroot()
        assert root.tag == "{http://www.w3.org/2000/svg}svg" and float(root.get("width").removesuffix("pt")) > 500
        assert b"<dc:date>" not in svg.read_bytes()  # no date: the same figure gives the same file
    assert not list(where.glob(".*"))  # no temporaries left behind


# --------------------------------------------------------------------------- panels, sizes, files
def test_trajectory_panels_tables_and_combined_error_bars(tmp_path, drawn):
    """One panel per metric, the table behind it with every metric, and Δ CE error bars = the combined
    uncertainty sqrt(SE² + SD²/R) of repeated quantizations."""
    rows = study_rows(repeats=4, run_sd=0.05)
    table = figures.trajectory(rows, "demo", [(t, lr_at(t // 1000)) for t in range(0, 400_001, 10_000)],
                               tmp_path / "traj.png")
    fig = drawn["traj"]
    labels = [ax.get_ylabel() for ax in fig.axes if ax.get_ylabel() and ax.get_ylabel() != "LR"]
    assert labels[0] == "FP loss (nats)"
    assert [lab.removesuffix(" (log)") for lab in labels[1:]] == [m.label for m in figures.METRICS]
    assert "Δ CE (nats) (log)" in labels  # rtn2 and rtn4 differ by 20x+: one log axis shows both
    assert labels[-1] == "top-1 agreement with FP"  # never on a log scale
    q = [t for t in table if t["quantizer"] == "gptq3"]
    assert len(q) == 4 and len([t for t in table if t["quantizer"] == "FP"]) == 4
    src = {r["step"]: r for r in rows if r["kind"] == "ptq" and r["quantizer"] == "gptq3" and r["branch"] == "main"}
    for t in q:
        r = src[t["step"]]
        for k in ("delta_ce", "rel_delta_ce", "delta_ppl", "kl", "top1_agree", "delta_ce_run_sd",
                  "delta_ce_total_se", "quant_repeats"):
            assert t[k] == r[k], k
        assert t["uncertainty_dominant"] == stats.RUN  # SD 0.015 / √4 > SE 0.003
    ax = next(a for a in fig.axes if a.get_ylabel().startswith("Δ CE (nats)"))
    main = sorted((r for r in rows if r["kind"] == "ptq" and r["branch"] == "main"), key=lambda r: r["step"])
    for qq in QUANTIZERS:
        mine = [r for r in main if r["quantizer"] == qq]
        want = [math.sqrt(r["delta_ce_se"] ** 2 + (r["delta_ce_run_sd"] or 0) ** 2 / r["quant_repeats"]) for r in mine]
        assert errorbar_halfwidths(ax, qq) == pytest.approx(want, rel=1e-6), qq
    gptq = [r for r in main if r["quantizer"] == "gptq3"]
    assert all(stats.total_se(r) > 2 * r["delta_ce_se"] for r in gptq)  # the run-to-run part counts


def test_save_figure_keeps_dots_inside_names(tmp_path):
    import matplotlib.pyplot as plt

    paths = output.save_figure(plt.figure(figsize=(2, 2)), tmp_path / "trajectory_EleutherAI_pythia-1.4b")
    assert [p.name for p in paths] == ["trajectory_EleutherAI_pythia-1.4b.png", "trajectory_EleutherAI_pythia-1.4b.svg"]


# --------------------------------------------------------------------------- uncertainty
def test_total_se_from_parts_when_not_stored_and_eval_se_alone_without_repeats():
    r = {"delta_ce": 0.5, "delta_ce_se": 0.003, "quant_repeats": 4, "delta_ce_run_sd": 0.02}
    assert stats.total_se(r) == pytest.approx(math.sqrt(0.003 ** 2 + 0.02 ** 2 / 4))
    assert stats.uncertainty(r).dominant == stats.RUN and stats.uncertainty(r).run_se == pytest.approx(0.01)
    assert stats.total_se({**r, "delta_ce_total_se": 0.5}) == 0.5  # the writer's own combination wins
    assert stats.total_se({"delta_ce_se": 0.003}) == 0.003  # older rows: R = 1
    one = stats.uncertainty({"delta_ce_se": 0.003, "quant_repeats": 1, "delta_ce_run_sd": None})
    assert one.run_sd is None and one.dominant == stats.EVAL
    kl = {"kl_se": 0.001, "kl_run_sd": 0.004, "quant_repeats": 4}
    assert stats.total_se(kl, "kl") == pytest.approx(math.sqrt(0.001 ** 2 + 0.004 ** 2 / 4))


def test_decayed_minus_control_z_uses_the_combined_uncertainty():
    rows = study_rows(repeats=3, run_sd=0.05)
    table = {t["quantizer"]: t for t in figures.rainbow_table(rows, "demo")}
    end = {(r["quantizer"], r["branch"]): r for r in rows if r["kind"] == "ptq" and r["step"] == 300}
    g = table["gptq3"]
    a, b = end[("gptq3", "cooldown-s200-d100-linear")], end[("gptq3", "control-s200-d100")]
    diffs = [x - y for x, y in zip(a["window_delta"], b["window_delta"])]
    m = sum(diffs) / len(diffs)
    eval_se = math.sqrt(sum((x - m) ** 2 for x in diffs) / (len(diffs) - 1) / len(diffs))
    run_se = math.sqrt(a["delta_ce_run_sd"] ** 2 / 3 + b["delta_ce_run_sd"] ** 2 / 3)
    assert g["difference"] == pytest.approx(a["delta_ce"] - b["delta_ce"])
    assert g["difference_eval_se"] == pytest.approx(eval_se) and g["difference_run_se"] == pytest.approx(run_se)
    assert g["difference_se"] == pytest.approx(math.hypot(eval_se, run_se))
    assert g["z"] == pytest.approx(g["difference"] / g["difference_se"]) and g["dominant"] == stats.RUN
    assert g["exceeds_uncertainty"] == (abs(g["z"]) > 2)
    r = table["rtn4"]  # not repeated: the evaluation windows alone
    assert r["difference_run_se"] is None and r["difference_se"] == r["difference_eval_se"]
    assert r["dominant"] == stats.EVAL
    # a difference that clears the window SE but not the run-to-run spread is not claimed
    noisy = study_rows(repeats=3, run_sd=2.0)
    g2 = next(t for t in figures.rainbow_table(noisy, "demo") if t["quantizer"] == "gptq3")
    assert abs(g2["difference"]) > 2 * g2["difference_eval_se"] and not g2["exceeds_uncertainty"]
    note = uncertainty.note(list(table.values()))
    assert "gptq3 (R = 3): the run-to-run part is the larger at 1 of 1 points" in note
    assert "rtn4, rtn2: not repeated (R = 1)" in note


def test_uncertainty_note_groups_quantizers_and_names_deterministic_repeats():
    def pt(q, R, sd, dom):
        return {"quantizer": q, "quant_repeats": R, "delta_ce_run_sd": sd, "uncertainty_dominant": dom}

    table = [pt("rtn4", 2, 0.0, stats.EVAL), pt("rtn3", 2, 0.0, stats.EVAL),
             pt("gptq3", 2, 0.01, stats.RUN), pt("gptq3", 2, 0.001, stats.EVAL),
             pt("gptq4", 2, 0.02, stats.RUN), pt("gptq4", 2, 0.002, stats.EVAL),
             pt("awq4", 1, None, stats.EVAL)]
    note = uncertainty.note(table)
    assert "rtn4, rtn3 (R = 2): no run-to-run spread (the repeats agree exactly)" in note  # RTN: no calibration
    assert "gptq3, gptq4 (R = 2): the run-to-run part is the larger at 1 of 2 points" in note
    assert "awq4: not repeated (R = 1), evaluation SE only" in note
    assert uncertainty.note([{"quantizer": "x", "delta_ce": 1.0}]) == ""  # a table without uncertainty columns


def test_error_maps_are_left_out_for_old_rows_and_drawn_for_new_ones(tmp_path):
    """Rows written before issue 29 carry no floor, block maps or confidence histogram: no band, no heat map, no
    KL-by-confidence figure, no error. The same rows with those fields get all three."""
    from quantdyn.report import error_maps

    old = study_rows()
    assert error_maps.sections(old, tmp_path) == []
    fp = [r for r in old if r["kind"] == "fp" and r["branch"] == "main"]
    series = {q: [r for r in old if r.get("quantizer") == q and r["branch"] == "main"] for q in QUANTIZERS}
    table = figures.metric_panels(fp, series, [], tmp_path / "old.png", "old rows")
    assert not any(t["quantizer"] == "bf16 noise floor" for t in table)
    new = []
    for r in old:
        extra = {}
        if r["kind"] == "fp":
            extra = {"floor_delta_ce": 0.001, "floor_delta_ce_se": 0.0002, "floor_kl": 1e-4, "floor_kl_se": 1e-5,
                     "floor_top1_agree": 0.99, "floor_block_rel_fro": [0.002, 0.003, 0.004]}
        elif r["kind"] == "ptq":
            extra = {"block_rel_fro": [0.01 * r["bits"], 0.02, 0.03], "kl_by_confidence": [0.3, 0.2, 0.1, 0.05, None],
                     "confidence_fraction": [0.1, 0.2, 0.3, 0.4, 0.0]}
        new.append({**r, **extra})
    found = {title: table for title, _, table, _ in error_maps.sections(new, tmp_path)}
    assert len(found) == 2 and all(found.values())
    heat = next(t for k, t in found.items() if "where in the network" in k)
    assert {t["quantizer"] for t in heat} == {*QUANTIZERS, "bf16 noise floor"} and heat[0]["block_2"] == 0.03
    kl = next(t for k, t in found.items() if "confidence" in k)
    assert {t["branch"] for t in kl} == {"cooldown-s200-d100-linear", "control-s200-d100"}
    fp = [r for r in new if r["kind"] == "fp" and r["branch"] == "main"]
    table = figures.metric_panels(fp, series, [], tmp_path / "new.png", "new rows")
    floor_rows = [t for t in table if t["quantizer"] == "bf16 noise floor"]
    assert len(floor_rows) == len(fp) and floor_rows[0]["floor_kl"] == 1e-4
