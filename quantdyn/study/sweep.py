"""The trajectory sweep: every checkpoint of a trajectory × every quantizer
-> result rows with provenance, resumable and shardable.

    quantdyn sweep SPEC.yaml [--shard i/n]

Per checkpoint the model is loaded once and its full-precision per-window CE
computed once (and cached on disk), then each quantizer runs on a copy.
Calibration and evaluation windows come from cached token shards, prepared
once per tokenizer.  Each row's ``key`` = hash(checkpoint weights, quantizer
config, eval-data hash): a rerun skips finished rows, an interrupted sweep
resumes without duplicates or losses.
"""
from __future__ import annotations

import copy
import hashlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from quantdyn.config import config_hash, from_dict, to_dict
from quantdyn.data.prepare import DataConfig, TokenData, prepare_data
from quantdyn.errors import QuantdynError
from quantdyn.results.store import ResultStore
from quantdyn.runtime import provenance, resolve_device
from quantdyn.study.metrics_rows import AnalysisConfig, analysis_rows, check_analysis_names
from quantdyn.study.trajectory import Point, TrajectoryConfig, checkpoint_hash, plan_points


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

    trajectory: TrajectoryConfig = field(default_factory=lambda: TrajectoryConfig(run="runs/tiny"))
    quantizers: tuple[str, ...] = ("gptq3", "gptq4", "rtn4")
    """Quantizer specs (gptq3, rtn4g64, awq4, or dicts of QuantConfig fields)."""
    data: SweepDataConfig = field(default_factory=SweepDataConfig)
    store: str = "results"
    """Results store directory."""
    device: str = "auto"
    """Compute device."""
    batch_size: int = 16
    """Evaluation batch size."""
    quantize_threads: int = 1
    """torch threads while quantizing on CPU: 1 (default) makes the codes independent of the machine's thread
    count (BLAS rounds differently with more threads); 0 = torch's setting, ~1.75x faster for a whole model
    on an idle 2-core CPU (BENCHMARKS.md). The GPTQ column loop itself always runs single-threaded."""
    analysis: tuple[str, ...] = ()
    """Extra per-checkpoint metrics: hessian, outliers, propagation."""
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
    eval_group: int = 8
    """Quantized copies of a checkpoint evaluated together, sharing one FP forward per batch (each copy
    holds the model's weights in memory; 1 = one at a time)."""

    def __post_init__(self):
        if self.eval_group < 1:
            raise QuantdynError(f"sweep eval_group={self.eval_group} must be >= 1 (quantized copies held at once)")


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


def sweep_data(cfg: SweepConfig, points: list[Point], progress: bool = True) -> TokenData:
    d = cfg.data
    if cfg.trajectory.run:
        from quantdyn.train.branches import load_run_config

        base = load_run_config(Path(cfg.trajectory.run)).data
        over = {k: v for k, v in (("source", d.source), ("tokenizer", d.tokenizer)) if v}
        dc = from_dict(DataConfig, {**to_dict(base), **over})
    else:
        tok = d.tokenizer or points[0].ref  # the model's own tokenizer (hub-id@revision or a directory)
        dc = DataConfig(source=d.source or "builtin:kjv", tokenizer=tok)
    return prepare_data(dc, progress=progress)


def row_key(ckpt_hash: str, what: str, eval_hash: str) -> str:
    return hashlib.sha256(f"{ckpt_hash}|{what}|{eval_hash}".encode()).hexdigest()[:24]


def point_fields(p: Point, ckpt_hash: str) -> dict:
    conf = p.meta.get("config") or {}
    qat = conf.get("qat") or None
    return {"run": p.run, "branch": p.branch, "ckpt_kind": p.kind, "checkpoint": p.ref, "checkpoint_hash": ckpt_hash,
            "step": p.step, "tokens": p.tokens, "lr": p.lr, "decaying": p.decaying,
            "peak_lr": p.meta.get("peak_lr"), "seed": p.meta.get("seed"),
            "parent_step": (p.meta.get("parent") or {}).get("from_step"),
            "optimizer": (conf.get("optim") or {}).get("name"),
            "weight_decay": (conf.get("optim") or {}).get("weight_decay"),
            "qat": f"{qat['method']}-w{qat['w_bits']}a{qat.get('a_bits') or 0}" if qat else None}


def n_params_of(model) -> int:
    """Non-embedding parameter count (the N of scaling laws)."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is None and hasattr(model, "gpt_neox"):
        emb = model.gpt_neox.embed_in
    total = sum(p.numel() for p in model.parameters())
    return total - (emb.weight.numel() if emb is not None else 0)


def _load(ref: str, device):
    from quantdyn.models.hf_io import load_causal_lm

    return load_causal_lm(ref, device=device)


def run_sweep(cfg: SweepConfig, shard: str | None = None, progress: bool = True) -> dict:
    """Run (or resume) a sweep; returns counts of rows written and skipped."""
    from tqdm import tqdm

    from quantdyn.quantize.config import parse_quantizer

    # fail on a bad quantizer before any work; rows carry the spec as the user wrote it
    qcfgs = {(q if isinstance(q, str) else parse_quantizer(q).name): parse_quantizer(q) for q in cfg.quantizers}
    check_analysis_names(cfg.analysis)
    prop_q = {q: parse_quantizer(q) for q in (cfg.propagation_quantizers or [q for q in cfg.quantizers])}
    if "propagation" in cfg.analysis and not prop_q:
        raise QuantdynError("the propagation analysis needs quantizers: set quantizers or propagation_quantizers")
    prop_hash = config_hash({k: to_dict(v) for k, v in sorted(prop_q.items())})
    points = plan_points(cfg.trajectory)
    i, n = parse_shard(shard)
    device = resolve_device(cfg.device)
    store = ResultStore(cfg.store)
    data = sweep_data(cfg, points, progress)
    d = cfg.data
    eval_ids = data.eval_windows(d.eval_seq_len, d.eval_windows)
    calib_ids = data.calib_windows(d.calib_samples, d.calib_seq_len, d.calib_seed)
    eval_hash = data.token_hash("val", d.eval_seq_len, d.eval_windows)
    calib_hash = hashlib.sha1(f"{data.data_hash}:{d.calib_samples}:{d.calib_seq_len}:{d.calib_seed}".encode()).hexdigest()[:12]
    done = store.keys()
    acc_done = store.keys("sweep_acc_key") if cfg.eval_tasks else set()  # a second read of the store only if needed
    written = skipped = 0
    timings = []
    mine = [p for k, p in enumerate(points) if k % n == i]
    bar = tqdm(mine, desc=f"sweep {i}/{n}", disable=not progress, unit="ckpt")
    for p in bar:
        t0 = time.perf_counter()
        # the weights' hash, qualified by the point's place in the trajectory: a cooldown branch can end
        # with weights identical to its parent's own decayed endpoint, and both points belong in the plots
        h = checkpoint_hash(p.ref)
        hp = f"{h}:{p.run}:{p.branch}:{p.step}"
        base = {**point_fields(p, h), "eval_hash": eval_hash, "calib_hash": calib_hash, "data_key": data.data_hash}
        fp_key = row_key(hp, "fp", eval_hash)
        q_keys = {label: row_key(hp, f"ptq:{config_hash(qc)}:{calib_hash}", eval_hash) for label, qc in qcfgs.items()}
        qat_cfg = (p.meta.get("config") or {}).get("qat")
        qat_key = row_key(hp, f"qat:{config_hash(qat_cfg)}", eval_hash) if qat_cfg else None
        a_keys = {a: row_key(hp, f"analysis:{a}:{config_hash(cfg.analysis_budget)}"
                             + (f":{prop_hash}" if a == "propagation" else ""), eval_hash) for a in cfg.analysis}
        # accuracy rows of one (point, quantizer) are appended together and carry this key, so a sweep that
        # died between a PTQ row and its accuracy rows re-quantizes that point on rerun and adds only them
        acc_keys = {label: row_key(hp, f"acc:{config_hash(qc)}:{calib_hash}:{','.join(cfg.eval_tasks)}:"
                                       f"{cfg.eval_fewshot}:{cfg.eval_limit}", eval_hash)
                    for label, qc in qcfgs.items()} if cfg.eval_tasks else {}
        todo = [fp_key, *q_keys.values(), *a_keys.values(), *([qat_key] if qat_key else [])]
        if all(k in done for k in todo) and all(k in acc_done for k in acc_keys.values()):
            skipped += len(todo)
            continue
        model = _load(p.ref, device)
        t_load = time.perf_counter() - t0
        base["n_params"] = n_params_of(model)
        fp_ce = _fp_window_ce(model, eval_ids, h, eval_hash, cfg.batch_size)
        if fp_key not in done:
            from quantdyn.evaluate.quant_error import _se

            store.append([{"key": fp_key, "kind": "fp", **base, "ce_fp": float(fp_ce.mean()), "ce_fp_se": _se(fp_ce),
                           "n_windows": len(fp_ce), **provenance()}])
            written += 1
        else:
            skipped += 1
        if qat_key and qat_key not in done:
            store.append([{"key": qat_key, "kind": "qat", **base, **qat_measure(model, qat_cfg, eval_ids, fp_ce, cfg),
                           "t_load": t_load, **provenance()}])
            written += 1
        elif qat_key:
            skipped += 1
        pending = [label for label, key in q_keys.items()
                   if key not in done or (label in acc_keys and acc_keys[label] not in acc_done)]
        skipped += len(q_keys) - len(pending)
        for g in range(0, len(pending), cfg.eval_group):
            group = pending[g : g + cfg.eval_group]
            rows = quantize_and_measure_many(model, {label: qcfgs[label] for label in group}, calib_ids, eval_ids,
                                             fp_ce, cfg, device)
            for label, (row, qmodel) in rows.items():
                if q_keys[label] not in done:
                    store.append([{"key": q_keys[label], "kind": "ptq", **base, **row, "t_load": t_load,
                                   **provenance()}])
                    written += 1
                else:
                    skipped += 1
                if label in acc_keys and acc_keys[label] not in acc_done:
                    written += _append_accuracy(store, model, label, qmodel, qcfgs[label], acc_keys[label], cfg,
                                                data, base, calib_hash)
            del rows
        for name, key in a_keys.items():
            if key in done:
                skipped += 1
                continue
            vals = analysis_rows(name, model, data, calib_ids, eval_ids, prop_q, cfg.analysis_budget)
            store.append([{"key": key, "kind": "analysis", "analysis": name, **base, **vals, **provenance()}])
            written += 1
        timings.append(time.perf_counter() - t0)
        del model
    return {"written": written, "skipped": skipped, "checkpoints": len(mine), "seconds": timings}


def _fp_window_ce(model, eval_ids, ckpt_hash: str, eval_hash: str, batch_size: int) -> torch.Tensor:
    """Per-window FP CE, cached on disk per (checkpoint, eval set)."""
    from quantdyn.data.prepare import default_cache_dir
    from quantdyn.evaluate.loss import window_losses

    cache = default_cache_dir().parent / "fp" / f"{ckpt_hash}-{eval_hash}.pt"
    if cache.is_file():
        try:
            return torch.load(cache, weights_only=True)
        except Exception:  # a corrupt cache entry is recomputed
            cache.unlink(missing_ok=True)
    ce = window_losses(model, eval_ids, batch_size)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".tmp{os.getpid()}")
    torch.save(ce, tmp)
    os.replace(tmp, cache)
    return ce


def _append_accuracy(store, model, label, qmodel, qc, acc_key, cfg: SweepConfig, data, base, calib_hash) -> int:
    """lm-eval accuracy rows of one (checkpoint, quantizer), appended together and marked with ``acc_key``."""
    from quantdyn.evaluate.downstream import accuracy_rows_for_point

    acc = accuracy_rows_for_point(model, {label: qmodel}, list(cfg.eval_tasks), tokenizer=data.tokenizer,
                                  quant_configs={label: qc}, base=base, data=data, calib_hash=calib_hash,
                                  limit=cfg.eval_limit or None, num_fewshot=cfg.eval_fewshot)
    done_now = store.keys()
    tagged = [{**r, "sweep_acc_key": acc_key} for r in acc]
    new_rows = [r for r in tagged if r["key"] not in done_now]
    # rows stored earlier under the same keys (an older sweep, `quantdyn eval`) are written again only to
    # record the marker; readers keep the first occurrence of a key
    store.append(new_rows or tagged)
    return len(new_rows)


def quantize_and_measure_many(model, qcs: dict, calib_ids, eval_ids, fp_ce, cfg: SweepConfig, device) -> dict:
    """Quantize one copy of ``model`` per config and measure them together (one FP forward per batch).

    Returns {label: (row, quantized model)}; ``t_eval`` is the shared evaluation time divided evenly."""
    from quantdyn.evaluate.quant_error import compare_many
    from quantdyn.quantize.apply import num_threads, quantize_model

    qmodels, results, t_q = {}, {}, {}
    threads = cfg.quantize_threads if device.type == "cpu" else torch.get_num_threads()
    for label, qc in qcs.items():
        qmodels[label] = copy.deepcopy(model)
        t0 = time.perf_counter()
        with num_threads(threads):
            results[label] = quantize_model(qmodels[label], calib_ids, qc, device=device, progress=False)
        t_q[label] = time.perf_counter() - t0
    t0 = time.perf_counter()
    metrics = compare_many(model, qmodels, eval_ids, fp_window_ce=fp_ce, batch_size=cfg.batch_size)
    t_e = (time.perf_counter() - t0) / len(qcs)
    out = {}
    for label, qc in qcs.items():
        layer_losses = [r.get("loss") for r in getattr(results[label], "rows", []) if r.get("loss") is not None]
        row = {
            "quantizer": label,
            "method": qc.method,
            "bits": qc.bits,
            "group_size": qc.group_size,
            "quant_config": to_dict(qc),
            "quant_config_hash": config_hash(qc),
            **metrics[label],
            "layer_loss_sum": float(sum(layer_losses)) if layer_losses else None,
            "t_quantize": t_q[label],
            "t_eval": t_e,
            "eval_group": len(qcs),
        }
        out[label] = (row, qmodels[label])
    return out


def qat_measure(model, qat_cfg: dict, eval_ids, fp_ce, cfg: SweepConfig) -> dict:
    """A QAT checkpoint in its deployed (W+A fake-quantized) form against its own FP weights."""
    from quantdyn.evaluate.quant_error import compare_models
    from quantdyn.quantize.qat import QATConfig, fake_quant_forward

    qc = from_dict(QATConfig, qat_cfg)
    q = copy.deepcopy(model)
    with fake_quant_forward(q, qc):
        m = compare_models(model, q, eval_ids, fp_window_ce=fp_ce, batch_size=cfg.batch_size)
    label = f"qat-{qc.method}-w{qc.w_bits}a{qc.a_bits or 0}"
    return {"quantizer": label, "method": f"qat-{qc.method}", "bits": qc.w_bits, "a_bits": qc.a_bits or 0,
            "quant_config": to_dict(qc), **m}
