"""Optimizers: one registry, one declared parameter-group table, one builder.

Parameter groups (``OptimConfig.groups``; paper A: no weight decay on biases
and norms; paper B: matrix optimizers on hidden 2-D weights only, AdamW on
embeddings, output head and vectors):

  =============  ==========================================  ====================
  group          which parameters                            default optimizer
  =============  ==========================================  ====================
  hidden_matrix  every >=2-D weight that is not below        the run's optimizer
  embedding      weights of ``nn.Embedding`` modules          'main' -> AdamW for
                 (input embedding; a tied head lands here)    matrix optimizers
  head           the output projection (``embed_out`` /      'main' -> AdamW for
                 ``get_output_embeddings()`` / ``lm_head``)   matrix optimizers
  no_decay       every 0-/1-D parameter (biases, norm         'main' -> AdamW for
                 weights); weight decay multiplier 0          matrix optimizers
  =============  ==========================================  ====================

"Matrix" optimizers (muon, scion, soap, shampoo, kron) therefore never see the
vocabulary embedding or the head: an 8192x8192 eigendecomposition of SOAP's
preconditioner cost 194 s for one step.

LR contract with the trainer
----------------------------
Every param group of the returned optimizer (also of a :class:`CombinedOptimizer`,
whose ``param_groups`` are the inner optimizers' own dicts) carries

* ``"group_name"``: one of ``hidden_matrix``, ``embedding``, ``head``, ``no_decay``;
* ``"lr_scale"``: float; the trainer sets ``group["lr"] = schedule_lr(step) *
  group["lr_scale"]`` before every step, where ``schedule_lr`` peaks at
  ``OptimConfig.lr``.  ``lr_scale = row.lr_scale * spec.lr_scale`` (the second
  factor only for the run's own optimizer; see the table below).
* ``"weight_decay"``: ``OptimConfig.weight_decay * row.wd_scale / spec.lr_scale``
  so that the decoupled decay per step, ``lr * wd``, is the same for every
  optimizer at the same schedule.

At construction ``group["lr"] = OptimConfig.lr * lr_scale``, so the optimizer
also works without a trainer.

Registered optimizers (``OPTIMIZERS``), with the defaults chosen here
---------------------------------------------------------------------
=====================  ================================================  ========
name                   implementation and defaults                       lr_scale
=====================  ================================================  ========
adamw                  torch.optim.AdamW(betas, eps from the config)       1
muon                   torch.optim.Muon on hidden_matrix: momentum 0.95,   1
                       Nesterov, 5 quintic Newton-Schulz steps (bf16),
                       ``adjust_lr_fn='match_rms_adamw'`` (Moonshot: the
                       update RMS is 0.2*lr like AdamW's, so AdamW's peak
                       LR and weight decay are reused); AdamW elsewhere
scion                  pytorch_optimizer.SCION on hidden_matrix: spectral  1/12
                       LMO (sqrt(d_out/d_in) * UV^T), radius ``scale`` 50,
                       momentum (weight of the new gradient) 0.1; lr 3e-3/12
                       = 2.5e-4 ~ 2^-12 as in Pethick et al.'s nanoGPT runs
soap                   pytorch_optimizer.SOAP on hidden_matrix: betas/eps  1
                       from the config, precondition_frequency 10 (paper B)
shampoo                pytorch_optimizer.ScalableShampoo on hidden_matrix  1
                       with *Adam grafting* (our ``_AdamGraft``: RMSProp
                       statistics with beta2 and bias correction, EMA
                       momentum beta1), preconditioners recomputed every
                       20 steps (paper B) and used from step 21, block 512,
                       decoupled weight decay
kron                   pytorch_optimizer.Kron (PSGD-Kron) on               1/3
                       hidden_matrix: momentum 0.9, the library's update-
                       probability schedule (1 for 500 steps, then decays
                       to 0.03); lr 1/3 of AdamW's (kron_torch advice)
lion                   pytorch_optimizer.Lion on every group, betas        1/10
                       (0.9, 0.99) (Chen et al.); lr 3-10x smaller than
                       AdamW's and weight decay larger in proportion
schedulefree_adamw     pytorch_optimizer.ScheduleFreeAdamW on every group  1
                       (betas, eps from the config; internal warmup 0 --
                       the trainer's schedule warms up; use a constant
                       schedule after warmup).  Needs train/eval switching:
                       see :func:`optimizer_train_mode`
=====================  ================================================  ========

Optimizer-specific hyperparameters go in ``OptimConfig.extra`` (a dict of
keyword arguments of the run's optimizer class, checked against its
constructor signature; ``lr`` and ``weight_decay`` come from the typed fields,
and ``betas``/``eps`` too for optimizers that take them from the config).

Schedule-free AdamW keeps two sequences; the parameters hold the *training*
point ``y`` in train mode and the averaged point ``x`` in eval mode.  Call
:func:`optimizer_train_mode` before training steps and
:func:`optimizer_eval_mode` before evaluating, quantizing or saving weights
for analysis; save optimizer state in train mode.  Both are no-ops for every
other optimizer.

Gradient clipping is not done here (the trainer does it).
"""
from __future__ import annotations

import functools
import inspect
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from quantdyn.errors import QuantdynError, did_you_mean, unknown_name
from quantdyn.registry import Registry

GROUP_NAMES: tuple[str, ...] = ("hidden_matrix", "embedding", "head", "no_decay")
"""The parameter groups, in the order they appear in every optimizer."""

MAIN = "main"
"""Row optimizer meaning 'the run's optimizer' (``OptimConfig.name``)."""


# --------------------------------------------------------------------------- config


@dataclass(frozen=True)
class GroupRule:
    """One row of the parameter-group table."""

    name: str
    """Group: 'hidden_matrix', 'embedding', 'head' or 'no_decay'."""
    optimizer: str = MAIN
    """'main' = the run's optimizer (matrix optimizers fall back to AdamW outside
    hidden_matrix, as in paper B), or a registered optimizer name for this group."""
    lr_scale: float = 1.0
    """Multiplier on the schedule's LR for this group (times the optimizer's own lr_scale)."""
    wd_scale: float = 1.0
    """Multiplier on OptimConfig.weight_decay for this group (0 = no decay)."""

    def __post_init__(self):
        if self.name not in GROUP_NAMES:
            raise unknown_name("parameter group", self.name, GROUP_NAMES)
        if self.optimizer != MAIN and self.optimizer not in OPTIMIZERS:
            raise unknown_name("optimizer", self.optimizer, [MAIN, *OPTIMIZERS.names()])
        if not (self.lr_scale >= 0 and math.isfinite(self.lr_scale)):
            raise QuantdynError(f"optim.groups[{self.name}].lr_scale={self.lr_scale} must be a finite number >= 0")
        if not (self.wd_scale >= 0 and math.isfinite(self.wd_scale)):
            raise QuantdynError(f"optim.groups[{self.name}].wd_scale={self.wd_scale} must be a finite number >= 0")


DEFAULT_GROUPS: tuple[GroupRule, ...] = (
    GroupRule("hidden_matrix"),
    GroupRule("embedding"),
    GroupRule("head"),
    GroupRule("no_decay", wd_scale=0.0),  # paper A: no weight decay on biases and norms
)


@dataclass(frozen=True)
class OptimConfig:
    """Optimizer choice and hyperparameters (paper A defaults for AdamW)."""

    name: str = "adamw"
    """Registered optimizer: adamw, muon, scion, soap, shampoo, kron, lion, schedulefree_adamw."""
    lr: float = 3e-3
    """Peak learning rate of the schedule (paper A: 3e-3); groups multiply it by their lr_scale."""
    betas: tuple[float, float] = (0.9, 0.95)
    """(beta1, beta2) for AdamW and the optimizers that take Adam-style betas (paper A: 0.9, 0.95)."""
    eps: float = 1e-8
    """Adam epsilon (AdamW, SOAP, schedule-free AdamW, Shampoo's Adam graft)."""
    weight_decay: float = 0.1
    """Decoupled weight decay (paper A: 0.1); per group times wd_scale, divided by the optimizer's lr_scale."""
    groups: tuple[GroupRule, ...] = DEFAULT_GROUPS
    """Parameter-group table; rows given override the defaults by name, missing rows keep them."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the run's optimizer class (checked against its signature),
    e.g. {'precondition_frequency': 5} for soap or {'ns_steps': 6} for muon."""
    sam_rho: float = 0.0
    """Sharpness-aware minimisation around the optimizer (train/sam.py): the radius ρ of the perturbation
    (Foret et al. 2021 use 0.05); 0 = off. Each step then costs two forward/backward passes."""
    sam_adaptive: bool = False
    """ASAM (Kwon et al. 2021): the perturbation scaled by |w| element-wise (scale-invariant); needs sam_rho > 0
    (ASAM's ρ is typically ~10x SAM's, e.g. 0.5)."""

    def __post_init__(self):
        spec = OPTIMIZERS.get(self.name)  # unknown name -> QuantdynError with did-you-mean
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise QuantdynError(f"optim.lr={self.lr} must be a positive number (paper A peak: 3e-3)")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise QuantdynError(f"optim.betas={self.betas} must be two numbers in [0, 1), e.g. [0.9, 0.95]")
        if not self.eps > 0:
            raise QuantdynError(f"optim.eps={self.eps} must be positive")
        if not self.weight_decay >= 0:
            raise QuantdynError(f"optim.weight_decay={self.weight_decay} must be >= 0")
        if not (self.sam_rho >= 0 and math.isfinite(self.sam_rho)):
            raise QuantdynError(f"optim.sam_rho={self.sam_rho} must be >= 0 (0 = no SAM; Foret et al. use 0.05)")
        if self.sam_adaptive and not self.sam_rho > 0:
            raise QuantdynError("optim.sam_adaptive=true needs optim.sam_rho > 0 (ASAM's radius, e.g. 0.5)")
        rows = {r.name: r for r in DEFAULT_GROUPS}
        seen: set[str] = set()
        for r in self.groups:
            if not isinstance(r, GroupRule):
                raise QuantdynError(f"optim.groups entries must be group rules, got {r!r}")
            if r.name in seen:
                raise QuantdynError(f"optim.groups lists group '{r.name}' twice; keep one row per group")
            seen.add(r.name)
            rows[r.name] = r
        object.__setattr__(self, "groups", tuple(rows[n] for n in GROUP_NAMES))
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        extra = {k: tuple(v) if isinstance(v, list) else v for k, v in dict(self.extra).items()}
        allowed = spec.extra_keys()
        for k in extra:
            if k not in allowed:
                taken = {"lr", "weight_decay", "params"} | (set(spec.from_config) if spec.from_config else set())
                why = f"; set optim.{k} instead" if k in taken else ""
                raise QuantdynError(
                    f"unknown optim.extra key '{k}' for optimizer '{self.name}'"
                    f"{did_you_mean(k, allowed)}{why}; valid keys: {', '.join(sorted(allowed)) or '(none)'}"
                )
        object.__setattr__(self, "extra", extra)


# --------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class OptimizerSpec:
    """How to build one registered optimizer."""

    load: Callable[[], type]
    """Returns the optimizer class (imported lazily: pytorch_optimizer takes seconds to
    import); its constructor signature defines the valid ``extra`` keys."""
    matrix: bool
    """True: runs on hidden 2-D weights only; 'main' rows of other groups get AdamW."""
    defaults: Mapping[str, Any]
    """Constructor keyword arguments chosen here (paper defaults); ``extra`` overrides them."""
    from_config: tuple[str, ...] = ()
    """Which of 'betas', 'eps' the optimizer takes from OptimConfig (and not from ``extra``)."""
    config_kwarg: Mapping[str, str] = field(default_factory=dict)
    """Renames of config fields to constructor arguments (e.g. eps -> diagonal_eps)."""
    lr_scale: float = 1.0
    """LR multiplier of this optimizer relative to AdamW's peak (weight decay divided by it)."""
    two_d_only: bool = False
    """The class refuses tensors that are not 2-D (torch.optim.Muon)."""
    needs_opt_einsum: bool = False
    """Multi-operand einsums (PSGD-Kron) need opt_einsum for a sane contraction order."""

    @property
    def cls(self) -> type:
        return self.load()

    def extra_keys(self) -> set[str]:
        taken = {"self", "params", "lr", "weight_decay", "kwargs", "args"}
        taken |= {self.config_kwarg.get(k, k) for k in self.from_config}
        for klass in self.cls.__mro__:  # a thin subclass taking **kwargs validates against its parent
            names = {p for p in inspect.signature(klass.__init__).parameters if p not in taken}
            if names:
                return names
        return set()

    def build(self, groups: list[dict], cfg: OptimConfig, extra: Mapping[str, Any]) -> torch.optim.Optimizer:
        kwargs: dict[str, Any] = dict(self.defaults)
        for k in self.from_config:
            kwargs[self.config_kwarg.get(k, k)] = getattr(cfg, k)
        kwargs.update(extra)
        if self.needs_opt_einsum and not torch.backends.opt_einsum.is_available():
            # Without opt_einsum torch.einsum contracts Kron's 5-operand expressions left to
            # right through n^4..n^5 intermediates: ~30x slower even on a tiny model.
            raise QuantdynError("optimizer 'kron' needs the opt_einsum package; run: pip install opt_einsum")
        try:
            return self.cls(groups, lr=cfg.lr, **kwargs)
        except (TypeError, ValueError) as e:
            raise QuantdynError(f"cannot build optimizer {self.cls.__name__} with {kwargs}: {e}") from None


OPTIMIZERS: Registry[OptimizerSpec] = Registry("optimizer")


# ---- Shampoo with Adam grafting -------------------------------------------------------
# pytorch_optimizer 4.1 has SGD/AdaGrad/RMSProp/sign grafts but no Adam graft; paper B
# uses Shampoo with Adam grafting.  _AdamGraft is RMSProp grafting with bias correction
# of the second moment; ScalableShampoo applies EMA momentum (beta1) on top when
# moving_average_for_momentum=True, which makes the graft Adam.  Its state is kept in
# plain tensors by state_dict() so checkpoints load with torch.load(weights_only=True).


@functools.lru_cache(maxsize=None)
def _shampoo_class() -> type:
    from pytorch_optimizer.optimizer.shampoo import ScalableShampoo
    from pytorch_optimizer.optimizer.utils.graft import LayerWiseGrafting, RMSPropGraft
    from pytorch_optimizer.optimizer.utils.preconditioner import PreConditioner

    class _AdamGraft(RMSPropGraft):
        """RMSProp graft with Adam's bias correction of the second moment."""

        def __init__(self, var: torch.Tensor, diagonal_eps: float):
            super().__init__(var, diagonal_eps)
            self.count = 0
            self.beta2 = 0.0

        def add_statistics(self, grad: torch.Tensor, beta2: float) -> None:
            self.count += 1
            self.beta2 = beta2
            super().add_statistics(grad, beta2)

        def precondition_gradient(self, grad: torch.Tensor) -> torch.Tensor:
            bc2 = 1.0 - self.beta2 ** max(self.count, 1)
            return grad.div(self.statistics.div(bc2).sqrt_().add_(self.diagonal_eps))

    class ShampooAdamGraft(ScalableShampoo):
        """ScalableShampoo with Adam grafting and tensor-only state dicts."""

        def __init__(self, params, **kwargs):
            kwargs.setdefault("graft_type", LayerWiseGrafting.RMSPROP)
            super().__init__(params, **kwargs)
            self.graft_type = int(self.graft_type)

        def __str__(self) -> str:
            return "ShampooAdamGraft"

        def _new_state(self, p: torch.Tensor, beta2: float) -> tuple[Any, Any]:
            pc = PreConditioner(
                p, beta2, self.inverse_exponent_override, self.block_size,
                self.skip_preconditioning_rank_lt, self.no_preconditioning_for_layers_with_dim_gt,
                self.shape_interpretation, self.pre_conditioner_type, self.matrix_eps, self.use_svd,
            )
            return pc, _AdamGraft(p, self.diagonal_eps)

        def init_group(self, group, **kwargs) -> None:
            if "step" not in group:
                group["step"] = 0
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state["momentum"] = torch.zeros_like(p.grad)
                    state["pre_conditioner"], state["graft"] = self._new_state(p, group["betas"][1])

        def state_dict(self) -> dict[str, Any]:
            sd = super().state_dict()
            flat = {}
            for idx, st in sd["state"].items():
                st = dict(st)
                pc, gr = st.pop("pre_conditioner", None), st.pop("graft", None)
                if pc is not None:
                    st["pc_statistics"] = pc.statistics
                    st["pc_pre_conditioners"] = pc.pre_conditioners
                    st["graft_momentum"] = gr.momentum
                    st["graft_statistics"] = gr.statistics
                    st["graft_count"] = torch.tensor(gr.count, dtype=torch.int64)
                flat[idx] = st
            sd["state"] = flat
            return sd

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            super().load_state_dict(state_dict)
            for group in self.param_groups:
                for p in group["params"]:
                    st = self.state.get(p)
                    if not st or "pc_statistics" not in st:
                        continue
                    pc, gr = self._new_state(p, group["betas"][1])
                    pc.statistics = st.pop("pc_statistics")
                    pc.pre_conditioners = st.pop("pc_pre_conditioners")
                    gr.momentum = st.pop("graft_momentum")
                    gr.statistics = st.pop("graft_statistics")
                    gr.count = int(st.pop("graft_count"))
                    gr.beta2 = group["betas"][1]
                    st["pre_conditioner"], st["graft"] = pc, gr

    return ShampooAdamGraft


def _po(name: str) -> Callable[[], type]:
    def load() -> type:
        import pytorch_optimizer

        return getattr(pytorch_optimizer, name)

    return load


def _register_builtins() -> None:
    OPTIMIZERS.add("adamw", OptimizerSpec(lambda: torch.optim.AdamW, matrix=False, defaults={}, from_config=("betas", "eps")))
    OPTIMIZERS.add("muon", OptimizerSpec(
        lambda: torch.optim.Muon, matrix=True, two_d_only=True,
        defaults=dict(momentum=0.95, nesterov=True, ns_steps=5, adjust_lr_fn="match_rms_adamw"),
    ))
    OPTIMIZERS.add("scion", OptimizerSpec(
        _po("SCION"), matrix=True, lr_scale=1.0 / 12.0,
        defaults=dict(momentum=0.1, norm_type=2, norm_kwargs={}, scale=50.0,  # 2 = LMONorm.SPECTRAL
                      constraint=False, weight_decouple=True),
    ))
    OPTIMIZERS.add("soap", OptimizerSpec(
        _po("SOAP"), matrix=True, from_config=("betas", "eps"),
        defaults=dict(precondition_frequency=10, max_precondition_dim=10000, precondition_1d=False),
    ))
    OPTIMIZERS.add("shampoo", OptimizerSpec(
        _shampoo_class, matrix=True, from_config=("betas", "eps"), config_kwarg={"eps": "diagonal_eps"},
        defaults=dict(preconditioning_compute_steps=20, start_preconditioning_step=21, statistics_compute_steps=1,
                      block_size=512, moving_average_for_momentum=True, decoupled_weight_decay=True,
                      nesterov=False, matrix_eps=1e-6),
    ))
    OPTIMIZERS.add("kron", OptimizerSpec(
        _po("Kron"), matrix=True, lr_scale=1.0 / 3.0, needs_opt_einsum=True,
        defaults=dict(momentum=0.9, weight_decouple=True, max_size_triangular=8192),
    ))
    OPTIMIZERS.add("lion", OptimizerSpec(
        _po("Lion"), matrix=False, lr_scale=0.1, defaults=dict(betas=(0.9, 0.99), weight_decouple=True),
    ))
    OPTIMIZERS.add("schedulefree_adamw", OptimizerSpec(
        _po("ScheduleFreeAdamW"), matrix=False, from_config=("betas", "eps"), defaults=dict(warmup_steps=0),
    ))


# Fills this module's own registry; classes are imported only when used.
_register_builtins()


# --------------------------------------------------------------------------- grouping


def _head_params(model: nn.Module) -> set[int]:
    head = None
    getter = getattr(model, "get_output_embeddings", None)
    if callable(getter):
        head = getter()
    for attr in ("embed_out", "lm_head"):
        if head is None:
            head = getattr(model, attr, None)
    if not isinstance(head, nn.Module):
        return set()
    w = getattr(head, "weight", None)
    return {id(w)} if isinstance(w, torch.Tensor) else set()


def classify_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter, str]]:
    """(name, parameter, group) for every trainable parameter, in model order.

    A weight shared by input embedding and head (tied) appears once, under its
    first name, in 'embedding'.
    """
    emb = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    head = _head_params(model)
    out = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if id(p) in emb:
            g = "embedding"
        elif id(p) in head:
            g = "head"
        elif p.ndim < 2:
            g = "no_decay"
        else:
            g = "hidden_matrix"
        out.append((name, p, g))
    return out


@dataclass(frozen=True)
class _ResolvedGroup:
    group: str
    optimizer: str
    lr_scale: float
    weight_decay: float


def _resolve(cfg: OptimConfig) -> dict[str, _ResolvedGroup]:
    out = {}
    for row in cfg.groups:
        opt = cfg.name if row.optimizer == MAIN else row.optimizer
        if row.optimizer == MAIN and row.name != "hidden_matrix" and OPTIMIZERS.get(opt).matrix:
            opt = "adamw"  # paper B: AdamW on embeddings, head and vectors
        spec_scale = OPTIMIZERS.get(opt).lr_scale
        out[row.name] = _ResolvedGroup(
            row.name, opt, row.lr_scale * spec_scale, cfg.weight_decay * row.wd_scale / spec_scale
        )
    return out


def param_group_table(model: nn.Module, cfg: OptimConfig) -> list[dict[str, Any]]:
    """One row per trainable parameter: name, group, shape, optimizer, lr_scale, weight_decay."""
    res = _resolve(cfg)
    return [
        dict(name=n, group=g, shape=tuple(p.shape), optimizer=res[g].optimizer,
             lr_scale=res[g].lr_scale, weight_decay=res[g].weight_decay)
        for n, p, g in classify_parameters(model)
    ]


# --------------------------------------------------------------------------- combined


class _MergedState(Mapping):
    """Read-only view of several optimizers' ``state`` dicts."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self._opts = optimizers

    def __getitem__(self, p):
        for o in self._opts:
            if p in o.state:
                return o.state[p]
        raise KeyError(p)

    def __iter__(self) -> Iterator:
        for o in self._opts:
            yield from o.state

    def __len__(self) -> int:
        return sum(len(o.state) for o in self._opts)


class CombinedOptimizer(torch.optim.Optimizer):
    """Several optimizers over disjoint parameters, used as one.

    ``param_groups`` is the concatenation of the inner optimizers' groups (the
    very same dicts, so setting ``group["lr"]`` reaches the inner optimizer);
    ``step``, ``zero_grad``, ``state_dict`` and ``load_state_dict`` go to each.
    """

    def __init__(self, optimizers: Mapping[str, torch.optim.Optimizer]):
        self.optimizers: OrderedDict[str, torch.optim.Optimizer] = OrderedDict(optimizers)
        groups = [g for o in self.optimizers.values() for g in o.param_groups]
        # Optimizer.__init__ appends these same dicts (hooks and bookkeeping come with it).
        super().__init__(groups, {})
        self.state = _MergedState(list(self.optimizers.values()))  # type: ignore[assignment]

    def step(self, closure: Callable[[], float] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for o in self.optimizers.values():
            o.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers.values():
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": {k: o.state_dict() for k, o in self.optimizers.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("optimizers") if isinstance(state_dict, dict) else None
        if not isinstance(saved, dict) or list(saved) != list(self.optimizers):
            have = list(saved) if isinstance(saved, dict) else "a single optimizer"
            raise QuantdynError(
                f"optimizer state holds {have} but this run builds {list(self.optimizers)}; "
                "resume with the same optim.name and optim.groups"
            )
        for k, o in self.optimizers.items():
            o.load_state_dict(saved[k])
        # torch's load_state_dict replaces each inner optimizer's group dicts with new ones: point ours at
        # them again, or LR schedules set through ``param_groups`` would silently stop reaching the optimizer
        self.param_groups = [g for o in self.optimizers.values() for g in o.param_groups]

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={type(o).__name__}" for k, o in self.optimizers.items())
        return f"CombinedOptimizer({inner})"


# --------------------------------------------------------------------------- build


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """Build the run's optimizer over ``model``'s trainable parameters.

    Returns one optimizer; a :class:`CombinedOptimizer` when groups use
    different optimizers (e.g. Muon on hidden matrices + AdamW elsewhere).
    Every param group has ``group_name`` and ``lr_scale`` (see the module
    docstring for the trainer contract).
    """
    res = _resolve(cfg)
    by_group: dict[str, list[nn.Parameter]] = {g: [] for g in GROUP_NAMES}
    for _, p, g in classify_parameters(model):
        by_group[g].append(p)
    if not any(by_group.values()):
        raise QuantdynError("the model has no trainable parameters to optimize")
    per_opt: OrderedDict[str, list[dict]] = OrderedDict()
    for g in GROUP_NAMES:
        if not by_group[g]:
            continue
        r = res[g]
        spec = OPTIMIZERS.get(r.optimizer)
        if spec.two_d_only and any(p.ndim != 2 for p in by_group[g]):
            raise QuantdynError(
                f"optimizer '{r.optimizer}' handles 2-D weights only but group '{g}' has other shapes; "
                f"set optim.groups row '{g}' to optimizer 'adamw' or 'main'"
            )
        per_opt.setdefault(r.optimizer, []).append(
            {"params": by_group[g], "lr": cfg.lr * r.lr_scale, "weight_decay": r.weight_decay,
             "lr_scale": r.lr_scale, "group_name": g}
        )
    opts: OrderedDict[str, torch.optim.Optimizer] = OrderedDict()
    for name, groups in per_opt.items():
        extra = cfg.extra if name == cfg.name else {}
        opts[name] = OPTIMIZERS.get(name).build(groups, cfg, extra)
    if len(opts) == 1:
        return next(iter(opts.values()))
    return CombinedOptimizer(opts)


def _leaves(opt: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    if isinstance(opt, CombinedOptimizer):
        return list(opt.optimizers.values())
    return [opt]


def _has_modes(o: torch.optim.Optimizer) -> bool:
    return bool(o.param_groups) and "train_mode" in o.param_groups[0] and callable(getattr(o, "eval", None))


def optimizer_train_mode(opt: torch.optim.Optimizer) -> None:
    """Put parameters at the training point (schedule-free); no-op for other optimizers.
    Call before every training forward/backward after an :func:`optimizer_eval_mode`."""
    for o in _leaves(opt):
        if _has_modes(o):
            o.train()


def optimizer_eval_mode(opt: torch.optim.Optimizer) -> None:
    """Put parameters at the averaged point (schedule-free) for evaluation, quantization
    or exporting weights; no-op for other optimizers."""
    for o in _leaves(opt):
        if _has_modes(o):
            o.eval()


# --------------------------------------------------------------------------- Newton-Schulz


def newton_schulz(
    G: torch.Tensor,
    steps: int = 5,
    coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315),
    eps: float = 1e-7,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Approximate the orthogonal polar factor U V^T of G = U S V^T (Muon's step).

    The same iteration as torch.optim.Muon's ``_zeropower_via_newtonschulz``
    (which runs in bfloat16): X <- G / ||G||_F (transposed so rows <= cols),
    then ``steps`` times X <- a X + (b A + c A^2) X with A = X X^T.  With the
    quintic default coefficients the singular values land near 1 (roughly in
    [0.7, 1.2]), not exactly at 1; (1.5, -0.5, 0) is the cubic iteration, which
    converges to U V^T exactly.
    """
    if G.ndim != 2:
        raise ValueError("newton_schulz needs a 2-D matrix")
    a, b, c = coefficients
    X = G.to(dtype)
    tall = G.size(0) > G.size(1)
    if tall:
        X = X.T
    X = X / X.norm().clamp(min=eps)
    for _ in range(steps):  # the same ops, in the same order, as torch.optim.Muon
        A = X @ X.T
        B = torch.addmm(A, A, A, beta=b, alpha=c)  # b A + c A^2
        X = torch.addmm(X, B, X, beta=a)  # a X + B X
    return (X.T if tall else X).to(G.dtype)


__all__ = [
    "GROUP_NAMES", "GroupRule", "OptimConfig", "OptimizerSpec", "OPTIMIZERS", "CombinedOptimizer",
    "build_optimizer", "param_group_table", "classify_parameters", "optimizer_train_mode",
    "optimizer_eval_mode", "newton_schulz",
]
