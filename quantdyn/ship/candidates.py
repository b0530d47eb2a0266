"""The candidates of a ship: which weights could be deployed.

A source is a quantdyn run directory (its main run, its cooldown and control branches, its averages; a cooldown
experiment from an HF model, ``quantdyn cooldown MODEL --out DIR``, is one), a list of checkpoint directories, or
``preset:NAME`` (a public trajectory's last revisions). From a run the default candidates are

* the last ``last`` checkpoints of the main run and of each branch (decayed endpoints, constant-LR controls);
* the EMA and LAWA weights the run kept (``averages/``: their newest checkpoint each);
* LAWA over the last ``lawa`` checkpoints of the main run (the uniform average, written under ``OUT/candidates``);
* a soup of the decayed branch endpoints (a uniform average, when there are two or more).

Identical weights are one candidate: candidates are keyed by the hash of their weights (``checkpoint_hash``); a
cooldown branch's step 0 is its branch point, the main run's checkpoint, and is measured once, under the simpler
recipe's name. Every candidate must share one architecture and vocabulary (one line naming the key that differs).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from quantdyn.errors import QuantdynError
from quantdyn.models.causal_lm import ARCH_KEYS
from quantdyn.models.hf_io import checkpoint_hash
from quantdyn.runs import MAIN, RunDir, has_weights, is_cooldown, read_meta
from quantdyn.ship.decide import recipe_rank
from quantdyn.sources.trajectory import Point, TrajectoryConfig, plan_points, points_of_checkpoints, points_of_run, ScheduleSpec


@dataclass(frozen=True)
class Candidate:
    """Weights that could be deployed."""

    name: str
    """Unique within a ship: ``main@600``, ``<branch>@N``, ``lawa-last3``, ``soup-decayed``, ``ema``."""
    path: str
    """The checkpoint (a directory, or hub id@revision)."""
    how: str
    """checkpoint | cooldown | control | ema | lawa | soup (decide.RECIPES)."""
    members: tuple[str, ...] = ()
    """The checkpoints an average was made of (empty for a checkpoint)."""
    step: int | None = None
    branch: str = MAIN
    run: str = ""
    weights_hash: str = ""
    """checkpoint_hash of the weights (filled by :func:`resolve_candidates`)."""
    same_as: tuple[str, ...] = field(default=())
    """Other names of the same weights (measured once, under this name)."""
    qat_format: str = ""
    """The format a branch was trained for by format QAT (its run's qat.format): deployed with that format only,
    artifact to artifact; empty for weights trained in full precision."""

    def describe(self) -> dict:
        return {"name": self.name, "path": self.path, "how": self.how, "members": list(self.members),
                "step": self.step, "branch": self.branch, "run": self.run, "checkpoint_hash": self.weights_hash,
                **({"same_as": list(self.same_as)} if self.same_as else {}),
                **({"qat_format": self.qat_format} if self.qat_format else {})}


@dataclass(frozen=True)
class CandidateSpec:
    """Which candidates a source gives."""

    last: int = 2
    """Last checkpoints of the main run and of each branch."""
    lawa: int = 3
    """LAWA over the last K main-run checkpoints (0: none; needs K >= 2 checkpoints)."""
    soup: bool = True
    """A uniform soup of the decayed branch endpoints (when there are two or more)."""
    averages: bool = True
    """The averages the run kept (EMA, online or offline LAWA): the newest of each."""

    def __post_init__(self):
        if self.last < 1:
            raise QuantdynError(f"--last {self.last} must be >= 1 (checkpoints per branch)")
        if self.lawa < 0:
            raise QuantdynError(f"--lawa {self.lawa} must be >= 0 (0: no LAWA candidate)")


def _how(p: Point) -> str:
    if p.branch == MAIN:
        return "checkpoint"
    if p.kind in ("cooldown", "control", "ema", "lawa", "soup"):
        return p.kind
    return "cooldown" if is_cooldown(p.branch) else p.kind


def _name(p: Point) -> str:
    return f"{p.branch}@{p.step}" if p.step is not None else p.branch  # RUN@N: how a checkpoint is named elsewhere


def source_points(source: Sequence[str]) -> tuple[list[Point], Path | None]:
    """The points of a source and its run directory (None for checkpoints that belong to no one run, presets)."""
    if not source:
        raise QuantdynError("ship needs a SOURCE: a run directory, checkpoint directories or preset:NAME")
    if len(source) == 1 and str(source[0]).startswith("preset:"):
        pl = plan_points(TrajectoryConfig(preset=str(source[0])[len("preset:"):]))
        return list(pl), None
    if len(source) == 1 and RunDir(Path(source[0])).is_run:
        return points_of_run(Path(source[0])), Path(source[0])
    for s in source:
        p = Path(s)
        if not p.exists():
            raise QuantdynError(f"source '{s}' does not exist; give a run directory, checkpoint directories or "
                                "preset:NAME")
        if p.is_dir() and not (p / "config.json").is_file():
            raise QuantdynError(f"source '{s}' holds no checkpoints (neither a quantdyn run directory with "
                                "config.yaml nor a checkpoint directory with config.json)")
    return points_of_checkpoints([str(s) for s in source], ScheduleSpec()), None


def qat_format_of(p: Point) -> str:
    """The format a point's run trained for by format QAT (qat.format), or ''."""
    return str(((p.meta.get("config") or {}).get("qat") or {}).get("format") or "")


def default_candidates(points: list[Point], spec: CandidateSpec) -> tuple[list[Candidate], dict]:
    """The candidates the points give as checkpoints (no average made yet) and the averages to make:
    {"lawa": [paths], "soup": [paths]} (only those with two or more members)."""
    by_branch: dict[str, list[Point]] = {}
    for p in points:
        if p.step == 0 and p.branch != MAIN:
            continue  # a branch's step 0 is its branch point: the main run's checkpoint (or the HF model)
        by_branch.setdefault(p.branch, []).append(p)
    out: list[Candidate] = []
    make: dict[str, list[str]] = {}
    for branch, pts in by_branch.items():
        pts = sorted(pts, key=lambda p: (p.step or 0, p.tokens or 0))
        how = _how(pts[-1])
        if how in ("ema", "lawa", "soup"):
            if spec.averages:
                p = pts[-1]
                out.append(Candidate(_name(p), p.ref, how, tuple(i.get("path", "") for i in p.meta.get("ingredients", [])),
                                     p.step, p.branch, p.run))
            continue
        for p in pts[-spec.last:]:
            out.append(Candidate(_name(p), p.ref, how, (), p.step, p.branch, p.run, qat_format=qat_format_of(p)))
    main = sorted([p for p in points if p.branch == MAIN and p.is_local and p.step], key=lambda p: p.step)
    if spec.lawa >= 2 and len(main) >= 2:
        make["lawa"] = [p.ref for p in main[-spec.lawa:]]
    # a soup of the decayed branches trained in full precision (a format-QAT branch's weights are tuned to its grid)
    decayed = [max(pts, key=lambda p: p.step or 0) for b, pts in by_branch.items()
               if is_cooldown(b) and not qat_format_of(pts[-1])]
    if main and main[-1].decaying:
        decayed.append(main[-1])
    if spec.soup and len(decayed) >= 2 and all(p.is_local for p in decayed):
        make["soup"] = sorted(p.ref for p in decayed)
    return out, make


def check_compatible(cands: Sequence[Candidate]) -> None:
    """One line when the candidates do not share one architecture and vocabulary (local checkpoints only)."""
    ref = None
    for c in cands:
        cfg_path = Path(c.path) / "config.json"
        if not cfg_path.is_file():
            continue
        try:
            d = json.loads(cfg_path.read_text())
        except json.JSONDecodeError:
            raise QuantdynError(f"'{cfg_path}' is not valid JSON; the checkpoint is corrupt") from None
        if ref is None:
            ref = (c, d)
            continue
        for k in ARCH_KEYS:
            if ref[1].get(k) != d.get(k):
                raise QuantdynError(f"candidates {ref[0].name} and {c.name} differ in {k} ({ref[1].get(k)!r} vs "
                                    f"{d.get(k)!r}): ship compares weights of one architecture and vocabulary; give "
                                    "checkpoints of one model")


def dedupe(cands: Sequence[Candidate]) -> list[Candidate]:
    """One candidate per weights hash: the simplest recipe's (then the first given) keeps its name, the others are
    listed in its ``same_as``."""
    groups: dict[str, list[Candidate]] = {}
    for c in cands:
        h = c.weights_hash or checkpoint_hash(c.path)
        groups.setdefault(h, []).append(Candidate(**{**c.__dict__, "weights_hash": h}))
    out = []
    for h, cs in groups.items():
        first = min(cs, key=lambda c: (recipe_rank(c.how), cs.index(c)))
        others = tuple(c.name for c in cs if c is not first)
        out.append(Candidate(**{**first.__dict__, "same_as": others}))
    return sorted(out, key=lambda c: [i for i, x in enumerate(cands) if x.name == c.name][0])


def local_checkpoints(points: Sequence[Point]) -> bool:
    return any(p.is_local and has_weights(Path(p.ref)) for p in points)


def member_meta(path: str) -> dict:
    return read_meta(Path(path)) if Path(path).is_dir() else {}
