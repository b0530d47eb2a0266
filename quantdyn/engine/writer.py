"""Write a quantized checkpoint while the engine streams: the fake-quantized HF checkpoint that
``quantdyn quantize --save DIR`` produces, one shard at a time.

The output directory holds what ``quantize.apply.save_quantized`` writes for an in-memory model:
config.json + the weights with every quantized layer dequantized (``model.safetensors``, or
``model-0000k-of-0000n.safetensors`` + index when larger than a shard), the tokenizer files of
the source, ``quant_codes.safetensors`` (codes, scales, zeros, g_idx[, awq_scales] per layer,
sharded the same way) and ``quant_config.json``. Quantized layers are written as the engine
produces them and every other tensor is copied from the source at the end, so memory stays at
one shard, whatever the model's size. The directory appears only when complete.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from safetensors.torch import save_file

from quantdyn.config import config_hash, to_dict
from quantdyn.engine.lazy_model import LazyModel
from quantdyn.engine.walk import ModelQuantization
from quantdyn.errors import QuantdynError
from quantdyn.export import open_export
from quantdyn.files import atomic_dir
from quantdyn.models.adapters import model_type_of
from quantdyn.models.gpt import GPT
from quantdyn.models.hf_io import hf_config_dict, save_hf_into
from quantdyn.quantize.config import QuantConfig
from quantdyn.quantize.primitives import QuantResult

_COPY_SUFFIXES = (".json", ".model", ".txt", ".tiktoken")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                    "vocab.json", "merges.txt", "tokenizer.model", "generation_config.json")
_NOT_COPIED = {"config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json", "quant_config.json"}


class _Shards:
    """Tensors flushed to numbered safetensors files once ``limit`` bytes are buffered."""

    def __init__(self, directory: Path, stem: str, limit: int, metadata: dict):
        self.dir, self.stem, self.limit, self.metadata = directory, stem, limit, metadata
        self.buf: dict[str, torch.Tensor] = {}
        self.size = 0
        self.files: list[tuple[Path, list[str]]] = []

    def add(self, name: str, t: torch.Tensor) -> None:
        self.buf[name] = t.detach().to("cpu").contiguous()
        self.size += t.numel() * t.element_size()
        if self.size >= self.limit:
            self.flush()

    def flush(self) -> None:
        if not self.buf:
            return
        path = self.dir / f".{self.stem}-part{len(self.files):05d}.safetensors"
        save_file(self.buf, str(path), metadata=self.metadata)
        self.files.append((path, list(self.buf)))
        self.buf, self.size = {}, 0

    def finish(self) -> None:
        """Name the files ``STEM.safetensors`` or ``STEM-0000k-of-0000n.safetensors`` (+ index)."""
        self.flush()
        if len(self.files) == 1:
            self.files[0][0].rename(self.dir / f"{self.stem}.safetensors")
            return
        n = len(self.files)
        weight_map = {}
        for k, (path, names) in enumerate(self.files, 1):
            final = f"{self.stem}-{k:05d}-of-{n:05d}.safetensors"
            path.rename(self.dir / final)
            weight_map.update({name: final for name in names})
        (self.dir / f"{self.stem}.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))


class QuantizedCheckpointWriter:
    """``on_layer`` sink of the engine for one quantizer (see module docstring)."""

    def __init__(self, out: str | Path, source: LazyModel, qc: QuantConfig, label: str, model_type: str,
                 shard_bytes: int = 2 * 2**30):
        self.out, self.source, self.qc, self.label, self.model_type = Path(out), source, qc, label, model_type
        self._cm = atomic_dir(self.out)
        self.tmp = self._cm.__enter__()
        self.weights = _Shards(self.tmp, "model", shard_bytes, {"format": "pt"})
        self.codes = _Shards(self.tmp, "quant_codes", shard_bytes, {"format": "quantdyn-codes", "quantizer": qc.name})
        self.written: set[str] = set()
        self.untied_head = False

    def __call__(self, label: str, full: str, res: QuantResult, module: nn.Module) -> None:
        if label != self.label:
            return
        key = self.source.checkpoint_key(f"{full}.weight")
        if self.source.adapter.head == full and key != f"{full}.weight":
            key = f"{full}.weight"  # a tied head, quantized: saved untied
            self.untied_head = True
        self.weights.add(key, module.weight)
        self.written.add(key)
        self.codes.add(f"{full}.codes", res.codes)
        self.codes.add(f"{full}.scales", res.scales.float())
        self.codes.add(f"{full}.zeros", res.zeros.float())
        self.codes.add(f"{full}.g_idx", res.g_idx)
        if res.awq_scales is not None:
            self.codes.add(f"{full}.awq_scales", res.awq_scales.float())

    def close(self, rows: list[dict], summary: dict, git_sha: str) -> Path:
        """Copy every tensor not quantized from the source, write the metadata and move the directory in place."""
        try:
            w = self.source.weights
            for name in w.names():
                if name not in self.written:
                    self.weights.add(name, w.get(name))
            self.weights.finish()
            self.codes.finish()
            config = dict(w.config)
            if self.untied_head:
                config["tie_word_embeddings"] = False
            (self.tmp / "config.json").write_text(json.dumps(config, indent=2))
            for f in w.path.iterdir():
                if f.is_file() and f.suffix in _COPY_SUFFIXES and f.name not in _NOT_COPIED:
                    shutil.copy2(f, self.tmp / f.name)
            meta = dict(
                quantizer=to_dict(self.qc), config_hash=config_hash(self.qc), model_type=self.model_type,
                layout="weight (out, in) = scales[:, g_idx] * (codes - zeros[:, g_idx]) [/ awq_scales]; "
                       "GPT-2 Conv1D weights are stored transposed in the checkpoint",
                summary=summary, rows=rows, git_sha=git_sha,
            )
            (self.tmp / "quant_config.json").write_text(json.dumps(meta, indent=2, default=str))
        except BaseException as e:
            self._cm.__exit__(type(e), e, e.__traceback__)
            raise
        self._cm.__exit__(None, None, None)
        return self.out

    def abort(self) -> None:
        """Remove the temporary directory (nothing appears under the final name)."""
        err = RuntimeError("aborted")
        try:
            self._cm.__exit__(RuntimeError, err, None)
        except RuntimeError:
            pass


class ExportSink:
    """``on_layer`` sink that streams one quantizer's codes into a deployable export (``quantdyn.export``:
    GPTQ or compressed-tensors): quantized layers as the engine produces them, every other tensor copied
    from the source checkpoint at the end, the tokenizer files beside them."""

    def __init__(self, fmt: str, out: str | Path, source: LazyModel, qc: QuantConfig, label: str, **options):
        self.source, self.label = source, label
        self.writer = open_export(fmt, out, dict(source.weights.config), qc, model_type_of(source.model), **options)
        self.quantized: set[str] = set()

    def __call__(self, label: str, full: str, res: QuantResult, module: nn.Module) -> None:
        if label != self.label:
            return
        key = self.source.checkpoint_key(f"{full}.weight")
        self.writer.add_quantized(key.rsplit(".", 1)[0], res.codes, res.scales, res.zeros, res.g_idx,
                                  awq_scales=res.awq_scales)
        self.quantized.add(key)

    def close(self) -> Path:
        w = self.source.weights
        try:
            for name in w.names():
                if name not in self.quantized:
                    self.writer.add_tensor(name, w.get(name))
            for name in _TOKENIZER_FILES:
                if (w.path / name).is_file():
                    self.writer.add_file(name, w.path / name)
        except BaseException:
            self.writer.abort()
            raise
        return self.writer.close()

    def abort(self) -> None:
        self.writer.abort()


# ------------------------------------------------------------------ a whole in-memory model
def source_config_of(model: nn.Module) -> dict:
    """The HF config.json (as a dict) that describes ``model``'s full-precision architecture."""
    if isinstance(model, GPT):
        return hf_config_dict(model.config)
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "to_dict"):
        raise QuantdynError(f"cannot export a {type(model).__name__}: it has no HF config")
    d = cfg.to_dict()
    d.setdefault("architectures", [type(model).__name__])
    d.pop("quantization_config", None)
    return d


def export_model(model: nn.Module, quantization: ModelQuantization, fmt: str, out_dir: str | Path,
                 tokenizer_dir: str | Path | None = None, **options: Any) -> Path:
    """Write ``model`` with the codes of ``quantization`` as a ``fmt`` checkpoint into ``out_dir``.

    ``model`` may be the fake-quantized model quantize_model returned or the original one: the
    quantized layers' weights come from the codes, every other tensor from the model.
    tokenizer_dir: copy the tokenizer files found there. options: as :func:`open_export`.
    """
    packed = quantization.packed
    layers = sorted({k.rsplit(".", 1)[0] for k in packed if k.endswith(".codes")})
    writer = open_export(fmt, out_dir, source_config_of(model), quantization.config, quantization.model_type,
                         **options)
    try:
        from safetensors import safe_open

        with tempfile.TemporaryDirectory(prefix="quantdyn-export-") as tmp:
            save_hf_into(model, Path(tmp))
            files = sorted(Path(tmp).glob("*.safetensors"))
            names: dict[str, Path] = {}
            for f in files:
                with safe_open(str(f), "pt") as h:
                    names.update(dict.fromkeys(h.keys(), f))
            missing = [n for n in layers if f"{n}.weight" not in names]
            if missing:
                raise QuantdynError(f"quantized layers {missing[:3]} are not in the model's checkpoint; export the "
                                    f"model that was quantized")
            quantized = set(layers)
            for name in sorted(names):
                base = name.rsplit(".", 1)[0]
                with safe_open(str(names[name]), "pt") as h:
                    if base in quantized and name.endswith(".weight"):
                        writer.add_quantized(base, packed[f"{base}.codes"], packed[f"{base}.scales"],
                                             packed[f"{base}.zeros"], packed[f"{base}.g_idx"],
                                             awq_scales=packed.get(f"{base}.awq_scales"))
                    else:
                        writer.add_tensor(name, h.get_tensor(name))
        if tokenizer_dir is not None:
            for fname in _TOKENIZER_FILES:
                src = Path(tokenizer_dir) / fname
                if src.is_file():
                    writer.add_file(fname, src)
        return writer.close()
    except BaseException:
        writer.abort()
        raise
