"""The training loop: one function, :func:`train`, for fresh runs, resumed
runs and cooldown branches; data-parallel under torchrun (DDP).

Data order is a pure function of (seed, step): the global batch of step s is
drawn from ``np.random.default_rng([seed, s])`` and sliced per rank and
micro-batch, so a resumed run, a cooldown branch and a 2-process DDP run see
exactly the batches a single uninterrupted process would.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from quantdyn.config import dump_yaml, to_dict
from quantdyn.data.prepare import prepare_data
from quantdyn.errors import QuantdynError
from quantdyn.evaluate.loss import mean_loss
from quantdyn.models.gpt import GPT, resolve_model_config
from quantdyn.files import write_json_atomic
from quantdyn.runtime import git_sha, hardware, resolve_device, seed_everything
from quantdyn.train.averaging import OnlineEMA, OnlineLAWA
from quantdyn.train.checkpoint import (
    CheckpointInfo,
    checkpoint_dir,
    load_training_state,
    save_checkpoint,
)
from quantdyn.train.config import RunConfig
from quantdyn.train.optimizers import build_optimizer, optimizer_eval_mode, optimizer_train_mode
from quantdyn.train.schedules import lr_at


# ---------------------------------------------------------------- distributed
def dist_info() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's environment."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))


def init_distributed(device: torch.device) -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")


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


# ------------------------------------------------------------------ metrics
def append_metrics(path: Path, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()


def truncate_metrics(path: Path, max_step: int) -> None:
    """Drop rows logged after ``max_step`` (a crashed run logged past its last checkpoint)."""
    if not path.is_file():
        return
    keep = [l for l in path.read_text().splitlines() if l.strip() and json.loads(l).get("step", 0) <= max_step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(l + "\n" for l in keep))
    os.replace(tmp, path)


def read_metrics(run_dir: Path) -> list[dict]:
    p = Path(run_dir) / "metrics.jsonl"
    if not p.is_file():
        return []
    return [json.loads(l) for l in p.read_text().splitlines() if l.strip()]


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
) -> Path:
    """Train ``cfg``; return the run directory.

    resume:     continue this run from one of its own checkpoints (exactly).
    init_from:  start from another run's checkpoint (weights, optimizer, step) —
                how cooldown branches and controls begin.
    stop_after: stop (after checkpointing) once this step is reached; for tests
                that simulate an interrupted run.
    """
    rank, world, local_rank = dist_info()
    device = resolve_device(cfg.train.device)
    if world > 1:
        if device.type == "cuda":
            device = torch.device(f"cuda:{local_rank}")
            torch.cuda.set_device(device)
        init_distributed(device)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    run_dir = Path(run_dir) if run_dir is not None else Path(cfg.out_dir) / cfg.name
    is_main = rank == 0

    data = prepare_data(cfg.data, progress=progress and is_main)
    mcfg = resolve_model_config(cfg.model, data.vocab_size)
    if mcfg.vocab_size < data.vocab_size:
        raise QuantdynError(
            f"model.vocab_size={mcfg.vocab_size} is smaller than the tokenizer's {data.vocab_size} tokens; "
            "set model.vocab_size to 0 (auto) or at least the tokenizer size"
        )
    if cfg.train.seq_len > mcfg.max_seq_len:
        raise QuantdynError(f"train.seq_len={cfg.train.seq_len} exceeds model.max_seq_len={mcfg.max_seq_len}")
    resolved = replace(cfg, model=mcfg)

    seed_everything(cfg.seed)
    model = GPT(mcfg).to(device)
    if cfg.init_weights and resume is None and init_from is None:
        _load_weights(model, cfg.init_weights, device)
    if cfg.qat is not None:
        from quantdyn.quantize.qat import prepare_qat

        prepare_qat(model, cfg.qat)  # same parameter names: checkpoints load into a plain GPT
    optimizer = build_optimizer(model, cfg.optim)
    start_step = 0
    lawa = OnlineLAWA(cfg.averaging.lawa_window, cfg.averaging.lawa_every) if cfg.averaging.lawa_window else None
    tokens_per_step = cfg.tokens_per_step * world
    ema_decay = cfg.averaging.ema_decay or (
        0.5 ** (tokens_per_step / cfg.averaging.ema_half_life_tokens) if cfg.averaging.ema_half_life_tokens else 0.0
    )
    ema = OnlineEMA(ema_decay) if ema_decay else None

    source = resume or init_from
    if source is not None:
        from quantdyn.models.hf_io import load_gpt

        src = load_gpt(source.path, device)
        if src.config.shape() != mcfg.shape():
            raise QuantdynError(
                f"checkpoint '{source.path}' has model shape {to_dict(src.config)} but the config asks for "
                f"{to_dict(mcfg)}; resume with the run's own config.yaml"
            )
        model.load_state_dict(src.state_dict())
        del src
        state = load_training_state(source.path)
        try:
            optimizer.load_state_dict(state["optimizer"])
        except (ValueError, KeyError, RuntimeError) as e:
            raise QuantdynError(
                f"optimizer state in '{source.path}' does not fit optim.name='{cfg.optim.name}' ({e}); "
                "resume with the optimizer the checkpoint was trained with"
            ) from None
        optimizer_train_mode(optimizer)  # checkpoints hold the eval-mode point (schedule-free)
        start_step = int(state["step"])
        if "torch_rng" in state:
            torch.set_rng_state(state["torch_rng"])
        if "numpy_rng" in state:  # Kron draws from the global numpy RNG
            set_numpy_rng(state["numpy_rng"])
        if resume is not None:
            if lawa is not None and "lawa" in state:
                lawa.load_state_dict(state["lawa"])
            if ema is not None and "ema" in state:
                ema.load_state_dict(state["ema"])
    if start_step >= cfg.train.steps:
        raise QuantdynError(f"the run is already at step {start_step} >= train.steps={cfg.train.steps}; nothing to do")

    metrics_path = run_dir / "metrics.jsonl"
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(dump_yaml(resolved))
        info_path = run_dir / "run.json"
        info = json.loads(info_path.read_text()) if info_path.is_file() else {}
        info.update(
            {
                "name": cfg.name,
                "data_cache": str(data.directory),
                "data_key": data.data_hash,
                "tokens_per_step": tokens_per_step,
                "world_size": world,
                "git_sha": git_sha(),
                "hardware": hardware(),
            }
        )
        if parent is not None:
            info["parent"] = parent
        write_json_atomic(info_path, info)
        if resume is not None:
            truncate_metrics(metrics_path, start_step)

    train_model = model
    if cfg.train.compile:
        train_model = torch.compile(model)
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        train_model = DDP(train_model, device_ids=[device.index] if device.type == "cuda" else None)

    amp = _amp_dtype(cfg, device)
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if (amp == "bfloat16" and device.type == "cuda")
        else torch.autocast("cpu", dtype=torch.bfloat16)
        if amp == "bfloat16"
        else contextlib.nullcontext()
    )
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
            **({"parent": parent} if parent else {}),
            **extra,
        }

    from tqdm import tqdm

    bar = tqdm(total=cfg.train.steps, initial=start_step, desc=cfg.name, disable=not (progress and is_main), unit="step")
    t_last, tok_since = time.perf_counter(), 0
    model.train()
    lr = lr_at(max(0, start_step - 1), cfg.optim.lr, cfg.schedule, cfg.train.steps)
    for step in range(start_step, cfg.train.steps):
        lr = lr_at(step, cfg.optim.lr, cfg.schedule, cfg.train.steps)
        for g in optimizer.param_groups:
            g["lr"] = lr * g.get("lr_scale", 1.0)
        starts = batch_starts(len(train_tokens), T, cfg.seed, step, B * A * world)
        loss_sum = 0.0
        for micro in range(A):
            sl = starts[(micro * world + rank) * B : (micro * world + rank + 1) * B]
            x, y = get_batch(train_tokens, sl, T)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            sync = contextlib.nullcontext() if (world == 1 or micro == A - 1) else train_model.no_sync()
            with sync:
                with autocast:
                    logits = train_model(x)
                    loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1)) / A
                loss.backward()
            loss_sum += float(loss.detach())
        if cfg.train.grad_clip > 0:
            gn = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip))
        else:
            gn = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None])))
        if not math.isfinite(loss_sum):
            raise QuantdynError(
                f"training diverged at step {step} (loss {loss_sum}); lower optim.lr or check the data"
            )
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        done = step + 1
        tok_since += tokens_per_step
        if lawa is not None:
            lawa.update(done, model)
        if ema is not None:
            ema.update(model)
        bar.update(1)

        if world > 1:
            import torch.distributed as dist

            t = torch.tensor([loss_sum], device=device)
            dist.all_reduce(t)
            loss_sum = float(t) / world
        row = None
        if done % cfg.train.log_every == 0 or done in ckpt_steps or done == cfg.train.steps:
            now = time.perf_counter()
            row = {
                "step": done,
                "tokens": done * tokens_per_step,
                "lr": lr,
                "train_loss": loss_sum,
                "grad_norm": gn,
                "tokens_per_s": tok_since / max(now - t_last, 1e-9),
            }
            t_last, tok_since = now, 0
        want_eval = (cfg.train.eval_every and done % cfg.train.eval_every == 0) or done in ckpt_steps
        want_ckpt = done in ckpt_steps or (stop_after is not None and done == stop_after)
        want_monitor = bool(cfg.monitor.every and done % cfg.monitor.every == 0 and is_main)
        if want_eval or want_ckpt or want_monitor:
            # schedule-free optimizers evaluate and save the averaged point, not the training point
            optimizer_eval_mode(optimizer)
        if want_eval:
            val = mean_loss(model, val_windows, batch_size=max(1, min(32, B)), dtype=amp)
            row = dict(row or {"step": done, "tokens": done * tokens_per_step, "lr": lr}, val_loss=val)
            bar.set_postfix(val=f"{val:.3f}", lr=f"{lr:.2e}")
        if want_monitor:
            from quantdyn.study.monitor import monitor_quantization

            row = dict(row or {"step": done, "tokens": done * tokens_per_step, "lr": lr})
            row.update(monitor_quantization(model, data, cfg.monitor, cfg.train.seq_len))
        if row is not None and is_main:
            append_metrics(metrics_path, row)
        if want_ckpt:
            if is_main:
                # weights and optimizer state are both saved in eval mode (consistent for schedule-free);
                # a resumed run switches back to train mode after loading them
                state = {"optimizer": optimizer.state_dict(), "step": done, "torch_rng": torch.get_rng_state(),
                         "numpy_rng": numpy_rng_state()}
                if lawa is not None:
                    state["lawa"] = lawa.state_dict()
                if ema is not None:
                    state["ema"] = ema.state_dict()
                extra = {"val_loss": row.get("val_loss")} if row else {}
                save_checkpoint(checkpoint_dir(run_dir, done), model, meta_for(done, lr, **extra), data.tokenizer, state)
                _save_online_averages(run_dir, done, model, lawa, ema, meta_for, lr, data)
            if world > 1:
                import torch.distributed as dist

                dist.barrier()
        if want_eval or want_ckpt or want_monitor:
            optimizer_train_mode(optimizer)
        if stop_after is not None and done >= stop_after:
            break
    bar.close()
    return run_dir


def _load_weights(model: GPT, path: str, device) -> None:
    from quantdyn.models.hf_io import load_gpt

    src = load_gpt(path, device)
    if src.config.shape() != model.config.shape():
        raise QuantdynError(
            f"init_weights '{path}' has a different model shape than the config; use a checkpoint of the same model"
        )
    model.load_state_dict(src.state_dict())


def _save_online_averages(run_dir, step, model, lawa, ema, meta_for, lr, data) -> None:
    if lawa is not None and lawa.ready():
        avg = GPT(model.config)
        avg.load_state_dict(lawa.average())
        ingredients = [{"step": s, "weight": 1.0 / len(lawa.steps())} for s in lawa.steps()]
        save_checkpoint(
            Path(run_dir) / "averages" / f"lawa-k{lawa.window}-p{lawa.every}" / f"step-{step:07d}",
            avg,
            meta_for(step, lr, kind="lawa", ingredients=ingredients, window=lawa.window, every=lawa.every),
            data.tokenizer,
        )
    if ema is not None and ema.t > 0:
        avg = GPT(model.config)
        avg.load_state_dict(ema.average(model.state_dict()))
        save_checkpoint(
            Path(run_dir) / "averages" / f"ema-{ema.decay:.6g}" / f"step-{step:07d}",
            avg,
            meta_for(step, lr, kind="ema", decay=ema.decay, updates=ema.t),
            data.tokenizer,
        )
