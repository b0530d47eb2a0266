"""Downstream accuracy: the lm-eval adapter against direct computation, the
built-in offline tasks, the offline error for hub tasks, and result rows."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("lm_eval")

from conftest import tiny_run_dict  # noqa: E402

from quantdyn.errors import QuantdynError  # noqa: E402
from quantdyn.evaluate.lm_eval_tasks import make_lm, prepare_tasks  # noqa: E402
from quantdyn.evaluate.tasks import BUILTIN_TASKS, build_builtin_tasks  # noqa: E402
from quantdyn.models.gpt import GPT, ModelConfig, resolve_model_config  # noqa: E402
from quantdyn.sweep.accuracy import accuracy_rows_for_point, evaluate_accuracy, format_accuracy_table  # noqa: E402


def _instances(kind, args_list):
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args_list)]


@pytest.fixture(scope="module")
def tiny_model(kjv_small):
    _, data = kjv_small
    torch.manual_seed(0)
    model = GPT(resolve_model_config(ModelConfig(n_layer=2, d_model=32, n_head=2, max_seq_len=256), data.vocab_size))
    return model.eval(), data.tokenizer


@torch.no_grad()
def _direct_ll(model, ctx_ids, cont_ids, max_len):
    row = (ctx_ids + cont_ids)[-(max_len + 1):]
    logp = F.log_softmax(model(torch.tensor([row[:-1]]))[0].float(), dim=-1)  # (T, V)
    k = len(cont_ids)
    target = torch.tensor(row[-k:])
    lp = logp[-k:]
    return float(lp.gather(1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all())


def test_loglikelihood_equals_direct_computation(tiny_model):
    model, tok = tiny_model
    lm = make_lm(model, tok, batch_size=3)
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    long_ctx = " ".join(["In the beginning God created the heaven and the earth."] * 30)  # > 256 tokens
    pairs = [("And God said, Let there be", " light"), ("The LORD is my", " shepherd; I shall not want"),
             (long_ctx, " And the earth was without form"), ("", " Amen"), ("Jesus wept", ".")]
    got = lm.loglikelihood(_instances("loglikelihood", pairs))
    assert len(enc(long_ctx)) > model.config.max_seq_len  # the long context is truncated from the left
    for (ctx, cont), (ll, greedy) in zip(pairs, got):
        if ctx:
            ctx_ids = enc(ctx)
            cont_ids = enc(ctx + cont)[len(ctx_ids):]
        else:
            ctx_ids, cont_ids = [tok.eos_token_id], enc(cont)
        want_ll, want_greedy = _direct_ll(model, ctx_ids, cont_ids, model.config.max_seq_len)
        assert ll == pytest.approx(want_ll, abs=1e-4)
        assert greedy == want_greedy
    # is_greedy is true exactly for the argmax token
    ctx_ids = enc("And God said, Let there be")
    top = int(model(torch.tensor([ctx_ids]))[0, -1].argmax())
    (ll_top, g_top), (_, g_other) = lm._loglikelihood_tokens([(None, ctx_ids, [top]), (None, ctx_ids, [(top + 1) % 512])])
    assert g_top and not g_other
    assert ll_top == pytest.approx(_direct_ll(model, ctx_ids, [top], 256)[0], abs=1e-5)


@torch.no_grad()
def test_loglikelihood_rolling_equals_total_loglik(tiny_model):
    model, tok = tiny_model
    L = model.config.max_seq_len
    lm = make_lm(model, tok, batch_size=2)
    short = "Blessed are the meek: for they shall inherit the earth."
    long = " ".join(["Blessed are they that mourn: for they shall be comforted."] * 45)
    got = lm.loglikelihood_rolling(_instances("loglikelihood_rolling", [(short,), (long,)]))
    for text, value in zip((short, long), got):
        toks = tok(text, add_special_tokens=False)["input_ids"]
        full = [tok.eos_token_id] + toks  # full[i] is the input that predicts toks[i]
        n, total = len(toks), 0.0
        # every token predicted once: blocks of L tokens, each seeing its block; the last, partial block
        # sees the L tokens before its end (lm-eval's disjoint rolling windows, context_len=1)
        for start in range(0, n, L):
            end = min(start + L, n)
            lo = start if (end - start == L or start == 0) else end - L
            logp = F.log_softmax(model(torch.tensor([full[lo:end]]))[0].float(), dim=-1)
            k = end - start
            total += float(logp[-k:].gather(1, torch.tensor(toks[start:end])[:, None]).sum())
        if text is short:
            assert n < L
            logp = F.log_softmax(model(torch.tensor([full[:-1]]))[0].float(), dim=-1)
            assert total == pytest.approx(float(logp.gather(1, torch.tensor(toks)[:, None]).sum()), abs=1e-4)
        else:
            assert n > 2 * L
        assert value == pytest.approx(total, abs=1e-3)


@torch.no_grad()
def test_generate_until_is_greedy_and_stops_at_stop_string(tiny_model):
    model, tok = tiny_model
    lm = make_lm(model, tok, batch_size=4)
    contexts = ["And God said", "In the beginning God created the heaven and the earth. And the earth was"]

    def greedy(ctx, n):
        ids = tok(ctx, add_special_tokens=False)["input_ids"]
        out = []
        for _ in range(n):
            nxt = int(model(torch.tensor([ids[-model.config.max_seq_len:]]))[0, -1].argmax())
            ids.append(nxt)
            out.append(nxt)
        return tok.decode(out)

    eos = tok.decode([tok.eos_token_id])
    full = [greedy(c, 12) for c in contexts]
    # without stop strings: exactly max_gen_toks greedy tokens (cut at EOS should the model emit it)
    got = lm.generate_until(_instances("generate_until", [(c, {"until": [], "max_gen_toks": 12}) for c in contexts]))
    assert got == [f.split(eos)[0] for f in full]
    # a stop string taken from the middle of the greedy text: output ends right before it
    stops = [f[len(f) // 2 : len(f) // 2 + 3] for f in full]
    assert all(s.strip() for s in stops)
    got = lm.generate_until(_instances("generate_until", [(c, {"until": [s], "max_gen_toks": 12})
                                                           for c, s in zip(contexts, stops)]))
    for g, f, s in zip(got, full, stops):
        assert g == f.split(eos)[0].split(s)[0] and s not in g
    with pytest.raises(QuantdynError, match="greedily"):
        lm.generate_until(_instances("generate_until", [("x", {"do_sample": True, "temperature": 1.0})]))


def test_builtin_tasks_are_deterministic(tmp_path, kjv_small):
    _, data = kjv_small
    a = build_builtin_tasks(data, tmp_path / "a", seed=0, n=120)
    b = build_builtin_tasks(data, tmp_path / "b", seed=0, n=120)
    c = build_builtin_tasks(data, tmp_path / "c", seed=1, n=120)
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    for name in files:
        ta, tb = (a / name).read_text(), (b / name).read_text()
        if name.endswith(".yaml"):  # they name their own directory
            ta, tb = ta.replace(str(a.resolve()), "DIR"), tb.replace(str(b.resolve()), "DIR")
        assert ta == tb, name
    assert (a / "quantdyn_nextsent.test.jsonl").read_text() != (c / "quantdyn_nextsent.test.jsonl").read_text()
    for task in BUILTIN_TASKS:
        assert "dataset_path: json" in (a / f"{task}.yaml").read_text()
    nextsent = [json.loads(x) for x in (a / "quantdyn_nextsent.test.jsonl").read_text().splitlines()]
    lastword = [json.loads(x) for x in (a / "quantdyn_lastword.test.jsonl").read_text().splitlines()]
    assert len(nextsent) == len(lastword) == 120
    assert all(len(r["choices"]) == 4 and len(set(r["choices"])) == 4 and 0 <= r["label"] < 4 for r in nextsent)
    assert len({r["label"] for r in nextsent}) == 4  # the true sentence is not always in one place
    assert all(r["target"].startswith(" ") and r["target"][1:].isalpha() for r in lastword)
    # every label points at the sentence that follows its context in the held-out text, every target at the
    # word that ends its passage (a label or target off by one would leave the accuracies at chance)
    held_out = " ".join(data.tokenizer.decode(list(map(int, data.val))).split())
    assert all(f"{r['context'][-60:]} {r['choices'][r['label']]}" in held_out for r in nextsent)
    assert all(f"{r['context'][-60:]}{r['target']}" in held_out for r in lastword)
    # rebuilding into an existing directory with the same parameters reuses it
    mtime = (a / "manifest.json").stat().st_mtime_ns
    assert build_builtin_tasks(data, a, seed=0, n=120) == a and (a / "manifest.json").stat().st_mtime_ns == mtime


def test_hub_task_offline_is_one_line_naming_the_dataset(tmp_path):
    """arc_easy's own YAML (copied from lm-eval, so the ~10 s index of every task is not built)
    with the Hub offline and an empty cache: one QuantdynError line naming allenai/ai2_arc."""
    import lm_eval

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    src = Path(lm_eval.__file__).parent / "tasks" / "arc" / "arc_easy.yaml"
    (tasks / "arc_easy.yaml").write_text(src.read_text())
    code = (
        "from quantdyn.errors import QuantdynError\n"
        "from quantdyn.evaluate.lm_eval_tasks import prepare_tasks\n"
        f"try:\n    prepare_tasks(['arc_easy'], include_paths=[{str(tasks)!r}])\n"
        "except QuantdynError as e:\n    print('ERROR:' + str(e))\n"
    )
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    lines = [x for x in out.stdout.splitlines() if x.startswith("ERROR:")]
    assert len(lines) == 1, out.stdout + out.stderr
    msg = lines[0][len("ERROR:"):]
    assert "allenai/ai2_arc" in msg and "arc_easy" in msg and "quantdyn_nextsent" in msg
    assert "Traceback" not in out.stderr


@pytest.mark.e2e
def test_hub_task_offline_by_name(tmp_path):
    """The same through the full lm-eval task index (as `quantdyn eval --tasks arc_easy` runs it)."""
    code = (
        "from quantdyn.errors import QuantdynError\n"
        "from quantdyn.evaluate.lm_eval_tasks import prepare_tasks\n"
        "try:\n    prepare_tasks(['arc_easy'])\n"
        "except QuantdynError as e:\n    print('ERROR:' + str(e))\n"
    )
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    lines = [x for x in out.stdout.splitlines() if x.startswith("ERROR:")]
    assert len(lines) == 1 and "allenai/ai2_arc" in lines[0], out.stdout + out.stderr


def test_accuracy_rows_land_in_store(tmp_path, kjv_small, tiny_model):
    from quantdyn.report.accuracy import accuracy_vs_dce
    from quantdyn.results.store import ResultStore

    _, data = kjv_small
    model, _ = tiny_model
    kw = dict(quantizer=["rtn4", "rtn2"], limit=16, data=data, builtin_n=40, task_dir=tmp_path / "tasks",
              calib_samples=4, calib_seq_len=32, device="cpu", checkpoint_hash="ckpt-a")
    rows = evaluate_accuracy(model, "quantdyn_nextsent,quantdyn_lastword", **kw)
    assert len(rows) == 4 and {r["kind"] for r in rows} == {"accuracy"}
    assert {(r["task"], r["quantizer"]) for r in rows} == {
        (t, q) for t in ("quantdyn_nextsent", "quantdyn_lastword") for q in ("rtn4", "rtn2")}
    for r in rows:
        assert r["metric"] == "acc" and r["n"] == 16 and r["checkpoint_hash"] == "ckpt-a"
        assert r["acc_drop"] == pytest.approx(r["acc_fp"] - r["acc_q"])
        assert r["task_version"] is not None and r["num_fewshot"] == 0 and r["seed"] == 0 and r["limit"] == 16
        assert r["quant_config"]["bits"] == {"rtn4": 4, "rtn2": 2}[r["quantizer"]] and r["git_sha"] and r["task_files_hash"]
    store = ResultStore(tmp_path / "results")
    store.append(rows)
    again = evaluate_accuracy(model, ["quantdyn_nextsent", "quantdyn_lastword"], **kw)
    assert [r["key"] for r in again] == [r["key"] for r in rows]  # same inputs, same identity
    store.append(again)
    stored = store.rows()
    assert len(stored) == 4 and len({r["key"] for r in stored}) == 4
    assert {r["acc_q"] for r in stored} == {r["acc_q"] for r in rows}
    # another seed or few-shot count is another row
    other = evaluate_accuracy(model, ["quantdyn_lastword"], num_fewshot=1, **{**kw, "quantizer": "rtn4"})
    assert other[0]["key"] not in {r["key"] for r in rows}
    table = format_accuracy_table(stored)
    assert "quantdyn_nextsent" in table and "rtn2" in table and "not standard benchmarks" in table
    # joined with PTQ rows of the same checkpoint and quantizer for paper A's Fig. 4
    ptq = [{"kind": "ptq", "checkpoint_hash": "ckpt-a", "quantizer": q, "delta_ce": d, "delta_ce_se": 0.01,
            "checkpoint": "x"} for q, d in (("rtn4", 0.05), ("rtn2", 2.0))]
    points = accuracy_vs_dce(stored + ptq, tmp_path / "acc.png")
    assert (tmp_path / "acc.png").stat().st_size > 0
    assert {(p["task"], p["quantizer"]) for p in points} >= {("quantdyn_nextsent", "rtn2"), ("mean over tasks", "rtn4")}
    assert all(p["delta_ce"] == (0.05 if p["quantizer"] == "rtn4" else 2.0) for p in points)


def test_fp_only_rows_and_errors(tmp_path, kjv_small, tiny_model):
    _, data = kjv_small
    model, tok = tiny_model
    tasks, ident = prepare_tasks(["quantdyn_lastword"], data=data, builtin_n=20, task_dir=tmp_path / "t")
    rows = accuracy_rows_for_point(model, {}, tasks, tokenizer=tok, task_ident=ident, base={"checkpoint_hash": "h"})
    assert len(rows) == 1 and rows[0]["acc_q"] is None and rows[0]["quantizer"] is None and rows[0]["n"] == 20
    with pytest.raises(QuantdynError, match="pass data="):
        prepare_tasks(["quantdyn_nextsent"])
    with pytest.raises(QuantdynError, match="tokenizer"):
        evaluate_accuracy(model, ["quantdyn_nextsent"])
    with pytest.raises(QuantdynError, match="no tasks"):
        evaluate_accuracy(model, " , ", tokenizer=tok)


@pytest.mark.e2e
def test_trained_model_beats_an_untrained_one_on_lastword(tmp_path, kjv_small):
    """A 1-layer model trained 200 steps predicts the held-out passages' last words far better than an untrained
    one: the per-example log-likelihood of the target (lm-eval's ``perplexity`` samples), paired over the same
    500 examples, with the pipeline's own paired SE.

    Measured (2026-11-24, training seeds 0, 1 and this fixture's 3): +5.3 to +5.5 nats per target, SE 0.21,
    z = 26; the assertion asks for z > 10. This replaced an assertion on ``quantdyn_nextsent``'s
    ``acc_mutual_info`` (trained 0.28-0.34 against untrained 0.24-0.30, z 2.7-3.2 even for a 2x64 model trained
    600 steps), which sat within ~2 SE of failing: models this small barely use the context, which is all the
    next-sentence task rewards. That every nextsent label points at the true next sentence is checked exactly in
    test_builtin_tasks_are_deterministic.
    """
    import math

    from quantdyn.config import from_dict
    from quantdyn.models.hf_io import load_gpt
    from quantdyn.runs import list_checkpoints
    from quantdyn.train.config import RunConfig
    from quantdyn.train.trainer import train

    data_cfg, data = kjv_small
    d = tiny_run_dict(tmp_path, data_cfg, steps=200, batch_size=4, seq_len=256, checkpoint_every=200, log_every=50)
    d["model"].update(n_layer=1, max_seq_len=256)
    d["schedule"] = {"name": "constant", "warmup": 10}
    d["optim"] = {"lr": 1e-2}
    run = train(from_dict(RunConfig, d), progress=False)
    trained = load_gpt(list_checkpoints(run)[-1].path)
    torch.manual_seed(0)
    untrained = GPT(trained.config)
    tasks, ident = prepare_tasks(["quantdyn_lastword"], data=data, task_dir=tmp_path / "tasks")
    (r,) = accuracy_rows_for_point(trained, {"untrained": untrained}, tasks, tokenizer=data.tokenizer,
                                   task_ident=ident, metric="perplexity", batch_size=32)
    # per example the metric is the target's log-likelihood; lm-eval's perplexity is exp(-mean) of the same values
    assert r["n"] == 500 and r["metric"] == "perplexity" and r["acc_fp"] < 0 and r["acc_q"] < 0
    assert r["metrics_fp"]["perplexity"] == pytest.approx(math.exp(-r["acc_fp"]), rel=1e-6)
    assert r["metrics_q"]["perplexity"] == pytest.approx(math.exp(-r["acc_q"]), rel=1e-6)
    assert r["acc_drop"] == pytest.approx(r["acc_fp"] - r["acc_q"]) and r["acc_drop"] > 10 * r["acc_drop_se"] > 0, r


@pytest.mark.e2e
def test_eval_cli_builtin_tasks_with_quantizer(tmp_path, kjv_small):
    """`quantdyn eval CKPT --quantizers rtn2 --tasks ...` prints the table and stores accuracy rows."""
    import json as _json
    import os as _os
    import subprocess as _sp
    import sys as _sys

    from conftest import tiny_run_dict

    from quantdyn.config import from_dict
    from quantdyn.results.store import ResultStore
    from quantdyn.train.config import RunConfig
    from quantdyn.train.trainer import train

    data_cfg, _ = kjv_small
    d = tiny_run_dict(tmp_path, data_cfg, steps=4, checkpoint_every=4, seq_len=64)
    d["model"]["max_seq_len"] = 256
    run = train(from_dict(RunConfig, d), progress=False)
    ck = str(run / "checkpoints" / "step-0000004")
    exe = [_sys.executable, "-m", "quantdyn.cli", "eval", ck, "--tasks", "quantdyn_nextsent", "--quantizers", "rtn2",
           "--limit", "20", "--store", str(tmp_path / "st")]
    r = _sp.run(exe + ["--json"], capture_output=True, text=True, env=dict(_os.environ))
    assert r.returncode == 0, r.stderr[-2000:]
    rows = _json.loads(r.stdout.strip().splitlines()[-1])
    assert rows and all(x["kind"] == "accuracy" and x["task"] == "quantdyn_nextsent" and x["n"] == 20 for x in rows)
    assert all(abs(x["acc_drop"] - (x["acc_fp"] - x["acc_q"])) < 1e-12 for x in rows)
    assert len(ResultStore(tmp_path / "st").rows()) == len(rows)
    r = _sp.run(exe[:-2] + ["--store", ""], capture_output=True, text=True, env=dict(_os.environ))
    assert r.returncode == 0 and "quantdyn_nextsent" in r.stdout
