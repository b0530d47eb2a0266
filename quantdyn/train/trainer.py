"""The training loop: one function, :func:`train`, for fresh runs, resumed
runs and cooldown branches; data-parallel under torchrun (``dist.strategy``:
DDP, or FSDP2 sharding — see train/distributed.py).

Data order is a pure function of (seed, step): the global batch of step s is
drawn from ``np.random.default_rng([seed, s])`` and sliced per rank and
micro-batch, so a resumed run, a cooldown branch and a 2-process DDP or FSDP2
run see exactly the batches a single uninterrupted process would.  A run can
therefore resume with another number of processes as long as the global batch
(batch_size x grad_accum x processes) stays the same.

Everything a resume can get wrong (model shape, optimizer, data, global batch)
is checked before anything in the run directory is written.

Step hooks: ``train(cfg, hooks=[...])`` calls each hook whose ``due(step)`` is true after that optimizer
step, on the main process, with the whole model (gathered under FSDP2), and logs the metrics it returns
with the step's row.  The PTQ monitor (``quantdyn.monitor.PTQMonitor``; ``quantdyn.monitor.hooks_for(cfg)``
builds it from ``cfg.monitor``) is one; the trainer knows only the protocol (:class:`StepHook`).

Metrics go to the destinations of ``cfg.log.to`` (train/loggers.py: metrics.jsonl always, CSV,
TensorBoard, W&B) under one set of names; the console shows a bar on a terminal and plain periodic
lines elsewhere.
"""
from __future__ import annotations

import math
import sys
import time
import uuid
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Mapping, Protocol, Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from quantdyn.config import dump_yaml, to_dict
from quantdyn.data.prepare import prepare_data
from quantdyn.errors import QuantdynError
from quantdyn.evaluate.loss import mean_loss
from quantdyn.files import write_json_atomic, write_text_atomic
from quantdyn.models.gpt import GPT, resolve_model_config
from quantdyn.models.hf_io import load_gpt
from quantdyn.runtime import git_sha, hardware, resolve_device, seed_everything
from quantdyn.train.averaging import OnlineEMA, OnlineLAWA, local_state_dict
from quantdyn.train.checkpoint import (
    CheckpointInfo,
    RunDir,
    checkpoint_dir,
    clear_run,
    has_checkpoints,
    load_training_state,
    remove_stale_temporaries,
    save_checkpoint,
)
from quantdyn.train.config import RunConfig
from quantdyn.train.distributed import (
    dist_info,
    init_distributed,
    launched_by_torchrun,
    make_strategy,
    mean_over_ranks,
    rank0_first,
)
from quantdyn.train.loggers import (
    TRAIN_GRAD_NORM,
    TRAIN_LOSS,
    TRAIN_LR,
    TRAIN_TOKENS,
    TRAIN_TOKENS_PER_S,
    VAL_LOSS,
    Console,
    RunLogContext,
    build_loggers,
    check_destinations,
    clear_outputs,
    close_all,
    log_all,
)
from quantdyn.train.optimizers import build_optimizer, optimizer_eval_mode, optimizer_train_mode
from quantdyn.train.qat import prepare_qat
from quantdyn.train.schedules import lr_at


# ---------------------------------------------------------------------- data
def batch_starts(n_tokens: int, seq_len: int, seed: int, step: int, count: int) -> np.ndarray:
    if n_tokens <= seq_len + 1:
        raise QuantdynError(
            f"the train split has {n_tokens} tokens, fewer than one sequence of {seq_len + 1}; "
            "use more data or a shorter train.seq_len"
        )
    rng = np.random.default_rng([seed, step])
    return rng.integers(0, n_tokens - seq_len - 1, size=count)


def get_batch(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = np.stack([np.asarray(tokens[s : s + seq_len + 1], dtype=np.int64) for s in starts])
    t = torch.from_numpy(rows)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def numpy_rng_state() -> dict:
    """numpy's global RNG state as tensors (loadable with weights_only=True)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos), "has_gauss": int(has_gauss),
            "gauss": float(gauss)}


def set_numpy_rng(d: dict) -> None:
    np.random.set_state(("MT19937", d["keys"].numpy().astype(np.uint32), d["pos"], d["has_gauss"], d["gauss"]))


class StepHook(Protocol):
    """What :func:`train` calls after optimizer steps (``quantdyn.monitor.PTQMonitor`` is one).

    ``due(step)`` is asked on every process (under FSDP2 the weights are gathered, collectively, when any
    hook is due); ``step(model, step, lr, tokens)`` runs on the main process only, with the whole, unwrapped
    model in evaluation mode (schedule-free optimizers: at their averaged point), and returns the metrics to
    log with that step (shared names, e.g. ptq/rtn4/delta_ce). It must leave the weights as it found them."""

    def due(self, step: int) -> bool: ...

    def step(self, model: nn.Module, step: int, lr: float | None = None,
             tokens: int | None = None) -> Mapping[str, float]: ...


# --------------------------------------------------------------------- train
def checkpoint_steps(cfg: RunConfig, tokens_per_step: int, start_step: int = 0) -> set[int]:
    steps = {cfg.train.steps}
    if cfg.train.checkpoint_every:
        steps |= set(range(cfg.train.checkpoint_every, cfg.train.steps + 1, cfg.train.checkpoint_every))
    for t in cfg.train.checkpoint_tokens:
        steps.add(min(cfg.train.steps, max(1, math.ceil(t / tokens_per_step))))
    return {s for s in steps if s > start_step}


def _amp_dtype(cfg: RunConfig, device: torch.device) -> str:
    if cfg.train.dtype == "auto":
        return "bfloat16" if device.type == "cuda" else "float32"
    return cfg.train.dtype


def train(
    cfg: RunConfig,
    run_dir: Path | None = None,
    *,
    resume: CheckpointInfo | None = None,
    init_from: CheckpointInfo | None = None,
    parent: dict | None = None,
    progress: bool = True,
    stop_after: int | None = None,
    overwrite: bool = False,
    hooks: Sequence[StepHook] = (),
    verbose: bool = False,
) -> Path:
    """Train ``cfg``; return the run directory.

    resume:     continue this run from one of its own checkpoints (exactly).
    init_from:  start from another run's checkpoint (weights, optimizer, step) —
                how cooldown branches and controls begin.
    stop_after: stop (after checkpointing) once this step is reached; for tests
                that simulate an interrupted run.
    overwrite:  a fresh start (no resume/init_from) in a run directory that already has
                checkpoints deletes them; without it such a start is refused.
    hooks:      step hooks (:class:`StepHook`), e.g. ``quantdyn.monitor.hooks_for(cfg)`` for the PTQ monitor
                that ``cfg.monitor`` describes.
    progress:   False prints nothing while training (--quiet); verbose: every logged row as a line too.
    """
    rank, world, local_rank = dist_info()
    device = resolve_device(cfg.train.device)
    distributed = world > 1 or (cfg.dist.strategy == "fsdp2" and launched_by_torchrun())
    if distributed and device.type == "cuda":
        device = torch.device(f"cuda:{local_rank}")
        torch.cuda.set_device(device)
    strategy = make_strategy(cfg.dist, device, world, rank)  # fsdp2 without torchrun: says how to launch
    strategy.check_optimizer(cfg.optim)
    run_dir = Path(run_dir) if run_dir is not None else Path(cfg.out_dir) / cfg.name
    is_main = rank == 0
    source = resume or init_from
    tokens_per_step = cfg.tokens_per_step * world
    _check_start(cfg, run_dir, resume, init_from, overwrite, tokens_per_step, world)
    check_destinations(cfg.log.to)  # a logger whose package is missing: one line, before anything runs
    if distributed:
        init_distributed(device)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)

    # rank 0 tokenizes and caches the shards; the other processes wait, then open the cache
    tty = bool(getattr(sys.stderr, "isatty", lambda: False)())
    data = rank0_first(lambda: prepare_data(cfg.data, progress=progress and is_main and tty),
                       timeout_min=cfg.dist.data_timeout_min, what="preparing the token shards")
    mcfg = resolve_model_config(cfg.model, data.vocab_size)
    if mcfg.vocab_size < data.vocab_size:
        raise QuantdynError(
            f"model.vocab_size={mcfg.vocab_size} is smaller than the tokenizer's {data.vocab_size} tokens; "
            "set model.vocab_size to 0 (auto) or at least the tokenizer size"
        )
    if cfg.train.seq_len > mcfg.max_seq_len:
        raise QuantdynError(f"train.seq_len={cfg.train.seq_len} exceeds model.max_seq_len={mcfg.max_seq_len}")
    if resume is not None and resume.meta.get("data_key") is not None and not data.same_data(resume.meta["data_key"]):
        raise QuantdynError(
            f"checkpoint '{resume.path}' was trained on other data (data key {resume.meta['data_key']}, the "
            f"config's data section gives {data.data_hash}); restore the run's data section to resume exactly, or "
            "start a new run from this checkpoint's weights with init_weights=CHECKPOINT"
        )
    resolved = replace(cfg, model=mcfg)

    seed_everything(cfg.seed)
    model = GPT(mcfg).to(device)
    if cfg.init_weights and resume is None and init_from is None:
        _load_weights(model, cfg.init_weights, device)
    if cfg.qat is not None:
        prepare_qat(model, cfg.qat)  # same parameter names: checkpoints load into a plain GPT
    state = None
    if source is not None:
        src = load_gpt(source.path, device)
        if src.config.shape() != mcfg.shape():
            raise QuantdynError(
                f"checkpoint '{source.path}' has model shape {to_dict(src.config)} but the config asks for "
                f"{to_dict(mcfg)}; resume with the run's own config.yaml"
            )
        model.load_state_dict(src.state_dict())  # the whole model, before any sharding
        del src
        state = load_training_state(source.path)
    amp = _amp_dtype(cfg, device)
    train_model = strategy.wrap(model, cfg.train.compile, amp)  # fsdp2: shards `model` in place
    optimizer = build_optimizer(model, cfg.optim)
    start_step = 0
    lawa = OnlineLAWA(cfg.averaging.lawa_window, cfg.averaging.lawa_every) if cfg.averaging.lawa_window else None
    ema_decay = cfg.averaging.ema_decay or (
        0.5 ** (tokens_per_step / cfg.averaging.ema_half_life_tokens) if cfg.averaging.ema_half_life_tokens else 0.0
    )
    ema = OnlineEMA(ema_decay) if ema_decay else None

    if source is not None:
        try:
            strategy.load_optimizer_state(model, optimizer, state["optimizer"])
        except QuantdynError:
            raise
        except (ValueError, KeyError, RuntimeError, TypeError, IndexError) as e:
            raise QuantdynError(
                f"optimizer state in '{source.path}' does not fit optim.name='{cfg.optim.name}' "
                f"({type(e).__name__}: {str(e)[:120]}); resume with the optimizer the checkpoint was trained with"
            ) from None
        optimizer_train_mode(optimizer)  # checkpoints hold the eval-mode point (schedule-free)
        start_step = int(state["step"])
        if "torch_rng" in state:
            torch.set_rng_state(state["torch_rng"])
        if "numpy_rng" in state:  # Kron draws from the global numpy RNG
            set_numpy_rng(state["numpy_rng"])
        if resume is not None:
            if lawa is not None and "lawa" in state:
                saved = state["lawa"]
                lawa.load_state_dict({"steps": saved["steps"],
                                      "states": [strategy.scatter(sd, model) for sd in saved["states"]]})
            if ema is not None and "ema" in state:
                ema.load_state_dict({**state["ema"], "acc": strategy.scatter(state["ema"]["acc"], model)})
        del state
    if start_step >= cfg.train.steps:
        raise QuantdynError(f"the run is already at step {start_step} >= train.steps={cfg.train.steps}; nothing to do")

    # everything is checked: from here on the run directory is written
    loggers = []
    if is_main:
        if overwrite and resume is None and init_from is None:
            clear_run(run_dir)
            clear_outputs(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(run_dir)
        rd = RunDir(run_dir)
        write_text_atomic(rd.config, dump_yaml(resolved))
        info_path = rd.info
        info = rd.read_info()
        info.update(
            {
                "name": cfg.name,
                "data_cache": str(data.directory),
                "data_key": data.data_hash,
                "tokens_per_step": tokens_per_step,
                "world_size": world,
                "dist_strategy": strategy.name,
                "git_sha": git_sha(),
                "hardware": hardware(),
            }
        )
        if parent is not None:
            info["parent"] = parent
        if "wandb" in cfg.log.to and (resume is None or not info.get("wandb_id")):
            info["wandb_id"] = uuid.uuid4().hex[:12]  # a resume continues the same W&B run
        write_json_atomic(info_path, info)
        # rows logged after the starting step (a run that crashed past its last checkpoint, or an attempt that
        # crashed before its first one) are dropped: a resumed run logs them again, identically
        loggers = build_loggers(cfg.log.to, RunLogContext(
            run_dir, cfg.name, to_dict(resolved), truncate_after=start_step, wandb_id=info.get("wandb_id"),
            wandb_project=cfg.log.wandb_project, wandb_entity=cfg.log.wandb_entity, wandb_mode=cfg.log.wandb_mode))

    autocast = strategy.autocast(amp)
    val_windows = data.eval_windows(cfg.train.seq_len, cfg.train.eval_windows)
    ckpt_steps = checkpoint_steps(cfg, tokens_per_step, start_step)
    T, B, A = cfg.train.seq_len, cfg.train.batch_size, cfg.train.grad_accum
    train_tokens = data.train

    def meta_for(step: int, lr: float, kind: str = "checkpoint", **extra) -> dict:
        return {
            "kind": kind,
            "run": cfg.name,
            "step": step,
            "tokens": step * tokens_per_step,
            "lr": lr,
            "peak_lr": cfg.optim.lr,
            "total_steps": cfg.train.steps,
            "schedule": to_dict(cfg.schedule),
            "config": to_dict(resolved),
            "data_key": data.data_hash,
            "git_sha": git_sha(),
            "seed": cfg.seed,
            "world_size": world,
            "dist_strategy": strategy.name,
            **({"parent": parent} if parent else {}),
            **extra,
        }

    mode = "quiet" if not (progress and is_main) else "verbose" if verbose else "normal"
    console = Console(cfg.name, cfg.train.steps, start_step, mode, cfg.log.print_every or cfg.train.log_every)
    if cfg.monitor.every and not hooks and is_main:
        # the trainer cannot build the monitor itself (it lives in a layer above); a caller that forgot it is told
        warnings.warn(f"{cfg.name}: monitor.every={cfg.monitor.every} is set but train() got no step hooks, so "
                      "nothing is monitored; pass hooks=quantdyn.monitor.hooks_for(cfg)", stacklevel=2)
    console.note(f"steps {start_step} -> {cfg.train.steps}, {tokens_per_step:,} tokens/step, {device}"
                 + (f", {world} processes ({strategy.name})" if world > 1 else ""))
    done = start_step
    try:
        cuda = device.type == "cuda"
        t_last, tok_since = time.perf_counter(), 0
        model.train()
        lr = lr_at(max(0, start_step - 1), cfg.optim.lr, cfg.schedule, cfg.train.steps)
        for step in range(start_step, cfg.train.steps):
            lr = lr_at(step, cfg.optim.lr, cfg.schedule, cfg.train.steps)
            for g in optimizer.param_groups:
                g["lr"] = lr * g.get("lr_scale", 1.0)
            starts = batch_starts(len(train_tokens), T, cfg.seed, step, B * A * world)
            loss_acc = torch.zeros((), device=device, dtype=torch.float64)
            for micro in range(A):
                sl = starts[(micro * world + rank) * B : (micro * world + rank + 1) * B]
                x, y = get_batch(train_tokens, sl, T)
                if cuda:  # pinned host memory: the copy overlaps with the GPU's work
                    x, y = x.pin_memory(), y.pin_memory()
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with strategy.gradient_sync(train_model, last_micro=micro == A - 1):
                    with autocast:
                        logits = train_model(x)
                        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1)) / A
                    loss.backward()
                loss_acc += loss.detach().double()
            gn = strategy.clip_grad_norm(model, cfg.train.grad_clip)
            done = step + 1
            log_due = done % cfg.train.log_every == 0 or done in ckpt_steps or done == cfg.train.steps
            ckpt_due = done in ckpt_steps or (stop_after is not None and done == stop_after)
            # the loss comes to the host (a GPU sync) every step on the CPU, on a GPU only when it is logged or
            # checkpointed: a divergence is caught there at the latest, and never saved
            if not cuda or log_due or ckpt_due:
                loss_sum = float(loss_acc)
                if not math.isfinite(loss_sum):
                    raise QuantdynError(
                        f"training diverged by step {done} (loss {loss_sum}); lower optim.lr or check the data"
                    )
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            tok_since += tokens_per_step
            if lawa is not None:
                lawa.update(done, model)
            if ema is not None:
                ema.update(model)
            console.advance()

            row = None
            if log_due:
                if world > 1:
                    loss_sum = mean_over_ranks(loss_sum, device)
                now = time.perf_counter()
                row = {
                    TRAIN_TOKENS: done * tokens_per_step,
                    TRAIN_LR: lr,
                    TRAIN_LOSS: loss_sum,
                    TRAIN_GRAD_NORM: float(gn),
                    TRAIN_TOKENS_PER_S: tok_since / max(now - t_last, 1e-9),
                }
                t_last, tok_since = now, 0
            want_eval = (cfg.train.eval_every and done % cfg.train.eval_every == 0) or done in ckpt_steps
            want_ckpt = ckpt_due
            due_hooks = [h for h in hooks if h.due(done)]  # asked on every process: all take part in gathering
            want_monitor = bool(due_hooks)
            if want_eval or want_ckpt or want_monitor:
                # schedule-free optimizers evaluate and save the averaged point, not the training point
                optimizer_eval_mode(optimizer)
            if want_eval:  # every process evaluates (under FSDP2 each forward gathers the weights)
                val = mean_loss(model, val_windows, batch_size=max(1, min(32, B)), dtype=amp)
                row = {**(row or {TRAIN_TOKENS: done * tokens_per_step, TRAIN_LR: lr}), VAL_LOSS: val}
            if want_monitor:
                # FSDP2: the whole model is gathered on rank 0 (collective); the hooks run there
                monitored = _whole_model(strategy, model, mcfg, device) if strategy.shards else model
                if is_main:
                    row = dict(row or {TRAIN_TOKENS: done * tokens_per_step, TRAIN_LR: lr})
                    for hook in due_hooks:
                        row.update(hook.step(monitored, done, lr=lr, tokens=done * tokens_per_step))
                del monitored
            if row is not None and is_main:
                log_all(loggers, row, done)
                console.logged(done, row)
            if want_ckpt:
                # gathering is collective under FSDP2: every process takes part, rank 0 writes
                whole = _whole_model(strategy, model, mcfg, torch.device("cpu")) if strategy.shards else model
                # weights and optimizer state are both saved in eval mode (consistent for schedule-free);
                # a resumed run switches back to train mode after loading them
                state = {"optimizer": strategy.optimizer_state(model, optimizer), "step": done,
                         "torch_rng": torch.get_rng_state(), "numpy_rng": numpy_rng_state()}
                if lawa is not None:
                    state["lawa"] = {"steps": lawa.steps(), "states": [strategy.gather(sd, model) for sd in lawa.state_dict()["states"]]}
                if ema is not None:
                    state["ema"] = {**ema.state_dict(), "acc": strategy.gather(ema.state_dict()["acc"], model)}
                averages = _online_averages(strategy, model, lawa, ema)
                if is_main:
                    extra = {"val_loss": row.get(VAL_LOSS)} if row else {}
                    # the step's averages first, its checkpoint last: the checkpoint commits the step, so a kill
                    # between the two resumes from the previous checkpoint and rewrites these averages
                    _save_online_averages(run_dir, done, mcfg, averages, lawa, ema, meta_for, lr, data)
                    save_checkpoint(checkpoint_dir(run_dir, done), whole, meta_for(done, lr, **extra), data.tokenizer, state)
                del whole, state, averages
                if world > 1:
                    import torch.distributed as dist

                    dist.barrier()
            if want_eval or want_ckpt or want_monitor:
                optimizer_train_mode(optimizer)
            if stop_after is not None and done >= stop_after:
                break
    finally:
        close_all(loggers)
        console.close()
    console.close(final_step=done)
    return run_dir


def _check_start(cfg: RunConfig, run_dir: Path, resume, init_from, overwrite: bool, tokens_per_step: int,
                 world: int) -> None:
    """What can be checked before any data or weights are read: a fresh run does not silently
    replace a run's checkpoints, and a resume keeps the optimizer and the global batch."""
    if resume is None and init_from is None:
        steps = has_checkpoints(run_dir)
        if steps and not overwrite:
            raise QuantdynError(
                f"run directory '{run_dir}' already has checkpoints (last: step {steps[-1]}); continue it with "
                f"`quantdyn train --resume {run_dir}`, or start again (deleting them) with --overwrite"
            )
        return
    source = resume or init_from
    saved = (source.meta.get("config") or {}).get("optim") or {}
    if saved.get("name") and saved["name"] != cfg.optim.name:
        raise QuantdynError(
            f"checkpoint '{source.path}' was trained with optim.name='{saved['name']}' but the config asks for "
            f"'{cfg.optim.name}'; set optim.name back to '{saved['name']}' to continue it (a new optimizer needs "
            "a new run, e.g. with init_weights=CHECKPOINT)"
        )
    saved_groups = [g.get("optimizer", "main") for g in saved.get("groups") or []]
    if saved_groups and saved_groups != [g.optimizer for g in cfg.optim.groups]:
        raise QuantdynError(
            f"checkpoint '{source.path}' was trained with per-group optimizers {saved_groups} (optim.groups) but the "
            f"config asks for {[g.optimizer for g in cfg.optim.groups]}; restore optim.groups to continue it"
        )
    if resume is None:
        return
    step, tokens = int(resume.meta.get("step", resume.step) or 0), resume.meta.get("tokens")
    if step > 0 and tokens is not None and int(tokens) != step * tokens_per_step:
        before = int(tokens) // step
        was = resume.meta.get("world_size")
        raise QuantdynError(
            f"checkpoint '{resume.path}' was trained with {before} tokens per step"
            f"{f' ({was} processes)' if was else ''}, this launch gives {tokens_per_step} "
            f"(train.batch_size={cfg.train.batch_size} x grad_accum={cfg.train.grad_accum} x seq_len="
            f"{cfg.train.seq_len} x {world} processes); keep the global batch: launch with the same number of "
            "processes, or change train.batch_size/grad_accum so that the product is unchanged"
        )


def _whole_model(strategy, model, mcfg, device) -> GPT | None:
    """A plain GPT with the gathered weights on rank 0 (None on the others); collective."""
    full = strategy.full_state(model)
    if full is None:
        return None
    whole = GPT(mcfg)
    whole.load_state_dict(full)
    return whole.to(device)


def _online_averages(strategy, model, lawa, ema) -> dict:
    """Whole-model LAWA and EMA weights on rank 0 (collective under FSDP2)."""
    out = {}
    if not strategy.shards and strategy.rank != 0:
        return out  # whole replicas: rank 0 has everything
    if lawa is not None and lawa.ready():
        out["lawa"] = strategy.gather(lawa.average(), model)
    if ema is not None and ema.t > 0:
        out["ema"] = strategy.gather(ema.average(local_state_dict(model)), model)
    return out


def _load_weights(model: GPT, path: str, device) -> None:
    src = load_gpt(path, device)
    if src.config.shape() != model.config.shape():
        raise QuantdynError(
            f"init_weights '{path}' has a different model shape than the config; use a checkpoint of the same model"
        )
    model.load_state_dict(src.state_dict())


def _save_online_averages(run_dir, step, mcfg, averages, lawa, ema, meta_for, lr, data) -> None:
    if "lawa" in averages:
        avg = GPT(mcfg)
        avg.load_state_dict(averages["lawa"])
        ingredients = [{"step": s, "weight": 1.0 / len(lawa.steps())} for s in lawa.steps()]
        save_checkpoint(
            RunDir(run_dir).average(f"lawa-k{lawa.window}-p{lawa.every}", step),
            avg,
            meta_for(step, lr, kind="lawa", ingredients=ingredients, window=lawa.window, every=lawa.every),
            data.tokenizer,
        )
    if "ema" in averages:
        avg = GPT(mcfg)
        avg.load_state_dict(averages["ema"])
        save_checkpoint(
            RunDir(run_dir).average(f"ema-{ema.decay:.6g}", step),
            avg,
            meta_for(step, lr, kind="ema", decay=ema.decay, updates=ema.t),
            data.tokenizer,
        )
