"""The training loop: :func:`train`, for fresh runs, resumed runs and cooldown branches; data-parallel under
torchrun (``dist.strategy``: DDP, or FSDP2 sharding — see train/distributed.py).

:func:`train` reads as the run's story; each part is a function below it, in the same order:
set-up (:func:`resolve_runtime`, :func:`prepare_run`, :func:`build_model`, :func:`build_training_state`),
restore (:func:`load_checkpoint_weights`, :func:`restore_training_state`), the run directory
(:func:`write_run_files`), a step (:func:`optimizer_step`, then :func:`evaluate` and :func:`run_hooks`), and
a checkpoint (:func:`save_step`, :func:`training_state_dict`).  What the parts share travels in two small
objects: :class:`TrainingRun` (fixed for the run: config, data, runtime) and :class:`TrainState` (what a
step changes and a checkpoint saves: model, optimizer, online averages, step).

Data order is a pure function of (seed, step) (data/batches.py): the global batch of step s is sliced
per rank and micro-batch, so a resumed run, a cooldown branch and a 2-process DDP or FSDP2 run see exactly
the batches a single uninterrupted process would.  A run can therefore resume with another number of
processes as long as the global batch (batch_size x grad_accum x processes) stays the same. The generators'
state a resume restores is train/rng.py's; where everything goes in the run directory, quantdyn/runs.py's.

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

import contextlib
import math
import sys
import time
import uuid
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator, Mapping, Protocol, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from quantdyn.config import dump_yaml, to_dict
from quantdyn.data.batches import batch_starts, get_batch
from quantdyn.data.prepare import TokenData, prepare_data
from quantdyn.errors import QuantdynError
from quantdyn.evaluate.loss import mean_loss
from quantdyn.files import write_json_atomic, write_text_atomic
from quantdyn.models.causal_lm import RunModel, checkpoint_blocks, run_model
from quantdyn.models.hf_io import load_gpt
from quantdyn.progress import Progress
from quantdyn.runs import (
    STATE,
    CheckpointInfo,
    RunDir,
    checkpoint_dir,
    clear_run,
    ema_name,
    has_checkpoints,
    lawa_name,
    read_meta,
    remove_stale_temporaries,
)
from quantdyn.runtime import git_sha, hardware, resolve_device, seed_everything
from quantdyn.schedules import lr_at
from quantdyn.train.averaging import OnlineEMA, OnlineLAWA, local_state_dict
from quantdyn.train.checkpoint import load_training_state, save_checkpoint
from quantdyn.train.config import RunConfig, data_config_of
from quantdyn.train.distributed import (
    Replicated,
    barrier,
    dist_info,
    init_distributed,
    launched_by_torchrun,
    make_strategy,
    mean_over_ranks,
    rank0_first,
)
from quantdyn.train.from_weights import check_hf_run, estimate_optimizer_state, optimizer_start_note
from quantdyn.train.stop_signal import StoppedOnSignal, StopRequest
from quantdyn.train.loggers import (
    TRAIN_GRAD_NORM,
    TRAIN_LOSS,
    TRAIN_LR,
    TRAIN_TOKENS,
    TRAIN_TOKENS_PER_S,
    VAL_LOSS,
    RunLogContext,
    build_loggers,
    check_destinations,
    clear_outputs,
    close_all,
    log_all,
    show_logged,
)
from quantdyn.train.optimizers import build_optimizer, optimizer_eval_mode, optimizer_train_mode
from quantdyn.train.qat import prepare_qat
from quantdyn.train.sam import perturbed
from quantdyn.train.rng import restore_rng_states, rng_states


class StepHook(Protocol):
    """What :func:`train` calls after optimizer steps (``quantdyn.monitor.PTQMonitor`` is one).

    ``due(step)`` is asked on every process (under FSDP2 the weights are gathered, collectively, when any
    hook is due); ``step(model, step, lr, tokens)`` runs on the main process only, with the whole, unwrapped
    model in evaluation mode (schedule-free optimizers: at their averaged point), and returns the metrics to
    log with that step (shared names, e.g. ptq/rtn4/delta_ce). It must leave the weights as it found them."""

    def due(self, step: int) -> bool: ...

    def step(self, model: nn.Module, step: int, lr: float | None = None,
             tokens: int | None = None) -> Mapping[str, float]: ...


@dataclass(frozen=True)
class Runtime:
    """Where this process trains."""

    rank: int  # this process's rank among ``world`` (0 without torchrun)
    world: int  # number of processes
    device: torch.device  # this process's device (under torchrun on GPUs: cuda:LOCAL_RANK)
    distributed: bool  # whether a process group is used (world > 1, or FSDP2 under torchrun with one process)
    strategy: Replicated  # how the model is spread over the processes (DDP replicas or FSDP2 shards)
    amp: str  # compute dtype of the forward passes: 'float32' or 'bfloat16'
    tokens_per_step: int  # tokens per optimizer step over all processes

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that writes the run directory and runs the step hooks."""
        return self.rank == 0


@dataclass(frozen=True)
class TrainingRun:
    """What every part of one call of :func:`train` reads, and none changes."""

    cfg: RunConfig  # the run config as given (its data section as the run reads it: data_config_of)
    resolved: RunConfig  # with the model section resolved (vocabulary size filled in): what artifacts record
    model: RunModel  # what builds, loads and runs the model (quantdyn's GPT, or model.hf's own class)
    run_dir: Path  # the run directory (checkpoints, averages, metrics, config.yaml, run.json)
    data: TokenData  # the token shards
    runtime: Runtime  # this process's place in the run
    parent: dict | None  # what a branch started from (in run.json and every checkpoint); None for a trunk
    checkpoint_steps: frozenset[int]  # steps after which a checkpoint is written (always including train.steps)
    val_windows: torch.Tensor  # validation windows (n, seq_len) for val/loss

    def meta(self, step: int, lr: float, kind: str = "checkpoint", **extra) -> dict:
        """The metadata saved with a checkpoint or an online average of ``step``."""
        cfg = self.cfg
        return {
            "kind": kind,
            "run": cfg.name,
            "step": step,
            "tokens": step * self.runtime.tokens_per_step,
            "lr": lr,
            "peak_lr": cfg.optim.lr,
            "total_steps": cfg.train.steps,
            "schedule": to_dict(cfg.schedule),
            "config": to_dict(self.resolved),
            "data_key": self.data.data_hash,
            "git_sha": git_sha(),
            "seed": cfg.seed,
            "world_size": self.runtime.world,
            "dist_strategy": self.runtime.strategy.name,
            **({"parent": self.parent} if self.parent else {}),
            **extra,
        }

    def step_row(self, step: int, lr: float) -> dict:
        """The fields every logged row of ``step`` has."""
        return {TRAIN_TOKENS: step * self.runtime.tokens_per_step, TRAIN_LR: lr}


@dataclass
class TrainState:
    """What an optimizer step changes and a checkpoint saves."""

    model: nn.Module  # holds the parameters the optimizer updates (under FSDP2 sharded in place)
    train_model: nn.Module  # what the training forward runs: ``model``, compiled and/or wrapped for DDP
    optimizer: torch.optim.Optimizer
    lawa: OnlineLAWA | None  # online LAWA (averaging.lawa_window), None when off
    ema: OnlineEMA | None  # online EMA (averaging.ema_decay or ema_half_life_tokens), None when off
    step: int = 0  # optimizer steps done


# --------------------------------------------------------------------- train
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
    estimated: Path | None = None,
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
    estimated:  model.hf with optimizer_start estimate: the step-0 checkpoint of another run of the same experiment
                (same weights, optimizer, data, batch, seed and processes: the cooldown branches of one checkpoint)
                whose estimated optimizer state this run takes instead of estimating it again.
    """
    runtime = resolve_runtime(cfg)
    run_dir = Path(run_dir) if run_dir is not None else Path(cfg.out_dir) / cfg.name
    cfg = replace(cfg, data=data_config_of(cfg))  # model.hf: the model's own tokenizer
    source = resume or init_from
    _check_start(cfg, run_dir, resume, init_from, overwrite, runtime.tokens_per_step, runtime.world)
    check_destinations(cfg.log.to)  # a logger whose package is missing: one line, before anything runs
    start_runtime(cfg, runtime)
    run = prepare_run(cfg, run_dir, runtime, resume, parent, progress)

    model = build_model(run, source)
    state = build_training_state(run, model)
    if source is not None:
        restore_training_state(run, state, source, exact=resume is not None)
    if state.step >= cfg.train.steps:
        raise QuantdynError(f"the run is already at step {state.step} >= train.steps={cfg.train.steps}; nothing to do")

    # everything is checked: from here on the run directory is written
    loggers = write_run_files(run, state.step, clear=overwrite and source is None, resuming=resume is not None)
    _warn_if_unmonitored(run, hooks)
    console = open_console(run, state.step, progress)
    stop = StopRequest().install()  # SIGUSR1: checkpoint this step and stop (train/stop_signal.py)
    try:
        if source is None and run.model.from_checkpoint:  # model.hf: its weights are the run's step 0
            start_from_weights(run, state, console, estimated)
        throughput = Throughput(state.step, runtime.tokens_per_step)
        model.train()
        for step in range(state.step, cfg.train.steps):
            due = due_after(run, step + 1, stop_after)
            lr, loss, grad_norm = optimizer_step(run, state, step, sync_loss=due.sync_loss)
            stopping = due.sync_loss and stop.agreed(runtime.device)
            if stopping:
                due = replace(due, checkpoint=True)
            row = train_row(run, state.step, lr, loss, grad_norm, throughput) if due.log else None
            due_hooks = [h for h in hooks if h.due(state.step)]  # asked on every process: all take part in gathering
            with averaged_point(state.optimizer, due.evaluate or due.checkpoint or bool(due_hooks)):
                if due.evaluate:
                    row = evaluate(run, state, lr, row)
                if due_hooks:
                    row = run_hooks(run, state, lr, row, due_hooks)
                if row is not None and runtime.is_main:
                    log_all(loggers, row, state.step)
                    show_logged(console, state.step, row, verbose)
                console.update()  # after the row: a plain line shows this step's loss
                if due.checkpoint:
                    save_step(run, state, lr, row)
            if stopping and state.step < cfg.train.steps:
                raise StoppedOnSignal(state.step)
            if stop_after is not None and state.step >= stop_after:
                break
    finally:
        stop.restore()
        close_all(loggers)
        console.close(summary=sys.exc_info()[0] is None)  # no summary line for a run that ends in an error
    return run_dir


# -------------------------------------------------------------------- set-up
def resolve_runtime(cfg: RunConfig) -> Runtime:
    """This process's rank, device and parallel strategy; an optimizer the strategy cannot run is refused here
    (and fsdp2 without torchrun says how to launch)."""
    rank, world, local_rank = dist_info()
    device = resolve_device(cfg.train.device)
    distributed = world > 1 or (cfg.dist.strategy == "fsdp2" and launched_by_torchrun())
    if distributed and device.type == "cuda":
        device = torch.device(f"cuda:{local_rank}")
        torch.cuda.set_device(device)
    strategy = make_strategy(cfg.dist, device, world, rank)
    strategy.check_optimizer(cfg.optim)
    amp = ("bfloat16" if device.type == "cuda" else "float32") if cfg.train.dtype == "auto" else cfg.train.dtype
    return Runtime(rank, world, device, distributed, strategy, amp, cfg.tokens_per_step * world)


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


def start_runtime(cfg: RunConfig, runtime: Runtime) -> None:
    """Join the process group (waits for the other processes) and set torch's thread count."""
    if runtime.distributed:
        init_distributed(runtime.device)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)


def prepare_run(cfg: RunConfig, run_dir: Path, runtime: Runtime, resume: CheckpointInfo | None,
                parent: dict | None, progress: bool) -> TrainingRun:
    """The token data (rank 0 tokenizes and caches the shards; the others wait, then open the cache) and the
    model config it implies, checked against the data and the checkpoint being resumed."""
    tty = bool(getattr(sys.stderr, "isatty", lambda: False)())
    hf = run_model(cfg.model) if cfg.model.hf else None  # read (and checked) before any data is written
    if hf is not None:
        check_hf_run(cfg, hf)
    data = rank0_first(lambda: prepare_data(cfg.data, progress=progress and runtime.is_main and tty),
                       timeout_min=cfg.dist.data_timeout_min, what="preparing the token shards")
    model = hf if hf is not None else run_model(cfg.model, data.vocab_size)
    if hf is None and model.vocab_size < data.vocab_size:
        raise QuantdynError(
            f"model.vocab_size={model.vocab_size} is smaller than the tokenizer's {data.vocab_size} tokens; "
            "set model.vocab_size to 0 (auto) or at least the tokenizer size"
        )
    if hf is None and cfg.train.seq_len > model.max_positions:
        raise QuantdynError(f"train.seq_len={cfg.train.seq_len} exceeds model.max_seq_len={model.max_positions}")
    if resume is not None and resume.meta.get("data_key") is not None and not data.same_data(resume.meta["data_key"]):
        raise QuantdynError(
            f"checkpoint '{resume.path}' was trained on other data (data key {resume.meta['data_key']}, the "
            f"config's data section gives {data.data_hash}); restore the run's data section to resume exactly, or "
            "start a new run from this checkpoint's weights with init_weights=CHECKPOINT"
        )
    resolved = cfg if hf is not None else replace(cfg, model=model.config)
    return TrainingRun(
        cfg=cfg, resolved=resolved, model=model, run_dir=run_dir, data=data, runtime=runtime, parent=parent,
        checkpoint_steps=frozenset(checkpoint_steps(cfg, runtime.tokens_per_step)),
        val_windows=data.eval_windows(cfg.train.seq_len, cfg.train.eval_windows),
    )


def build_model(run: TrainingRun, source: CheckpointInfo | None) -> nn.Module:
    """The model the run starts with, whole and unsharded: the weights of ``source`` (a resume or a branch); else
    the seeded initialisation (``init_weights`` when set) of a GPT, or model.hf's weights. With QAT's
    fake-quantized linears when ``cfg.qat`` is set (same parameter names: checkpoints load into a plain model)."""
    cfg, device = run.cfg, run.runtime.device
    seed_everything(cfg.seed)
    if source is not None and run.model.from_checkpoint:  # one read of the weights: the checkpoint's
        model = run.model.load(source.path, device)
    else:
        model = run.model.initial(device)
        if cfg.init_weights and source is None:
            src = load_gpt(cfg.init_weights, device)
            if src.config.shape() != model.config.shape():
                raise QuantdynError(f"init_weights '{cfg.init_weights}' has a different model shape than the "
                                    "config; use a checkpoint of the same model")
            model.load_state_dict(src.state_dict())
    if cfg.qat is not None:
        prepare_qat(model, cfg.qat)
    if source is not None and not run.model.from_checkpoint:
        load_checkpoint_weights(run, model, source)
    return model


def build_training_state(run: TrainingRun, model: nn.Module) -> TrainState:
    """The model wrapped for the strategy (FSDP2 shards ``model`` in place, one unit per decoder layer; with
    activation checkpointing those layers recompute in the backward), its optimizer and the online averages,
    at step 0."""
    cfg, runtime = run.cfg, run.runtime
    blocks = run.model.blocks(model)
    if cfg.train.activation_checkpointing:
        checkpoint_blocks(blocks)
    train_model = runtime.strategy.wrap(model, cfg.train.compile, runtime.amp, blocks=blocks)
    optimizer = build_optimizer(model, cfg.optim)
    avg = cfg.averaging
    lawa = OnlineLAWA(avg.lawa_window, avg.lawa_every) if avg.lawa_window else None
    ema_decay = avg.ema_decay or (
        0.5 ** (runtime.tokens_per_step / avg.ema_half_life_tokens) if avg.ema_half_life_tokens else 0.0
    )
    return TrainState(model, train_model, optimizer, lawa, OnlineEMA(ema_decay) if ema_decay else None)


# ------------------------------------------------------------------- restore
def load_checkpoint_weights(run: TrainingRun, model: nn.Module, source: CheckpointInfo) -> None:
    """The weights of ``source`` into ``model`` (not yet sharded); a checkpoint of another shape is refused."""
    model.load_state_dict(run.model.load(source.path, run.runtime.device).state_dict())


def restore_training_state(run: TrainingRun, state: TrainState, source: CheckpointInfo, exact: bool) -> None:
    """The optimizer state, step and RNG states of ``source`` into ``state`` (what :func:`training_state_dict`
    saved); ``exact`` (a resume of the run itself): the online averages too, where a branch starts them anew."""
    saved = load_training_state(source.path)
    strategy, model = run.runtime.strategy, state.model
    try:
        strategy.load_optimizer_state(model, state.optimizer, saved["optimizer"])
    except QuantdynError:
        raise
    except (ValueError, KeyError, RuntimeError, TypeError, IndexError) as e:
        raise QuantdynError(
            f"optimizer state in '{source.path}' does not fit optim.name='{run.cfg.optim.name}' "
            f"({type(e).__name__}: {str(e)[:120]}); resume with the optimizer the checkpoint was trained with"
        ) from None
    optimizer_train_mode(state.optimizer)  # checkpoints hold the eval-mode point (schedule-free)
    state.step = int(saved["step"])
    restore_rng_states(saved)
    if not exact:
        return
    if state.lawa is not None and "lawa" in saved:
        lawa = saved["lawa"]
        state.lawa.load_state_dict({"steps": lawa["steps"],
                                    "states": [strategy.scatter(sd, model) for sd in lawa["states"]]})
    if state.ema is not None and "ema" in saved:
        state.ema.load_state_dict({**saved["ema"], "acc": strategy.scatter(saved["ema"]["acc"], model)})


# ------------------------------------------------------------- run directory
def write_run_files(run: TrainingRun, start_step: int, *, clear: bool, resuming: bool) -> list:
    """On the main process: the run directory with its config.yaml and run.json, and the metric loggers
    (rows logged after ``start_step`` are dropped from their files). ``clear`` first deletes the checkpoints
    and outputs of an earlier run there (--overwrite). Returns the loggers (none on the other processes)."""
    if not run.runtime.is_main:
        return []
    cfg, run_dir = run.cfg, run.run_dir
    if clear:
        clear_run(run_dir)
        clear_outputs(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(run_dir)
    rd = RunDir(run_dir)
    write_text_atomic(rd.config, dump_yaml(run.resolved))
    info = rd.read_info()
    info.update(
        {
            "name": cfg.name,
            "data_cache": str(run.data.directory),
            "data_key": run.data.data_hash,
            "tokens_per_step": run.runtime.tokens_per_step,
            # what one optimizer step costs in passes over its tokens (SAM: two), so that runs compare at equal compute
            "forward_backward_per_step": forward_backward_passes(cfg),
            **fake_quant_cost(cfg),
            "world_size": run.runtime.world,
            "dist_strategy": run.runtime.strategy.name,
            "git_sha": git_sha(),
            "hardware": hardware(),
        }
    )
    if run.parent is not None:
        info["parent"] = run.parent
    if run.model.from_checkpoint:  # weights alone: say how the optimizer started (the step-0 checkpoint holds it)
        info["model"] = {"hf": cfg.model.hf, "model_type": run.model.config.get("model_type")}
        info["optimizer_start"] = optimizer_start_note(cfg)
    if "wandb" in cfg.log.to and (not resuming or not info.get("wandb_id")):
        info["wandb_id"] = uuid.uuid4().hex[:12]  # a resume continues the same W&B run
    write_json_atomic(rd.info, info)
    # rows logged after the starting step (a run that crashed past its last checkpoint, or an attempt that
    # crashed before its first one) are dropped: a resumed run logs them again, identically
    return build_loggers(cfg.log.to, RunLogContext(
        run_dir, cfg.name, to_dict(run.resolved), truncate_after=start_step, wandb_id=info.get("wandb_id"),
        wandb_project=cfg.log.wandb_project, wandb_entity=cfg.log.wandb_entity, wandb_mode=cfg.log.wandb_mode))


def _warn_if_unmonitored(run: TrainingRun, hooks: Sequence[StepHook]) -> None:
    """The trainer cannot build the monitor itself (it lives in a layer above): a caller of :func:`train` that
    forgot it is told."""
    mon = run.cfg.monitor
    what = " and ".join(f"monitor.{k}={v}" for k, v in (("every", mon.every), ("warning_every", mon.warning_every)) if v)
    if what and not hooks and run.runtime.is_main:
        warnings.warn(f"{run.cfg.name}: {what} is set but train() got no step hooks, so nothing is "
                      "monitored; pass hooks=quantdyn.monitor.hooks_for(cfg)", stacklevel=3)


def open_console(run: TrainingRun, start_step: int, progress: bool) -> Progress:
    """The run's console output, counting steps (nothing on the other processes, or without ``progress``),
    started with a line saying what the run does."""
    cfg, runtime = run.cfg, run.runtime
    console = Progress(cfg.name, total=cfg.train.steps, initial=start_step, enabled=progress and runtime.is_main,
                       unit="steps", every_n=cfg.log.print_every or cfg.train.log_every)
    processes = f", {runtime.world} processes ({runtime.strategy.name})" if runtime.world > 1 else ""
    sam = (f", {'ASAM' if cfg.optim.sam_adaptive else 'SAM'} rho={cfg.optim.sam_rho:g} (2 forward/backward per step)"
           if cfg.optim.sam_rho > 0 else "")
    console.note(f"steps {start_step} -> {cfg.train.steps}, {runtime.tokens_per_step:,} tokens/step, "
                 f"{runtime.device}{processes}{sam}")
    return console


# ---------------------------------------------------------------------- step
@dataclass(frozen=True)
class Due:
    """What follows one optimizer step."""

    log: bool  # log the step's training row
    evaluate: bool  # measure val/loss
    checkpoint: bool  # write a checkpoint (and the online averages)
    sync_loss: bool  # bring the loss to the host and check that it is finite (a GPU sync)


def due_after(run: TrainingRun, done: int, stop_after: int | None) -> Due:
    """What is due once ``done`` optimizer steps are done."""
    t = run.cfg.train
    at_checkpoint = done in run.checkpoint_steps  # train.steps is one
    log = done % t.log_every == 0 or at_checkpoint
    checkpoint = at_checkpoint or (stop_after is not None and done == stop_after)
    # the loss comes to the host (a GPU sync) every step on the CPU, on a GPU only when it is logged or
    # checkpointed: a divergence is caught there at the latest, and never saved
    return Due(log=log, evaluate=bool(t.eval_every and done % t.eval_every == 0) or at_checkpoint,
               checkpoint=checkpoint, sync_loss=run.runtime.device.type != "cuda" or log or checkpoint)


def optimizer_step(run: TrainingRun, state: TrainState, step: int,
                   sync_loss: bool) -> tuple[float, float | None, torch.Tensor]:
    """Optimizer step ``step`` (0-based): the schedule's LR, forward and backward over the step's micro-batches
    (with ``optim.sam_rho``: a second forward and backward at the SAM-perturbed weights, train/sam.py; the loss
    reported is the first one's, at the weights), gradient clipping, the update, the online averages. Returns (LR, the step's loss when ``sync_loss``, else
    None, the gradient norm before clipping as a device tensor)."""
    cfg = run.cfg
    lr = lr_at(step, cfg.optim.lr, cfg.schedule, cfg.train.steps)
    for g in state.optimizer.param_groups:
        g["lr"] = lr * g.get("lr_scale", 1.0)
    loss = forward_backward(run, state, step)
    if cfg.optim.sam_rho > 0:  # SAM/ASAM: the gradient at w + ε on the same batches, the weights back at w
        with perturbed(list(state.model.parameters()), cfg.optim.sam_rho, cfg.optim.sam_adaptive):
            forward_backward(run, state, step)
    grad_norm = run.runtime.strategy.clip_grad_norm(state.model, cfg.train.grad_clip)
    loss_value = None
    if sync_loss:
        loss_value = float(loss)
        if not math.isfinite(loss_value):
            raise QuantdynError(
                f"training diverged by step {step + 1} (loss {loss_value}); lower optim.lr or check the data"
            )
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    state.step = step + 1
    if state.lawa is not None:
        state.lawa.update(state.step, state.model)
    if state.ema is not None:
        state.ema.update(state.model)
    return lr, loss_value, grad_norm


def forward_backward_passes(cfg: RunConfig) -> int:
    """Forward/backward passes over a step's tokens per optimizer step: 2 with SAM (train/sam.py), else 1."""
    return 2 if cfg.optim.sam_rho > 0 else 1


def fake_quant_cost(cfg: RunConfig) -> dict:
    """What format QAT (``qat.format``) adds to a step, for run.json: the format, and how many times per
    optimizer step every block linear's weight is fake-quantized (once per state of the weights: once, with SAM
    twice; the micro-batches of a step share it). {} without format QAT."""
    if cfg.qat is None or cfg.qat.method != "format":
        return {}
    return {"qat_format": cfg.qat.format, "fake_quant_per_step": forward_backward_passes(cfg)}


def forward_backward(run: TrainingRun, state: TrainState, step: int, stream: int = 0) -> torch.Tensor:
    """Gradients of this process's part of step ``step``'s global batch, accumulated over ``grad_accum``
    micro-batches (synchronised over the processes at the last one); returns the step's loss on this process
    (float64 on the device). ``stream`` 1: the batches of the optimizer-state estimate, not the run's."""
    t, runtime = run.cfg.train, run.runtime
    B, A, world = t.batch_size, t.grad_accum, runtime.world
    starts = batch_starts(len(run.data.train), t.seq_len, run.cfg.seed, step, B * A * world, stream=stream)
    total = torch.zeros((), device=runtime.device, dtype=torch.float64)
    autocast = runtime.strategy.autocast(runtime.amp)
    for micro in range(A):
        at = (micro * world + runtime.rank) * B
        x, y = get_batch(run.data.train, starts[at : at + B], t.seq_len)
        if runtime.device.type == "cuda":  # pinned host memory: the copy overlaps with the GPU's work
            x, y = x.pin_memory(), y.pin_memory()
        x, y = x.to(runtime.device, non_blocking=True), y.to(runtime.device, non_blocking=True)
        with runtime.strategy.gradient_sync(state.train_model, last_micro=micro == A - 1):
            with autocast:
                logits = run.model.logits(state.train_model, x)
                loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1)) / A
            loss.backward()
        total += loss.detach().double()
    return total


def start_from_weights(run: TrainingRun, state: TrainState, console: Progress, estimated: Path | None = None) -> None:
    """A run that starts from a checkpoint's weights alone (model.hf): the optimizer's start as
    ``optimizer_start`` says (estimate: its state filled by steps at LR 0 on batches of their own, the weights
    restored bit for bit afterwards), then the starting point written as the run's step 0 (with that
    optimizer state: a resume from it is exact). ``estimated``: a step-0 checkpoint that holds that estimate
    already (another branch of the same experiment, written by as many processes): its optimizer and RNG states
    are taken, so this run continues exactly as if it had estimated them itself."""
    start = run.cfg.optimizer_start
    saved = _estimate_of(run, estimated) if start.mode == "estimate" and estimated is not None else None
    if saved is not None:
        console.note(f"optimizer state: the estimate over {start.steps} steps of {estimated} (same experiment)")
        run.runtime.strategy.load_optimizer_state(state.model, state.optimizer, saved["optimizer"])
        optimizer_train_mode(state.optimizer)  # checkpoints hold the eval-mode point (schedule-free)
        restore_rng_states(saved)
    elif start.mode == "estimate":
        console.note(f"optimizer state: estimating over {start.steps} steps at LR 0")
        estimate_optimizer_state(state.model, state.optimizer, start.steps,
                                 lambda k: forward_backward(run, state, k, stream=1),
                                 lambda: run.runtime.strategy.clip_grad_norm(state.model, run.cfg.train.grad_clip))
    lr = lr_at(-1, run.cfg.optim.lr, run.cfg.schedule, run.cfg.train.steps)  # the LR before the first update
    with averaged_point(state.optimizer, True):
        save_step(run, state, lr, None)


def _estimate_of(run: TrainingRun, ckpt: Path) -> dict | None:
    """The training state of the step-0 checkpoint ``ckpt`` when it holds this run's optimizer estimate (step 0 of
    a run of the same weights, optimizer, optimizer_start, seed, batch and number of processes); None otherwise
    (the run then estimates it itself)."""
    meta = read_meta(ckpt)
    conf = meta.get("config") or {}
    mine = to_dict(run.resolved)
    same = (meta.get("step") == 0 and meta.get("world_size", 1) == run.runtime.world
            and all(conf.get(k) == mine.get(k) for k in ("model", "data", "optim", "optimizer_start", "seed", "qat"))
            and all((conf.get("train") or {}).get(k) == mine["train"].get(k)
                    for k in ("batch_size", "seq_len", "grad_accum", "grad_clip", "dtype")))
    if not same or not (Path(ckpt) / STATE).is_file():
        return None
    saved = load_training_state(ckpt)
    return saved if int(saved.get("step", -1)) == 0 else None


class Throughput:
    """Tokens per second since the last row that reported it."""

    def __init__(self, step: int, tokens_per_step: int):
        self.step, self.tokens_per_step, self.since = step, tokens_per_step, time.perf_counter()

    def rate(self, step: int) -> float:
        """Tokens per second from the previous call (or the start) to ``step``."""
        now = time.perf_counter()
        rate = (step - self.step) * self.tokens_per_step / max(now - self.since, 1e-9)
        self.step, self.since = step, now
        return rate


def train_row(run: TrainingRun, step: int, lr: float, loss: float, grad_norm: torch.Tensor,
              throughput: Throughput) -> dict:
    """The logged training metrics of ``step`` (the loss averaged over the processes: a collective)."""
    if run.runtime.world > 1:
        loss = mean_over_ranks(loss, run.runtime.device)
    return {**run.step_row(step, lr), TRAIN_LOSS: loss, TRAIN_GRAD_NORM: float(grad_norm),
            TRAIN_TOKENS_PER_S: throughput.rate(step)}


@contextlib.contextmanager
def averaged_point(optimizer: torch.optim.Optimizer, needed: bool) -> Iterator[None]:
    """Inside the block (when ``needed``) the weights sit where they are evaluated and saved: schedule-free
    optimizers' averaged point, not the training point (other optimizers: unchanged)."""
    if not needed:
        yield
        return
    optimizer_eval_mode(optimizer)
    yield
    optimizer_train_mode(optimizer)


def evaluate(run: TrainingRun, state: TrainState, lr: float, row: dict | None) -> dict:
    """``row`` (or the step's base row) with val/loss; every process evaluates (under FSDP2 each forward gathers
    the weights)."""
    batch_size = max(1, min(32, run.cfg.train.batch_size))
    val = mean_loss(state.model, run.val_windows, batch_size=batch_size, dtype=run.runtime.amp)
    return {**(row or run.step_row(state.step, lr)), VAL_LOSS: val}


def run_hooks(run: TrainingRun, state: TrainState, lr: float, row: dict | None,
              hooks: Sequence[StepHook]) -> dict | None:
    """``row`` with the metrics of the due step hooks, which run on the main process with the whole model
    (FSDP2: gathered on rank 0, collectively); the other processes return ``row`` as it was."""
    strategy, runtime = run.runtime.strategy, run.runtime
    monitored = _whole_model(strategy, state.model, run.model, runtime.device) if strategy.shards \
        else state.model
    if not runtime.is_main:
        return row
    row = dict(row or run.step_row(state.step, lr))
    for hook in hooks:
        row.update(hook.step(monitored, state.step, lr=lr, tokens=state.step * runtime.tokens_per_step))
    return row


# ---------------------------------------------------------------- checkpoint
def checkpoint_steps(cfg: RunConfig, tokens_per_step: int) -> set[int]:
    """Steps that end with a checkpoint: train.steps, every checkpoint_every steps, and the first step to reach
    each of checkpoint_tokens."""
    steps = {cfg.train.steps}
    if cfg.train.checkpoint_every:
        steps |= set(range(cfg.train.checkpoint_every, cfg.train.steps + 1, cfg.train.checkpoint_every))
    for t in cfg.train.checkpoint_tokens:
        steps.add(min(cfg.train.steps, max(1, math.ceil(t / tokens_per_step))))
    return steps


def save_step(run: TrainingRun, state: TrainState, lr: float, row: dict | None) -> None:
    """Checkpoint the step just done, with the online averages of that step. Gathering is collective under
    FSDP2: every process takes part, rank 0 writes; the processes wait for each other at the end."""
    strategy, runtime, step = run.runtime.strategy, run.runtime, state.step
    whole = _whole_model(strategy, state.model, run.model, torch.device("cpu")) if strategy.shards \
        else state.model
    training_state = training_state_dict(run, state)
    averages = _online_averages(strategy, state.model, state.lawa, state.ema)
    if runtime.is_main:
        extra = {"val_loss": row.get(VAL_LOSS)} if row else {}
        # the step's averages first, its checkpoint last: the checkpoint commits the step, so a kill
        # between the two resumes from the previous checkpoint and rewrites these averages
        _save_online_averages(run, state, lr, averages)
        save_checkpoint(checkpoint_dir(run.run_dir, step), whole, run.meta(step, lr, **extra), run.data.tokenizer,
                        training_state)
    del whole, training_state, averages  # free the gathered copies before waiting for the other processes
    if runtime.world > 1:
        barrier()


def training_state_dict(run: TrainingRun, state: TrainState) -> dict:
    """What a resume needs beyond the weights: optimizer state (whole, on rank 0), step, RNG states and the
    online averages' accumulators (gathered: collective under FSDP2)."""
    strategy, model = run.runtime.strategy, state.model
    # weights and optimizer state are both saved in eval mode (consistent for schedule-free);
    # a resumed run switches back to train mode after loading them
    saved = {"optimizer": strategy.optimizer_state(model, state.optimizer), "step": state.step, **rng_states()}
    if state.lawa is not None:
        saved["lawa"] = {"steps": state.lawa.steps(),
                         "states": [strategy.gather(sd, model) for sd in state.lawa.state_dict()["states"]]}
    if state.ema is not None:
        saved["ema"] = {**state.ema.state_dict(), "acc": strategy.gather(state.ema.state_dict()["acc"], model)}
    return saved


def _whole_model(strategy, model: nn.Module, run_model: RunModel, device) -> nn.Module | None:
    """A plain (unsharded) model with the gathered weights on rank 0 (None on the others); collective."""
    full = strategy.full_state(model)
    if full is None:
        return None
    return run_model.from_state(full).to(device)


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


def _save_online_averages(run: TrainingRun, state: TrainState, lr: float, averages: dict) -> None:
    """Write the whole-model averages of :func:`_online_averages` as checkpoints under RUN/averages."""
    lawa, ema, step, rd = state.lawa, state.ema, state.step, RunDir(run.run_dir)
    if "lawa" in averages:
        ingredients = [{"step": s, "weight": 1.0 / len(lawa.steps())} for s in lawa.steps()]
        _save_average(run, rd.average(lawa_name(lawa.window, lawa.every), step), averages["lawa"],
                      run.meta(step, lr, kind="lawa", ingredients=ingredients, window=lawa.window, every=lawa.every))
    if "ema" in averages:
        _save_average(run, rd.average(ema_name(ema.decay), step), averages["ema"],
                      run.meta(step, lr, kind="ema", decay=ema.decay, updates=ema.t))


def _save_average(run: TrainingRun, directory: Path, weights: dict, meta: dict) -> None:
    save_checkpoint(directory, run.model.from_state(weights), meta, run.data.tokenizer)
