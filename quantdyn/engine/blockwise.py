"""One block at a time: capture the blocks' inputs, quantize one block's linear layers.

These are the only functions in quantize/ that put hooks on modules. ``apply.py`` walks a
whole model with them.

* :func:`capture_inputs` runs the model on token ids up to the last block with every block
  replaced by a recording stub (no block weights are needed: a skeleton works), and returns
  block 0's hidden states per batch and the other arguments every block receives (rotary
  tables / ``position_embeddings``, masks, which may differ per layer, e.g. Qwen2's
  sliding-window layers), deduplicated across blocks and batches; :func:`capture_block_inputs`
  does it for several token sets from a BlockSource, loading only what the capture needs.
* :func:`quantize_block` collects each linear layer's input statistics (H = 2/N Σ x xᵀ,
  mean |x|) by running the block on its calibration inputs — one true-sequential group at a
  time when asked, so later groups see the already quantized earlier ones — and quantizes
  the layers in place with the registered pure quantizer function.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from quantdyn.engine.lazy_model import BlockSource
from quantdyn.engine.phases import PhaseTimer, time_phase
from quantdyn.engine.streams import trim_heap
from quantdyn.errors import QuantdynError
from quantdyn.models.adapters import get_weight, set_weight
from quantdyn.models.gpt import GPT
from quantdyn.quantize.catalogue import QUANTIZERS, QuantConfig, TensorSite, config_for_tensor, grid_bits_per_weight
from quantdyn.quantize.gptq import ActStats, gptq_batch, stats_update
from quantdyn.quantize.primitives import QuantResult, all_finite, num_threads
from quantdyn.quantize.rotation import (
    fold_stats,
    hadamard_seed,
    quantize_rotated,
    quantize_rotated_batch,
    rotated_act_quant,
)

BlockArgs = tuple[tuple, dict]
"""The arguments of one block call besides the hidden states: (positional rest, keyword)."""


class _StopForward(Exception):
    """Raised by the last block's stub once every block's inputs are recorded."""


def check_calibration(calib_ids: Any, vocab: int | None) -> torch.Tensor:
    """Calibration ids as a LongTensor [N, L] (one-line errors for empty, misshapen, float or out-of-vocab ids)."""
    if calib_ids is None:
        raise QuantdynError("this quantizer needs calibration data; pass calib_ids (a LongTensor of shape [N, L])")
    if not isinstance(calib_ids, torch.Tensor):
        calib_ids = torch.as_tensor(calib_ids)
    if calib_ids.dim() == 1:
        calib_ids = calib_ids[None]
    if calib_ids.dim() != 2 or calib_ids.numel() == 0:
        raise QuantdynError(
            f"calibration set is empty or misshapen (shape {tuple(calib_ids.shape)}); "
            f"pass token ids of shape [N, L] with N, L > 0"
        )
    if calib_ids.dtype.is_floating_point or calib_ids.dtype == torch.bool:
        raise QuantdynError(f"calibration ids must be integer token ids, got dtype {calib_ids.dtype}")
    if vocab is not None and (int(calib_ids.min()) < 0 or int(calib_ids.max()) >= vocab):
        raise QuantdynError(
            f"calibration ids lie in [{int(calib_ids.min())}, {int(calib_ids.max())}] but the model's vocabulary "
            f"has {vocab} tokens; tokenize with the model's tokenizer"
        )
    return calib_ids.long()


def vocab_size_of(model: nn.Module) -> int | None:
    cfg = getattr(model, "config", None)
    v = getattr(cfg, "vocab_size", None)
    return int(v) if v else None


def run_model(model: nn.Module, ids: torch.Tensor) -> Any:
    if isinstance(model, GPT):
        return model(ids)
    return model(input_ids=ids, use_cache=False)


def block_output(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def same_value(a: Any, b: Any) -> bool:
    """Whether two captured block arguments are the same value (tensors compared exactly)."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and a.device == b.device and bool(torch.equal(a, b)))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:  # objects without a usable ==
        return False


def _split_call(args: tuple, kwargs: dict) -> tuple[torch.Tensor, BlockArgs]:
    kwargs = dict(kwargs)
    if args:
        return args[0], (tuple(args[1:]), kwargs)
    return kwargs.pop("hidden_states"), ((), kwargs)


def first_block_inputs(model: nn.Module, blocks: nn.ModuleList, ids: torch.Tensor) -> tuple[torch.Tensor, BlockArgs]:
    """Block 0's hidden states and other arguments for one batch of ids (the forward stops at block 0)."""
    got: list = []

    def hook(module, args, kwargs):
        got.append(_split_call(args, kwargs))
        raise _StopForward

    h = blocks[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        run_model(model, ids)
    except _StopForward:
        pass
    finally:
        h.remove()
    if not got:
        raise QuantdynError("could not capture the inputs of block 0; the model did not call its blocks")
    return got[0]


class CapturedInputs:
    """Block-0 hidden states per batch and every block's other arguments per batch.

    ``args(b, i)`` is what block ``b`` receives with batch ``i`` besides the hidden states;
    identical values are stored once (``per_layer`` tells whether any block's differ from
    block 0's)."""

    def __init__(self, hiddens: list[torch.Tensor], table: list[list[BlockArgs]], per_layer: bool):
        self.hiddens = hiddens
        self._table = table
        self.per_layer = per_layer

    def __len__(self) -> int:
        return len(self.hiddens)

    def args(self, b: int, i: int) -> BlockArgs:
        row = self._table[i]
        return row[b] if self.per_layer else row[0]


def capture_inputs(model: nn.Module, blocks: nn.ModuleList, ids: torch.Tensor, device: torch.device,
                   batch_size: int, returns_tuple: bool) -> CapturedInputs:
    """Run ``model`` on ``ids`` in batches with every block replaced by a recording stub.

    The stubs return their hidden-state input unchanged (as a tuple when the real blocks
    return tuples) so the model's own code computes every block's arguments; the forward
    stops after the last block. Only the modules before block 0 need real weights."""
    n = len(blocks)
    current: list = []

    def stub_for(b: int):
        def stub(*args, **kwargs):
            hidden, rest = _split_call(args, kwargs)
            current.append((hidden if b == 0 else None, rest))
            if b == n - 1:
                raise _StopForward
            return (hidden,) if returns_tuple else hidden
        return stub

    hiddens: list[torch.Tensor] = []
    table: list[list[BlockArgs]] = []
    per_layer = False
    for b, blk in enumerate(blocks):
        blk.forward = stub_for(b)  # instance attribute shadows the class's forward
    try:
        for batch in ids.split(batch_size):
            current = []
            try:
                run_model(model, batch.to(device))
            except _StopForward:
                pass
            if len(current) != n:
                raise QuantdynError(f"could not capture the inputs of blocks 0..{n - 1}; the model did not call "
                                    "its blocks in order")
            hiddens.append(current[0][0])
            row = [rest for _, rest in current]
            row = [row[0] if same_value(r, row[0]) else r for r in row]  # share identical per-layer args
            per_layer = per_layer or any(r is not row[0] for r in row)
            if table and len(table[-1]) == n and hiddens[-1].shape == hiddens[-2].shape:
                prev = table[-1]
                row = [p if same_value(r, p) else r for r, p in zip(row, prev)]  # share identical per-batch args
            table.append(row)
    finally:
        for blk in blocks:
            if "forward" in blk.__dict__:
                del blk.forward
    return CapturedInputs(hiddens, table, per_layer)


@torch.no_grad()
def capture_block_inputs(source: BlockSource, sets: Sequence[tuple[torch.Tensor, int]], device: torch.device,
                         timer: PhaseTimer | None = None) -> list[CapturedInputs]:
    """:func:`capture_inputs` for each token set of ``sets`` ((ids [N, T], sequences per batch) each, in order) from
    a BlockSource: the modules before block 0 (the embedding) are loaded for the capture alone; block 0 is loaded
    to learn whether the blocks return tuples, and stays loaded (a walk starts there). ``timer`` gets the loads
    and the ``capture`` phase."""
    if not sets:
        return []
    model, blocks = source.model, source.blocks
    pre = source.pre_block()
    for m in pre:
        source.load(m, device, timer)
    try:
        with time_phase(timer, "capture"):
            h0, (rest0, kw0) = first_block_inputs(model, blocks, sets[0][0][:1].to(device))
        source.load(blocks[0], device, timer)
        with time_phase(timer, "capture"):
            returns_tuple = isinstance(blocks[0](h0, *rest0, **kw0), (tuple, list))
            return [capture_inputs(model, blocks, ids, device, batch_size, returns_tuple) for ids, batch_size in sets]
    finally:
        for m in pre:
            source.unload(m)
        trim_heap()


def check_finite_weights(groups: list[list[tuple[str, nn.Module]]], prefix: str) -> None:
    for grp in groups:
        for name, m in grp:
            if not all_finite(m.weight):
                raise QuantdynError(f"weight '{prefix}.{name}' contains NaN or Inf; fix the checkpoint before quantizing")


def quantize_layer(name: str, module: nn.Module, stats: ActStats | None, cfg: QuantConfig,
                   threads: int | None, site: TensorSite | None = None) -> tuple[QuantResult, torch.Tensor]:
    """Quantize one linear layer in place; returns the result and the original weight (float32).

    A format that chooses per tensor (llama.cpp's mixes and shape fallbacks) resolves ``cfg`` for ``site``
    first; the choice lands in ``res.diagnostics`` (``quantizer_method`` and the format's notes). A format
    with activation quantization (W8A8) also gets a forward pre-hook on ``module`` that fake-quantizes its input.
    With ``+had`` the weight is quantized as Q(W R) from the rotated statistics and the module holds Q(W R) Rᵀ
    (quantize/rotation.py); activation quantization then quantizes x R."""
    W, cfg, notes = _layer_weight(module, cfg, site or TensorSite(name, 0, 1, tuple(get_weight(module).shape)))
    with num_threads(threads):
        res = quantize_weight(W, stats, cfg, name)
    res = _apply_result(name, module, res, cfg, notes)
    return res, W


def quantize_weight(W: torch.Tensor, stats: ActStats | None, cfg: QuantConfig, name: str) -> QuantResult:
    """One weight W (out, in) quantized as the engine quantizes a layer with ``cfg`` (already resolved for its
    tensor, config_for_tensor): the registered method, or with ``+had`` the method on W R with the rotated
    statistics and the result's weight rotated back, Q(W R) Rᵀ (quantize/rotation.py quantize_rotated).
    ``name`` names the layer in errors. The quantizer may work on W in place: pass a copy to keep it."""
    fn = QUANTIZERS.get(cfg.method).fn
    return fn(W, stats, cfg) if hadamard_seed(cfg) is None else quantize_rotated(fn, W, stats, cfg, name)


def _layer_weight(module: nn.Module, cfg: QuantConfig, site: TensorSite) -> tuple[torch.Tensor, QuantConfig, dict]:
    """The layer's weight as float32 (one copy), and the configuration that quantizes it (config_for_tensor)."""
    W = get_weight(module).detach().to(torch.float32, copy=True)  # one copy (bf16 -> fp32 is already one)
    cfg, notes = config_for_tensor(cfg, site)
    return W, cfg, notes


def _apply_result(name: str, module: nn.Module, res: QuantResult, cfg: QuantConfig, notes: dict) -> QuantResult:
    """Put a quantizer's result into the layer (and its activation hook, for formats that quantize inputs); returns
    the result with its bits per weight filled in from ``cfg`` where the quantizer left them out."""
    if not all_finite(res.weight):
        raise QuantdynError(f"quantizing '{name}' produced NaN/Inf; raise damp_percent or check the calibration data")
    res.diagnostics.update(notes)
    if res.bits_per_weight is None:  # the tensor's own configuration (a plan's entry), not the variant's
        res = replace(res, bits_per_weight=grid_bits_per_weight(cfg, *res.weight.shape))
    set_weight(module, res.weight)
    act_quant = QUANTIZERS.get(cfg.method).act_quant
    if act_quant is not None:
        if hadamard_seed(cfg) is not None:  # +had: the rotated input x R is what a deployment quantizes
            act_quant = rotated_act_quant(act_quant, hadamard_seed(cfg))
        module.register_forward_pre_hook(lambda m, args: (act_quant(args[0]).to(args[0].dtype), *args[1:]))
    return res


def layer_row(block_idx: int, name: str, full: str, W: torch.Tensor, res: QuantResult, stats: ActStats | None,
              cfg: QuantConfig, output_error: bool = True) -> dict:
    """The per-layer diagnostics row: shapes, quantizer loss, output error ½ tr(ΔW H ΔWᵀ) and its relative size
    (``output_error``: computed where statistics exist; else None: two out x in x in products saved)."""
    row = dict(block=block_idx, layer=full, name=name, out_features=W.shape[0], in_features=W.shape[1],
               method=cfg.method, bits=res.bits, group_size=cfg.group_size, loss=res.loss,
               seconds=res.seconds, n_samples=None, tokens=None, output_error=None, rel_error=None,
               bits_per_weight=(res.bits_per_weight if res.bits_per_weight is not None
                                else grid_bits_per_weight(cfg, W.shape[0], W.shape[1])))
    if stats is not None:
        row.update(n_samples=stats.n, tokens=stats.tokens)
    if stats is not None and output_error:  # two out x in temporaries at a time (dW and dW H), multiplied in place
        H = stats.H.to(W)
        dW = W - res.weight.to(W)
        err = 0.5 * float((dW @ H).mul_(dW).sum())
        del dW
        ref = 0.5 * float((W @ H).mul_(W).sum())
        row.update(output_error=err, rel_error=err / ref if ref > 0 else None)
    for k, v in res.diagnostics.items():
        row[k] = v
    return row


LayerCallback = Callable[[str, QuantResult, nn.Module], None]
"""Called with (full layer name, result, module) after each layer is quantized."""


@dataclass
class BlockJob:
    """One quantizer's share of quantizing one block (:func:`quantize_blocks`)."""

    block: nn.Module
    """The block (a copy of the model's) whose linear layers are quantized in place."""
    groups: list[list[tuple[str, nn.Module]]]
    """Its layers in true-sequential groups (adapter.linear_groups)."""
    inputs: Sequence[torch.Tensor] | None
    """Its calibration hidden states per batch (None: no statistics, only for calibration-free quantizers)."""
    args_of: Callable[[int], BlockArgs] | None
    """The other arguments of calibration batch ``i``."""
    cfg: QuantConfig
    """The quantizer."""
    on_layer: LayerCallback | None = None
    """Called with (full layer name, result, module) after each layer is quantized."""


def quantize_block(block: nn.Module, groups: list[list[tuple[str, nn.Module]]], block_idx: int, prefix: str,
                   inputs: Sequence[torch.Tensor] | None, args_of: Callable[[int], BlockArgs], cfg: QuantConfig,
                   layer_threads: int | None = None, on_layer: LayerCallback | None = None,
                   n_blocks: int = 0, timer: PhaseTimer | None = None, diagnostics: bool = True) -> list[dict]:
    """Quantize the linear layers of one block in place; returns one diagnostics row per layer (``diagnostics``:
    with each layer's output error where statistics exist, see layer_row).

    ``inputs`` are the block's calibration hidden states per batch (None: no statistics, only for
    calibration-free quantizers); ``args_of(i)`` the other arguments of batch ``i``.
    ``groups`` are the block's layers in true-sequential groups (flattened into one unless
    ``cfg.true_sequential``). ``n_blocks`` (the model's) lets formats choose a type per tensor. ``timer`` gets
    the calibration forwards, the quantizer calls and the rows' diagnostics.

    Memory: the statistics (GPTQ's fp32 Hessian, in_features² floats per layer) exist for one group at a
    time — the whole block without ``true_sequential`` — and each layer's is dropped as soon as that layer
    is quantized. Layers that receive the very same input tensor (q/k/v, gate/up) share one statistics
    object: it is accumulated once (the same values: the same tensor folded in the same order), and with GPTQ
    they are quantized in one column loop (``gptq_batch``: the same bits as one at a time)."""
    return quantize_blocks([BlockJob(block, groups, inputs, args_of, cfg, on_layer)], block_idx, prefix,
                           layer_threads, n_blocks, timer, diagnostics)[0]


def gptq_batchable(cfg: QuantConfig) -> bool:
    """Whether ``cfg`` quantizes with GPTQ (its layers can share column loops: quantize/gptq.py gptq_batch; with
    ``+had`` on their rotated weights and Hessians, quantize/rotation.py quantize_rotated_batch)."""
    return QUANTIZERS.get(cfg.method).fn is QUANTIZERS.get("gptq").fn


def quantize_blocks(jobs: Sequence[BlockJob], block_idx: int, prefix: str, layer_threads: int | None = None,
                    n_blocks: int = 0, timer: PhaseTimer | None = None, diagnostics: bool = True) -> list[list[dict]]:
    """:func:`quantize_block` for several quantizers of the same block at once (one row list per job).

    Per true-sequential group, every job's statistics are collected first; then the group's layers are quantized
    in sets: GPTQ layers that share a statistics object (q/k/v, gate/up) in every job, across all the jobs, in
    one ``gptq_batch`` call (one column loop: on a GPU the loop is bound by kernel launches, so k weights cost
    about what one costs); every other layer on its own. Each job's work is what quantize_block would do for it
    alone, so its codes and rows are the same; what changes is that the jobs' statistics (and blocks) exist
    together. The jobs must share the group structure (the same true_sequential)."""
    plans = [job.groups if job.cfg.true_sequential else [[x for grp in job.groups for x in grp]] for job in jobs]
    if len({tuple(tuple(n for n, _ in grp) for grp in p) for p in plans}) != 1:
        raise ValueError("quantize_blocks: the jobs' layer groups differ (true_sequential must agree)")
    rows: list[dict[str, dict]] = [{} for _ in jobs]
    for gi, grp0 in enumerate(plans[0]):
        stats_of: list[dict[str, ActStats | None]] = []
        for job, plan in zip(jobs, plans):
            stats: dict[str, ActStats | None] = {name: None for name, _ in plan[gi]}
            if job.inputs is not None:
                with time_phase(timer, "calib_forward"):
                    shared = _collect_stats(job.block, plan[gi], job.inputs, job.args_of, QUANTIZERS.get(job.cfg.method).needs_abs_stats, stats,
                                             hadamard_seed(job.cfg))
                for name, first in shared.items():
                    stats[name] = stats[first]
            stats_of.append(stats)
        names = [name for name, _ in grp0]
        done: set[str] = set()
        for name in names:
            if name in done:
                continue
            layer_set = [name]
            if all(gptq_batchable(job.cfg) and st[name] is not None for job, st in zip(jobs, stats_of)):
                layer_set += [n for n in names if n not in done and n != name
                              and all(st[n] is st[name] for st in stats_of)]
            done.update(layer_set)
            _quantize_set(jobs, [dict(p[gi]) for p in plans], stats_of, layer_set, block_idx, prefix, layer_threads,
                          n_blocks, timer, rows, diagnostics)
    return [[r[name] for grp in plans[0] for name, _ in grp] for r in rows]


#: weight entries (rows x columns, all weights together) above which a set's GPTQ layers are not put in one loop: the
#: loop holds four float32 buffers of that size besides the weights and results (1 GiB at 2^26), so a Llama-7B
#: block's q/k/v (5.0e7) still share a loop but its gate/up (9.0e7) go one by one, and a block's transient memory
#: stays near what its down projection's Hessian needs anyway (BENCHMARKS.md, "Real size")
GPTQ_BATCH_ENTRIES = 1 << 26


def _chunks(items: list, jobs: Sequence[BlockJob]) -> list[list]:
    """The set's layers in loops: all together, else each job's together, else one by one (GPTQ_BATCH_ENTRIES)."""
    def entries(chunk):
        return sum(site.shape[0] * site.shape[1] for *_, site in chunk)
    if not all(gptq_batchable(jobs[j].cfg) for j, *_ in items):
        return [[it] for it in items]
    if entries(items) <= GPTQ_BATCH_ENTRIES:
        return [items]
    per_job = [[it for it in items if it[0] == j] for j in range(len(jobs))]
    return [c for c in per_job if c] if all(entries(c) <= GPTQ_BATCH_ENTRIES for c in per_job) \
        else [[it] for it in items]


def _quantize_set(jobs: Sequence[BlockJob], modules: list[dict[str, nn.Module]], stats_of: list[dict],
                  layer_set: list[str], block_idx: int, prefix: str, layer_threads: int | None, n_blocks: int,
                  timer: PhaseTimer | None, rows: list[dict[str, dict]], diagnostics: bool) -> None:
    """Quantize ``layer_set`` of every job (in one gptq_batch call where the set holds GPTQ layers that may share a
    column loop and fit GPTQ_BATCH_ENTRIES, else in fewer-layer calls), then their rows, callbacks and freed
    statistics."""
    items = []  # (job index, layer name, module, site)
    for j, job in enumerate(jobs):
        for name in layer_set:
            m = modules[j][name]
            items.append((j, name, m, TensorSite(name, block_idx, n_blocks or block_idx + 1, tuple(get_weight(m).shape))))
    for chunk in _chunks(items, jobs):
        batch = len(chunk) > 1
        results = []
        with time_phase(timer, "quantize_layers"):
            if batch:
                inputs = [_layer_weight(m, jobs[j].cfg, site) for j, name, m, site in chunk]
                batch = all(gptq_batchable(cfg) for _, cfg, _ in inputs)  # a format may resolve to another method
            if batch:
                with num_threads(layer_threads):
                    out = quantize_rotated_batch(gptq_batch, [(W, stats_of[j][name], cfg)
                                                              for (j, name, *_), (W, cfg, _) in zip(chunk, inputs)],
                                                 [f"{prefix}.{block_idx}.{name}" for _, name, *_ in chunk])
                for (j, name, m, site), (W, cfg, notes), res in zip(chunk, inputs, out):
                    results.append((_apply_result(f"{prefix}.{block_idx}.{name}", m, res, cfg, notes), W))
                del inputs, out
        for k, (j, name, m, site) in enumerate(chunk):
            full = f"{prefix}.{block_idx}.{name}"
            cfg = jobs[j].cfg
            if not batch:
                with time_phase(timer, "quantize_layers"):
                    res, W = quantize_layer(full, m, stats_of[j][name], cfg, layer_threads, site)
            else:
                res, W = results[k]
                results[k] = None
            with time_phase(timer, "diagnostics"):
                rows[j][name] = layer_row(block_idx, name, full, W, res, stats_of[j][name], cfg, diagnostics)
            del W
            if jobs[j].on_layer is not None:
                jobs[j].on_layer(full, res, m)
            del res
            stats_of[j][name] = None  # the last layer sharing a statistics object frees it


def _collect_stats(block: nn.Module, grp: list[tuple[str, nn.Module]], inputs: Sequence[torch.Tensor],
                   args_of: Callable[[int], BlockArgs], need_abs: bool, stats: dict,
                   rotation_seed: int | None = None) -> dict[str, str]:
    """Run the block on every calibration batch, folding each layer's input into ``stats[name]``; returns
    {layer: earlier layer} for the layers whose input was, in every batch, the same tensor object as that
    earlier layer's (their statistics are that layer's, accumulated once)."""
    shared: dict[str, str] = {}
    seen: dict[int, tuple[torch.Tensor, str]] = {}  # this batch: id(input) -> (input, first layer given it)
    batch = 0

    def hook(mod, inp, out, name):
        x = inp[0].detach()
        first = seen.get(id(inp[0]))
        same_as = first[1] if first is not None and first[0] is inp[0] else None
        if batch == 0 and same_as is not None:
            shared[name] = same_as
        if shared.get(name) != same_as:
            raise QuantdynError(f"layer '{name}' shared its input with '{shared.get(name) or same_as}' in one "
                                "calibration batch but not in another; the block's forward is not deterministic")
        if same_as is None:
            seen[id(inp[0])] = (inp[0], name)
            stats[name] = fold_stats(stats[name], x, need_abs, rotation_seed)

    handles = [m.register_forward_hook(lambda mod, inp, out, name=name: hook(mod, inp, out, name)) for name, m in grp]
    try:
        for i in range(len(inputs)):
            batch = i
            rest, kw = args_of(i)
            block(inputs[i], *rest, **kw)
            seen.clear()
    finally:
        for h in handles:
            h.remove()
    return shared


def run_block(block: nn.Module, stream, args_of: Callable[[int], BlockArgs]) -> None:
    """Replace every batch of ``stream`` by the block's output on it."""
    for i in range(len(stream)):
        rest, kw = args_of(i)
        stream[i] = block_output(block(stream[i], *rest, **kw))
