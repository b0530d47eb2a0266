"""Issue 48.3: the warmdown's length and shape as grid axes (schedule.decay, schedule.decay_shape), a warmdown
longer than the run refused in one line where the user sets it, and the no-decay branch (constant LR to the end,
then an online average as its endpoint)."""
from __future__ import annotations

import json

import pytest
import yaml
from conftest import tiny_run_dict
from safetensors.torch import load_file

from quantdyn.config import from_dict
from quantdyn.errors import QuantdynError
from quantdyn.launch.grid import expand_grid
from quantdyn.runs import RunDir, is_nodecay, list_checkpoints, nodecay_branch, parse_branch
from quantdyn.schedules import lr_at, wsd_bounds
from quantdyn.sources.trajectory import points_of_run
from quantdyn.studies.spec import spec_from_dict
from quantdyn.train.config import RunConfig
from quantdyn.train.trainer import train


def _base(tmp_path, data_cfg, steps=100):
    d = tiny_run_dict(tmp_path, data_cfg, steps=steps)
    d["schedule"] = {"name": "wsd", "warmup": 2, "decay": 0.2}
    return d


def test_warmdown_length_and_shape_are_grid_axes(tmp_path, kjv_small):
    runs = expand_grid(_base(tmp_path, kjv_small[0]), ["schedule.decay=0.1,0.33,0.5",
                                                       "schedule.decay_shape=linear,cosine,1-sqrt"])
    assert len(runs) == 9
    names = [n for n, _ in runs]
    assert "t-decay0.33-shape1-sqrt" in names and "t-decay0.1-shapelinear" in names
    cfgs = {n: from_dict(RunConfig, d) for n, d in runs}
    # 100 steps: the warmdown is 10, 33, 50 steps, starting at 90, 67, 50
    assert [wsd_bounds(cfgs[f"t-decay{f}-shapecosine"].schedule, 100) for f in ("0.1", "0.33", "0.5")] == \
        [(90, 10), (67, 33), (50, 50)]
    # halfway through a 50-step warmdown: linear at half the peak, cosine at half, 1-sqrt at 1 - sqrt(1/2)
    lr = {s: lr_at(74, 1.0, cfgs[f"t-decay0.5-shape{s}"].schedule, 100) for s in ("linear", "cosine", "1-sqrt")}
    assert lr["linear"] == pytest.approx(0.5) and lr["cosine"] == pytest.approx(0.5, abs=1e-12)
    assert lr["1-sqrt"] == pytest.approx(1 - 0.5 ** 0.5)
    assert lr_at(60, 1.0, cfgs["t-decay0.5-shapecosine"].schedule, 100) > \
        lr_at(60, 1.0, cfgs["t-decay0.5-shapelinear"].schedule, 100)  # cosine holds the LR up early


def test_warmdown_longer_than_the_run_is_one_line(tmp_path, kjv_small, cli):
    base = _base(tmp_path, kjv_small[0])
    with pytest.raises(QuantdynError, match=r"run 't-decay150': schedule.decay=150 is a warmdown of 150 steps, "
                                            r"longer than the run's 100"):
        expand_grid(base, ["schedule.decay=0.2,150"])
    study = {"run": {**base, "schedule": {"name": "wsd", "warmup": 2, "decay": 101}}}
    with pytest.raises(QuantdynError, match="longer than the run's 100"):
        spec_from_dict(study)
    assert spec_from_dict({"run": base}).run.schedule.decay == 0.2  # and a fraction is fine
    cfg = tmp_path / "base.yaml"
    cfg.write_text(yaml.safe_dump(base))
    r = cli("grid", cfg, "--vary", "schedule.decay=0.3,500", "--dir", tmp_path / "g")
    assert r.returncode == 2 and "warmdown of 500 steps" in r.stderr and "\n" not in r.stderr.strip()
    assert not (tmp_path / "g").exists()
    r = cli("train", cfg, "schedule.decay=400", "--quiet")
    assert r.returncode == 2 and "longer than the run's 100" in r.stderr
    assert not (tmp_path / "t").exists()
    # a tiny run with more decay than steps stays a valid RunConfig (the check is where the user sets it)
    assert from_dict(RunConfig, tiny_run_dict(tmp_path, kjv_small[0], steps=2)).train.steps == 2


@pytest.fixture(scope="module")
def run(tmp_path_factory, kjv_small):
    d = tiny_run_dict(tmp_path_factory.mktemp("runs"), kjv_small[0], steps=12, checkpoint_every=2)
    d["name"] = "nd"
    d["schedule"] = {"name": "wsd", "warmup": 2, "decay": 4}
    return train(from_dict(RunConfig, d), progress=False)


def test_nodecay_branch_is_constant_lr_then_its_average(run, cli):
    r = cli("cooldown", run, "--from-step", 8, "--decay-steps", 4, "--control", "--nodecay", "lawa-k2-p2,ema-0.9",
            "--quiet")
    assert r.returncode == 0, r.stderr
    lawa = RunDir(run).branch("nodecay-s8-d4-lawa-k2-p2").path
    ctrl = RunDir(run).branch("control-s8-d4").path
    assert parse_branch(lawa.name).average == "lawa-k2-p2" and is_nodecay(lawa.name)
    assert nodecay_branch(8, 4, "ema-0.9") in r.stdout
    info = json.loads((lawa / "run.json").read_text())["parent"]
    assert (info["kind"], info["average"], info["decay_steps"]) == ("nodecay", "lawa-k2-p2", 4)
    cps = {c.step: c.path for c in list_checkpoints(lawa)}
    assert sorted(cps) == [10, 12] and all(c.lr == pytest.approx(3e-3) for c in list_checkpoints(lawa))
    # no decay: the branch's own weights are its control's, bit for bit
    w12, c12 = load_file(str(cps[12] / "model.safetensors")), load_file(str(list_checkpoints(ctrl)[-1].path /
                                                                             "model.safetensors"))
    assert all((w12[k] == c12[k]).all() for k in w12)
    # its endpoint: the average of its last K=2 snapshots, 2 steps apart (steps 10 and 12)
    w10 = load_file(str(cps[10] / "model.safetensors"))
    avg = load_file(str(RunDir(lawa).average("lawa-k2-p2", 12) / "model.safetensors"))
    for k in avg:
        ref = 0.5 * (w10[k].double() + w12[k].double())
        assert float((avg[k].double() - ref).abs().max()) <= 4 * float(ref.abs().max()) * 2 ** -23
    # a sweep measures the average as the branch's points (its raw weights are the control's)
    pts = [p for p in points_of_run(run) if p.branch == lawa.name]
    assert {p.step for p in pts} == {10, 12} and all("averages/lawa-k2-p2" in p.ref for p in pts)
    assert {p.kind for p in pts} == {"nodecay"}


@pytest.mark.parametrize("avg, says", [("lawa-k3-p2", "must lie inside the branch"), ("lawa-k2-p5", "must divide 12"),
                                       ("ema-1", "name it lawa-kK-pP"), ("soup", "name it lawa-kK-pP")])
def test_bad_nodecay_one_line_nothing_written(run, cli, avg, says):
    before = sorted(p.name for p in RunDir(run).branches.iterdir()) if RunDir(run).branches.is_dir() else []
    r = cli("cooldown", run, "--from-step", 8, "--decay-steps", 4, "--nodecay", avg, "--quiet")
    assert r.returncode == 2 and says in r.stderr and "\n" not in r.stderr.strip()
    after = sorted(p.name for p in RunDir(run).branches.iterdir()) if RunDir(run).branches.is_dir() else []
    assert after == before
