"""Low-precision float formats of weights (and activations): FP8 E4M3, NF4, MXFP4, NVFP4.

Every function is a pure tensor function of a weight W (out_features, in_features) returning a
:class:`FloatQuant`: the integer code of every weight, the scale of every group, the value of
every code (``codebook``), the dequantized weight and the format's stored fields.

* **FP8 E4M3** (OCP 8-bit floating point spec; NVIDIA Hopper): ``scale = amax / 448`` per tensor
  (:func:`fp8_per_tensor`) or per output channel (:func:`fp8_per_channel`), codes
  ``E4M3(clamp(W / scale, +-448))`` rounded to nearest even, value ``E4M3 * scale``. Reference:
  torchao ``Float8Tensor.from_hp`` (granularity PerTensor / PerRow), i.e. ``_choose_scale_float8``
  and ``_quantize_affine_float8``. :func:`fp8_per_token` is the same per row of an activation
  matrix (W8A8 dynamic activation quantization, vLLM/torchao "per-token"). A tensor (or row)
  that is all zero gets scale 1 and zero codes (torchao divides 0 by 0 there).
* **NF4** (Dettmers et al. 2023, QLoRA, Sec. 3 and App. E): blocks of 64 consecutive weights,
  codes = the NormalFloat level nearest to ``W / absmax`` (ties to the lower level), and the
  block absmax "double-quantized": minus their mean, in blocks of 256, to the 8-bit dynamic
  code of Dettmers et al. 2022 (8-bit optimizers) with an fp32 absmax per 256. Reference:
  bitsandbytes ``quantize_4bit(blocksize=64, compress_statistics=True, quant_type="nf4")`` on
  CPU (its torch kernel for the 4-bit codes, its C kernel ``quantize_cpu`` for the absmax).
* **MXFP4** (OCP Microscaling Formats v1.0, Sec. 5 and 6.3): 32 consecutive weights share an
  E8M0 scale ``2^(floor(log2 amax) - 2)`` (2 = emax of E2M1), elements E2M1
  ({0, 0.5, 1, 1.5, 2, 3, 4, 6} and signs) rounded to nearest even with saturation. Reference:
  torchao ``MXTensor.to_mx(elem_dtype=float4_e2m1fn_x2, block_size=32)`` (scaling mode FLOOR,
  the spec's); llama.cpp's MXFP4 breaks ties towards the smaller magnitude instead.
* **NVFP4** (NVIDIA Blackwell; two-level scaling): per tensor ``s_t = amax / (448 * 6)`` (fp32),
  per 16 weights an E4M3 scale ``E4M3(amax_16 / 6 / s_t)``, elements E2M1 of
  ``W / (s_t * s_16)``. Reference: torchao ``nvfp4_quantize`` with
  ``per_tensor_scale = per_tensor_amax_to_scale(amax)``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from quantdyn.errors import QuantdynError

F32 = torch.float32
FP8_MAX = 448.0
"""Largest finite E4M3 (fn) value."""
E2M1_MAX = 6.0
"""Largest E2M1 value."""
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
"""Value of each 4-bit E2M1 code (bit 3 = sign, bits 2-1 = exponent, bit 0 = mantissa)."""
NF4_VALUES = torch.tensor([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
], dtype=F32)
"""The 16 NormalFloat levels (QLoRA App. E), as float32."""
NF4_BLOCK = 64
"""Weights per NF4 absmax."""
NF4_ABSMAX_BLOCK = 256
"""Absmax values per double-quantization scale."""


@dataclass(frozen=True)
class FloatQuant:
    """One weight in a float format: ``weight = scales[:, g_idx] * codebook[codes]`` (NVFP4: times its
    per-tensor scale, folded into ``scales``)."""

    format: str
    """fp8_e4m3 | nf4 | mxfp4 | nvfp4."""
    codes: torch.Tensor
    """(out, in) uint8: the element code (an E4M3 byte, an NF4 index, an E2M1 nibble)."""
    scales: torch.Tensor
    """(out, n_groups) float32: the effective scale of each group as dequantization applies it."""
    group: int
    """Weights per group along a row (0 = the whole row)."""
    codebook: torch.Tensor
    """(2^bits,) float32: the value of every code."""
    weight: torch.Tensor
    """(out, in) float32: the dequantized weight, as the reference dequantizes."""
    storage: dict[str, torch.Tensor] = field(default_factory=dict)
    """The format's stored fields besides the codes (E8M0/E4M3 scale bytes, double-quantized absmax ...)."""
    bits_per_weight: float = 0.0
    """Storage bits per weight, scales included."""


def _check(W: torch.Tensor, block: int, what: str) -> torch.Tensor:
    if W.dim() != 2:
        raise QuantdynError(f"{what} needs a 2-D weight, got shape {tuple(W.shape)}")
    if block and W.shape[1] % block:
        raise QuantdynError(f"weight has rows of {W.shape[1]} values; {what} needs a multiple of {block} "
                            f"({what} scales blocks of {block} consecutive values of a row)")
    return W.detach().to(F32).contiguous()


def _fp8_codebook() -> torch.Tensor:
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()


def _fp8_rows(X: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, scale, dequantized) for a scale broadcast against X: torchao's float8 cast."""
    scale = amax / FP8_MAX
    scale = torch.where(amax > 0, scale, torch.ones_like(scale))
    q = (X / scale).clamp(min=-FP8_MAX, max=FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(torch.uint8), scale, q.to(F32) * scale


def fp8_per_tensor(W: torch.Tensor) -> FloatQuant:
    """FP8 E4M3 with one fp32 scale for the whole tensor (torchao PerTensor)."""
    X = _check(W, 0, "FP8")
    codes, scale, Wq = _fp8_rows(X, X.abs().amax())
    rows = X.shape[0]
    return FloatQuant("fp8_e4m3", codes, scale.reshape(1, 1).expand(rows, 1).contiguous(), 0, _fp8_codebook(), Wq,
                      dict(scale=scale.reshape(1)), 8 + 32 / X.numel())


def fp8_per_channel(W: torch.Tensor) -> FloatQuant:
    """FP8 E4M3 with one fp32 scale per output channel (row; torchao PerRow)."""
    X = _check(W, 0, "FP8")
    codes, scale, Wq = _fp8_rows(X, X.abs().amax(1, keepdim=True))
    return FloatQuant("fp8_e4m3", codes, scale, 0, _fp8_codebook(), Wq, dict(scale=scale[:, 0]), 8 + 32 / X.shape[1])


def fp8_per_token(x: torch.Tensor) -> torch.Tensor:
    """Activations (..., features) fake-quantized to FP8 E4M3 with a dynamic scale per token (row):
    what W8A8 FP8 inference (vLLM, torchao Float8DynamicActivationFloat8WeightConfig(PerRow)) computes
    before its FP8 matmul. Returns float32 of x's shape."""
    X = x.to(F32)
    return _fp8_rows(X, X.abs().amax(-1, keepdim=True))[2]


# ----------------------------------------------------------------------------- E2M1 (FP4)

_E2M1_THRESHOLDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
_E2M1_TIE_UP = torch.tensor([False, True, False, True, False, True, False])
"""Midpoints between consecutive magnitudes; at a tie, round to the code with an even mantissa bit
(up where the upper neighbour's code is even)."""


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """float32 -> 4-bit E2M1 codes, round to nearest even, saturating at +-6 (the sign of -0 and of negative
    values that round to 0 is kept, as a float cast does). uint8."""
    a = x.abs()
    mag = torch.bucketize(a, _E2M1_THRESHOLDS)  # thresholds strictly below a
    at = mag.clamp(max=len(_E2M1_THRESHOLDS) - 1)
    mag = mag + ((a == _E2M1_THRESHOLDS[at]) & _E2M1_TIE_UP[at]).to(mag.dtype)
    sign = torch.signbit(x).to(torch.int64) << 3
    return (mag | sign).to(torch.uint8)


def mxfp4(W: torch.Tensor) -> FloatQuant:
    """MXFP4: E2M1 elements, one E8M0 scale per 32 consecutive weights of a row (OCP MX v1.0)."""
    X = _check(W, 32, "MXFP4")
    rows, cols = X.shape
    xb = X.reshape(rows, cols // 32, 32)
    amax = xb.abs().amax(-1)
    exp = ((amax.view(torch.int32) >> 23) & 0xFF) - 127  # floor(log2 amax); -127 for 0 and subnormals
    e8m0 = (torch.clamp(exp - 2, -127, 128) + 127).to(torch.int32)
    div = torch.clamp((e8m0 << 23).view(F32), min=torch.finfo(F32).tiny)  # the spec's 2^-127 is stored, 2^-126 divides
    codes = e2m1_codes(xb / div[..., None])
    scale = torch.where(e8m0 > 0, (e8m0 << 23).view(F32), torch.full_like(amax, 2.0**-127))
    Wq = (E2M1_VALUES[codes.long()] * scale[..., None]).reshape(rows, cols)
    return FloatQuant("mxfp4", codes.reshape(rows, cols), scale, 32, E2M1_VALUES.clone(), Wq,
                      dict(e8m0=e8m0.to(torch.uint8)), 4 + 8 / 32)


def nvfp4(W: torch.Tensor) -> FloatQuant:
    """NVFP4: E2M1 elements, an E4M3 scale per 16 consecutive weights of a row and an fp32 scale per tensor."""
    X = _check(W, 16, "NVFP4")
    rows, cols = X.shape
    xb = X.reshape(rows, cols // 16, 16)
    tensor_amax = X.abs().amax()
    if float(tensor_amax) == 0.0:
        zero = torch.zeros(rows, cols // 16)
        return FloatQuant("nvfp4", torch.zeros(rows, cols, dtype=torch.uint8), zero, 16, E2M1_VALUES.clone(),
                          torch.zeros_like(X), dict(e4m3=zero.to(torch.float8_e4m3fn).view(torch.uint8),
                                                    tensor_scale=torch.zeros(1)), 4 + 8 / 16 + 32 / X.numel())
    s_t = tensor_amax / (FP8_MAX * E2M1_MAX)
    block_scale = xb.abs().amax(-1) / E2M1_MAX
    s8 = torch.clamp(block_scale / s_t, min=torch.finfo(torch.float8_e4m3fn).tiny, max=FP8_MAX).to(torch.float8_e4m3fn)
    s16 = s8.to(F32)
    recip = (1.0 / s_t) / s16
    codes = e2m1_codes(torch.clamp(xb * recip[..., None], -E2M1_MAX, E2M1_MAX))
    scale = s_t * s16
    Wq = (E2M1_VALUES[codes.long()] * scale[..., None]).reshape(rows, cols)
    return FloatQuant("nvfp4", codes.reshape(rows, cols), scale, 16, E2M1_VALUES.clone(), Wq,
                      dict(e4m3=s8.view(torch.uint8), tensor_scale=s_t.reshape(1)), 4 + 8 / 16 + 32 / X.numel())


# ----------------------------------------------------------------------------- NF4


def dynamic_code() -> torch.Tensor:
    """The signed 8-bit dynamic-tree code of Dettmers et al. (2016; 8-bit optimizers 2022): per exponent
    e = -6..0, the midpoints of a linear split of [0.1, 1] into 2^e' parts, times +-10^e; plus 0 and 1;
    sorted (256 float32 values; products taken in float32, as bitsandbytes ``create_dynamic_map``).
    Dequantization uses these values; bitsandbytes' CPU quantizer searches with -1 as the smallest."""
    values: list[float] = []
    for i in range(7):
        bounds = torch.linspace(0.1, 1, 2 ** i + 1, dtype=F32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        values += ((10 ** (-6 + i)) * means).tolist() + (-(10 ** (-6 + i)) * means).tolist()
    values += [0.0, 1.0]
    values += [0.0] * (256 - len(values))
    return torch.tensor(sorted(values), dtype=F32)


def _nearest_code(x: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """bitsandbytes ``quantize_cpu``: the code entry at or below x, moved up one if strictly closer."""
    idx = torch.clamp(torch.searchsorted(code, x, right=True) - 1, 0, code.numel() - 1)
    up = torch.clamp(idx + 1, max=code.numel() - 1)
    closer = (x - code[up]).abs() < (x - code[idx]).abs()
    return torch.where((idx < code.numel() - 1) & closer, up, idx)


def nf4(W: torch.Tensor) -> FloatQuant:
    """NF4 with blocksize 64 and the double-quantized absmax of bitsandbytes (``compress_statistics``)."""
    X = _check(W, NF4_BLOCK, "NF4")
    rows, cols = X.shape
    xb = X.reshape(-1, NF4_BLOCK)
    absmax = xb.abs().max(-1).values
    scaled = torch.clamp(xb * (1.0 / absmax.clamp(min=1e-38)[:, None]), -1, 1)
    codes = torch.bucketize(scaled, (NF4_VALUES[:-1] + NF4_VALUES[1:]) / 2).to(torch.uint8)
    # double quantization of the absmax
    offset = absmax.mean()
    centred = absmax - offset
    n = centred.numel()
    pad = -n % NF4_ABSMAX_BLOCK
    blocks = torch.cat([centred, centred.new_zeros(pad)]).reshape(-1, NF4_ABSMAX_BLOCK)
    absmax2 = blocks.abs().max(-1).values  # the zero padding never raises a block's max |.|
    code8 = dynamic_code()
    search = code8.clone()
    search[0] = -1.0  # bitsandbytes' quantize_cpu searches with -1 in place of -0.99297 (its comment: range)
    normed = (blocks / absmax2[:, None]).reshape(-1)[:n]
    qabs = _nearest_code(normed, search)
    absmax_hat = (code8[qabs].reshape(-1) * absmax2.repeat_interleave(NF4_ABSMAX_BLOCK)[:n]) + offset
    Wq = (NF4_VALUES[codes.long()] * absmax_hat[:, None]).reshape(rows, cols)
    bpw = 4 + 8 / NF4_BLOCK + 32 * absmax2.numel() / X.numel() + 32 / X.numel()
    return FloatQuant("nf4", codes.reshape(rows, cols), absmax_hat.reshape(rows, -1), NF4_BLOCK, NF4_VALUES.clone(),
                      Wq, dict(absmax_q=qabs.to(torch.uint8), absmax_scale=absmax2, absmax_offset=offset.reshape(1),
                               ), bpw)
