"""Public training trajectories as data: which revisions a hub model has and
where each one sits in training (step, tokens, LR, phase).

One YAML file per family and size lives in ``quantdyn/sources/presets/`` (package
data), with the source of every number in a comment.  This module reads them
into typed, frozen :class:`Preset` objects and answers, for one revision name,
its :class:`RevisionInfo`, computed by the same schedule functions quantdyn
trains with (``quantdyn.schedules``)::

    pre = get_preset("olmo2-7b")
    info = pre.locate("stage2-ingredient2-step5000-tokens21B")   # RevisionInfo, or the reason it was skipped
    info.tokens, info.lr, info.phase, info.decaying

Revision names are parsed with the preset's regex, whose named groups may be
``step``, ``tokens`` (a number with an optional K/M/B/T suffix), ``stage``,
``ingredient`` and ``index`` (a checkpoint counter: step = first + every ×
index).  Steps and tokens of a revision are global (counted from the start of
training); a stage that branches off another (OLMo-2's stage 2) counts its own
names from zero and is placed after the revision it starts from.  The LR of a
revision is the schedule at the revision's position: the LR in effect when the
checkpoint was written (the last update's LR differs by one step's change).
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import yaml

from quantdyn.config import from_dict
from quantdyn.errors import QuantdynError, unknown_name
from quantdyn.schedules import PhaseSchedule, describe_schedule, schedule_state

GROUPS = ("step", "tokens", "stage", "ingredient", "index")
"""Named groups a revision pattern may use."""

SPECIAL_KINDS = ("alias", "soup")

_SUFFIX = {"": 1.0, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
_COUNT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMBGT]?)\s*$", re.IGNORECASE)


def parse_count(text: str, scale: float | None = 1.0) -> tuple[int, float] | None:
    """'4001B' -> (4001e9, 1e9): a token count and the size of its last digit's unit.

    A plain number is multiplied by ``scale`` (None: a plain number is not understood)."""
    m = _COUNT.match(str(text))
    if not m:
        return None
    unit = _SUFFIX[m.group(2).upper()] if m.group(2) else scale
    if unit is None:
        return None
    return round(float(m.group(1)) * unit), unit


@dataclass(frozen=True)
class RevisionRange:
    """Revision names generated from a template over values: ``step{step}`` over 1000, 2000, ..."""

    template: str = "step{step}"
    """Python format string; ``{step}`` and ``{index}`` both stand for the value (e.g. ckpt_{index:03d})."""
    values: tuple[int, ...] = ()
    """Explicit values."""
    start: int = 0
    """First value of an arithmetic range (with stop and every)."""
    stop: int = 0
    """Last value of the range (inclusive)."""
    every: int = 0
    """Spacing of the range (0 = no range, only ``values``)."""

    def __post_init__(self):
        if self.every < 0 or (self.every and self.stop < self.start):
            raise QuantdynError(f"revision range '{self.template}': need every >= 0 and stop >= start")
        try:
            self.template.format(step=0, index=0)
        except (KeyError, IndexError, ValueError) as e:
            raise QuantdynError(f"revision template '{self.template}' is not a valid format string ({e}); "
                                "use {step} or {index}") from None

    def names(self) -> list[str]:
        vals = list(self.values)
        if self.every:
            vals += list(range(self.start, self.stop + 1, self.every))
        return [self.template.format(step=v, index=v) for v in vals]


@dataclass(frozen=True)
class SpecialRevision:
    """A revision name the pattern does not parse (``main``): an alias of another revision, or a soup."""

    name: str = ""
    """The revision name, e.g. main."""
    kind: str = "alias"
    """alias (the same weights as ``of[0]``) | soup (the average of the revisions in ``of``)."""
    of: tuple[str, ...] = ()
    """The revision(s) it stands for."""
    note: str = ""
    """Where this is stated."""

    def __post_init__(self):
        if self.kind not in SPECIAL_KINDS:
            raise unknown_name("special revision kind", self.kind, SPECIAL_KINDS)
        if not self.name or not self.of or (self.kind == "alias" and len(self.of) != 1):
            raise QuantdynError(f"special revision '{self.name}': give a name and 'of' (one revision for an alias)")


@dataclass(frozen=True)
class IndexSteps:
    """How a checkpoint counter in the name maps to steps: step = first + every × index."""

    first: int = 0
    """Step of index 0."""
    every: int = 0
    """Steps between consecutive indices."""


@dataclass(frozen=True)
class RevisionSpec:
    """How a family names its revisions."""

    pattern: str = ""
    """Regex (matched against the whole name) with named groups among step, tokens, stage, ingredient, index."""
    complete: bool = False
    """True: ``names`` + ``ranges`` are every revision there is (listing needs no hub)."""
    names: tuple[str, ...] = ()
    """Revision names known from the sources (all of them if ``complete``)."""
    ranges: tuple[RevisionRange, ...] = ()
    """Further names, generated."""
    special: tuple[SpecialRevision, ...] = ()
    """Names the pattern does not parse: main as an alias or a soup."""
    index_step: IndexSteps | None = None
    """For an ``index`` group: its steps."""
    tokens_scale: float | None = 1.0
    """Multiplier of a ``tokens`` group written without a K/M/B/T suffix (None: such names have no token count)."""

    def __post_init__(self):
        try:
            rx = re.compile(self.pattern)
        except re.error as e:
            raise QuantdynError(f"revision pattern '{self.pattern}' is not a valid regex ({e})") from None
        bad = [g for g in rx.groupindex if g not in GROUPS]
        if bad:
            raise unknown_name("revision pattern group", bad[0], GROUPS)
        if "index" in rx.groupindex and self.index_step is None:
            raise QuantdynError(f"revision pattern '{self.pattern}' has an index group: give index_step (first, every)")

    def all_names(self) -> list[str]:
        out = list(self.names)
        for r in self.ranges:
            out += [n for n in r.names() if n not in out]
        return out


@dataclass(frozen=True)
class IngredientSpec:
    """One of several runs that branch from the same checkpoint (OLMo-2's stage-2 ingredients)."""

    name: str = ""
    """The value of the revision's ``ingredient`` group."""
    seed: int | None = None
    """Data-order seed, where stated."""
    schedule: PhaseSchedule | None = None
    """Its own schedule, when it differs from the stage's (a longer ingredient)."""
    note: str = ""
    """Source or remark."""


@dataclass(frozen=True)
class StageSpec:
    """A stage with its own schedule (OLMo-2: stage1, stage2)."""

    name: str = "*"
    """The value of the revision's ``stage`` group ('*' = any stage not listed, or names without one)."""
    schedule: PhaseSchedule | None = None
    """Its schedule (None: unknown; revisions get no LR)."""
    branches_from: str = ""
    """A revision of another stage this stage starts from: its names count from 0 there ('' = global)."""
    ingredients: tuple[IngredientSpec, ...] = ()
    """Runs of this stage that branch from the same point."""


@dataclass(frozen=True)
class Preset:
    """One public training trajectory (a family at one size)."""

    name: str = ""
    """Preset name (the file's stem), e.g. pythia-160m."""
    family: str = ""
    """Model family, e.g. pythia, olmo2."""
    size: str = ""
    """Model size as the family writes it, e.g. 160m, 7b."""
    description: str = ""
    """One line for listings."""
    repos: tuple[str, ...] = ()
    """Hub repo ids holding the revisions (first = default; others share the schedule, e.g. -deduped)."""
    tokens_per_step: int | None = None
    """Tokens per optimizer step (None: unknown or not constant; tokens then come from the names)."""
    peak_lr: float | None = None
    """Peak LR (None: unknown)."""
    revisions: RevisionSpec = field(default_factory=RevisionSpec)
    """How revisions are named, and the names themselves where they are fixed."""
    schedule: PhaseSchedule | None = None
    """The LR schedule of a single-stage run (None: unknown, or given per stage)."""
    stages: tuple[StageSpec, ...] = ()
    """Stages with their own schedules (multi-stage runs)."""
    sources: tuple[str, ...] = ()
    """Where the numbers come from (model cards, papers, config files)."""
    unverified: tuple[str, ...] = ()
    """What could not be verified, and where sources disagree."""

    def __post_init__(self):
        if not re.fullmatch(r"[a-z0-9][a-z0-9.\-]*", self.name):
            raise QuantdynError(f"preset name '{self.name}' must be lower-case letters, digits, '.' and '-'")
        if self.tokens_per_step is not None and self.tokens_per_step < 1:
            raise QuantdynError(f"preset {self.name}: tokens_per_step must be positive or null")
        if self.peak_lr is not None and self.peak_lr < 0:
            raise QuantdynError(f"preset {self.name}: peak_lr must be >= 0 or null")
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names):
            raise QuantdynError(f"preset {self.name}: stage names repeat ({names})")
        if self.schedule is not None and self.stages:
            raise QuantdynError(f"preset {self.name}: give either schedule (one stage) or stages, not both")

    # -- revisions -------------------------------------------------------------------------------------------
    @functools.cached_property
    def _rx(self) -> re.Pattern:
        return re.compile(self.revisions.pattern)

    def known_revisions(self) -> list[str]:
        """Revision names the preset itself lists (all of them when ``revisions.complete``), specials last."""
        return self.revisions.all_names() + [s.name for s in self.revisions.special]

    def stage(self, name: str) -> StageSpec | None:
        for s in self.stages:
            if s.name == name:
                return s
        return next((s for s in self.stages if s.name == "*"), None)

    def _schedule_of(self, stage: StageSpec | None, ingredient: str) -> PhaseSchedule | None:
        if stage is None:
            return self.schedule
        ing = next((i for i in stage.ingredients if i.name == ingredient), None)
        return ing.schedule if ing is not None and ing.schedule is not None else stage.schedule

    def locate(self, name: str) -> RevisionInfo | str:
        """Where revision ``name`` sits in training, or the reason it cannot be placed (one line)."""
        return self._locate(name, ())

    def _locate(self, name: str, seen: tuple[str, ...]) -> RevisionInfo | str:
        if name in seen:
            return f"'{name}' refers to itself through branches_from/special revisions"
        special = next((s for s in self.revisions.special if s.name == name), None)
        if special is not None:
            return self._special(special, seen + (name,))
        m = self._rx.fullmatch(name)
        if m is None:
            return f"'{name}' does not match the {self.name} revision pattern {self.revisions.pattern}"
        g = {k: v for k, v in m.groupdict().items() if v is not None}
        stage_name, ingredient = g.get("stage", ""), g.get("ingredient", "")
        stage = None
        if self.stages:
            stage = self.stage(stage_name)
            if stage is None:
                known = ", ".join(s.name for s in self.stages)
                return f"'{name}': stage '{stage_name}' is not one of the {self.name} stages ({known})"
            if ingredient and stage.ingredients and ingredient not in {i.name for i in stage.ingredients}:
                return f"'{name}': ingredient '{ingredient}' is not one of stage {stage.name}'s ingredients"
        step = int(g["step"]) if "step" in g else None
        if step is None and "index" in g and self.revisions.index_step is not None:
            step = self.revisions.index_step.first + self.revisions.index_step.every * int(g["index"])
        name_tokens = parse_count(g["tokens"], self.revisions.tokens_scale) if "tokens" in g else None
        if "tokens" in g and name_tokens is None:
            return f"'{name}': cannot read the token count '{g['tokens']}' (write a K/M/B/T suffix)"
        tokens, tokens_from = None, None
        if step is not None and self.tokens_per_step:
            tokens, tokens_from = step * self.tokens_per_step, "steps"
            if name_tokens is not None:
                written, unit = name_tokens
                if abs(written - tokens) > max(0.02 * tokens, 1.5 * unit):
                    return (f"'{name}': the name says {written:.4g} tokens but step {step} x {self.tokens_per_step} "
                            f"tokens/step = {tokens:.4g}; the preset's tokens_per_step does not fit this revision")
        elif name_tokens is not None:
            tokens, tokens_from = name_tokens[0], "name"
        off_step, off_tokens, parent = 0, 0, ""
        if stage is not None and stage.branches_from:
            base = self._locate(stage.branches_from, seen + (name,))
            if isinstance(base, str):
                return f"'{name}': stage {stage.name} branches from {stage.branches_from}, which cannot be placed: {base}"
            off_step, off_tokens, parent = base.step, base.tokens, base.revision
        g_step = None if step is None or off_step is None else off_step + step
        g_tokens = None if tokens is None or off_tokens is None else off_tokens + tokens
        sched = self._schedule_of(stage, ingredient)
        lr = phase = decaying = None
        if sched is not None:
            pos = step if sched.unit == "steps" else tokens
            if pos is not None:
                lr, phase, decaying = schedule_state(pos, sched, self.peak_lr or None)
        return RevisionInfo(revision=name, step=g_step, tokens=g_tokens, lr=lr, phase=phase, decaying=decaying,
                            stage=stage_name, ingredient=ingredient,
                            branch=f"ingredient{ingredient}" if ingredient else "main", kind="hub",
                            stage_step=step, stage_tokens=tokens, tokens_from=tokens_from, branches_from=parent)

    def _special(self, s: SpecialRevision, seen: tuple[str, ...]) -> RevisionInfo | str:
        parts = [self._locate(n, seen) for n in s.of]
        bad = next((p for p in parts if isinstance(p, str)), None)
        if bad is not None:
            return f"'{s.name}' ({s.kind} of {', '.join(s.of)}): {bad}"
        if s.kind == "alias":
            p = parts[0]
            return RevisionInfo(**{**p.__dict__, "revision": s.name, "alias_of": p.revision})
        toks = [p.tokens for p in parts]
        lrs = [p.lr for p in parts]
        lr = None if any(v is None for v in lrs) else max(lrs)
        peak = self.peak_lr or max((sch.peak for sch in self._schedules()), default=0.0)
        return RevisionInfo(revision=s.name, step=None, tokens=None if None in toks else max(toks), lr=lr,
                            phase="soup", decaying=None if lr is None or not peak else lr < peak * (1 - 1e-12),
                            stage=parts[0].stage, ingredient="", branch="soup", kind="soup",
                            soup_of=tuple(p.revision for p in parts))

    def _schedules(self) -> list[PhaseSchedule]:
        out = [self.schedule] if self.schedule is not None else []
        for st in self.stages:
            out += [st.schedule] if st.schedule is not None else []
            out += [i.schedule for i in st.ingredients if i.schedule is not None]
        return out

    def schedule_line(self) -> str:
        """The schedule in one line (stages separated by ' | ')."""
        if self.schedule is not None:
            return describe_schedule(self.schedule)
        parts = [f"{s.name}: {describe_schedule(s.schedule)}" for s in self.stages if s.schedule is not None]
        return " | ".join(parts) or "unknown"

    def check(self) -> None:
        """Every listed revision can be placed (a test runs this over all presets)."""
        for n in self.known_revisions():
            r = self.locate(n)
            if isinstance(r, str):
                raise QuantdynError(f"preset {self.name}: listed revision {r}")


@dataclass(frozen=True)
class RevisionInfo:
    """Where one revision sits in training."""

    revision: str
    step: int | None
    """Global optimizer step (None: unknown, or a soup)."""
    tokens: int | None
    """Global tokens trained."""
    lr: float | None
    """LR of the schedule at the revision's position (None: schedule unknown)."""
    phase: str | None
    """Label of the schedule phase (warmup, cosine, decay, ..., '-floor' where a min-LR clamp holds; soup)."""
    decaying: bool | None
    """Past warmup and below the peak LR."""
    stage: str = ""
    ingredient: str = ""
    branch: str = "main"
    """main, ingredient{k}, or soup."""
    kind: str = "hub"
    """hub | soup."""
    stage_step: int | None = None
    """Step as written in the name (within its stage)."""
    stage_tokens: int | None = None
    """Tokens within the stage."""
    tokens_from: str | None = None
    """steps (step × tokens_per_step) | name (the count written in the name, rounded)."""
    branches_from: str = ""
    """The revision this stage starts from."""
    alias_of: str = ""
    soup_of: tuple[str, ...] = ()


# -- loading ---------------------------------------------------------------------------------------------------
def _preset_files():
    root = resources.files("quantdyn") / "sources" / "presets"
    return sorted((f for f in root.iterdir() if f.name.endswith(".yaml")), key=lambda f: f.name)


def _prebuilt(data: dict) -> dict:
    """Build the optional nested configs first, so that an error inside them keeps its own message."""
    def build(d: Any, key: str, cls: type, where: str) -> None:
        if isinstance(d, dict) and isinstance(d.get(key), dict):
            d[key] = from_dict(cls, d[key], f"{where}{key}")

    data = dict(data)
    build(data, "schedule", PhaseSchedule, "")
    revs = data.get("revisions")
    if isinstance(revs, dict):
        data["revisions"] = revs = dict(revs)
        build(revs, "index_step", IndexSteps, "revisions.")
    stages = data.get("stages")
    if isinstance(stages, list):
        data["stages"] = stages = [dict(s) if isinstance(s, dict) else s for s in stages]
        for k, st in enumerate(stages):
            build(st, "schedule", PhaseSchedule, f"stages[{k}].")
            ings = st.get("ingredients") if isinstance(st, dict) else None
            if isinstance(ings, list):
                st["ingredients"] = ings = [dict(i) if isinstance(i, dict) else i for i in ings]
                for j, ing in enumerate(ings):
                    build(ing, "schedule", PhaseSchedule, f"stages[{k}].ingredients[{j}].")
    return data


def load_preset_text(text: str, source: str = "<text>") -> Preset:
    """Parse one preset YAML document (errors name ``source``)."""
    try:
        data: Any = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise QuantdynError(f"{source} is not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise QuantdynError(f"{source} must hold a mapping of preset fields")
    try:
        pre = from_dict(Preset, _prebuilt(data))
        pre.check()
    except QuantdynError as e:
        raise QuantdynError(f"{source}: {e}") from None
    return pre


@functools.lru_cache(maxsize=1)
def load_presets() -> dict[str, Preset]:
    """Every preset shipped in quantdyn/trajectories, by name."""
    out: dict[str, Preset] = {}
    for f in _preset_files():
        pre = load_preset_text(f.read_text(encoding="utf-8"), f"trajectory preset {f.name}")
        if pre.name != f.name[: -len(".yaml")]:
            raise QuantdynError(f"trajectory preset {f.name}: name '{pre.name}' differs from the file name")
        out[pre.name] = pre
    return out


def get_preset(name: str) -> Preset:
    """The preset called ``name``; an unknown name is one line with the closest names."""
    presets = load_presets()
    if name not in presets:
        raise unknown_name("trajectory preset", name, presets)
    return presets[name]


def preset_for_repo(repo: str) -> Preset | None:
    """The preset whose repos include ``repo`` (for rows written before they carried a preset name)."""
    for p in load_presets().values():
        if repo in p.repos:
            return p
    return None


@dataclass(frozen=True)
class PresetPoint:
    """A preset point ``NAME@REVISION`` (``smollm3-3b@stage1-step-40000``): the hub checkpoint it names and where it
    sits in its training run."""

    ref: str
    """As written: NAME@REVISION."""
    preset: str
    repo: str
    """The hub repo holding the revision (the preset's first)."""
    info: RevisionInfo
    """Step, tokens, LR and phase of the revision (from the preset's schedule)."""

    @property
    def hub_ref(self) -> str:
        """The hub reference transformers loads: ``repo@revision``."""
        return f"{self.repo}@{self.info.revision}"


def as_hub_ref(ref: str) -> str:
    """What transformers loads for ``ref``: a preset point's hub ``id@revision``; a directory, hub id or
    id@revision unchanged (model.hf of a run config, before the trainer reads it)."""
    point = preset_point(ref)
    return ref if point is None else point.hub_ref


def preset_point(ref: str) -> PresetPoint | None:
    """The preset point ``ref`` names, or None when ``ref`` does not start with a preset's name and '@' (a local
    directory, a hub id). A revision the preset does not place is one line saying why."""
    name, sep, revision = str(ref).partition("@")
    if not sep or name not in load_presets():
        return None
    pre = get_preset(name)
    info = pre.locate(revision)
    if isinstance(info, str):
        raise QuantdynError(f"preset point '{ref}': {info}; `quantdyn trajectories {name}` lists its revisions")
    if not pre.repos:
        raise QuantdynError(f"preset {name} names no hub repo; pass the checkpoint as HUB_ID@{revision}")
    return PresetPoint(ref, name, pre.repos[0], info)
