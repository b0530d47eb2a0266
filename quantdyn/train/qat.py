"""Quantization-aware training: fake quantization of linear layers with a
straight-through estimator (STE).

Three quantizers (``QATConfig.method``):

* ``'ste'``: plain asymmetric min-max, per output row for weights and per token
  for activations, ``2**bits`` levels on the grid of quantize/primitives.py (the
  one RTN and GPTQ use); the gradient is the identity (the min-max range covers
  every entry, so nothing is clipped).
* ``'quest'``: the QuEST quantizer used for QAT in paper B (Panferov et al.
  2025): a Hadamard transform over blocks of ``hadamard_block`` input features
  (applied to the weight rows and to the activations, so ``(xH)(WH)^T = xW^T``),
  clipping scale ``s = alpha_b * RMS(row)`` with ``alpha_b`` the Gaussian-MSE-
  optimal constant (:data:`GAUSSIAN_OPTIMAL_CLIP`, 2.514 at 4 bits), a symmetric
  uniform grid of ``2**bits`` levels spanning ``[-s, s]``, and a trust mask on
  the gradient: it passes only where ``|x| <= s`` (``trust_mask=True``).
* ``'format'`` (``QATConfig.format``: a registered quantizer's label, ``rtn4`` = int4 g128, ``q4_k``, ``nvfp4``):
  the deployment format's own fake quantization of the weights of every block linear, straight-through: the
  forward uses Q(W) dequantized, computed by the quantizer's registered function (quantize/; one implementation of
  each format), the gradient goes to the latent W unchanged (identity); activations stay in full precision and the
  head is not quantized. Each linear is quantized as the engine quantizes it (a llama.cpp mix's type for that
  tensor, a shape fallback), so the model trained is the model a sweep deploys with that label
  (:func:`qat_format_config` says which formats have this path).

Block size: if a layer's input width is not a multiple of ``hadamard_block``,
the largest power of two that divides the width is used instead (e.g. 96 -> 32);
a width with no even divisor (odd width) raises :class:`QuantdynError`.

Model surgery: :func:`prepare_qat` swaps every ``nn.Linear`` (except the output
head unless ``include_head``; embeddings are not linears and stay full
precision) for a :class:`QATLinear` that owns the *same* ``weight``/``bias``
parameters under the same names, so a QAT checkpoint loads into a plain model.
:func:`strip_qat` swaps them back (latent full-precision weights).

Evaluation of a QAT model with the PTQ engine's metrics:

* weights only -- :func:`fake_quantize_weights_` writes ``Q(W)`` (dequantized,
  in the original basis; for QuEST ``Q(WH)H^T``) into a plain model in place:
  the "deployed" QAT model.  Activations are *not* quantized in a plain forward.
* weights and activations -- :func:`fake_quant_forward` is a context manager
  inside which the model runs the W+A fake-quantized forward (the QAT forward).
"""
from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from quantdyn.config import OMIT_DEFAULT
from quantdyn.errors import QuantdynError, unknown_name
from quantdyn.models.adapters import adapter_for
from quantdyn.quantize.catalogue import (AUTO_PREFIX, PLAN_PREFIX, QUANTIZERS, BlockTransform, QuantConfig, TensorSite,
                                      config_for_tensor, parse_quantizer, rotation_of)
from quantdyn.quantize.primitives import fake_quantize, find_params

METHODS = ("ste", "quest", "format")

# Clipping scale, in units of the standard deviation, that minimises the MSE of
# quantizing N(0, 1) onto 2**b uniform levels whose outermost levels sit at +-alpha
# (step 2*alpha/(2**b - 1)), the QuEST grid.  Computed by golden-section search
# over alpha of the exact MSE (trapezoid quadrature on [-12, 12], 2e6 points, float64);
# :func:`gaussian_optimal_clip` recomputes any entry (b=1 gives sqrt(2/pi) = 0.7979).
GAUSSIAN_OPTIMAL_CLIP: dict[int, float] = {
    1: 0.7979, 2: 1.4935, 3: 2.0511, 4: 2.5140, 5: 2.9162, 6: 3.2780, 7: 3.6111, 8: 3.9222,
}


@dataclass(frozen=True)
class QATConfig:
    """Fake quantization applied during QAT (paper B: QuEST, W4A4)."""

    method: str = "quest"
    """'quest' (Hadamard + Gaussian-optimal clipping + trust mask) or 'ste' (min-max STE)."""
    w_bits: int = 4
    """Weight bits, 1..8 (paper B: 4)."""
    a_bits: int | None = 4
    """Activation bits (input of every quantized linear), 1..8; 0 or None = activations stay full precision."""
    hadamard_block: int = 128
    """Hadamard block over input features for 'quest' (power of two; paper B: 128)."""
    trust_mask: bool = True
    """'quest': gradient passes only where |x| <= clipping scale (False = plain identity STE)."""
    include_head: bool = False
    """Also quantize the output head (embed_out / lm_head); embeddings are never quantized."""
    format: str = field(default="", metadata=OMIT_DEFAULT)
    """A deployment format's quantizer label (rtn4 = int4 g128, rtn4g64, q4_k, q4_k_m, nvfp4, ...): train with
    that format's own straight-through fake quantization of the block linears' weights (method 'format', set
    by this field; activations stay full precision). '' = method's own quantizer."""

    def __post_init__(self):
        if self.format or self.method == "format":
            _set_format_fields(self)
        if self.method not in METHODS:
            raise unknown_name("QAT method", self.method, METHODS)
        if not 1 <= self.w_bits <= 8:
            raise QuantdynError(f"qat.w_bits={self.w_bits} must be in 1..8 (paper B: 4)")
        if self.a_bits is not None and not 0 <= self.a_bits <= 8:
            raise QuantdynError(f"qat.a_bits={self.a_bits} must be in 1..8, or 0/null for no activation quantization")
        if self.method == "ste" and (self.w_bits < 2 or (self.a_bits or 2) < 2):
            raise QuantdynError("qat method 'ste' (min-max) needs at least 2 bits; use method 'quest' for 1 bit")
        b = self.hadamard_block
        if b < 1 or b & (b - 1):
            raise QuantdynError(f"qat.hadamard_block={b} must be a power of two (paper B: 128)")

    @property
    def act_bits(self) -> int:
        """Activation bits, 0 when activations are not quantized."""
        return self.a_bits or 0

    @property
    def label(self) -> str:
        """What a row's ``qat`` field says: the format's label (``rtn4``), else ``quest-w4a4``."""
        return self.format or f"{self.method}-w{self.w_bits}a{self.act_bits}"


def _set_format_fields(cfg: QATConfig) -> None:
    """method 'format': the format fixes the weight bits and quantizes no activations (QATConfig's defaults give
    way to it, as a format's bits and group size do in QuantConfig); a contrary value is one line."""
    if not cfg.format:
        raise QuantdynError("qat.method=format needs qat.format, a quantizer label such as rtn4 or q4_k")
    qc = qat_format_config(cfg.format)
    defaults = QATConfig.__dataclass_fields__
    if cfg.method not in ("format", defaults["method"].default):
        raise QuantdynError(f"qat.format={cfg.format} trains with the format's own quantizer; drop "
                            f"qat.method={cfg.method}")
    if cfg.w_bits not in (qc.bits, defaults["w_bits"].default):
        raise QuantdynError(f"qat.format={cfg.format} has {qc.bits}-bit weights by definition; drop "
                            f"qat.w_bits={cfg.w_bits}")
    if cfg.a_bits not in (None, 0, defaults["a_bits"].default) or cfg.include_head:
        what = "qat.include_head" if cfg.include_head else f"qat.a_bits={cfg.a_bits}"
        raise QuantdynError(f"qat.format={cfg.format} quantizes the block linears' weights only; drop {what}")
    for name, value in (("method", "format"), ("w_bits", qc.bits), ("a_bits", None), ("format", qc.name)):
        object.__setattr__(cfg, name, value)


def qat_formats() -> list[str]:
    """The registered quantizers that have a fake-quantized training path: those that quantize a weight from
    the weight alone (no calibration data, no activation quantization, not a per-tensor plan)."""
    return [n for n in QUANTIZERS.names()
            if not QUANTIZERS.get(n).needs_calibration and QUANTIZERS.get(n).act_quant is None]


def qat_format_config(label: str) -> QuantConfig:
    """The QuantConfig of a QAT format label, or one line naming the formats that have a training path."""
    qc = parse_quantizer(label)
    method = QUANTIZERS.get(qc.method)
    why = ("it needs calibration data" if method.needs_calibration else
           "it also quantizes activations" if method.act_quant is not None else
           "a per-tensor plan" if qc.method.startswith((PLAN_PREFIX, AUTO_PREFIX)) else
           f"its rotation (+{rotation_of(qc)}) is applied at deployment only" if rotation_of(qc) else
           "its head is not quantized in training (no -head)" if qc.quantize_head else "")
    if why:
        names = [QUANTIZERS.get(n).format.label if QUANTIZERS.get(n).format else f"{n}<bits>[g<group>]"
                 for n in qat_formats()]
        raise QuantdynError(f"QAT format '{label}' has no fake-quantized training path ({why}); formats that have "
                            f"one: {', '.join(names)} (e.g. rtn4 = int4 g128)")
    return qc


# --------------------------------------------------------------------------- primitives


def gaussian_optimal_clip(bits: int, points: int = 400_001, iters: int = 60) -> float:
    """alpha minimising E[(Q_alpha(x) - x)^2] for x ~ N(0, 1) on the QuEST grid
    (2**bits levels, outermost at +-alpha); golden-section search, float64 quadrature."""
    x = torch.linspace(-12.0, 12.0, points, dtype=torch.float64)
    w = torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi) * (x[1] - x[0])
    n = 2**bits - 1

    def mse(a: float) -> float:
        d = 2 * a / n
        q = torch.clamp(torch.round((x + a) / d), 0, n) * d - a
        return float(((q - x) ** 2 * w).sum())

    lo, hi = 0.1, 8.0
    g = (math.sqrt(5) - 1) / 2
    for _ in range(iters):
        m1, m2 = hi - g * (hi - lo), lo + g * (hi - lo)
        if mse(m1) < mse(m2):
            hi = m2
        else:
            lo = m1
    return (lo + hi) / 2


@functools.lru_cache(maxsize=16)
def _hadamard_cpu(n: int) -> torch.Tensor:
    H = torch.ones(1, 1, dtype=torch.float64)
    while H.size(0) < n:  # Sylvester construction
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    return (H / math.sqrt(n)).float()


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """Orthonormal (Sylvester) Hadamard matrix of size n (a power of two): H H^T = I, H = H^T."""
    if n < 1 or n & (n - 1):
        raise QuantdynError(f"Hadamard size {n} must be a power of two")
    return _hadamard_cpu(n).to(dtype=dtype, device=device)


def hadamard_block_size(width: int, block: int) -> int:
    """Block actually used for a width: ``block`` if it divides the width, else the
    largest power of two that divides the width (and is <= block)."""
    if width % block == 0:
        return block
    b = min(width & -width, block)
    if b < 2:
        raise QuantdynError(
            f"input width {width} has no even divisor for the QuEST Hadamard transform; "
            "use qat.method='ste' or an even width"
        )
    return b


def hadamard_transform(x: torch.Tensor, block: int) -> torch.Tensor:
    """Block-diagonal Hadamard transform along the last dim: x -> x @ blockdiag(H_block).
    The same call is its own inverse (H is symmetric and orthogonal)."""
    n = x.shape[-1]
    b = hadamard_block_size(n, block)
    H = hadamard_matrix(b, x.dtype, x.device)
    return (x.reshape(*x.shape[:-1], n // b, b) @ H).reshape(x.shape)


def minmax_fake_quant(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Asymmetric min-max fake quantization over the last dim (per row / per token), 2**bits levels, on the
    grid of quantize/primitives.py (:func:`find_params`, the grid RTN and GPTQ use); straight-through
    gradient (identity)."""
    with torch.no_grad():
        rows = x.reshape(-1, x.shape[-1])
        scale, zero = find_params(rows, bits, sym=False)
        q = fake_quantize(rows, scale.unsqueeze(1), zero.unsqueeze(1), 2**bits - 1).reshape(x.shape)
    return x + (q - x).detach()


def quest_fake_quant(x: torch.Tensor, bits: int, trust_mask: bool = True) -> torch.Tensor:
    """QuEST fake quantization over the last dim (call on Hadamard-transformed data):
    s = alpha_bits * RMS, 2**bits symmetric levels on [-s, s]; gradient = 1 where
    |x| <= s and 0 elsewhere with ``trust_mask``, else 1 everywhere."""
    n = 2**bits - 1
    with torch.no_grad():
        s = (GAUSSIAN_OPTIMAL_CLIP[bits] * x.pow(2).mean(dim=-1, keepdim=True).sqrt()).clamp(min=1e-12)
        d = 2 * s / n
        q = torch.clamp(torch.round((x + s) / d), 0, n) * d - s
    if not trust_mask:
        return x + (q - x).detach()
    mask = (x.abs() <= s).to(x.dtype)
    xm = x * mask
    return xm + (q - xm).detach()


def format_fake_quant(W: torch.Tensor, qc: QuantConfig) -> torch.Tensor:
    """Straight-through fake quantization of a weight W (out, in) with a registered quantizer ``qc`` (already
    resolved for its tensor, ``config_for_tensor``): the value is Q(W) dequantized, as the quantizer's own
    function computes it, the gradient is the identity to W."""
    return W + (_format_weight(W, qc) - W).detach()


@torch.no_grad()
def _format_weight(W: torch.Tensor, qc: QuantConfig) -> torch.Tensor:
    """Q(W) dequantized, in W's dtype, by the registered quantizer's own function (on a float32 copy)."""
    return QUANTIZERS.get(qc.method).fn(W.detach().float().clone(), None, qc).weight.to(W.dtype)


def fake_quantize_weight(W: torch.Tensor, cfg: QATConfig, qc: QuantConfig | None = None) -> torch.Tensor:
    """Dequantized quantized weight in the original basis (what a plain linear would hold); method 'format'
    takes the tensor's resolved quantizer ``qc`` (default: the format's own)."""
    if cfg.method == "format":
        return format_fake_quant(W, qc or qat_format_config(cfg.format))
    if cfg.method == "ste":
        return minmax_fake_quant(W, cfg.w_bits)
    Wh = hadamard_transform(W, cfg.hadamard_block)
    return hadamard_transform(quest_fake_quant(Wh, cfg.w_bits, cfg.trust_mask), cfg.hadamard_block)


# --------------------------------------------------------------------------- module


class QATLinear(nn.Linear):
    """``nn.Linear`` with fake-quantized weights (and inputs); same parameter names."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, cfg: QATConfig | None = None,
                 device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.qat_config = cfg or QATConfig()
        if self.qat_config.method == "quest":
            hadamard_block_size(in_features, self.qat_config.hadamard_block)  # fail early on odd widths
        self.format_config: QuantConfig | None = None  # method 'format': this tensor's quantizer (prepare_qat)
        self._cached: tuple[tuple, torch.Tensor] | None = None

    @classmethod
    def from_linear(cls, lin: nn.Linear, cfg: QATConfig, site: TensorSite | None = None) -> "QATLinear":
        """A QATLinear sharing ``lin``'s parameter objects (no copy); method 'format' resolves the format for
        the tensor at ``site`` as the engine does (a mix's type, a shape fallback)."""
        q = cls(lin.in_features, lin.out_features, bias=lin.bias is not None, cfg=cfg, device="meta")
        q.weight = lin.weight
        q.bias = lin.bias
        q.train(lin.training)
        if cfg.method == "format":
            site = site or TensorSite("", 0, 1, (lin.out_features, lin.in_features))
            q.format_config = config_for_tensor(qat_format_config(cfg.format), site)[0]
        return q

    @torch.compiler.disable  # under train.compile: called as it is (its cache test would recompile every step)
    def quantized_weight(self) -> torch.Tensor:
        """Q(W) of the format (method 'format'), computed once per state of the weight: micro-batches of one
        step share it; an optimizer step (or SAM's perturbation) changes the weight's version and so Q(W)."""
        W = self.weight
        key = (W._version, W.data_ptr(), W.device, W.dtype)
        if self._cached is None or self._cached[0] != key:
            self._cached = (key, _format_weight(W, self.format_config))
            self.fake_quantizations += 1
        return self._cached[1]

    fake_quantizations = 0
    """How many times this layer computed Q(W) (method 'format'): the cost QAT adds, counted."""

    def to_linear(self) -> nn.Linear:
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        lin.weight = self.weight
        lin.bias = self.bias
        lin.train(self.training)
        return lin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.qat_config
        if cfg.method == "format":  # straight-through: the value Q(W), the gradient the identity to W
            return F.linear(x, self.weight + (self.quantized_weight() - self.weight).detach(), self.bias)
        if cfg.method == "ste":
            xq = minmax_fake_quant(x, cfg.act_bits) if cfg.act_bits else x
            return F.linear(xq, minmax_fake_quant(self.weight, cfg.w_bits), self.bias)
        blk = cfg.hadamard_block
        Wq = quest_fake_quant(hadamard_transform(self.weight, blk), cfg.w_bits, cfg.trust_mask)  # (out, in), rotated
        if cfg.act_bits:
            xq = quest_fake_quant(hadamard_transform(x, blk), cfg.act_bits, cfg.trust_mask)
            return F.linear(xq, Wq, self.bias)  # (xH)(WH)^T = x W^T
        return F.linear(x, hadamard_transform(Wq, blk), self.bias)

    def extra_repr(self) -> str:
        c = self.qat_config
        if c.method == "format":
            return f"{super().extra_repr()}, format={self.format_config.name if self.format_config else c.format}"
        return f"{super().extra_repr()}, method={c.method}, w_bits={c.w_bits}, a_bits={c.act_bits}"


# --------------------------------------------------------------------------- surgery


def _head_module(model: nn.Module) -> nn.Module | None:
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    for attr in ("embed_out", "lm_head"):
        if head is None:
            head = getattr(model, attr, None)
    return head if isinstance(head, nn.Module) else None


def _target_linears(model: nn.Module, cfg: QATConfig) -> list[tuple[nn.Module, str, nn.Linear]]:
    head = _head_module(model)
    out = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child) is nn.Linear and (cfg.include_head or child is not head):
                out.append((parent, name, child))
    return out


def _block_linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear, TensorSite]]:
    """Every linear of the model's decoder blocks, with its parent, name and the site the engine quantizes it
    at (its path in the block, the block's index): the layers method 'format' trains through."""
    adapter = adapter_for(model)
    blocks = adapter.get_blocks(model)
    out = []
    for b, block in enumerate(blocks):
        for path, lin in (x for grp in adapter.linear_groups(block) for x in grp):
            if isinstance(lin, QATLinear):
                continue
            if type(lin) is not nn.Linear:
                raise QuantdynError(f"QAT format training swaps nn.Linear layers; '{path}' of block {b} is a "
                                    f"{type(lin).__name__}")
            parent_path, _, name = path.rpartition(".")
            parent = block.get_submodule(parent_path) if parent_path else block
            site = TensorSite(path, b, len(blocks), (lin.out_features, lin.in_features))
            out.append((parent, name, lin, site))
    return out


def prepare_qat(model: nn.Module, cfg: QATConfig) -> nn.Module:
    """Swap the model's linears (not the head unless ``include_head``) for QATLinear,
    in place; parameter objects and names are unchanged. Returns ``model``. Method 'format': the decoder
    blocks' linears, each with its tensor's quantizer (what the engine quantizes with the format's label)."""
    if cfg.method == "format":
        found = _block_linears(model)
        for parent, name, lin, site in found:
            setattr(parent, name, QATLinear.from_linear(lin, cfg, site))
        if not found and not any(isinstance(m, QATLinear) for m in model.modules()):
            raise QuantdynError("prepare_qat found no nn.Linear layers to quantize in this model")
        return model
    targets = _target_linears(model, cfg)
    if not targets and not any(isinstance(m, QATLinear) for m in model.modules()):
        raise QuantdynError("prepare_qat found no nn.Linear layers to quantize in this model")
    for parent, name, lin in targets:
        setattr(parent, name, QATLinear.from_linear(lin, cfg))
    return model


def strip_qat(model: nn.Module) -> nn.Module:
    """Swap every QATLinear back to a plain nn.Linear with the same (latent, full
    precision) parameters, in place. Returns ``model``."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, QATLinear):
                setattr(parent, name, child.to_linear())
    return model


@torch.no_grad()
def fake_quantize_weights_(model: nn.Module, cfg: QATConfig) -> nn.Module:
    """Write the quantized weights (dequantized, original basis) into the model's
    linears in place -- the deployed QAT model.  Works on plain and QAT models;
    activations are not touched (use :func:`fake_quant_forward` for W+A).
    Returns ``model``."""
    if cfg.method == "format":
        found = _block_linears(model)
        for _, _, lin, site in found:
            lin.weight.copy_(_format_weight(lin.weight, config_for_tensor(qat_format_config(cfg.format), site)[0]))
        if not found:
            raise QuantdynError("fake_quantize_weights_ found no nn.Linear layers in this model")
        return model
    head = _head_module(model)
    n = 0
    for m in model.modules():
        if isinstance(m, nn.Linear) and (cfg.include_head or m is not head):
            m.weight.copy_(fake_quantize_weight(m.weight, cfg))
            n += 1
    if n == 0:
        raise QuantdynError("fake_quantize_weights_ found no nn.Linear layers in this model")
    return model


@contextlib.contextmanager
def fake_quant_forward(model: nn.Module, cfg: QATConfig) -> Iterator[nn.Module]:
    """Within the block the model runs the W+A fake-quantized (QAT) forward; the
    original linear modules are put back on exit. Weights are not modified."""
    if cfg.method == "format":
        targets = [(parent, name, lin) for parent, name, lin, _ in _block_linears(model)]
        sites = [site for *_, site in _block_linears(model)]
    else:
        targets = _target_linears(model, cfg)
        sites = [None] * len(targets)
    try:
        for (parent, name, lin), site in zip(targets, sites):
            setattr(parent, name, QATLinear.from_linear(lin, cfg, site))
        yield model
    finally:
        for parent, name, lin in targets:
            setattr(parent, name, lin)


class QATDeployed(BlockTransform):
    """A QAT model in its deployed form, as a variant of the streamed measurement: every linear of each block
    (and the head with ``include_head``) runs the W+A fake-quantized forward of ``cfg``."""

    def __init__(self, cfg: QATConfig):
        if cfg.method == "format":
            raise QuantdynError(f"a format-QAT model (qat.format={cfg.format}) is deployed by the quantizer of that "
                                f"label (a sweep with --quantizers {cfg.format}), not by a QAT block transform")
        self.cfg = cfg
        self.name = f"qat-{cfg.method}-w{cfg.w_bits}a{cfg.a_bits or 0}"

    def block(self, block: nn.Module) -> nn.Module:
        return prepare_qat(block, self.cfg)

    def head(self, head: nn.Module) -> nn.Module | None:
        if self.cfg.include_head and type(head) is nn.Linear:
            return QATLinear.from_linear(head, self.cfg)
        return None


__all__ = [
    "QATConfig", "QATLinear", "qat_formats", "qat_format_config", "format_fake_quant", "fake_quantizations",
    "GAUSSIAN_OPTIMAL_CLIP", "gaussian_optimal_clip", "hadamard_matrix",
    "hadamard_block_size", "hadamard_transform", "minmax_fake_quant", "quest_fake_quant",
    "fake_quantize_weight", "prepare_qat", "strip_qat", "fake_quantize_weights_", "fake_quant_forward", "QATDeployed",
]


def fake_quantizations(model: nn.Module) -> int:
    """Q(W) computations of a format-QAT model's layers so far (each QATLinear's count, summed)."""
    return sum(m.fake_quantizations for m in model.modules() if isinstance(m, QATLinear))
