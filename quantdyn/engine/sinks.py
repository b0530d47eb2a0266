"""The writers of quantized checkpoints, fed by the engine while it streams: one per on-disk layout.

* :class:`QuantizedCheckpointWriter` -- quantdyn's own layout (``quantdyn quantize --out DIR``):
  the HF checkpoint with every quantized layer's weight dequantized (``model.safetensors``, or
  ``model-0000k-of-0000n.safetensors`` + index when larger than a shard), the source's tokenizer
  and other small files, ``quant_codes.safetensors`` (codes, scales, zeros, g_idx[, awq_scales] per
  layer, sharded the same way) and ``quant_config.json`` (the QuantConfig, its hash, per-layer rows,
  summary, git commit).
* :class:`ExportSink` -- a deployable GPTQ or compressed-tensors checkpoint (``--export FMT``;
  the layout is :mod:`quantdyn.export`'s).

Both are ``on_layer`` sinks of :func:`~quantdyn.engine.measure.measure` for ONE quantizer label:
quantized layers are written as the engine produces them, and every other tensor and the config
come from the source at the end, so memory stays at one shard whatever the model's size::

    sink = ExportSink("gptq", out, model, qc, "gptq4")   # or QuantizedCheckpointWriter(out, model, qc, "gptq4")
    try:
        m = measure(model, {"gptq4": qc}, eval_windows, calib_ids, on_layer=sink)
    except BaseException:
        sink.abort()                                      # nothing is left behind
        raise
    sink.close()                                          # QuantizedCheckpointWriter: close(rows, summary, git_sha)

The source is a checkpoint read lazily (:class:`~quantdyn.engine.lazy_model.LazyModel`) or a model
in memory (:class:`~quantdyn.engine.lazy_model.InMemoryModel` or the bare ``nn.Module``). A model in
memory is written once to a temporary HF checkpoint (``save_hf_into``, exactly what saving it would
write) and read back lazily like any other, so both kinds of source take the same path through the
same writer. The output directory appears only when complete (``quantdyn.files.atomic_dir``).
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import torch.nn as nn

from quantdyn.config import config_hash, to_dict
from quantdyn.engine.lazy_model import BlockSource, InMemoryModel, LazyModel
from quantdyn.errors import QuantdynError
from quantdyn.export import open_export
from quantdyn.export.shards import DEFAULT_SHARD_BYTES, Shards
from quantdyn.files import atomic_dir
from quantdyn.models.adapters import get_weight, model_type_of
from quantdyn.models.hf_io import save_hf_into
from quantdyn.models.weights import CheckpointWeights
from quantdyn.quantize.catalogue import QuantConfig, parse_quantizer
from quantdyn.quantize.primitives import QuantResult

_COPY_SUFFIXES = (".json", ".model", ".txt", ".tiktoken")
"""Small files of the source that quantdyn's quantized checkpoint copies (tokenizer, generation config ...)."""
_NOT_COPIED = {"config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json", "quant_config.json"}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                    "vocab.json", "merges.txt", "tokenizer.model", "generation_config.json")
"""Files of the source that an export copies (a deployable checkpoint holds nothing else of the source's)."""
LAYOUT = ("weight (out, in) = scales[:, g_idx] * (codes - zeros[:, g_idx]) [/ awq_scales]; "
          "GPT-2 Conv1D weights are stored transposed in the checkpoint")
"""How quant_codes.safetensors maps back to the weights (written into quant_config.json)."""


def quantized_layer_shapes(source: LazyModel) -> dict[str, tuple[int, int]]:
    """{checkpoint layer name: (out_features, in_features)} of every block linear the engine quantizes
    (read from the skeleton: no weight is loaded)."""
    ad = source.adapter
    shapes = {}
    for b, block in enumerate(source.blocks):
        for group in ad.linear_groups(block):
            for name, module in group:
                key = source.checkpoint_key(f"{ad.blocks}.{b}.{name}.weight")
                shapes[key.rsplit(".", 1)[0]] = tuple(get_weight(module).shape)
    return shapes


class _LayerSink:
    """What both writers share: the source as a checkpoint, the label filter, the tensors left to copy."""

    def __init__(self, source: BlockSource | nn.Module, label: str):
        self._scratch: tempfile.TemporaryDirectory | None = None
        self.source = self._as_checkpoint(source)
        self.label = label
        self.written: set[str] = set()
        """Checkpoint names written from the engine's layers (not copied from the source)."""

    def _as_checkpoint(self, source: BlockSource | nn.Module) -> LazyModel:
        if isinstance(source, LazyModel):
            return source
        if isinstance(source, InMemoryModel):
            source = source.model
        if not isinstance(source, nn.Module):
            raise QuantdynError(f"a quantized checkpoint is written from a LazyModel, an InMemoryModel or a model, "
                                f"not a {type(source).__name__}")
        self._scratch = tempfile.TemporaryDirectory(prefix="quantdyn-source-")
        try:
            save_hf_into(source, Path(self._scratch.name))
            return LazyModel(CheckpointWeights(self._scratch.name))
        except BaseException:
            self._release()
            raise

    def _release(self) -> None:
        if self._scratch is not None:
            self._scratch.cleanup()
            self._scratch = None

    def __call__(self, label: str, full: str, res: QuantResult, module: nn.Module) -> None:
        if label == self.label:
            self._add(full, self.source.checkpoint_key(f"{full}.weight"), res, module)

    def _add(self, full: str, key: str, res: QuantResult, module: nn.Module) -> None:
        raise NotImplementedError

    def _unwritten(self) -> Iterator[tuple[str, object]]:
        """(name, tensor) of every source tensor the engine did not write, read one at a time."""
        w = self.source.weights
        for name in w.names():
            if name not in self.written:
                yield name, w.get(name)

    def _source_files(self, keep) -> Iterator[Path]:
        for f in sorted(self.source.weights.path.iterdir()):
            if f.is_file() and keep(f):
                yield f


class QuantizedCheckpointWriter(_LayerSink):
    """``on_layer`` sink writing quantdyn's quantized checkpoint for one quantizer (module docstring)."""

    def __init__(self, out: str | Path, source: BlockSource | nn.Module, qc: QuantConfig | str | dict, label: str,
                 model_type: str | None = None, shard_bytes: int = DEFAULT_SHARD_BYTES):
        self.out, self.qc = Path(out), parse_quantizer(qc)
        super().__init__(source, label)
        self.model_type = model_type or model_type_of(self.source.model)
        self._cm = atomic_dir(self.out)
        self.tmp: Path | None = self._cm.__enter__()
        self.weights = Shards(self.tmp, "model", shard_bytes, {"format": "pt"})
        self.codes = Shards(self.tmp, "quant_codes", shard_bytes,
                            {"format": "quantdyn-codes", "quantizer": self.qc.name})
        self.untied_head = False

    def _add(self, full: str, key: str, res: QuantResult, module: nn.Module) -> None:
        if self.source.adapter.head == full and key != f"{full}.weight":
            key = f"{full}.weight"  # a tied head, quantized: saved untied (the embedding stays full precision)
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
        if self.tmp is None:
            raise QuantdynError(f"the quantized checkpoint '{self.out}' is already closed or aborted")
        tmp = self.tmp
        try:
            for name, t in self._unwritten():
                self.weights.add(name, t)
            self.weights.finish()
            self.codes.finish()
            config = dict(self.source.weights.config)
            if self.untied_head:
                config["tie_word_embeddings"] = False
            (tmp / "config.json").write_text(json.dumps(config, indent=2))
            for f in self._source_files(lambda f: f.suffix in _COPY_SUFFIXES and f.name not in _NOT_COPIED):
                shutil.copy2(f, tmp / f.name)
            meta = dict(quantizer=to_dict(self.qc), config_hash=config_hash(self.qc), model_type=self.model_type,
                        layout=LAYOUT, summary=summary, rows=rows, git_sha=git_sha)
            (tmp / "quant_config.json").write_text(json.dumps(meta, indent=2, default=str))
        except BaseException:
            self.abort()
            raise
        self.tmp = None
        self._cm.__exit__(None, None, None)
        self._release()
        return self.out

    def abort(self) -> None:
        """Remove the temporary directory (nothing appears under the final name); safe to call twice."""
        if self.tmp is not None:
            self.tmp = None
            self.weights.drop()
            self.codes.drop()
            err = RuntimeError("aborted")
            try:
                self._cm.__exit__(RuntimeError, err, None)
            except RuntimeError:
                pass
        self._release()


class ExportSink(_LayerSink):
    """``on_layer`` sink that streams one quantizer's codes into a deployable export (``quantdyn.export``:
    GPTQ or compressed-tensors); what the format cannot hold -- the quantizer, the model family, any layer's
    shape -- is refused here, before anything is written."""

    def __init__(self, fmt: str, out: str | Path, source: BlockSource | nn.Module, qc: QuantConfig | str | dict,
                 label: str, **options):
        super().__init__(source, label)
        try:
            self.writer = open_export(fmt, out, dict(self.source.weights.config), qc, model_type_of(self.source.model),
                                      layers=quantized_layer_shapes(self.source), **options)
        except BaseException:
            self._release()
            raise

    def _add(self, full: str, key: str, res: QuantResult, module: nn.Module) -> None:
        self.writer.add_quantized(key.rsplit(".", 1)[0], res.codes, res.scales, res.zeros, res.g_idx,
                                  awq_scales=res.awq_scales,
                                  **({"result": res} if res.format or res.diagnostics.get("plan_type") else {}))
        self.written.add(key)

    def close(self) -> Path:
        """Copy every tensor not quantized and the tokenizer files from the source; finish the export."""
        try:
            for name, t in self._unwritten():
                self.writer.add_tensor(name, t)
            for f in self._source_files(lambda f: f.name in _TOKENIZER_FILES):
                self.writer.add_file(f.name, f)
            return self.writer.close()
        except BaseException:
            self.writer.abort()
            raise
        finally:
            self._release()

    def abort(self) -> None:
        """Discard the export (``out`` stays as it was); safe to call twice."""
        self.writer.abort()
        self._release()
