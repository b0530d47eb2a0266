"""A run that starts from a checkpoint's weights alone (``model.hf``: public checkpoints carry no optimizer state):
what is checked before its data is tokenized, how its optimizer starts (``optimizer_start``: estimate or fresh),
and the sentence run.json records about it. The trainer (train/trainer.py) writes the starting point as step 0.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from quantdyn.data.tokenizer import load_pretrained_tokenizer
from quantdyn.errors import QuantdynError
from quantdyn.models.causal_lm import HFModel
from quantdyn.schedules import _steps
from quantdyn.train.config import RunConfig, data_config_of


def check_hf_run(cfg: RunConfig, model: HFModel) -> None:
    """What a run of model.hf can get wrong, checked before the data is tokenized: the sequence length and a
    tokenizer whose ids do not fit the model's vocabulary."""
    if cfg.train.seq_len > model.max_positions:
        raise QuantdynError(f"train.seq_len={cfg.train.seq_len} exceeds the {model.max_positions} positions of "
                            f"model.hf '{model.ref}'; use a shorter train.seq_len")
    spec = data_config_of(cfg).tokenizer
    tok = load_pretrained_tokenizer(spec)
    if len(tok) > model.vocab_size:
        raise QuantdynError(f"tokenizer '{spec}' has {len(tok)} tokens but model.hf '{model.ref}' only "
                            f"{model.vocab_size}; use the model's own tokenizer (drop data.tokenizer)")


def optimizer_start_note(cfg: RunConfig) -> dict:
    """How the optimizer of a run from model.hf starts, for run.json (the field and a sentence)."""
    start = cfg.optimizer_start
    if start.mode == "estimate":
        how = (f"the checkpoint carries no optimizer state: {cfg.optim.name}'s state was estimated over "
               f"{start.steps} steps at LR 0 on batches of their own (seed {cfg.seed}, stream 1) before step 1; "
               "the weights are the checkpoint's bit for bit (step 0)")
    else:
        warmup = _steps(cfg.schedule.warmup, cfg.train.steps)
        how = (f"the checkpoint carries no optimizer state: {cfg.optim.name} started with an empty state"
               + (f" and a warmup of {warmup} steps" if warmup else ""))
    return {"mode": start.mode, "steps": start.steps if start.mode == "estimate" else 0, "how": how}


def estimate_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int,
                             gradients: Callable[[int], object], clip: Callable[[], object]) -> None:
    """``steps`` optimizer steps at LR 0 (``gradients(k)`` then ``clip()``, as in training) that fill the
    optimizer's state without moving the weights; the weights are restored from a copy afterwards (in host
    memory: this process's shards), so an optimizer whose LR-0 step is not exactly the identity changes nothing
    either. The run's step counter stays at 0."""
    params = [_local(p) for p in model.parameters() if p.requires_grad]
    with torch.no_grad():
        kept = [p.detach().to("cpu", copy=True) for p in params]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    for k in range(steps):
        gradients(k)  # forward and backward of estimate batch k (the trainer's, on its own batch stream)
        clip()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        for p, k in zip(params, kept):
            p.copy_(k)
    del kept


def _local(p: torch.Tensor) -> torch.Tensor:
    """This process's part of a parameter (FSDP2's DTensor shard), the parameter itself otherwise."""
    return p.to_local() if hasattr(p, "to_local") else p
