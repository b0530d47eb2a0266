"""Streaming writer of a quantized checkpoint directory (GPTQ or compressed-tensors).

The measurement engine quantizes one decoder block at a time; the writer takes each layer's
codes as they come and keeps at most one shard of tensors in memory::

    w = open_export("gptq", out_dir, source_config=hf_config_dict, qcfg=qcfg, model_type="llama")
    try:
        w.add_tensor("model.embed_tokens.weight", emb)            # everything not quantized, as in the checkpoint
        for name, codes, scales, zeros, g_idx in layers:        # per block, as they are produced
            w.add_quantized(name, codes, scales, zeros, g_idx, bias=bias_or_None)
        ...
        w.add_file("tokenizer.json", tokenizer_dir / "tokenizer.json")
        w.close()                                                # shards renamed, index + config.json written
    except BaseException:
        w.abort()                                                # nothing is left behind
        raise

(or ``with open_export(...) as w: ...``: close on success, abort on an exception).

Layout of ``out_dir`` (owned by this module): ``model.safetensors`` -- or
``model-0000i-of-0000N.safetensors`` plus ``model.safetensors.index.json`` once the tensors
exceed one shard -- ``config.json`` (the source config plus ``quantization_config``), for GPTQ
also ``quantize_config.json`` (read by AutoGPTQ-era tools), ``quantdyn_export.json``
(provenance: quantizer config and hash, layers, git commit, time) and any files added with
:meth:`ExportWriter.add_file`. Everything is written into a temporary directory beside
``out_dir`` and renamed into place by :meth:`ExportWriter.close` (quantdyn.files.atomic_dir):
a crash or :meth:`ExportWriter.abort` leaves ``out_dir`` as it was.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Any, Mapping

import torch

from quantdyn.errors import QuantdynError
from quantdyn.export.layouts import (
    EXPORT_FORMATS,
    SCALE_DTYPES,
    ExportFormat,
    check_exportable,
    check_rotation_exportable,
    permuted_groups,
)
from quantdyn.export.plans import check_int_plan, ct_groups, gptq_dynamic, is_plan, layer_config, llmcompressor_recipe
from quantdyn.export.shards import DEFAULT_SHARD_BYTES, Shards, cpu_tensor
from quantdyn.files import atomic_dir
from quantdyn.models.adapters import hf_model_type
from quantdyn.quantize.catalogue import QuantConfig, parse_quantizer
from quantdyn.quantize.primitives import QuantResult, n_groups
from quantdyn.runtime import git_sha

PROVENANCE_FILE = "quantdyn_export.json"
"""Provenance file of an export (also how an existing export directory is recognised)."""
INDEX = "model.safetensors.index.json"


class _Aborted(Exception):
    """Raised into the atomic directory to discard it."""


def _model_dtype(source_config: dict) -> torch.dtype:
    name = source_config.get("dtype") or source_config.get("torch_dtype") or "float32"
    return SCALE_DTYPES.get(str(name).replace("torch.", ""), torch.float32)


def _check_out_dir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise QuantdynError(f"export directory '{out}' is a file; pass a directory with --out")
    if out.is_dir() and any(out.iterdir()) and not (out / PROVENANCE_FILE).is_file():
        raise QuantdynError(f"'{out}' exists and is not a quantdyn export; pass an empty or new directory with --out "
                            f"(an earlier quantdyn export there would be replaced)")


class ExportWriter:
    """Writes one quantized checkpoint directory, a shard at a time; see the module docstring."""

    def __init__(self, fmt: str, out_dir: str | Path, source_config: dict, qcfg: QuantConfig | str | dict,
                 model_type: str, *, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                 layers: Mapping[str, tuple[int, int]] | None = None, **options: Any):
        self.format: ExportFormat = EXPORT_FORMATS.get(fmt)
        self.qcfg = parse_quantizer(qcfg)
        if not isinstance(source_config, dict) or not source_config.get("model_type"):
            raise QuantdynError("source_config must be the model's HF config.json as a dict (with 'model_type')")
        if source_config.get("quantization_config"):
            raise QuantdynError("the source model is already quantized (its config has a quantization_config); "
                                "export from a full-precision checkpoint")
        if max_shard_bytes < 1:
            raise QuantdynError(f"max_shard_bytes={max_shard_bytes} must be >= 1")
        self.model_type = str(model_type)
        self._layer_cfgs: dict[str, QuantConfig | None] | None = None
        if is_plan(self.qcfg):  # a per-tensor plan: every type it may give a layer must fit the format
            self._layer_cfgs = {}
            types = check_int_plan(self.qcfg, self.format.name)
            for qc in types:
                self.settings = check_exportable(fmt, qc, hf_model_type(self.model_type), _model_dtype(source_config),
                                                 layers=layers, **options)
        else:
            self.settings = check_exportable(fmt, self.qcfg, hf_model_type(self.model_type), _model_dtype(source_config),
                                             layers=layers, **options)
        self.out_dir = Path(out_dir)
        _check_out_dir(self.out_dir)
        self.source_config = json.loads(json.dumps(source_config, default=str))
        self._layers: list[str] = []
        self._sizes: dict[str, int] = {}
        self._files: set[str] = set()
        self._t0 = time.time()
        self._cm = atomic_dir(self.out_dir)  # the temporary directory exists from here on
        self._tmp: Path | None = self._cm.__enter__()
        self._shards = Shards(self._tmp, "model", max_shard_bytes)

    # ------------------------------------------------------------------ adding
    def _live(self) -> Path:
        if self._tmp is None:
            raise QuantdynError(f"the export to '{self.out_dir}' is already closed or aborted")
        return self._tmp

    def add_quantized(self, layer_name: str, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                      g_idx: torch.Tensor, bias: torch.Tensor | None = None,
                      awq_scales: torch.Tensor | None = None, result: QuantResult | None = None) -> None:
        """Add one quantized linear in quantdyn's layout (``ModelQuantization.packed``):
        codes (out, in) integers, scales/zeros (out, groups), g_idx (in,), optional bias (out,). A plan's layer
        also brings its ``result`` (its type is in the result's diagnostics; an f16 layer is stored dense)."""
        self._live()
        qcfg, settings = self.qcfg, self.settings
        if self._layer_cfgs is not None:
            qcfg = layer_config(self.qcfg, (result.diagnostics if result is not None else {}).get("plan_type"))
            self._layer_cfgs[layer_name] = qcfg
            if qcfg is None:
                self._shards.add(f"{layer_name}.weight", result.weight.to(torch.float16))
                if bias is not None:
                    self._shards.add(f"{layer_name}.bias", bias)
                self._layers.append(layer_name)
                return
            settings = dataclasses.replace(settings, desc_act=permuted_groups(qcfg))
        if awq_scales is not None:
            raise QuantdynError(f"layer '{layer_name}' has AWQ input scales, which {self.format.name} checkpoints "
                                f"cannot hold; export an rtn or gptq quantizer")
        q = {"codes": cpu_tensor(f"{layer_name}.codes", codes), "scales": cpu_tensor(f"{layer_name}.scales", scales),
             "zeros": cpu_tensor(f"{layer_name}.zeros", zeros), "g_idx": cpu_tensor(f"{layer_name}.g_idx", g_idx)}
        if q["codes"].dim() != 2:
            raise QuantdynError(f"layer '{layer_name}': codes must be (out, in), got shape {tuple(q['codes'].shape)}")
        out_f, in_f = q["codes"].shape
        groups = n_groups(in_f, qcfg.group_size)
        want = {"scales": (out_f, groups), "zeros": (out_f, groups), "g_idx": (in_f,)}
        for k, shape in want.items():
            if tuple(q[k].shape) != shape:
                raise QuantdynError(f"layer '{layer_name}': {k} has shape {tuple(q[k].shape)}, expected {shape} for "
                                    f"{out_f}x{in_f} codes with group_size {qcfg.group_size}")
        if q["codes"].numel() and int(q["codes"].max()) > 2**qcfg.bits - 1:
            raise QuantdynError(f"layer '{layer_name}': codes exceed {qcfg.bits} bits; export with the QuantConfig "
                                f"that produced them")
        tensors = self.format.layer_tensors(layer_name, q, qcfg, settings)
        if bias is not None:
            tensors[f"{layer_name}.bias"] = bias
        for k in tensors:
            if k in self._shards.names:
                raise QuantdynError(f"tensor '{k}' was added to the export twice")
        for k, t in tensors.items():
            self._shards.add(k, t)
        self._layers.append(layer_name)
        self._sizes[layer_name] = out_f * in_f

    def add_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """Add a tensor that stays as it is (embeddings, norms, biases, the head), under its checkpoint name."""
        self._live()
        self._shards.add(name, tensor)

    def add_file(self, name: str, source: str | Path | bytes) -> None:
        """Copy a file (tokenizer, generation config, README) into the export under ``name``."""
        tmp = self._live()
        rel = Path(name)
        if rel.is_absolute() or ".." in rel.parts or not rel.parts:
            raise QuantdynError(f"file name '{name}' must be a relative path inside the export")
        if name in self._files or rel.name in ("config.json", PROVENANCE_FILE, INDEX) or rel.suffix == ".safetensors":
            raise QuantdynError(f"file '{name}' is written by the exporter itself or was added twice")
        dest = tmp / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(source, bytes):
            dest.write_bytes(source)
        else:
            src = Path(source)
            if not src.is_file():
                raise QuantdynError(f"cannot add '{src}' to the export: no such file")
            shutil.copyfile(src, dest)
        self._files.add(name)

    # ------------------------------------------------------------------ finishing
    @property
    def layers(self) -> list[str]:
        """Names of the quantized layers added so far."""
        return list(self._layers)

    def close(self) -> Path:
        """Write the last shard, the index, config.json and provenance; move the directory into place."""
        tmp = self._live()
        if not self._layers:
            self.abort()
            raise QuantdynError("no quantized layer was added; nothing was exported")
        try:
            self._finish(tmp)
        except BaseException:
            self.abort()
            raise
        self._tmp = None
        self._cm.__exit__(None, None, None)
        return self.out_dir

    def _finish(self, tmp: Path) -> None:
        weight_map = self._shards.finish()
        n = len(set(weight_map.values()))
        qconfig = (self.format.config(self.qcfg, self._layers, self.settings) if self._layer_cfgs is None
                   else self._plan_config(tmp))
        config = dict(self.source_config)
        config["quantization_config"] = qconfig
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if self.format.name == "gptq":
            (tmp / "quantize_config.json").write_text(json.dumps(qconfig, indent=2))
        provenance = dict(
            format=self.format.name, model_type=self.model_type, quantizer=qconfig.get("meta", {}).get("quantdyn")
            or qconfig.get("quantdyn"), layers=self._layers, tensors=len(weight_map), bytes=self._shards.total_bytes,
            shards=n, scale_dtype=str(self.settings.scale_dtype).replace("torch.", ""),
            checkpoint_format=self.settings.checkpoint_format, git_sha=git_sha(),
            created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), seconds=time.time() - self._t0,
        )
        (tmp / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2))

    def _plan_config(self, tmp: Path) -> dict:
        """The quantization_config of a plan (export/plans.py): the base scheme and GPTQModel's ``dynamic``, or one
        compressed-tensors config group per scheme (and the llm-compressor recipe beside it)."""
        layers = self._layer_cfgs or {}
        sizes = {n: self._sizes.get(n, 1) for n in layers}
        base, dynamic = gptq_dynamic(layers, sizes)
        qconfig = self.format.config(base, [n for n, qc in layers.items() if qc is not None],
                                     dataclasses.replace(self.settings, desc_act=permuted_groups(base)))
        plan = {"name": self.qcfg.name, "layers": {n: (qc.name if qc is not None else "f16") for n, qc in layers.items()}}
        if self.format.name == "gptq":
            qconfig["dynamic"] = dynamic
            qconfig["meta"]["quantdyn"] = {**qconfig["meta"]["quantdyn"], "plan": plan}
        else:
            groups, ignore = ct_groups(layers)
            qconfig["config_groups"], qconfig["ignore"] = groups, ignore
            qconfig["quantdyn"] = {**qconfig["quantdyn"], "plan": plan}
            if any(not g["weights"]["symmetric"] for g in groups.values()):
                qconfig["dequantize"] = True
            else:
                qconfig.pop("dequantize", None)
            import yaml

            (tmp / "recipe.yaml").write_text(yaml.safe_dump(llmcompressor_recipe(layers), sort_keys=False))
        return qconfig

    def abort(self) -> None:
        """Discard everything written so far (``out_dir`` stays as it was); safe to call twice."""
        if self._tmp is None:
            return
        self._tmp = None
        self._shards.drop()
        self._cm.__exit__(_Aborted, _Aborted("export aborted"), None)

    def __enter__(self) -> "ExportWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif self._tmp is not None:
            self.close()


def open_export(fmt: str, out_dir: str | Path, source_config: dict, qcfg: QuantConfig | str | dict,
                model_type: str, **options: Any) -> ExportWriter:
    """Start a streaming export of format ``fmt`` ('gptq' or 'compressed-tensors') into ``out_dir``.

    source_config: the model's HF config.json as a dict (for quantdyn's GPT: ``hf_config_dict``);
    qcfg: the QuantConfig the codes come from; model_type: 'quantdyn-gpt' or the HF model_type.
    options: ``scale_dtype`` ('float16' | 'bfloat16' | 'float32'; GPTQ: float16 only; compressed-tensors:
    default the model's dtype), ``checkpoint_format`` (GPTQ: 'gptq' (v1, default) | 'gptq_v2'),
    ``max_shard_bytes``, ``layers`` ({name: (out_features, in_features)} of the layers to come). Everything the
    format cannot hold is refused here, before anything is written -- except what only the codes tell (a GPTQ
    v1 zero point of 0), refused by :meth:`ExportWriter.add_quantized` (abort then leaves nothing behind).
    """
    own = EXPORT_FORMATS.get(fmt).open_writer
    if own is not None:  # a single-file format (GGUF)
        check_rotation_exportable(fmt, parse_quantizer(qcfg))
        return own(out_dir, source_config, qcfg, model_type, **options)
    return ExportWriter(fmt, out_dir, source_config, qcfg, model_type, **options)
