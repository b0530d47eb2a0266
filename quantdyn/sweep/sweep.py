"""The trajectory sweep: every checkpoint of a trajectory × every quantizer
-> result rows with provenance, resumable and shardable.

    quantdyn sweep SPEC.yaml [--shard i/n]

Per checkpoint, the streamed engine (``quantdyn.engine.measure``) reads the weights one
decoder block at a time in the checkpoint's own dtype, quantizes with every
pending quantizer and carries the evaluation windows through the full-precision
and quantized blocks, the FP forward shared by all quantizers: memory is one
block plus activation streams, whatever the model's size. Calibration and
evaluation windows come from cached token shards, prepared once per tokenizer.
Each row's ``key`` = hash(checkpoint weights, quantizer config, calibration,
eval-data hash): a rerun skips finished rows, an interrupted sweep resumes
without duplicates or losses. Identical weights at several places of a trajectory (a cooldown experiment's
branch point is step 0 of the experiment and of every branch) are measured once: the other places get rows of
their own copied from that measurement (``measurement``, ``copy_of``). A checkpoint that cannot be read (missing shard,
truncated file, config that does not match the weights) is reported in one
line and skipped; the sweep goes on and names every such checkpoint at the end.
"""
from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from quantdyn.analysis.grid import grid_note
from quantdyn.config import config_hash, from_dict, to_dict
from quantdyn.data.prepare import DataConfig, TokenData, prepare_data
from quantdyn.engine.lazy_model import LazyModel
from quantdyn.engine.measure import MeasureConfig, measure
from quantdyn.engine.rows import (REPEAT_VARY, calibration_draws, floor_fields, grid_fields, ptq_fields, ptq_what,
                                  repeat_labels)
from quantdyn.engine.sensitivity import SensitivityConfig, check_quantizers_fit, measure_sensitivity
from quantdyn.errors import QuantdynError, unknown_name
from quantdyn.models.hf_io import checkpoint_hash, load_causal_lm
from quantdyn.progress import duration
from quantdyn.progress import progress as counted
from quantdyn.quantize.catalogue import parse_quantizer
from quantdyn.quantize.residual_rotation import check_rotations
from quantdyn.results.schema import ANALYSIS, FP, PTQ, QAT
from quantdyn.results.schema import calib_hash as calib_identity
from quantdyn.results.schema import row_key
from quantdyn.results.stats import mean_se
from quantdyn.results.store import ResultStore, StoreWriteError
from quantdyn.runs import run_root_of
from quantdyn.runtime import provenance, resolve_device
from quantdyn.sources.hub import evict_revision, open_checkpoint
from quantdyn.sources.trajectory import (
    Point,
    TrajectoryConfig,
    plan_points,
    preset_row_fields,
    require_available,
)
from quantdyn.sweep.accuracy import accuracy_rows_for_point, quantized_twin
from quantdyn.sweep.analysis_rows import AnalysisConfig, analysis_rows, check_analysis_names, predecessor_of
from quantdyn.sweep.allocate_one import sensitivity_rows
from quantdyn.train.config import load_run_config
from quantdyn.train.qat import QATConfig, QATDeployed

log = logging.getLogger("quantdyn")


@dataclass(frozen=True)
class SweepDataConfig:
    """Calibration and evaluation tokens."""

    source: str = ""
    """Data source; '' = the run's own data (for a run) or builtin:kjv."""
    tokenizer: str = ""
    """'' = the run's tokenizer, or the first checkpoint's own tokenizer for HF models."""
    calib_samples: int = 32
    """Calibration sequences (paper A used 1024 C4 documents)."""
    calib_seq_len: int = 128
    """Tokens per calibration sequence."""
    calib_seed: int = 0
    """Seed for drawing calibration windows."""
    eval_windows: int = 200
    """Held-out non-overlapping windows for the error."""
    eval_seq_len: int = 128
    """Tokens per evaluation window (paper A: 2048)."""

    def __post_init__(self):
        if self.calib_samples < 1:
            raise QuantdynError("sweep data.calib_samples must be >= 1 (the calibration set is empty)")
        if self.eval_windows < 1:
            raise QuantdynError("sweep data.eval_windows must be >= 1")


@dataclass(frozen=True)
class SweepConfig:
    """A sweep: trajectory × quantizers -> results store."""

    MOVED: ClassVar[dict[str, str]] = {k: f"engine.{k}" for k in (
        "batch_size", "calib_batch_size", "quantize_threads", "dtype", "max_memory", "spill_dir", "streams",
        "logits_budget_mb", "layer_diagnostics", "detailed_metrics")}
    """Engine settings a sweep file may still give at its top level (config.moved_keys)."""

    trajectory: TrajectoryConfig = field(default_factory=lambda: TrajectoryConfig(run="runs/tiny"))
    quantizers: tuple[str, ...] = ("gptq3", "gptq4", "rtn4")
    """Quantizer specs (gptq3, rtn4g64, awq4, or dicts of QuantConfig fields)."""
    data: SweepDataConfig = field(default_factory=SweepDataConfig)
    store: str = "results"
    """Results store directory."""
    device: str = "auto"
    """Compute device."""
    engine: MeasureConfig = field(default_factory=MeasureConfig)
    """How the engine batches, threads, types and budgets the measurement (engine/measure.py MeasureConfig: the
    same fields, passed down unchanged). Sweep files may still give them at the top level (``MOVED``)."""
    analysis: tuple[str, ...] = ()
    """Extra per-checkpoint metrics: hessian, outliers, propagation, curvature (sweep/analysis_rows.py)."""
    analysis_budget: AnalysisConfig = field(default_factory=AnalysisConfig)
    """Budgets of those metrics."""
    propagation_quantizers: tuple[str, ...] = ()
    """Quantizers for the propagation analysis ('' = the sweep's quantizers)."""
    eval_tasks: tuple[str, ...] = ()
    """lm-eval tasks for downstream accuracy (needs the eval extra), e.g. quantdyn_nextsent, arc_easy."""
    eval_limit: int = 0
    """Examples per task (0 = all)."""
    eval_fewshot: int = 0
    """Few-shot examples per prompt."""
    quant_repeats: int = 1
    """Quantize each checkpoint R times per quantizer (repeat r calibrated on its own draw, see repeat_vary): rows
    give the mean, the SD over repeats (delta_ce_run_sd) and the combined uncertainty (delta_ce_total_se), since
    re-quantizing moves Δ CE by more than the evaluation SE shows."""
    repeat_vary: str = "draw"
    """What differs between repeats: draw (calibration windows drawn with calib_seed + r) | order (the same windows
    in a permuted order: float summation order only) | both."""
    evict: bool = False
    """Hub trajectories: delete each revision's files from the Hugging Face cache once its rows are stored (the
    revision whose tokenizer the sweep uses is kept), so a long trajectory needs the disk of one or two
    revisions; a rerun skips stored rows before downloading anything."""
    eval_group: int = 8
    """Quantizers measured in one streamed pass over a checkpoint, sharing the FP forward (each adds one
    activation stream, not a model copy; more quantizers take several passes)."""
    noise_floor: bool | None = None
    """Measure each checkpoint's bf16 noise floor with its FP row (engine/noise_floor.py): the fp row stores it
    (floor_<field>), every ptq row says whether its Δ CE sits inside it. None (default): where the blocks compute in
    float32, where it costs one extra block pass; not where they compute in bf16/fp16 (a bf16 checkpoint on a GPU or
    a CPU with bf16 units), where its blocks run in float32 and cost more than the rest of the measurement
    (BENCHMARKS.md, "The floor"): true measures it there too."""
    sensitivity: tuple[str, ...] = ()
    """Candidate types of a per-tensor sensitivity pass at every checkpoint (engine/sensitivity.py), e.g. [q3_k,
    q4_k, q5_k, q6_k]: rows of kind sensitivity, one per tensor, tensor group and the whole model x type, on the
    calibration windows; the report maps them along training. () = none."""
    sensitivity_draws: int = 2
    """Labels drawn from the model per sequence in the sensitivity pass (each adds one backward pass)."""

    def __post_init__(self):
        if self.quant_repeats < 1:
            raise QuantdynError(f"sweep quant_repeats={self.quant_repeats} must be >= 1")
        if self.repeat_vary not in REPEAT_VARY:
            raise unknown_name("sweep repeat_vary", self.repeat_vary, REPEAT_VARY)
        if self.eval_group < 1:
            raise QuantdynError(f"sweep eval_group={self.eval_group} must be >= 1 (quantized copies held at once)")
        if self.sensitivity:
            from quantdyn.sweep.allocate_one import check_types

            object.__setattr__(self, "sensitivity", check_types(self.sensitivity))
        if self.sensitivity_draws < 1:
            raise QuantdynError(f"sweep sensitivity_draws={self.sensitivity_draws} must be >= 1")


def parse_shard(text: str | None) -> tuple[int, int]:
    """'i/n' -> (i, n); None -> from torchrun RANK/WORLD_SIZE or SLURM_ARRAY_TASK_ID/COUNT, else (0, 1)."""
    if text:
        try:
            i, n = (int(x) for x in text.split("/"))
        except ValueError:
            raise QuantdynError(f"--shard '{text}' must look like i/n, e.g. 0/4") from None
        if not (n >= 1 and 0 <= i < n):
            raise QuantdynError(f"--shard {text}: need 0 <= i < n")
        return i, n
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        return int(os.environ.get("RANK", 0)), int(os.environ["WORLD_SIZE"])
    if "SLURM_ARRAY_TASK_ID" in os.environ and "SLURM_ARRAY_TASK_COUNT" in os.environ:
        lo = int(os.environ.get("SLURM_ARRAY_TASK_MIN", 0))
        return int(os.environ["SLURM_ARRAY_TASK_ID"]) - lo, int(os.environ["SLURM_ARRAY_TASK_COUNT"])
    return 0, 1



def _run_data(points: list[Point]) -> DataConfig | None:
    """The data config of the quantdyn run the points come from (a run, or checkpoints of one), else None."""
    roots = {run_root_of(Path(p.ref)) for p in points if p.is_local}
    roots.discard(None)
    if not roots:
        return None
    configs = {config_hash(load_run_config(r).data): load_run_config(r).data for r in sorted(roots)}
    if len(configs) > 1:
        raise QuantdynError(f"the checkpoints come from {len(roots)} runs trained on different data; sweep them "
                            "separately, or set data.source and data.tokenizer to measure them all on the same tokens")
    return next(iter(configs.values()))


def sweep_data(cfg: SweepConfig, points: list[Point], progress: bool = True) -> TokenData:
    """The tokens a sweep measures on. Checkpoints of a quantdyn run are measured on their run's own data (its
    tokenizer and held-out split) whether the trajectory names the run or its checkpoint directories, so the same
    checkpoint gets the same rows either way; other models on ``data.source`` (default builtin:kjv) with their own
    tokenizer. ``data.source`` / ``data.tokenizer`` override either."""
    d = cfg.data
    base = load_run_config(Path(cfg.trajectory.run)).data if cfg.trajectory.run else _run_data(points)
    if base is not None:
        over = {k: v for k, v in (("source", d.source), ("tokenizer", d.tokenizer)) if v}
        dc = from_dict(DataConfig, {**to_dict(base), **over})
    else:
        tok = d.tokenizer or points[0].ref  # the model's own tokenizer (hub-id@revision or a directory)
        dc = DataConfig(source=d.source or "builtin:kjv", tokenizer=tok)
    return prepare_data(dc, progress=progress)


def point_fields(p: Point, ckpt_hash: str) -> dict:
    conf = p.meta.get("config") or {}
    qat = conf.get("qat") or None
    return {"run": p.run, "branch": p.branch, "ckpt_kind": p.kind, "checkpoint": p.ref, "checkpoint_hash": ckpt_hash,
            "step": p.step, "tokens": p.tokens, "lr": p.lr, "decaying": p.decaying,
            "peak_lr": p.meta.get("peak_lr"), "seed": p.meta.get("seed"),
            "parent_step": (p.meta.get("parent") or {}).get("from_step"),
            "optimizer": (conf.get("optim") or {}).get("name"),
            "weight_decay": (conf.get("optim") or {}).get("weight_decay"),
            "qat": (qat.get("format") or f"{qat['method']}-w{qat['w_bits']}a{qat.get('a_bits') or 0}") if qat else None,
            **preset_row_fields(p)}


def run_sweep(cfg: SweepConfig, shard: str | None = None, progress: bool = True,
              echo=None, verbose: bool = False) -> dict:
    """Run (or resume) a sweep; returns counts of rows written and skipped, and the checkpoints that failed.

    A checkpoint that cannot be read or measured (a QuantdynError: missing shard, truncated file, config
    that does not match the weights) is reported (``echo`` or the log) and skipped; the others go on. The
    caller decides what to do with ``failed`` (the CLI exits 2 after the sweep when it is not empty).
    ``verbose``: also a line per decoder block and one per checkpoint with its time (through ``echo``)."""

    # fail on a bad quantizer before any work; rows carry the spec as the user wrote it
    qcfgs = {(q if isinstance(q, str) else parse_quantizer(q).name): parse_quantizer(q) for q in cfg.quantizers}
    check_analysis_names(cfg.analysis)
    prop_q = {q: parse_quantizer(q) for q in (cfg.propagation_quantizers or [q for q in cfg.quantizers])}
    if "propagation" in cfg.analysis and not prop_q:
        raise QuantdynError("the propagation analysis needs quantizers: set quantizers or propagation_quantizers")
    mcfg = cfg.engine
    points = plan_points(cfg.trajectory)
    for label in qat_formats(points):  # a branch trained with a format's QAT is deployed with that same format
        if parse_quantizer(label) not in qcfgs.values():
            qcfgs[label] = parse_quantizer(label)
            (echo or log.info)(f"sweep: {label} added to the quantizers: checkpoints trained with its QAT (qat.format) "
                               "are deployed with it")
    _check_rotations(points, list(qcfgs.values()))
    say = echo or log.warning
    for name, reason in points.skipped:
        say(f"skipped revision {name}: {reason}")
    i, n = parse_shard(shard)
    mine = [p for k, p in enumerate(points) if k % n == i]
    note = echo or log.info  # progress lines, not warnings
    if progress:  # the plan, before the data is prepared or any weight is read (issue 50.5)
        note(plan_line(cfg, len(mine), "" if n == 1 else f" (shard {i}/{n} of {len(points)})"))
    device = resolve_device(cfg.device)
    store = ResultStore(cfg.store)
    data = sweep_data(cfg, points, progress)
    d = cfg.data
    ctx = _SweepContext(
        cfg=cfg, mcfg=mcfg, qcfgs=qcfgs, prop_q=prop_q, device=device, store=store, data=data,
        eval_ids=data.eval_windows(d.eval_seq_len, d.eval_windows),
        calib_draws=calibration_draws(data, d.calib_samples, d.calib_seq_len, d.calib_seed, cfg.quant_repeats,
                                      cfg.repeat_vary),
        eval_hash=data.token_hash("val", d.eval_seq_len, d.eval_windows),
        calib_hash=calib_identity(data.data_hash, d.calib_samples, d.calib_seq_len, d.calib_seed),
        done=store.keys(), acc_done=store.keys("sweep_acc_key") if cfg.eval_tasks else set(),
        block_echo=say if verbose else None, say=say,
        eta=_FirstETA(note, len(mine)) if progress else None,
    )
    written = skipped = 0
    timings: list[float] = []
    failed: list[tuple[str, str]] = []
    # offline, revisions that still need work must be cached: one line before any work (measured ones may be gone)
    require_available([p for p in mine if not p.is_local and not _point_done(ctx, p)])
    first = next((p for p in mine if p.is_local), None)
    if first is not None:  # a plan made for another model, an auto@ budget out of reach: one line before any work
        check_quantizers_fit(qcfgs, open_checkpoint(first.ref))
    keep = points[0].ref  # the tokenizer's revision: never evicted
    desc = "sweep" if n == 1 else f"sweep shard {i}/{n}"  # the --shard i/n spelling
    for p in counted(mine, desc=desc, enabled=progress, unit="ckpt"):
        t0 = time.perf_counter()
        try:
            w, s = _sweep_point(ctx, p)
        except StoreWriteError:  # a full disk: every later checkpoint would fail the same way
            raise
        except QuantdynError as e:
            failed.append((p.ref, str(e)))
            say(f"error: skipped checkpoint {p.ref}: {e}")
            continue
        written += w
        skipped += s
        if w:
            timings.append(time.perf_counter() - t0)
        if verbose:
            say(f"{p.ref}: {w} rows written, {s} already stored ({time.perf_counter() - t0:.1f}s)")
        if cfg.evict and p.kind in ("hub", "soup") and "@" in p.ref and not p.is_local and p.ref != keep:
            repo, _, rev = p.ref.partition("@")
            evict_revision(repo, rev)
    return {"written": written, "skipped": skipped, "checkpoints": len(mine), "seconds": timings, "failed": failed}


def qat_formats(points: list[Point]) -> list[str]:
    """The formats the points' runs were trained with by format QAT (qat.format), in order of appearance: each is
    deployed (and so measured, on every point, for the comparison) with that same quantizer."""
    out: list[str] = []
    for p in points:
        label = ((p.meta.get("config") or {}).get("qat") or {}).get("format")
        if label and label not in out:
            out.append(label)
    return out


def plan_line(cfg: SweepConfig, checkpoints: int, shard: str = "") -> str:
    """What a sweep is about to do, in one line: checkpoints x quantizers and where the rows go."""
    q = cfg.quantizers
    labels = ", ".join(x if isinstance(x, str) else parse_quantizer(x).name for x in q)
    return (f"sweep: {checkpoints} checkpoint{'s' if checkpoints != 1 else ''}{shard} x {len(q)} "
            f"quantizer{'s' if len(q) != 1 else ''} ({labels})"
            + (f", each quantized {cfg.quant_repeats} times" if cfg.quant_repeats > 1 else "")
            + f" -> store {cfg.store} (rows already there are skipped)")


class _FirstETA:
    """One line, once the first block of the first measured checkpoint is done: how long a checkpoint and the
    sweep will take at that pace (before the first checkpoint ends: on a 135M model on a CPU, minutes)."""

    def __init__(self, say, checkpoints: int):
        self.say, self.checkpoints, self.done, self.t0, self.passes = say, checkpoints, False, 0.0, 1

    def start(self, passes: int) -> None:
        if not self.done:
            self.t0, self.passes = time.perf_counter(), passes

    def block(self, line: str) -> None:
        m = re.match(r"block (\d+)/(\d+)", line)
        if self.done or m is None:
            return
        self.done = True
        b, n = int(m.group(1)), int(m.group(2))  # blocks done, of n
        per = (time.perf_counter() - self.t0) / min(b, n) * n * self.passes
        self.say(f"sweep: the first block took {duration(per / n / self.passes)}: about {duration(per)} per "
                 f"checkpoint, {duration(per * self.checkpoints)} for {self.checkpoints} (rows already stored "
                 "take none)")


def _check_rotations(points, qcfgs) -> None:
    """A rotation the model cannot take (+had on a width without a Hadamard matrix, +r1 on a LayerNorm model) is one
    line before any work: checked on the first local checkpoint's skeleton (the others share its architecture;
    a hub checkpoint not yet downloaded is checked when it is measured)."""
    if not any(q.hadamard or q.r1 for q in qcfgs):
        return
    first = next((p for p in points if p.is_local), None)
    if first is not None:
        check_rotations(LazyModel(open_checkpoint(first.ref)).model, qcfgs)


@dataclass
class _SweepContext:
    cfg: SweepConfig
    mcfg: MeasureConfig
    qcfgs: dict
    prop_q: dict
    device: torch.device
    store: ResultStore
    data: TokenData
    eval_ids: torch.Tensor
    calib_draws: list[torch.Tensor]
    eval_hash: str
    calib_hash: str
    done: set
    acc_done: set
    block_echo: Any = None
    eta: _FirstETA | None = None
    """The first ETA line (None: no progress output)."""
    say: Any = None
    """Where lines the user must see go (the sweep's echo, or the log's warnings)."""
    stored_floors: dict | None = None
    """fp row key -> its floor fields, read from the store once when first needed."""
    measured: dict | None = None
    """measurement id -> the stored row that holds it (read from the store once when first needed, then kept up to
    date): identical weights at several places of a trajectory are measured once (:func:`_copies`)."""
    hashes: dict = field(default_factory=dict)
    """checkpoint reference -> its weights' hash (hashing reads every weight file: once per reference)."""
    predecessors: dict = field(default_factory=dict)
    """checkpoint reference -> (the checkpoint it was trained from or None, why not): read once per reference."""


def _stored_floor(ctx: _SweepContext, fp_key: str) -> dict:
    """The noise floor an fp row already stored carries ({} when it has none: written before the floor)."""
    if ctx.stored_floors is None:
        ctx.stored_floors = {r["key"]: {k: v for k, v in r.items() if k.startswith("floor_")}
                             for r in ctx.store.rows() if FP.matches(r)}
    return ctx.stored_floors.get(fp_key, {})


def _measured(ctx: _SweepContext) -> dict:
    """measurement id -> the first stored row measured with it (rows written before ``measurement`` have none)."""
    if ctx.measured is None:
        ctx.measured = {}
        for r in ctx.store.rows():
            if r.get("measurement") and not r.get("copy_of"):
                ctx.measured.setdefault(r["measurement"], r)
    return ctx.measured


def _copies(ctx: _SweepContext, pending: dict[str, str], base: dict) -> list[dict]:
    """The rows of ``pending`` ({row key: measurement id}) whose measurement is stored already at another point
    with the same weights: that row's numbers and provenance, with this point's place in the trajectory (``base``)
    and key, and ``copy_of`` naming the measured row. The branch point of a cooldown experiment is step 0 of the
    experiment and of every branch: one checkpoint hash, measured once, a row at each place (the per-branch rows
    the decay table, the figures and a resume read stay where they were)."""
    have = _measured(ctx)
    return [{**have[mid], **base, "key": key, "measurement": mid, "copy_of": have[mid]["key"]}
            for key, mid in pending.items() if mid in have]


def _note_measured(ctx: _SweepContext, rows: list[dict]) -> None:
    for r in rows:
        if r.get("measurement") and not r.get("copy_of"):
            _measured(ctx).setdefault(r["measurement"], r)


def _point_done(ctx: _SweepContext, p: Point) -> bool:
    """Whether every row of ``p`` is stored already (hub points are hashed by reference: nothing is read)."""
    return _point_keys(ctx, p)[-1]


def _point_keys(ctx: _SweepContext, p: Point):
    cfg = ctx.cfg
    # the weights' hash, qualified by the point's place in the trajectory: a cooldown branch can end
    # with weights identical to its parent's own decayed endpoint, and both points belong in the plots
    h = ctx.hashes.get(p.ref) or ctx.hashes.setdefault(p.ref, checkpoint_hash(p.ref))
    hp = f"{h}:{p.run}:{p.branch}:{p.step}"
    base = {**point_fields(p, h), "eval_hash": ctx.eval_hash, "calib_hash": ctx.calib_hash,
            "data_key": ctx.data.data_hash}
    mids: dict[str, str] = {}  # row key -> measurement id: the same ``what`` on the weights alone (no place)

    def key(what: str) -> str:
        k = row_key(hp, what, ctx.eval_hash)
        mids[k] = row_key(h, what, ctx.eval_hash)
        return k

    fp_key = key("fp")
    q_keys = {label: key(ptq_what(qc, ctx.calib_hash, cfg.quant_repeats, cfg.repeat_vary))
              for label, qc in ctx.qcfgs.items()}
    qat_cfg = (p.meta.get("config") or {}).get("qat")
    if qat_cfg and qat_cfg.get("format"):  # format QAT is deployed by its format's quantizer: ptq rows (qat_formats)
        qat_cfg = None
    qat_key = key(f"qat:{config_hash(qat_cfg)}") if qat_cfg else None
    prop_hash = config_hash({k: to_dict(v) for k, v in sorted(ctx.prop_q.items())})
    a_keys = {a: key(f"analysis:{a}:{config_hash(cfg.analysis_budget)}"
                     + (f":{prop_hash}" if a == "propagation" else "")
                     + (f":{_predecessor_hash(ctx, p)}" if a == "curvature" else ""))
              for a in cfg.analysis}
    # accuracy rows of one (point, quantizer) are appended together and carry this key, so a sweep that
    # died between a PTQ row and its accuracy rows re-quantizes that point on rerun and adds only them
    acc_keys = {label: row_key(hp, f"acc:{config_hash(qc)}:{ctx.calib_hash}:{','.join(cfg.eval_tasks)}:"
                                   f"{cfg.eval_fewshot}:{cfg.eval_limit}", ctx.eval_hash)
                for label, qc in ctx.qcfgs.items()} if cfg.eval_tasks else {}
    sens_key = row_key(hp, f"sens:{','.join(cfg.sensitivity)}:{ctx.calib_hash}:{cfg.sensitivity_draws}",
                       ctx.eval_hash) if cfg.sensitivity else None
    todo = [fp_key, *q_keys.values(), *a_keys.values(), *([qat_key] if qat_key else []), *([sens_key] if sens_key else [])]
    done = all(k in ctx.done for k in todo) and all(k in ctx.acc_done for k in acc_keys.values())
    return h, base, fp_key, q_keys, qat_cfg, qat_key, a_keys, acc_keys, sens_key, todo, mids, done


def _predecessor(ctx: _SweepContext, p: Point) -> tuple:
    """(the checkpoint ``p`` was trained from or None, why not), as analysis_rows.predecessor_of says, once per point."""
    if p.ref not in ctx.predecessors:
        ctx.predecessors[p.ref] = predecessor_of(p.ref)  # a reference that is no local directory has none
    return ctx.predecessors[p.ref]


def _predecessor_hash(ctx: _SweepContext, p: Point) -> str:
    """The weights' hash of the checkpoint ``p`` was trained from ('none' without one): the curvature along the
    update is a measurement of the pair, so identical weights reached from other weights are measured again."""
    prev, _ = _predecessor(ctx, p)
    if prev is None:
        return "none"
    return ctx.hashes.get(str(prev)) or ctx.hashes.setdefault(str(prev), checkpoint_hash(str(prev)))


def _sweep_point(ctx: _SweepContext, p: Point) -> tuple[int, int]:
    """Measure one checkpoint: the rows it still lacks. Returns (written, skipped)."""
    cfg = ctx.cfg
    h, base, fp_key, q_keys, qat_cfg, qat_key, a_keys, acc_keys, sens_key, todo, mids, done = _point_keys(ctx, p)
    if done:
        return 0, len(todo)
    written = skipped = 0
    # what these weights already gave at another point (the branch point as each branch's step 0): copied, not
    # measured again; accuracy rows are measured per point (a copy carries no lm-eval rows)
    copies = _copies(ctx, {k: mids[k] for k in todo if k not in ctx.done and k != sens_key
                           and not (k in q_keys.values() and acc_keys)}, base)
    if copies:
        written += len(ctx.store.append_new(copies))
        ctx.done |= {r["key"] for r in copies}
        if all(k in ctx.done for k in todo) and all(k in ctx.acc_done for k in acc_keys.values()):
            return written, len(todo) - len(copies)
    skipped = -len(copies)  # a copied key is counted below as already done: it was written
    t0 = time.perf_counter()
    weights = open_checkpoint(p.ref)  # validates every file and shape before anything is computed
    t_load = time.perf_counter() - t0
    pending = [label for label, key in q_keys.items()
               if key not in ctx.done or (label in acc_keys and acc_keys[label] not in ctx.acc_done)]
    skipped += len(q_keys) - len(pending)
    qat_pending = bool(qat_key and qat_key not in ctx.done)
    skipped += bool(qat_key) and not qat_pending
    fp_pending = fp_key not in ctx.done
    skipped += not fp_pending
    groups = [pending[g : g + cfg.eval_group] for g in range(0, len(pending), cfg.eval_group)] or [[]]
    floor = None if fp_pending else _stored_floor(ctx, fp_key)  # the floor fields the ptq rows are read against
    for g, group in enumerate(groups):
        variants: dict = {}
        calib: dict = {}
        for label in group:
            for r, vlabel in enumerate(repeat_labels(label, cfg.quant_repeats)):
                variants[vlabel] = ctx.qcfgs[label]
                calib[vlabel] = ctx.calib_draws[r]
        if g == 0 and qat_pending:
            variants["__qat__"] = QATDeployed(from_dict(QATConfig, qat_cfg))
        if not variants and not (g == 0 and fp_pending):
            continue
        collect = {label: {} for label in group if label in acc_keys and acc_keys[label] not in ctx.acc_done}
        on_layer = (lambda label, full, res, m: collect[label].__setitem__(full, m.weight.detach().cpu().clone())
                    if label in collect else None) if collect else None
        if ctx.eta is not None:
            ctx.eta.start(len(groups))
        m = measure(weights, variants, ctx.eval_ids, calib, device=ctx.device, cfg=ctx.mcfg, on_layer=on_layer,
                    on_block=_on_block(ctx, f"{p.ref}: pass {g + 1}/{len(groups)} "),
                    noise_floor=cfg.noise_floor if g == 0 and fp_pending else False)
        if g == 0 and fp_pending:
            floor = floor_fields(m.noise_floor)
        grid = grid_fields(m)
        if g == 0 and grid["weight_grid"] and ctx.say is not None:
            ctx.say(f"{p.ref}: {grid_note(grid['weight_grid_levels'], grid['weight_grid'])}")
        base["n_params"] = m.n_params
        rows = []
        if g == 0 and fp_pending:
            fp_ce = m.fp_window_ce
            rows.append({"key": fp_key, "kind": FP.name, **base, "measurement": mids[fp_key], "ce_fp": float(fp_ce.mean()),
                         "ce_fp_se": mean_se(fp_ce)[1],
                         "n_windows": len(fp_ce), "compute_dtype": m.dtype, **grid, **floor,
                         **provenance()})
        if "__qat__" in variants:
            tr = variants["__qat__"]
            qc = tr.cfg
            rows.append({"key": qat_key, "kind": QAT.name, **base, "measurement": mids[qat_key], "quantizer": tr.name,
                         "method": f"qat-{qc.method}",
                         "bits": qc.w_bits, "a_bits": qc.a_bits or 0, "quant_config": to_dict(qc),
                         **m.metrics["__qat__"], "t_load": t_load, "compute_dtype": m.dtype, **provenance()})
        threads = cfg.engine.quantize_threads if ctx.device.type == "cpu" else 0
        for label in group:
            if q_keys[label] not in ctx.done:
                rows.append({"key": q_keys[label], "kind": PTQ.name, **base, "measurement": mids[q_keys[label]],
                             **ptq_fields(label, ctx.qcfgs[label], m, ctx.mcfg, threads, cfg.quant_repeats,
                                          cfg.repeat_vary, floor), "t_load": t_load,
                             **provenance()})
            else:
                skipped += 1
        written += len(ctx.store.append_new(rows))
        _note_measured(ctx, rows)
        for label, weights_q in collect.items():
            written += _append_accuracy(ctx, p, label, weights_q, acc_keys[label], base)
    if sens_key is not None:
        if sens_key in ctx.done:
            skipped += 1
        else:
            written += _append_sensitivity(ctx, weights, sens_key, f"{h}:{p.run}:{p.branch}:{p.step}", base)
    for name, key in a_keys.items():
        if key in ctx.done:
            skipped += 1
            continue
        vals = analysis_rows(name, weights, ctx.data, ctx.calib_draws[0], ctx.eval_ids, ctx.prop_q, cfg.analysis_budget,
                             device=ctx.device, mcfg=ctx.mcfg,
                             previous=_predecessor(ctx, p) if name == "curvature" else None)
        if name == "curvature" and vals["curvature_from_step"] is not None:
            vals["curvature_from_hash"] = _predecessor_hash(ctx, p)
        rows = [{"key": key, "kind": ANALYSIS.name, "analysis": name, **base, "measurement": mids[key], **vals,
                 **provenance()}]
        written += len(ctx.store.append_new(rows))
        _note_measured(ctx, rows)
    return written, skipped


def _on_block(ctx: _SweepContext, prefix: str):
    """The engine's per-block callback: the verbose line, and the first ETA."""
    echo, eta = ctx.block_echo, ctx.eta if ctx.eta is not None and not ctx.eta.done else None
    if echo is None and eta is None:
        return None

    def on_block(line: str) -> None:
        if eta is not None:
            eta.block(line)
        if echo is not None:
            echo(prefix + line)
    return on_block


def _append_sensitivity(ctx: _SweepContext, weights, sens_key: str, point: str, base: dict) -> int:
    """The sensitivity rows of one checkpoint (engine/sensitivity.py) on the calibration windows, appended together;
    the marker row (scope ``model``, first type) carries ``sens_key`` so that a rerun skips the checkpoint."""
    cfg = ctx.cfg
    sens = measure_sensitivity(weights, cfg.sensitivity, ctx.calib_draws[0], device=ctx.device,
                               cfg=SensitivityConfig(draws=cfg.sensitivity_draws))
    rows = sensitivity_rows(sens, point, ctx.calib_hash, {**base, **provenance()})
    marker = next(r for r in rows if r["scope"] == "model")
    marker["key"] = sens_key
    return len(ctx.store.append_new(rows))


def _append_accuracy(ctx: _SweepContext, p: Point, label: str, weights_q: dict, acc_key: str, base: dict) -> int:
    """lm-eval accuracy rows of one (checkpoint, quantizer), appended together and marked with ``acc_key``.

    lm-eval runs whole models: the FP model is loaded in memory and its quantized twin is that model with
    the engine's quantized weights written in (the quantization itself ran once, in the measurement)."""

    cfg = ctx.cfg
    model = load_causal_lm(p.ref, device=ctx.device)
    qmodel = quantized_twin(model, weights_q)
    acc = accuracy_rows_for_point(model, {label: qmodel}, list(cfg.eval_tasks), tokenizer=ctx.data.tokenizer,
                                  quant_configs={label: ctx.qcfgs[label]}, base=base, data=ctx.data,
                                  calib_hash=ctx.calib_hash, limit=cfg.eval_limit or None,
                                  num_fewshot=cfg.eval_fewshot)
    tagged = [{**r, "sweep_acc_key": acc_key} for r in acc]
    new_rows = ctx.store.append_new(tagged)
    if not new_rows:
        # every row is stored already (an older sweep, `quantdyn eval`): write them again only to record the
        # marker, so a rerun does not recompute them; readers keep the first occurrence of a key
        ctx.store.append(tagged, skip_stored=False)
    return len(new_rows)
