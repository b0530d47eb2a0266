"""Cooldown branches with an intervention (issue 48.2): QAT in a deployment format's fake quantization and SAM,
named for it, recorded with its cost, deployed by the sweep with the same format; bad input one line, exit 2,
nothing written."""
from __future__ import annotations

import json

import pytest
import torch
import yaml
from conftest import tiny_run_dict
from safetensors.torch import load_file

from quantdyn.config import from_dict
from quantdyn.results.store import ResultStore
from quantdyn.runs import RunDir, list_checkpoints, parse_branch, standard_of
from quantdyn.sweep.sweep import SweepConfig, run_sweep
from quantdyn.train.config import RunConfig
from quantdyn.train.trainer import train


@pytest.fixture(scope="module")
def run(tmp_path_factory, kjv_small):
    d = tiny_run_dict(tmp_path_factory.mktemp("runs"), kjv_small[0], steps=12, checkpoint_every=4)
    d["name"] = "iv"
    d["schedule"] = {"name": "wsd", "warmup": 2, "decay": 4}
    return train(from_dict(RunConfig, d), progress=False)


def _weights(branch_dir):
    return load_file(str(list_checkpoints(branch_dir)[-1].path / "model.safetensors"))


def _info(branch_dir):
    return json.loads((branch_dir / "run.json").read_text())


def test_qat_and_sam_cooldowns(run, cli):
    plain = cli("cooldown", run, "--from-step", 8, "--decay-steps", 4, "--control", "--quiet")
    assert plain.returncode == 0, plain.stderr
    r = cli("cooldown", run, "--from-step", 8, "--decay-steps", 4, "--qat", "RTN4g128", "--control", "--quiet")
    assert r.returncode == 0, r.stderr
    qat = RunDir(run).branch("cooldown-s8-d4-linear-qat-rtn4").path
    assert f"branch: {qat}" in r.stdout
    cfg = yaml.safe_load((qat / "config.yaml").read_text())
    assert cfg["qat"]["format"] == "rtn4" and cfg["qat"]["method"] == "format"
    info = _info(qat)
    assert (info["qat_format"], info["fake_quant_per_step"], info["forward_backward_per_step"]) == ("rtn4", 1, 1)
    assert info["parent"]["intervention"] == "qat-rtn4" and info["parent"]["kind"] == "cooldown"
    assert list_checkpoints(qat)[-1].step == 12
    # its control is the plain constant-LR twin, shared with the standard cooldown
    ctrl = RunDir(run).branch("control-s8-d4").path
    assert yaml.safe_load((ctrl / "config.yaml").read_text()).get("qat") is None
    assert standard_of(qat.name) == "cooldown-s8-d4-linear"
    # the same start, data and schedule: the QAT branch differs from the standard cooldown by its training only
    a, b = _weights(qat), _weights(RunDir(run).branch("cooldown-s8-d4-linear").path)
    assert set(a) == set(b)  # plain parameter names: a QAT checkpoint loads into a plain model
    assert max(float((a[k] - b[k]).abs().max()) for k in a) > 1e-4

    # SAM in the cooldown, with QAT too: named for both, two passes (and two fake quantizations) per step
    r = cli("cooldown", run, "--from-step", 8, "--decay-steps", 4, "optim.sam_rho=0.05", "qat.format=q4_k", "--quiet")
    assert r.returncode == 0, r.stderr
    both = RunDir(run).branch("cooldown-s8-d4-linear-sam0.05-qat-q4_k").path
    info = _info(both)
    assert (info["forward_backward_per_step"], info["fake_quant_per_step"], info["qat_format"]) == (2, 2, "q4_k")
    cfg = yaml.safe_load((both / "config.yaml").read_text())
    assert cfg["optim"]["sam_rho"] == 0.05 and cfg["qat"]["format"] == "q4_k"
    assert parse_branch(both.name).intervention == "sam0.05-qat-q4_k"
    # a rerun of the same command continues (here: finds it finished), it does not start a new branch
    again = cli("cooldown", run, "--from-step", 8, "--decay-steps", 4, "optim.sam_rho=0.05", "--qat", "q4_k", "--quiet")
    assert again.returncode == 0 and f"branch: {both}" in again.stdout


def test_sweep_deploys_a_qat_branch_with_its_format(run, cli, tmp_path):
    r = cli("cooldown", run, "--from-step", 8, "--decay-steps", 4, "--qat", "rtn4", "--quiet")
    assert r.returncode == 0, r.stderr
    store = tmp_path / "store"
    cfg = from_dict(SweepConfig, {"trajectory": {"run": str(run), "include_averages": False}, "quantizers": ["rtn2"],
                                  "store": str(store), "data": {"calib_samples": 4, "calib_seq_len": 32,
                                                                "eval_windows": 8, "eval_seq_len": 32}})
    said = []
    run_sweep(cfg, progress=False, echo=said.append)
    assert any("rtn4 added to the quantizers" in s for s in said)
    rows = ResultStore(store).rows()
    end = [x for x in rows if x.get("branch") == "cooldown-s8-d4-linear-qat-rtn4" and x.get("step") == 12]
    assert {x["kind"] for x in end} == {"fp", "ptq"}  # deployed by the format's quantizer: no qat-kind row
    # the formats of the run's QAT branches (this module's other test may have made a q4_k one)
    formats = {yaml.safe_load((b / "config.yaml").read_text())["qat"]["format"]
               for b in RunDir(run).branches.iterdir() if "qat-" in b.name}
    assert "rtn4" in formats
    assert {x["quantizer"] for x in end if x["kind"] == "ptq"} == {"rtn2"} | formats
    assert {x["qat"] for x in end} == {"rtn4"}
    # every other point measured at rtn4 too, so that the QAT branch compares artifact to artifact
    main_end = [x for x in rows if x.get("branch") == "main" and x.get("step") == 12 and x["kind"] == "ptq"]
    assert {x["quantizer"] for x in main_end} == {"rtn2"} | formats and {x["qat"] for x in main_end} == {None}


@pytest.mark.parametrize("args, says", [
    (["--qat", "gptq4"], "no fake-quantized training path (it needs calibration data); formats that have one:"),
    (["--qat", "w4a4"], "also quantizes activations"),
    (["optim.lr=0.1"], "'optim.lr' cannot be set on a cooldown branch of a quantdyn run"),
    (["optim.sam_adaptive=true"], "needs optim.sam_rho > 0"),
    (["--qat", "rtn4", "qat.format=q4_k"], "disagree"),
])
def test_bad_intervention_one_line_nothing_written(run, cli, args, says):
    before = sorted(p.name for p in RunDir(run).branches.iterdir()) if RunDir(run).branches.is_dir() else []
    r = cli("cooldown", run, "--from-step", 8, "--decay-steps", 3, *args, "--quiet")
    assert r.returncode == 2
    err = r.stderr.strip()
    assert says in err and "\n" not in err and "Traceback" not in r.stderr
    after = sorted(p.name for p in RunDir(run).branches.iterdir()) if RunDir(run).branches.is_dir() else []
    assert after == before


def test_qat_on_a_qat_run_is_refused(tmp_path, kjv_small, cli):
    d = tiny_run_dict(tmp_path, kjv_small[0], steps=8, checkpoint_every=4)
    d.update(name="qq", qat={"method": "ste", "w_bits": 4, "a_bits": 0}, schedule={"name": "constant"})
    parent = train(from_dict(RunConfig, d), progress=False)
    r = cli("cooldown", parent, "--from-step", 4, "--decay-steps", 2, "--qat", "rtn4", "--quiet")
    assert r.returncode == 2 and "already trains with QAT" in r.stderr
    assert not RunDir(parent).branches.exists()
    assert torch.is_tensor(next(iter(_weights(parent).values())))


def test_intervention_names_round_trip():
    from quantdyn.runs import BranchName, control_of, cooldown_branch, intervention_tag, is_cooldown, is_intervention
    from quantdyn.schedules import DECAY_SHAPES

    assert intervention_tag(1e-5) == "sam0.00001" and intervention_tag(0.5, True) == "asam0.5"
    assert intervention_tag(0.05, False, "rtn4") == "sam0.05-qat-rtn4" and intervention_tag() == ""
    for shape in sorted(DECAY_SHAPES):
        for tag in ("sam0.05", "asam0.5", "qat-rtn4", "sam0.05-qat-q4_k_m", "qat-rtn3g64-sym"):
            name = cooldown_branch(8, 4, shape, tag)
            assert parse_branch(name) == BranchName("cooldown", 8, 4, shape, tag)
            assert is_intervention(name) and not is_cooldown(name) and control_of(name) is None
            assert standard_of(name) == cooldown_branch(8, 4, shape)
        assert standard_of(cooldown_branch(8, 4, shape)) is None and is_cooldown(cooldown_branch(8, 4, shape))
    for name in ("control-s8-d4-qat-rtn4", "cooldown-s8-d4-qat-rtn4", "cooldown-s8-d4-linear-sam"):
        assert not is_intervention(name)


def test_qat_cooldown_from_an_hf_checkpoint(tmp_path, hf_models, cli):
    """--qat on a cooldown from a Hugging Face checkpoint: the cooldowns train with the format (per tensor of the
    llama blocks), the controls do not."""
    out = tmp_path / "cd"
    r = cli("cooldown", hf_models["llama"], "--peak-lr", "1e-3", "--decay-steps", "2", "--control", "--qat", "nvfp4",
            "--data", "builtin:kjv", "--batch-size", "2", "--seq-len", "16", "--out", out, "--optimizer-start",
            "estimate:2", "--quiet", "data.max_tokens=200000", "data.bpe_train_chars=400000", "train.eval_windows=4",
            "train.eval_every=0", "train.log_every=1")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (out / "branches").iterdir()) == ["control-s0-d2", "cooldown-s0-d2-linear-qat-nvfp4"]
    qat = out / "branches" / "cooldown-s0-d2-linear-qat-nvfp4"
    assert _info(qat)["qat_format"] == "nvfp4" and _info(qat)["parent"]["intervention"] == "qat-nvfp4"
    assert yaml.safe_load((out / "branches" / "control-s0-d2" / "config.yaml").read_text()).get("qat") is None
    bad = cli("cooldown", hf_models["llama"], "--peak-lr", "1e-3", "--decay-steps", "2", "--qat", "gptq3",
              "--out", tmp_path / "bad", "--quiet")
    assert bad.returncode == 2 and "no fake-quantized training path" in bad.stderr and not (tmp_path / "bad").exists()


def test_format_qat_on_conv1d_model_is_one_line(tmp_path, hf_models, cli):
    r = cli("cooldown", hf_models["gpt2"], "--peak-lr", "1e-3", "--decay-steps", "2", "--qat", "rtn4",
            "--data", "builtin:kjv", "--batch-size", "2", "--seq-len", "16", "--out", tmp_path / "g2",
            "--optimizer-start", "estimate:2", "--quiet", "data.max_tokens=200000", "data.bpe_train_chars=400000",
            "train.eval_windows=4", "train.eval_every=0")
    err = r.stderr.strip()
    assert r.returncode == 2 and "\n" not in err and "swaps nn.Linear layers" in err and "Conv1D" in err
