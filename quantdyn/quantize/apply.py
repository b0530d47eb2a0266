"""Quantize a whole model, block by block (the only place in quantize/ with hooks).

Pipeline (as the GPTQ reference ``llama_sequential``):

1. capture the inputs of block 0 (positional and keyword arguments: hidden
   states, rotary tables / ``position_embeddings``, masks) by running the
   model on the calibration ids with a forward pre-hook on block 0 that stops
   the forward;
2. for each block, on the compute device (one block there at a time):
   hook its linear layers, run the block on all captured inputs to collect
   ActStats (H = 2/N sum x x^T, mean |x|), quantize the layers; with
   ``true_sequential`` one layer group at a time, re-running the block so a
   later group sees the already quantized earlier ones;
3. re-run the block with quantized weights: its outputs are the next block's inputs.

Embeddings and the head stay in full precision unless ``quantize_head``.
The model is modified in place; pass a copy to keep the original.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from quantdyn.config import config_hash, to_dict
from quantdyn.errors import QuantdynError
from quantdyn.models.adapters import adapter_for, get_weight, model_type_of, set_weight
from quantdyn.models.gpt import GPT
from quantdyn.quantize.config import QUANTIZERS, QuantConfig, parse_quantizer
from quantdyn.quantize.gptq import ActStats, stats_update
from quantdyn.quantize.primitives import QuantResult, num_threads

log = logging.getLogger("quantdyn")

__all__ = ["ModelQuantization", "quantize_model", "save_quantized", "num_threads"]


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


class _StopForward(Exception):
    """Raised by the block-0 pre-hook once its inputs are captured."""


def _check_calibration(calib_ids: Any, vocab: int | None) -> torch.Tensor:
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


def _vocab_size(model: nn.Module) -> int | None:
    cfg = getattr(model, "config", None)
    v = getattr(cfg, "vocab_size", None)
    return int(v) if v else None


def _run_model(model: nn.Module, ids: torch.Tensor) -> None:
    if isinstance(model, GPT):
        model(ids)
    else:
        model(input_ids=ids, use_cache=False)


def _block_output(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def _move(modules: list[nn.Module], device: torch.device | None) -> None:
    if device is not None:
        for m in modules:
            m.to(device)


def _same(a: Any, b: Any) -> bool:
    """Whether two captured block arguments are the same value (tensors compared exactly)."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and a.device == b.device and bool(torch.equal(a, b)))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:  # objects without a usable ==
        return False


def capture_block_inputs(model, blocks, calib_ids, device, batch_size, every_block: bool):
    """Per calibration batch, per block: (hidden, other_args, kwargs) on the compute device.

    With ``every_block`` False only block 0 is captured (the forward stops there); otherwise the
    forward runs up to the last block, whose arguments may differ per layer (e.g. Qwen2's
    sliding-window layers get another attention mask than its full-attention layers).
    """
    captured: list[list[tuple[torch.Tensor | None, tuple, dict]]] = []
    current: list[tuple[torch.Tensor | None, tuple, dict]] = []
    last = len(blocks) - 1 if every_block else 0

    def make_hook(b):
        def hook(module, args, kwargs):
            kwargs = dict(kwargs)
            if args:
                hidden, rest = args[0], tuple(args[1:])
            else:
                hidden, rest = kwargs.pop("hidden_states"), ()
            current.append((hidden if b == 0 else None, rest, kwargs))
            if b == last:
                raise _StopForward
        return hook

    handles = [blk.register_forward_pre_hook(make_hook(b), with_kwargs=True) for b, blk in enumerate(blocks[: last + 1])]
    try:
        for batch in calib_ids.split(batch_size):
            current = []
            try:
                _run_model(model, batch.to(device))
            except _StopForward:
                pass
            if len(current) != last + 1:
                raise QuantdynError(f"could not capture the inputs of blocks 0..{last}; the model did not call its "
                                    "blocks in order")
            captured.append(current)
    finally:
        for h in handles:
            h.remove()
    return captured


def _capture_inputs(model, blocks, calib_ids, device, batch_size):
    """Block 0's inputs per batch, and a function (block, batch) -> (other_args, kwargs).

    One probe batch runs through every block; when all blocks receive the same non-hidden
    arguments (the usual case) only block 0 is captured for the rest, else every block's."""
    probe = capture_block_inputs(model, blocks, calib_ids[:batch_size], device, batch_size, every_block=True)[0]
    per_layer = any(not _same(probe[b][1:], probe[0][1:]) for b in range(1, len(probe)))
    captured = capture_block_inputs(model, blocks, calib_ids, device, batch_size, every_block=per_layer)
    inputs = [c[0][0] for c in captured]
    if per_layer:
        return inputs, lambda b, i: captured[i][b][1:]
    return inputs, lambda b, i: captured[i][0][1:]


def _quantize_layer(name, module, stats, cfg, threads) -> tuple[QuantResult, torch.Tensor]:
    W = get_weight(module).detach().float().clone()  # the original, kept for the rows
    fn = QUANTIZERS.get(cfg.method).fn
    with num_threads(threads):
        res = fn(W, stats, cfg)
    if not torch.isfinite(res.weight).all():
        raise QuantdynError(f"quantizing '{name}' produced NaN/Inf; raise damp_percent or check the calibration data")
    set_weight(module, res.weight)
    return res, W


def _row(block_idx, name, full, W, res: QuantResult, stats: ActStats | None, cfg) -> dict:
    row = dict(block=block_idx, layer=full, name=name, out_features=W.shape[0], in_features=W.shape[1],
               method=cfg.method, bits=cfg.bits, group_size=cfg.group_size, loss=res.loss,
               seconds=res.seconds, n_samples=None, tokens=None, output_error=None, rel_error=None)
    if stats is not None:
        H = stats.H.to(W)
        dW = W - res.weight.to(W)
        err = 0.5 * float((dW @ H * dW).sum())
        ref = 0.5 * float((W @ H * W).sum())
        row.update(n_samples=stats.n, tokens=stats.tokens, output_error=err, rel_error=err / ref if ref > 0 else None)
    for k, v in res.diagnostics.items():
        row[k] = v
    return row


def _pack(packed: dict, full: str, res: QuantResult) -> None:
    packed[f"{full}.codes"] = res.codes.detach().cpu().contiguous()
    packed[f"{full}.scales"] = res.scales.detach().float().cpu().contiguous()
    packed[f"{full}.zeros"] = res.zeros.detach().float().cpu().contiguous()
    packed[f"{full}.g_idx"] = res.g_idx.detach().cpu().contiguous()
    if res.awq_scales is not None:
        packed[f"{full}.awq_scales"] = res.awq_scales.detach().float().cpu().contiguous()


@torch.no_grad()
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
    cfg = parse_quantizer(cfg)
    method = QUANTIZERS.get(cfg.method)
    adapter = adapter_for(model)
    mtype = model_type_of(model)
    blocks = adapter.get_blocks(model)
    groups_per_block = [adapter.linear_groups(b) for b in blocks]
    prefix = adapter.blocks
    for b, groups in enumerate(groups_per_block):
        for grp in groups:
            for name, m in grp:
                if not torch.isfinite(m.weight).all():
                    raise QuantdynError(f"weight '{prefix}.{b}.{name}' contains NaN or Inf; fix the checkpoint before quantizing")
    if batch_size < 1:
        raise QuantdynError(f"batch_size={batch_size} must be >= 1")
    use_calib = method.needs_calibration or calib_ids is not None
    if use_calib:
        calib_ids = _check_calibration(calib_ids, _vocab_size(model))
    home = next(model.parameters()).device
    dev = torch.device(device) if device is not None else home
    move = dev != home
    was_training = model.training
    model.eval()
    t_start = time.perf_counter()
    rows: list[dict] = []
    packed: dict[str, torch.Tensor] = {}

    try:
        if not use_calib:  # RTN without data: no forward passes at all
            for b, groups in enumerate(groups_per_block):
                for name, m in (x for grp in groups for x in grp):
                    full = f"{prefix}.{b}.{name}"
                    res, W = _quantize_layer(full, m, None, cfg, threads)
                    rows.append(_row(b, name, full, W, res, None, cfg))
                    _pack(packed, full, res)
                if progress:
                    log.info("quantize %s: block %d/%d done", cfg.name, b + 1, len(blocks))
            if cfg.quantize_head:
                _quantize_head(model, adapter, None, cfg, threads, rows, packed, dev, move)
            return ModelQuantization(cfg, rows, packed, time.perf_counter() - t_start, mtype, 0)

        pre = adapter.get_pre_block(model)
        _move(pre, dev if move else None)
        try:
            hiddens, block_args = _capture_inputs(model, blocks, calib_ids, dev, batch_size)
        finally:
            _move(pre, home if move else None)
        need_abs = cfg.method == "awq"

        for b, block in enumerate(blocks):
            _move([block], dev if move else None)
            groups = groups_per_block[b]
            if not cfg.true_sequential:
                groups = [[x for grp in groups for x in grp]]
            for grp in groups:
                stats: dict[str, ActStats | None] = {name: None for name, _ in grp}
                handles = []
                for name, m in grp:
                    def hook(mod, inp, out, name=name):
                        stats[name] = stats_update(stats[name], inp[0].detach(), need_abs=need_abs)
                    handles.append(m.register_forward_hook(hook))
                try:
                    for i, hidden in enumerate(hiddens):
                        rest, kw = block_args(b, i)
                        block(hidden, *rest, **kw)
                finally:
                    for h in handles:
                        h.remove()
                for name, m in grp:
                    full = f"{prefix}.{b}.{name}"
                    res, W = _quantize_layer(full, m, stats[name], cfg, threads)
                    rows.append(_row(b, name, full, W, res, stats[name], cfg))
                    _pack(packed, full, res)
                    stats[name] = None
            nxt = []
            for i, hidden in enumerate(hiddens):
                rest, kw = block_args(b, i)
                nxt.append(_block_output(block(hidden, *rest, **kw)))
            hiddens = nxt
            _move([block], home if move else None)
            if progress:
                log.info("quantize %s: block %d/%d done", cfg.name, b + 1, len(blocks))

        if cfg.quantize_head:
            _quantize_head(model, adapter, hiddens, cfg, threads, rows, packed, dev, move)
        return ModelQuantization(cfg, rows, packed, time.perf_counter() - t_start, mtype, int(calib_ids.shape[0]))
    finally:
        model.train(was_training)


def _quantize_head(model, adapter, hiddens, cfg, threads, rows, packed, dev, move) -> None:
    """Quantize the output head from the final-norm outputs (untying it from the embedding first)."""
    head = adapter.get_head(model)
    emb_ptrs = {p.data_ptr() for m in adapter.get_pre_block(model) for p in m.parameters()}
    if head.weight.data_ptr() in emb_ptrs:  # tied: keep the embedding in full precision
        head.weight = nn.Parameter(head.weight.detach().clone())
        if hasattr(getattr(model, "config", None), "tie_word_embeddings"):
            model.config.tie_word_embeddings = False
    stats = None
    if hiddens is not None:
        norm = adapter.get_final_norm(model)
        home = head.weight.device
        _move([norm, head], dev if move else None)
        for h in hiddens:
            stats = stats_update(stats, norm(h), need_abs=cfg.method == "awq")
        _move([norm], home if move else None)
    name = adapter.head
    res, W = _quantize_layer(name, head, stats, cfg, threads)
    if hiddens is not None:
        _move([head], home if move else None)
    rows.append(_row(-1, name, name, W, res, stats, cfg))
    _pack(packed, name, res)


def save_quantized(model: nn.Module, result: ModelQuantization, cfg: QuantConfig | None, out_dir: str | Path) -> Path:
    """Atomically write an HF checkpoint of the (dequantized) model plus
    ``quant_codes.safetensors`` (codes, scales, zeros, g_idx[, awq_scales] per layer)
    and ``quant_config.json`` (the QuantConfig, its hash, per-layer rows, summary)."""
    from safetensors.torch import save_file

    from quantdyn.files import atomic_dir
    from quantdyn.models.hf_io import save_hf_into
    from quantdyn.runtime import git_sha

    cfg = result.config if cfg is None else parse_quantizer(cfg)
    out = Path(out_dir)
    with atomic_dir(out) as tmp:
        save_hf_into(model, tmp)
        save_file(result.packed, str(tmp / "quant_codes.safetensors"),
                  metadata={"format": "quantdyn-codes", "quantizer": cfg.name})
        meta = dict(
            quantizer=to_dict(cfg), config_hash=config_hash(cfg), model_type=result.model_type,
            layout="weight (out, in) = scales[:, g_idx] * (codes - zeros[:, g_idx]) [/ awq_scales]; "
                   "GPT-2 Conv1D weights are stored transposed in the checkpoint",
            summary=result.summary(), rows=result.rows, git_sha=git_sha(),
        )
        (tmp / "quant_config.json").write_text(json.dumps(meta, indent=2, default=str))
    return out
