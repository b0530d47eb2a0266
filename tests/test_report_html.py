"""The HTML report end to end on stores built here: every figure's CSV and SVG linked beside it, the provenance
block, the uncertainty statements, and a monitored run (metrics.jsonl) beside the sweep's figure."""
from __future__ import annotations

import csv
import json
import math
import re
import xml.etree.ElementTree as ET
from importlib import metadata

import pytest
from conftest import tiny_run_dict
from test_report_figures import drawn, errorbar_halfwidths, line_colors, study_rows  # noqa: F401  (drawn: a fixture)

from quantdyn.report import figures
from quantdyn.report.html import write_page
from quantdyn.report.monitored import monitored_points
from quantdyn.report.palette import quantizer_color
from quantdyn.results.stats import rel_delta_ce
from quantdyn.results.store import ResultStore
from quantdyn.runtime import git_sha, hardware
from quantdyn.train.checkpoint import read_metrics


def sections_of(page: str) -> list[dict]:
    """Title, image, links and uncertainty note of each figure section of a report page."""
    out = []
    for m in re.finditer(r"<section id='s\d+'>(.*?)</section>", page, re.S):
        body = m.group(1)
        out.append({"title": re.search(r"<h2>(.*?)</h2>", body).group(1),
                    "img": (re.search(r"<img src='([^']+)'", body) or [None, None])[1],
                    "links": re.findall(r"<a href='([^']+)'", body),
                    "note": (re.search(r"<p class='unc'>(.*?)</p>", body) or [None, ""])[1]})
    return out


def read_csv(path) -> tuple[list[str], list[dict]]:
    with open(path, newline="") as f:
        r = csv.DictReader(f)
        return list(r.fieldnames), list(r)


def test_report_links_csv_and_svg_beside_every_figure_and_lists_provenance(tmp_path):
    rows = study_rows(root=str(tmp_path / "runs"))
    rows += [{**r, "key": r["key"] + "-x", "eval_hash": "evalhash0002", "git_sha": "fedcba987654",
              "hardware": "NVIDIA H100 x1"} for r in rows if r["kind"] == "ptq" and r["step"] == 400][:2]
    ResultStore(tmp_path / "st").append(rows)
    page = write_page(tmp_path / "st", tmp_path / "rep").read_text()
    rep = tmp_path / "rep"
    secs = sections_of(page)
    assert [s["title"] for s in secs][:3] == ["Run demo: loss and quantization error along training",
                                              "Run demo: cooldown branches vs constant-LR controls",
                                              "Δ CE against full-precision loss"]
    assert all(s["img"] for s in secs)
    for s in secs:
        stem = s["img"].removesuffix(".png")
        assert s["links"] == [f"{stem}.png", f"{stem}.svg", f"{stem}.csv"], s
        assert (rep / s["img"]).stat().st_size > 0
        assert ET.parse(rep / f"{stem}.svg").getroot().tag.endswith("svg")
        cols, body = read_csv(rep / f"{stem}.csv")
        assert body and f"{len(body)} rows, {len(cols)} columns" in page
    cols, body = read_csv(rep / "trajectory_demo.csv")
    assert {"quantizer", "step", "tokens", "lr", "ce_fp", "delta_ce", "delta_ce_se", "delta_ce_run_sd", "quant_repeats",
            "delta_ce_total_se", "uncertainty_dominant", "rel_delta_ce", "delta_ppl", "kl", "top1_agree"} <= set(cols)
    g = [b for b in body if b["quantizer"] == "gptq3"]
    src = {r["step"]: r for r in rows if r["kind"] == "ptq" and r["quantizer"] == "gptq3" and r["branch"] == "main"
           and r["eval_hash"] == "evalhash0001"}
    assert [b["eval_hash"] for b in g] == ["evalhash0001"] * 4 + ["evalhash0002"]  # the second set's point is marked
    assert all(float(b["delta_ce_total_se"]) == src[int(b["step"])]["delta_ce_total_se"] for b in g[:4])
    cols, body = read_csv(rep / "rainbow_demo.csv")
    assert {"difference", "difference_eval_se", "difference_run_se", "difference_se", "z", "exceeds_uncertainty",
            "dominant"} <= set(cols)
    # provenance: what wrote the report, and every hash of the rows
    start = page.index("<section id='provenance'>")
    prov = page[start:page.index("</section>", start)]
    assert page.index("<section id='contents'>") < page.index("<section id='uncertainty'>") < start  # at the end
    for v in ("evalhash0001", "evalhash0002", "calibhash001", "datakey-0abc", "cfg-gptq3", "cfg-rtn4", "cfg-rtn2",
              "0123456789ab", "fedcba987654", "cpu test x2", "NVIDIA H100 x1", metadata.version("quantdyn"), git_sha(),
              hardware()):
        assert v in prov, v
    assert "⚠ mixed sets" in prov and "evaluation set hashes" in prov
    js = json.loads((rep / "provenance.json").read_text())
    assert {x["value"] for x in js["fields"]["eval_hash"]} == {"evalhash0001", "evalhash0002"}
    assert {x["value"]: x["rows"] for x in js["fields"]["quant_repeats"]} == {"3": 7, "1": 13}  # 6 points x 3 + 2
    # each config hash names the quantizer labels of the rows that carry it
    assert {x["value"]: x["quantizers"] for x in js["fields"]["quant_config_hash"]} == {
        "cfg-gptq3": ["gptq3"], "cfg-rtn4": ["rtn4"], "cfg-rtn2": ["rtn2"]}
    assert js["rows"] == len(rows) and js["git_commit"] == git_sha()
    # uncertainty: said for the whole report and per figure, with the part that dominates
    assert "the run-to-run part dominates in 7 of 20 PTQ rows, the evaluation windows in 13" in page
    traj = next(s for s in secs if s["img"] == "trajectory_demo.png")
    assert "gptq3 (R = 3): the run-to-run part is the larger at 5 of 5 points" in traj["note"]
    assert "rtn4, rtn2: not repeated (R = 1), evaluation SE only" in traj["note"]


def test_without_repeats_the_report_says_the_error_bars_miss_the_run_to_run_spread():
    from quantdyn.report.html import _uncertainty_summary
    from quantdyn.report.uncertainty import note

    rows = study_rows(repeats=1)
    assert "No row repeats its quantization (R = 1)" in _uncertainty_summary(rows)
    table = figures.rainbow_table(rows, "demo")
    assert all(t["difference_run_se"] is None and t["difference_se"] == t["difference_eval_se"] for t in table)
    assert note(table).startswith("Uncertainty: no point repeats its quantization (R = 1)")


def test_monitored_points_accept_both_key_styles():
    metrics = [
        {"step": 4, "tokens": 512, "lr": 1e-3, "train_loss": 5.0},
        {"step": 8, "tokens": 1024, "lr": 1e-3, "val_loss": 4.5, "dce_gptq4g128": 0.2, "dce_gptq4g128_se": 0.01,
         "dce_rtn2": 1.0, "dce_rtn2_se": 0.05, "ptq/rtn2/delta_ce": 1.1, "ptq/rtn2/kl": 0.9},
        {"step": 12, "tokens": 1536, "lr": 5e-4, "ptq/rtn2/delta_ce": 1.2, "ptq/rtn2/delta_ce_se": 0.04},
    ]
    fp, series, lr = monitored_points(metrics)
    assert fp == [{"step": 8, "tokens": 1024, "lr": 1e-3, "ce_fp": 4.5}]
    assert lr == [(512, 1e-3), (1024, 1e-3), (1536, 5e-4)]
    assert sorted(series) == ["gptq4", "rtn2"]  # gptq4g128 is gptq4's canonical label: its colour
    assert series["gptq4"][0]["quantizer_spec"] == "gptq4g128" and series["gptq4"][0]["delta_ce_se"] == 0.01
    r8, r12 = series["rtn2"]
    assert (r8["delta_ce"], r8["delta_ce_se"], r8["kl"]) == (1.1, 0.05, 0.9)  # ptq/ wins, dce_ fills in
    assert (r12["step"], r12["delta_ce"], r12["delta_ce_se"]) == (12, 1.2, 0.04)


@pytest.mark.e2e
def test_report_of_a_monitored_run_beside_its_sweep(tmp_path, kjv_small, cli, monkeypatch, drawn):  # noqa: F811
    """`quantdyn report RUN_DIR` of a run trained with the in-training monitor: Δ CE against steps with the LR
    from metrics.jsonl alone, then beside the sweep's figure once the store has rows of the run."""
    from quantdyn.config import from_dict
    from quantdyn.train.config import RunConfig
    from quantdyn.train.trainer import train

    d = tiny_run_dict(tmp_path / "runs", kjv_small[0], steps=8, checkpoint_every=4, eval_every=4)
    d["name"] = "mon"
    d["monitor"] = {"every": 4, "quantizers": ["rtn2", "gptq3"], "calib_samples": 4, "eval_windows": 8}
    from quantdyn.monitor import hooks_for

    cfg = from_dict(RunConfig, d)
    run = train(cfg, progress=False, hooks=hooks_for(cfg))  # what `quantdyn train` does
    monkeypatch.chdir(tmp_path)  # the default store, results, does not exist here
    res = cli("report", run, "--out", tmp_path / "rep")
    assert res.returncode == 0, res.stderr
    page = (tmp_path / "rep" / "index.html").read_text()
    (sec,) = sections_of(page)
    assert sec["title"] == "Run mon: quantization error monitored during training"
    cols, body = read_csv(tmp_path / "rep" / "monitored_mon.csv")
    logged = [r for r in read_metrics(run) if "ptq/rtn2/delta_ce" in r]
    assert [int(b["step"]) for b in body if b["quantizer"] == "rtn2"] == [r["step"] for r in logged] == [4, 8]
    assert [float(b["delta_ce"]) for b in body if b["quantizer"] == "rtn2"] == [r["ptq/rtn2/delta_ce"] for r in logged]
    assert [float(b["ce_fp"]) for b in body if b["quantizer"] == "FP"] == [r["val/loss"] for r in logged]
    mon_fig = drawn["monitored_mon"]
    ax = next(a for a in mon_fig.axes if a.get_ylabel().startswith("Δ CE"))
    labels = [a.get_ylabel() for a in mon_fig.axes]
    panels = [x for x in labels if x and x != "LR"]
    assert "Δ CE (nats)" in panels and "FP loss (nats)" in panels
    # the LR overlaid on every panel, each with its own LR axis
    assert labels.count("LR") == len(panels)
    assert any(a.get_xlabel() == "tokens" for a in mon_fig.axes)  # on the bottom row, with steps on a second axis
    assert any(c.get_xlabel() == "step" for a in mon_fig.axes for c in a.child_axes)
    assert errorbar_halfwidths(ax, "rtn2") == pytest.approx([r["ptq/rtn2/delta_ce_se"] for r in logged])
    # the sweep's rows of the same run: its figure first, the monitored one beside it, same colours
    sweep = [{**r, "checkpoint": str(run / "checkpoints" / f"step-{r['step']:07d}"), "run": "mon",
              "key": "m" + r["key"]} for r in study_rows() if r["branch"] == "main"]
    ResultStore(tmp_path / "results").append(sweep)
    assert cli("report", run, "--out", tmp_path / "rep2").returncode == 0
    titles = [s["title"] for s in sections_of((tmp_path / "rep2" / "index.html").read_text())]
    assert titles[:2] == ["Run mon: loss and quantization error along training",
                          "Run mon: quantization error monitored during training"]
    sweep_colors, mon_colors = line_colors(drawn["trajectory_mon"]), line_colors(drawn["monitored_mon"])
    for q in ("rtn2", "gptq3"):
        assert sweep_colors[q] == mon_colors[q] == {quantizer_color(q)}


def test_report_of_a_run_with_neither_rows_nor_monitor_is_one_line(tmp_path, cli):
    run = tmp_path / "r"
    run.mkdir()
    (run / "config.yaml").write_text("name: r\n")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "tokens": 8, "lr": 1e-3}) + "\n")
    (tmp_path / "st").mkdir()  # a store without rows
    res = cli("report", run, "--store", tmp_path / "st", "--out", tmp_path / "rep")
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1
    assert "no result rows" in res.stderr and "monitor" in res.stderr and not (tmp_path / "rep").exists()


def test_trajectory_sections_of_public_runs_still_link_their_files(tmp_path):
    """A public-trajectory run whose name has a dot (pythia-1.4b): the PNG the section names is the one written."""
    rows = [{**r, "run": "EleutherAI/pythia-1.4b", "ckpt_kind": "hub", "checkpoint": f"EleutherAI/pythia-1.4b@step{r['step']}"}
            for r in study_rows() if r["kind"] == "ptq" and r["branch"] == "main"]
    from quantdyn.report import public_trajectories

    secs = public_trajectories.sections(rows, tmp_path)
    assert secs and all((tmp_path / png).is_file() for _, png, _, _ in secs)
    assert math.isclose(rel_delta_ce({**rows[0], "rel_delta_ce": None}), rows[0]["delta_ce"] / rows[0]["ce_fp"])


def test_sections_from_the_caller_come_first_with_their_csv(tmp_path):
    """A study's findings tables handed to write_page, without a figure or showing one of the report's own:
    shown first, each with a CSV of its own table (never overwriting the figure's own CSV)."""
    ResultStore(tmp_path / "st").append(study_rows())
    table = [{"finding": "decay raises Δ CE", "quantizer": "gptq3", "effect": 0.05, "se": 0.01, "verdict": "reproduced"}]
    page = write_page(tmp_path / "st", tmp_path / "rep",
                        extra_sections=[("Findings: the papers' claims at this scale", "", table, "Each finding."),
                                        ("Findings, decay", "rainbow_demo.png", table[:1] * 2, "The decay finding.")]
                        ).read_text()
    first, second = sections_of(page)[:2]
    assert first["img"] is None and first["title"] == "Findings: the papers&#x27; claims at this scale"
    assert first["links"] == ["findings_the_papers_claims_at_this_scale.csv"]
    cols, body = read_csv(tmp_path / "rep" / "findings_the_papers_claims_at_this_scale.csv")
    assert cols == list(table[0]) and body[0]["verdict"] == "reproduced"
    assert second["img"] == "rainbow_demo.png"
    assert second["links"] == ["rainbow_demo.png", "rainbow_demo.svg", "findings_decay.csv"]
    assert len(read_csv(tmp_path / "rep" / "findings_decay.csv")[1]) == 2
    assert "difference_se" in read_csv(tmp_path / "rep" / "rainbow_demo.csv")[0]  # the rainbow's own table
