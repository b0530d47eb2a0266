"""Running lm-evaluation-harness tasks (the optional ``eval`` extra): loading tasks — lm-eval's own by name,
and quantdyn's built-in offline ones (``evaluate/tasks.py``) — running them on an ``LM``, and reading
per-example values back. A task whose data cannot be loaded ends in one line naming the dataset it needs.

lm-eval's own per-task standard errors are not used (``bootstrap_iters=0``: its bootstrap spawns a process
pool); rows carry closed-form SEs of the per-example values instead (``study/accuracy.py``).
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from quantdyn.errors import QuantdynError, did_you_mean
from quantdyn.evaluate.tasks import BUILTIN_TASKS, build_builtin_tasks, task_files_hash
from quantdyn.models.hf_io import _auto_load, load_causal_lm, read_config_json

METRIC_PREFERENCE = ("acc", "acc_norm", "exact_match")
"""The accuracy reported per task: the first of these that the task computes."""

INSTALL_HINT = "install the eval extra: pip install 'quantdyn[eval]' (or pip install 'lm-eval[hf]>=0.4.5')"


def require_lm_eval() -> None:
    """One line (not an ImportError) when the optional lm-evaluation-harness is missing."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise QuantdynError(f"downstream evaluation needs lm-evaluation-harness; {INSTALL_HINT}") from None


def make_lm(model: nn.Module, tokenizer, **kwargs):
    """A :class:`~quantdyn.evaluate.lm_eval_adapter.QuantdynLM` for ``model`` (kwargs: batch_size, max_length,
    max_gen_toks, progress)."""
    require_lm_eval()
    from quantdyn.evaluate.lm_eval_adapter import QuantdynLM  # imports lm-eval: the optional extra, checked above

    return QuantdynLM(model, tokenizer, **kwargs)


@contextlib.contextmanager
def quiet_logs(enabled: bool):
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


# --------------------------------------------------------------------------- tasks
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
    require_lm_eval()
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=[str(p) for p in include_paths] or None, include_defaults=include_defaults)


def load_tasks(names: Sequence[str], tm=None) -> dict[str, Any]:
    """Load lm-eval tasks by name -> {leaf task name: Task}; user errors become one-line QuantdynErrors.

    A task whose data cannot be loaded (offline, no cache, gated dataset) is
    reported with the dataset it needs instead of a ``datasets`` traceback.
    """

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
            ds = _dataset_of_config(tm, name) or "its dataset"
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise QuantdynError(
                f"lm-eval task '{name}' needs the dataset {ds}, which could not be loaded ({type(e).__name__}: "
                f"{first[:200]}); connect to the Hugging Face Hub once to cache it (or copy it into HF_DATASETS_CACHE), "
                f"or use an offline task: {', '.join(BUILTIN_TASKS)}"
            ) from None
        out.update(loaded["tasks"])
    return out


def split_names(tasks: str | Iterable[str]) -> list[str]:
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
    names = split_names(tasks)
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
    with quiet_logs(True):
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
    with quiet_logs(quiet):
        res = evaluate(lm=lm, task_dict={"tasks": dict(tasks), "groups": {}, "group_map": {}}, limit=limit,
                       bootstrap_iters=0, log_samples=True)
    return res


def pick_metric(samples: list[dict], metric: str | None, task: str) -> str:
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
    m = pick_metric(samples, metric, task)
    values = {int(s["doc_id"]): float(s[m]) for s in samples}
    agg = {k.split(",")[0]: v for k, v in res["results"].get(task, {}).items()
           if isinstance(v, (int, float)) and not k.startswith(("alias", "sample")) and "_stderr" not in k}
    return m, values, agg


def load_tokenizer(ref: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(ref.split("@")[0] if not Path(ref).is_dir() else ref)
    except (OSError, ValueError) as e:
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise QuantdynError(f"cannot load a tokenizer from '{ref}' ({first[:160]}); pass tokenizer=") from None


def load_eval_model(ref: str, backend: str, dev: torch.device) -> nn.Module:
    if backend == "quantdyn":
        return load_causal_lm(ref, device=dev).eval()

    path = Path(ref)
    if path.is_dir():
        read_config_json(path)  # a clear error for a directory that is not a checkpoint
        return _auto_load(str(path), None, dev, torch.float32)
    repo, _, rev = ref.partition("@")
    return _auto_load(repo, rev or None, dev, torch.float32)


def hf_lm(model_or_path, tokenizer, batch_size: int, dev: torch.device):
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
