"""quantdyn's lm-eval adapter (evaluate/lm_eval_tasks.make_lm) against lm-eval's own HFLM.

One tiny GPT-NeoX checkpoint on disk, evaluated by both: quantdyn's adapter on quantdyn's GPT
loaded from it, HFLM on transformers' GPTNeoXForCausalLM loaded from the same directory. Tasks:
the two built-in offline tasks (quantdyn_lastword: loglikelihood with is_greedy; quantdyn_nextsent:
multiple choice) and one task in the format of a hub task (ARC-Easy's YAML: Jinja templates over
question/choices/answerKey) whose data is a local JSONL file. Per request the log-likelihoods must
agree within 1e-4 (or 4 float32 ULPs of
the total for continuations of several hundred nats) and the greedy flags exactly; per example the accuracies exactly.
"""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("lm_eval")

from quantdyn.evaluate.lm_eval_tasks import make_lm, prepare_tasks, run_tasks  # noqa: E402
from quantdyn.models.gpt import GPT, ModelConfig, resolve_model_config  # noqa: E402
from quantdyn.models.hf_io import load_gpt, save_hf  # noqa: E402


ARC_STYLE_YAML = """\
task: local_arc_style
dataset_path: json
dataset_kwargs:
  data_files:
    test: {test}
output_type: multiple_choice
test_split: test
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{choices.label.index(answerKey)}}}}"
doc_to_choice: "{{{{choices.text}}}}"
should_decontaminate: true
doc_to_decontamination_query: "Question: {{{{question}}}}\\nAnswer:"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

_QUESTIONS = [
    ("Who created the heaven and the earth?", ["God", "Moses", "Pharaoh", "the serpent"], "A"),
    ("What did God divide from the darkness?", ["the waters", "the light", "the land", "the firmament"], "B"),
    ("Where did the LORD God plant a garden?", ["in Egypt", "in Babylon", "eastward in Eden", "in Canaan"], "C"),
    ("Who was the first man?", ["Noah", "Abraham", "Cain", "Adam"], "D"),
    ("What did Noah build?", ["an ark", "a tower", "a temple", "a wall"], "A"),
    ("Who slew Abel?", ["Seth", "Cain", "Enoch", "Lamech"], "B"),
    ("What was the name of Abraham's wife?", ["Rebekah", "Rachel", "Sarah", "Leah"], "C"),
    ("Which sea did Moses cross?", ["the Dead sea", "the great sea", "the sea of Galilee", "the Red sea"], "D"),
    ("How many days and nights did it rain?", ["forty", "seven", "three", "twelve"], "A"),
    ("Who was sold into Egypt by his brethren?", ["Benjamin", "Joseph", "Judah", "Reuben"], "B"),
]


@pytest.fixture(scope="module")
def checkpoint(kjv_small, tmp_path_factory):
    _, data = kjv_small
    torch.manual_seed(0)
    model = GPT(resolve_model_config(ModelConfig(n_layer=2, d_model=32, n_head=2, max_seq_len=256), data.vocab_size))
    d = tmp_path_factory.mktemp("ckpt") / "tiny"
    save_hf(model, d)
    data.tokenizer.save_pretrained(str(d))
    return d, data


@pytest.fixture(scope="module")
def tasks(checkpoint, tmp_path_factory):
    _, data = checkpoint
    tdir = tmp_path_factory.mktemp("tasks")
    rows = [{"id": f"q{i}", "question": q, "choices": {"text": c, "label": ["A", "B", "C", "D"]}, "answerKey": k}
            for i, (q, c, k) in enumerate(_QUESTIONS)]
    (tdir / "local_arc_style.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tdir / "local_arc_style.yaml").write_text(ARC_STYLE_YAML.format(test=tdir / "local_arc_style.jsonl"))
    return tdir, data


def _run(lm, tdir, data):
    loaded, _ = prepare_tasks(["quantdyn_lastword", "quantdyn_nextsent", "local_arc_style"], data=data, seed=0,
                              builtin_n=24, task_dir=tdir / "builtin", include_paths=[tdir])
    return run_tasks(lm, loaded, num_fewshot=0, seed=0)


def test_adapter_matches_hflm(checkpoint, tasks):
    from lm_eval.models.huggingface import HFLM

    ckpt, data = checkpoint
    tdir, _ = tasks
    ours = make_lm(load_gpt(ckpt), data.tokenizer, batch_size=5)
    theirs = HFLM(pretrained=str(ckpt), tokenizer=str(ckpt), device="cpu", dtype="float32", batch_size=5)
    assert theirs.max_length == ours.max_length == 256
    res_ours, res_theirs = _run(ours, tdir, data), _run(theirs, tdir, data)
    compared, worst = 0, 0.0
    for task in ("quantdyn_lastword", "quantdyn_nextsent", "local_arc_style"):
        a = sorted(res_ours["samples"][task], key=lambda s: s["doc_id"])
        b = sorted(res_theirs["samples"][task], key=lambda s: s["doc_id"])
        assert [s["doc_id"] for s in a] == [s["doc_id"] for s in b] and len(a) > 0
        for sa, sb in zip(a, b):
            assert len(sa["resps"]) == len(sb["resps"])
            for (ra,), (rb,) in zip(sa["resps"], sb["resps"]):
                ll_a, greedy_a = ra
                ll_b, greedy_b = rb
                worst = max(worst, abs(ll_a - ll_b))
                # 1e-4, or a few float32 ULPs of the sum for long continuations (|ll| of several hundred nats:
                # the two models add the same terms in another order)
                tol = max(1e-4, 4 * 2.0**-23 * abs(ll_b))
                assert abs(ll_a - ll_b) <= tol, (task, sa["doc_id"], ll_a, ll_b)
                assert bool(greedy_a) == bool(greedy_b), (task, sa["doc_id"])
                compared += 1
            for metric in ("acc", "acc_norm"):
                if metric in sa:
                    assert sa[metric] == sb[metric], (task, sa["doc_id"], metric)
        for metric in ("acc,none", "acc_norm,none"):
            if metric in res_ours["results"][task]:
                assert res_ours["results"][task][metric] == res_theirs["results"][task][metric]
    print(f"requests compared: {compared}, largest |Δ log-likelihood|: {worst:.2e}")
    assert compared > 100  # 24 lastword + 24 x 4 nextsent + 10 x 4 ARC-style requests
