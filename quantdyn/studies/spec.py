"""The study file, typed: ``StudySpec`` and its sections.

A study file (``configs/studies/*.yaml``, the embedded ``demo.yaml``) is read
into frozen dataclasses; unknown keys fail with a did-you-mean
(:func:`quantdyn.config.from_dict`), values are checked in ``__post_init__``
before anything is trained.  Layout::

  run:        a RunConfig (the base run; names get -<vary>... and -sSEED)
  seeds:      [0, 1, 2]            one run per seed
  vary:       ["optim.lr=1e-3,3e-3"]  a grid over run keys (as `quantdyn grid --vary`)
  cooldowns:  {from_steps: [...], decay_steps: D | end_step: T, shape, control, interventions, nodecay}
  averaging:  {lawa: [{window, every}, ...], at_step, soup_cooldowns, reference_from_step}
  sweep:      SweepConfig fields except trajectory (set per run); state quant_repeats
  findings:   {compute: [decay, peak_lr, averaging, sharpness, predictors, interventions, warmdown], quantizers, z, ...}
  ship:       {budget: BPW, quantizers, formats, auto, last, lawa, soup, screen_windows, out}  `quantdyn ship`
              on every run once it is swept: what to deploy at that size (none without a budget)
  report:     report directory
  scale:      a named size (quantdyn/studies/scales.py), applied before typing

Command-line overrides (``quantdyn study FILE key=value ...``) use the same
dotted keys (``run.data.source=my.txt``, ``sweep.quant_repeats=3``,
``seeds=[0,1,2]``, ``scale=pythia-160m``); a key that starts with a run
section (``data.source=...``, ``optim.lr=...``) means ``run.<key>``.
The scale is applied to the file first, the overrides last, so an override
always wins.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Sequence

import yaml

from quantdyn.config import apply_overrides, from_dict, load_yaml, parse_override, to_dict
from quantdyn.errors import QuantdynError, unknown_name
from quantdyn.launch.grid import expand_grid, parse_vary
from quantdyn.quantize.catalogue import parse_quantizer
from quantdyn.runs import control_branch, cooldown_branch, lawa_name, parse_average
from quantdyn.schedules import DECAY_SHAPES
from quantdyn.ship.quantizations import check_formats
from quantdyn.sources.trajectory import TrajectoryConfig
from quantdyn.studies.families import FINDING_FAMILIES
from quantdyn.studies.scales import SCALES, apart_paths, apply_scale
from quantdyn.sweep.sweep import SweepConfig
from quantdyn.train.branches import Intervention, branch_configs, intervention_of, nodecay_config
from quantdyn.train.config import RunConfig, check_warmdown

_DEFAULT_TRAJECTORY = TrajectoryConfig(run="runs/tiny")


@dataclass(frozen=True)
class CooldownSpec:
    """Cooldown branches (and constant-LR control twins) from stable-phase checkpoints of every run."""

    from_steps: tuple[int, ...] = ()
    """Steps of the main run to branch from (each must be a stored checkpoint); empty = no cooldowns."""
    decay_steps: int = 0
    """Every branch decays over this many steps (give this or end_step)."""
    end_step: int = 0
    """Every branch decays from its from_step to this step, so all branches end at equal tokens
    (decay = end_step - from_step; for soups of cooldown branches)."""
    shape: str = "linear"
    """Decay shape: linear | cosine | 1-sqrt."""
    control: bool = False
    """Also train a constant-LR control twin of every branch (same start, data and tokens)."""
    interventions: tuple[str, ...] = ()
    """Cooldown branches with an intervention beside the standard one (issue 48), each 'key=value [key=value]'
    of train/branches.INTERVENTION_KEYS: "qat.format=rtn4", "optim.sam_rho=0.05", "optim.sam_rho=0.5
    optim.sam_adaptive=true". Needs a single from_step (one stable-phase checkpoint per seed)."""
    nodecay: tuple[str, ...] = ()
    """No-decay branches beside the cooldowns: constant LR over the same steps, then the average named here
    (lawa-kK-pP, ema-DECAY) as the endpoint. Needs a single from_step."""

    def __post_init__(self):
        if self.shape not in DECAY_SHAPES:
            raise unknown_name("cooldowns.shape", self.shape, DECAY_SHAPES)
        for a in self.nodecay:
            parse_average(a)
        for text in self.interventions:
            self.intervention(text)
        if (self.interventions or self.nodecay) and len(self.from_steps) != 1:
            raise QuantdynError(f"cooldowns.interventions and nodecay compare branches from one stable-phase "
                                f"checkpoint per seed; give one from_step (got {list(self.from_steps)})")
        if not self.from_steps:
            if self.decay_steps or self.end_step or self.control:
                raise QuantdynError("cooldowns: give from_steps (the checkpoints to branch from)")
            return
        if len(set(self.from_steps)) != len(self.from_steps) or min(self.from_steps) < 1:
            raise QuantdynError(f"cooldowns.from_steps {list(self.from_steps)} must be distinct positive steps")
        if bool(self.decay_steps) == bool(self.end_step):
            raise QuantdynError("cooldowns: give exactly one of decay_steps (the same decay for every branch) "
                                "or end_step (every branch ends there)")
        if self.decay_steps < 0:
            raise QuantdynError(f"cooldowns.decay_steps={self.decay_steps} must be positive")
        if self.end_step and self.end_step <= max(self.from_steps):
            raise QuantdynError(f"cooldowns.end_step={self.end_step} must lie after every from_step "
                                f"({max(self.from_steps)})")

    @property
    def enabled(self) -> bool:
        return bool(self.from_steps)

    @staticmethod
    def intervention(text: str) -> Intervention:
        """The Intervention of one cooldowns.interventions entry ('qat.format=rtn4 optim.sam_rho=0.05')."""
        given = {".".join(k): v for k, v in map(parse_override, text.split())}
        if not given:
            raise QuantdynError("cooldowns.interventions has an empty entry; write e.g. \"qat.format=rtn4\"")
        return intervention_of(given)

    def decay_of(self, from_step: int) -> int:
        """Decay length of the branch that starts at ``from_step``."""
        return self.decay_steps or self.end_step - from_step

    def branch_name(self, from_step: int) -> str:
        """Directory name of that branch (quantdyn.runs.cooldown_branch, as train/branches.py names it)."""
        return cooldown_branch(from_step, self.decay_of(from_step), self.shape)

    def control_name(self, from_step: int) -> str:
        """Directory name of its constant-LR control twin (quantdyn.runs.control_branch)."""
        return control_branch(from_step, self.decay_of(from_step))


@dataclass(frozen=True)
class LawaSpec:
    """One offline LAWA setting: the uniform average of the last ``window`` checkpoints ``every`` steps apart."""

    window: int = 0
    """K, checkpoints averaged."""
    every: int = 0
    """P, steps between them (a multiple of run.train.checkpoint_every)."""

    def __post_init__(self):
        if self.window < 1 or self.every < 1:
            raise QuantdynError(f"averaging.lawa: window ({self.window}) and every ({self.every}) must be >= 1")

    @property
    def name(self) -> str:
        return lawa_name(self.window, self.every)


@dataclass(frozen=True)
class AveragingSpec:
    """Weight averages compared with the decayed endpoint at equal tokens (paper A, finding c)."""

    lawa: tuple[LawaSpec, ...] = ()
    """LAWA settings; each is written once, ending at ``at_step`` of the main run."""
    at_step: int = 0
    """Main-run step the LAWA windows end at (0 = the run's last step); the decayed endpoint compared has
    the same tokens."""
    soup_cooldowns: bool = False
    """Also average the endpoints of all cooldown branches into a soup (needs cooldowns.end_step)."""
    reference_from_step: int = 0
    """The cooldown branch that is "the decayed endpoint": the one from this step (0 = the latest from_step,
    i.e. the shortest decay)."""

    def __post_init__(self):
        names = [x.name for x in self.lawa]
        if len(set(names)) != len(names):
            raise QuantdynError(f"averaging.lawa lists a setting twice ({names})")
        if self.at_step < 0 or self.reference_from_step < 0:
            raise QuantdynError("averaging.at_step and reference_from_step must be >= 0")

    @property
    def enabled(self) -> bool:
        return bool(self.lawa or self.soup_cooldowns)


@dataclass(frozen=True)
class FindingsSpec:
    """Which findings the study computes, and how an effect counts as resolved."""

    compute: tuple[str, ...] = ()
    """Finding families (studies/families.py FINDING_FAMILIES: decay, peak_lr, averaging, sharpness, predictors
    ...); empty = every family whose inputs the study has (StudySpec.finding_families); a family named here must
    have them."""
    quantizers: tuple[str, ...] = ()
    """Quantizers the table covers (empty = every swept quantizer)."""
    z: float = 2.0
    """An effect is resolved when |effect| > z x its uncertainty (or, for a correlation, when its bootstrap
    interval excludes 0); otherwise the verdict is "not resolved at this scale"."""
    matched_loss_levels: int = 5
    """peak_lr: common FP-loss levels at which each run's Δ CE is interpolated."""
    matched_loss_from: float = 0.25
    """peak_lr: a run's checkpoints enter its Δ CE-vs-FP-loss curve from this fraction of its steps on
    (warmup checkpoints, with almost no error, would only widen the range)."""
    n_boot: int = 1000
    """Bootstrap resamples for correlation intervals."""
    ci: float = 0.95
    """Coverage of those intervals."""
    bootstrap_seed: int = 0
    """Seed of the bootstrap."""

    def __post_init__(self):
        for c in self.compute:
            if c not in FINDING_FAMILIES:
                raise unknown_name("findings.compute entry", c, FINDING_FAMILIES)
        if self.z <= 0:
            raise QuantdynError(f"findings.z={self.z} must be > 0")
        if self.matched_loss_levels < 1:
            raise QuantdynError("findings.matched_loss_levels must be >= 1")
        if not 0.0 <= self.matched_loss_from < 1.0:
            raise QuantdynError("findings.matched_loss_from must lie in [0, 1)")
        if self.n_boot < 0 or not 0.0 < self.ci < 1.0:
            raise QuantdynError("findings: n_boot must be >= 0 and ci in (0, 1)")
        for q in self.quantizers:
            parse_quantizer(q)


@dataclass(frozen=True)
class ShipSpec:
    """`quantdyn ship` on every run of the study once it is swept (quantdyn/ship/): which weights, quantized how,
    to deploy at ``budget`` bits per weight; the decision leads the summary and the report.  It is measured on the
    sweep's evaluation and calibration windows (sweep.data) and stores its rows in sweep.store."""

    budget: float = 0.0
    """Bits per weight of the quantized linears, scales included (0 = no ship stage)."""
    quantizers: tuple[str, ...] = ()
    """Uniform types considered (() = ship's common deployment types whose bits per weight fit the budget)."""
    formats: tuple[str, ...] = ()
    """Export formats allowed (gguf, gptq, compressed-tensors; () = all)."""
    auto: bool = True
    """Also allocate a per-tensor plan auto@BUDGET on each candidate."""
    last: int = 2
    """Candidates: the last checkpoints of the main run and of each branch."""
    lawa: int = 3
    """Candidates: LAWA over the last K main-run checkpoints (0 = none)."""
    soup: bool = True
    """Candidates: a soup of the decayed branch endpoints."""
    screen_windows: int = 0
    """Windows of the screen (0 = a quarter of the evaluation windows, at least 16)."""
    repeats: int = 1
    """Calibration draws per quantization (ship --repeats)."""
    out: str = "ship"
    """Directory of the decisions: OUT/<run>-<budget> per run (candidates made, plans, export, ship.json)."""

    def __post_init__(self):
        if self.budget < 0:
            raise QuantdynError(f"ship.budget={self.budget:g} must be a positive number of bits per weight "
                                "(0: no ship stage)")
        if self.last < 1 or self.lawa < 0 or self.screen_windows < 0 or self.repeats < 1:
            raise QuantdynError("ship: last and repeats must be >= 1, lawa and screen_windows >= 0")
        for q in self.quantizers:
            parse_quantizer(q)
        check_formats(self.formats)

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    def out_of(self, run: str) -> str:
        """The ship directory of one run of the study."""
        return str(Path(self.out) / f"{run}-{self.budget:g}")


@dataclass(frozen=True)
class StudySpec:
    """A study: runs (seeds x grid), cooldowns and controls, averages, a sweep, a report and findings."""

    run: RunConfig = field(default_factory=RunConfig)
    """The base training run (required in a study file)."""
    seeds: tuple[int, ...] = ()
    """Seeds; run NAME[-grid...]-sSEED per seed (empty = the run's own seed, no suffix)."""
    vary: tuple[str, ...] = ()
    """Grid over run keys, as `quantdyn grid --vary`: e.g. "optim.lr=1e-3,3e-3,1e-2"."""
    cooldowns: CooldownSpec = field(default_factory=CooldownSpec)
    """Cooldown branches and controls of every run."""
    averaging: AveragingSpec = field(default_factory=AveragingSpec)
    """LAWA settings and a soup of cooldown branches, per run."""
    sweep: SweepConfig = field(default_factory=SweepConfig)
    """The sweep of every run's checkpoints (SweepConfig without trajectory; state quant_repeats)."""
    findings: FindingsSpec = field(default_factory=FindingsSpec)
    """The findings table."""
    ship: ShipSpec = field(default_factory=ShipSpec)
    """What to ship at a size budget, decided on every run once it is swept (none without ship.budget)."""
    report: str = "report"
    """Report directory (index.html, figures, findings.json)."""
    scale: str = ""
    """The named size applied to this spec ('' = as written); see quantdyn/studies/scales.py."""
    title: str = ""
    """One line saying what the study measures (printed and shown in the report)."""

    def __post_init__(self):
        if self.scale and self.scale not in SCALES:
            raise unknown_name("scale", self.scale, SCALES)
        if self.sweep.trajectory != _DEFAULT_TRAJECTORY:
            raise QuantdynError("sweep.trajectory: a study sweeps its own runs; remove sweep.trajectory")
        if len(set(self.seeds)) != len(self.seeds):
            raise QuantdynError(f"seeds {list(self.seeds)} lists a seed twice")
        keys = [parse_vary(v)[0] for v in self.vary]
        if "seed" in keys:
            raise QuantdynError("vary: give seeds as `seeds: [...]`, not vary seed=...")
        if self.vary:  # every grid point typed and checked now (a warmdown axis longer than the run: one line)
            expand_grid(to_dict(self.run), list(self.vary))
        else:
            check_warmdown(self.run)
        for q in self.sweep.quantizers:
            parse_quantizer(q)
        steps, every = self.run.train.steps, self.run.train.checkpoint_every
        stored = f"run.train.checkpoint_every={every}"

        def is_stored(s: int) -> bool:
            return s == steps or (every > 0 and s % every == 0)

        cd = self.cooldowns
        for s in cd.from_steps:
            if s > steps or not is_stored(s):
                raise QuantdynError(f"cooldowns.from_steps: step {s} is not a stored checkpoint of a {steps}-step "
                                    f"run with {stored}; pick a multiple of it")
        for s in cd.from_steps if cd.nodecay else ():  # every average's window fits its branch, before any work
            control = branch_configs(self.run, s, cd.decay_of(s), cd.shape)[1]
            for a in cd.nodecay:
                nodecay_config(control, s, cd.decay_of(s), a)
        av = self.averaging
        at = av.at_step or steps
        if av.at_step > steps:
            raise QuantdynError(f"averaging.at_step={av.at_step} lies after the run's last step {steps}")
        for x in av.lawa:
            if every <= 0 or x.every % every:
                raise QuantdynError(f"averaging.lawa every={x.every} must be a multiple of {stored}")
            if at % x.every:
                raise QuantdynError(f"averaging.lawa every={x.every} must divide the step the windows end at ({at})")
        if av.soup_cooldowns and (not cd.end_step or len(cd.from_steps) < 2):
            raise QuantdynError("averaging.soup_cooldowns needs cooldowns with end_step and at least two from_steps "
                                "(branches that end at equal tokens)")
        if av.reference_from_step and av.reference_from_step not in cd.from_steps:
            raise QuantdynError(f"averaging.reference_from_step={av.reference_from_step} is not one of "
                                f"cooldowns.from_steps {list(cd.from_steps)}")
        for c in self.findings.compute:
            if not FINDING_FAMILIES.get(c).in_spec(self):
                raise QuantdynError(f"findings.compute: {c} needs {FINDING_FAMILIES.get(c).needs}")
        if av.lawa and cd.end_step and cd.end_step != at:
            raise QuantdynError(f"averaging: LAWA windows end at step {at} but the cooldown branches at "
                                f"{cd.end_step}; compare at equal tokens (set averaging.at_step)")

    @property
    def finding_families(self) -> tuple[str, ...]:
        """The finding families this study computes: findings.compute, or every family it has the inputs for."""
        if self.findings.compute:
            return self.findings.compute
        return tuple(f.name for f in FINDING_FAMILIES.values() if f.in_spec(self))


# --------------------------------------------------------------------- loading
SPEC_KEYS = tuple(f.name for f in dataclasses.fields(StudySpec))
_RUN_KEYS = tuple(f.name for f in dataclasses.fields(RunConfig))


def _spec_path(key: list[str]) -> list[str]:
    """An override's key path on the spec: a key that starts with a run section means run.<key>."""
    if key and key[0] not in SPEC_KEYS and key[0] in _RUN_KEYS:
        return ["run", *key]
    return key


def spec_from_dict(data: dict, overrides: Sequence[str] = (), where: str = "study spec") -> StudySpec:
    """Type a study dict: the scale (from the dict or an override) first, then the overrides, then checks. A scale
    on the command line that is not the file's own moves the outputs apart (scales.apart_paths)."""
    data = dict(data or {})
    if "run" not in data:
        raise QuantdynError(f"{where} has no 'run' section (a run config)")
    parsed = [(_spec_path(parse_override(o)[0]), o) for o in overrides]
    scale = next((o.split("=", 1)[1].strip() for p, o in parsed if p == ["scale"]), None)
    own = str(data.get("scale") or "cpu")
    if scale is not None:
        data["scale"] = scale
    if data.get("scale"):
        data = apply_scale(data, str(data["scale"]))
        if scale is not None and scale != own:
            data = apart_paths(data, scale)  # a smoke (or GPU) size never writes into the file's own outputs
    rest = [".".join(p) + "=" + o.split("=", 1)[1] for p, o in parsed if p != ["scale"]]
    data = apply_overrides(data, rest)
    return from_dict(StudySpec, data)


def load_study_spec(path: str | Path, overrides: Sequence[str] = ()) -> StudySpec:
    """Read and type a study file (``quantdyn study FILE key=value ...``)."""
    try:
        return spec_from_dict(load_yaml(path), overrides, where=f"study spec '{path}'")
    except QuantdynError as e:
        msg = str(e)
        raise QuantdynError(msg if str(path) in msg else f"{path}: {msg}") from None


def demo_dict() -> dict:
    """The embedded default study (quantdyn/studies/demo.yaml) as written."""
    return yaml.safe_load(resources.files("quantdyn.studies").joinpath("demo.yaml").read_text())


def demo_spec(overrides: Sequence[str] = ()) -> StudySpec:
    """The embedded default study that `quantdyn demo` runs."""
    return spec_from_dict(demo_dict(), overrides, where="the demo spec")
