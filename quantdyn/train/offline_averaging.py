"""Offline weight averaging over stored checkpoints: LAWA, model soups and
linear interpolation (paper A, Section on weight averaging).

* :func:`average_lawa` — LAWA (Kaddour 2022; Sanyal et al. 2023) after the
  fact: at every stored checkpoint step s on the period-P grid, the uniform
  average of the checkpoints at ``lawa_steps(s, K, P)`` (s, s-P, ..., K of
  them, fewer before K exist).  The arithmetic is that of the trainer's online
  LAWA (float64 accumulation in the same order), so offline and online agree
  to float rounding.
* :func:`make_soup` — model soups (Wortsman et al. 2022) over checkpoints of
  different runs, seeds or cooldown branches: uniform, weighted, or greedy
  (ingredients sorted by held-out loss, each added only if the soup's
  held-out loss goes down).
* :func:`write_interpolation` — θ(α) = (1-α)·θ_A + α·θ_B at one α, written as
  a checkpoint (``quantdyn.sweep.interpolation`` measures FP loss and Δ CE on an α grid).

Every produced model is an HF checkpoint directory whose ``quantdyn.json``
records its ingredients (paths, steps, weights) and ``kind`` (lawa, soup,
interpolation), so sweeps pick it up like any other checkpoint (see
``quantdyn/sources/trajectory.py``: ``RUN_DIR/averages/NAME/*/``).

Checkpoints are loaded one at a time and summed into a float64 accumulator,
so averaging K models needs memory for about three models, not K.
"""
from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path
from typing import Sequence

import torch
import torch.nn as nn

from quantdyn.config import from_dict
from quantdyn.data.prepare import DataConfig, prepare_data
from quantdyn.errors import QuantdynError
from quantdyn.evaluate.loss import mean_loss
from quantdyn.models.causal_lm import ARCH_KEYS
from quantdyn.models.hf_io import load_causal_lm
from quantdyn.runs import META, STATE, RunDir, lawa_name, list_checkpoints, read_meta, step_name
from quantdyn.train.averaging import StateDict, interpolate, lawa_steps
from quantdyn.train.checkpoint import save_checkpoint

# files of a checkpoint directory that are not the tokenizer
_NOT_TOKENIZER = {"config.json", "generation_config.json", META, STATE}
_NOT_TOKENIZER_SUFFIXES = (".safetensors", ".bin", ".pt", ".index.json")
# metadata of an ingredient that describes that one checkpoint, not an average of several
_PER_CHECKPOINT_META = ("created", "val_loss", "kind", "ingredients", "window", "every", "decay", "updates")


# ------------------------------------------------------------------ helpers
def _as_ckpt(path: str | Path) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise QuantdynError(f"checkpoint '{p}' does not exist; pass a checkpoint directory (HF format)")
    if not (p / "config.json").is_file():
        raise QuantdynError(f"'{p}' has no config.json; pass a checkpoint directory (HF format)")
    return p


def _config_json(path: Path) -> dict:
    try:
        return json.loads((path / "config.json").read_text())
    except json.JSONDecodeError:
        raise QuantdynError(f"'{path / 'config.json'}' is not valid JSON; the checkpoint is corrupt — re-export it") from None


def check_same_architecture(ckpts: Sequence[str | Path]) -> None:
    """Raise a QuantdynError naming the first config.json key on which ``ckpts`` differ."""
    paths = [_as_ckpt(c) for c in ckpts]
    ref = _config_json(paths[0])
    for p in paths[1:]:
        d = _config_json(p)
        for k in ARCH_KEYS:
            if ref.get(k) != d.get(k):
                raise QuantdynError(
                    f"cannot average '{p}' with '{paths[0]}': {k} differs ({d.get(k)!r} vs {ref.get(k)!r}); "
                    "averages, soups and interpolations need checkpoints of one architecture"
                )


def _load_model(path: Path) -> nn.Module:
    return load_causal_lm(path, device="cpu").eval()


def _state(path: Path) -> StateDict:
    return _load_model(path).state_dict()


class _TokenizerFiles:
    """Stands in for a tokenizer in :func:`save_checkpoint`: copies an
    ingredient's tokenizer files and reports its EOS id for config.json."""

    def __init__(self, source: Path):
        self.source = source
        cfg = _config_json(source)
        self.eos_token_id = cfg.get("eos_token_id")

    def save_pretrained(self, directory: str) -> None:
        for f in self.source.iterdir():
            if f.is_file() and f.name not in _NOT_TOKENIZER and not f.name.endswith(_NOT_TOKENIZER_SUFFIXES):
                shutil.copy2(f, Path(directory) / f.name)


class _Accumulator:
    """Σ w_i·θ_i over state dicts added one at a time (float64 on the CPU).

    Performs exactly the operations of ``averaging.weighted_average`` (same
    order, same float64 products), so results match it bit for bit while
    holding one ingredient at a time. Non-float tensors come from the last.
    """

    def __init__(self):
        self.acc: dict[str, torch.Tensor] = {}
        self.last: StateDict | None = None
        self.first_path: Path | None = None

    def add(self, sd: StateDict, weight: float, path: Path) -> None:
        if self.last is None:
            self.first_path = path
            self.acc = {k: torch.zeros(v.shape, dtype=torch.float64) for k, v in sd.items() if torch.is_floating_point(v)}
        else:
            _check_state_match(self.last, sd, path, self.first_path)
        for k in self.acc:
            self.acc[k] += sd[k].detach().to("cpu", torch.float64) * weight
        self.last = sd

    def result(self) -> StateDict:
        assert self.last is not None
        return {k: self.acc[k].to(v.dtype) if k in self.acc else v.detach().cpu().clone() for k, v in self.last.items()}


def _check_state_match(ref: StateDict, sd: StateDict, path: Path, ref_path: Path | None) -> None:
    if set(ref) != set(sd):
        extra = sorted(set(sd) ^ set(ref))[:3]
        raise QuantdynError(
            f"cannot average '{path}' with '{ref_path}': parameter names differ (e.g. {extra}); "
            "they need one architecture"
        )
    for k, v in ref.items():
        if sd[k].shape != v.shape:
            raise QuantdynError(
                f"cannot average '{path}' with '{ref_path}': '{k}' has shape {tuple(sd[k].shape)} vs "
                f"{tuple(v.shape)}; they need one architecture"
            )


def _base_meta(meta: dict, keep_parent: bool = True) -> dict:
    """An ingredient's metadata without the fields that describe only that checkpoint
    (and without its branch link when the result mixes several checkpoints' lineages)."""
    drop = _PER_CHECKPOINT_META + (() if keep_parent else ("parent",))
    return {k: v for k, v in meta.items() if k not in drop}


def _ingredient(path: Path, meta: dict, weight: float, **extra) -> dict:
    return {"path": str(path.resolve()), "step": meta.get("step"), "tokens": meta.get("tokens"),
            "run": meta.get("run"), "weight": weight, **extra}


def _save(model: nn.Module, state: StateDict, out: Path, meta: dict, tokenizer_from: Path) -> Path:
    model.load_state_dict(state)
    return save_checkpoint(out, model, meta, _TokenizerFiles(tokenizer_from))


def _model_limit(path: Path) -> int | None:
    d = _config_json(path)
    v = d.get("max_position_embeddings") or d.get("n_positions")
    return int(v) if v else None


# --------------------------------------------------------------- held-out
def data_config_of(ckpt: str | Path):
    """The DataConfig a checkpoint was trained on (from quantdyn.json), or, for
    checkpoints without quantdyn metadata, builtin:kjv with the checkpoint's
    own tokenizer (what ``quantdyn sweep`` uses for local HF checkpoints)."""

    ckpt = _as_ckpt(ckpt)
    data = (read_meta(ckpt).get("config") or {}).get("data")
    if data:
        return from_dict(DataConfig, data, "data")
    return DataConfig(source="builtin:kjv", tokenizer=str(ckpt))


def _token_data(ckpt: Path, data, progress: bool):
    td = prepare_data(data if data is not None else data_config_of(ckpt), progress=progress)
    vocab = _config_json(ckpt).get("vocab_size")
    if vocab is not None and td.vocab_size > int(vocab):
        raise QuantdynError(
            f"the data's tokenizer has {td.vocab_size} tokens but '{ckpt}' only {vocab}; "
            "pass a DataConfig with the checkpoint's own tokenizer"
        )
    return td


def held_out_windows(ckpt: str | Path, data=None, seq_len: int = 128, n_windows: int = 200,
                     progress: bool = False) -> torch.Tensor:
    """Held-out token windows [n, seq_len] for ``ckpt``: the validation split of
    ``data`` (a DataConfig) or of the checkpoint's own run data."""
    ckpt = _as_ckpt(ckpt)
    limit = _model_limit(ckpt)
    if limit is not None and seq_len > limit:
        raise QuantdynError(f"eval sequence length {seq_len} exceeds the model's {limit} positions; use a shorter one")
    return _token_data(ckpt, data, progress).eval_windows(seq_len, n_windows)


def _loss(model: nn.Module, windows: torch.Tensor, batch_size: int) -> float:
    return mean_loss(model, windows, batch_size=batch_size)


# ---------------------------------------------------------------- LAWA
def average_lawa(run_dir: str | Path, window: int, every: int, out: str | Path | None = None,
                 cache_bytes: int = 4 << 30) -> list[Path]:
    """Offline LAWA over a run's stored checkpoints; returns the written checkpoint dirs.

    For every stored checkpoint step s > 0 with s % every == 0, writes the uniform
    average of the checkpoints at ``lawa_steps(s, window, every)`` to
    ``OUT/step-NNNNNNN`` (OUT defaults to RUN_DIR/averages/lawa-kK-pP-offline).
    Metadata: kind "lawa", the ingredients (paths, steps, weights), and the
    step, tokens and LR of the newest ingredient.

    Raises QuantdynError if a needed checkpoint is not stored (naming the
    missing steps) — train.checkpoint_every must divide ``every``.
    cache_bytes bounds the loaded checkpoints kept between windows.
    """
    run_dir = Path(run_dir)
    if window < 1 or every < 1:
        raise QuantdynError(f"LAWA needs window K >= 1 and period P >= 1 (got K={window}, P={every})")
    stored = {c.step: c for c in list_checkpoints(run_dir)}
    if not stored:
        raise QuantdynError(
            f"'{run_dir}' has no stored checkpoints (RUN_DIR/checkpoints/step-N); pass a training run directory"
        )
    targets = [s for s in sorted(stored) if s > 0 and s % every == 0]  # step 0 (a run from model.hf) averages nothing
    have = sorted(stored)
    if not targets:
        raise QuantdynError(
            f"no checkpoint of '{run_dir}' lies on the LAWA grid of period P={every} (stored steps: {_fmt(have)}); "
            f"train.checkpoint_every must divide P, or choose P as a multiple of the checkpoint interval"
        )
    missing = sorted({t for s in targets for t in lawa_steps(s, window, every)} - set(stored))
    if missing:
        raise QuantdynError(
            f"offline LAWA (K={window}, P={every}) needs checkpoints at steps {_fmt(missing)} that '{run_dir}' does "
            f"not store (stored: {_fmt(have)}); train.checkpoint_every must divide P={every}"
        )
    out = Path(out) if out is not None else RunDir(run_dir).average_dir(lawa_name(window, every, offline=True))
    cache: dict[int, StateDict] = {}
    written = []
    template = None
    for s in targets:
        steps = lawa_steps(s, window, every)
        w = 1.0 / len(steps)
        acc = _Accumulator()
        for t in steps:
            sd = cache.get(t)
            if sd is None:
                sd = _state(stored[t].path)
                if sum(v.numel() * v.element_size() for v in sd.values()) * (len(cache) + 1) <= cache_bytes:
                    cache[t] = sd
            acc.add(sd, w, stored[t].path)
        for t in [t for t in cache if t <= s - (window - 1) * every]:  # no later window needs it
            del cache[t]
        newest = stored[steps[-1]]
        if template is None:
            template = _load_model(newest.path)
        meta = {
            **_base_meta(newest.meta),
            "kind": "lawa",
            "offline": True,
            "window": window,
            "every": every,
            "step": newest.step,
            "tokens": newest.tokens,
            "lr": newest.lr,
            "ingredients": [_ingredient(stored[t].path, stored[t].meta, w) for t in steps],
        }
        written.append(_save(template, acc.result(), out / step_name(s), meta, newest.path))
    return written


def _fmt(steps: list[int], n: int = 12) -> str:
    return ", ".join(map(str, steps[:n])) + (f", ... ({len(steps)} in all)" if len(steps) > n else "")


# ---------------------------------------------------------------- soups
def make_soup(
    ckpts: Sequence[str | Path],
    weights: Sequence[float] | None = None,
    greedy: bool = False,
    eval_windows: torch.Tensor | None = None,
    *,
    out: str | Path,
    data=None,
    eval_seq_len: int = 128,
    n_eval_windows: int = 200,
    batch_size: int = 16,
    refs: Sequence[str] | None = None,
) -> Path:
    """Average checkpoints of one architecture into a soup at ``out``; return ``out``.

    uniform (default): equal weights.  weights: Σ w_i θ_i / Σ w_i.
    greedy (Wortsman et al. 2022, Algorithm 1 with held-out loss for accuracy):
    ingredients sorted by held-out loss; starting from the best, each is added
    (uniform average of those kept) only if the soup's held-out loss goes
    strictly down — so the soup is never worse than its best ingredient on
    those windows.  Held-out windows: ``eval_windows`` if given, else the
    validation split of ``data`` or of the first ingredient's run data
    (``eval_seq_len`` x ``n_eval_windows``).  Without greedy, losses are
    measured (and recorded) only when ``eval_windows`` is given.

    Selection bias: greedy soups are chosen on these windows; evaluate them on
    other text (or accept an optimistic FP loss) when comparing with others.
    Metadata (kind "soup"): method, ingredients with weights and held-out
    losses, the greedy decisions ("considered") and the soup's held-out loss;
    step, tokens and LR are those of the newest ingredient kept. ``refs``: how the ingredients were named
    (hub id@revision, preset points) when ``ckpts`` are their local directories; recorded with each.
    """
    paths = [_as_ckpt(c) for c in ckpts]
    if not paths:
        raise QuantdynError("a soup needs at least one checkpoint")
    named = list(refs) if refs is not None else [None] * len(paths)
    if len(named) != len(paths):
        raise QuantdynError(f"{len(named)} refs for {len(paths)} checkpoints; give one per checkpoint")
    if greedy and weights is not None:
        raise QuantdynError("give weights or greedy, not both (a greedy soup is a uniform average of the kept ingredients)")
    if weights is not None:
        weights = [float(x) for x in weights]
        if len(weights) != len(paths):
            raise QuantdynError(f"{len(weights)} weights for {len(paths)} checkpoints; give one weight per checkpoint")
        if any(x < 0 or not math.isfinite(x) for x in weights) or sum(weights) <= 0:
            raise QuantdynError(f"soup weights {weights} must be finite, non-negative and not all zero")
    check_same_architecture(paths)
    metas = [read_meta(p) for p in paths]
    if greedy and eval_windows is None:
        eval_windows = held_out_windows(paths[0], data, eval_seq_len, n_eval_windows)
    out = Path(out)

    losses: list[float | None] = [None] * len(paths)
    if eval_windows is not None:
        for i, p in enumerate(paths):
            losses[i] = _loss(_load_model(p), eval_windows, batch_size)

    if greedy:
        template, state, weight_of, soup_loss, considered = _greedy_soup(paths, losses, eval_windows, batch_size)
        method = "greedy"
    else:
        template, state, weight_of, soup_loss = _weighted_soup(paths, weights, eval_windows, batch_size)
        method, considered = ("weighted" if weights is not None else "uniform"), []
    kept = list(weight_of)  # in the order the ingredients were taken

    newest = max(kept, key=lambda i: (metas[i].get("tokens") or 0, metas[i].get("step") or 0))
    runs = {metas[i].get("run") for i in kept}
    seeds = {metas[i].get("seed") for i in kept}
    meta = {
        **_base_meta(metas[newest], keep_parent=False),
        "kind": "soup",
        "method": method,
        "run": runs.pop() if len(runs) == 1 else "soup",
        "seed": seeds.pop() if len(seeds) == 1 else None,
        "step": metas[newest].get("step"),
        "tokens": metas[newest].get("tokens"),
        "lr": metas[newest].get("lr"),
        "ingredients": [_ingredient(paths[i], metas[i], weight_of[i], held_out_loss=losses[i],
                                    **({"ref": named[i]} if named[i] else {})) for i in kept],
        "considered": considered or [
            {"path": str(p.resolve()), "held_out_loss": losses[i], "accepted": i in weight_of}
            for i, p in enumerate(paths)
        ],
        "held_out_loss": soup_loss,
        "held_out": None if eval_windows is None else {"n_windows": int(eval_windows.shape[0]),
                                                       "seq_len": int(eval_windows.shape[1])},
    }
    return _save(template, state, out, meta, paths[newest])


def _greedy_soup(paths: list[Path], losses: list[float], eval_windows: torch.Tensor, batch_size: int):
    """Wortsman et al.'s greedy soup: ingredients by held-out loss, each kept only if the uniform average of
    those kept gets a strictly lower held-out loss. Returns (model holding the soup's architecture, soup
    state, {kept index: weight}, soup loss, the decisions)."""
    order = sorted(range(len(paths)), key=lambda i: losses[i])
    template = _load_model(paths[order[0]])
    ref = {k: v.detach().clone() for k, v in template.state_dict().items()}  # template's own tensors change below
    total = {k: v.detach().to(torch.float64).clone() for k, v in ref.items() if torch.is_floating_point(v)}
    kept, soup_loss = [order[0]], losses[order[0]]
    considered = [{"path": str(paths[order[0]].resolve()), "held_out_loss": soup_loss,
                   "soup_loss_with": soup_loss, "accepted": True}]
    for i in order[1:]:
        sd = _state(paths[i])
        _check_state_match(ref, sd, paths[i], paths[order[0]])
        cand = {k: (total[k] + sd[k].to(torch.float64)) / (len(kept) + 1) for k in total}
        template.load_state_dict({k: cand[k].to(v.dtype) if k in cand else v for k, v in ref.items()})
        loss = _loss(template, eval_windows, batch_size)
        accepted = loss < soup_loss
        considered.append({"path": str(paths[i].resolve()), "held_out_loss": losses[i],
                           "soup_loss_with": loss, "accepted": accepted})
        if accepted:
            for k in total:
                total[k] += sd[k].to(torch.float64)
            kept.append(i)
            soup_loss = loss
    state = {k: (total[k] / len(kept)).to(v.dtype) if k in total else v.detach().clone() for k, v in ref.items()}
    return template, state, {i: 1.0 / len(kept) for i in kept}, soup_loss, considered


def _weighted_soup(paths: list[Path], weights: list[float] | None, eval_windows: torch.Tensor | None,
                   batch_size: int):
    """Σ w_i θ_i / Σ w_i (uniform without ``weights``; ingredients of weight 0 are left out), with its held-out
    loss when ``eval_windows`` are given. Returns (model holding the soup, soup state, {kept index: weight},
    soup loss or None)."""
    raw = weights if weights is not None else [1.0] * len(paths)
    tot = sum(raw)
    acc = _Accumulator()
    kept = [i for i, x in enumerate(raw) if x > 0]
    for i in kept:
        acc.add(_state(paths[i]), raw[i] / tot, paths[i])
    state = acc.result()
    template = _load_model(paths[kept[-1]])
    soup_loss = None
    if eval_windows is not None:
        template.load_state_dict(state)
        soup_loss = _loss(template, eval_windows, batch_size)
    return template, state, {i: raw[i] / tot for i in kept}, soup_loss


# --------------------------------------------------------- interpolation
def interpolation_run(a: Path, b: Path) -> str:
    """The run name of an interpolation between two checkpoints (their run when both share one)."""
    ma, mb = read_meta(a), read_meta(b)
    return ma.get("run") if ma.get("run") == mb.get("run") else "interpolation"


def write_interpolation(model: nn.Module, sa: StateDict, sb: StateDict, alpha: float, a: Path, b: Path,
                        out: Path) -> Path:
    """θ(α) = (1-α)·θ_A + α·θ_B written as a checkpoint (kind "interpolation"; α and both endpoints in its
    metadata). ``model`` is a module of the endpoints' architecture (its weights are overwritten)."""
    meta_a, meta_b = read_meta(a), read_meta(b)
    endpoints = {
        "a": _ingredient(a, meta_a, 1.0 - alpha, lr=meta_a.get("lr")),
        "b": _ingredient(b, meta_b, alpha, lr=meta_b.get("lr")),
    }
    meta = {
        **_base_meta(meta_b, keep_parent=False),
        "kind": "interpolation",
        "alpha": alpha,
        "run": interpolation_run(a, b),
        "step": None,
        "tokens": None,
        "lr": None,
        "endpoints": copy.deepcopy(endpoints),
        "ingredients": [copy.deepcopy(endpoints["a"]), copy.deepcopy(endpoints["b"])],
    }
    return _save(model, interpolate(sa, sb, alpha), out, meta, a)


def endpoint_states(a: Path, b: Path) -> tuple[nn.Module, StateDict, StateDict]:
    """A's model (CPU) and both endpoints' state dicts, checked to be of one architecture."""
    check_same_architecture([a, b])
    model = _load_model(a)
    sa = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    sb = _state(b)
    _check_state_match(sa, sb, b, a)
    return model, sa, sb
