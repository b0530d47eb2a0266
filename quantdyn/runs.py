"""Run directories: the one owner of their layout and of every name in them.

    RUN_DIR/
      config.yaml                 resolved RunConfig (train/config.py types it: load_run_config)
      run.json                    run identity, parent link (cooldown branches), data cache
      metrics.jsonl               one row per log/eval event (train/loggers.py)
      checkpoints/step-0000400/   HF checkpoint: config.json, model.safetensors, tokenizer files,
                                  quantdyn.json (step, tokens, lr, schedule, config, git SHA),
                                  training_state.pt (optimizer, step, RNG; loaded weights_only)
      branches/NAME/              child runs (cooldowns, constant-LR controls), same layout;
                                  NAME: cooldown-sS-dD-SHAPE, control-sS-dD (:func:`cooldown_branch`);
                                  a cooldown with an intervention: cooldown-sS-dD-SHAPE-TAG, TAG e.g.
                                  sam0.05, asam0.5, qat-rtn4, sam0.05-qat-q4_k (:func:`intervention_tag`);
                                  no decay + averaging: nodecay-sS-dD-AVG, AVG lawa-kK-pP or ema-DECAY
                                  (:func:`nodecay_branch`), its endpoint the average in its own averages/
      averages/NAME/step-N/       averaged checkpoints as HF checkpoints; NAME: lawa-kK-pP (online),
                                  lawa-kK-pP-offline, ema-DECAY, soup-..., interp-A-B/alpha-X (:func:`lawa_name` ...)

Every module that reads or writes a run asks this one for a path or a name (``RunDir(run).branch(name)``,
:func:`list_checkpoints`, :func:`lawa_name` ...); none builds them by hand.  It knows names and reads small
JSON/YAML files only: writing a checkpoint (train/checkpoint.py) and typing the config (train/config.py) live
with the code that needs torch and the config classes.

A checkpoint of a run is named by step without spelling its directory: ``RUN_DIR@latest`` (its last checkpoint),
``RUN_DIR@-100`` (100 steps before the run's end, its ``train.steps``), ``RUN_DIR@400``; ``--from-step`` takes the
same step references (:func:`resolve_step`, :func:`resolve_run_reference`), so commands written for a run keep
working when the run is made shorter or longer.

Checkpoints are written to a temporary directory and renamed into place, so a crash never leaves a
half-written checkpoint under its final name; the temporaries a killed process leaves (``.step-*.tmp-*``,
``.step-*.old-*``) are removed when the run next starts (:func:`remove_stale_temporaries`).
"""
from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

from quantdyn.config import load_yaml
from quantdyn.errors import QuantdynError

CONFIG = "config.yaml"
"""The resolved run config in a run directory."""
INFO = "run.json"
"""Run identity, the parent link of a branch, the data cache."""
METRICS = "metrics.jsonl"
"""The run's logged rows."""
CHECKPOINTS = "checkpoints"
BRANCHES = "branches"
AVERAGES = "averages"
META = "quantdyn.json"
"""quantdyn's metadata in a checkpoint directory (step, tokens, LR, schedule, config ...)."""
STATE = "training_state.pt"
"""What a resume needs beyond the weights (optimizer, step, RNG, online averages)."""
WEIGHTS = "model.safetensors"
"""The weights file of a checkpoint written by quantdyn."""
BRANCH_PARENT = "../.."
"""Where a branch's run.json says its parent run is, relative to the branch directory."""


def step_name(step: int) -> str:
    """The directory name of the checkpoint at ``step`` (``step-0000400``)."""
    return f"step-{step:07d}"


def step_of_name(name: str) -> int | None:
    """The step of a checkpoint directory name (``step-0000400`` -> 400); None for any other name."""
    return int(name[5:]) if name.startswith("step-") and name[5:].isdigit() else None


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint of a run, with its metadata."""

    path: Path
    step: int
    tokens: int
    lr: float | None
    meta: dict


COOLDOWN_EXPERIMENT = "checkpoint-cooldowns"
"""run.json's ``kind`` of an experiment of cooldowns branched from a checkpoint's weights (quantdyn cooldown MODEL)."""


@dataclass(frozen=True)

class RunDir:
    """Where each part of a run directory lives (the layout in this module's docstring)."""

    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    @property
    def config(self) -> Path:
        return self.path / CONFIG

    @property
    def info(self) -> Path:
        return self.path / INFO

    @property
    def metrics(self) -> Path:
        return self.path / METRICS

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS

    @property
    def averages(self) -> Path:
        return self.path / AVERAGES

    @property
    def branches(self) -> Path:
        return self.path / BRANCHES

    @property
    def is_run(self) -> bool:
        """Whether this is a quantdyn run directory (it has its config.yaml)."""
        return self.config.is_file()

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / step_name(step)

    def average_dir(self, name: str) -> Path:
        """The directory of the averaged checkpoints called ``name`` (one ``step-N`` per step in it)."""
        return self.averages / name

    def average(self, name: str, step: int) -> Path:
        return self.average_dir(name) / step_name(step)

    def branch(self, name: str) -> "RunDir":
        return RunDir(self.branches / name)

    def status(self, steps: int) -> str:
        """'finished' (a checkpoint at ``steps`` or later), 'partial' (a resumable checkpoint before it) or
        'new' — what every "train, resume or skip" decision asks."""
        if any(c.step >= steps for c in list_checkpoints(self.path)):
            return "finished"
        return "partial" if latest_resumable(self.path) is not None else "new"

    @property
    def kind(self) -> str | None:
        """What run.json says this directory is (``COOLDOWN_EXPERIMENT`` for ``quantdyn cooldown MODEL``; None for a
        training run, whose run.json names no kind)."""
        return self.read_info().get("kind")

    def read_info(self) -> dict:
        """run.json ({} when the run has none yet); an unreadable one is one line."""
        if not self.info.is_file():
            return {}
        try:
            info = json.loads(self.info.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise QuantdynError(f"'{self.info}' is not valid JSON; restore it or remove the run directory") from None
        if not isinstance(info, dict):
            raise QuantdynError(f"'{self.info}' must hold a JSON object; restore it or remove the run directory")
        return info

    def read_config(self) -> dict:
        """config.yaml as a mapping; a directory without one is one line saying what to pass."""
        if not self.is_run:
            raise QuantdynError(f"'{self.path}' is not a quantdyn run directory (no {CONFIG}); pass RUN_DIR of a "
                                "training run")
        return load_yaml(self.config)


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return RunDir(run_dir).checkpoint(step)


def has_weights(ckpt: Path) -> bool:
    """Whether checkpoint directory ``ckpt`` holds its weights (a finished checkpoint)."""
    return (Path(ckpt) / WEIGHTS).is_file()


def is_resumable(ckpt: Path) -> bool:
    """Whether a checkpoint holds the training state a resume or a branch needs."""
    return (Path(ckpt) / STATE).is_file()


def read_meta(ckpt: Path) -> dict:
    """quantdyn's metadata of a checkpoint directory ({} for a checkpoint written elsewhere)."""
    p = Path(ckpt) / META
    if not p.is_file():
        return {}
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError:
        raise QuantdynError(f"'{p}' is corrupt (invalid JSON); delete the checkpoint directory and re-create it") from None


def checkpoint_info(ckpt: Path, step: int | None = None) -> CheckpointInfo:
    """The :class:`CheckpointInfo` of one checkpoint directory (``step`` when its metadata has none)."""
    ckpt = Path(ckpt)
    meta = read_meta(ckpt)
    at = meta.get("step")
    if at is None:
        at = step if step is not None else (step_of_name(ckpt.name) or 0)
    return CheckpointInfo(ckpt, int(at), int(meta.get("tokens", 0)), meta.get("lr"), meta)


def list_checkpoints(run_dir: Path) -> list[CheckpointInfo]:
    """The run's own checkpoints (not its branches), sorted by step."""
    root = RunDir(run_dir).checkpoints
    out = []
    if root.is_dir():
        for d in sorted(root.iterdir()):
            if d.is_dir() and d.name.startswith("step-") and has_weights(d):
                meta = read_meta(d)
                out.append(CheckpointInfo(d, int(meta.get("step", d.name[5:])), int(meta.get("tokens", 0)),
                                          meta.get("lr"), meta))
    return sorted(out, key=lambda c: c.step)


def latest_resumable(run_dir: Path) -> CheckpointInfo | None:
    """The newest checkpoint of the run that a resume can continue from (None: start fresh)."""
    for c in reversed(list_checkpoints(run_dir)):
        if is_resumable(c.path):
            return c
    return None


STEP_REFERENCES = "a step (400), latest (the last checkpoint) or -N (N steps before the run's end)"
"""What a step reference may be, for help texts and errors."""


def run_end(run_dir: Path) -> int | None:
    """The step a run ends at: its config's ``train.steps`` (None without a readable config)."""
    try:
        return int(RunDir(run_dir).read_config()["train"]["steps"])
    except (QuantdynError, KeyError, TypeError, ValueError):
        return None


def resolve_step(run_dir: Path, ref: int | str) -> int:
    """The step a step reference names in ``run_dir`` (module docstring): ``400`` as it is; ``latest`` (or
    ``last``) the run's last checkpoint; ``-N`` N steps before the run's end (its ``train.steps``, or its last
    checkpoint when the config has none), which must be a checkpoint the run holds. One line otherwise."""
    text = str(ref).strip()
    steps = sorted(c.step for c in list_checkpoints(run_dir))
    held = f"its checkpoints: {', '.join(map(str, steps))}" if steps else "it has no checkpoints yet"
    if text.lower() in ("latest", "last"):
        if not steps:
            raise QuantdynError(f"'{run_dir}' has no checkpoint for '{text}' yet; train it first")
        return steps[-1]
    if not re.fullmatch(r"[+-]?\d+", text):
        raise QuantdynError(f"step '{text}' of '{run_dir}' must be {STEP_REFERENCES}")
    step = int(text)
    if step >= 0:
        return step
    end = run_end(run_dir)
    end = end if end is not None else (steps[-1] if steps else None)
    if end is None or end + step < 0:
        raise QuantdynError(f"step {step} reaches before the start of '{run_dir}' (it ends at step {end}); {held}")
    if end + step not in steps:
        raise QuantdynError(f"step {step} of '{run_dir}' is step {end + step} ({-step} before its end, {end}), which "
                            f"has no checkpoint; {held}")
    return end + step


def resolve_run_reference(ref: str | Path) -> str:
    """``RUN_DIR@STEP`` (a step reference, :func:`resolve_step`) -> that checkpoint's directory; any other reference
    (a directory, ``hub-id@revision``) unchanged."""
    text = str(ref)
    head, at, step = text.rpartition("@")
    if not at or not head or Path(text).exists() or not RunDir(head).is_run:
        return text
    ckpt = RunDir(head).checkpoint(resolve_step(Path(head), step))
    if not has_weights(ckpt):
        steps = sorted(c.step for c in list_checkpoints(Path(head)))
        raise QuantdynError(f"'{text}' names step {step_of_name(ckpt.name)}, which has no checkpoint in '{head}'; its "
                            f"checkpoints: {', '.join(map(str, steps)) or 'none yet'}")
    return str(ckpt)


def has_checkpoints(run_dir: Path) -> list[int]:
    """Steps of the checkpoints a run directory holds (any ``checkpoints/step-*`` directory)."""
    root = RunDir(run_dir).checkpoints
    if not root.is_dir():
        return []
    return sorted(s for d in root.iterdir() if d.is_dir() and (s := step_of_name(d.name)) is not None)


def averaged_checkpoints(run_dir: Path) -> list[tuple[str, Path]]:
    """(name, checkpoint directory) of every averaged checkpoint of a run, by name then step: each
    ``averages/NAME/step-N`` (and an ``averages/NAME`` that is itself one checkpoint)."""
    root = RunDir(run_dir).averages
    out = []
    for a in sorted(root.iterdir()) if root.is_dir() else []:
        for c in sorted(a.iterdir()) if a.is_dir() else []:
            if has_weights(c):
                out.append((a.name, c))
        if a.is_dir() and has_weights(a):  # a single averaged checkpoint
            out.append((a.name, a))
    return out


def branch_runs(run_dir: Path) -> list[RunDir]:
    """The run's branches (cooldowns, controls) that are runs themselves, by name."""
    root = RunDir(run_dir).branches
    return [RunDir(b) for b in sorted(root.iterdir()) if RunDir(b).is_run] if root.is_dir() else []


def run_root_of(path: Path) -> Path | None:
    """The quantdyn run directory a checkpoint directory belongs to (its main run, also for a checkpoint of a
    cooldown/control branch or an averaged model), or None for a checkpoint outside any run."""
    path = Path(path).resolve()
    for parent in path.parents:
        if RunDir(parent).is_run and parent.parent.name != BRANCHES:
            return parent
    return None


def in_checkpoints(ckpt: Path) -> Path | None:
    """The run directory whose ``checkpoints/`` holds ``ckpt`` directly (None when it lies elsewhere)."""
    ckpt = Path(ckpt)
    run = ckpt.parent.parent
    return run if ckpt.parent.name == CHECKPOINTS and RunDir(run).is_run else None


def predecessor(ckpt: Path) -> tuple[Path | None, str]:
    """The checkpoint the training reached ``ckpt`` from, as (its directory, '') or (None, why there is none): the
    run's own checkpoint just before it (a step below its own); for a branch's first checkpoint after its branch
    point, the branch point (the parent run's checkpoint at the branch's ``parent.from_step``); for a branch's own
    copy of its branch point (a checkpoint at ``from_step``), the branch point's own predecessor (the same weights,
    the same update). An averaged checkpoint (``RUN/averages/NAME/step-N``) counts as the run's at step N. None for
    a run's first checkpoint and for a checkpoint outside any run directory (the early warning's predecessor,
    analysis ``curvature``)."""
    ckpt = Path(ckpt)
    run = in_checkpoints(ckpt)
    if run is None and ckpt.parent.parent.name == AVERAGES and RunDir(ckpt.parent.parent.parent).is_run:
        run = ckpt.parent.parent.parent
    if run is None:
        return None, "a checkpoint outside any run directory"
    step = checkpoint_info(ckpt).step
    earlier = [c for c in list_checkpoints(run) if c.step < step]
    link = RunDir(run).read_info().get("parent") or {}
    if run.parent.name != BRANCHES or link.get("from_step") is None:
        return (earlier[-1].path, "") if earlier else (None, "the first checkpoint of its run")
    from_step = int(link["from_step"])
    point = RunDir(os.path.normpath(run / link.get("run_dir", BRANCH_PARENT))).checkpoint(from_step)
    if step <= from_step:
        return predecessor(point) if step == from_step and has_weights(point) else \
            (None, f"at or before its branch point (step {from_step})")
    earlier = [c for c in earlier if c.step > from_step]
    if earlier:
        return earlier[-1].path, ""
    if not has_weights(point):
        return None, f"its branch point '{point}' has no checkpoint"
    return point, ""


def _stale(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    return [p for p in directory.iterdir() if p.name.startswith(".step-") and (".tmp-" in p.name or ".old-" in p.name)]


def remove_stale_temporaries(run_dir: Path) -> list[Path]:
    """Remove the half-written checkpoint directories a killed process left behind
    (``checkpoints/.step-*.tmp-*`` and ``.step-*.old-*``, the same under ``averages/*/``).

    Call only when no other process writes checkpoints of this run (at the start of training).
    Returns what was removed.
    """
    rd = RunDir(run_dir)
    found = _stale(rd.checkpoints)
    averages = rd.averages
    if averages.is_dir():
        for d in sorted(averages.iterdir()):
            found += _stale(d)
    for p in found:
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    return found


RUN_CONTENTS = (CHECKPOINTS, AVERAGES, BRANCHES, METRICS, INFO, CONFIG)
"""What a run directory holds that a fresh start of the run replaces (see :func:`clear_run`)."""


def clear_run(run_dir: Path) -> None:
    """Delete a run's checkpoints, averages, branches and logs (``train --overwrite``)."""
    run_dir = Path(run_dir)
    for name in RUN_CONTENTS:
        p = run_dir / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()


# ------------------------------------------------------------------ averaged checkpoints
def lawa_name(window: int, every: int, offline: bool = False) -> str:
    """The averages/ name of LAWA over ``window`` checkpoints ``every`` steps apart: ``lawa-kK-pP`` (the
    trainer's online average), ``lawa-kK-pP-offline`` (averaged afterwards from stored checkpoints)."""
    return f"lawa-k{window}-p{every}" + ("-offline" if offline else "")


def ema_name(decay: float) -> str:
    """The averages/ name of the trainer's EMA with this per-step decay (``ema-0.999``)."""
    return f"ema-{decay:.6g}"


SOUP_OF_COOLDOWNS = "soup-cooldowns"
"""The averages/ name of a study's soup of its cooldown branches' endpoints."""


def interpolation_name(a: Path, b: Path) -> str:
    """The averages/ name of the interpolation from checkpoint ``a`` to ``b``: ``interp-A-B`` (B prefixed
    with its run's name when it is not beside A)."""
    a, b = Path(a), Path(b)
    if b.parent.resolve() == a.parent.resolve():
        tag = b.name
    else:
        owner = b.parent.parent if b.parent.name == CHECKPOINTS else b.parent
        tag = f"{owner.name}-{b.name}"
    return f"interp-{a.name}-{tag}"


def alpha_name(alpha: float) -> str:
    """The directory of the interpolated checkpoint at ``alpha`` inside an interpolation (``alpha-0.2500``)."""
    return f"alpha-{alpha:.4f}"


# ------------------------------------------------------------------ branch names
MAIN = "main"
"""The branch name of a run's own checkpoints."""
COOLDOWN = "cooldown"
CONTROL = "control"
_TAG = r"(?:a?sam\d[\d.]*(?:-qat-.+)?|qat-.+)"
_BRANCH = re.compile(rf"^(cooldown|control)-s(\d+)-d(\d+)(?:-(.+?))??(?:-({_TAG}))?$")


@dataclass(frozen=True)
class BranchName:
    """A cooldown or control branch name, parsed."""

    kind: str
    """'cooldown' or 'control'."""
    from_step: int
    """The main-run step it starts from."""
    decay_steps: int
    """Its length in steps (the decay's, for a control its twin's)."""
    shape: str | None
    """The decay shape of a cooldown (linear, cosine, 1-sqrt; None on a control or an old unshaped name)."""
    intervention: str | None = None
    """What the cooldown trains with besides its decay (:func:`intervention_tag`: sam0.05, qat-rtn4, ...);
    None for the standard cooldown and for controls."""
    average: str | None = None
    """A no-decay branch's average (lawa-kK-pP, ema-DECAY: :func:`lawa_name`, :func:`ema_name`); None otherwise."""


NODECAY = "nodecay"
"""The kind of a no-decay branch: constant LR for D steps, then its weight average as the endpoint."""
_NODECAY = re.compile(r"^nodecay-s(\d+)-d(\d+)-(lawa-k\d+-p\d+|ema-\d[\d.]*)$")


def nodecay_branch(from_step: int, decay_steps: int, average: str) -> str:
    """The name of a no-decay branch: ``nodecay-s<from_step>-d<decay_steps>-<average>``, where ``average`` is the
    online average that is its endpoint (``lawa-k5-p10``, ``ema-0.99``: :func:`parse_average`)."""
    parse_average(average)
    return f"{NODECAY}-s{int(from_step)}-d{int(decay_steps)}-{average}"


def parse_average(name: str) -> tuple[str, float, int]:
    """('lawa', K, P) of ``lawa-kK-pP``, ('ema', DECAY, 0) of ``ema-DECAY``; one line for any other name."""
    m = re.fullmatch(r"lawa-k(\d+)-p(\d+)", str(name))
    if m is not None and int(m[1]) >= 1 and int(m[2]) >= 1:
        return "lawa", int(m[1]), int(m[2])
    m = re.fullmatch(r"ema-(\d[\d.]*)", str(name))
    if m is not None and 0 < float(m[1]) < 1 and ema_name(float(m[1])) == name:
        return "ema", float(m[1]), 0
    raise QuantdynError(f"average '{name}': name it lawa-kK-pP (the last K snapshots, P steps apart, e.g. "
                        "lawa-k5-p10) or ema-DECAY (a per-step decay in (0, 1), e.g. ema-0.99)")


def _plain_number(value: float) -> str:
    """A number without exponent or sign, as names spell it (1e-05 -> 0.00001, 0.05 -> 0.05, 1.0 -> 1)."""
    text = format(Decimal(repr(float(value))), "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def intervention_tag(sam_rho: float = 0.0, sam_adaptive: bool = False, qat_format: str = "") -> str:
    """The part of a cooldown branch's name that says what it trains with besides its decay: ``sam<rho>``
    (``asam<rho>`` adaptive), ``qat-<format label>``, both as ``sam0.05-qat-rtn4``; '' for neither."""
    parts = []
    if sam_rho > 0:
        parts.append(f"{'asam' if sam_adaptive else 'sam'}{_plain_number(sam_rho)}")
    if qat_format:
        parts.append(f"qat-{qat_format}")
    return "-".join(parts)


def cooldown_branch(from_step: int, decay_steps: int, shape: str, intervention: str = "") -> str:
    """The name of a cooldown branch: ``cooldown-s<from_step>-d<decay_steps>-<shape>`` (the shape may hold
    dashes: ``1-sqrt``), then ``-<intervention>`` for a cooldown with one (:func:`intervention_tag`)."""
    if not shape:
        raise QuantdynError("a cooldown branch needs a decay shape (linear, cosine, 1-sqrt)")
    return f"{COOLDOWN}-s{int(from_step)}-d{int(decay_steps)}-{shape}" + (f"-{intervention}" if intervention else "")


def control_branch(from_step: int, decay_steps: int) -> str:
    """The name of the constant-LR control twin of the cooldowns from ``from_step`` over ``decay_steps``:
    ``control-s<from_step>-d<decay_steps>`` (one control serves every shape of that start and length)."""
    return f"{CONTROL}-s{int(from_step)}-d{int(decay_steps)}"


def parse_branch(name: str | None) -> BranchName | None:
    """The parts of a cooldown or control branch name; None for any other branch (main, averages ...)."""
    m = _BRANCH.match(str(name or ""))
    if m is None:
        nd = _NODECAY.match(str(name or ""))
        return BranchName(NODECAY, int(nd[1]), int(nd[2]), None, average=nd[3]) if nd is not None else None
    kind, s, d, shape, tag = m.groups()
    if kind == CONTROL and (shape is not None or tag is not None) or (tag is not None and shape is None):
        return None
    return BranchName(kind, int(s), int(d), shape, tag)


def control_of(branch: str | None) -> str | None:
    """The control twin of a cooldown branch (``cooldown-s8-d4-1-sqrt`` -> ``control-s8-d4``); None when
    ``branch`` is not a standard cooldown branch (a cooldown with an intervention is compared with the standard
    cooldown, :func:`standard_of`, not paired with the control)."""
    b = parse_branch(branch)
    return control_branch(b.from_step, b.decay_steps) if is_cooldown(branch) else None


def is_cooldown(branch: str | None) -> bool:
    """Whether ``branch`` is named as a standard cooldown branch (a decay and nothing else)."""
    b = parse_branch(branch)
    return b is not None and b.kind == COOLDOWN and b.intervention is None


def is_intervention(branch: str | None) -> bool:
    """Whether ``branch`` is a cooldown with an intervention (SAM, QAT: ``cooldown-s8-d4-linear-qat-rtn4``)."""
    b = parse_branch(branch)
    return b is not None and b.kind == COOLDOWN and b.intervention is not None


def is_nodecay(branch: str | None) -> bool:
    """Whether ``branch`` is a no-decay branch (constant LR, then an average: ``nodecay-s8-d4-lawa-k2-p2``)."""
    b = parse_branch(branch)
    return b is not None and b.kind == NODECAY


def standard_of(branch: str | None) -> str | None:
    """The standard cooldown an intervention's branch is compared with: the same start, length and shape without
    the intervention (``cooldown-s8-d4-linear-qat-rtn4`` -> ``cooldown-s8-d4-linear``); None otherwise."""
    b = parse_branch(branch)
    return cooldown_branch(b.from_step, b.decay_steps, b.shape) if is_intervention(branch) else None


def is_control(branch: str | None) -> bool:
    """Whether ``branch`` is named as a constant-LR control twin."""
    b = parse_branch(branch)
    return b is not None and b.kind == CONTROL
