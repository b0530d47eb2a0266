"""The deployment formats as quantizers: every GGUF block type and mix (``quantize.gguf``) and the float
formats (``quantize.float_formats``) registered in QUANTIZERS, so that the engine, sweeps, the monitor and
studies take them like rtn or gptq (labels: see ``quantize.catalogue``, "Deployment formats").

Each entry turns the pure format function's output into a :class:`QuantResult`: the codes, the scale of every
group, the format's stored fields (``storage``) and its bits per weight. With calibration statistics the
result also carries the layer loss ½ tr(ΔW H ΔWᵀ) like RTN's.

* ``<gguf type>-imatrix`` and ``<mix>-imatrix`` quantize with llama.cpp's importance matrix: per input
  column the mean of x_j² over the calibration tokens (what ``llama-imatrix`` accumulates and
  ``llama-quantize`` divides by its token count), read off the walk's statistics:
  mean x_j² = diag(H)_j · n / (2 · tokens), H = 2/n Σ x xᵀ. Like llama-imatrix, the statistics come from
  the full-precision model's activations (``QuantMethod.fp_calibration``), not from the quantized blocks.
* A mix resolves per tensor (``QuantMethod.for_tensor``) to the block type llama.cpp's recipe gives it
  (``gguf_mixes.mix_type``); every GGUF type falls back as llama.cpp does when a row does not fit its block
  (``gguf_mixes.fallback_type``); the layer row records ``gguf_type`` and ``gguf_fallback_from``.
* ``w8a8-fp8`` is ``fp8-channel`` weights plus FP8 per-token activations (``QuantMethod.act_quant``),
  applied by the engine to the input of every quantized layer.
* ``f16`` keeps the weight in 16-bit floats (llama.cpp's F16): what a per-tensor plan gives a tensor it leaves
  unquantized (``quantize.plan``), a type like the others.
* ``w4a4`` is rtn4's weights (4-bit asymmetric, group 128, round to nearest) plus 4-bit integer per-token
  activations (:func:`int4_per_token`): QuaRot's W4A4 setting without its rotations; ``w4a4+had`` quantizes the
  rotated activations x R (quantize/rotation.py), the setting where rotations matter most.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from quantdyn.errors import QuantdynError
from quantdyn.quantize import float_formats as ff
from quantdyn.quantize import gguf, gguf_mixes
from quantdyn.quantize.catalogue import QUANTIZERS, FormatSpec, QuantConfig, QuantMethod, TensorSite
from quantdyn.quantize.gptq import ActStats
from quantdyn.quantize.primitives import QuantResult, layer_loss
from quantdyn.quantize.rtn import rtn


def imatrix_from_stats(stats: ActStats) -> torch.Tensor:
    """llama.cpp's importance matrix of a layer from its calibration statistics: mean over tokens of x_j² (in,)."""
    if stats.tokens <= 0:
        raise QuantdynError("the importance matrix needs calibration tokens; none reached this layer")
    return (torch.diagonal(stats.H).double() * stats.n / (2.0 * stats.tokens)).float()


def _g_idx(cols: int, group: int) -> torch.Tensor:
    return (torch.arange(cols) // (group or cols)).to(torch.int32)


def _loss(W: torch.Tensor, W_hat: torch.Tensor, stats: ActStats | None) -> float | None:
    if stats is None:
        return None
    if stats.H.shape != (W.shape[1], W.shape[1]):
        raise QuantdynError(f"Hessian of shape {tuple(stats.H.shape)} does not match in_features={W.shape[1]}")
    return layer_loss(W.float(), W_hat, stats.H)


# ----------------------------------------------------------------------------- GGUF


def _gguf_fn(t: str, imatrix: bool) -> Callable[..., QuantResult]:
    def fn(W: torch.Tensor, stats: ActStats | None, cfg: QuantConfig) -> QuantResult:
        t0 = time.perf_counter()
        im = None
        if imatrix:
            if stats is None:
                raise QuantdynError(f"{cfg.name} needs calibration data: its importance matrix is the mean x^2 of each "
                                    "input column over the calibration tokens")
            im = imatrix_from_stats(stats)
        q = gguf.quantize_gguf(W, t, im)
        step, zero = q.step_and_zero()
        g = q.ggml
        return QuantResult(
            weight=q.weight, codes=q.codes, scales=step, zeros=zero, g_idx=_g_idx(W.shape[1], g.group), bits=g.bits,
            loss=_loss(W, q.weight, stats), seconds=time.perf_counter() - t0, diagnostics=dict(gguf_type=g.name),
            format=g.name, storage=q.fields, bits_per_weight=g.bits_per_weight)
    return fn


def _gguf_for_tensor(cfg: QuantConfig, site: TensorSite) -> tuple[str, dict]:
    imatrix = cfg.method.endswith("-imatrix")
    base = cfg.method.removesuffix("-imatrix")
    cols = site.shape[1]
    where = "the head" if site.block < 0 else f"layer {site.path} of block {site.block}"
    t = base
    if base in gguf_mixes.MIXES:
        category = "output" if site.block < 0 else gguf_mixes.tensor_category(site.path)
        t = gguf_mixes.mix_type(base, category, max(site.block, 0), site.n_blocks, cols)
    try:
        fb = gguf_mixes.fallback_type(t, cols)
    except QuantdynError as e:
        raise QuantdynError(f"{where}: {e}") from None
    notes: dict = {}
    if fb is not None:
        notes["gguf_fallback_from"] = gguf.GGML_TYPES.get(t).name
        t = fb
    return (f"{t}-imatrix" if imatrix and gguf.GGML_TYPES.get(t).takes_imatrix else t), notes


def _mix_fn(mix: str, imatrix: bool) -> Callable[..., QuantResult]:
    """Called without a tensor site (a direct call, not through the engine): the mix's default type."""
    return _gguf_fn(gguf_mixes.MIXES.get(mix).default, imatrix)


# ----------------------------------------------------------------------------- float formats


def _float_fn(quantize: Callable[[torch.Tensor], ff.FloatQuant], bits: int) -> Callable[..., QuantResult]:
    def fn(W: torch.Tensor, stats: ActStats | None, cfg: QuantConfig) -> QuantResult:
        t0 = time.perf_counter()
        q = quantize(W)
        return QuantResult(
            weight=q.weight, codes=q.codes, scales=q.scales, zeros=torch.zeros_like(q.scales),
            g_idx=_g_idx(W.shape[1], q.group), bits=bits, loss=_loss(W, q.weight, stats),
            seconds=time.perf_counter() - t0, format=q.format, codebook=q.codebook, storage=q.storage,
            bits_per_weight=q.bits_per_weight)
    return fn


def _rows_of(block: int, label: str) -> Callable[[QuantConfig, TensorSite], tuple[str, dict]]:
    """A float format whose scales cover ``block`` consecutive weights of a row: one line if the rows do not fit."""
    def for_tensor(cfg: QuantConfig, site: TensorSite) -> tuple[str, dict]:
        cols = site.shape[1]
        if block and cols % block:
            where = "the head" if site.block < 0 else f"layer {site.path} of block {site.block}"
            raise QuantdynError(f"{where} has {cols} input features; {label} needs a multiple of {block} "
                                f"(one scale per {block} consecutive weights of a row)")
        return cfg.method, {}
    return for_tensor


# ----------------------------------------------------------------------------- F16

F16 = "f16"
"""The type that keeps a tensor in 16-bit floats (llama.cpp's F16): no codes, 16 bits per weight."""


def _f16(W: torch.Tensor, stats: ActStats | None, cfg: QuantConfig) -> QuantResult:
    """The weight rounded to float16 (what a GGUF F16 tensor stores)."""
    t0 = time.perf_counter()
    Wq = W.to(torch.float16).to(W.dtype)
    rows, cols = W.shape
    return QuantResult(weight=Wq, codes=torch.zeros(0, dtype=torch.uint8), scales=torch.ones(rows, 1),
                       zeros=torch.zeros(rows, 1), g_idx=torch.zeros(cols, dtype=torch.int32), bits=16,
                       seconds=time.perf_counter() - t0, format=F16, bits_per_weight=16.0)


# ----------------------------------------------------------------------------- W4A4


def int4_per_token(x: torch.Tensor) -> torch.Tensor:
    """Activations (..., features) fake-quantized to symmetric 4-bit integers with a dynamic scale per token
    (row): scale = max |x| / 7, codes round(x / scale) in [-7, 7] (no clipping search: QuaRot's per-token
    symmetric activation grid with clip ratio 1). Returns float32 of x's shape."""
    X = x.to(torch.float32)
    scale = X.abs().amax(-1, keepdim=True) / 7.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.clamp(torch.round(X / scale), -7, 7) * scale


def _w4a4_weights(W: torch.Tensor, stats: ActStats | None, cfg: QuantConfig) -> QuantResult:
    """rtn4's weights (the format fixes 4 bits, group 128; the rest are QuantConfig's defaults: asymmetric)."""
    return rtn(W, cfg, stats.H if stats is not None else None)


# ----------------------------------------------------------------------------- registration


def _register() -> None:
    for name in gguf.GGML_TYPES:
        t = gguf.GGML_TYPES.get(name)
        QUANTIZERS.add(name, QuantMethod(_gguf_fn(name, False), False, FormatSpec(name, t.bits, t.group),
                                         _gguf_for_tensor))
        if t.takes_imatrix:  # ggml's Q8_0 ignores an importance matrix
            label = f"{name}-imatrix"
            QUANTIZERS.add(label, QuantMethod(_gguf_fn(name, True), True, FormatSpec(label, t.bits, t.group),
                                              _gguf_for_tensor, fp_calibration=True))
    for mix in gguf_mixes.MIXES:
        t = gguf.GGML_TYPES.get(gguf_mixes.MIXES.get(mix).default)
        QUANTIZERS.add(mix, QuantMethod(_mix_fn(mix, False), False, FormatSpec(mix, t.bits, t.group), _gguf_for_tensor))
        QUANTIZERS.add(f"{mix}-imatrix", QuantMethod(_mix_fn(mix, True), True, FormatSpec(f"{mix}-imatrix", t.bits, t.group),
                                                     _gguf_for_tensor, fp_calibration=True))
    QUANTIZERS.add("fp8", QuantMethod(_float_fn(ff.fp8_per_tensor, 8), False, FormatSpec("fp8", 8, 0),
                                      _rows_of(0, "fp8")))
    QUANTIZERS.add("fp8_channel", QuantMethod(_float_fn(ff.fp8_per_channel, 8), False,
                                              FormatSpec("fp8-channel", 8, 0), _rows_of(0, "fp8-channel")))
    QUANTIZERS.add("w8a8_fp8", QuantMethod(_float_fn(ff.fp8_per_channel, 8), False, FormatSpec("w8a8-fp8", 8, 0),
                                           _rows_of(0, "w8a8-fp8"), act_quant=ff.fp8_per_token))
    QUANTIZERS.add("w4a4", QuantMethod(_w4a4_weights, False, FormatSpec("w4a4", 4, 128), act_quant=int4_per_token))
    QUANTIZERS.add("nf4", QuantMethod(_float_fn(ff.nf4, 4), False, FormatSpec("nf4", 4, ff.NF4_BLOCK),
                                      _rows_of(ff.NF4_BLOCK, "nf4")))
    QUANTIZERS.add("mxfp4", QuantMethod(_float_fn(ff.mxfp4, 4), False, FormatSpec("mxfp4", 4, 32),
                                        _rows_of(32, "mxfp4")))
    QUANTIZERS.add("nvfp4", QuantMethod(_float_fn(ff.nvfp4, 4), False, FormatSpec("nvfp4", 4, 16),
                                        _rows_of(16, "nvfp4")))
    QUANTIZERS.add(F16, QuantMethod(_f16, False, FormatSpec(F16, 16, 0)))


_register()
