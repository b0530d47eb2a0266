"""Downstream accuracy with EleutherAI's lm-evaluation-harness (the ``eval`` extra).

    rows = accuracy_rows_for_point(fp_model, {"gptq3": quantized_model}, ["quantdyn_nextsent", "arc_easy"],
                                   tokenizer=tok, quant_configs={"gptq3": qc}, limit=200)
    print(format_accuracy_table(rows))

(``quantdyn.study.accuracy.evaluate_accuracy`` is the command's entry point: it loads a
checkpoint, quantizes it through the streamed engine and calls the functions here.)

* :class:`QuantdynLM` is an lm-eval ``LM`` for a model **in memory** — a
  quantdyn GPT, a fake-quantized copy, or any HF causal LM — so a quantized
  model is evaluated without being saved first.  ``loglikelihood`` scores
  continuations in batches (contexts truncated from the left to the model's
  maximum length), ``loglikelihood_rolling`` follows lm-eval's disjoint
  rolling windows, ``generate_until`` decodes greedily in batches until a
  stop string or ``max_gen_toks``.
* ``backend="hf"`` uses lm-eval's own ``hf`` model (HFLM) instead: built from
  the checkpoint path when only the full-precision model is evaluated, else
  from the transformers model loaded once and its quantized deep copies —
  nothing is re-saved to disk to be evaluated.
* :func:`accuracy_rows_for_point` measures the full-precision model and each
  quantized copy on the same examples and returns result rows (``kind:
  "accuracy"``) with the accuracy of both, the drop and its *paired* standard
  error over examples.  The metric is ``acc``, else ``acc_norm``, else
  ``exact_match`` (the row's ``metric`` says which).
* Tasks are lm-eval names (hub datasets, downloaded by ``datasets`` when
  online) or the built-in offline tasks ``quantdyn_lastword`` and
  ``quantdyn_nextsent`` (see :mod:`quantdyn.evaluate.tasks`; generated from the
  held-out split, not standard benchmarks).  A task whose dataset cannot be
  loaded ends in one :class:`QuantdynError` line naming the dataset.

lm-eval's own per-task standard errors are not used (``bootstrap_iters=0``:
its bootstrap spawns a process pool); the rows carry closed-form SEs of the
per-example values instead.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from quantdyn.errors import QuantdynError
from quantdyn.evaluate.loss import model_device
from quantdyn.evaluate.tasks import BUILTIN_TASKS, build_builtin_tasks, task_files_hash
from quantdyn.models.gpt import GPT, logits_of
from quantdyn.runtime import provenance

METRIC_PREFERENCE = ("acc", "acc_norm", "exact_match")
"""The accuracy reported per task: the first of these that the task computes."""

INSTALL_HINT = "install the eval extra: pip install 'quantdyn[eval]' (or pip install 'lm-eval[hf]>=0.4.5')"

__all__ = [
    "QuantdynLM", "accuracy_rows_for_point", "format_accuracy_table", "load_tasks",
    "METRIC_PREFERENCE", "BUILTIN_TASKS",
]


def _lm_eval():
    try:
        import lm_eval  # noqa: F401
        from lm_eval.api.model import TemplateLM
    except ImportError:
        raise QuantdynError(f"downstream evaluation needs lm-evaluation-harness; {INSTALL_HINT}") from None
    return TemplateLM


@contextlib.contextmanager
def _quiet(enabled: bool):
    """lm-eval logs every task and request batch at INFO; keep it to warnings unless asked."""
    if not enabled:
        yield
        return
    loggers = [logging.getLogger(n) for n in ("lm_eval", "lm-eval")]
    old = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for lg, lvl in zip(loggers, old):
            lg.setLevel(lvl)


def max_length_of(model: nn.Module, tokenizer=None, default: int = 2048) -> int:
    """Longest sequence the model takes: quantdyn max_seq_len, else HF position limits, else ``default``."""
    if isinstance(model, GPT):
        return int(model.config.max_seq_len)
    cfg = getattr(model, "config", None)
    for attr in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "n_ctx"):
        v = getattr(cfg, attr, None)
        if isinstance(v, int) and v > 0:
            return v
    v = getattr(tokenizer, "model_max_length", None)
    if isinstance(v, int) and 0 < v < 1_000_000:
        return v
    return default


# --------------------------------------------------------------------------- the adapter
def _make_adapter_class():
    TemplateLM = _lm_eval()
    from lm_eval import utils as lm_utils

    class QuantdynLM(TemplateLM):
        """lm-eval ``LM`` for a causal LM held in memory (quantdyn GPT, fake-quantized copy or HF model).

        Token ids come from ``tokenizer`` without special tokens; an empty
        context is conditioned on the EOS token (quantdyn's document separator).
        Requests are sorted by length and run ``batch_size`` at a time, padded
        on the right (causal attention: padding after a position never
        changes it).  Contexts longer than ``max_length`` lose tokens on the left.
        """

        def __init__(self, model: nn.Module, tokenizer, *, batch_size: int = 16, max_length: int | None = None,
                     max_gen_toks: int = 256, progress: bool = False):
            super().__init__()
            if tokenizer is None:
                raise QuantdynError("QuantdynLM needs the model's tokenizer (pass tokenizer=...)")
            eos = tokenizer.eos_token_id
            if eos is None:
                raise QuantdynError("the tokenizer has no EOS token; lm-eval needs one to condition empty contexts")
            if batch_size < 1:
                raise QuantdynError(f"batch_size must be >= 1, got {batch_size}")
            self.model = model.eval()
            self.tokenizer = tokenizer
            self.batch_size = int(batch_size)
            self._max_length = int(max_length or max_length_of(model, tokenizer))
            self.max_gen_toks = int(max_gen_toks)
            self.progress = progress
            self._eos = int(eos)
            self._device = model_device(model)
            # a multiple-choice context is encoded once per choice: cache recent strings
            self._encode = functools.lru_cache(maxsize=8192)(self._encode_uncached)

        # -- what TemplateLM asks for
        @property
        def eot_token_id(self) -> int:
            return self._eos

        @property
        def max_length(self) -> int:
            return self._max_length

        @property
        def tokenizer_name(self) -> str:
            return getattr(self.tokenizer, "name_or_path", "quantdyn").replace("/", "__")

        def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
            if add_special_tokens:
                return self.tokenizer(string, add_special_tokens=True)["input_ids"]
            return list(self._encode(string))

        def _encode_uncached(self, string: str) -> tuple[int, ...]:
            return tuple(self.tokenizer(string, add_special_tokens=False)["input_ids"])

        def tok_decode(self, tokens: list[int]) -> str:
            return self.tokenizer.decode(tokens)

        # -- scoring
        @torch.no_grad()
        def _logprobs(self, rows: list[list[int]]) -> list[torch.Tensor]:
            """Log-softmax (len_i - 1, V) of each token row, in one right-padded forward."""
            T = max(len(r) for r in rows) - 1  # the last token of a row is only a target
            x = torch.zeros(len(rows), T, dtype=torch.long)
            for i, r in enumerate(rows):
                x[i, : len(r) - 1] = torch.tensor(r[:-1], dtype=torch.long)
            logits = logits_of(self.model, x.to(self._device)).float()  # (B, T, V)
            return [F.log_softmax(logits[i, : len(r) - 1], dim=-1) for i, r in enumerate(rows)]

        def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
            return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not self.progress)

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
            """requests: ((context, continuation) | None, context_ids, continuation_ids) -> (logprob, is_greedy)."""
            from tqdm import tqdm

            L = self.max_length
            out: list[tuple[float, bool] | None] = [None] * len(requests)
            order = sorted(range(len(requests)), key=lambda i: -(len(requests[i][1]) + len(requests[i][2])))
            bar = tqdm(total=len(requests), desc="loglikelihood", disable=disable_tqdm or not self.progress)
            for start in range(0, len(order), self.batch_size):
                idx = order[start : start + self.batch_size]
                rows, n_cont = [], []
                for i in idx:
                    _, ctx, cont = requests[i]
                    if not cont:
                        raise QuantdynError("lm-eval asked for the likelihood of an empty continuation")
                    if len(cont) > L:
                        raise QuantdynError(
                            f"a task continuation of {len(cont)} tokens does not fit the model's {L}-token context; "
                            "evaluate a model with a longer max_seq_len or pick tasks with shorter answers")
                    rows.append((list(ctx) + list(cont))[-(L + 1):])  # left-truncate to L inputs + 1 target
                    n_cont.append(len(cont))
                for i, row, k, lp in zip(idx, rows, n_cont, self._logprobs(rows)):
                    # inputs row[:-1] predict row[1:]; the continuation is the last k targets
                    target = torch.tensor(row[-k:], dtype=torch.long, device=lp.device)
                    lp_cont = lp[-k:]
                    ll = float(lp_cont.gather(1, target[:, None]).sum())
                    greedy = bool((lp_cont.argmax(dim=-1) == target).all())
                    out[i] = (ll, greedy)
                    if requests[i][0] is not None:
                        self.cache_hook.add_partial("loglikelihood", requests[i][0], (ll, greedy))
                bar.update(len(idx))
            bar.close()
            return out  # type: ignore[return-value]

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
            """Total log-likelihood of each text, in lm-eval's disjoint rolling windows of max_length."""
            windows, owner = [], []
            for k, (string,) in enumerate(req.args for req in requests):
                for ctx, cont in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                        token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                        max_seq_len=self.max_length, context_len=1)):
                    windows.append((None, ctx, cont))
                    owner.append(k)
            totals = [0.0] * len(requests)
            for k, (ll, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)):
                totals[k] += ll
            for req, total in zip(requests, totals):
                self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
            return totals

        # -- generation
        @torch.no_grad()
        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            """Greedy decoding, batched; stops at any ``until`` string (cut there), EOS or ``max_gen_toks``."""
            out: list[str | None] = [None] * len(requests)
            jobs = []
            for i, req in enumerate(requests):
                context, kw = req.args
                kw = dict(kw or {})
                if kw.pop("do_sample", False) and float(kw.get("temperature", 1.0) or 0.0) > 0.0:
                    raise QuantdynError("the quantdyn lm-eval adapter decodes greedily; the task asks for sampling "
                                        "(do_sample=True) — run it with --backend hf")
                until = kw.pop("until", None) or []
                until = [until] if isinstance(until, str) else list(until)
                eos_text = self.tok_decode([self._eos])
                if eos_text and eos_text not in until:
                    until.append(eos_text)
                max_new = int(kw.pop("max_gen_toks", kw.pop("max_new_tokens", self.max_gen_toks)))
                max_new = max(1, min(max_new, self.max_length - 1))
                ctx = self.tok_encode(context) or [self.prefix_token_id]
                ctx = ctx[-(self.max_length - max_new):]  # left-truncate so context + generation fit
                jobs.append((i, ctx, until, max_new))
            jobs.sort(key=lambda j: -len(j[1]))
            for start in range(0, len(jobs), self.batch_size):
                for i, text in self._greedy_batch(jobs[start : start + self.batch_size]):
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
            return out  # type: ignore[return-value]

        def _greedy_batch(self, jobs) -> list[tuple[int, str]]:
            B = len(jobs)
            lengths = [len(c) for _, c, _, _ in jobs]
            budget = max(len(c) + m for _, c, _, m in jobs)
            buf = torch.zeros(B, budget, dtype=torch.long)
            for b, (_, ctx, _, _) in enumerate(jobs):
                buf[b, : len(ctx)] = torch.tensor(ctx, dtype=torch.long)
            generated: list[list[int]] = [[] for _ in jobs]
            texts = [""] * B
            active = set(range(B))
            while active:
                T = max(lengths[b] for b in active)
                rows = sorted(active)
                logits = logits_of(self.model, buf[rows, :T].to(self._device))  # (b, T, V), right-padded
                for r, b in enumerate(rows):
                    tok = int(logits[r, lengths[b] - 1].argmax())
                    buf[b, lengths[b]] = tok
                    lengths[b] += 1
                    generated[b].append(tok)
                    texts[b] = self.tok_decode(generated[b])
                    _, _, until, max_new = jobs[b]
                    if any(s in texts[b] for s in until) or len(generated[b]) >= max_new:
                        active.discard(b)
            results = []
            for b, (i, _, until, _) in enumerate(jobs):
                text = texts[b]
                for s in until:
                    if s:
                        text = text.split(s)[0]
                results.append((i, text))
            return results

    return QuantdynLM


_ADAPTER = None


def __getattr__(name: str):
    # QuantdynLM subclasses lm-eval's TemplateLM, so it is built on first use: importing this module must
    # not require the optional lm-eval dependency.
    if name == "QuantdynLM":
        global _ADAPTER
        if _ADAPTER is None:
            _ADAPTER = _make_adapter_class()
        return _ADAPTER
    raise AttributeError(name)


def make_lm(model: nn.Module, tokenizer, **kwargs):
    """A :class:`QuantdynLM` for ``model`` (kwargs: batch_size, max_length, max_gen_toks, progress)."""
    return __getattr__("QuantdynLM")(model, tokenizer, **kwargs)


# --------------------------------------------------------------------------- tasks
def _dataset_of_failure(exc: BaseException) -> str | None:
    """The dataset a failed lm-eval task was loading: read from the Task whose download() raised."""
    tb = exc.__traceback__
    found = None
    while tb is not None:
        obj = tb.tb_frame.f_locals.get("self")
        path = getattr(obj, "DATASET_PATH", None)
        if isinstance(path, str):
            name = getattr(obj, "DATASET_NAME", None)
            found = f"{path}" + (f" (config '{name}')" if name else "")
        tb = tb.tb_next
    return found


def _dataset_of_config(tm, name: str) -> str | None:
    """dataset_path (and dataset_name) from a registered task's YAML, without loading it."""
    entry = tm.task_index.get(name)
    path = getattr(entry, "yaml_path", None)
    if not path:
        return None
    try:
        from lm_eval.tasks._yaml_loader import load_yaml

        cfg = load_yaml(path, resolve_func=False, recursive=True)
    except Exception:  # an unreadable YAML just means we cannot name the dataset
        return None
    ds = cfg.get("dataset_path")
    return None if not ds else ds + (f" (config '{cfg['dataset_name']}')" if cfg.get("dataset_name") else "")


def task_manager(include_paths: Sequence[str | Path] = (), include_defaults: bool = True):
    """An lm-eval TaskManager over extra task directories (the defaults take ~10 s to index)."""
    _lm_eval()
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=[str(p) for p in include_paths] or None, include_defaults=include_defaults)


def load_tasks(names: Sequence[str], tm=None) -> dict[str, Any]:
    """Load lm-eval tasks by name -> {leaf task name: Task}; user errors become one-line QuantdynErrors.

    A task whose data cannot be loaded (offline, no cache, gated dataset) is
    reported with the dataset it needs instead of a ``datasets`` traceback.
    """
    from quantdyn.errors import did_you_mean

    tm = tm or task_manager()
    out: dict[str, Any] = {}
    for name in names:
        if name not in tm.task_index:
            raise QuantdynError(
                f"unknown lm-eval task '{name}'{did_you_mean(name, tm.all_tasks)}; list them with `lm-eval ls tasks`"
                + (f" (built-in offline tasks: {', '.join(BUILTIN_TASKS)})" if not name.startswith("quantdyn_") else "")
            )
        try:
            loaded = tm.load([name])
        except Exception as e:  # lm-eval/datasets raise many types (ConnectionError, DatasetNotFoundError, ...)
            ds = _dataset_of_failure(e) or _dataset_of_config(tm, name) or "its dataset"
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise QuantdynError(
                f"lm-eval task '{name}' needs the dataset {ds}, which could not be loaded ({type(e).__name__}: "
                f"{first[:200]}); connect to the Hugging Face Hub once to cache it (or copy it into HF_DATASETS_CACHE), "
                f"or use an offline task: {', '.join(BUILTIN_TASKS)}"
            ) from None
        out.update(loaded["tasks"])
    return out


def _split_names(tasks: str | Iterable[str]) -> list[str]:
    names = tasks.split(",") if isinstance(tasks, str) else list(tasks)
    names = [n.strip() for n in names if n and n.strip()]
    if not names:
        raise QuantdynError("no tasks given; pass e.g. --tasks quantdyn_nextsent,arc_easy")
    return list(dict.fromkeys(names))


def prepare_tasks(tasks: str | Iterable[str], *, data=None, seed: int = 0, builtin_n: int = 500,
                  task_dir: str | Path | None = None, include_paths: Sequence[str | Path] = ()) -> tuple[dict, dict]:
    """Resolve task names (building the built-in ones from ``data`` if asked for) and load them.

    Returns ({task name: Task}, {task name: identity dict for result rows}).
    The default lm-eval index is only built when a non-built-in task is requested.
    """
    names = _split_names(tasks)
    paths = [Path(p) for p in include_paths]
    ident: dict[str, dict] = {}
    builtin = [n for n in names if n in BUILTIN_TASKS]
    if builtin:
        if data is None:
            raise QuantdynError(
                f"the built-in tasks ({', '.join(builtin)}) are generated from held-out text: pass data= "
                "(a TokenData, e.g. prepare_data(DataConfig(...)))"
            )
        d = build_builtin_tasks(data, task_dir, seed=seed, n=builtin_n)
        paths.insert(0, d)
        files = task_files_hash(d)
        for n in builtin:
            ident[n] = {"task_data": data.data_hash, "task_seed": seed, "task_n": builtin_n, "task_files_hash": files}
    needs_defaults = any(n not in BUILTIN_TASKS for n in names) and not _all_in_paths(names, builtin, paths)
    with _quiet(True):
        tm = task_manager(paths, include_defaults=needs_defaults)
        loaded = load_tasks(names, tm)
    return loaded, ident


def _all_in_paths(names, builtin, paths) -> bool:
    """True when every non-built-in task is a YAML of that name in an include path (skip the big index)."""
    rest = [n for n in names if n not in builtin]
    if not rest or not paths:
        return False
    have = set()
    for p in paths:
        for y in Path(p).rglob("*.yaml"):
            have.add(y.stem)
    return all(n in have for n in rest)


# --------------------------------------------------------------------------- running
def _seed_all(seed: int) -> None:
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def run_tasks(lm, tasks: Mapping[str, Any], *, num_fewshot: int = 0, limit: int | float | None = None,
              seed: int = 0, quiet: bool = True) -> dict:
    """Run lm-eval's evaluator on already loaded tasks; returns its results dict (with per-example samples)."""
    from lm_eval.evaluator import evaluate

    for task in tasks.values():
        # unlike simple_evaluate, the requested count always wins (also over a YAML's num_fewshot: 0),
        # so a row's num_fewshot is what ran
        task.set_config(key="num_fewshot", value=num_fewshot)
        task.set_fewshot_seed(seed=seed)
    _seed_all(seed)
    with _quiet(quiet):
        res = evaluate(lm=lm, task_dict={"tasks": dict(tasks), "groups": {}, "group_map": {}}, limit=limit,
                       bootstrap_iters=0, log_samples=True)
    return res


def _pick_metric(samples: list[dict], metric: str | None, task: str) -> str:
    have = set(samples[0].get("metrics", [])) if samples else set()
    if metric:
        if metric not in have:
            raise QuantdynError(f"task '{task}' does not compute '{metric}' (it computes {', '.join(sorted(have))})")
        return metric
    for m in METRIC_PREFERENCE:
        if m in have:
            return m
    raise QuantdynError(
        f"task '{task}' reports no accuracy ({', '.join(sorted(have)) or 'no metrics'}); "
        f"quantdyn reports one of {', '.join(METRIC_PREFERENCE)}"
    )


def per_example(res: dict, task: str, metric: str | None = None) -> tuple[str, dict[int, float], dict]:
    """(metric, {doc_id: value}, aggregated metrics) of one task in an lm-eval results dict."""
    samples = [s for s in res["samples"].get(task, []) if s.get("filter", "none") == "none"] or \
        res["samples"].get(task, [])
    if not samples:
        raise QuantdynError(f"task '{task}' produced no examples (is --limit 0 or the split empty?)")
    m = _pick_metric(samples, metric, task)
    values = {int(s["doc_id"]): float(s[m]) for s in samples}
    agg = {k.split(",")[0]: v for k, v in res["results"].get(task, {}).items()
           if isinstance(v, (int, float)) and not k.startswith(("alias", "sample")) and "_stderr" not in k}
    return m, values, agg


def _mean_se(x: list[float]) -> tuple[float, float]:
    n = len(x)
    mean = sum(x) / n
    if n < 2:
        return mean, float("nan")
    var = sum((v - mean) ** 2 for v in x) / (n - 1)
    return mean, math.sqrt(var / n)


def state_hash(model: nn.Module) -> str:
    """Content hash of an in-memory model's weights (for models that came from no checkpoint)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
                 if t.numel() else b"")
    return h.hexdigest()[:16]


def accuracy_row_key(checkpoint_hash: str, task: str, task_version: Any, task_ident: dict, num_fewshot: int,
                     limit: Any, seed: int, quant_hash: str, calib_hash: str, metric: str, backend: str) -> str:
    blob = "|".join(str(x) for x in (checkpoint_hash, task, task_version, sorted(task_ident.items()), num_fewshot,
                                     limit, seed, quant_hash, calib_hash, metric, backend))
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _quant_fields(label: str, qc) -> dict:
    if qc is None:
        return {"quantizer": label, "quant_config": None, "quant_config_hash": None}
    from quantdyn.quantize.config import row_fields

    return row_fields(label, qc)


def accuracy_rows_for_point(
    fp_model: nn.Module | Any,
    q_models: Mapping[str, nn.Module | Any],
    tasks: str | Iterable[str] | Mapping[str, Any],
    *,
    tokenizer=None,
    quant_configs: Mapping[str, Any] | None = None,
    base: Mapping[str, Any] | None = None,
    data=None,
    num_fewshot: int = 0,
    limit: int | float | None = None,
    seed: int = 0,
    metric: str | None = None,
    batch_size: int = 16,
    calib_hash: str = "",
    builtin_n: int = 500,
    task_dir: str | Path | None = None,
    include_paths: Sequence[str | Path] = (),
    task_ident: Mapping[str, dict] | None = None,
    backend: str = "quantdyn",
    progress: bool = False,
) -> list[dict]:
    """Accuracy rows for one checkpoint: its full-precision model and already quantized copies.

    ``fp_model`` / ``q_models`` values are nn.Modules (wrapped in QuantdynLM
    with ``tokenizer``) or ready lm-eval ``LM`` objects.  ``base`` holds the
    point's fields (the sweep's ``point_fields``: checkpoint_hash, step, ...);
    ``quant_configs`` maps each label to its QuantConfig (for the row identity).
    ``tasks`` is a list of names or the ``{name: Task}`` of :func:`prepare_tasks`.
    With no ``q_models`` the rows hold the full-precision accuracy only.

    Each row: kind "accuracy", task, task_version, metric, n, acc_fp(_se),
    acc_q(_se), acc_drop = acc_fp - acc_q with its paired SE over examples,
    num_fewshot, limit, seed, quantizer fields, checkpoint_hash, provenance,
    and a ``key`` = hash(checkpoint, task and version, task data, few-shot,
    limit, seed, quantizer config, calibration, metric, backend).
    """
    import lm_eval

    base = dict(base or {})
    if "checkpoint_hash" not in base:
        base["checkpoint_hash"] = state_hash(fp_model) if isinstance(fp_model, nn.Module) else "unknown"
    if isinstance(tasks, Mapping):
        loaded, ident = dict(tasks), dict(task_ident or {})
    else:
        loaded, ident = prepare_tasks(tasks, data=data, seed=seed, builtin_n=builtin_n, task_dir=task_dir,
                                      include_paths=include_paths)
        ident.update(task_ident or {})
    quant_configs = dict(quant_configs or {})

    def as_lm(m):
        if isinstance(m, nn.Module):
            return make_lm(m, tokenizer, batch_size=batch_size, progress=progress)
        return m

    fp = run_tasks(as_lm(fp_model), loaded, num_fewshot=num_fewshot, limit=limit, seed=seed, quiet=not progress)
    qs = {label: run_tasks(as_lm(m), loaded, num_fewshot=num_fewshot, limit=limit, seed=seed, quiet=not progress)
          for label, m in q_models.items()}
    prov = provenance()
    rows = []
    for task in loaded:
        m, v_fp, agg_fp = per_example(fp, task, metric)
        version = fp.get("versions", {}).get(task)
        ids = sorted(v_fp)
        acc_fp, se_fp = _mean_se([v_fp[i] for i in ids])
        common = {
            "kind": "accuracy", **base, "task": task, "task_version": version, **ident.get(task, {}),
            "metric": m, "n": len(ids), "num_fewshot": num_fewshot, "limit": limit, "seed": seed,
            "backend": backend, "lm_eval_version": getattr(lm_eval, "__version__", None),
            "acc_fp": acc_fp, "acc_fp_se": se_fp, "metrics_fp": agg_fp, "calib_hash": calib_hash or None,
        }
        labels = list(qs) or [None]
        for label in labels:
            qc = quant_configs.get(label) if label else None
            qf = _quant_fields(label, qc) if label else _quant_fields(None, None)
            qhash = (qf.get("quant_config_hash") or str(label)) if label else "fp"
            row = {**common, **qf}
            if label is not None:
                m_q, v_q, agg_q = per_example(qs[label], task, m)
                if sorted(v_q) != ids:
                    raise QuantdynError(f"task '{task}': the quantized run saw other examples than the FP run")
                acc_q, se_q = _mean_se([v_q[i] for i in ids])
                drop, se_drop = _mean_se([v_fp[i] - v_q[i] for i in ids])
                row.update(acc_q=acc_q, acc_q_se=se_q, acc_drop=drop, acc_drop_se=se_drop, metrics_q=agg_q)
            else:
                row.update(acc_q=None, acc_q_se=None, acc_drop=None, acc_drop_se=None)
            row["key"] = accuracy_row_key(base["checkpoint_hash"], task, version, ident.get(task, {}), num_fewshot,
                                          limit, seed, qhash, calib_hash if label else "", m, backend)
            rows.append({"key": row.pop("key"), **row, **prov})
    return rows


# --------------------------------------------------------------------------- the library entry point
def _load_tokenizer(ref: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(ref.split("@")[0] if not Path(ref).is_dir() else ref)
    except (OSError, ValueError) as e:
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise QuantdynError(f"cannot load a tokenizer from '{ref}' ({first[:160]}); pass tokenizer=") from None


def _ref_hash(ref: str) -> str:
    # the checkpoint hash of the sweep's rows, so accuracy rows join with ptq rows
    from quantdyn.models.hf_io import checkpoint_hash

    return checkpoint_hash(ref.split("@")[0] if Path(ref.split("@")[0]).is_dir() else ref)


def _load_model(ref: str, backend: str, dev: torch.device) -> nn.Module:
    if backend == "quantdyn":
        from quantdyn.models.hf_io import load_causal_lm

        return load_causal_lm(ref, device=dev).eval()
    from quantdyn.models.hf_io import _auto_load, read_config_json

    path = Path(ref)
    if path.is_dir():
        read_config_json(path)  # a clear error for a directory that is not a checkpoint
        return _auto_load(str(path), None, dev, torch.float32)
    repo, _, rev = ref.partition("@")
    return _auto_load(repo, rev or None, dev, torch.float32)


def _hf_lm(model_or_path, tokenizer, batch_size: int, dev: torch.device):
    """lm-eval's plain ``hf`` model, from a checkpoint path or a transformers model object."""
    from lm_eval.models.huggingface import HFLM

    if isinstance(model_or_path, nn.Module):
        from transformers import PreTrainedModel

        if not isinstance(model_or_path, PreTrainedModel):
            raise QuantdynError("backend 'hf' needs a transformers model; quantdyn GPTs use backend 'quantdyn'")
        return HFLM(pretrained=model_or_path, tokenizer=tokenizer, batch_size=batch_size)
    repo, _, rev = str(model_or_path).partition("@")
    kw = {"revision": rev} if rev else {}
    return HFLM(pretrained=repo, tokenizer=tokenizer, batch_size=batch_size, device=str(dev), dtype="float32", **kw)


# --------------------------------------------------------------------------- printing
def _pct(v) -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{100 * v:6.2f}"


def format_accuracy_table(rows: Iterable[dict]) -> str:
    """The table ``quantdyn eval`` prints: one line per (task, quantizer), accuracies in %.

    Columns: task, metric, n, quantizer, FP, quantized, drop (FP − quantized)
    with its paired standard error; FP-only rows leave the last ones blank.
    """
    rows = [r for r in rows if r.get("kind") == "accuracy"]
    if not rows:
        return "(no accuracy rows)"
    header = ("task", "metric", "n", "shots", "quantizer", "FP %", "quant %", "drop %", "± se")
    lines = []
    for r in sorted(rows, key=lambda r: (r["task"], str(r.get("quantizer") or ""))):
        lines.append((
            str(r["task"]), str(r["metric"]), str(r["n"]), str(r.get("num_fewshot", "")),
            str(r.get("quantizer") or "—"), _pct(r.get("acc_fp")), _pct(r.get("acc_q")),
            _pct(r.get("acc_drop")), _pct(r.get("acc_drop_se")),
        ))
    widths = [max(len(h), *(len(line[k].strip()) for line in lines)) for k, h in enumerate(header)]
    right = {2, 3, 5, 6, 7, 8}

    def fmt(cells):
        return "  ".join(c.strip().rjust(w) if k in right else c.strip().ljust(w)
                         for k, (c, w) in enumerate(zip(cells, widths))).rstrip()

    out = [fmt(header), fmt(["-" * w for w in widths])] + [fmt(line) for line in lines]
    if any(str(r["task"]).startswith("quantdyn_") for r in rows):
        out.append("quantdyn_* tasks are generated from the held-out split; they are not standard benchmarks.")
    return "\n".join(out)
