"""GGUF export: one ``.gguf`` file that llama.cpp loads and runs, from a GGUF quantizer's block bytes.

``quantdyn quantize CKPT --method q4_k_m --export gguf --out model.gguf`` (or ``--quantizers q4_k_m``) streams
every quantized linear's ggml blocks (``QuantResult.storage``, packed by ``quantize.gguf.pack_gguf``:
the same bytes llama.cpp's own quantizer writes) into the file; embeddings, norms and biases are copied
from the checkpoint (F32 by default, so that llama.cpp runs exactly the weights quantdyn measured;
``float_type=f16`` halves them).

Layout (GGUF v3, as ``convert_hf_to_gguf.py`` of llama.cpp 0c1e570 names and arranges it; written here
without the ``gguf`` package): header, metadata, tensor infos, aligned tensor data. Architectures:

* ``gptneox`` (GPT-NeoX, Pythia, quantdyn's GPT): ``token_embd``, ``blk.N.attn_norm``, ``blk.N.attn_qkv``
  (rows reordered from the per-head interleaved ``(head, q|k|v, dim)`` of HF to ``[Q; K; V]``),
  ``blk.N.attn_output``, ``blk.N.ffn_norm``, ``blk.N.ffn_up``, ``blk.N.ffn_down`` (weights and biases),
  ``output_norm``, ``output`` (a copy of ``token_embd`` for tied embeddings: llama.cpp's gptneox requires
  it); rope of ``rotary_pct * head_dim`` dimensions (NeoX style);
* ``llama`` (LLaMA-like ``model_type: llama``): ``attn_q``/``attn_k`` rows permuted from HF's rotate-half
  layout to llama.cpp's interleaved rope (convert's ``LlamaModel.permute``), ``attn_v``, ``attn_output``,
  ``ffn_gate``/``ffn_up``/``ffn_down``, RMS norms; a tied head writes no ``output``.

Reordering rows is exact: every ggml block lies inside one row. The vocabulary comes from the checkpoint's
``tokenizer.json`` (byte-level BPE: tokens, merges) or, without one, placeholder tokens ``<tok-N>`` (llama.cpp
then runs on token ids; its text tokenizer is meaningless).

Refused with one line before anything is written: another architecture, a quantizer that is not a GGUF
block type or mix (FP8, NF4, gptq ... have no ggml type here), an existing output file.
"""
from __future__ import annotations

import json
import os
import struct
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from quantdyn.errors import QuantdynError
from quantdyn.export.layouts import EXPORT_FORMATS, ExportFormat
from quantdyn.files import atomic_file
from quantdyn.models.adapters import hf_model_type
from quantdyn.quantize import gguf as qg
from quantdyn.quantize import gguf_mixes
from quantdyn.quantize.catalogue import QUANTIZERS, QuantConfig, parse_quantizer
from quantdyn.quantize.plan import KEEP, is_auto, parse_auto, plan_of
from quantdyn.quantize.primitives import QuantResult

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
ALIGNMENT = 32
F32_TYPE, F16_TYPE = 0, 1
"""ggml type ids of the float tensors."""



def _file_type(label: str) -> int | None:
    """llama.cpp's ``llama_ftype`` of a GGUF label (a block type's or a mix's), None for any other label."""
    if label in qg.GGML_TYPES:
        return qg.GGML_TYPES.get(label).file_type
    if label in gguf_mixes.MIXES:
        return gguf_mixes.MIXES.get(label).file_type
    return None


_ARCH = {"gpt_neox": "gptneox", "llama": "llama"}
"""HF model_type -> GGUF architecture (quantdyn's GPT is a gpt_neox: models.adapters.hf_model_type)."""

# GGUF metadata value types
_U32, _I32, _F32, _BOOL, _STR, _ARR, _U64 = 4, 5, 6, 7, 8, 9, 10


def _plan_types(qcfg: QuantConfig) -> tuple[list[str], str | None] | None:
    """The types of a ``plan:`` or ``auto@`` quantizer and the one that names the file (a plan's: by weights, most
    first, and Plan.main_type; auto@'s: nearest the budget first, and the nearest but f16), None for any other
    quantizer."""
    plan = plan_of(qcfg)
    if plan is not None:
        return plan.types_by_weight(), plan.main_type
    if is_auto(qcfg):
        budget, types = parse_auto(qcfg.method)
        near = sorted(types, key=lambda t: abs(_nominal_bpw(t) - budget))
        return near, next((t for t in near if t != KEEP), None)
    return None


def _nominal_bpw(label: str) -> float:
    return 16.0 if label == KEEP else qg.GGML_TYPES.get(label.removesuffix("-imatrix")).bits_per_weight


def gguf_quantizer(qcfg: QuantConfig) -> str:
    """The GGUF label of ``qcfg`` (``q4_k_m``) or a one-line refusal; a plan's (or an ``auto@`` label's) own types
    must all be GGUF block types or f16, and its file type is that of its largest type (auto@: the type nearest
    the budget)."""
    planned = _plan_types(qcfg)
    if planned is not None:
        types, main = planned
        other = [t for t in types if t != KEEP and t.removesuffix("-imatrix") not in qg.GGML_TYPES]
        if other:
            if "+" in other[0]:  # a rotated type (+had): no export file carries a per-tensor rotation
                raise QuantdynError(f"GGUF export holds llama.cpp's block types and F16; {qcfg.name} has the rotated "
                                    f"type {other[0]}, which no export format holds per tensor: allocate without "
                                    "+had types to export the plan")
            raise QuantdynError(f"GGUF export holds llama.cpp's block types and F16; {qcfg.name} has type {other[0]}: "
                                "export its integer types as gptq or compressed-tensors")
        return main.removesuffix("-imatrix") if main is not None else "q8_0"
    spec = QUANTIZERS.get(qcfg.method).format
    base = qcfg.method.removesuffix("-imatrix")
    if spec is None or _file_type(base) is None:
        gguf_labels = ", ".join(sorted([*qg.GGML_TYPES, *gguf_mixes.MIXES]))
        raise QuantdynError(f"GGUF export holds llama.cpp's block types ({gguf_labels}, each also -imatrix); "
                            f"quantizer {qcfg.name} has no ggml type: quantize with one of those, or export "
                            f"{qcfg.name} as gptq or compressed-tensors")
    return base


def gguf_tensor_name(arch: str, hf_name: str) -> str:
    """HF checkpoint tensor name -> its GGUF name in architecture ``arch`` (``gptneox`` or ``llama``; one line for a
    name the architecture does not have)."""
    parts = hf_name.split(".")
    suffix = parts[-1]
    if arch == "gptneox":
        table = {"gpt_neox.embed_in": "token_embd", "embed_out": "output", "lm_head": "output",
                 "gpt_neox.final_layer_norm": "output_norm"}
        layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                 "attention.query_key_value": "attn_qkv", "attention.dense": "attn_output",
                 "mlp.dense_h_to_4h": "ffn_up", "mlp.dense_4h_to_h": "ffn_down"}
        prefix = "gpt_neox.layers."
    else:
        table = {"model.embed_tokens": "token_embd", "lm_head": "output", "model.norm": "output_norm"}
        layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                 "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}
        prefix = "model.layers."
    base = ".".join(parts[:-1])
    if base in table:
        return f"{table[base]}.{suffix}"
    if base.startswith(prefix):
        idx, _, rest = base[len(prefix):].partition(".")
        if rest in layer and idx.isdigit():
            return f"blk.{idx}.{layer[rest]}.{suffix}"
    raise QuantdynError(f"checkpoint tensor '{hf_name}' has no place in a GGUF {arch} model")


def gguf_arch(model_type: str) -> str:
    """The GGUF architecture of a quantdyn/HF model_type (one line for one GGUF export does not write)."""
    if hf_model_type(model_type) not in _ARCH:
        raise QuantdynError(f"GGUF export writes GPT-NeoX and LLaMA models; model_type '{model_type}' is not "
                            f"supported (supported: {', '.join(sorted(_ARCH))})")
    return _ARCH[hf_model_type(model_type)]


def _rope_base(cfg: dict) -> float:
    rope = cfg.get("rope_parameters") or {}
    return float(rope.get("rope_theta", cfg.get("rotary_emb_base", cfg.get("rope_theta", 10000.0))))


def _rotary_pct(cfg: dict) -> float:
    rope = cfg.get("rope_parameters") or {}
    return float(rope.get("partial_rotary_factor", cfg.get("rotary_pct", 1.0)))


class _Meta:
    """GGUF key/value metadata, serialised in insertion order."""

    def __init__(self) -> None:
        self.items: list[tuple[str, int, Any]] = []

    def add(self, key: str, vtype: int, value: Any) -> None:
        self.items.append((key, vtype, value))

    @staticmethod
    def _str(s: str) -> bytes:
        b = s.encode("utf-8")
        return struct.pack("<Q", len(b)) + b

    def _value(self, vtype: int, value: Any) -> bytes:
        if vtype == _STR:
            return self._str(value)
        if vtype == _ARR:
            etype, values = value
            if etype == _STR:
                body = b"".join(self._str(v) for v in values)
            else:
                body = np.asarray(values, dtype={_I32: "<i4", _F32: "<f4", _U32: "<u4"}[etype]).tobytes()
            return struct.pack("<IQ", etype, len(values)) + body
        fmt = {_U32: "<I", _I32: "<i", _F32: "<f", _BOOL: "<?", _U64: "<Q"}[vtype]
        return struct.pack(fmt, value)

    def encode(self) -> bytes:
        return b"".join(self._str(k) + struct.pack("<I", t) + self._value(t, v) for k, t, v in self.items)


class GGUFExportWriter:
    """Streams one GGUF file; the interface of ``quantdyn.export.ExportWriter`` (``add_quantized`` also takes
    the layer's ``QuantResult`` as ``result=``: the ggml blocks are in its storage)."""

    def __init__(self, out: str | Path, source_config: dict, qcfg: QuantConfig | str | dict, model_type: str,
                 *, float_type: str = "f32", name: str | None = None,
                 layers: dict[str, tuple[int, int]] | None = None, **options: Any):
        self.qcfg = parse_quantizer(qcfg)
        self.label = gguf_quantizer(self.qcfg)
        if options:
            raise QuantdynError(f"GGUF export has no option {sorted(options)[0]!r}; its options: float_type (f32 | f16), "
                                "name (general.name)")
        if float_type not in ("f32", "f16"):
            raise QuantdynError(f"GGUF float_type '{float_type}' is not supported; choose f32 or f16")
        self.arch = gguf_arch(model_type)
        if not isinstance(source_config, dict):
            raise QuantdynError("source_config must be the model's HF config.json as a dict")
        self.cfg = source_config
        need = ["hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"]
        missing = [k for k in need if k not in source_config]
        if missing:
            raise QuantdynError(f"the model's config.json lacks {missing[0]}; GGUF export needs {', '.join(need)}")
        self.n_head = int(source_config["num_attention_heads"])
        self.n_kv = int(source_config.get("num_key_value_heads") or self.n_head)
        self.d = int(source_config["hidden_size"])
        self.n_layer = int(source_config["num_hidden_layers"])
        self.float_type = F16_TYPE if float_type == "f16" else F32_TYPE
        self.name = name or str(source_config.get("_name_or_path") or "quantdyn-export")
        for layer, (rows, cols) in (layers or {}).items():  # what only the shapes tell, refused before any work
            self._gguf_name(f"{layer}.weight")
            _check_layer(layer, rows, cols, self.qcfg)
        self.out = Path(out)
        if self.out.exists():
            raise QuantdynError(f"'{self.out}' exists; choose a new --out file for the GGUF export (nothing was written)")
        if not self.out.parent.is_dir():
            raise QuantdynError(f"directory '{self.out.parent}' of --out does not exist")
        self._tensors: list[tuple[str, list[int], int, int, int]] = []  # name, ne (ne0 first), type, offset, nbytes
        self._names: set[str] = set()
        self._tokenizer: dict | None = None
        self._embd: tuple | None = None  # token_embd, for a tied head (llama.cpp's gptneox needs output.weight)
        self._layers: list[str] = []
        fd, tmp = tempfile.mkstemp(prefix=f".{self.out.name}.", suffix=".data", dir=self.out.parent)
        self._data_path = Path(tmp)
        self._data = os.fdopen(fd, "wb")
        self._offset = 0
        self._t0 = time.time()

    # ------------------------------------------------------------------ names
    def _gguf_name(self, hf_name: str) -> str:
        return gguf_tensor_name(self.arch, hf_name)

    def _row_order(self, gguf_name: str, rows: int) -> torch.Tensor | None:
        """The HF -> llama.cpp row permutation of a tensor (None: rows stay)."""
        if self.arch == "gptneox" and ".attn_qkv." in gguf_name:
            hd = self.d // self.n_head
            return torch.arange(rows).reshape(self.n_head, 3, hd).permute(1, 0, 2).reshape(-1)
        if self.arch == "llama" and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
            heads = self.n_head if ".attn_q." in gguf_name else self.n_kv
            hd = rows // heads
            # HF rotate-half (first half, second half) -> llama.cpp's interleaved pairs
            return torch.arange(rows).reshape(heads, 2, hd // 2).transpose(1, 2).reshape(-1)
        return None

    # ------------------------------------------------------------------ adding
    def _write(self, name: str, ne: list[int], ttype: int, data: bytes) -> None:
        if self._data is None:
            raise QuantdynError(f"the GGUF export to '{self.out}' is already closed or aborted")
        if name in self._names:
            raise QuantdynError(f"tensor '{name}' was added to the GGUF export twice")
        pad = -self._offset % ALIGNMENT
        self._data.write(b"\0" * pad)
        self._offset += pad
        self._tensors.append((name, ne, ttype, self._offset, len(data)))
        self._names.add(name)
        self._data.write(data)
        self._offset += len(data)

    def add_quantized(self, layer_name: str, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                      g_idx: torch.Tensor, bias: torch.Tensor | None = None, awq_scales: torch.Tensor | None = None,
                      result: QuantResult | None = None) -> None:
        """Add one quantized linear (``layer_name`` = its HF name without ``.weight``); ``result`` carries its
        ggml blocks. codes/scales/zeros/g_idx are quantdyn's generic layout (unused: GGUF stores the blocks)."""
        if result is not None and result.format == KEEP:  # a plan's f16 tensor: llama.cpp's F16
            self._add_float(f"{layer_name}.weight", result.weight, F16_TYPE)
            self._layers.append(layer_name)
            if bias is not None:
                self.add_tensor(f"{layer_name}.bias", bias)
            return
        if result is None or result.format is None or result.format.lower() not in qg.GGML_TYPES:
            raise QuantdynError(f"layer '{layer_name}' was not quantized to a ggml block type; GGUF export needs the "
                                f"GGUF quantizer's blocks")
        t = result.format.lower()
        q = qg.GGUFQuant(t, result.codes.cpu(), {k: v.cpu() for k, v in result.storage.items()}, result.weight.cpu())
        data = qg.pack_gguf(q)
        name = self._gguf_name(f"{layer_name}.weight")
        order = self._row_order(name, data.shape[0])
        if order is not None:
            data = data[order]
        rows, cols = result.codes.shape
        self._write(name, [cols, rows], qg.GGML_TYPES.get(t).type_id, data.contiguous().numpy().tobytes())
        self._layers.append(layer_name)
        if bias is not None:
            self.add_tensor(f"{layer_name}.bias", bias)

    def add_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """Add an unquantized tensor under its HF checkpoint name (1-D: F32; 2-D: ``float_type``)."""
        self._add_float(name, tensor, F32_TYPE if tensor.dim() == 1 else self.float_type)

    def _add_float(self, name: str, tensor: torch.Tensor, ttype: int) -> None:
        gname = self._gguf_name(name)
        t = tensor.detach().to("cpu", torch.float32)
        order = self._row_order(gname, t.shape[0])
        if order is not None:
            t = t[order]
        arr = t.contiguous().numpy().astype(np.float16 if ttype == F16_TYPE else np.float32)
        self._write(gname, list(reversed(t.shape)), ttype, arr.tobytes())
        if gname == "token_embd.weight":
            self._embd = (list(reversed(t.shape)), ttype, arr.tobytes())

    def add_file(self, name: str, source: str | Path | bytes) -> None:
        """Only ``tokenizer.json`` matters to a GGUF file (its vocabulary goes into the metadata)."""
        if Path(name).name != "tokenizer.json":
            return
        text = source.decode() if isinstance(source, bytes) else Path(source).read_text()
        self._tokenizer = json.loads(text)

    @property
    def layers(self) -> list[str]:
        return list(self._layers)

    # ------------------------------------------------------------------ metadata
    def _vocab(self, meta: _Meta) -> None:
        n_vocab = int(self.cfg["vocab_size"])
        tok = self._tokenizer
        model = (tok or {}).get("model") or {}
        tokens = [f"<tok-{i}>" for i in range(n_vocab)]
        types = [1] * n_vocab  # NORMAL
        merges: list[str] = []
        if model.get("type") == "BPE" and isinstance(model.get("vocab"), dict):
            for piece, i in model["vocab"].items():
                if i < n_vocab:
                    tokens[i] = piece
            for added in tok.get("added_tokens") or []:
                i = added.get("id")
                if isinstance(i, int) and i < n_vocab:
                    tokens[i] = added["content"]
                    types[i] = 3 if added.get("special") else 4  # CONTROL / USER_DEFINED
            for i in range(n_vocab):
                if tokens[i] == f"<tok-{i}>":
                    tokens[i], types[i] = f"[PAD{i}]", 5  # UNUSED padding rows of the embedding
            merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
        meta.add("tokenizer.ggml.model", _STR, "gpt2")
        meta.add("tokenizer.ggml.pre", _STR, "default")
        meta.add("tokenizer.ggml.tokens", _ARR, (_STR, tokens))
        meta.add("tokenizer.ggml.token_type", _ARR, (_I32, types))
        meta.add("tokenizer.ggml.merges", _ARR, (_STR, merges))
        for key, field in (("bos_token_id", "bos"), ("eos_token_id", "eos")):
            v = self.cfg.get(key)
            if isinstance(v, int) and 0 <= v < n_vocab:
                meta.add(f"tokenizer.ggml.{field}_token_id", _U32, v)

    def _metadata(self) -> _Meta:
        c, a = self.cfg, self.arch
        meta = _Meta()
        meta.add("general.architecture", _STR, a)
        meta.add("general.name", _STR, self.name)
        meta.add("general.file_type", _U32, _file_type(self.label))
        meta.add("general.quantization_version", _U32, 2)
        meta.add("general.alignment", _U32, ALIGNMENT)
        meta.add("quantdyn.quantizer", _STR, self.qcfg.name)
        ctx = int(c.get("max_position_embeddings", 2048))
        hd = self.d // self.n_head
        meta.add(f"{a}.context_length", _U32, ctx)
        meta.add(f"{a}.embedding_length", _U32, self.d)
        meta.add(f"{a}.block_count", _U32, self.n_layer)
        meta.add(f"{a}.feed_forward_length", _U32, int(c.get("intermediate_size", 4 * self.d)))
        meta.add(f"{a}.attention.head_count", _U32, self.n_head)
        meta.add(f"{a}.rope.freq_base", _F32, _rope_base(c))
        if a == "gptneox":
            meta.add(f"{a}.rope.dimension_count", _U32, int(_rotary_pct(c) * hd))
            meta.add(f"{a}.use_parallel_residual", _BOOL, bool(c.get("use_parallel_residual", True)))
            meta.add(f"{a}.attention.layer_norm_epsilon", _F32, float(c.get("layer_norm_eps", 1e-5)))
        else:
            meta.add(f"{a}.rope.dimension_count", _U32, hd)
            meta.add(f"{a}.attention.head_count_kv", _U32, self.n_kv)
            meta.add(f"{a}.attention.layer_norm_rms_epsilon", _F32, float(c.get("rms_norm_eps", 1e-6)))
            meta.add(f"{a}.vocab_size", _U32, int(c["vocab_size"]))
        self._vocab(meta)
        return meta

    # ------------------------------------------------------------------ finishing
    def close(self) -> Path:
        """Write header, metadata and tensor infos, then the data, into a temporary file renamed to ``out``."""
        if self._data is None:
            raise QuantdynError(f"the GGUF export to '{self.out}' is already closed or aborted")
        if not self._layers:
            self.abort()
            raise QuantdynError("no quantized layer was added; nothing was exported")
        try:
            if self.arch == "gptneox" and "output.weight" not in self._names and self._embd is not None:
                self._write("output.weight", *self._embd)  # tied embeddings: llama.cpp's gptneox has no tying
            self._data.close()
            self._data = None
            meta_kv = self._metadata()
            meta = meta_kv.encode()
            infos = b""
            for name, ne, ttype, offset, _ in self._tensors:
                nb = name.encode()
                infos += struct.pack("<Q", len(nb)) + nb + struct.pack("<I", len(ne))
                infos += struct.pack(f"<{len(ne)}Q", *ne) + struct.pack("<IQ", ttype, offset)
            header = GGUF_MAGIC + struct.pack("<IQQ", GGUF_VERSION, len(self._tensors), len(meta_kv.items)) + meta + infos
            header += b"\0" * (-len(header) % ALIGNMENT)
            with atomic_file(self.out, "wb") as f, open(self._data_path, "rb") as data:
                f.write(header)
                while chunk := data.read(64 * 1024 * 1024):
                    f.write(chunk)
                if self.out.exists():
                    raise QuantdynError(f"'{self.out}' appeared while exporting; not replacing it")
        except BaseException:
            self.abort()
            raise
        self._data_path.unlink(missing_ok=True)
        return self.out

    def abort(self) -> None:
        """Discard everything written so far (``out`` is never created); safe to call twice."""
        if self._data is not None:
            self._data.close()
            self._data = None
        self._data_path.unlink(missing_ok=True)

    def __enter__(self) -> "GGUFExportWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif self._data is not None:
            self.close()


def _check_layer(name: str, out_features: int, in_features: int, qcfg: QuantConfig) -> None:
    """A layer whose rows fit no ggml block (not a multiple of 32) is refused before any work."""
    if in_features % qg.QK:
        raise QuantdynError(f"layer '{name}' has rows of {in_features} weights; every GGUF block type needs a "
                            f"multiple of {qg.QK} (llama.cpp would keep it in F16, which quantdyn does not)")


def _check(qcfg: QuantConfig, model_type: str, model_dtype: torch.dtype, options: dict):
    """The export-format check for ``check_exportable('gguf', ...)``: a one-line refusal or None."""
    gguf_quantizer(qcfg)
    if hf_model_type(model_type) not in _ARCH:
        raise QuantdynError(f"GGUF export writes GPT-NeoX and LLaMA models; model_type '{model_type}' is not supported")
    return None


def _register() -> None:
    def _no_layout(*args, **kwargs):
        raise QuantdynError("GGUF export writes through its own writer (quantdyn.export.gguf.GGUFExportWriter)")

    EXPORT_FORMATS.add("gguf", ExportFormat(
        name="gguf", summary="one .gguf file for llama.cpp (GGUF block types and mixes)",
        check=_check, check_layer=_check_layer, layer_tensors=_no_layout, config=_no_layout,
        open_writer=GGUFExportWriter))


_register()
