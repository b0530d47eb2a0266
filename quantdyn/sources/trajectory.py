"""Trajectories: which checkpoints a sweep visits, with their tokens and LR.

A trajectory is one of
  run:          a quantdyn run directory — its checkpoints, those of its
                cooldown/control branches and its averaged models;
  checkpoints:  a list (or globs) of local HF checkpoint directories;
  hub:          a hub model with revisions (explicit list, or a regex matched
                against the repo's branches and tags via huggingface_hub);
  preset:       a public training trajectory described as data
                (``quantdyn/sources/presets/*.yaml``, see ``quantdyn trajectories``):
                its revisions and, for each, step, tokens, LR and phase.
The LR at each point comes from quantdyn's run metadata, from the preset, or
for other public models from a schedule spec (``ScheduleSpec``) given in the
sweep config.  ``select`` thins any trajectory (every N-th revision, K
log-spaced in tokens, a token range, named revisions).

    plan = plan_trajectory(TrajectoryConfig(preset="pythia-160m", select=SelectConfig(log_spaced=12)))
    print("\n".join(dry_run_lines(plan.points, plan.skipped)))

Hub access is for listing only and fails fast: offline (HF_HUB_OFFLINE=1) or
with the hub unreachable, revisions are listed from the local HF cache, and
:func:`require_available` names the revisions a sweep would still have to
download.  :func:`evict_revision` deletes one revision from the HF cache once
its rows are stored, so a long sweep needs the disk of one or two revisions.
"""
from __future__ import annotations

import glob
import logging
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from quantdyn.errors import QuantdynError
from quantdyn.runs import MAIN, NODECAY, RunDir, averaged_checkpoints, branch_runs, list_checkpoints, read_meta, run_root_of
from quantdyn.schedules import ScheduleConfig, is_decaying, lr_at
from quantdyn.sources.hub import cached_snapshot, hub_offline, hub_refs, list_revisions
from quantdyn.sources.presets import Preset, get_preset, parse_count

log = logging.getLogger(__name__)


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
    phase: str | None = None
    """Schedule phase at this point (warmup, cosine, decay, stage2-linear, soup, ...; None: unknown)."""

    @property
    def is_local(self) -> bool:
        return Path(self.ref).is_dir()

    @property
    def revision(self) -> str:
        """The hub revision of a hub point ('' for local checkpoints)."""
        return self.meta.get("revision") or (self.ref.partition("@")[2] if self.kind in ("hub", "soup") else "")


def _points_of_run_dir(run_dir: Path, run: str, branch: str, kind: str) -> list[Point]:
    out = []
    for c in list_checkpoints(run_dir):
        m = c.meta
        sched = ScheduleConfig(**m["schedule"]) if "schedule" in m else None
        decaying = is_decaying(c.step - 1, sched, m.get("total_steps", c.step)) if sched else None
        out.append(Point(str(c.path), run, branch, kind, c.step, c.tokens, c.lr, decaying, m))
    return out


def points_of_run(run_dir: Path) -> list[Point]:
    """The points of a quantdyn run directory: its checkpoints, those of its branches, its averages."""
    run_dir = Path(run_dir)
    rd = RunDir(run_dir)
    if not rd.is_run:
        raise QuantdynError(f"'{run_dir}' is not a quantdyn run directory (no config.yaml)")
    info = rd.read_info()
    run = info.get("name", run_dir.name)
    pts = _points_of_run_dir(run_dir, run, MAIN, "checkpoint")
    for b in branch_runs(run_dir):
        link = b.read_info().get("parent", {})
        kind = link.get("kind", "branch")
        if kind == NODECAY:  # a no-decay branch's endpoints are its average's (its raw weights are its control's)
            for name, c in averaged_checkpoints(b.path):
                if name == link.get("average"):
                    m = read_meta(c)
                    pts.append(Point(str(c), run, b.path.name, kind, m.get("step"), m.get("tokens"), m.get("lr"),
                                     False, m))
            continue
        pts += _points_of_run_dir(b.path, run, b.path.name, kind)
    for name, c in averaged_checkpoints(run_dir):
        m = read_meta(c)
        pts.append(Point(str(c), run, name, m.get("kind", "average"), m.get("step"), m.get("tokens"), m.get("lr"),
                         None, m))
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


def run_point_of(path: Path) -> Point | None:
    """The point a checkpoint directory is in its run's trajectory (the same run, branch, kind, step, tokens, LR
    and decaying flag as ``points_of_run`` gives it), or None when it belongs to no run. A checkpoint is then the
    same measurement whichever way it is named: ``--run`` or ``--checkpoint``."""
    root = run_root_of(path)
    if root is None:
        return None
    want = Path(path).resolve()
    for p in points_of_run(root):
        if Path(p.ref).resolve() == want:
            return p
    return None


def points_of_checkpoints(patterns: list[str], spec: ScheduleSpec, run: str = "") -> list[Point]:
    """Points of local checkpoint directories (globs allowed). A checkpoint of a quantdyn run is the point its run
    gives it (:func:`run_point_of`), named by the reference as given; any other one is placed on ``spec``."""
    pts = []
    for pat in patterns:
        matches = sorted(glob.glob(pat)) if any(ch in pat for ch in "*?[") else [pat]
        if not matches:
            raise QuantdynError(f"no checkpoint directory matches '{pat}'; check the glob")
        for m in matches:
            p = Path(m)
            if not (p / "config.json").is_file():
                raise QuantdynError(f"checkpoint '{p}' does not exist or has no config.json; fix the trajectory list")
            in_run = run_point_of(p)
            if in_run is not None:
                pts.append(replace(in_run, ref=str(p)))
                continue
            meta = read_meta(p)
            pts.append(_with_schedule(str(p), p.name, run or meta.get("run", p.parent.name), "local", spec, meta))
    return pts


def _hub_points(points: list[Point]) -> list[tuple[Point, str, str]]:
    out = []
    for p in points:
        if p.kind in ("hub", "soup") and "@" in p.ref and not p.is_local:
            repo, _, rev = p.ref.partition("@")
            out.append((p, repo, rev or "main"))
    return out


def missing_revisions(points: list[Point]) -> list[Point]:
    """Hub points whose revision the local HF cache does not hold."""
    return [p for p, repo, rev in _hub_points(points) if cached_snapshot(repo, rev) is None]


def require_available(points: list[Point]) -> None:
    """Offline, fail before any work when revisions of the plan are not in the local HF cache (one line)."""
    if not hub_offline():
        return
    hub = _hub_points(points)
    missing = [(repo, rev) for p, repo, rev in hub if cached_snapshot(repo, rev) is None]
    if missing:
        repo, rev = missing[0]
        raise QuantdynError(f"{len(missing)} of {len(hub)} revisions are not in the local HF cache and HF_HUB_OFFLINE=1 "
                            f"(first: '{rev}' of '{repo}'): download them (`hf download {repo} --revision {rev}`), "
                            "unset HF_HUB_OFFLINE, or restrict the sweep with --revisions")


def points_of_hub(repo: str, revisions: list[str] | None, pattern: str | None, spec: ScheduleSpec) -> list[Point]:
    revs = list(revisions or []) or list_revisions(repo, pattern or ".*")
    pts = [_with_schedule(f"{repo}@{r}", r, repo, "hub", spec, {"revision": r}) for r in revs]
    return sorted(pts, key=lambda p: (p.step is None, p.step or 0))


# -- presets --------------------------------------------------------------------------------------------------
def point_of_revision(pre: Preset, repo: str, name: str) -> Point | str:
    """The sweep point of revision ``name`` of preset ``pre`` in ``repo``, or why it is skipped."""
    info = pre.locate(name)
    if isinstance(info, str):
        return info
    meta = {"revision": name, "preset": pre.name, "family": pre.family, "stage": info.stage,
            "ingredient": info.ingredient, "stage_step": info.stage_step, "stage_tokens": info.stage_tokens,
            "tokens_from": info.tokens_from, "peak_lr": pre.peak_lr}
    for k in ("branches_from", "alias_of", "soup_of"):
        if getattr(info, k):
            meta[k] = getattr(info, k)
    return Point(f"{repo}@{name}", repo, info.branch, info.kind, info.step, info.tokens, info.lr, info.decaying,
                 meta, info.phase)


def _branch_order(p: Point) -> tuple:
    return ({"main": 0, "soup": 2}.get(p.branch, 1), p.branch)


def points_of_preset(t: TrajectoryConfig) -> tuple[list[Point], list[tuple[str, str]]]:
    """(points, skipped (revision, reason)) of a preset trajectory, before ``select``."""
    pre = get_preset(t.preset)
    repo = t.hub or pre.repos[0]
    wanted = list(dict.fromkeys([*t.revisions, *t.select.revisions]))
    if wanted:
        names = wanted
    elif pre.revisions.complete:
        names = pre.known_revisions()
    else:
        names, _ = hub_refs(repo)
    if t.revision_pattern:
        rx = re.compile(t.revision_pattern)
        names = [n for n in names if rx.search(n)]
    aliases = {s.name: s.of[0] for s in pre.revisions.special if s.kind == "alias"}
    points, skipped = [], []
    for n in names:
        if n in aliases and aliases[n] in names and not wanted:
            skipped.append((n, f"the same weights as {aliases[n]} (planned under that name)"))
            continue
        pt = point_of_revision(pre, repo, n)
        if isinstance(pt, str):
            skipped.append((n, pt))
        else:
            points.append(pt)
    points.sort(key=lambda p: (p.tokens is None, p.tokens or 0, _branch_order(p), p.step or 0))
    return points, skipped


# -- selection ------------------------------------------------------------------------------------------------
def parse_tokens_range(text: str) -> tuple[float, float]:
    """'100B:1T' -> (1e11, 1e12); either side may be empty ('100B:' = from 100B on)."""
    lo, sep, hi = str(text).partition(":")
    bounds = []
    for part, default in ((lo, 0.0), (hi, math.inf)):
        if not part.strip():
            bounds.append(default)
            continue
        v = parse_count(part)
        if not sep or v is None:
            raise QuantdynError(f"tokens range '{text}' must look like A:B with token counts such as 100B:1.5T "
                                "(K/M/B/T suffixes; either side may be empty)")
        bounds.append(float(v[0]))
    if bounds[0] > bounds[1]:
        raise QuantdynError(f"tokens range '{text}': the start lies after the end")
    return bounds[0], bounds[1]


@dataclass(frozen=True)
class SelectConfig:
    """Which points of a trajectory to visit (applied per run and branch, after listing)."""

    every: int = 0
    """Keep every N-th point in training order, and always the last (0 = all)."""
    log_spaced: int = 0
    """Keep about K points log-spaced in tokens (points with tokens > 0; the first and last among them)."""
    tokens_range: str = ""
    """Keep points with tokens in A:B, e.g. 100B:1T (inclusive; either side may be empty)."""
    revisions: tuple[str, ...] = ()
    """Only these hub revisions (a preset still supplies their tokens and LR)."""

    def __post_init__(self):
        if self.every < 0 or self.log_spaced < 0:
            raise QuantdynError("trajectory select: every and log_spaced must be >= 0")
        if self.every and self.log_spaced:
            raise QuantdynError("trajectory select: give either every or log_spaced, not both")
        if self.tokens_range:
            parse_tokens_range(self.tokens_range)

    @property
    def active(self) -> bool:
        return bool(self.every or self.log_spaced or self.tokens_range or self.revisions)


def _log_pick(pts: list[Point], k: int) -> list[Point]:
    pos = [p for p in pts if p.tokens and p.tokens > 0]
    if len(pos) <= k:
        return pos
    lo, hi = math.log(pos[0].tokens), math.log(pos[-1].tokens)
    keep: list[Point] = []
    for j in range(k):
        target = lo + (hi - lo) * j / (k - 1) if k > 1 else hi
        best = min(pos, key=lambda p: abs(math.log(p.tokens) - target))
        if best not in keep:
            keep.append(best)
    return sorted(keep, key=lambda p: p.tokens)


def select_points(points: list[Point], sel: SelectConfig) -> tuple[list[Point], list[tuple[str, str]]]:
    """(kept points, dropped points that could not be judged with the reason) under ``sel``."""
    if not sel.active:
        return list(points), []
    dropped: list[tuple[str, str]] = []
    pts = list(points)
    if sel.revisions:
        want = set(sel.revisions)
        pts = [p for p in pts if p.revision in want or p.ref in want]
    if sel.tokens_range:
        lo, hi = parse_tokens_range(sel.tokens_range)
        dropped += [(p.revision or p.ref, "its token count is unknown, so tokens_range cannot place it")
                    for p in pts if p.tokens is None]
        pts = [p for p in pts if p.tokens is not None and lo <= p.tokens <= hi]
    if sel.every or sel.log_spaced:
        groups: dict[tuple[str, str], list[Point]] = {}
        for p in pts:
            groups.setdefault((p.run, p.branch), []).append(p)
        kept = []
        for grp in groups.values():
            grp = sorted(grp, key=lambda p: (p.tokens is None, p.tokens or 0, p.step or 0))
            if sel.every:
                kept += [p for j, p in enumerate(grp) if j % sel.every == 0 or j == len(grp) - 1]
            else:
                if len(grp) > 1:
                    dropped += [(p.revision or p.ref, "no positive token count to place on a log scale")
                                for p in grp if not p.tokens]
                kept += _log_pick(grp, sel.log_spaced) if len(grp) > 1 else grp
        keep_ids = {id(p) for p in kept}
        pts = [p for p in pts if id(p) in keep_ids]
    return pts, dropped


# -- the trajectory config and the plan -----------------------------------------------------------------------
@dataclass(frozen=True)
class TrajectoryConfig:
    """Which checkpoints to visit (give exactly one of run / checkpoints / hub / preset; a preset may name a hub
    repo other than its default one)."""

    run: str = ""
    """A quantdyn run directory (with its branches and averages)."""
    checkpoints: tuple[str, ...] = ()
    """Local HF checkpoint directories or globs."""
    hub: str = ""
    """A hub model id whose revisions form the trajectory (with a preset: the repo to read, e.g. a -deduped twin)."""
    revisions: tuple[str, ...] = ()
    """Explicit hub revisions (with a preset: only these, their tokens and LR still from the preset)."""
    revision_pattern: str = ""
    """Regex matched against the hub repo's branches and tags (with a preset: a filter on its revisions)."""
    schedule: ScheduleSpec = field(default_factory=ScheduleSpec)
    """LR schedule for checkpoints without quantdyn metadata (public models without a preset)."""
    include_branches: bool = True
    """For a run: also visit cooldown/control branches."""
    include_averages: bool = True
    """For a run: also visit averaged checkpoints (LAWA, EMA, soups)."""
    preset: str = ""
    """A public-trajectory preset (`quantdyn trajectories` lists them), e.g. pythia-160m, olmo2-7b."""
    select: SelectConfig = field(default_factory=SelectConfig)
    """Thin the trajectory: every N-th, K log-spaced in tokens, a token range, named revisions."""

    def __post_init__(self):
        given = [bool(self.run), bool(self.checkpoints), bool(self.hub or self.preset)]
        if sum(given) != 1:
            raise QuantdynError("sweep trajectory: give exactly one of run, checkpoints, hub or preset")
        if self.revision_pattern:
            try:
                re.compile(self.revision_pattern)
            except re.error as e:
                raise QuantdynError(f"trajectory.revision_pattern '{self.revision_pattern}' is not a valid regex "
                                    f"({e})") from None
        if self.preset:
            pre = get_preset(self.preset)
            if self.schedule != ScheduleSpec():
                raise QuantdynError(f"trajectory: preset {self.preset} defines the schedule; drop trajectory.schedule")
            if not (self.hub or pre.repos):
                raise QuantdynError(f"preset {self.preset} names no hub repo (one per run): give trajectory.hub "
                                    "(--hub) with the run's repo id")


@dataclass(frozen=True)
class TrajectoryPlan:
    """The points a sweep visits, and the revisions it leaves out with the reason."""

    points: tuple[Point, ...]
    skipped: tuple[tuple[str, str], ...] = ()


class PointList(list):
    """A list of points that also carries ``skipped``: [(revision, reason)] (what :func:`plan_points` returns)."""

    skipped: list[tuple[str, str]]

    def __init__(self, points=(), skipped=()):
        super().__init__(points)
        self.skipped = list(skipped)


def plan_trajectory(t: TrajectoryConfig) -> TrajectoryPlan:
    """The points of a trajectory in order, with the revisions left out and why (nothing is downloaded;
    a hub trajectory without a fixed revision list asks the hub, or the local cache offline, for the names)."""
    skipped: list[tuple[str, str]] = []
    if t.run:
        pts = points_of_run(Path(t.run))
        if not t.include_branches:
            pts = [p for p in pts if p.branch == "main" or p.kind in ("lawa", "ema", "soup", "average", "interpolation")]
        if not t.include_averages:
            pts = [p for p in pts if p.kind not in ("lawa", "ema", "soup", "average", "interpolation")]
    elif t.checkpoints:
        pts = points_of_checkpoints(list(t.checkpoints), t.schedule)
    elif t.preset:
        pts, skipped = points_of_preset(t)
    else:
        pts = points_of_hub(t.hub, list(t.revisions), t.revision_pattern or None, t.schedule)
    pts, dropped = select_points(pts, t.select)
    skipped += dropped
    if not pts:
        why = f" ({len(skipped)} revisions skipped, e.g. {skipped[0][0]}: {skipped[0][1]})" if skipped else ""
        raise QuantdynError(f"the trajectory has no checkpoints{why}; train first or fix the trajectory spec")
    return TrajectoryPlan(tuple(pts), tuple(skipped))


def plan_points(t: TrajectoryConfig) -> PointList:
    """The checkpoints of a trajectory, in order (a list; ``.skipped`` holds the revisions left out and why)."""
    plan = plan_trajectory(t)
    return PointList(plan.points, plan.skipped)


def format_count(v: int | None) -> str:
    """A token or step count with a unit: 1.43K, 2.5B, ? for unknown."""
    if v is None:
        return "?"
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if v >= div:
            return f"{v / div:.4g}{unit}"
    return str(v)


def dry_run_lines(points: list[Point], skipped: list[tuple[str, str]] | None = None) -> list[str]:
    """One line per revision: name, step, tokens, LR and phase (then one per skipped revision with the reason)."""
    if skipped is None:
        skipped = list(getattr(points, "skipped", []))
    width = max([len(p.revision or p.ref) for p in points] + [8])
    lines = []
    for p in points:
        step = "-" if p.step is None else str(p.step)
        lr = "?" if p.lr is None else f"{p.lr:.4g}"
        phase = p.phase or "?"
        dec = "  decaying" if p.decaying else ""
        branch = "" if p.branch == "main" else f"  [{p.branch}]"
        lines.append(f"{p.revision or p.ref:<{width}}  step {step:>9}  tokens {format_count(p.tokens):>8}  "
                     f"lr {lr:>9}  phase {phase}{dec}{branch}")
    lines += [f"skipped {name}: {reason}" for name, reason in skipped]
    return lines


def preset_row_fields(p: Point) -> dict:
    """Fields a result row of preset point ``p`` should carry besides ``sweep.point_fields``."""
    return {"preset": p.meta.get("preset"), "family": p.meta.get("family"), "phase": p.phase,
            "revision": p.revision or None, "stage": p.meta.get("stage") or None,
            "ingredient": p.meta.get("ingredient") or None}
