"""The measurement engine: quantize a checkpoint with several quantizers and compare each
with full precision, streamed one decoder block at a time.

    m = measure("runs/tiny/checkpoints/step-0001000", ["gptq3", "rtn4"], eval_windows, calib_ids, device="cuda")
    m.metrics["gptq3"]["delta_ce"], m.fp_window_ce

This is the only place where "quantize, then compare with FP" happens: sweeps, `quantize`,
`interpolate`, the monitor and `analyze` call it. The work is a block walk
(``engine/walk.py``: every quantizer's blocks and the shared full-precision blocks
carry the evaluation windows through the model) followed by the head: the final norm and
head turn each variant's last hidden states into logits one slice of windows at a time, with
the full-precision logits shared by all quantizers, and give the CE, KL both ways, top-K
agreement, the correct token's Δp and log-probability (``evaluate/quant_error.py``). Logits of
the variants are never held at once and never written: a batch whose logits would exceed
``logits_budget`` is split by windows, and what is kept is a few floats per token. The walk
also compares every variant's hidden states with FP's after every block (per-block error
maps), and ``noise_floor=True`` adds the bf16 noise floor as one more variant
(``engine/noise_floor.py``).

The model is a checkpoint reference (local directory, sharded safetensors, hub
``ID@REVISION``) read lazily in its own dtype, or a model already in memory (left
untouched). On ``device="cuda"`` only one block at a time is onloaded; the model never
has to fit on the GPU.
"""
from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch
import torch.nn as nn

from quantdyn.analysis.propagation import block_sums, finalize_propagation, input_sums
from quantdyn.config import shared_fields
from quantdyn.engine.blockwise import block_output
from quantdyn.engine.lazy_model import BlockSource, block_source, compute_dtype_of
from quantdyn.engine.noise_floor import NOISE_FLOOR_LABEL, BF16NoiseFloor, floor_rounding
from quantdyn.engine.sensitivity import allocate_auto, check_quantizers_fit
from quantdyn.engine.streams import fmt_bytes, parse_bytes, trim_heap
from quantdyn.engine.walk import BlockTransform, VariantQuantization, WalkConfig, walk
from quantdyn.errors import QuantdynError, unknown_name
from quantdyn.evaluate.quant_error import TOP_K, ErrorTokens, FPLogits, FPTokens, summarize
from quantdyn.models.weights import CheckpointWeights
from quantdyn.quantize.catalogue import QuantConfig, parse_quantizer
from quantdyn.quantize.primitives import QuantResult
from quantdyn.quantize.plan import is_auto
from quantdyn.quantize.residual_rotation import check_rotations

log = logging.getLogger("quantdyn")


@dataclass(frozen=True)
class MeasureConfig:
    """How the engine batches, threads and budgets its work (numbers do not depend on it beyond
    float rounding, except ``dtype``)."""

    batch_size: int = 16
    """Evaluation windows per forward."""
    calib_batch_size: int = 8
    """Calibration sequences per forward."""
    quantize_threads: int = 1
    """torch threads while calibrating and quantizing on CPU: 1 (default) makes the codes independent of the
    machine's core count (BLAS rounds differently with more threads); 0 = torch's setting, ~1.75x faster for a
    whole model on an idle 2-core CPU (BENCHMARKS.md). The GPTQ column loop itself always runs single-threaded."""
    layer_diagnostics: bool = False
    """Per-layer output errors 1/2 tr(dW H dW^T) (``output_error``, ``rel_error`` in the layer rows) for every
    quantizer, and for that calibration passes of the calibration-free ones (RTN: their rows' layer_loss_sum).
    Off by default: they cost a calibration forward per RTN variant and two out x in x in products per layer
    (BENCHMARKS.md, "The floor"); GPTQ's own loss is in its rows either way."""
    dtype: str = "auto"
    """Compute dtype: auto | float32 | bfloat16 | float16. auto: the checkpoint's own (bf16 stays bf16), except
    bf16/fp16 on a CPU without native units for it, which computes in float32 (faster there:
    lazy_model.auto_compute_dtype)."""
    max_memory: str = ""
    """Memory for weights and activation streams, e.g. 8GB ('' = automatic: half the free RAM/GPU memory).
    Streams beyond it spill to disk; less than one block's needs is an error saying the minimum."""
    spill_dir: str = ""
    """Where spilled streams go ('' = the system temporary directory; removed afterwards)."""
    logits_budget_mb: int = 16
    """Largest logits tensor of one variant (MiB); bigger batches are evaluated in slices of windows (at least one
    window). The head holds about six tensors of that size at once (FP log-probabilities and probabilities; the
    variant's logits, log-probabilities, their difference and its product), so this bounds the head's memory."""
    streams: str = "auto"
    """Where activation streams live: auto | memory | disk. auto: by the memory budget, and on CPU with the
    automatic budget streams over 256 MiB spill unless the spill directory is on tmpfs/ramfs (StreamStore)."""
    detailed_metrics: bool = True
    """KL percentiles and reverse KL, top-2..5 agreement, Δp, log-probability correlation, KL by confidence and
    the per-block error maps (evaluate/quant_error.py); false: only CE, mean KL and top-1 agreement, what rows
    held before these (the cost reference of bench/metrics_cost.py)."""

    def __post_init__(self):
        if self.batch_size < 1 or self.calib_batch_size < 1:
            raise QuantdynError(f"batch sizes must be >= 1 (got {self.batch_size} and {self.calib_batch_size})")
        if self.quantize_threads < 0:
            raise QuantdynError(f"quantize_threads={self.quantize_threads} must be >= 0 (0 = torch's setting)")
        if self.logits_budget_mb < 1:
            raise QuantdynError(f"logits_budget_mb={self.logits_budget_mb} must be >= 1")
        compute_dtype_of(self.dtype)
        parse_bytes(self.max_memory)
        if self.streams not in ("auto", "memory", "disk"):
            raise unknown_name("streams setting", self.streams, ("auto", "memory", "disk"))


@dataclass
class Measurement:
    """What :func:`measure` found for one checkpoint."""

    fp_window_ce: torch.Tensor
    """Per-window full-precision CE (float64)."""
    metrics: dict[str, dict] = field(default_factory=dict)
    """Per quantizer label: the error fields of ``evaluate.quant_error.summarize`` (ce_fp, ce_q, delta_ce ± SE,
    rel_delta_ce, delta_ppl, kl ± SE, top1_agree, n_windows, window_delta and, with ``detailed_metrics``, the KL
    percentiles, reverse KL, top-K agreement, Δp, correlation, KL by confidence) and the per-block maps
    block_rel_fro, block_cos_err, block_sqnr."""
    quantizations: dict[str, VariantQuantization] = field(default_factory=dict)
    """Per quantizer label: layer rows, quantization seconds, calibration count."""
    t_eval: float = 0.0
    """Seconds spent carrying evaluation windows through the blocks and the head (all variants)."""
    n_params: int = 0
    """Non-embedding parameters."""
    dtype: str = ""
    """Compute dtype used."""
    streams: str = ""
    """Where the activation streams lived."""
    propagation: dict[str, list[dict]] = field(default_factory=dict)
    """Per quantizer label, with ``propagation_ids``: paper B's per-block R, A, B, C and gain
    (analysis/propagation.py)."""
    phase_seconds: dict[str, float] = field(default_factory=dict)
    """Wall seconds of the whole measurement (all quantizers together) per phase of engine/phases.py (read,
    convert, capture, calib_forward, quantize_layers, diagnostics, eval_forward, head), and ``total``: the whole
    call, opening the checkpoint included (the rest of total: building the skeleton, copying blocks, freeing
    memory)."""
    noise_floor: dict | None = None
    """With ``noise_floor=True``: the same error fields for the FP model against its bf16-rounded self
    (engine/noise_floor.py), and ``floor_rounding``, what was rounded; None when not measured."""
    plans: dict[str, dict] = field(default_factory=dict)
    """Per ``auto@`` quantizer label: the plan it allocated on this checkpoint (engine/sensitivity.py
    ``allocate_auto``: its label, digest, bits per weight, predicted KL, the sensitivity pass's seconds)."""
    weight_levels: dict[str, float | None] = field(default_factory=dict)
    """Per quantizable block linear: the median distinct values per 32-weight block of its FP weight
    (analysis/grid.py; ``engine.rows.grid_fields`` turns them into the rows' weight_grid_levels / weight_grid)."""

    @property
    def ce_fp(self) -> float:
        return float(self.fp_window_ce.mean())


def check_budget(source: BlockSource, budget: int) -> int:
    """Bytes left for streams under ``budget`` (0 = automatic); too small a budget is an error, raised before
    any weight is read, that gives the minimum budget."""
    if not budget:
        return 0
    weights = 2 * source.block_bytes() + source.edge_bytes()
    tensor, tensor_bytes = source.largest_tensor()
    minimum = max(weights, tensor_bytes) * 1.25
    if budget < tensor_bytes:
        raise QuantdynError(f"--max-memory {fmt_bytes(budget)} cannot hold this checkpoint's largest tensor "
                            f"'{tensor}' ({fmt_bytes(tensor_bytes)} to read it in {str(source.dtype)[6:]}); "
                            f"give at least {fmt_bytes(minimum)}")
    if budget < minimum:
        raise QuantdynError(f"--max-memory {fmt_bytes(budget)} is too small for this model: one block, its quantized "
                            f"copy, the embedding and head need {fmt_bytes(weights)}; give at least "
                            f"{fmt_bytes(minimum)}")
    return budget - weights


def _variants(quantizers) -> dict[str, QuantConfig | BlockTransform]:
    """{label: QuantConfig or BlockTransform} of measure's ``quantizers`` (a mapping, or labels/configs)."""
    if isinstance(quantizers, (str, QuantConfig, BlockTransform)):
        quantizers = [quantizers]
    if isinstance(quantizers, Mapping):
        return {label: (q if isinstance(q, BlockTransform) else parse_quantizer(q)) for label, q in quantizers.items()}
    out: dict[str, QuantConfig | BlockTransform] = {}
    for q in quantizers:
        v = q if isinstance(q, BlockTransform) else parse_quantizer(q)
        label = v.name
        if label in out:
            raise QuantdynError(f"quantizer '{q}' is given twice (as '{label}'); list each once")
        out[label] = v
    return out


@torch.no_grad()
def measure(
    model: str | Path | nn.Module | CheckpointWeights | BlockSource,
    quantizers: Mapping[str, QuantConfig | str | dict | BlockTransform] | Sequence[QuantConfig | str],
    eval_windows: torch.Tensor | None,
    calib_ids: torch.Tensor | None = None,
    *,
    device: str | torch.device = "cpu",
    cfg: MeasureConfig = MeasureConfig(),
    propagation_ids: torch.Tensor | None = None,
    on_layer: Callable[[str, str, QuantResult, nn.Module], None] | None = None,
    on_block: Callable[[str], None] | None = None,
    noise_floor: bool | None = False,
    **old,
) -> Measurement:
    """Quantize ``model`` with each of ``quantizers`` and measure every one against full precision on
    ``eval_windows`` [N, T+1] (inputs = all but the last token, targets = all but the first; None = no error
    metrics).

    ``quantizers``: labels or QuantConfigs (``["gptq3", "rtn4"]``: each measured under its canonical label), or
    ``{label: label, QuantConfig, dict or BlockTransform}`` to choose the labels. ``calib_ids`` [N, L]: the
    calibration sequences, or {label: [N, L]} per variant. ``propagation_ids`` [N, T]: also run paper B's
    error-propagation analysis on these sequences (the four passes per block of analysis/propagation.py,
    inside the same walk). The model is left untouched (an in-memory model included).
    ``on_layer(label, layer, result, module)`` sees every quantized layer (to pack or export codes);
    ``on_block(line)`` gets a line per block (``progress=`` before 0.2). ``noise_floor``: also measure the bf16
    noise floor (``Measurement.noise_floor``; one extra block pass per block, in float32 when the blocks compute in
    bf16/fp16); None: only where the blocks compute in float32 (there it costs one block pass; in bf16 an fp32 pass,
    2.3x a whole bf16 measurement of one quantizer on a CPU with bf16 units: BENCHMARKS.md, "The floor")."""
    if "progress" in old:
        warnings.warn("measure(progress=callable) is now measure(on_block=callable)", DeprecationWarning, stacklevel=3)
        on_block = on_block or old.pop("progress")
    if old:
        raise TypeError(f"measure() got an unexpected keyword argument '{next(iter(old))}'")
    t_start = time.perf_counter()
    device = torch.device(device)
    variants = _variants(quantizers)
    probes: dict[str, torch.Tensor] = {}
    if eval_windows is not None:
        if not isinstance(eval_windows, torch.Tensor) or eval_windows.dim() != 2 or eval_windows.shape[1] < 2:
            raise QuantdynError("evaluation windows must be token ids shaped [N, T+1] with T >= 1")
        probes["eval"] = eval_windows[:, :-1]
    if propagation_ids is not None:
        probes["prop"] = propagation_ids
    source = block_source(model, compute_dtype_of(cfg.dtype), device)
    check_rotations(source.model, variants.values())  # +had widths, +r1 architectures: one line before any work
    if noise_floor is None:  # auto: where the floor costs one block pass (float32 blocks), not an fp32 pass more
        noise_floor = source.dtype == torch.float32
    if noise_floor and eval_windows is not None:
        variants[NOISE_FLOOR_LABEL] = BF16NoiseFloor()
    stream_budget = check_budget(source, parse_bytes(cfg.max_memory))
    check_quantizers_fit(variants, source)  # plan: and auto@ labels against this model, before any work
    plans: dict[str, dict] = {}
    autos = {label: v for label, v in variants.items() if isinstance(v, QuantConfig) and is_auto(v)}
    if autos:  # allocate on this checkpoint: its sensitivity to the candidate types, then a plan per budget
        for label, (plan_qc, summary) in allocate_auto(model, autos, calib_ids, device).items():
            variants[label] = plan_qc
            plans[label] = summary
    threads = cfg.quantize_threads if device.type == "cpu" else None  # a GPU's quantizing is not threaded by torch
    wcfg = WalkConfig(**shared_fields(cfg, WalkConfig, but=("quantize_threads",)), quantize_threads=threads,
                      calibrate_all=cfg.layer_diagnostics, stream_bytes=stream_budget,
                      block_errors="eval" if eval_windows is not None and cfg.detailed_metrics else None)
    t0 = time.perf_counter()
    prop_sums: dict[str, list] = {}

    def observer(label, b, block, qblock, fp_in, q_in, args_of) -> None:
        # total[0]: sums of the block-0 inputs; total[b + 1]: block b (analysis/propagation.py)
        total = prop_sums.setdefault(label, [])
        for i in range(len(fp_in)):
            h, hq = fp_in[i], q_in[i]
            rest, kw = args_of(i)
            sums, _, _ = block_sums(lambda x: block_output(block(x, *rest, **kw)),
                                    lambda x: block_output(qblock(x, *rest, **kw)), h, hq)
            entries = ([(0, input_sums(h, hq))] if b == 0 else []) + [(b + 1, sums)]
            for k, v in entries:
                if len(total) == k:
                    total.append(dict(v))
                else:
                    total[k] = {key: total[k][key] + x for key, x in v.items()}

    def block_done(b: int, n: int) -> None:
        if on_block is not None:
            on_block(f"block {b}/{n} ({time.perf_counter() - t0:.0f}s)")

    with walk(source, variants, calib_ids, probes, device, wcfg, on_layer=on_layer,
              observer=observer if propagation_ids is not None else None,
              observe="prop" if propagation_ids is not None else None, progress=block_done) as w:
        t_head = time.perf_counter()
        fp_tokens, per_q = (_head_metrics(w, eval_windows[:, 1:], cfg.batch_size, cfg.logits_budget_mb * 2**20,
                                          device, cfg.detailed_metrics)
                            if eval_windows is not None else (FPTokens(), {}))
        metrics = {label: {**summarize(fp_tokens, acc), **w.block_errors.get(label, {})} for label, acc in per_q.items()}
        t_head = time.perf_counter() - t_head
        if eval_windows is not None:
            w.times.seconds["head"] += t_head
        streams = w.store.describe()
        quantizations = dict(w.variants)
        t_eval = w.probe_seconds + t_head
        phase_seconds = dict(w.times.seconds)
        weight_levels = dict(w.weight_levels)
    floor = None
    if NOISE_FLOOR_LABEL in metrics:
        floor = {**metrics.pop(NOISE_FLOOR_LABEL), "floor_rounding": floor_rounding(source.dtype)}
    quantizations.pop(NOISE_FLOOR_LABEL, None)
    prop_sums.pop(NOISE_FLOOR_LABEL, None)
    fp_ce = fp_tokens.window_ce
    propagation = {label: finalize_propagation(s) for label, s in prop_sums.items()}
    phase_seconds["total"] = time.perf_counter() - t_start
    return Measurement(fp_ce, metrics, quantizations, t_eval, source.n_params(), str(source.dtype).replace("torch.", ""),
                       streams, propagation, phase_seconds, floor, plans, weight_levels)


def _head_metrics(w, targets: torch.Tensor, batch_size: int, logits_budget: int, device: torch.device,
                  detailed: bool = True) -> tuple[FPTokens, dict[str, ErrorTokens]]:
    """FP's per-window CE and per-token values and, per variant, its accumulated errors
    (``evaluate/quant_error.py``), from the walk's final hidden states."""
    fp_stream = w.finals[None]["eval"]
    labels = [k for k in w.finals if k is not None and "eval" in w.finals[k]]
    fp_tokens = FPTokens()
    acc = {k: ErrorTokens(detailed) for k in labels}
    top_k = TOP_K if detailed else 1
    vocab = w.head.weight.shape[0]
    start = 0
    for i in range(len(fp_stream)):
        h_fp = fp_stream[i]
        B, T = h_fp.shape[0], h_fp.shape[1]
        y_all = targets[start : start + B].to(device)
        start += B
        # windows per slice so that one variant's float32 logits stay within the budget (the FP side holds three
        # tensors of that size: log-probabilities, probabilities and the logits until sliced away; a variant its
        # logits, then its log-probabilities and their difference from FP's)
        step = max(1, min(B, logits_budget // max(1, T * vocab * 4)))
        hq_all = {label: w.finals[label]["eval"][i] for label in labels}
        for a in range(0, B, step):
            fp = FPLogits(w.head(w.norm(h_fp[a : a + step])).float(), y_all[a : a + step], top_k)
            fp_tokens.add(fp, detailed)
            for label in labels:
                acc[label].add(fp, w.head_of(label)(w.norm(hq_all[label][a : a + step])).float())
            del fp
            if device.type == "cpu":
                trim_heap()  # each slice frees logits-sized tensors that glibc would otherwise keep (see trim_heap)
    return fp_tokens, acc
