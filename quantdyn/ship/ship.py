"""``quantdyn ship``: which weights, quantized how, to deploy at a size budget -- decided on the deployed quantity,
with its uncertainty, and written.

    quantdyn ship runs/demo --budget 5 --out ship/demo

1. Candidates (ship/candidates.py): the last checkpoints of every branch, the averages the run kept, LAWA over
   the last K, a soup of the decayed branches; made once under ``OUT/candidates`` and keyed by their weights'
   hash (identical weights are one candidate).
2. Quantizations (ship/quantizations.py): every common uniform type whose bits per weight *on this model* fit the
   budget and that an allowed format exports, plus ``auto@BUDGET`` allocated on each candidate.
3. Screen, then measure in full (successive halving with the verdict rule as its cut): every candidate x
   quantization is measured on the first ``screen_windows`` evaluation windows; an option whose quantized CE is
   above the best one's at z > Z (paired over those windows) is dropped, with the reason printed; the survivors
   are measured on the remaining windows, so each window is measured once per option.
4. Decide (ship/decide.py) on the quantized CE paired over all windows: the best, the tied set (|z| <= Z), the
   option to ship (smallest file among the tied, then the simplest recipe) and its gain over the naive choice
   (the final checkpoint with the uniform type closest to the budget).
5. Write the export of the chosen option in its format (the exact calibration and plan that were measured) and
   ``OUT/ship.json``; the decision is also a row of the store (kind ``decision``), which the report's first
   section, "What to ship", draws.

Every measurement is a row of the store (kind ``ship``: one candidate x quantization on one slice of windows,
keyed by the weights' hash, the quantizer, the calibration and the windows), written as it is made: a second ship
of the same source measures nothing again, and a ship killed at any point loses only the option being measured;
averages, plans and the export are written atomically, ``ship.json`` last.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import shlex
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from quantdyn.config import config_hash, to_dict
from quantdyn.engine.lazy_model import LazyModel, compute_dtype_of
from quantdyn.engine.measure import MeasureConfig, measure
from quantdyn.engine.rows import calibration_draws, ptq_fields, ptq_what, repeat_labels
from quantdyn.engine.sensitivity import model_tensors
from quantdyn.engine.sinks import ExportSink
from quantdyn.errors import QuantdynError
from quantdyn.export.writer import PROVENANCE_FILE
from quantdyn.files import ensure_writable, read_json, write_json_atomic
from quantdyn.models.adapters import model_type_of
from quantdyn.progress import progress as counted
from quantdyn.quantize.catalogue import QuantConfig, parse_quantizer
from quantdyn.quantize.plan import plan_of, write_plan
from quantdyn.results.schema import DECISION, SHIP
from quantdyn.results.schema import calib_hash as calib_identity
from quantdyn.results.schema import row_key
from quantdyn.results.stats import Z
from quantdyn.results.store import ResultStore
from quantdyn.runtime import provenance, resolve_device
from quantdyn.ship.candidates import (Candidate, CandidateSpec, check_compatible, default_candidates, dedupe,
                                      source_points)
from quantdyn.ship.decide import Decision, Dropped, Option, decide, naive_quantizer, screen
from quantdyn.ship.quantizations import Quantization, plan_quantizations
from quantdyn.sources.hub import open_checkpoint
from quantdyn.sources.trajectory import TrajectoryConfig
from quantdyn.sweep.sweep import SweepConfig, SweepDataConfig, sweep_data
from quantdyn.train.offline_averaging import make_soup

log = logging.getLogger("quantdyn")

REQUEST = "ship-request.json"
"""What a ship directory was asked (written first): a later ship into the same --out must ask the same."""
DECISION_FILE = "ship.json"


@dataclass(frozen=True)
class ShipConfig:
    """One ship: a source, a budget, where to write."""

    source: tuple[str, ...]
    """A run directory, checkpoint directories, or preset:NAME."""
    budget: float
    """Bits per weight the quantized linears may take (their scales included, as each format stores them)."""
    out: str
    """Directory for the candidates, plans, export and ship.json."""
    quantizers: tuple[str, ...] = ()
    """Uniform types to consider (() = quantizations.DEPLOYMENT_TYPES); those above the budget are left out."""
    formats: tuple[str, ...] = ()
    """Export formats the user's engine runs (gguf, gptq, compressed-tensors; () = all)."""
    auto: bool = True
    """Also allocate a per-tensor plan (auto@BUDGET) on each candidate."""
    candidates: CandidateSpec = field(default_factory=CandidateSpec)
    eval_data: str = ""
    """Evaluation and calibration data ('' = the run's own data, or builtin:kjv with the model's tokenizer)."""
    eval_tokens: int = 25600
    """Held-out tokens the decision is measured on (windows of eval_seq_len)."""
    eval_seq_len: int = 128
    calib_samples: int = 32
    calib_seq_len: int = 128
    screen_windows: int = 0
    """Windows of the screen (0 = a quarter of the windows, at least 16); >= all windows: no screen."""
    repeats: int = 1
    """Calibration draws per quantization (and per sensitivity pass of auto@): run-to-run spread and the plan's
    stability."""
    store: str = "results"
    device: str = "auto"
    engine: MeasureConfig = field(default_factory=MeasureConfig)
    z: float = Z

    def __post_init__(self):
        if self.eval_tokens < self.eval_seq_len * 2:
            raise QuantdynError(f"--eval-tokens {self.eval_tokens} gives fewer than two windows of {self.eval_seq_len}"
                                " tokens: a paired SE needs at least two")
        if self.repeats < 1:
            raise QuantdynError(f"--repeats {self.repeats} must be >= 1")
        if self.screen_windows < 0:
            raise QuantdynError(f"--screen-windows {self.screen_windows} must be >= 0 (0: a quarter of the windows)")

    def request(self) -> dict:
        """What decides the answer (a later ship into the same --out must ask the same)."""
        d = to_dict(self)
        for k in ("out", "store", "device", "engine"):
            d.pop(k, None)
        d["source"] = [str(Path(s).resolve()) if Path(s).exists() else s for s in self.source]
        return d


@dataclass
class ShipResult:
    """What :func:`ship` decided and wrote."""

    decision: Decision
    dropped: list[Dropped]
    report: dict
    """ship.json's content."""
    measured: int
    """Rows written by this call (0: everything was in the store)."""
    path: Path


# ------------------------------------------------------------------ checks before anything is written


def _check_out(out: Path, request: dict) -> None:
    if out.exists() and not out.is_dir():
        raise QuantdynError(f"--out '{out}' is a file; give a directory for the ship")
    if out.is_dir() and any(out.iterdir()):
        req = out / REQUEST
        if not req.is_file():
            raise QuantdynError(f"--out '{out}' exists and holds other files; give a new or empty directory")
        old = read_json(req, "delete the directory or give another --out")
        if old != request:
            diff = sorted(k for k in set(old) | set(request) if old.get(k) != request.get(k))
            raise QuantdynError(f"--out '{out}' holds another decision (its {', '.join(diff)} differ); give another "
                                "--out, or delete that directory")
    ensure_writable(out, "--out", kind="dir")  # qd.ship too, not only the command line's --out


# ------------------------------------------------------------------ measurement


@dataclass
class _Ctx:
    cfg: ShipConfig
    store: ResultStore
    device: torch.device
    eval_ids: torch.Tensor
    calib: list
    calib_hash: str
    eval_base: str
    data_hash: str
    done: set
    plans_dir: Path
    echo: Callable[[str], None]
    written: int = 0


def _slice_hash(ctx: _Ctx, a: int, b: int) -> str:
    return f"{ctx.eval_base}[{a}:{b}]"


def _label_of(ctx: _Ctx, c: Candidate, q: Quantization, stage: str) -> str:
    """The engine label of q on c at a stage: auto@ on the screen, the plan it made there afterwards."""
    if q.uniform or stage == "screen":
        return q.label
    return f"plan:{_plan_path(ctx, c, q)}"


def _plan_path(ctx: _Ctx, c: Candidate, q: Quantization) -> Path:
    return ctx.plans_dir / f"{c.weights_hash}-{config_hash(q.label)[:8]}.json"


def _key(ctx: _Ctx, c: Candidate, qc: QuantConfig, a: int, b: int) -> str:
    return row_key(c.weights_hash, "ship:" + ptq_what(qc, ctx.calib_hash, ctx.cfg.repeats),
                   _slice_hash(ctx, a, b))


def _measure_slice(ctx: _Ctx, c: Candidate, qs: Sequence[Quantization], a: int, b: int, stage: str) -> None:
    """Measure the options of candidate ``c`` still missing on windows [a, b); their rows appended at once."""
    cfg = ctx.cfg
    todo = {}
    for q in qs:
        label = _label_of(ctx, c, q, stage)
        qc = parse_quantizer(label)
        if _key(ctx, c, qc, a, b) not in ctx.done:
            todo[q.name] = (q, label, qc)
    if not todo:
        return
    variants, calib = {}, {}
    for name, (q, label, qc) in todo.items():
        for r, v in enumerate(repeat_labels(name, cfg.repeats)):
            variants[v], calib[v] = qc, ctx.calib[r]
    weights = open_checkpoint(c.path)
    # an allocated plan's stability between draws is said beside the checkpoint's bf16 noise floor (plan_stability)
    floor = None if stage == "screen" and cfg.repeats > 1 and any(not q.uniform for q, _, _ in todo.values()) else False
    m = measure(weights, variants, ctx.eval_ids[a:b], calib, device=ctx.device, cfg=cfg.engine, noise_floor=floor)
    fp = m.fp_window_ce.double().numpy()
    rows = []
    for name, (q, label, qc) in todo.items():
        f = ptq_fields(name, qc, m, cfg.engine, cfg.engine.quantize_threads, cfg.repeats)
        stability = None
        if not q.uniform and stage == "screen":
            plan = plan_of(parse_quantizer(m.plans[name]["plan_label"]))
            path = _plan_path(ctx, c, q)
            if not path.is_file():
                write_plan(plan, path)  # atomic; the rest of the windows are measured with this very plan
            stability = plan_stability(m, name, cfg.repeats)
        wq = fp + np.asarray(f["window_delta"], dtype=np.float64)
        rows.append({"key": _key(ctx, c, qc, a, b), "kind": SHIP.name, **f, "ship_quantization": q.name,
                     "ship_candidate": c.name, "ship_recipe": c.how, "ship_stage": stage, "ship_windows": [a, b],
                     "window_ce_q": [round(float(v), 7) for v in wq], "run": c.run, "branch": c.branch,
                     "step": c.step, "checkpoint": c.path, "checkpoint_hash": c.weights_hash,
                     "eval_hash": _slice_hash(ctx, a, b), "calib_hash": ctx.calib_hash, "data_key": ctx.data_hash,
                     "n_params": m.n_params, **({"plan_stability": stability} if stability else {}),
                     "plan_file": str(_plan_path(ctx, c, q)) if not q.uniform else None, **provenance()})
    ctx.written += len(ctx.store.append_new(rows))
    ctx.done.update(r["key"] for r in rows)


def deployable(c: Candidate, qs: Sequence[Quantization]) -> list[Quantization]:
    """The quantizations candidate ``c`` is deployed with: a branch trained by format QAT with that format only
    (artifact to artifact, issue 48), other weights with every one."""
    return [q for q in qs if not c.qat_format or q.name == c.qat_format]


def plan_stability(m, name: str, repeats: int) -> dict | None:
    """How much an allocated plan moves between calibration draws (R >= 2): tensors whose type differs from draw
    0's plan (per draw), the spread of the plan's predicted KL, and the checkpoint's bf16 noise floor in KL."""
    if repeats < 2:
        return None
    labels = repeat_labels(name, repeats)
    plans = [plan_of(parse_quantizer(m.plans[v]["plan_label"])) for v in labels]
    base = plans[0].assignment()
    changed = [sum(1 for t, ty in p.assignment().items() if base.get(t) != ty) for p in plans[1:]]
    kls = [m.plans[v].get("plan_predicted_kl_joint") for v in labels]
    kls = [k for k in kls if k is not None]
    actual = [m.metrics[v]["kl"] for v in labels if v in m.metrics]
    return {"draws": repeats, "n_tensors": len(base), "changed_tensors": changed,
            "predicted_kl": kls, "predicted_kl_sd": statistics.stdev(kls) if len(kls) > 1 else None,
            "kl": actual, "kl_sd": statistics.stdev(actual) if len(actual) > 1 else None,
            "bits_per_weight": [m.plans[v].get("plan_bits_per_weight") for v in labels],
            "floor_kl": (m.noise_floor or {}).get("kl")}


def _option(rows: list[dict], c: Candidate, q: Quantization, windows: int | None = None) -> Option | None:
    """The option of c x q from its rows (windows in order, the first ``windows`` of them when given; None when
    none is stored)."""
    mine = sorted((r for r in rows if r.get("ship_candidate") == c.name and r.get("ship_quantization") == q.name
                   and r.get("checkpoint_hash") == c.weights_hash), key=lambda r: r["ship_windows"][0])
    if not mine:
        return None
    w: list[float] = []
    for r in mine:
        if r["ship_windows"][0] != len(w):
            continue  # a slice of another screen size
        w += r["window_ce_q"]
    w = w[:windows] if windows is not None else w
    sds = [r.get("delta_ce_run_sd") for r in mine if r.get("delta_ce_run_sd") is not None]
    R = int(mine[0].get("quant_repeats") or 1)
    run_se = statistics.fmean(sds) / math.sqrt(R) if sds and R > 1 else None
    bpw = mine[0].get("bits_per_weight") or q.bits_per_weight
    return Option(c.name, q.name, float(bpw), np.asarray(w), c.how, run_se, q.uniform)


# ------------------------------------------------------------------ the command


def ship(cfg: ShipConfig | str | Sequence[str], budget: float | None = None, out: str | Path | None = None, *,
         echo: Callable[[str], None] | None = None, progress: bool = True, **options) -> ShipResult:
    """Decide what to ship and write it (module docstring): ``ship("runs/demo", budget=5, out="ship/demo")`` or
    ``ship(ShipConfig(...))``; ``options`` are ShipConfig's other fields (quantizers, formats, repeats, store ...).
    Every bad input is one line (a QuantdynError) before anything is written."""
    if not isinstance(cfg, ShipConfig):
        if budget is None or out is None:
            raise QuantdynError("ship needs a budget (bits per weight) and out (the directory to write)")
        src = (str(cfg),) if isinstance(cfg, (str, Path)) else tuple(str(s) for s in cfg)
        if isinstance(options.get("candidates"), dict):
            options["candidates"] = CandidateSpec(**options["candidates"])
        cfg = ShipConfig(source=src, budget=float(budget), out=str(out), **{k: tuple(v) if isinstance(v, list) else v
                                                                          for k, v in options.items()})
    say = echo or log.warning
    out = Path(cfg.out)
    request = cfg.request()
    _check_out(out, request)
    points, run_dir = source_points(cfg.source)
    if not points:
        raise QuantdynError(f"source {' '.join(cfg.source)} holds no checkpoints; train or download some first")
    cands, make = default_candidates(points, cfg.candidates)
    if not cands:
        raise QuantdynError(f"source {' '.join(cfg.source)} holds no checkpoints; train or download some first")
    check_compatible(cands)
    first = open_checkpoint(cands[-1].path)
    source = LazyModel(first, compute_dtype_of(cfg.engine.dtype), torch.device("cpu"))
    tensors = model_tensors(source)
    limit = first.config.get("max_position_embeddings") or first.config.get("n_positions")
    if limit and max(cfg.eval_seq_len, cfg.calib_seq_len) > int(limit):
        raise QuantdynError(f"--eval-seq-len {cfg.eval_seq_len} / --calib-seq-len {cfg.calib_seq_len} exceed the "
                            f"model's {limit} positions; give at most {limit}")
    mt = model_type_of(source.model)
    qs, notes = plan_quantizations(cfg.budget, tensors, len(source.blocks), mt, labels=cfg.quantizers,
                                   formats=cfg.formats, auto=cfg.auto)
    bpw = {q.name: q.bits_per_weight for q in qs if q.uniform}
    naive_q = naive_quantizer(bpw, cfg.budget)
    main = [c for c in cands if c.how == "checkpoint"] or cands
    naive_c = max(main, key=lambda c: c.step or 0).name
    device = resolve_device(cfg.device)
    # ---------------------------------------------------------------- from here on, files are written
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / REQUEST, request)
    for n in notes:
        say(n)
    for how, members in make.items():
        name = f"lawa-last{len(members)}" if how == "lawa" else "soup-decayed"  # ship's own, not a run's averages/
        path = out / "candidates" / name
        if not path.is_dir():
            say(f"making {name} from {len(members)} checkpoints")
            make_soup(members, out=path)
        cands.append(Candidate(name, str(path), how, tuple(members), None, name, cands[0].run))
    check_compatible(cands)
    cands = dedupe(cands)
    for c in cands:
        if c.same_as:
            say(f"{c.name}: the same weights as {', '.join(c.same_as)} (measured once)")
    naive_c = next((c.name for c in cands if c.name == naive_c or naive_c in c.same_as), naive_c)
    names = {q.name for q in qs}
    for c in [c for c in cands if c.qat_format and c.qat_format not in names]:
        say(f"{c.name}: trained for {c.qat_format} by QAT, which is not among this ship's quantizations (fits the "
            f"budget and --formats? add it with --quantizers); left out")
        cands.remove(c)
    # data: the run's own tokens (its tokenizer, its held-out split), or eval_data with the model's tokenizer
    scfg = SweepConfig(trajectory=TrajectoryConfig(checkpoints=(cands[0].path,)) if run_dir is None else
                       TrajectoryConfig(run=str(run_dir)),
                       data=SweepDataConfig(source=cfg.eval_data, calib_samples=cfg.calib_samples,
                                            calib_seq_len=cfg.calib_seq_len, eval_seq_len=cfg.eval_seq_len),
                       store=cfg.store)
    data = sweep_data(scfg, [p for p in points if p.is_local] or points, progress)
    n = cfg.eval_tokens // cfg.eval_seq_len
    eval_ids = data.eval_windows(cfg.eval_seq_len, n)
    n = len(eval_ids)
    n0 = cfg.screen_windows or max(16, n // 4)
    n0 = min(n0, n)
    store = ResultStore(cfg.store)
    ctx = _Ctx(cfg, store, device, eval_ids,
               calibration_draws(data, cfg.calib_samples, cfg.calib_seq_len, 0, cfg.repeats, "draw"),
               calib_identity(data.data_hash, cfg.calib_samples, cfg.calib_seq_len, 0),
               data.token_hash("val", cfg.eval_seq_len, n), data.data_hash, store.keys(), out / "plans", say)
    ctx.plans_dir.mkdir(exist_ok=True)
    # ---------------------------------------------------------------- screen
    for c in counted(cands, desc="ship screen", enabled=progress, unit="candidate"):
        _measure_slice(ctx, c, deployable(c, qs), 0, n0, "screen")
    rows = [r for r in store.rows() if SHIP.matches(r) and r.get("data_key") == ctx.data_hash
            and r.get("calib_hash") == ctx.calib_hash and str(r.get("eval_hash", "")).startswith(ctx.eval_base)]
    options = [o for c in cands for q in deployable(c, qs) if (o := _option(rows, c, q, n0)) is not None]
    kept, dropped = screen(options, cfg.z, keep=[(naive_c, naive_q)] if naive_q else ())
    for d in dropped:
        say(f"dropped {d.reason()}")
    # ---------------------------------------------------------------- the survivors on the other windows
    if n0 < n:
        survivors = {(o.candidate, o.quantizer) for o in kept}
        todo = [(c, [q for q in qs if (c.name, q.name) in survivors]) for c in cands]
        for c, cq in counted([t for t in todo if t[1]], desc="ship full", enabled=progress, unit="candidate"):
            _measure_slice(ctx, c, cq, n0, n, "full")
        rows = [r for r in store.rows() if SHIP.matches(r) and r.get("data_key") == ctx.data_hash
                and r.get("calib_hash") == ctx.calib_hash and str(r.get("eval_hash", "")).startswith(ctx.eval_base)]
    by = {(c.name, q.name): (c, q) for c in cands for q in deployable(c, qs)}
    full = [o for o in (_option(rows, *by[k]) for k in sorted({(o.candidate, o.quantizer) for o in kept},
                                                              key=lambda k: list(by).index(k)))
            if o is not None and len(o.window_ce) == n]
    dec = decide(full, (naive_c, naive_q) if naive_q else None, cfg.z)
    # ---------------------------------------------------------------- write the chosen one
    chosen_c, chosen_q = by[dec.chosen.key]
    export = _export(ctx, chosen_c, chosen_q, mt, say)
    report = _report(cfg, ctx, dec, dropped, cands, qs, by, export, data, n, n0, rows, naive_c, naive_q)
    write_json_atomic(out / DECISION_FILE, report)
    dkey = hashlib.sha256(json.dumps({"request": request, "chosen": report["artifact"]["name"],
                                      "quantizer": report["quantizer"]}, sort_keys=True).encode()).hexdigest()[:24]
    ctx.written += len(store.append_new([{"key": dkey, "kind": DECISION.name, "ship": report,
                                          "checkpoint": chosen_c.path, "checkpoint_hash": chosen_c.weights_hash,
                                          "eval_hash": ctx.eval_base, "data_key": ctx.data_hash, **provenance()}]))
    return ShipResult(dec, dropped, report, ctx.written, out / DECISION_FILE)


def _sha256(path: Path) -> str:
    """The sha256 of what a server reads: the file, or every file of the directory by relative path, but the
    export's provenance (quantdyn_export.json: when it was written, in how many seconds, at which git commit), so
    identical weights quantized the same way give the same digest in every run."""
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file() and p.name != PROVENANCE_FILE)
    for f in files:
        if path.is_dir():
            h.update(str(f.relative_to(path)).encode() + b"\0")
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()


def _export(ctx: _Ctx, c: Candidate, q: Quantization, model_type: str, say) -> dict:
    """The chosen option written in its format, with the calibration (and plan) it was measured with."""
    out = Path(ctx.cfg.out)
    label = _label_of(ctx, c, q, "full")
    path = out / ("model.gguf" if q.export_format == "gguf" else "export")
    stamp = out / ".export.json"
    want = {"candidate": c.weights_hash, "quantizer": label, "format": q.export_format}
    if path.exists() and stamp.is_file() and read_json(stamp, "delete it") == want:
        return {"path": str(path), "format": q.export_format, "sha256": _sha256(path), "quantizer": label}
    if path.exists():  # an export of another choice (the data or the rows changed): replaced
        import shutil

        shutil.rmtree(path) if path.is_dir() else path.unlink()
    say(f"writing {c.name} x {q.name} as {q.export_format}: {path}")
    qc = parse_quantizer(label)
    source = LazyModel(open_checkpoint(c.path), compute_dtype_of(ctx.cfg.engine.dtype), ctx.device)
    sink = ExportSink(q.export_format, path, source, qc, qc.name)
    try:
        measure(source, {qc.name: qc}, None, ctx.calib[0], device=ctx.device, cfg=ctx.cfg.engine, on_layer=sink)
        written = sink.close()
    except BaseException:
        sink.abort()
        raise
    write_json_atomic(stamp, want)
    return {"path": str(written), "format": q.export_format, "sha256": _sha256(Path(written)), "quantizer": label}


def _row_of(o: Option, d=None) -> dict:
    r = {"candidate": o.candidate, "recipe": o.how, "quantizer": o.quantizer, "bits_per_weight": o.bits_per_weight,
         "ce_q": o.ce_q, "ce_q_se": o.ce_q_se}
    if d is not None:
        r.update({"minus_best": d.difference, "minus_best_se": d.se, "z": d.z if d.se > 0 else None})
    return r


def _report(cfg, ctx, dec: Decision, dropped, cands, qs, by, export, data, n, n0, rows, naive_c, naive_q) -> dict:
    chosen_c, chosen_q = by[dec.chosen.key]
    src = " ".join(shlex.quote(s) for s in cfg.source)
    stab = next((r.get("plan_stability") for r in rows if r.get("ship_candidate") == chosen_c.name
                 and r.get("ship_quantization") == chosen_q.name and r.get("plan_stability")), None)
    stability = {f"{r['ship_candidate']}": r["plan_stability"] for r in rows if r.get("plan_stability")}
    g = dec.gain
    label = _label_of(ctx, chosen_c, chosen_q, "full")
    fmt = chosen_q.export_format
    return {
        "budget": cfg.budget,
        "artifact": {**chosen_c.describe(), "made": chosen_c.how},
        "quantizer": chosen_q.name, "quantizer_label": label, "format": fmt, "uniform": chosen_q.uniform,
        "bits_per_weight": dec.chosen.bits_per_weight, "ce_q": dec.chosen.ce_q, "ce_q_se": dec.chosen.ce_q_se,
        "best": _row_of(dec.best),
        "tied": [_row_of(o, d) for o, d in dec.tied],
        "naive": ({"artifact": naive_c, "quantizer": naive_q, "ce_q": dec.naive.ce_q, "ce_q_se": dec.naive.ce_q_se,
                   "bits_per_weight": dec.naive.bits_per_weight} if dec.naive is not None else None),
        "gain": g.difference if g is not None else None, "gain_se": g.se if g is not None else None,
        "gain_z": (g.z if g is not None and g.se > 0 else None),
        "gain_resolved": dec.gain_resolved, "z": cfg.z,
        "export": export,
        "options": [_row_of(o, d) for o, d in dec.ranked],
        "dropped": [{**_row_of(d.option), "beaten_by": f"{d.beaten_by.candidate} x {d.beaten_by.quantizer}",
                     "minus_best": d.difference.difference, "minus_best_se": d.difference.se,
                     "z": d.difference.z, "windows": len(d.option.window_ce)} for d in dropped],
        "screen": {"scheme": "one round of successive halving cut by the verdict rule: every option on the first "
                             f"{n0} windows, those beaten by the best at z > {cfg.z:g} dropped, the rest measured "
                             f"on the other {n - n0} windows", "screen_windows": n0, "windows": n},
        "candidates": [c.describe() for c in cands],
        "quantizations": [q.describe() for q in qs],
        "plan_stability": stability or None, "chosen_plan_stability": stab,
        "data": {"source": data.manifest.get("source") if isinstance(data.manifest, dict) else None,
                 "data_key": ctx.data_hash, "eval_windows": n, "eval_seq_len": cfg.eval_seq_len,
                 "calib_samples": cfg.calib_samples, "calib_seq_len": cfg.calib_seq_len, "calib_hash": ctx.calib_hash},
        "store": str(cfg.store),
        "commands": {
            "ship": f"quantdyn ship {src} --budget {cfg.budget:g} --out {shlex.quote(cfg.out)} --store "
                    f"{shlex.quote(str(cfg.store))}" + (f" --formats {','.join(cfg.formats)}" if cfg.formats else "")
                    + (f" --repeats {cfg.repeats}" if cfg.repeats > 1 else ""),
            "average": {c.name: ("quantdyn average soup " + " ".join(shlex.quote(m) for m in c.members)
                                 + f" --out {shlex.quote(c.path)}") for c in cands if c.how in ("lawa", "soup")
                        and c.members and str(Path(cfg.out)) in c.path},
            "measure": f"quantdyn quantize {shlex.quote(chosen_c.path)} --quantizers {label} --calib-samples "
                       f"{cfg.calib_samples} --calib-seq-len {cfg.calib_seq_len} --eval-seq-len {cfg.eval_seq_len}",
            "export": f"quantdyn quantize {shlex.quote(chosen_c.path)} --quantizers {label} --export {fmt} --out "
                      f"{shlex.quote(export['path'])}",
        },
    }


# ------------------------------------------------------------------ the answer as text


def summary_lines(report: dict, limit: int = 12) -> list[str]:
    """ship.json as the terminal shows it: the options (best first; * chosen, = tied with the best, n the naive
    choice) and the answer in three lines."""
    from quantdyn.results.stats import format_estimate

    tied = {(t["candidate"], t["quantizer"]) for t in report["tied"]}
    chosen = (report["artifact"]["name"], report["quantizer"])
    naive = (report["naive"]["artifact"], report["naive"]["quantizer"]) if report.get("naive") else None
    head = f"  {'':2} {'candidate':<28} {'recipe':<10} {'quantizer':<10} {'bpw':>6} {'CE(q)':>9} {'− best':>10} {'± SE':>9} {'z':>6}"
    lines = [f"What to ship at {report['budget']:g} bits per weight ({report['screen']['windows']} windows; "
             f"* chosen, = tied with the best at |z| <= {report['z']:g}, n naive):", head]
    opts = report["options"]
    shown = [o for i, o in enumerate(opts) if i < limit or (o["candidate"], o["quantizer"]) in (chosen, naive)]
    for o in shown:
        k = (o["candidate"], o["quantizer"])
        mark = ("*" if k == chosen else "=" if k in tied or o is opts[0] else " ") + ("n" if k == naive else " ")
        e, s, z = format_estimate(o["minus_best"], o["minus_best_se"], report["z"]) if o["minus_best_se"] else (
            "0", "", "")
        lines.append(f"  {mark} {o['candidate']:<28.28} {o['recipe']:<10} {o['quantizer']:<10} "
                     f"{o['bits_per_weight']:>6.3f} {o['ce_q']:>9.4f} {e:>10} {s:>9} {z:>6}")
    if len(opts) > len(shown):
        lines.append(f"  ... {len(opts) - len(shown)} more in ship.json")
    if report["dropped"]:
        lines.append(f"  {len(report['dropped'])} options dropped by the screen on {report['screen']['screen_windows']}"
                     " windows (beaten at z > 2; ship.json lists them)")
    return lines + answer_lines(report)


def answer_lines(report: dict) -> list[str]:
    """The decision in words: what was chosen, what the naive choice costs, whether the difference is resolved."""
    from quantdyn.results.stats import format_estimate

    a = report["artifact"]
    out = [f"ship: {a['name']} ({a['made']}) x {report['quantizer']}, {report['bits_per_weight']:.3f} bits per weight,"
           f" CE(q) {report['ce_q']:.4f} ± {report['ce_q_se']:.4f}; {len(report['tied'])} other option(s) tied with "
           "the best"]
    nv = report.get("naive")
    if nv and report.get("gain_se"):
        e, s, z = format_estimate(report["gain"], report["gain_se"], report["z"])
        verdict = "resolved" if report["gain_resolved"] else f"not resolved (|z| <= {report['z']:g})"
        out.append(f"naive choice: {nv['artifact']} x {nv['quantizer']} ({nv['bits_per_weight']:.3f} bpw), CE(q) "
                   f"{nv['ce_q']:.4f}: naive − chosen = {e} ± {s} nats (z = {z}), {verdict}")
    elif nv:
        out.append(f"naive choice: {nv['artifact']} x {nv['quantizer']} is the chosen option")
    st = report.get("chosen_plan_stability")
    if st:
        out.append(stability_line(st))
    out.append(f"export: {report['export']['path']} ({report['export']['format']}, sha256 "
               f"{report['export']['sha256'][:16]}…)")
    return out


def stability_line(st: dict) -> str:
    """How much the shipped plan moved between calibration draws, in one line (plan_stability's fields)."""
    changed = ", ".join(str(c) for c in st["changed_tensors"])
    kl = st.get("kl") or []
    spread = (f"its KL {statistics.fmean(kl):.3g} ± {st['kl_sd']:.2g} (sd over draws)" if st.get("kl_sd") is not None
              else "its KL spread unmeasured")
    floor = (f", against a bf16 noise floor of {st['floor_kl']:.3g}" if st.get("floor_kl") is not None else "")
    return (f"plan stability over {st['draws']} calibration draws: {changed} of {st['n_tensors']} tensors change type "
            f"from draw 0's plan; {spread}{floor}")
