"""`quantdyn ship`: the decision logic against hand-computed paired numbers, the screen, the quantizations a budget
allows, every bad input as one line before anything is written, and (e2e) the whole command on a tiny run: a kill -9
in the middle loses nothing, a rerun finishes, a second ship measures nothing."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from quantdyn.errors import QuantdynError
from quantdyn.ship.decide import Option, decide, naive_quantizer, paired, screen

A = np.array([1.0, 2.0, 3.0, 4.0])
B = np.array([1.5, 2.1, 3.4, 4.2])  # B - A per window: 0.5, 0.1, 0.4, 0.2


def _opt(name, q, bpw, w, how="checkpoint", uniform=True):
    return Option(name, q, bpw, np.asarray(w, dtype=np.float64), how, None, uniform)


def test_paired_difference_is_the_se_of_per_window_differences():
    d = paired(_opt("b", "q", 4, B), _opt("a", "q", 4, A))
    # by hand: mean 0.3; deviations 0.2, -0.2, 0.1, -0.1 -> s^2 = 0.10 / 3; SE = sqrt(s^2 / 4)
    assert d.difference == pytest.approx(0.3, abs=1e-12)
    assert d.eval_se == pytest.approx(math.sqrt(0.10 / 3 / 4), rel=1e-12)
    assert d.paired and d.run_se is None
    # unpaired, each option's own SE is far larger (the windows' difficulty does not cancel)
    assert _opt("a", "q", 4, A).ce_q_se == pytest.approx(np.std(A, ddof=1) / 2, rel=1e-12)


def test_run_to_run_part_is_added_in_quadrature():
    a = Option("a", "q", 4, A, "checkpoint", 0.03)
    b = Option("b", "q", 4, B, "checkpoint", 0.04)
    d = paired(b, a)
    assert d.run_se == pytest.approx(0.05, rel=1e-12)
    assert d.se == pytest.approx(math.sqrt(0.10 / 12 + 0.05 ** 2), rel=1e-12)


def test_ties_ship_the_smaller_file_and_the_gain_is_paired_against_the_naive_choice():
    base = np.linspace(3.0, 4.0, 40)
    noise = np.tile([0.002, -0.002], 20)
    best = _opt("lawa-last3", "q5_0", 5.5, base, "lawa")
    tied = _opt("main/step-600", "q4_1", 5.0, base + 0.0002 + noise)  # +0.0002 ± 0.00032: z ~ 0.6, tied
    worse = _opt("main/step-600", "q4_0", 4.5, base + 0.05 + noise)  # resolved worse, though the smallest file
    dec = decide([best, tied, worse], naive=("main/step-600", "q4_0"))
    assert dec.best is best
    assert [o.key for o, _ in dec.tied] == [("main/step-600", "q4_1")]
    assert dec.chosen is tied  # tied with the best and the smaller file
    # gain = naive - chosen, paired: per window 0.05 - 0.0002 exactly, SE 0 up to rounding
    assert dec.gain.difference == pytest.approx(0.0498, abs=1e-12)
    assert dec.gain.eval_se < 1e-12
    assert dec.naive is worse


def test_among_tied_options_of_one_size_the_simpler_recipe_is_shipped():
    w = np.linspace(3.0, 4.0, 20)
    soup = _opt("soup-decayed", "q4_0", 4.5, w, "soup")
    ckpt = _opt("main/step-600", "q4_0", 4.5, w + np.tile([1e-4, -1e-4], 10) + 1e-5)
    plan = _opt("main/step-600", "auto@4.5", 4.5, w, "checkpoint", uniform=False)
    dec = decide([soup, plan, ckpt])
    assert dec.chosen is ckpt  # same size: checkpoint before soup, a uniform type before a plan
    assert {o.key for o, _ in dec.tied} | {dec.best.key} == {soup.key, ckpt.key, plan.key}


def test_naive_quantizer_is_the_fitting_type_closest_to_the_budget():
    bpw = {"q4_0": 4.5, "q4_1": 5.0, "q5_0": 5.5, "gptq3": 3.15625}
    assert naive_quantizer(bpw, 5.2) == "q4_1"
    assert naive_quantizer(bpw, 5.0) == "q4_1"
    assert naive_quantizer(bpw, 4.0) == "gptq3"
    assert naive_quantizer(bpw, 3.0) is None


def test_screen_drops_what_the_best_beats_at_z_above_2_and_keeps_the_naive_choice():
    w = np.linspace(3.0, 4.0, 16)
    noise = np.tile([0.001, -0.001], 8)
    best = _opt("a", "q4_0", 4.5, w)
    close = _opt("b", "q4_0", 4.5, w + 0.0001 + noise)  # z ~ 0.4
    far = _opt("c", "q4_0", 4.5, w + 0.01 + noise)  # z ~ 39
    naive = _opt("d", "q4_0", 4.5, w + 0.02 + noise)
    kept, dropped = screen([best, close, far, naive], keep=[("d", "q4_0")])
    assert [o.candidate for o in kept] == ["a", "b", "d"]
    assert [d.option.candidate for d in dropped] == ["c"]
    assert dropped[0].beaten_by is best and dropped[0].difference.z > 2
    assert "z = " in dropped[0].reason() and "c x q4_0" in dropped[0].reason()


def _tensors(width=32, blocks=2):
    from quantdyn.quantize.plan import ModelTensor

    out = []
    for b in range(blocks):
        for path, shape in (("attention.query_key_value", (3 * width, width)), ("attention.dense", (width, width)),
                            ("mlp.dense_h_to_4h", (4 * width, width)), ("mlp.dense_4h_to_h", (width, 4 * width))):
            out.append(ModelTensor(f"gpt_neox.layers.{b}.{path}", b, path, shape))
    return out


def test_quantizations_that_fit_the_budget_on_this_model():
    from quantdyn.ship.quantizations import plan_quantizations

    qs, notes = plan_quantizations(5.0, _tensors(), 2, "quantdyn-gpt")
    names = {q.name: q for q in qs}
    assert all(q.bits_per_weight <= 5.0 for q in qs if q.uniform)
    assert names["q4_0"].bits_per_weight == 4.5 and names["q4_0"].export_format == "gguf"
    assert names["gptq4"].export_format == "gptq"
    assert "q5_0" not in names and "q8_0" not in names  # 5.5 and 8.5 bits per weight
    assert "auto@5" in names and not names["auto@5"].uniform
    # rows of 32 weights: K-quants fall back to the legacy types they equal here -> measured once, said so
    assert any("measured once" in n for n in notes)
    only = plan_quantizations(5.0, _tensors(), 2, "quantdyn-gpt", formats=("gptq",), auto=False)[0]
    assert {q.export_format for q in only} == {"gptq"}


@pytest.mark.parametrize("width, budget, forced", [(128, 4.5, True), (128, 4.52, True), (128, 4.56, False),
                                                   (128, 5.0, False),
                                                   (32, 4.5, True), (256, 4.5, False)])
def test_a_plan_the_budget_forces_is_exactly_what_the_allocator_makes_whatever_the_sensitivity(width, budget, forced):
    """forced_assignment is exact: where it names one assignment, the allocator makes that one for any errors; where
    it does not, some errors make the allocator choose otherwise than every tensor in its cheapest type."""
    import math

    from quantdyn.quantize.allocate import allocate
    from quantdyn.quantize.catalogue import TensorSite
    from quantdyn.quantize.plan import forced_assignment, type_bits_per_weight

    types = ("q4_0", "q5_0", "q8_0", "q4_k", "q6_k")
    entries = [(t.name, t.block, t.path, tuple(t.shape)) for t in _tensors(width=width)]
    types = tuple(t for t in types if width % (256 if "_k" in t else 32) == 0)  # those every row holds
    n = sum(s[0] * s[1] for *_, s in entries)
    cost = {name: {t: round(type_bits_per_weight(t, s, TensorSite(p, b, 2, s)) * s[0] * s[1]) for t in types}
            for name, b, p, s in entries}
    got = forced_assignment(entries, 2, types, budget)
    assert (got is not None) == forced
    rng = np.random.default_rng(0)
    total = math.floor(budget * n + 1e-9)
    choices = set()
    for _ in range(20):  # random sensitivities, richer types mostly better: the allocator spends what it may
        curves = {name: {t: (c, float(rng.random()) / c) for t, c in cost[name].items()} for name in cost}
        choices.add(tuple(allocate(curves, total).choice[name] for name, *_ in entries))
    if forced:
        assert choices == {got}
    else:
        cheapest = tuple(min(cost[name], key=cost[name].get) for name, *_ in entries)
        assert any(c != cheapest for c in choices)


def test_an_auto_plan_the_budget_forces_to_a_measured_uniform_type_is_left_out_with_a_note():
    from quantdyn.ship.quantizations import plan_quantizations

    qs, notes = plan_quantizations(4.5, _tensors(width=128), 2, "quantdyn-gpt")
    assert "auto@4.5" not in {q.name for q in qs} and "q4_0" in {q.name for q in qs}
    assert any(n.startswith("auto@4.5 left out") and "q4_0 on every tensor" in n for n in notes)
    kept = plan_quantizations(4.5, _tensors(width=128), 2, "quantdyn-gpt", labels=("gptq4",))[0]
    assert "auto@4.5" in {q.name for q in kept}  # q4_0 not measured: the plan is
    assert "auto@5" in {q.name for q in plan_quantizations(5.0, _tensors(width=128), 2, "quantdyn-gpt")[0]}


@pytest.mark.parametrize("kw, msg", [
    (dict(budget=1.0), "the smallest available is gptq2 at 2."),
    (dict(budget=5.0, formats=("ggml",)), "did you mean 'gguf'"),
    (dict(budget=5.0, labels=("nf4",), formats=("gguf",)), "cannot be exported as gguf"),
    (dict(budget=0.0), "must be a positive number"),
])
def test_quantizations_refuse_bad_requests_in_one_line(kw, msg):
    from quantdyn.ship.quantizations import plan_quantizations

    budget = kw.pop("budget")
    with pytest.raises(QuantdynError, match=None) as e:
        plan_quantizations(budget, _tensors(), 2, "quantdyn-gpt", **kw)
    assert msg in str(e.value) and "\n" not in str(e.value)


# ------------------------------------------------------------------ the command line: bad input, nothing written


def _one_line_exit_2(r, msg):
    assert r.returncode == 2 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_bad_inputs_are_one_line_and_write_nothing(cli, tmp_path, tiny_checkpoint, hf_models):
    out, store = tmp_path / "out", tmp_path / "store"
    common = ["--out", out, "--store", store, "--eval-seq-len", 32, "--calib-seq-len", 32]
    _one_line_exit_2(cli("ship", tiny_checkpoint, "--budget", 1, *common), "smallest available is")
    _one_line_exit_2(cli("ship", tiny_checkpoint, "--budget", 5, "--formats", "onnx", *common), "export format 'onnx'")
    empty = tmp_path / "empty"
    empty.mkdir()
    _one_line_exit_2(cli("ship", empty, "--budget", 5, *common), "holds no checkpoints")
    _one_line_exit_2(cli("ship", tiny_checkpoint, hf_models["llama"], "--budget", 5, *common), "differ in model_type")
    _one_line_exit_2(cli("ship", tiny_checkpoint, "--budget", 5, "--out", out, "--store", store), "exceed the model's")
    afile = tmp_path / "afile"
    afile.write_text("x")
    _one_line_exit_2(cli("ship", tiny_checkpoint, "--budget", 5, "--out", afile / "sub", "--store", store,
                         "--eval-seq-len", 32, "--calib-seq-len", 32), "cannot write --out")
    assert not out.exists() and not store.exists()
    other = tmp_path / "other"
    other.mkdir()
    (other / "ship-request.json").write_text(json.dumps({"budget": 4.0}))
    before = sorted(p.name for p in other.iterdir())
    _one_line_exit_2(cli("ship", tiny_checkpoint, "--budget", 5, "--out", other, "--store", store,
                         "--eval-seq-len", 32, "--calib-seq-len", 32), "holds another decision")
    assert sorted(p.name for p in other.iterdir()) == before and not store.exists()


# ------------------------------------------------------------------ end to end


def _tiny_run_with_branches(root: Path, data_cfg) -> Path:
    from quantdyn.config import from_dict
    from quantdyn.train.branches import cooldown
    from quantdyn.train.config import RunConfig
    from quantdyn.train.trainer import train
    from conftest import tiny_run_dict

    run = train(from_dict(RunConfig, tiny_run_dict(root, data_cfg, steps=12, checkpoint_every=4)), progress=False)
    cooldown(run, 4, [4], control=True)
    return run


def _ship_cmd(run, out, store):
    return [sys.executable, "-m", "quantdyn", "ship", str(run), "--budget", "5", "--out", str(out), "--store",
            str(store), "--eval-seq-len", "32", "--calib-seq-len", "32", "--eval-tokens", "2048",
            "--calib-samples", "8", "--formats", "gguf,gptq", "--json", "--quiet"]


def _store_keys(store: Path) -> list[str]:
    return [json.loads(line)["key"] for f in sorted(store.glob("part-*.jsonl")) for line in f.read_text().splitlines()
            if line.strip()]


@pytest.mark.e2e
def test_ship_end_to_end_kill_resume_and_nothing_measured_twice(tmp_path, kjv_small):
    run = _tiny_run_with_branches(tmp_path / "runs", kjv_small[0])
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out, store = tmp_path / "ship", tmp_path / "store"
    p = subprocess.Popen(_ship_cmd(run, out, store), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env)
    deadline = time.time() + 600
    while len(list(store.glob("part-*.jsonl"))) < 2:  # killed after some options are stored, before the end
        assert p.poll() is None, p.communicate()[1][-3000:]
        assert time.time() < deadline
        time.sleep(0.01)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert not (out / "ship.json").exists()
    stored = _store_keys(store)
    r = subprocess.run(_ship_cmd(run, out, store), capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    keys = _store_keys(store)
    assert len(keys) == len(set(keys)) and set(stored) <= set(keys)  # nothing lost, nothing stored twice
    shipped = json.loads((out / "ship.json").read_text())
    assert shipped == json.loads(json.dumps(report))
    for field in ("artifact", "quantizer", "bits_per_weight", "ce_q", "ce_q_se", "tied", "naive", "gain", "gain_se",
                  "export", "commands"):
        assert field in shipped, field
    assert shipped["bits_per_weight"] <= 5.0
    assert shipped["naive"]["artifact"] == "main@12"
    exported = Path(shipped["export"]["path"])
    assert exported.exists()
    from quantdyn.ship.ship import _sha256

    assert _sha256(exported) == shipped["export"]["sha256"]
    assert shipped["gain"] == pytest.approx(shipped["naive"]["ce_q"] - shipped["ce_q"], abs=1e-9)
    # the same weights (control-s4-d4@8 equals main@8: no decay, same data) were measured once
    names = [c["name"] for c in shipped["candidates"]]
    assert len(names) == len({c["checkpoint_hash"] for c in shipped["candidates"]})
    # a second ship of the same source measures nothing and decides the same
    again = subprocess.run(_ship_cmd(run, out, store), capture_output=True, text=True, env=env, timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    assert _store_keys(store) == keys
    second = json.loads(again.stdout)
    assert (second["artifact"]["name"], second["quantizer"], second["ce_q"]) == (
        shipped["artifact"]["name"], shipped["quantizer"], shipped["ce_q"])
    # into a fresh --out: the export is written again, and identical weights give the same digest (the export's
    # provenance file, with its time of writing, is not part of it)
    third = subprocess.run(_ship_cmd(run, tmp_path / "ship2", store), capture_output=True, text=True, env=env,
                           timeout=900)
    assert third.returncode == 0, third.stderr[-3000:]
    again_export = json.loads(third.stdout)["export"]
    assert again_export["path"] != shipped["export"]["path"] and again_export["sha256"] == shipped["export"]["sha256"]


# ------------------------------------------------------------------ the demo ends with the decision (issue 46.6)


def test_the_demo_spec_ships_at_a_budget_its_width_holds_and_scales_write_apart():
    from quantdyn.studies.pipeline import ship_config
    from quantdyn.studies.spec import demo_spec

    spec = demo_spec()
    assert (spec.ship.budget, spec.ship.quantizers, spec.ship.last) == (4.5, ("q4_0", "gptq4"), 1)
    cfg = ship_config(spec, Path("runs/demo"), "demo")
    # measured on the sweep's own windows and calibration, into its store
    assert (cfg.eval_tokens, cfg.eval_seq_len, cfg.calib_samples, cfg.calib_seq_len) == (200 * 128, 128, 32, 128)
    assert (cfg.source, cfg.out, cfg.store) == (("runs/demo",), "ship/demo-4.5", "results")
    assert demo_spec(["scale=cpu-tiny"]).ship.out == "ship-cpu-tiny"  # a smoke size never meets the full size's
    assert not demo_spec(["ship.budget=0"]).ship.enabled


@pytest.mark.parametrize("override, msg", [
    ("ship.budget=-1", "ship.budget=-1 must be a positive number"),
    ("ship.formats=[ggfu]", "did you mean 'gguf'"),
    ("ship.last=0", "last and repeats must be >= 1"),
])
def test_a_bad_ship_section_is_one_line_before_anything_runs(override, msg):
    from quantdyn.studies.spec import demo_spec

    with pytest.raises(QuantdynError, match=msg.replace("(", r"\(")):
        demo_spec([override])


def test_a_study_whose_ship_out_holds_another_decision_names_its_own_key(tmp_path):
    from quantdyn.studies.pipeline import _ship
    from quantdyn.studies.spec import demo_spec

    spec = demo_spec([f"ship.out={tmp_path / 'ship'}"])
    other = tmp_path / "ship" / "demo-4.5"
    other.mkdir(parents=True)
    (other / "ship-request.json").write_text(json.dumps({"budget": 4.5, "quantizers": ["q8_0"]}))
    with pytest.raises(QuantdynError, match=r"^ship.out '.*demo-4.5' holds another decision .*give another ship.out"):
        _ship(spec, tmp_path / "runs" / "demo", "demo", False, lambda line: None)
    assert sorted(p.name for p in other.iterdir()) == ["ship-request.json"]


@pytest.mark.e2e
def test_the_demo_ends_with_the_decision(tmp_path):
    """The embedded demo at its smoke size: after the sweep, ship decides on the demo's run; the printed summary and
    the report open with "What to ship"; a rerun measures nothing again."""
    import re

    from quantdyn.results.store import ResultStore
    from quantdyn.studies.pipeline import run_study
    from quantdyn.studies.spec import demo_spec

    spec = demo_spec(["scale=cpu-tiny", f"run.out_dir={tmp_path / 'runs'}", f"sweep.store={tmp_path / 'store'}",
                      f"report={tmp_path / 'rep'}", f"ship.out={tmp_path / 'ship'}", "sweep.quantizers=[rtn4]",
                      "run.train.eval_every=0"])
    lines: list[str] = []
    out = run_study(spec, progress=False, echo=lines.append)
    shipped = json.loads((tmp_path / "ship" / "demo-4.5" / "ship.json").read_text())
    assert out["ship"] == [json.loads(json.dumps(shipped))]
    assert shipped["budget"] == 4.5 and shipped["naive"]["quantizer"] == "q4_0"  # q4_0 is 4.5 bpw on any width
    assert shipped["quantizer"] in {"q4_0", "gptq4", "auto@4.5"} and shipped["bits_per_weight"] <= 4.5
    # last=1: the main run's final checkpoint, the 4 branch endpoints, LAWA over the last 3, the soup
    assert sorted(c["how"] for c in shipped["candidates"]) == ["checkpoint", "control", "control", "cooldown",
                                                               "cooldown", "lawa", "soup"]
    # the decision leads the summary, before the findings; the screen's drops are one counted line
    head = next(i for i, x in enumerate(lines) if x.startswith("What to ship at 4.5 bits per weight"))
    assert head < next(i for i, x in enumerate(lines) if x.startswith("Answer"))
    assert any(x.startswith("ship: ") and shipped["artifact"]["name"] in x for x in lines[head:])
    drops = [x for x in lines if x.strip().startswith("screen: dropped")]
    assert len(drops) == 1 and f"dropped {len(shipped['dropped'])} of " in drops[0]
    assert not any(x.strip().startswith("dropped ") for x in lines)
    html = (tmp_path / "rep" / "index.html").read_text()
    assert re.findall(r"<h2[^>]*>([^<]*)", html)[0].startswith("What to ship at 4.5 bits per weight")
    # `quantdyn report` over the store prints the same summary, the decision first
    from quantdyn.studies.section import write_report

    printed: list[str] = []
    write_report(tmp_path / "store", tmp_path / "rep2", echo=printed.append)
    assert printed[0].startswith("What to ship at 4.5") and lines[head:head + len(printed)] == printed
    keys = ResultStore(tmp_path / "store").keys()
    again: list[str] = []
    run_study(spec, progress=False, echo=again.append)
    assert ResultStore(tmp_path / "store").keys() == keys  # every stage resumed: nothing measured twice
    assert json.loads((tmp_path / "ship" / "demo-4.5" / "ship.json").read_text())["quantizer"] == shipped["quantizer"]


def test_a_branch_trained_by_format_qat_is_deployed_with_its_format_only_and_stays_out_of_the_soup(tmp_path):
    """Issue 48.2: a cooldown trained with q4_k's fake quantization is compared artifact to artifact: ship measures
    it with q4_k only, and does not mix its weights (tuned to q4_k's grid) into the soup of decayed branches."""
    from quantdyn.ship.candidates import CandidateSpec, default_candidates
    from quantdyn.ship.quantizations import Quantization
    from quantdyn.ship.ship import deployable
    from quantdyn.sources.trajectory import Point

    def pt(branch, step, kind, qat=None):
        ref = tmp_path / branch / str(step)
        ref.mkdir(parents=True)
        return Point(str(ref), "r", branch, kind, step, step * 10, 0.0, kind == "cooldown",
                     meta={"config": {"qat": {"format": qat} if qat else None}})

    points = [pt("main", 400, "checkpoint"), pt("main", 600, "checkpoint"),
              pt("cooldown-s400-d100-linear", 500, "cooldown"), pt("cooldown-s200-d100-linear", 300, "cooldown"),
              pt("cooldown-s400-d100-linear-qat-q4_k", 500, "cooldown", "q4_k")]
    cands, make = default_candidates(points, CandidateSpec(last=1, lawa=0, soup=True))
    qat = next(c for c in cands if c.branch.endswith("qat-q4_k"))
    assert qat.qat_format == "q4_k" and qat.describe()["qat_format"] == "q4_k"
    assert all(not c.qat_format for c in cands if c is not qat)
    assert make["soup"] == sorted(str(tmp_path / b / s) for b, s in
                                  [("cooldown-s400-d100-linear", "500"), ("cooldown-s200-d100-linear", "300")])
    qs = [Quantization(n, n, 4.5, "gguf") for n in ("q4_0", "q4_k", "gptq4")]
    assert [q.name for q in deployable(qat, qs)] == ["q4_k"]
    plain = next(c for c in cands if c.branch == "main")
    assert [q.name for q in deployable(plain, qs)] == ["q4_0", "q4_k", "gptq4"]
