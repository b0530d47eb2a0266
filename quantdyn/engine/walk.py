"""Walk a model block by block: quantize it, and carry token sets through its full-precision
and quantized blocks — the one pipeline behind every "quantize, then compare" in quantdyn.

:func:`walk` takes a :class:`~quantdyn.engine.lazy_model.BlockSource` (a checkpoint read lazily
one module at a time, or a model already in memory), any number of quantizers, calibration
ids and named *probe* token sets (e.g. the evaluation windows), and runs (as the GPTQ
reference's ``llama_sequential``, generalised to several quantizers at once):

1. capture the inputs of every block for each token set: block 0's hidden states and the
   other arguments each block receives (``_capture``, ``blockwise.capture_block_inputs``; only
   the embedding needs weights), and put the hidden states into streams (``_open_streams``);
2. for each block, loaded onto the compute device alone:
   for each quantizer, on a copy of the block (one extra block in memory at any time):
   collect its layers' input statistics from *that quantizer's own* calibration stream (the
   outputs of its already quantized earlier blocks), quantize the layers
   (``blockwise.quantize_blocks``, true-sequential groups when asked), then advance its
   calibration stream and its probe streams through the quantized block
   (``_quantize_and_advance``; block transforms: ``_transform_and_advance``);
   then advance the full-precision probe streams through the block itself — computed once,
   shared by all quantizers (``_advance_full_precision``);
3. at the end, the final norm and head are loaded; quantizers with ``quantize_head``
   quantize a copy of the head from their calibration stream (``_quantize_heads``).

The streams (lists of activation batches) live on the device, in host RAM or spilled to
disk, as a memory budget decides (``engine/streams.py``). Each quantizer's work equals
what quantizing its own copy of the whole model would do, operation for operation, so codes
and outputs are the same as with the in-memory pipeline; memory is one block plus the
streams instead of one model copy per quantizer.

:func:`quantize_model` is the walk with one quantizer applied to an in-memory model in place.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch
import torch.nn as nn

from quantdyn.analysis.grid import median_levels
from quantdyn.engine.blockwise import (
    BlockJob,
    CapturedInputs,
    capture_block_inputs,
    check_calibration,
    check_finite_weights,
    layer_row,
    gptq_batchable,
    quantize_blocks,
    quantize_layer,
    run_block,
    vocab_size_of,
)
from quantdyn.engine.lazy_model import BlockSource, InMemoryModel
from quantdyn.engine.phases import PhaseTimer, time_phase
from quantdyn.engine.streams import Stream, StreamStore, trim_heap
from quantdyn.errors import QuantdynError
from quantdyn.evaluate.quant_error import HiddenError
from quantdyn.models.adapters import get_weight, model_type_of
from quantdyn.quantize.catalogue import QUANTIZERS, BlockTransform, QuantConfig, TensorSite, parse_quantizer
from quantdyn.quantize.residual_rotation import check_rotations, residual_rotated_block, rotate_model
from quantdyn.quantize.rotation import fold_stats, hadamard_seed
from quantdyn.quantize.primitives import QuantResult, num_threads

log = logging.getLogger("quantdyn")

__all__ = ["BlockTransform", "ModelQuantization", "Walk", "WalkConfig", "quantize_model", "walk", "num_threads"]


@dataclass(frozen=True)
class WalkConfig:
    """How a walk batches, threads and stores its work."""

    calib_batch_size: int = 8
    """Calibration sequences per block call (results do not depend on it beyond float rounding)."""
    batch_size: int = 16
    """Probe (evaluation) sequences per block call (MeasureConfig.batch_size)."""
    quantize_threads: int | None = None
    """torch threads while calibrating and quantizing a block (None or 0 = leave as set). 1 makes the codes
    independent of the machine's core count (BLAS rounds differently with more threads)."""
    layer_threads: int | None = None
    """torch threads inside each layer's quantizer function only (None = leave as set)."""
    calibrate_all: bool = True
    """Collect calibration statistics for calibration-free quantizers too (RTN), for their per-layer
    loss and output-error diagnostics; False skips their calibration passes."""
    layer_diagnostics: bool = True
    """Each layer row's output error 1/2 tr(dW H dW^T) and its reference where statistics exist (two out x in x in
    products per layer); False leaves them None."""
    stream_bytes: int = 0
    """Bytes the activation streams may take in memory (0 = half the free RAM / GPU memory); above it
    they spill to disk. measure() gives what MeasureConfig.max_memory leaves after the weights (check_budget)."""
    spill_dir: str = ""
    """Directory for spilled streams ('' = the system temporary directory)."""
    in_place: bool = False
    """Quantize the model's own blocks (one quantizer, no probes): quantize_model."""
    streams: str = "auto"
    """Where activation streams live: auto (by max_memory; on CPU large streams spill to a real disk: StreamStore)
    | memory | disk."""
    block_errors: str | None = None
    """A probe set whose hidden states are compared after every block, each variant's against FP's
    (``evaluate.quant_error.HiddenError``: relative Frobenius error, cosine error, SQNR); None = none."""
    batch_quantizers: bool | None = None
    """Quantize a block for all GPTQ quantizers together: each set of layers in one column loop for all of them
    (``quantize/gptq.py`` ``gptq_batch``; the same codes as one at a time). On a GPU, where the column loop is
    bound by kernel launches, k quantizers then cost about what one costs. Their block copies and statistics
    exist together (one more block and its Hessians per quantizer), so None (the default) does it on a GPU only."""

    def __post_init__(self):
        if self.calib_batch_size < 1 or self.batch_size < 1:
            raise QuantdynError(f"batch sizes must be >= 1 (calibration {self.calib_batch_size}, "
                                f"evaluation {self.batch_size})")
        for name in ("quantize_threads", "layer_threads"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise QuantdynError(f"{name}={v} must be >= 0 (0 = torch's setting)")


@dataclass
class VariantQuantization:
    """One quantizer's part of a walk."""

    config: QuantConfig | None
    """The quantizer's configuration (None for a BlockTransform variant)."""
    rows: list[dict] = field(default_factory=list)
    """One diagnostics row per quantized layer (see blockwise.layer_row)."""
    seconds: float = 0.0
    """Wall time of its calibration passes and quantization."""
    n_calibration: int = 0
    """Calibration sequences used (0 without calibration)."""
    head: nn.Module | None = None
    """Its quantized copy of the head (quantize_head), else None: the FP head applies."""


@dataclass
class Walk:
    """What a walk leaves: per-quantizer results and the final hidden states of every probe set.

    ``finals[None]`` are the full-precision streams, ``finals[label]`` a quantizer's, each
    ``{probe name: Stream}`` of the last block's outputs (before the final norm). The final norm
    and head stay loaded on the device until :meth:`close` (which also removes spilled streams)."""

    source: BlockSource
    variants: dict[str, VariantQuantization]
    finals: dict[str | None, dict[str, Stream]]
    norm: nn.Module
    head: nn.Module
    probe_seconds: float
    store: StreamStore
    times: PhaseTimer = field(default_factory=PhaseTimer)
    """Wall seconds per phase of the walk (engine/phases.py); the head's are added by whoever evaluates it."""
    block_errors: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    """With ``WalkConfig.block_errors``: per variant label, ``block_rel_fro``, ``block_cos_err`` and
    ``block_sqnr``, one value per block (its output against FP's, on that probe set)."""
    weight_levels: dict[str, float | None] = field(default_factory=dict)
    """Per quantizable block linear (full name): the median distinct values per 32-weight block of its full-precision
    weight (analysis/grid.py; <= 16 on a checkpoint dequantized from a 4-bit format)."""

    def head_of(self, label: str | None) -> nn.Module:
        v = self.variants.get(label) if label is not None else None
        return v.head if v is not None and v.head is not None else self.head

    def close(self) -> None:
        self.store.close()
        self.source.unload(self.norm)
        self.source.unload(self.head)

    def __enter__(self) -> "Walk":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


Observer = Callable[[str, int, nn.Module, nn.Module, Stream, Stream, Callable[[int], tuple]], None]
"""observer(label, block index, FP block, quantized block, FP input stream, quantized input stream, args_of):
called for the observed probe set before both streams advance through block ``b``."""


def _check_probe(name: str, ids, vocab: int | None) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.numel() == 0:
        raise QuantdynError(f"token set '{name}' must be token ids shaped [N, T] with N, T > 0")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise QuantdynError(f"token set '{name}' must hold integer token ids, got dtype {ids.dtype}")
    if vocab is not None and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise QuantdynError(f"token set '{name}' has ids in [{int(ids.min())}, {int(ids.max())}] but the model's "
                            f"vocabulary has {vocab} tokens; tokenize with the model's tokenizer")
    return ids.long()


def _stream_bytes(cap: CapturedInputs) -> int:
    return sum(h.numel() * h.element_size() for h in cap.hiddens)


@dataclass
class _Walking:
    """What a walk carries from one phase to the next (:func:`walk`)."""

    source: BlockSource
    device: torch.device
    cfg: WalkConfig
    timer: PhaseTimer
    qcfgs: dict[str, QuantConfig]
    """The weight quantizers by label."""
    transforms: dict[str, BlockTransform]
    """The BlockTransform variants by label."""
    probe_caps: dict[str, CapturedInputs] = field(default_factory=dict)
    """Per probe set: the other arguments every block receives (its hidden states moved into ``fp``)."""
    calib_caps: dict[str, CapturedInputs] = field(default_factory=dict)
    """Per calibrating quantizer: the same for its calibration set (shared by labels with the same set)."""
    store: StreamStore | None = None
    fp: dict[str, Stream] = field(default_factory=dict)
    """Per probe set: the full-precision stream (the inputs of the next block)."""
    qs: dict[str, dict[str, Stream]] = field(default_factory=dict)
    """Per variant and probe set: the variant's stream."""
    qcal: dict[str, Stream] = field(default_factory=dict)
    """Per calibrating quantizer: its own calibration stream (through its quantized blocks)."""
    variants: dict[str, VariantQuantization] = field(default_factory=dict)
    probe_seconds: float = 0.0
    block_errors: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    weight_levels: dict[str, float | None] = field(default_factory=dict)


@torch.no_grad()
def walk(
    source: BlockSource,
    quantizers: Mapping[str, QuantConfig | str | dict | BlockTransform],
    calib_ids: torch.Tensor | Mapping[str, torch.Tensor] | None,
    probes: Mapping[str, torch.Tensor],
    device: str | torch.device,
    cfg: WalkConfig = WalkConfig(),
    on_layer: Callable[[str, str, QuantResult, nn.Module], None] | None = None,
    observer: Observer | None = None,
    observe: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Walk:
    """Quantize with every quantizer and carry the probe sets through the blocks (module docstring).

    ``calib_ids`` is one calibration set for all quantizers, or {label: ids} (e.g. repeats of one quantizer
    with different calibration draws; labels without an entry get no calibration); identical tensors are
    captured once. ``on_layer(label, layer name, result, quantized module)`` sees every quantized layer (to pack
    or export codes); ``progress(block, n_blocks)`` is called after each block."""
    transforms = {label: q for label, q in quantizers.items() if isinstance(q, BlockTransform)}
    qcfgs = {label: parse_quantizer(q) for label, q in quantizers.items() if label not in transforms}
    _check_walk(cfg, qcfgs, transforms, probes, observe)
    vocab = vocab_size_of(source.model)
    calib_of = _calibration_sets(qcfgs, calib_ids, cfg, vocab)
    probes = {name: _check_probe(name, ids, vocab) for name, ids in probes.items()}
    w = _Walking(source, torch.device(device), cfg, PhaseTimer(), qcfgs, transforms)
    model = source.model
    was_training = model.training
    model.eval()
    try:
        _capture(w, calib_of, probes)
        _open_streams(w, calib_of)
        batches = _quantizer_batches(qcfgs, cfg, w.device)
        for b, block in enumerate(source.blocks):
            source.load(block, w.device, w.timer)
            check_finite_weights(source.adapter.linear_groups(block), f"{source.adapter.blocks}.{b}")
            _count_levels(w, b, block)
            for batch in batches:  # one quantizer, or GPTQ quantizers quantized together (batch_quantizers)
                _quantize_and_advance(w, b, block, batch, on_layer, observer, observe)
            _transform_and_advance(w, b, block, observer, observe)
            _advance_full_precision(w, b, block)
            source.unload(block)
            if w.device.type == "cpu":
                trim_heap()
            if progress is not None:
                progress(b + 1, len(source.blocks))
        norm, head = source.tail()
        source.load(norm, w.device, w.timer)
        source.load(head, w.device, w.timer)
        _quantize_heads(w, norm, head, on_layer)
        for label, tr in transforms.items():
            w.variants[label] = VariantQuantization(None, head=tr.head(copy.deepcopy(head)))
        for s in w.qcal.values():
            s.close()
        finals: dict[str | None, dict[str, Stream]] = {None: w.fp, **w.qs}
        return Walk(source, w.variants, finals, norm, head, w.probe_seconds, w.store, w.timer, w.block_errors,
                    w.weight_levels)
    except BaseException:
        if w.store is not None:
            w.store.close()
        raise
    finally:
        model.train(was_training)


def _count_levels(w: _Walking, b: int, block: nn.Module) -> None:
    """Distinct values per 32-weight block of each FP linear of block ``b`` as it is loaded (analysis/grid.py: a
    sort of at most 32K values per tensor: 0.10 s of a 4.0 s rtn4 measurement of the demo model on 16 windows, 0.39 s
    for pythia-160m's 48 block linears, on 2 shared CPU cores, 2026-11-28)."""
    prefix = f"{w.source.adapter.blocks}.{b}"
    for grp in w.source.adapter.linear_groups(block):
        for name, m in grp:
            w.weight_levels[f"{prefix}.{name}"] = median_levels(get_weight(m))


def _check_walk(cfg: WalkConfig, qcfgs: Mapping, transforms: Mapping, probes: Mapping, observe: str | None) -> None:
    if cfg.in_place and (len(qcfgs) != 1 or probes or transforms):
        raise ValueError("an in-place walk takes exactly one quantizer and no probe sets")
    if observe is not None and observe not in probes:
        raise ValueError(f"observed probe set '{observe}' is not among the probes")
    if cfg.block_errors is not None and cfg.block_errors not in probes:
        raise ValueError(f"probe set '{cfg.block_errors}' for block errors is not among the probes")


def _calibration_sets(qcfgs: Mapping[str, QuantConfig], calib_ids, cfg: WalkConfig,
                      vocab: int | None) -> dict[str, torch.Tensor]:
    """{label: its calibration ids} for the quantizers that calibrate (those that need it; with ``calibrate_all``
    every one given ids), each distinct set validated once: labels given the same tensor share one object."""
    calib_of: dict[str, torch.Tensor] = {}
    for label, qc in qcfgs.items():
        ids = calib_ids.get(label) if isinstance(calib_ids, Mapping) else calib_ids
        if QUANTIZERS.get(qc.method).needs_calibration or (ids is not None and cfg.calibrate_all):
            calib_of[label] = ids
    checked: dict[int, torch.Tensor] = {}
    for label, ids in calib_of.items():  # validate each distinct set once; equal objects share a capture
        if id(ids) not in checked:
            checked[id(ids)] = check_calibration(ids, vocab)
        calib_of[label] = checked[id(ids)]
    return calib_of


def _capture(w: _Walking, calib_of: dict[str, torch.Tensor], probes: dict[str, torch.Tensor]) -> None:
    """Phase 1: every block's inputs for each distinct calibration set and each probe set (blockwise)."""
    distinct = {id(ids): ids for ids in calib_of.values()}
    captured = capture_block_inputs(w.source, [(ids, w.cfg.calib_batch_size) for ids in distinct.values()]
                                    + [(ids, w.cfg.batch_size) for ids in probes.values()], w.device, w.timer)
    cals: dict[int, CapturedInputs] = dict(zip(distinct, captured))
    w.probe_caps = dict(zip(probes, captured[len(distinct):]))
    w.calib_caps = {label: cals[id(ids)] for label, ids in calib_of.items()}


def _open_streams(w: _Walking, calib_of: dict[str, torch.Tensor]) -> None:
    """The streams, sized for the store's budget: per probe set the FP stream and a copy per variant; per
    calibrating quantizer its calibration stream. The captured hidden states move into them."""
    caps, n_variants = w.probe_caps, len(w.qcfgs) + len(w.transforms)
    need = sum(_stream_bytes(c) for c in caps.values()) * (1 + n_variants)
    need += sum(_stream_bytes(w.calib_caps[label]) for label in calib_of)
    cfg = w.cfg
    w.store = store = StreamStore(w.device, need, cfg.stream_bytes, cfg.spill_dir or None,
                                  force={"auto": None, "memory": "device", "disk": "disk"}[cfg.streams])
    for name, c in caps.items():
        w.fp[name] = store.new(f"fp-{name}")
        for h in c.hiddens:
            w.fp[name].append(h)
        c.hiddens = []
    for label in [*w.qcfgs, *w.transforms]:
        w.qs[label] = {}
        for name in caps:
            w.qs[label][name] = store.new(f"q{len(w.qs)}-{name}")
            w.qs[label][name].copy_from(w.fp[name])
        if label in w.calib_caps:
            w.qcal[label] = store.new(f"q{len(w.qs)}-calib")
            for h in w.calib_caps[label].hiddens:
                w.qcal[label].append(h)
    for c in w.calib_caps.values():
        c.hiddens = []
    w.variants = {label: VariantQuantization(qc, n_calibration=int(calib_of[label].shape[0]) if label in w.qcal else 0)
                  for label, qc in w.qcfgs.items()}


def _probe_args(w: _Walking, b: int) -> dict[str, Callable[[int], tuple]]:
    return {name: (lambda i, b=b, c=c: c.args(b, i)) for name, c in w.probe_caps.items()}


def _forward_variant(w: _Walking, label: str, b: int, block: nn.Module, qblock: nn.Module,
                     observer: Observer | None, observe: str | None) -> None:
    """A variant's probe streams through its block (and the observer, which sees both blocks first)."""
    t0 = time.perf_counter()
    probe_args = _probe_args(w, b)
    with time_phase(w.timer if w.probe_caps else None, "eval_forward"):  # nothing to time without probes
        if observer is not None:
            observer(label, b, block, qblock, w.fp[observe], w.qs[label][observe], probe_args[observe])
        for name in w.probe_caps:
            run_block(qblock, w.qs[label][name], probe_args[name])
    w.probe_seconds += time.perf_counter() - t0


def _quantize_and_advance(w: _Walking, b: int, block: nn.Module, batch: list[str], on_layer,
                          observer: Observer | None, observe: str | None) -> None:
    """Phase 2, per quantizer (or batch of GPTQ quantizers): quantize its copy of block ``b`` from its own
    calibration stream (blockwise.quantize_blocks), advance that stream, then its probe streams."""
    cfg, source = w.cfg, w.source
    t0 = time.perf_counter()
    jobs: dict[str, BlockJob] = {}
    for label in batch:
        qblock = block if cfg.in_place else copy.deepcopy(block)
        qgroups = source.adapter.linear_groups(qblock)
        if w.qcfgs[label].r1 and not cfg.in_place:  # +r1: this copy rotated, between the model's basis
            qblock = residual_rotated_block(qblock, model_type_of(source.model), w.qcfgs[label].rotation_seed)
        hook = (lambda full, res, m, label=label: on_layer(label, full, res, m)) if on_layer else None
        cal_args = (lambda i, b=b, c=w.calib_caps[label]: c.args(b, i)) if label in w.calib_caps else None
        jobs[label] = BlockJob(qblock, qgroups, w.qcal.get(label), cal_args, w.qcfgs[label], hook)
    with num_threads(cfg.quantize_threads or None):
        rows_of = quantize_blocks(list(jobs.values()), b, source.adapter.blocks, cfg.layer_threads,
                                  n_blocks=len(source.blocks), timer=w.timer, diagnostics=cfg.layer_diagnostics)
        for label, job in jobs.items():
            if label in w.qcal:  # statistics of the FP model's activations where the method asks (imatrix)
                fp_stats = QUANTIZERS.get(job.cfg.method).fp_calibration and not cfg.in_place
                with w.timer("calib_forward"):
                    run_block(block if fp_stats else job.block, w.qcal[label], job.args_of)
    share = (time.perf_counter() - t0) / len(batch)  # a batch's quantizers share its time equally
    for label, rows in zip(jobs, rows_of):
        for r in rows:
            r.setdefault("weight_grid_levels", w.weight_levels.get(r.get("layer")))
        w.variants[label].rows += rows
        w.variants[label].seconds += share
        _forward_variant(w, label, b, block, jobs[label].block, observer, observe)
    del jobs
    if w.device.type == "cpu":
        trim_heap()  # before the next quantizer: this one's Hessians and temporaries are freed


def _transform_and_advance(w: _Walking, b: int, block: nn.Module, observer: Observer | None,
                           observe: str | None) -> None:
    """Phase 2, per BlockTransform variant: its form of a copy of block ``b``, and its probe streams through it."""
    for label, tr in w.transforms.items():
        t0 = time.perf_counter()
        with w.timer("quantize_layers"):
            qblock = tr.block(copy.deepcopy(block))
        w.probe_seconds += time.perf_counter() - t0
        _forward_variant(w, label, b, block, qblock, observer, observe)
        del qblock


def _advance_full_precision(w: _Walking, b: int, block: nn.Module) -> None:
    """Phase 2, last: the full-precision probe streams through block ``b`` (computed once for every variant), and
    each variant's error against them where asked (``WalkConfig.block_errors``)."""
    t0 = time.perf_counter()
    probe_args = _probe_args(w, b)
    with time_phase(w.timer if w.probe_caps else None, "eval_forward"):
        for name in w.probe_caps:
            run_block(block, w.fp[name], probe_args[name])
        if w.cfg.block_errors is not None:
            _compare_streams(w.fp[w.cfg.block_errors], {label: q[w.cfg.block_errors] for label, q in w.qs.items()},
                             w.block_errors)
    w.probe_seconds += time.perf_counter() - t0


def _quantize_heads(w: _Walking, norm: nn.Module, head: nn.Module, on_layer) -> None:
    """Phase 3: the quantizers with ``quantize_head`` quantize a copy of the head (in place: the head itself,
    untied from the embedding) from their calibration stream through the final norm."""
    cfg, source, timer = w.cfg, w.source, w.timer
    adapter = source.adapter
    for label, qc in w.qcfgs.items():
        if not qc.quantize_head:
            continue
        t0 = time.perf_counter()
        v = w.variants[label]
        if cfg.in_place:
            qhead = head
            emb = source.pre_block()[0]
            if any(qhead.weight is p for p in emb.parameters()):  # tied: keep the embedding in full precision
                qhead.weight = nn.Parameter(qhead.weight.detach().clone())
                if hasattr(getattr(source.model, "config", None), "tie_word_embeddings"):
                    source.model.config.tie_word_embeddings = False
        else:
            qhead = copy.deepcopy(head)
        stats = None
        # +r1 in a measurement: the head sees the stream in the model's basis and gets R on its input (+had)
        head_qc = dataclasses.replace(qc, hadamard=True) if qc.r1 and not cfg.in_place else qc
        with num_threads(cfg.quantize_threads or None):
            if label in w.qcal:
                with timer("calib_forward"):
                    for i in range(len(w.qcal[label])):
                        stats = fold_stats(stats, norm(w.qcal[label][i]),
                                            QUANTIZERS.get(qc.method).needs_abs_stats, hadamard_seed(head_qc))
            with timer("quantize_layers"):
                site = TensorSite(adapter.head, -1, len(source.blocks), tuple(qhead.weight.shape))
                res, W = quantize_layer(adapter.head, qhead, stats, head_qc, cfg.layer_threads, site)
            with timer("diagnostics"):
                v.rows.append(layer_row(-1, adapter.head, adapter.head, W, res, stats, qc,
                                        output_error=cfg.layer_diagnostics))
        if on_layer is not None:
            on_layer(label, adapter.head, res, qhead)
        v.head = None if cfg.in_place else qhead
        v.seconds += time.perf_counter() - t0


def _quantizer_batches(qcfgs: Mapping[str, QuantConfig], cfg: WalkConfig, device: torch.device) -> list[list[str]]:
    """The labels quantized together per block (``WalkConfig.batch_quantizers``): the GPTQ quantizers with the
    same true-sequential setting in one batch each, every other quantizer alone; in the order given."""
    together = cfg.batch_quantizers if cfg.batch_quantizers is not None else device.type == "cuda"
    batches: dict[object, list[str]] = {}
    for label, qc in qcfgs.items():
        key = ("gptq", qc.true_sequential) if together and not cfg.in_place and gptq_batchable(qc) else label
        batches.setdefault(key, []).append(label)
    return list(batches.values())


def _compare_streams(fp: Stream, variants: dict[str, Stream], out: dict[str, dict[str, list[float]]]) -> None:
    """Append each variant's error against FP at this block output to ``out[label]`` (every batch read once)."""
    errs = {label: HiddenError() for label in variants}
    for i in range(len(fp)):
        f = fp[i]
        for label, s in variants.items():
            errs[label].add(s[i], f)
    for label, e in errs.items():
        per = out.setdefault(label, {"block_rel_fro": [], "block_cos_err": [], "block_sqnr": []})
        for key, v in zip(per, e.result()):
            per[key].append(v)


# ------------------------------------------------------------------ one model, in place
@dataclass(frozen=True)
class ModelQuantization:
    """What quantize_model did: per-layer rows and the packed integer representation."""

    config: QuantConfig
    """The quantizer configuration used."""
    rows: list[dict]
    """One dict per quantized layer: block, layer, shape, loss, output_error, rel_error, seconds, ..."""
    packed: dict[str, torch.Tensor] = field(repr=False)
    """'<layer>.codes' (uint8, out x in), '.scales', '.zeros' (out x groups), '.g_idx' (in), and for
    AWQ '.awq_scales' (in): dequantized W = scales[:, g_idx] * (codes - zeros[:, g_idx]) / awq_scales."""
    seconds: float
    """Total wall time."""
    model_type: str
    """'quantdyn-gpt' or the HF model_type."""
    n_calibration: int
    """Number of calibration sequences used (0 without calibration)."""

    def summary(self) -> dict:
        """Totals over layers (for result rows)."""
        def tot(key):
            vals = [r[key] for r in self.rows if r.get(key) is not None]
            return float(sum(vals)) if vals else None
        return dict(
            quantizer=self.config.name, layers=len(self.rows), seconds=self.seconds,
            output_error=tot("output_error"), loss=tot("loss"), n_calibration=self.n_calibration,
        )


def pack_result(packed: dict, full: str, res: QuantResult) -> None:
    """Add one layer's codes, scales, zeros, g_idx (and AWQ scales) to a packed dict (CPU tensors)."""
    packed[f"{full}.codes"] = res.codes.detach().cpu().contiguous()
    packed[f"{full}.scales"] = res.scales.detach().float().cpu().contiguous()
    packed[f"{full}.zeros"] = res.zeros.detach().float().cpu().contiguous()
    packed[f"{full}.g_idx"] = res.g_idx.detach().cpu().contiguous()
    if res.awq_scales is not None:
        packed[f"{full}.awq_scales"] = res.awq_scales.detach().float().cpu().contiguous()


def quantize_model(
    model: nn.Module,
    calib_ids: torch.Tensor | None,
    cfg: QuantConfig | str | dict,
    device: str | torch.device | None = None,
    progress: bool = True,
    batch_size: int = 8,
    threads: int | None = None,
) -> ModelQuantization:
    """Quantize the block linears of ``model`` IN PLACE; return per-layer rows and packed codes.

    calib_ids: LongTensor [N, L] of calibration token ids (may be None for RTN,
    which then needs no forward pass). device: compute device (None = where
    the model is); the model may live on CPU and only one block at a time is
    moved to ``device``. batch_size: calibration sequences per forward (results
    do not depend on it beyond float rounding). threads: torch intra-op threads
    while quantizing a layer (None = leave; 1 is fastest for GPTQ on few CPU cores).
    Progress is logged (logger 'quantdyn') when ``progress``.
    """
    qc = parse_quantizer(cfg)
    if batch_size < 1:
        raise QuantdynError(f"batch_size={batch_size} must be >= 1")
    check_rotations(model, [qc])
    if qc.r1:  # in place, the whole model is rotated offline first (embedding, blocks, head): residual_rotation
        rotate_model(model, qc.rotation_seed)
    source = InMemoryModel(model)
    dev = torch.device(device) if device is not None else source.home
    packed: dict[str, torch.Tensor] = {}
    t0 = time.perf_counter()

    def report(b: int, n: int) -> None:
        if progress:
            log.info("quantize %s: block %d/%d done", qc.name, b, n)

    w = walk(source, {qc.name: qc}, calib_ids, {}, dev,
             WalkConfig(calib_batch_size=batch_size, layer_threads=threads, in_place=True),
             on_layer=lambda label, full, res, m: pack_result(packed, full, res), progress=report)
    w.close()
    v = w.variants[qc.name]
    return ModelQuantization(qc, v.rows, packed, time.perf_counter() - t0, model_type_of(model), v.n_calibration)
