"""Trajectories: which checkpoints a sweep visits, with their tokens and LR.

A trajectory is one of
  run:          a quantdyn run directory — its checkpoints, those of its
                cooldown/control branches and its averaged models;
  checkpoints:  a list (or globs) of local HF checkpoint directories;
  hub:          a hub model with revisions (explicit list, or a regex matched
                against the repo's branches and tags via huggingface_hub).
The LR at each point comes from quantdyn's run metadata, or for public
models from a schedule spec (``ScheduleSpec``) given in the sweep config.
"""
from __future__ import annotations

import glob
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from quantdyn.errors import QuantdynError
from quantdyn.models.hf_io import checkpoint_hash  # noqa: F401  (re-exported: sweeps key rows by it)
from quantdyn.train.checkpoint import list_checkpoints, read_meta
from quantdyn.train.schedules import ScheduleConfig, is_decaying, lr_at


@dataclass(frozen=True)
class ScheduleSpec:
    """LR schedule of a public model, to place its revisions on the LR curve."""

    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """The schedule shape (e.g. WSD with its step counts)."""
    peak_lr: float = 0.0
    """Peak LR (0 = unknown: no LR overlay)."""
    total_steps: int = 0
    """Total steps of the schedule."""
    tokens_per_step: int = 0
    """Tokens per optimizer step (to convert steps to tokens)."""
    step_regex: str = r"step[-_]?(\d+)"
    """Regex whose first group is the step in a revision or directory name."""


@dataclass(frozen=True)
class Point:
    """One checkpoint of a trajectory."""

    ref: str
    """Local directory or hub-id@revision."""
    run: str
    """Run (or model) name."""
    branch: str
    """'main', a cooldown/control branch name, or an averaging name."""
    kind: str
    """checkpoint | cooldown | control | lawa | ema | soup | hub | local."""
    step: int | None
    tokens: int | None
    lr: float | None
    decaying: bool | None
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def is_local(self) -> bool:
        return Path(self.ref).is_dir()


def _points_of_run_dir(run_dir: Path, run: str, branch: str, kind: str) -> list[Point]:
    out = []
    for c in list_checkpoints(run_dir):
        m = c.meta
        sched = ScheduleConfig(**m["schedule"]) if "schedule" in m else None
        decaying = is_decaying(c.step - 1, sched, m.get("total_steps", c.step)) if sched else None
        out.append(Point(str(c.path), run, branch, kind, c.step, c.tokens, c.lr, decaying, m))
    return out


def points_of_run(run_dir: Path) -> list[Point]:
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise QuantdynError(f"'{run_dir}' is not a quantdyn run directory (no config.yaml)")
    info = json.loads((run_dir / "run.json").read_text()) if (run_dir / "run.json").is_file() else {}
    run = info.get("name", run_dir.name)
    pts = _points_of_run_dir(run_dir, run, "main", "checkpoint")
    bdir = run_dir / "branches"
    if bdir.is_dir():
        for b in sorted(bdir.iterdir()):
            if (b / "config.yaml").is_file():
                binfo = json.loads((b / "run.json").read_text()) if (b / "run.json").is_file() else {}
                kind = binfo.get("parent", {}).get("kind", "branch")
                pts += _points_of_run_dir(b, run, b.name, kind)
    adir = run_dir / "averages"
    if adir.is_dir():
        for a in sorted(adir.iterdir()):
            for c in sorted(a.iterdir()) if a.is_dir() else []:
                if (c / "model.safetensors").is_file():
                    m = read_meta(c)
                    pts.append(Point(str(c), run, a.name, m.get("kind", "average"), m.get("step"), m.get("tokens"),
                                     m.get("lr"), None, m))
            if a.is_dir() and (a / "model.safetensors").is_file():  # a single averaged checkpoint
                m = read_meta(a)
                pts.append(Point(str(a), run, a.name, m.get("kind", "average"), m.get("step"), m.get("tokens"),
                                 m.get("lr"), None, m))
    return pts


def _step_of(name: str, regex: str) -> int | None:
    m = re.search(regex, name)
    return int(m.group(1)) if m else None


def _with_schedule(ref: str, name: str, run: str, kind: str, spec: ScheduleSpec, meta: dict) -> Point:
    step = meta.get("step", _step_of(name, spec.step_regex))
    tokens = meta.get("tokens") or (step * spec.tokens_per_step if step is not None and spec.tokens_per_step else None)
    lr = meta.get("lr")
    decaying = None
    if lr is None and step is not None and spec.peak_lr and spec.total_steps:
        lr = lr_at(max(0, step - 1), spec.peak_lr, spec.schedule, spec.total_steps)
        decaying = is_decaying(max(0, step - 1), spec.schedule, spec.total_steps)
    return Point(ref, run, "main", kind, step, tokens, lr, decaying, meta)


def points_of_checkpoints(patterns: list[str], spec: ScheduleSpec, run: str = "") -> list[Point]:
    pts = []
    for pat in patterns:
        matches = sorted(glob.glob(pat)) if any(ch in pat for ch in "*?[") else [pat]
        if not matches:
            raise QuantdynError(f"no checkpoint directory matches '{pat}'; check the glob")
        for m in matches:
            p = Path(m)
            if not (p / "config.json").is_file():
                raise QuantdynError(f"checkpoint '{p}' does not exist or has no config.json; fix the trajectory list")
            meta = read_meta(p)
            pts.append(_with_schedule(str(p), p.name, run or meta.get("run", p.parent.name), "local", spec, meta))
    return pts


def list_revisions(repo: str, pattern: str) -> list[str]:
    """Branches and tags of a hub repo matching ``pattern``; offline, those in the local HF cache."""
    rx = re.compile(pattern)
    names: list[str] = []
    try:
        from huggingface_hub import list_repo_refs

        refs = list_repo_refs(repo)
        names = [r.name for r in list(refs.branches) + list(refs.tags)]
    except Exception:  # offline or unknown repo: fall back to what the local cache holds
        from huggingface_hub.constants import HF_HUB_CACHE

        refdir = Path(HF_HUB_CACHE) / f"models--{repo.replace('/', '--')}" / "refs"
        if refdir.is_dir():
            names = [str(p.relative_to(refdir)) for p in refdir.rglob("*") if p.is_file()]
    found = [n for n in names if rx.fullmatch(n) or rx.search(n)]
    if not found:
        raise QuantdynError(f"no revision of '{repo}' matches '{pattern}' (seen {len(names)} refs); check the pattern or network")
    return found


def points_of_hub(repo: str, revisions: list[str] | None, pattern: str | None, spec: ScheduleSpec) -> list[Point]:
    revs = list(revisions or []) or list_revisions(repo, pattern or ".*")
    pts = [_with_schedule(f"{repo}@{r}", r, repo, "hub", spec, {}) for r in revs]
    return sorted(pts, key=lambda p: (p.step is None, p.step or 0))


@dataclass(frozen=True)
class TrajectoryConfig:
    """Which checkpoints to visit (give exactly one of run / checkpoints / hub)."""

    run: str = ""
    """A quantdyn run directory (with its branches and averages)."""
    checkpoints: tuple[str, ...] = ()
    """Local HF checkpoint directories or globs."""
    hub: str = ""
    """A hub model id whose revisions form the trajectory."""
    revisions: tuple[str, ...] = ()
    """Explicit hub revisions."""
    revision_pattern: str = ""
    """Regex matched against the hub repo's branches and tags."""
    schedule: ScheduleSpec = field(default_factory=ScheduleSpec)
    """LR schedule for checkpoints without quantdyn metadata (public models)."""
    include_branches: bool = True
    """For a run: also visit cooldown/control branches."""
    include_averages: bool = True
    """For a run: also visit averaged checkpoints (LAWA, EMA, soups)."""

    def __post_init__(self):
        given = [bool(self.run), bool(self.checkpoints), bool(self.hub)]
        if sum(given) != 1:
            raise QuantdynError("sweep trajectory: give exactly one of run, checkpoints or hub")


def plan_points(t: TrajectoryConfig) -> list[Point]:
    """The checkpoints of a trajectory, in order."""
    if t.run:
        pts = points_of_run(Path(t.run))
        if not t.include_branches:
            pts = [p for p in pts if p.branch == "main" or p.kind in ("lawa", "ema", "soup", "average", "interpolation")]
        if not t.include_averages:
            pts = [p for p in pts if p.kind not in ("lawa", "ema", "soup", "average", "interpolation")]
    elif t.checkpoints:
        pts = points_of_checkpoints(list(t.checkpoints), t.schedule)
    else:
        pts = points_of_hub(t.hub, list(t.revisions), t.revision_pattern or None, t.schedule)
    if not pts:
        raise QuantdynError("the trajectory has no checkpoints; train first or fix the trajectory spec")
    return pts
