"""Built-in offline lm-eval tasks, generated from quantdyn's held-out split.

These are **not standard benchmarks**: their numbers are comparable only
between models evaluated on the same generated files (same token cache, same
seed, same ``n``), never with published LAMBADA or HellaSwag figures.  They
exist so that downstream accuracy can be measured with no network, on text the
model was never trained on (the ``val`` split of a :class:`TokenData`).

How they are built (deterministic for a seed):

1. the ``val`` token shard is cut into documents at EOS and each document is
   decoded with the shard's tokenizer; whitespace runs become one space;
2. each document is split into sentences after ``.``, ``?`` or ``!``;
   sentences of 4..60 words are *usable*;
3. ``quantdyn_lastword`` (LAMBADA-style, scored like ``lambada_openai``): for a
   usable sentence, the passage is that sentence and the preceding sentences
   of its document, up to 120 words; the passage's final punctuation is
   dropped, its last word (letters only) is the target and the rest is the
   context.  ``acc`` = the target is the model's greedy continuation
   (loglikelihood ``is_greedy``); ``perplexity`` of the target as well;
4. ``quantdyn_nextsent`` (multiple choice; ``acc``, ``acc_norm`` and
   ``acc_mutual_info``): the context is up to 120 words of consecutive
   sentences, the true choice is the sentence that follows them, and 3
   distractors are usable sentences, not first in their document, drawn at
   random from *other* documents.  The true sentence comes from the same
   pool, so the four choices are exchangeable except for their relation to
   the context: a model that ignores the context scores 25 % on average
   (± 2 % at n=500), whatever its length bias.  Only context use helps, and
   very small models use little: a 1-layer width-32 model trained for 200
   steps on KJV stays at chance on ``acc`` (the choice's own likelihood swamps
   the context's effect) and reaches only ~0.28-0.33 on ``acc_mutual_info``
   (log P(choice | context) − log P(choice)) against ~0.24-0.30 untrained.

Candidates are shuffled with ``numpy.random.default_rng(seed)``; the first
``n`` form the ``test`` split and up to 32 further ones a ``train`` split used
only for few-shot examples (so ``--num-fewshot K`` works).  Few-shot examples
come from the same held-out documents as the test examples, not from separate
ones.  Files land in ``<out_dir>/``: ``quantdyn_lastword.yaml``,
``quantdyn_nextsent.yaml`` (lm-eval task configs using ``dataset_path: json``
with ``data_files`` pointing at the jsonl files beside them), the jsonl files
and ``manifest.json``; load them with ``TaskManager(include_path=out_dir)``.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np

from quantdyn.data.prepare import default_cache_dir
from quantdyn.errors import QuantdynError
from quantdyn.files import atomic_dir, write_json_atomic

LASTWORD = "quantdyn_lastword"
NEXTSENT = "quantdyn_nextsent"
BUILTIN_TASKS = (LASTWORD, NEXTSENT)
"""Names of the built-in offline tasks."""

TASKS_VERSION = 1
"""Bumped whenever the generation procedure changes (it is part of every task's identity)."""

MIN_WORDS, MAX_WORDS, MAX_CONTEXT_WORDS, N_FEWSHOT, N_DISTRACTORS = 4, 60, 120, 32, 3

_SENTENCE_END = re.compile(r"(?<=[.?!])\s+")
_WORD = re.compile(r"^[A-Za-z]+$")

# lm-eval task configs; {test}/{train} are the absolute jsonl paths.  Fields are named directly
# (doc_to_text: context) rather than through Jinja templates, which lm-eval recompiles per example.
LASTWORD_YAML = """\
task: quantdyn_lastword
dataset_path: json
dataset_kwargs:
  data_files:
    test: {test}
    train: {train}
output_type: loglikelihood
training_split: train
test_split: test
doc_to_text: context
doc_to_target: target
target_delimiter: ""
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: {version}
  description: "quantdyn built-in, not a standard benchmark: last word of held-out passages (LAMBADA-style)"
"""

NEXTSENT_YAML = """\
task: quantdyn_nextsent
dataset_path: json
dataset_kwargs:
  data_files:
    test: {test}
    train: {train}
output_type: multiple_choice
training_split: train
test_split: test
doc_to_text: context
doc_to_choice: choices
doc_to_target: label
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
  - metric: acc_mutual_info
    aggregation: mean
    higher_is_better: true
metadata:
  version: {version}
  description: "quantdyn built-in, not a standard benchmark: next sentence of a held-out passage among 4"
"""


def val_documents(data) -> list[str]:
    """The ``val`` split of a TokenData as decoded documents (split at EOS, whitespace collapsed)."""
    toks = np.asarray(data.val, dtype=np.int64)
    ends = np.flatnonzero(toks == data.eos_id)
    docs, start = [], 0
    for end in [*ends.tolist(), len(toks)]:
        if end > start:
            text = " ".join(data.tokenizer.decode(toks[start:end].tolist()).split())
            if text:
                docs.append(text)
        start = end + 1
    return docs


def split_sentences(text: str) -> list[str]:
    """Sentences of a whitespace-normalised text, split after '.', '?' or '!'."""
    return [s for s in _SENTENCE_END.split(text) if s]


def _usable(sentence: str) -> bool:
    return MIN_WORDS <= len(sentence.split()) <= MAX_WORDS


def _context(sentences: list[str], end: int, include_end: bool) -> str:
    """Sentences before ``end`` (and ``end`` itself if include_end), at most MAX_CONTEXT_WORDS words,
    always at least the sentence just before the cut."""
    last = end + 1 if include_end else end
    words = 0
    start = last
    while start > 0:
        n = len(sentences[start - 1].split())
        if start < last and words + n > MAX_CONTEXT_WORDS:
            break
        words += n
        start -= 1
    return " ".join(sentences[start:last])


def _lastword_candidates(docs: list[list[str]]) -> list[dict]:
    out = []
    for sents in docs:
        for i, s in enumerate(sents):
            if not _usable(s):
                continue
            passage = _context(sents, i, include_end=True).rstrip(".?!\"')")
            context, _, target = passage.rpartition(" ")
            if context and _WORD.match(target) and len(target) > 1:
                out.append({"context": context, "target": " " + target})  # the scored continuation
    return out


def _nextsent_candidates(docs: list[list[str]], rng: np.random.Generator) -> list[dict]:
    # true sentences and distractors come from one pool (usable, not first in their document), so the four
    # choices are exchangeable except for how they relate to the context
    pool = [(d, s) for d, sents in enumerate(docs) for i, s in enumerate(sents) if i > 0 and _usable(s)]
    if len({d for d, _ in pool}) < 2:
        return []
    out = []
    for d, sents in enumerate(docs):
        for i in range(1, len(sents)):
            true = sents[i]
            if not _usable(true):
                continue
            distractors: list[str] = []
            for _ in range(100 * N_DISTRACTORS):  # bounded: a tiny pool may not have enough distinct sentences
                od, s = pool[int(rng.integers(len(pool)))]
                if od != d and s != true and s not in distractors:
                    distractors.append(s)
                    if len(distractors) == N_DISTRACTORS:
                        break
            if len(distractors) < N_DISTRACTORS:
                continue
            label = int(rng.integers(N_DISTRACTORS + 1))
            choices = distractors[:label] + [true] + distractors[label:]
            out.append({"context": _context(sents, i, include_end=False), "choices": choices, "label": label})
    return out


def _take(cands: list[dict], rng: np.random.Generator, n: int) -> tuple[list[dict], list[dict]]:
    order = rng.permutation(len(cands))
    picked = [cands[k] for k in order[: n + N_FEWSHOT]]
    test, train = picked[:n], picked[n:]
    if len(test) < n and len(test) > N_FEWSHOT:  # too few candidates: keep the few-shot pool anyway
        test, train = picked[: len(picked) - N_FEWSHOT], picked[len(picked) - N_FEWSHOT:]
    return test, train


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, sort_keys=True, ensure_ascii=False) + "\n" for r in rows))


def default_task_dir(data, seed: int, n: int) -> Path:
    """``$QUANTDYN_CACHE/tasks/<data key>-s<seed>-n<n>`` (or .cache/quantdyn/...)."""

    return default_cache_dir().parent / "tasks" / f"{data.data_hash}-s{seed}-n{n}"


def task_files_hash(directory: str | Path) -> str:
    """Content hash of the generated jsonl files (part of each accuracy row's identity)."""
    h = hashlib.sha256()
    for p in sorted(Path(directory).glob("*.jsonl")):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def build_builtin_tasks(data, out_dir: str | Path | None = None, seed: int = 0, n: int = 500) -> Path:
    """Generate quantdyn_lastword and quantdyn_nextsent from ``data``'s val split into ``out_dir``.

    Deterministic: the same (data, seed, n) always gives byte-identical jsonl files
    (the YAMLs differ only in the absolute directory they name).  An existing
    directory built with the same parameters is reused.  Returns the directory
    (pass it as ``include_path`` to an lm-eval TaskManager).
    """

    if n < 1:
        raise QuantdynError(f"built-in tasks need n >= 1 examples, got {n}")
    out = Path(out_dir) if out_dir is not None else default_task_dir(data, seed, n)
    want = {"version": TASKS_VERSION, "data_key": data.data_hash, "seed": seed, "n": n}
    manifest = out / "manifest.json"
    if manifest.is_file():
        try:
            have = json.loads(manifest.read_text())
        except json.JSONDecodeError:
            have = {}
        if {k: have.get(k) for k in want} == want and all((out / f"{t}.yaml").is_file() for t in BUILTIN_TASKS):
            return out

    docs = [split_sentences(d) for d in val_documents(data)]
    rng = np.random.default_rng(seed)
    lastword_test, lastword_train = _take(_lastword_candidates(docs), rng, n)
    nextsent_test, nextsent_train = _take(_nextsent_candidates(docs, rng), rng, n)
    if not lastword_test or not nextsent_test:
        raise QuantdynError(
            f"the held-out split of '{data.manifest.get('source')}' has too few sentences for the built-in tasks "
            f"({len(docs)} documents); use more data or a larger data.val_fraction"
        )
    with atomic_dir(out) as tmp:
        counts = {}
        for task, test, train, template in ((LASTWORD, lastword_test, lastword_train, LASTWORD_YAML),
                                            (NEXTSENT, nextsent_test, nextsent_train, NEXTSENT_YAML)):
            _write_jsonl(tmp / f"{task}.test.jsonl", test)
            _write_jsonl(tmp / f"{task}.train.jsonl", train)
            # the files are renamed into ``out`` with the directory, so the YAML names their final place
            (tmp / f"{task}.yaml").write_text(template.format(
                test=json.dumps(str((out / f"{task}.test.jsonl").resolve())),
                train=json.dumps(str((out / f"{task}.train.jsonl").resolve())),
                version=f"{TASKS_VERSION}.0"))
            counts[task] = {"test": len(test), "train": len(train)}
        write_json_atomic(tmp / "manifest.json", {**want, "source": data.manifest.get("source"),
                                                  "documents": len(docs), "examples": counts})
    return out
