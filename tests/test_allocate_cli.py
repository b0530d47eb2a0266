"""`quantdyn allocate` and plans as quantizers where users meet them: the command line (plan file, summary, one-line
refusals that leave nothing behind), `quantize --quantizers plan:FILE`, sweeps with plan:/auto@ labels and
sensitivity rows (resumable), and the in-training monitor with an auto@ label."""
from __future__ import annotations

import json
import shlex

import pytest
import torch
from conftest import tiny_run_dict
from plan_models import tiny_checkpoint, tiny_gpt, windows

from quantdyn.config import from_dict
from quantdyn.results.store import ResultStore


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, kjv_small):
    """A tiny GPT-NeoX checkpoint with vocabulary 512 and the KJV BPE-512 tokenizer beside it."""
    _, data = kjv_small
    d = tiny_checkpoint(tmp_path_factory.mktemp("alloc") / "model", vocab=512)
    data.tokenizer.save_pretrained(str(d))
    return d


SHORT = ["--calib-samples", "6", "--calib-seq-len", "32"]


@pytest.mark.e2e
def test_allocate_writes_a_plan_that_quantize_uses(ckpt, tmp_path, cli):
    out, store = tmp_path / "plan.json", tmp_path / "store"
    r = cli("allocate", ckpt, "--budget", "5", "--types", "q4_0,q5_1,q8_0", "--out", out, "--store", store,
            *SHORT, "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    s = json.loads(r.stdout)
    plan = json.loads(out.read_text())
    assert plan["format"] == "quantdyn-plan" and s["bits_per_weight"] == plan["bits_per_weight"] <= 5
    assert s["allocator"] == "knapsack-dp" and set(s["counts"]) <= {"q4_0", "q5_1", "q8_0"}
    assert s["llama_quantize"][-3:-1] == ["model-f32.gguf", "model-plan.gguf"] and s["llama_quantize"][-1] in {"2", "9", "7"}
    assert sum(a == "--tensor-type" for a in s["llama_quantize"]) == 8
    script = tmp_path / "plan.llama-quantize.sh"  # the long command line goes to a file beside the plan
    assert s["llama_quantize_script"] == str(script) and s["uniform"] is None
    text = script.read_text()
    words = shlex.split(text.split("\nexec ", 1)[1].replace("\\\n", ""))  # as sh reads it: no line continuations
    assert text.startswith("#!/bin/sh\n") and words[0] == "llama-quantize"
    assert words[1:-3] == s["llama_quantize"][:-3] and words[-1] == s["llama_quantize"][-1]
    rows = ResultStore(store).rows()
    assert len(rows) == 8 * 3 + 4 * 3 + 3 and {r["kind"] for r in rows} == {"sensitivity"}
    r = cli("quantize", ckpt, "--quantizers", f"plan:{out}", "--calib-samples", "4", "--calib-seq-len", "32",
            "--eval-tokens", "1024", "--eval-seq-len", "32", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    row = json.loads(r.stdout.strip().splitlines()[-1])
    assert row["quantizer"] == f"plan:{out}#{plan['digest']}"
    assert row["bits_per_weight"] == pytest.approx(plan["bits_per_weight"], rel=1e-12)
    assert row["plan_types"] == {k: v["type"] for k, v in plan["tensors"].items()}


@pytest.mark.parametrize("args,says", [
    (["--budget", "9", "--types", "q4_0,q8_0"], "budget 9 bits per weight is outside what q4_0, q8_0 can reach on "
                                                "this model: 4.5000"),
    (["--budget", "4.4", "--types", "q4_0,q8_0"], "is outside what"),
    (["--budget", "4.5", "--types", "q4_k,q8_0,q3_k"], "q4_k, q3_k cannot hold rows of 64 weights (6 tensors, "
                                                       "e.g. gpt_neox.layers.0.attention.query_key_value; llama.cpp "
                                                       "would store them as its fallback q4_k->q5_0, q3_k->q4_0)"),
    (["--budget", "4.5", "--types", "awq4,rtn4"], "awq cannot be a plan's type"),
    (["--budget", "4.5", "--types", "q4_0"], "at least two candidate types"),
    (["--budget", "4.5", "--types", "q4_0,q8_0", "--draws", "0"], "--draws 0 must be >= 1"),
])
def test_bad_input_is_one_line_and_writes_nothing(ckpt, tmp_path, cli, args, says):
    out, store = tmp_path / "plan.json", tmp_path / "store"
    r = cli("allocate", ckpt, *args, "--out", out, "--store", store, *SHORT)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert says in r.stderr, r.stderr
    assert not out.exists() and not store.exists()


def test_an_existing_plan_file_is_kept(ckpt, tmp_path, cli):
    out = tmp_path / "plan.json"
    out.write_text("keep me")
    r = cli("allocate", ckpt, "--budget", "5", "--types", "q4_0,q8_0", "--out", out, *SHORT)
    assert r.returncode == 2 and "exists; choose a new --out" in r.stderr and out.read_text() == "keep me"


def test_every_type_a_tensor_cannot_hold_is_named_at_once():
    """Every candidate against every tensor's shape, before any work: all misfits in one line, grouped by the widths
    they cannot hold, with llama.cpp's fallbacks and the candidates that do hold every tensor."""
    from quantdyn.errors import QuantdynError
    from quantdyn.quantize.allocate import check_types_hold

    tensors = [(f"model.layers.{b}.{p}", b, p, shape) for b in range(2) for p, shape in
               (("self_attn.q_proj", (576, 576)), ("mlp.down_proj", (576, 1536)), ("mlp.up_proj", (1536, 576)))]
    with pytest.raises(QuantdynError) as e:
        check_types_hold(tensors, ("q3_k", "q4_k", "q5_k", "q6_k", "q8_0"))
    assert str(e.value) == (
        "q3_k, q4_k, q5_k, q6_k cannot hold rows of 576 weights (4 tensors, e.g. model.layers.0.self_attn.q_proj; "
        "llama.cpp would store them as its fallback q3_k->q4_0, q4_k->q5_0, q5_k->q5_1, q6_k->q8_0); of the types "
        "given, q8_0 holds every tensor. Drop q3_k, q4_k, q5_k, q6_k from --types, or allocate between types that "
        "hold every tensor (llama.cpp's own fallbacks: q4_0,q5_0,q5_1,q8_0), e.g. --types q8_0,q4_0,q5_0,q5_1")
    with pytest.raises(QuantdynError, match=r"^q8_0 cannot hold rows of 100 weights \(1 tensor, .*fallback "
                                            r"q8_0->f16\); none of the types given holds every tensor"):
        check_types_hold([("x", 0, "mlp.down_proj", (256, 100))], ("q8_0",))
    check_types_hold([t for t in tensors if "down" in t[0]], ("q4_k", "q8_0", "rtn4g64"))  # 1536-wide rows hold them


def test_a_budget_at_either_end_says_the_plan_is_one_type():
    from types import SimpleNamespace

    from quantdyn.sweep.allocate_one import _uniform

    plan = SimpleNamespace(tensors=[SimpleNamespace(type="q4_0")] * 3)
    assert _uniform(4.5, 4.5, 8.5, plan) == "q4_0" and _uniform(8.5, 4.5, 8.5, plan) == "q4_0"
    assert _uniform(5.0, 4.5, 8.5, plan) is None
    mixed = SimpleNamespace(tensors=[SimpleNamespace(type="q4_0"), SimpleNamespace(type="q8_0")])
    assert _uniform(4.5, 4.5, 8.5, mixed) is None


def test_split_quantizers_keeps_auto_type_lists_together():
    from quantdyn.cli.options import split_quantizers

    assert split_quantizers("q4_k_m,auto@4.5:q3_k,q4_k,q5_k,q6_k") == ["q4_k_m", "auto@4.5:q3_k,q4_k,q5_k,q6_k"]
    assert split_quantizers("auto@4:q3_k,q4_k,plan:p.json,auto@5:q4_k,q6_k") == [
        "auto@4:q3_k,q4_k", "plan:p.json", "auto@5:q4_k,q6_k"]
    assert split_quantizers("gptq3,rtn4") == ["gptq3", "rtn4"]


@pytest.mark.e2e
def test_sweep_with_plan_and_auto_labels_and_sensitivity_rows_resumes(tmp_path, kjv_small):
    from quantdyn.sweep.sweep import SweepConfig, run_sweep
    from quantdyn.train.config import RunConfig
    from quantdyn.train.trainer import train

    data_cfg, _ = kjv_small
    d = tiny_run_dict(tmp_path, data_cfg, steps=8, checkpoint_every=4)
    d["name"] = "pl"
    run = train(from_dict(RunConfig, d), progress=False)
    model = tiny_gpt(d=32)  # the run's shapes (2 x 32) for a hand-made plan
    from test_plan import _plan

    from quantdyn.quantize.plan import write_plan

    plan = write_plan(_plan(model, ["q4_0", "q8_0"]), tmp_path / "p.json")
    cfg = from_dict(SweepConfig, {
        "trajectory": {"run": str(run)}, "quantizers": [f"plan:{plan}", "auto@5:q4_0,q5_1", "q4_0"],
        "store": str(tmp_path / "store"), "sensitivity": ["q4_0", "q8_0"],
        "data": {"calib_samples": 4, "calib_seq_len": 32, "eval_windows": 8, "eval_seq_len": 32}})
    out = run_sweep(cfg, progress=False)
    rows = ResultStore(tmp_path / "store").rows()
    ptq = [r for r in rows if r["kind"] == "ptq"]
    n_ck = len({r["checkpoint"] for r in ptq})
    assert n_ck >= 2 and len(ptq) == 3 * n_ck
    auto = [r for r in ptq if r["quantizer"].startswith("auto@")]
    assert all(r["bits_per_weight"] <= 5 and r["plan_types"] and r["plan_label"].startswith("plan:auto#") for r in auto)
    sens = [r for r in rows if r["kind"] == "sensitivity"]
    assert len(sens) == n_ck * (8 * 2 + 4 * 2 + 2)
    assert out["written"] == len(rows)
    again = run_sweep(cfg, progress=False)
    assert again["written"] == 0  # every row, sensitivity included, is skipped on a rerun


def test_monitor_takes_an_auto_label():
    from quantdyn.monitor.ptq import PTQMonitor

    model = tiny_gpt()
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    flags = [p.requires_grad for p in model.parameters()]
    mon = PTQMonitor(["auto@5:q4_0,q5_1"], eval_ids=windows(1, 400, 1)[0], calib_ids=windows(6, 32, 2), every=1,
                     seq_len=33, n_eval_windows=6)
    out = mon.step(model, 1)
    assert out["ptq/auto@5:q4_0,q5_1/kl"] > 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()) and model.training
    assert [p.requires_grad for p in model.parameters()] == flags


def test_a_study_spec_takes_plan_auto_and_sensitivity():
    from quantdyn.errors import QuantdynError
    from quantdyn.studies.spec import demo_spec

    s = demo_spec(['sweep.quantizers=[q4_k_m,"auto@4.5:q6_k,q3_k,q4_k,q5_k"]', "sweep.sensitivity=[q3_k,q4_k]"])
    assert s.sweep.quantizers == ("q4_k_m", "auto@4.5:q6_k,q3_k,q4_k,q5_k") and s.sweep.sensitivity == ("q3_k", "q4_k")
    with pytest.raises(QuantdynError, match="at least two candidate types"):
        demo_spec(["sweep.sensitivity=[q3_k]"])


def test_quantize_refuses_a_plan_from_another_model_before_writing(ckpt, tmp_path, cli):
    from test_plan import _plan

    from quantdyn.quantize.plan import write_plan

    plan = write_plan(_plan(tiny_gpt(n_layer=3), ["q4_0"]), tmp_path / "deep.json")
    out = tmp_path / "q.gguf"
    r = cli("quantize", ckpt, "--quantizers", f"plan:{plan}", "--export", "gguf", "--out", out)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "was made for a gpt_neox model of 3 blocks; this checkpoint is gpt_neox with 2 blocks" in r.stderr
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["deep.json"]
    r = cli("quantize", ckpt, "--quantizers", "auto@9:q4_0,q8_0", "--out", tmp_path / "x")
    assert r.returncode == 2 and "budget 9 bits per weight is outside" in r.stderr and not (tmp_path / "x").exists()
