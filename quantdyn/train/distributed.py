"""How the trainer spreads over the processes torchrun starts: one process, DDP or FSDP2.

    torchrun --nproc_per_node 8 -m quantdyn.cli train configs/pythia160m.yaml dist.strategy=fsdp2

* one process (no torchrun, ``dist.strategy=ddp``): plain training.
* ``ddp``: every process holds the whole model and optimizer state; gradients are all-reduced
  (``DistributedDataParallel``).
* ``fsdp2``: parameters, gradients and optimizer state are sharded over the processes with
  ``torch.distributed.fsdp.fully_shard``, one FSDP unit per decoder block plus the root (embedding,
  final norm, head).  On a GPU the mixed-precision policy computes in bf16 and reduces gradients
  in fp32 (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``); the master weights and the
  optimizer state stay fp32.  On the CPU (gloo) everything is fp32, so CI tests the same code path.

Checkpoints: gathered, one layout for every strategy.  Every checkpoint is the HF directory it
was before (``model.safetensors`` that ``transformers`` loads) plus ``training_state.pt`` whose
optimizer state is exactly what ``optimizer.state_dict()`` of a one-process run holds (full
tensors, parameters numbered in optimizer order).  An FSDP2 run gathers weights and optimizer
state to rank 0 (``get_model_state_dict`` / ``get_optimizer_state_dict`` with
``full_state_dict=True, cpu_offload=True``) and converts the optimizer state from parameter names
to that numbering; resuming slices the full state back into each rank's shard
(``set_optimizer_state_dict(full_state_dict=True)``).  Why gathered rather than sharded
``torch.distributed.checkpoint`` files: the user-facing checkpoint must be a gathered HF
directory anyway, so the weights are gathered either way; a full, name-addressed optimizer state
does not depend on the number of processes, so a run resumes at another world size, and under
another strategy (FSDP2 <-> DDP <-> one process), by construction; and every checkpoint has one
layout that one module (quantdyn/runs.py) names.  The price is rank 0's CPU memory at save
time: about 12 bytes per parameter for AdamW (fp32 weights + two moments) — 2 GB for Pythia-160M,
18 GB for 1.5B; beyond ~10B parameters sharded DCP files would be the better trade.

Every process builds the full fp32 model once before sharding it (identical seeded
initialisation, so an FSDP2 run starts from the same weights as a one-process run); fine to a
few billion parameters.

Optimizers: FSDP2 shards every tensor, so only element-wise optimizers (AdamW, Lion,
schedule-free AdamW) run on the shards; matrix optimizers (Muon, Scion, SOAP, Shampoo, Kron) need
whole matrices and are refused with ``dist.strategy=fsdp2``.
"""
from __future__ import annotations

import contextlib
import datetime
import os
from typing import Any, Callable, TypeVar

import torch
import torch.nn as nn

from quantdyn.errors import QuantdynError
from quantdyn.train.optimizers import MAIN, OPTIMIZERS

T = TypeVar("T")

FSDP2_LAUNCH = "torchrun --nproc_per_node N -m quantdyn.cli train CONFIG dist.strategy=fsdp2"


# ---------------------------------------------------------------- environment
def dist_info() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's environment."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))


def launched_by_torchrun() -> bool:
    """True when torchrun (or another launcher that sets its variables) started this process."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"))


def init_distributed(device: torch.device) -> None:
    """Join the torchrun job's default process group; a gloo group is destroyed when the process exits.

    A process that exits with the group alive can abort at interpreter shutdown ("terminate called without an
    active exception": gloo's worker threads outlive the interpreter; pytorch/pytorch#179291). Seen once in a
    kill-and-resume test on torch 2.11 (gloo): the resumed job's rank 1 died with SIGABRT after training."""
    import atexit

    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend)
        if backend == "gloo":  # NCCL's teardown with work still pending can block: left to the process's end there
            atexit.register(_destroy_default_group)


def _destroy_default_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def is_distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def barrier() -> None:
    if is_distributed():
        import torch.distributed as dist

        dist.barrier()


def mean_over_ranks(value: float, device: torch.device) -> float:
    """The mean of a float over all processes (the value itself with one process)."""
    if not is_distributed():
        return value
    import torch.distributed as dist

    t = torch.tensor([value], device=device, dtype=torch.float64 if device.type == "cpu" else torch.float32)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def rank0_first(fn: Callable[[], T], timeout_min: int = 1440, what: str = "preparing data") -> T:
    """Run ``fn`` on rank 0 while the other processes wait, then on the others.

    For work whose result rank 0 caches on disk (token shards): the others then find the cache.
    The wait uses its own gloo group with a long timeout, since tokenizing a large corpus can
    outlast the default collective timeout.  A :class:`QuantdynError` on rank 0 is raised on every
    rank with the same message (no rank is left waiting for a collective that never comes).
    """
    if not is_distributed():
        return fn()
    import torch.distributed as dist

    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=timeout_min))
    outcome: list[Any] = [None]
    result = None
    if dist.get_rank() == 0:
        try:
            result = fn()
        except QuantdynError as e:
            outcome[0] = str(e)
        except BaseException as e:  # rank 0 failed unexpectedly: let the others stop with a line, then re-raise
            outcome[0] = f"rank 0 failed while {what} ({type(e).__name__}: {e}); see rank 0's output"
            dist.broadcast_object_list(outcome, src=0, group=group)
            raise
    dist.broadcast_object_list(outcome, src=0, group=group)
    dist.barrier(group=group)  # every rank has received before the group's connections are closed
    dist.destroy_process_group(group)
    if outcome[0] is not None:
        raise QuantdynError(outcome[0])
    return result if dist.get_rank() == 0 else fn()


# ------------------------------------------------------------ optimizer state
def optimizer_leaves(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers behind ``optimizer`` (the inner ones of a CombinedOptimizer)."""
    inner = getattr(optimizer, "optimizers", None)
    return list(inner.values()) if isinstance(inner, dict) else [optimizer]


def _leaf_names(optimizer: torch.optim.Optimizer) -> list[str] | None:
    inner = getattr(optimizer, "optimizers", None)
    return list(inner) if isinstance(inner, dict) else None


def _param_names(model: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters(remove_duplicate=True)}


def _leaf_param_fqns(model: nn.Module, leaf: torch.optim.Optimizer) -> list[list[str]]:
    names = _param_names(model)
    return [[names[id(p)] for p in g["params"]] for g in leaf.param_groups]


def optimizer_state_to_fqn(model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict) -> dict:
    """``optimizer.state_dict()`` form (parameters numbered per torch optimizer) -> the
    name-keyed form of ``torch.distributed.checkpoint.state_dict`` for ``optimizer_leaves``."""
    leaves = optimizer_leaves(optimizer)
    names = _leaf_names(optimizer)
    per_leaf = [saved["optimizers"][n] for n in names] if names else [saved]
    state: dict[str, Any] = {}
    groups: list[dict] = []
    for leaf, sd in zip(leaves, per_leaf):
        fqns = _leaf_param_fqns(model, leaf)
        if len(sd["param_groups"]) != len(fqns):
            raise QuantdynError(
                f"the checkpoint's optimizer has {len(sd['param_groups'])} parameter groups but this run builds "
                f"{len(fqns)}; resume with the same optim.name and optim.groups"
            )
        for g_saved, g_names in zip(sd["param_groups"], fqns):
            if len(g_saved["params"]) != len(g_names):
                raise QuantdynError(
                    "the checkpoint's optimizer groups hold other parameters than this run's; "
                    "resume with the same model and optim.groups"
                )
            for idx, fqn in zip(g_saved["params"], g_names):
                if idx in sd["state"]:
                    state[fqn] = sd["state"][idx]
            groups.append({**g_saved, "params": list(g_names)})
    return {"state": state, "param_groups": groups}


def optimizer_state_from_fqn(model: nn.Module, optimizer: torch.optim.Optimizer, full: dict) -> dict:
    """The inverse of :func:`optimizer_state_to_fqn`: what ``optimizer.state_dict()`` of a
    one-process run with the same parameters holds."""
    leaves = optimizer_leaves(optimizer)
    names = _leaf_names(optimizer)
    groups = list(full["param_groups"])
    out = []
    for leaf in leaves:
        fqns = _leaf_param_fqns(model, leaf)
        mine, groups = groups[: len(fqns)], groups[len(fqns):]
        index = {}
        for g_names in fqns:
            for n in g_names:
                index[n] = len(index)
        state = {index[n]: full["state"][n] for g in fqns for n in g if n in full["state"]}
        pg = [{**g, "params": [index[n] for n in g_names]} for g, g_names in zip(mine, fqns)]
        out.append({"state": state, "param_groups": pg})
    return {"optimizers": dict(zip(names, out))} if names else out[0]


def _repoint_combined(optimizer: torch.optim.Optimizer) -> None:
    # loading replaces each inner optimizer's group dicts: a CombinedOptimizer must point at the new ones
    if _leaf_names(optimizer):
        optimizer.param_groups = [g for o in optimizer_leaves(optimizer) for g in o.param_groups]


# ------------------------------------------------------------------ strategies
class Replicated:
    """One process, or DDP: every process holds the whole model."""

    name = "ddp"
    shards = False

    def __init__(self, device: torch.device, world: int, rank: int, cfg=None):
        self.device, self.world, self.rank = device, world, rank

    def check_optimizer(self, optim_cfg) -> None:
        return None

    def wrap(self, model: nn.Module, compile: bool, amp: str, blocks: nn.ModuleList | None = None) -> nn.Module:
        """What the training forward runs (``blocks``: the decoder layers, FSDP2's units)."""
        train_model = torch.compile(model) if compile else model
        if self.world > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            train_model = DDP(train_model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        return train_model

    def autocast(self, amp: str):
        if amp == "bfloat16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def gradient_sync(self, train_model: nn.Module, last_micro: bool):
        if self.world == 1 or last_micro:
            return contextlib.nullcontext()
        return train_model.no_sync()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip the gradients to ``max_norm`` (0 = no clipping); the total norm before clipping, as a
        tensor on the device (reading it is a GPU sync: the trainer does so only when it logs)."""
        params = list(model.parameters())
        if max_norm > 0:
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params if p.grad is not None]))

    def full_state(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """The whole model's weights on rank 0 (CPU tensors; None elsewhere)."""
        return model.state_dict() if self.rank == 0 else None

    def optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict | None:
        return optimizer.state_dict() if self.rank == 0 else None

    def load_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict) -> None:
        optimizer.load_state_dict(saved)

    # averages (LAWA snapshots, EMA accumulators) are kept as this process's part of the weights
    def gather(self, local: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor] | None:
        return local if self.rank == 0 else None

    def scatter(self, full: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
        return full


class FSDP2(Replicated):
    """Parameters, gradients and optimizer state sharded with ``fully_shard`` (see module docstring)."""

    name = "fsdp2"
    shards = True

    def __init__(self, device: torch.device, world: int, rank: int, cfg=None):
        super().__init__(device, world, rank)
        self.reshard_after_forward = True if cfg is None else cfg.reshard_after_forward

    def check_optimizer(self, optim_cfg) -> None:
        if optim_cfg.sam_rho > 0:  # its global gradient norm over shards is untested here
            raise QuantdynError("optim.sam_rho (SAM) is not supported with dist.strategy=fsdp2 yet; use "
                                "dist.strategy=ddp (SAM's gradient norm is then the same on every process)")
        used = {optim_cfg.name} | {r.optimizer for r in optim_cfg.groups if r.optimizer != MAIN}
        matrix = sorted(n for n in used if OPTIMIZERS.get(n).matrix)
        if matrix:
            ok = sorted(n for n in OPTIMIZERS.names() if not OPTIMIZERS.get(n).matrix)
            raise QuantdynError(
                f"optimizer '{matrix[0]}' works on whole weight matrices, which dist.strategy=fsdp2 shards over "
                f"processes; use dist.strategy=ddp, or an element-wise optimizer with fsdp2: {', '.join(ok)}"
            )

    def wrap(self, model: nn.Module, compile: bool, amp: str, blocks: nn.ModuleList | None = None) -> nn.Module:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if self.device.type == "cuda" and amp == "bfloat16":
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        else:  # CPU/gloo, or float32 asked for: fp32 compute and reductions
            mp = MixedPrecisionPolicy()
        for block in model.blocks if blocks is None else blocks:  # one unit per decoder layer
            if compile:
                block.compile()  # in place: parameter names stay those of the checkpoint
            fully_shard(block, reshard_after_forward=self.reshard_after_forward, mp_policy=mp)
        fully_shard(model, mp_policy=mp)  # root: embeddings, final norm, head
        return model

    def autocast(self, amp: str):
        # on the GPU the mixed-precision policy casts parameters to bf16; autocast only where it does not
        if amp == "bfloat16" and self.device.type != "cuda":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def gradient_sync(self, train_model: nn.Module, last_micro: bool):
        # reduce-scatter gradients only after the last micro-batch of a step
        train_model.set_requires_gradient_sync(last_micro)
        return contextlib.nullcontext()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        params = [p for p in model.parameters() if p.grad is not None]
        total = torch.nn.utils.get_total_norm([p.grad for p in params])
        if hasattr(total, "full_tensor"):  # a DTensor holding the partial norms of the shards
            total = total.full_tensor()
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    def full_state(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return sd if self.rank == 0 else None

    def optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict | None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        full = get_optimizer_state_dict(
            model, optimizer_leaves(optimizer), options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        return optimizer_state_from_fqn(model, optimizer, full) if self.rank == 0 else None

    def load_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        full = optimizer_state_to_fqn(model, optimizer, saved)
        set_optimizer_state_dict(model, optimizer_leaves(optimizer), full,
                                 options=StateDictOptions(full_state_dict=True))
        _repoint_combined(optimizer)

    def _templates(self, model: nn.Module) -> dict[str, Any]:
        return dict(model.state_dict())

    def gather(self, local: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor] | None:
        """Whole tensors on rank 0 from this process's shards (laid out like the model's DTensors)."""
        from torch.distributed.tensor import DTensor

        out = {}
        for k, like in self._templates(model).items():
            v = local[k]
            if isinstance(like, DTensor):
                dt = DTensor.from_local(v.to(self.device), like.device_mesh, like.placements,
                                        shape=like.shape, stride=like.stride())
                v = dt.full_tensor().cpu()
            out[k] = v
        return out if self.rank == 0 else None

    def scatter(self, full: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
        """This process's shards of whole tensors (every process holds ``full``; no communication)."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        out = {}
        for k, like in self._templates(model).items():
            v = full[k]
            if isinstance(like, DTensor):
                v = distribute_tensor(v.to(self.device), like.device_mesh, like.placements, src_data_rank=None).to_local().cpu()
            out[k] = v
        return out


def make_strategy(dist_cfg, device: torch.device, world: int, rank: int) -> Replicated:
    """The strategy object for ``dist_cfg.strategy`` (checks that fsdp2 runs under torchrun)."""
    if dist_cfg.strategy == "fsdp2":
        if not launched_by_torchrun():
            raise QuantdynError(
                "dist.strategy=fsdp2 shards the model over processes that torchrun starts; launch with "
                f"`{FSDP2_LAUNCH}` (N >= 1), or use dist.strategy=ddp for one process"
            )
        return FSDP2(device, world, rank, dist_cfg)
    return Replicated(device, world, rank, dist_cfg)
