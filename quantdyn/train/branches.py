"""Cooldown branches: the "same model, cooldowns at different token budgets"
experiment of paper A (Figure 5), with constant-LR control twins.

From a stable-phase checkpoint at step S of a parent run, each branch decays
the LR to lr_end over D steps (a WSD schedule with decay_start = S); its
control twin continues at the constant peak LR for the same D steps.  A
decayed endpoint and its control share weights, optimizer state, data order
and token count, so their quantization errors differ only by the decay.

:func:`cooldown` branches from a checkpoint of a quantdyn run (its optimizer state included);
:func:`cooldown_from_checkpoint` from any Hugging Face causal LM (``model.hf``: a public stable-phase
revision, a local directory), which carries weights only: each branch starts its optimizer as
``optimizer_start`` says and counts its steps from the branch point, written as its step 0
(``DIR/branches/NAME/checkpoints/step-0000000`` holds the source's weights bit for bit).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

from quantdyn.config import dump_yaml, to_dict
from quantdyn.errors import QuantdynError
from quantdyn.files import atomic_dir, link_or_copy, share_if_identical, write_json_atomic, write_text_atomic
from quantdyn.models.causal_lm import run_model
from quantdyn.runs import (
    BRANCH_PARENT,
    COOLDOWN_EXPERIMENT,
    META,
    STATE,
    WEIGHTS,
    CheckpointInfo,
    RunDir,
    checkpoint_info,
    control_branch,
    cooldown_branch,
    has_weights,
    intervention_tag,
    nodecay_branch,
    parse_average,
    is_resumable,
    latest_resumable,
    list_checkpoints,
    parse_branch,
    read_meta,
    remove_stale_temporaries,
)
from quantdyn.schedules import ScheduleConfig, _steps, lr_at
from quantdyn.train.checkpoint import same_training_state
from quantdyn.train.config import AveragingConfig, RunConfig, data_config_of, load_run_config
from quantdyn.train.from_weights import check_hf_run
from quantdyn.train.qat import QATConfig
from quantdyn.train.trainer import train

INTERVENTION_KEYS = ("optim.sam_rho", "optim.sam_adaptive", "qat.format")
"""The run-config keys a cooldown branch of a quantdyn run may set (``key=value`` after the run directory;
``--qat FORMAT`` is ``qat.format=FORMAT``): each is spelled in the branch's name (quantdyn.runs.intervention_tag),
so a branch's name still says everything its config adds to its parent's, and the same command continues it. Any
other key would make a branch that its name does not describe, and is refused."""


@dataclass(frozen=True)
class Intervention:
    """What a cooldown branch trains with besides its decay (issue 48): SAM/ASAM and QAT with a deployment
    format's fake quantization. Applied to the cooldown only; its control twin stays the plain constant LR."""

    sam_rho: float = 0.0
    """optim.sam_rho of the branch (train/sam.py; 0 = the parent's)."""
    sam_adaptive: bool = False
    """optim.sam_adaptive of the branch (ASAM)."""
    qat_format: str = ""
    """qat.format of the branch: a quantizer label with a fake-quantized training path (rtn4, q4_k, nvfp4)."""

    def __post_init__(self):
        from quantdyn.train.optimizers import OptimConfig

        OptimConfig(sam_rho=self.sam_rho, sam_adaptive=self.sam_adaptive)  # the optimizer's own checks, one line
        if self.qat_format:  # one line naming the formats that have a training path, before anything is written
            object.__setattr__(self, "qat_format", QATConfig(format=self.qat_format).format)

    @property
    def tag(self) -> str:
        return intervention_tag(self.sam_rho, self.sam_adaptive, self.qat_format)

    def apply(self, cfg: RunConfig) -> RunConfig:
        """``cfg`` with the intervention (a cooldown branch's config; its name comes from :attr:`tag`)."""
        if self.qat_format and cfg.qat is not None:
            raise QuantdynError(f"the run already trains with QAT (qat.method={cfg.qat.method}); a QAT cooldown "
                                "branches from a run trained in full precision")
        optim = replace(cfg.optim, sam_rho=self.sam_rho, sam_adaptive=self.sam_adaptive) if self.sam_rho else cfg.optim
        qat = QATConfig(format=self.qat_format) if self.qat_format else cfg.qat
        return replace(cfg, optim=optim, qat=qat)


def intervention_of(overrides: dict) -> Intervention:
    """The intervention of ``{key: value}`` overrides (INTERVENTION_KEYS); another key is one line."""
    from quantdyn.config import from_dict
    from quantdyn.errors import did_you_mean

    for k in overrides:
        if k not in INTERVENTION_KEYS:
            raise QuantdynError(f"'{k}' cannot be set on a cooldown branch of a quantdyn run{did_you_mean(k, INTERVENTION_KEYS)}"
                                f": its branches keep the run's config, except {', '.join(INTERVENTION_KEYS)} (each "
                                "named in the branch)")
    return from_dict(Intervention, {k.partition(".")[2].replace("format", "qat_format"): v for k, v in overrides.items()},
                     "cooldown intervention")


def branch_configs(parent: RunConfig, from_step: int, decay_steps: int, shape: str,
                   intervention: Intervention = Intervention()) -> tuple[RunConfig, RunConfig]:
    """(cooldown, control) configs for one decay length, named as quantdyn.runs names branches; ``intervention``
    applies to the cooldown (its name carries it), not to the control."""
    total = parent.train.steps
    warmup = _steps(parent.schedule.warmup, total)
    peak = parent.optim.lr
    if abs(lr_at(from_step - 1, peak, parent.schedule, total) - peak) > 1e-12 * max(peak, 1.0):
        raise QuantdynError(
            f"step {from_step} is not in the parent's stable phase (LR {lr_at(from_step - 1, peak, parent.schedule, total):.3g}"
            f" != peak {peak:.3g}); branch from a checkpoint after warmup and before the decay"
        )
    return _branch_pair(parent, from_step, decay_steps, shape, warmup, decay_start=from_step, intervention=intervention)


def _branch_pair(parent: RunConfig, from_step: int, decay_steps: int, shape: str, warmup: int,
                 decay_start: int, intervention: Intervention = Intervention()) -> tuple[RunConfig, RunConfig]:
    """A cooldown (WSD: ``warmup`` steps, the decay of ``decay_steps`` from ``decay_start``) and its constant-LR
    control, both ``decay_start + decay_steps`` steps long, named for ``from_step``."""
    if decay_steps < 1:
        raise QuantdynError("--decay-steps must be positive")
    train = replace(parent.train, steps=decay_start + decay_steps, checkpoint_tokens=())
    sched = ScheduleConfig(name="wsd", warmup=warmup, decay=decay_steps, decay_start=decay_start,
                           decay_shape=shape, lr_end=parent.schedule.lr_end)
    cool = replace(intervention.apply(parent), name=cooldown_branch(from_step, decay_steps, shape, intervention.tag),
                   schedule=sched, train=train)
    ctrl = replace(parent, name=control_branch(from_step, decay_steps),
                   schedule=ScheduleConfig(name="constant", warmup=warmup), train=train)
    return cool, ctrl


def nodecay_config(control: RunConfig, from_step: int, decay_steps: int, average: str) -> RunConfig:
    """The no-decay branch of a control twin ``control`` (WSO: no decay at all, the weights averaged at the end):
    the same constant LR, data and steps, with the online average ``average`` (lawa-kK-pP: the last K snapshots
    P steps apart, all inside the branch; ema-DECAY) whose value at the last step is the branch's endpoint."""
    kind, a, b = parse_average(average)
    end = control.train.steps
    if kind == "lawa":
        k, p = int(a), b
        if end % p or (k - 1) * p >= decay_steps:
            raise QuantdynError(f"{average} at the end of a {decay_steps}-step branch ending at step {end}: its {k} "
                                f"snapshots {p} steps apart must lie inside the branch (K-1)*P < {decay_steps}, and P "
                                f"must divide {end}; choose a shorter window or another P")
        avg = AveragingConfig(lawa_window=k, lawa_every=p)
    else:
        avg = AveragingConfig(ema_decay=a)
    return replace(control, name=nodecay_branch(from_step, decay_steps, average), averaging=avg)


def run_branch(cfg: RunConfig, branch_dir: Path, source: CheckpointInfo | None, parent: dict, progress: bool = True,
               hooks: Sequence = (), verbose: bool = False, estimated: Path | None = None) -> Path:
    """Train one branch, resume it, or skip it when it is done. ``source``: the parent run's checkpoint it starts
    from (weights and optimizer state); None: it starts from the checkpoint ``cfg.model.hf``, its step 0 written
    first. ``parent``: the branch's link to its parent (run.json); ``hooks``: the trainer's step hooks (e.g.
    ``quantdyn.monitor.hooks_for(cfg)``). ``estimated``: another branch's step 0 whose optimizer estimate this
    one takes instead of estimating it again (trainer.train; only where ``source`` is None)."""
    if RunDir(branch_dir).status(cfg.train.steps) == "finished":
        return branch_dir
    partial = latest_resumable(branch_dir)
    kw = dict(parent=parent, progress=progress, hooks=hooks, verbose=verbose)
    if partial is not None and partial.step > (source.step if source is not None else -1):
        return train(cfg, branch_dir, resume=partial, **kw)
    if source is not None:
        return train(cfg, branch_dir, init_from=source, **kw)
    # a branch killed before its step 0 leaves nothing to keep
    return train(cfg, branch_dir, overwrite=True, estimated=estimated, **kw)


def cooldown(
    run_dir: Path, from_step: int, decay_steps: list[int], shape: str = "linear", control: bool = False,
    progress: bool = True, device: str | None = None, hooks: Sequence = (), verbose: bool = False,
    intervention: Intervention = Intervention(), nodecay: Sequence[str] = (),
) -> list[Path]:
    """Start cooldown branches (and control twins) from the run's checkpoint at ``from_step``.

    nodecay: averages (lawa-kK-pP, ema-DECAY) for no-decay branches beside the cooldowns: constant LR over the same
            steps, then that online average as the endpoint (``nodecay-sS-dD-AVG``, :func:`nodecay_config`); with
            no cooldowns wanted, ``decay_steps`` is still the branches' length.
    intervention: what the cooldowns train with besides the decay (SAM, QAT in a format; named in the branch:
            ``cooldown-sS-dD-SHAPE-qat-rtn4``); the controls are the plain constant-LR twins either way.
    device: overrides the parent's train.device for the branches (e.g. 'cpu', 'cuda:1').
    hooks:  the trainer's step hooks for every branch, e.g. the PTQ monitor of the parent's config:
            ``hooks=quantdyn.monitor.hooks_for(load_run_config(run_dir))`` (the branches share its data).
    Half-written checkpoints that a killed cooldown left in a branch are removed first.
    """
    run_dir = Path(run_dir)
    parent_cfg = load_run_config(run_dir)
    if device:
        parent_cfg = replace(parent_cfg, train=replace(parent_cfg.train, device=device))
    ckpt = RunDir(run_dir).checkpoint(from_step)
    if not is_resumable(ckpt):
        have = [c.step for c in list_checkpoints(run_dir)]
        raise QuantdynError(
            f"run '{run_dir}' has no resumable checkpoint at step {from_step} (checkpoints: {have}); "
            "pick one of those steps with --from-step"
        )
    source = checkpoint_info(ckpt, from_step)
    out = []
    pairs = [branch_configs(parent_cfg, from_step, d, shape, intervention) for d in decay_steps]  # all checked first
    flat = [nodecay_config(ctrl, from_step, d, a) for d, (_, ctrl) in zip(decay_steps, pairs) for a in nodecay]
    for d, (cool, ctrl) in zip(decay_steps, pairs):
        todo = [(cool, "cooldown")] + ([(ctrl, "control")] if control else [])
        todo += [(c, "nodecay") for c in flat if c.train.steps == ctrl.train.steps]
        for cfg, kind in todo:
            bdir = RunDir(run_dir).branch(cfg.name).path
            remove_stale_temporaries(bdir)
            parent = {"run_dir": BRANCH_PARENT, "run": parent_cfg.name, "from_step": from_step, "kind": kind,
                      "decay_steps": d, "shape": shape if kind == "cooldown" else "constant",
                      **({"intervention": intervention.tag} if kind == "cooldown" and intervention.tag else {}),
                      **({"average": parse_branch(cfg.name).average} if kind == "nodecay" else {})}
            out.append(run_branch(cfg, bdir, source, parent, progress, hooks=hooks, verbose=verbose))
    return out


# ---------------------------------------------------------------- from any HF checkpoint
EXPERIMENT_KEYS = ("model", "data", "optim", "seed", "schedule", "qat", "optimizer_start", "train.batch_size",
                   "train.seq_len", "train.grad_accum", "train.grad_clip", "train.dtype")
"""What makes two cooldown experiments from a checkpoint the same (an --out is continued, not replaced)."""


def _experiment(cfg: RunConfig) -> dict:
    d = to_dict(cfg)
    return {k: (d["train"][k[6:]] if k.startswith("train.") else d[k]) for k in EXPERIMENT_KEYS}


def checkpoint_branch_configs(parent: RunConfig, decay_steps: int, shape: str,
                              intervention: Intervention = Intervention()) -> tuple[RunConfig, RunConfig]:
    """(cooldown, control) configs of one decay length from the checkpoint ``parent.model.hf``: the branch
    counts its steps from the branch point (step 0; names cooldown-s0-dD-SHAPE, control-s0-dD); with a
    schedule.warmup of W steps (a re-warm-up) the decay starts at W and both branches run W + D steps."""
    warmup = parent.schedule.warmup
    if warmup != int(warmup):
        raise QuantdynError(f"schedule.warmup={warmup}: a re-warm-up before a cooldown from a checkpoint is a number "
                            "of steps (0 = none)")
    return _branch_pair(parent, 0, decay_steps, shape, int(warmup), decay_start=int(warmup), intervention=intervention)


def cooldown_from_checkpoint(
    parent: RunConfig, out: Path, decay_steps: list[int], shape: str = "linear", control: bool = False,
    source: dict | None = None, progress: bool = True, hooks: Sequence = (), verbose: bool = False,
    intervention: Intervention = Intervention(),
) -> list[Path]:
    """Cooldown branches (and constant-LR controls) from the HF checkpoint ``parent.model.hf`` into ``out``.

    parent: the stable phase continued: model.hf (a directory, hub id or id@revision), data, optim.lr the
            peak (constant) LR, batch, sequence length, optimizer_start; schedule.lr_end the decay's end.
    out:    becomes a run directory (config.yaml = ``parent``, run.json with ``source``) whose branches
            ``out/branches/NAME`` are runs of their own, with the branch point as their step 0; `quantdyn sweep
            --run OUT` measures them. An ``out`` that holds another experiment is refused; the same
            experiment is continued (finished branches skipped, killed ones resumed).
    source: where the checkpoint sits in its own training (ref as given, step, tokens, LR, preset), recorded in
            run.json; inside the experiment every count starts at the branch point (cooldown-s0-dD-SHAPE, step 0,
            tokens 0).
    The branch point is also ``out``'s own checkpoint at step 0 (the run whose branches these are: sweeps and
    reports compare its cooldowns with their controls as for a quantdyn run); the branches' step-0 weights and
    optimizer states, the same bytes, are stored once (hard links).
    Everything is checked (the model, its tokenizer, ``out``) before anything is written."""
    out = Path(out)
    source = dict(source or {})
    if not parent.model.hf:
        raise QuantdynError("cooldown_from_checkpoint needs model.hf (the checkpoint to branch from)")
    parent = replace(parent, data=data_config_of(parent))  # the model's own tokenizer, recorded as such
    if not decay_steps or any(d < 1 for d in decay_steps):
        raise QuantdynError(f"--decay-steps {decay_steps}: give positive step counts, e.g. 50,100")
    pairs = [checkpoint_branch_configs(parent, d, shape, intervention) for d in decay_steps]
    check_hf_run(parent, run_model(parent.model))
    _check_out(out, parent)
    steps = max([parent.train.steps] + [c.train.steps for c, _ in pairs])
    if RunDir(out).is_run:
        steps = max(steps, load_run_config(out).train.steps)
    record = replace(parent, name=out.name, train=replace(parent.train, steps=steps))
    rd = RunDir(out)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(rd.config, dump_yaml(record))
    write_json_atomic(rd.info, {**rd.read_info(), "name": record.name, "kind": COOLDOWN_EXPERIMENT,
                                "source": {"model": parent.model.hf, **source},
                                "optimizer_start": to_dict(parent.optimizer_start)})
    paths = []
    for d, (cool, ctrl) in zip(decay_steps, pairs):
        for cfg, kind in [(cool, "cooldown")] + ([(ctrl, "control")] if control else []):
            bdir = rd.branch(cfg.name).path
            remove_stale_temporaries(bdir)
            link = {"run_dir": BRANCH_PARENT, "run": record.name, "from_step": 0, "kind": kind,
                    "decay_steps": d, "shape": shape if kind == "cooldown" else "constant",
                    "source": source.get("ref", parent.model.hf), "model": parent.model.hf,
                    **({"intervention": intervention.tag} if kind == "cooldown" and intervention.tag else {})}
            # the optimizer estimate is the same for every branch (same weights, batches, seed): made once, by the
            # first branch, and taken from its step 0 by the others (trainer: only where their configs agree)
            first = RunDir(paths[0]).checkpoint(0) if paths else None
            paths.append(run_branch(cfg, bdir, None, link, progress, hooks=hooks, verbose=verbose,
                                    estimated=first if first is not None and is_resumable(first) else None))
            _share_branch_point(record, source, RunDir(paths[0]).checkpoint(0), RunDir(bdir).checkpoint(0), out)
    return paths


def _check_out(out: Path, parent: RunConfig) -> None:
    """``out`` is new, empty, or this same experiment (one line otherwise, before anything is written)."""
    rd = RunDir(out)
    if out.exists() and not out.is_dir():
        raise QuantdynError(f"--out '{out}' is a file; pass a directory for the cooldown experiment")
    if rd.is_run:
        before, now = _experiment(load_run_config(out)), _experiment(parent)
        diff = next((k for k in EXPERIMENT_KEYS if before[k] != now[k]), None)
        if rd.kind != COOLDOWN_EXPERIMENT or diff is not None:
            what = f"{diff}: {before[diff]!r} there, {now[diff]!r} now" if diff else "a training run"
            raise QuantdynError(f"--out '{out}' already holds a different experiment ({what}); choose another --out "
                                "or repeat its own settings to continue it")
    elif out.is_dir() and any(out.iterdir()):
        raise QuantdynError(f"--out '{out}' is not empty and holds no cooldown experiment; choose a new directory")


def _same_state_file(first: Path, this: Path) -> bool:
    return (first / STATE).is_file() and (this / STATE).is_file() and same_training_state(first, this)


def _share_branch_point(record: RunConfig, source: dict, first: Path, this: Path, out: Path) -> None:
    """The branch point as ``out``'s checkpoint at step 0 (once: linked from the first branch's, with the
    experiment's own metadata), and a later branch's step 0 linked to the first's where the bytes agree (the
    training state: where it holds the same values, as it does when taken from the first's estimate)."""
    if this != first:
        share_if_identical(first / WEIGHTS, this / WEIGHTS)
        if not share_if_identical(first / STATE, this / STATE) and _same_state_file(first, this):
            share_if_identical(first / STATE, this / STATE, check_bytes=False)
    main = RunDir(out).checkpoint(0)
    if has_weights(main):
        return
    meta = read_meta(first)
    with atomic_dir(main) as tmp:
        for f in sorted(first.iterdir()):
            if f.is_file() and f.name not in (META, STATE):
                link_or_copy(f, tmp / f.name)
        write_json_atomic(tmp / META, {
            **{k: meta[k] for k in ("created", "data_key", "git_sha", "seed", "world_size", "dist_strategy")
               if k in meta},
            "kind": "checkpoint", "run": record.name, "step": 0, "tokens": 0, "lr": record.optim.lr,
            "peak_lr": record.optim.lr, "total_steps": record.train.steps, "schedule": to_dict(record.schedule),
            "config": to_dict(record), "source": source, "branch_point": True})
