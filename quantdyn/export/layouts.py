"""The two deployable checkpoint formats: what each can hold and how a layer is stored.

quantdyn's codes for one linear layer (see ``ModelQuantization.packed``):
``codes`` uint8 (out, in) in [0, 2^bits), ``scales`` and ``zeros`` (out, groups),
``g_idx`` int (in,), with the dequantized weight

    W[o, i] = scales[o, g_idx[i]] * (codes[o, i] - zeros[o, g_idx[i]]).

GPTQ (``quant_method: gptq``; read by GPTQModel, AutoGPTQ, transformers + optimum, vLLM)
    ``qweight`` int32 (in*bits/32, out): codes packed along the input dim (packing.py);
    ``qzeros`` int32 (groups, out*bits/32): zero points packed along the output dim;
    ``scales`` float16 (groups, out) -- the GPTQ linear layers of GPTQModel/AutoGPTQ keep
    float16 scale buffers, so scales are rounded to float16 (relative error <= 2^-11);
    ``g_idx`` int32 (in,): the group of each input column (a permutation of groups with
    act-order, ``desc_act: true``). Bits 2, 3, 4 or 8 (5-7 exist only in GPTQModel's own
    planar ``gptq_p`` layout; optimum, through which transformers loads GPTQ, accepts 2, 3, 4, 8). 3 bits needs in and out
    features divisible by 32 (32 codes fill 3 words).
    ``checkpoint_format``: ``gptq`` (v1) stores every zero point minus one, the convention
    of the original GPTQ/AutoGPTQ code; a zero point of 0 (asymmetric grid of a group with
    no negative weight) has no v1 encoding that all readers agree on (field-wise readers --
    vLLM's GPTQ kernels, GPTQModel's own dequantizer -- add one to each decoded field, while
    GPTQModel's loader adds 0x11111111 to whole 4-bit words, carrying into the neighbouring
    field), so v1 refuses it with an error naming the layer;
    ``gptq_v2`` stores zero points as they are (GPTQModel's internal form; transformers reads
    it through GPTQModel, and vLLM since it added gptq_v2 support in late 2025).

compressed-tensors ``pack-quantized`` (``quant_method: compressed-tensors``; written by
llm-compressor, served by vLLM, read by transformers with the compressed-tensors package)
    ``weight_packed`` int32 (out, in*bits/32): the codes packed along the input dim -- the
    library stores signed values q - 2^(bits-1) plus an offset of 2^(bits-1), i.e. exactly
    quantdyn's unsigned codes; ``weight_scale`` (out, groups) in ``scale_dtype``;
    ``weight_zero_point`` int32 (ceil(out*bits/32), groups), asymmetric grids only: the signed
    zero point z - 2^(bits-1), offset and packed along the OUTPUT dim -- what the library's own
    ``PackedQuantizationCompressor.compress`` writes (``pack_to_int32(zp, bits, packed_dim=0)``)
    and what vLLM's WNA16 scheme allocates (``out // pack_factor`` rows, ``packed_dim=0``);
    ``weight_shape`` int64 [out, in]. Symmetric grids (zero 2^(bits-1)) store no zero point.
    Bits 2..8; vLLM's kernels serve 4 and 8 bits; widths that do not divide 32 (3, 5, 6, 7)
    use the dense layout of compressed-tensors >= 0.18 (older versions packed floor(32/bits)
    codes per word). Groups must divide in_features (the library's rule). Act-order with a
    permuted ``g_idx`` (``actorder: group``, tensor ``weight_g_idx``) was removed from
    compressed-tensors in 0.19, so it is refused: export such quantizers as GPTQ, or
    quantize with static groups or group-aware ordering, whose groups stay contiguous.

    Asymmetric exports carry ``"dequantize": true`` in their quantization_config. Without it,
    transformers (5.x, compressed-tensors 0.19+) builds every quantized module on the meta device
    with ``compress_model``, whose meta branch leaves ``weight_zero_point`` unpacked, (out,
    groups) int8, so the packed tensor above -- of any asymmetric pack-quantized checkpoint,
    llm-compressor's included -- is refused with a size mismatch (``ckpt: [48, 1] vs model:
    [384, 1]``), while the same library's decompressor (run on the first forward) needs it packed:
    no one tensor satisfies both. ``dequantize`` is read by transformers' CompressedTensorsConfig
    from config.json and decompresses each layer while loading through the library's own
    decompressor, which reads the packed zero point; vLLM and compressed-tensors ignore the key.
    The loaded model is the same either way: transformers has no packed-int kernels for these
    layers, and the compressed route also decompresses the whole model on its first forward.

Rotations (``+had``, quantize/rotation.py) are exported as compressed-tensors only, the way llm-compressor writes
its QuIP transforms and vLLM reads them: the codes are those of W R, and ``quantization_config.transform_config``
holds one scheme ``had`` of type ``random-hadamard`` applied at the ``input`` of every quantized layer (online,
x -> x M / sqrt(n)); its matrix M = D H (±1, what compressed-tensors stores unnormalized) is the tensor
``<layer>.had_input.weight``, stored once per width under the first quantized layer of that width, as
llm-compressor saves transform weights that all layers of a width share (tied) and as vLLM loads them (one shared
tensor per scheme and size). GPTQ and GGUF have no place for a rotation and refuse ``+had``; ``+r1`` (the
residual stream, folded into the embedding, norms and head) is not exported at all.

Neither format has per-input-channel scales, so quantdyn's AWQ (scales s per linear, divided
back out of the weight) cannot be exported; neither loader quantizes the output head
through these configs, so ``quantize_head`` is refused too.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

import torch

from quantdyn import __version__
from quantdyn.config import config_hash, to_dict
from quantdyn.errors import QuantdynError
from quantdyn.export.packing import pack_rows
from quantdyn.quantize.catalogue import QUANTIZERS, QuantConfig
from quantdyn.quantize.rotation import hadamard_matrix
from quantdyn.registry import Registry

GPTQ_BITS = (2, 3, 4, 8)
"""Bit widths a GPTQ v1/v2 checkpoint holds."""
CT_BITS = (2, 3, 4, 5, 6, 7, 8)
"""Bit widths quantdyn writes as compressed-tensors pack-quantized."""
GPTQ_CHECKPOINT_FORMATS = ("gptq", "gptq_v2")
"""Zero-point conventions of GPTQ checkpoints (v1: zero - 1; v2: zero)."""
SCALE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
"""Scale dtypes by name (compressed-tensors stores the model's dtype)."""


@dataclass(frozen=True)
class ExportSettings:
    """Resolved per-export choices, fixed when the export is opened."""

    scale_dtype: torch.dtype
    """dtype of the stored scales."""
    checkpoint_format: str | None
    """GPTQ only: 'gptq' or 'gptq_v2'."""
    desc_act: bool
    """GPTQ only: whether g_idx may be a permutation of groups (act-order)."""
    transform_owners: frozenset[str] | None = None
    """compressed-tensors with ``+had``: the layers that carry their width's transform matrix (the first
    quantized layer of each width); None: every layer carries its own."""


@dataclass(frozen=True)
class ExportFormat:
    """A checkpoint format: its checks, per-layer tensors and quantization_config."""

    name: str
    """Registry name ('gptq', 'compressed-tensors')."""
    summary: str
    """One line: what reads it."""
    check: Callable[[QuantConfig, str, torch.dtype, dict], ExportSettings]
    """(qcfg, model_type, model dtype, options) -> settings, or a QuantdynError naming what the format supports."""
    check_layer: Callable[[str, int, int, QuantConfig], None]
    """(layer name, out_features, in_features, qcfg) -> None, or a QuantdynError if the format cannot hold a
    layer of that shape (known before any work: the writer is given every layer's shape when it opens)."""
    layer_tensors: Callable[[str, dict[str, torch.Tensor], QuantConfig, ExportSettings], dict[str, torch.Tensor]]
    """(layer name, quantdyn codes/scales/zeros/g_idx, qcfg, settings) -> checkpoint tensors."""
    config: Callable[[QuantConfig, list[str], ExportSettings], dict]
    """(qcfg, quantized layer names, settings) -> the quantization_config of config.json."""
    open_writer: Callable[..., Any] | None = None
    """Formats that are not a safetensors directory (GGUF: one file) bring their own writer:
    ``open_writer(out, source_config, qcfg, model_type, **options)`` with ExportWriter's methods."""


EXPORT_FORMATS: Registry[ExportFormat] = Registry("export format")
"""Formats quantdyn writes (``quantdyn quantize --export NAME``)."""


# ----------------------------------------------------------------------------- shared checks


def permuted_groups(qcfg: QuantConfig) -> bool:
    """Whether ``qcfg`` gives g_idx that is not ``i // group_size`` (act-order with dynamic groups)."""
    return bool(qcfg.act_order and qcfg.group_size and not qcfg.static_groups)


def _common_refusals(qcfg: QuantConfig, fmt: str) -> None:
    if QUANTIZERS.get(qcfg.method).format is not None:
        raise QuantdynError(f"{fmt} checkpoints hold integer grids; the format {qcfg.name} is exported with "
                            f"--export gguf (GGUF block types) or not at all")
    if qcfg.method == "awq":
        raise QuantdynError(
            f"{fmt} checkpoints have no per-input-channel scales, and quantdyn's AWQ gives every linear its own "
            f"scales (they cannot be folded into a shared norm); export an rtn or gptq quantizer"
        )
    if qcfg.quantize_head:
        raise QuantdynError(
            f"{fmt} export holds the quantized linears of the decoder blocks only (transformers keeps the head in "
            f"full precision); quantize without 'quantize_head' (-head)"
        )


def _scale_dtype(options: dict, default: torch.dtype) -> torch.dtype:
    name = options.get("scale_dtype")
    if name is None:
        return default
    if isinstance(name, torch.dtype):
        if name not in SCALE_DTYPES.values():
            raise QuantdynError(f"scale_dtype {name} is not supported; choose one of: {', '.join(SCALE_DTYPES)}")
        return name
    if name not in SCALE_DTYPES:
        raise QuantdynError(f"scale_dtype '{name}' is not supported; choose one of: {', '.join(SCALE_DTYPES)}")
    return SCALE_DTYPES[name]


def _as_int_zeros(name: str, zeros: torch.Tensor, bits: int) -> torch.Tensor:
    """Zero points as int64, checked integral and inside [0, 2^bits)."""
    z = zeros.detach().to(torch.float64)
    if not torch.equal(torch.round(z), z):
        raise QuantdynError(f"layer '{name}': zero points are not integers; pass the zeros quantize_model returned")
    zi = z.to(torch.int64)
    if zi.numel() and (int(zi.min()) < 0 or int(zi.max()) > 2**bits - 1):
        raise QuantdynError(f"layer '{name}': zero points lie in [{int(zi.min())}, {int(zi.max())}], outside the "
                            f"{bits}-bit grid [0, {2**bits - 1}]")
    return zi


def _cast_scales(name: str, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    s = scales.detach().to(dtype)
    if not torch.isfinite(s).all() or bool(((s == 0) & (scales != 0)).any()):
        raise QuantdynError(
            f"layer '{name}': scales overflow or underflow in {str(dtype).replace('torch.', '')} "
            f"(range [{float(scales.abs().min()):.3g}, {float(scales.abs().max()):.3g}]); export with a wider "
            f"scale_dtype where the format allows it"
        )
    return s.contiguous()


def _provenance(qcfg: QuantConfig) -> dict:
    return {"version": __version__, "quantizer": to_dict(qcfg), "config_hash": config_hash(qcfg), "name": qcfg.name}


# ----------------------------------------------------------------------------- GPTQ


def _gptq_check(qcfg: QuantConfig, model_type: str, model_dtype: torch.dtype, options: dict) -> ExportSettings:
    _common_refusals(qcfg, "GPTQ")
    if qcfg.bits not in GPTQ_BITS:
        raise QuantdynError(
            f"GPTQ checkpoints hold {', '.join(map(str, GPTQ_BITS))} bits, not {qcfg.bits}; export "
            f"compressed-tensors (2..8 bits) or quantize with one of those widths"
        )
    unknown = set(options) - {"scale_dtype", "checkpoint_format"}
    if unknown:
        raise QuantdynError(f"unknown GPTQ export option(s) {sorted(unknown)}; options: scale_dtype, checkpoint_format")
    ckpt = options.get("checkpoint_format") or "gptq"
    if ckpt not in GPTQ_CHECKPOINT_FORMATS:
        raise QuantdynError(f"GPTQ checkpoint_format '{ckpt}' is not supported; choose one of: "
                            f"{', '.join(GPTQ_CHECKPOINT_FORMATS)}")
    dtype = _scale_dtype(options, torch.float16)
    if dtype != torch.float16:
        raise QuantdynError("GPTQ checkpoints store float16 scales (the GPTQ linear layers keep float16 buffers); "
                            "leave scale_dtype unset or use compressed-tensors")
    return ExportSettings(scale_dtype=dtype, checkpoint_format=ckpt, desc_act=permuted_groups(qcfg))


def _gptq_layer(name: str, out_f: int, in_f: int, qcfg: QuantConfig) -> None:
    if qcfg.bits == 3 and (in_f % 32 or out_f % 32):
        raise QuantdynError(f"layer '{name}' is {out_f}x{in_f}; 3-bit GPTQ packs 32 codes into 3 words and needs in "
                            f"and out features divisible by 32; export compressed-tensors or use 2, 4 or 8 bits")


def _gptq_tensors(name: str, q: dict[str, torch.Tensor], qcfg: QuantConfig, st: ExportSettings) -> dict:
    codes, scales, g_idx = q["codes"], q["scales"], q["g_idx"]
    bits = qcfg.bits
    out_f, in_f = codes.shape
    _gptq_layer(name, out_f, in_f, qcfg)
    zeros = _as_int_zeros(name, q["zeros"], bits)
    natural = torch.equal(g_idx.long(), torch.arange(in_f) // qcfg.group_size) if qcfg.group_size else bool(
        (g_idx == 0).all())
    if not natural and not st.desc_act:
        raise QuantdynError(f"layer '{name}' has permuted groups (act-order) but the export was opened for natural "
                            f"group order; open it with the QuantConfig that produced the codes")
    if st.checkpoint_format == "gptq":
        if bool((zeros == 0).any()):
            raise QuantdynError(
                f"layer '{name}' has zero points equal to 0 (a group with no negative weight), which GPTQ v1 "
                f"(checkpoint_format 'gptq', zeros stored minus one) cannot store unambiguously; export with "
                f"checkpoint_format='gptq_v2' (`quantize --export gptq --export-option checkpoint_format=gptq_v2`), as "
                f"compressed-tensors, or with a symmetric quantizer"
            )
        stored_zeros = zeros - 1
    else:
        stored_zeros = zeros
    return {
        f"{name}.qweight": pack_rows(codes, bits).t().contiguous(),
        f"{name}.qzeros": pack_rows(stored_zeros.t().contiguous(), bits),
        f"{name}.scales": _cast_scales(name, scales.t(), st.scale_dtype),
        f"{name}.g_idx": g_idx.to(torch.int32).contiguous(),
    }


def _gptq_config(qcfg: QuantConfig, layers: list[str], st: ExportSettings) -> dict:
    return {
        "quant_method": "gptq",
        "bits": qcfg.bits,
        "group_size": qcfg.group_size or -1,
        "desc_act": st.desc_act,
        "sym": qcfg.sym,
        "lm_head": False,
        "checkpoint_format": st.checkpoint_format,
        "format": st.checkpoint_format,  # optimum >= 2 / GPTQModel >= 5 read 'format'
        "pack_dtype": "int32",
        "damp_percent": qcfg.damp_percent,
        "true_sequential": qcfg.true_sequential,
        "static_groups": qcfg.static_groups,
        "meta": {
            "quantizer": [f"quantdyn:{__version__}"],
            "quantdyn": _provenance(qcfg),
            "act_group_aware": qcfg.act_group_aware,
            "damp_auto_increment": qcfg.damp_auto_increment,
            "mse": qcfg.mse,
        },
    }


EXPORT_FORMATS.add("gptq", ExportFormat(
    name="gptq", summary="GPTQ qweight/qzeros/scales/g_idx (GPTQModel, AutoGPTQ, transformers+optimum, vLLM)",
    check=_gptq_check, check_layer=_gptq_layer, layer_tensors=_gptq_tensors, config=_gptq_config,
))


# ----------------------------------------------------------------------------- compressed-tensors


def _ct_check(qcfg: QuantConfig, model_type: str, model_dtype: torch.dtype, options: dict) -> ExportSettings:
    _common_refusals(qcfg, "compressed-tensors")
    if qcfg.bits not in CT_BITS:
        raise QuantdynError(f"compressed-tensors pack-quantized holds 2..8 bits here, not {qcfg.bits}")
    if permuted_groups(qcfg):
        raise QuantdynError(
            "compressed-tensors holds contiguous groups only (act-order with permuted groups, actorder 'group' "
            "with weight_g_idx, was removed in compressed-tensors 0.19); export act-order quantizers as gptq, or "
            "quantize with static groups (-static) or group-aware ordering (-gar)"
        )
    if model_type == "gpt2":
        raise QuantdynError("compressed-tensors quantizes nn.Linear layers, and GPT-2 uses Conv1D; export gpt2 "
                            "models as gptq")
    unknown = set(options) - {"scale_dtype"}
    if unknown:
        raise QuantdynError(f"unknown compressed-tensors export option(s) {sorted(unknown)}; options: scale_dtype")
    dtype = _scale_dtype(options, model_dtype)  # llm-compressor stores scales in the model's dtype
    return ExportSettings(scale_dtype=dtype, checkpoint_format=None, desc_act=False)


def _ct_layer(name: str, out_f: int, in_f: int, qcfg: QuantConfig) -> None:
    g = qcfg.group_size
    if g and in_f % g:
        raise QuantdynError(f"layer '{name}' has {in_f} input features, not a multiple of group_size {g}; "
                            f"compressed-tensors needs groups that divide in_features: quantize with a group size "
                            f"that divides {in_f}, per channel (group 0), or export gptq")


CT_GROUP_SIZES = (256, 128, 64, 32, 16)
"""Group sizes offered when a quantizer's does not divide a model's widths (powers of two, as the kernels that
serve compressed-tensors and GPTQ checkpoints take them; vLLM's Marlin: 32, 64, 128)."""


def fitting_group_sizes(widths, largest: int | None = None) -> list[int]:
    """The sizes of :data:`CT_GROUP_SIZES` (at most ``largest``) that divide every one of ``widths``, largest
    first."""
    return [g for g in CT_GROUP_SIZES if (largest is None or g <= largest) and all(int(w) % g == 0 for w in widths)]


def check_ct_groups(layers: Mapping[str, tuple[int, int]], qcfg: QuantConfig) -> None:
    """One line, before any work, when ``qcfg``'s group size does not divide every layer's input width: the widths
    it misses, the group sizes that divide them all, and the label to quantize with."""
    g = qcfg.group_size
    if not g or not layers:
        return
    bad: dict[int, list[str]] = {}
    for name, (_, in_f) in layers.items():
        if int(in_f) % g:
            bad.setdefault(int(in_f), []).append(name)
    if not bad:
        return
    widths = sorted({int(i) for _, i in layers.values()})
    n = sum(len(v) for v in bad.values())
    first = next(iter(bad.values()))[0]
    fits = fitting_group_sizes(widths)
    use = (f"group sizes that divide every width ({', '.join(map(str, widths))}): {', '.join(map(str, fits))}; "
           f"quantize with {replace(qcfg, group_size=fits[0]).name}" if fits else
           f"no group size divides every width ({', '.join(map(str, widths))})")
    raise QuantdynError(f"compressed-tensors needs groups that divide every layer's input width, and group_size {g} "
                        f"does not divide {' or '.join(map(str, bad))} ({n} layer{'s' if n > 1 else ''}, e.g. "
                        f"'{first}'); {use}, per channel ({replace(qcfg, group_size=0).name}), or export gptq")


def fit_group_size(qcfg: QuantConfig, layers: Mapping[str, tuple[int, int]]) -> QuantConfig:
    """``qcfg`` with the largest group size up to its own that divides every layer's input width (itself when its
    own does; per channel when none of :data:`CT_GROUP_SIZES` does) -- for a group size the user did not choose."""
    if not qcfg.group_size or not layers:
        return qcfg
    fits = fitting_group_sizes([i for _, i in layers.values()], qcfg.group_size)
    if fits and fits[0] == qcfg.group_size:
        return qcfg
    return replace(qcfg, group_size=fits[0] if fits else 0)


CT_TRANSFORM = "had"
"""The transform scheme's name in transform_config: its matrix is ``<layer>.had_input.weight``."""


def _ct_transform(name: str, in_f: int, qcfg: QuantConfig, st: ExportSettings) -> dict[str, torch.Tensor]:
    """The ``+had`` transform matrix a layer carries (module docstring), or nothing."""
    if not qcfg.hadamard or (st.transform_owners is not None and name not in st.transform_owners):
        return {}
    return {f"{name}.{CT_TRANSFORM}_input.weight": hadamard_matrix(in_f, qcfg.rotation_seed).to(st.scale_dtype)}


def _ct_tensors(name: str, q: dict[str, torch.Tensor], qcfg: QuantConfig, st: ExportSettings) -> dict:
    codes, scales, g_idx = q["codes"], q["scales"], q["g_idx"]
    bits = qcfg.bits
    out_f, in_f = codes.shape
    g = qcfg.group_size
    _ct_layer(name, out_f, in_f, qcfg)
    want = torch.arange(in_f) // g if g else torch.zeros(in_f, dtype=torch.long)
    if not torch.equal(g_idx.long(), want):
        raise QuantdynError(f"layer '{name}' has permuted groups; compressed-tensors holds contiguous groups only")
    zeros = _as_int_zeros(name, q["zeros"], bits)
    half = 2 ** (bits - 1)
    out = {
        f"{name}.weight_packed": pack_rows(codes, bits),
        f"{name}.weight_scale": _cast_scales(name, scales, st.scale_dtype),
        f"{name}.weight_shape": torch.tensor([out_f, in_f], dtype=torch.int64),
    }
    if qcfg.sym:
        if not bool((zeros == half).all()):
            raise QuantdynError(f"layer '{name}': a symmetric quantizer must have every zero point at {half}")
    else:
        # (ceil(out*bits/32), groups): the library packs the signed zero point z - 2^(bits-1) plus the same
        # offset -- the unsigned z -- along the output dim (module docstring)
        out[f"{name}.weight_zero_point"] = pack_rows(zeros.t().contiguous(), bits).t().contiguous()
    return {**out, **_ct_transform(name, in_f, qcfg, st)}


def _ct_config(qcfg: QuantConfig, layers: list[str], st: ExportSettings) -> dict:
    weights = {
        "num_bits": qcfg.bits,
        "type": "int",
        "symmetric": qcfg.sym,
        "group_size": qcfg.group_size or None,
        "strategy": "group" if qcfg.group_size else "channel",
        "dynamic": False,
        "observer": "minmax",
    }
    config = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": sorted(layers),  # exact module names: no family-specific class or regex guessing
                "weights": weights,
                "input_activations": None,
                "output_activations": None,
                "format": "pack-quantized",
            }
        },
        "ignore": [],
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {},
        "quantdyn": _provenance(qcfg),
    }
    if qcfg.hadamard:  # compressed-tensors' TransformConfig, as llm-compressor serializes it (module docstring)
        config["transform_config"] = {"config_groups": {CT_TRANSFORM: {
            "type": "random-hadamard", "randomize": False, "requires_grad": False, "head_dim": None,
            "precision": "torch.float32",
            "apply": [{"targets": sorted(layers), "location": "input", "inverse": False, "ignore": []}]}}}
    if not qcfg.sym:
        # transformers cannot load packed zero points into the modules it builds compressed; it loads them
        # through the library's decompressor with this key (module docstring)
        config["dequantize"] = True
    return config


EXPORT_FORMATS.add("compressed-tensors", ExportFormat(
    name="compressed-tensors",
    summary="compressed-tensors pack-quantized (llm-compressor's layout; vLLM, transformers+compressed-tensors)",
    check=_ct_check, check_layer=_ct_layer, layer_tensors=_ct_tensors, config=_ct_config,
))


def check_exportable(fmt: str, qcfg: QuantConfig, model_type: str = "", model_dtype: torch.dtype = torch.float32,
                     layers: Mapping[str, tuple[int, int]] | None = None, **options: Any) -> ExportSettings:
    """Raise a one-line QuantdynError if ``fmt`` cannot hold what ``qcfg`` produces (call it before any work).

    layers: {name: (out_features, in_features)} of the layers that will be quantized, to refuse shapes the
    format cannot hold too (what only the codes can tell -- a GPTQ v1 zero point of 0 -- is refused when the
    layer is added)."""
    f = EXPORT_FORMATS.get(fmt)
    check_rotation_exportable(fmt, qcfg)
    settings = f.check(qcfg, model_type, model_dtype, options)
    if f.name == "compressed-tensors":
        check_ct_groups(layers or {}, qcfg)  # every width at once, with the sizes that fit
    for name, (out_f, in_f) in (layers or {}).items():
        f.check_layer(name, int(out_f), int(in_f), qcfg)
    if qcfg.hadamard and layers:
        first: dict[int, str] = {}
        for name, (_, in_f) in layers.items():
            first.setdefault(int(in_f), name)
        settings = replace(settings, transform_owners=frozenset(first.values()))
    return settings


def check_rotation_exportable(fmt: str, qcfg: QuantConfig) -> None:
    """One line when ``fmt`` cannot hold ``qcfg``'s rotation (module docstring: Rotations)."""
    if qcfg.r1:
        raise QuantdynError("+r1 models are not exported: the residual stream's rotation would have to be folded into "
                            "the embedding, norms and head of the written checkpoint; export +had (compressed-tensors)")
    if qcfg.hadamard and fmt != "compressed-tensors":
        raise QuantdynError(f"{fmt} checkpoints have no place for a rotation; export {qcfg.name} as "
                            f"compressed-tensors, whose transform_config holds the Hadamard transform")
