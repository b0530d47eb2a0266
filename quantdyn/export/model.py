"""Export a whole in-memory model quantized by :func:`quantdyn.quantize.apply.quantize_model`.

A convenience for models that fit in memory (tests, small checkpoints, ``quantize --save``): the
checkpoint tensors are taken from the model's own HF serialization (so every name is the one its
loader expects, transformers' renames included) and each quantized layer's ``.weight`` is replaced
by the format's packed tensors. Large models go through the streaming :class:`ExportWriter`
directly, one block at a time.
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch.nn as nn

from quantdyn.errors import QuantdynError
from quantdyn.export.writer import open_export
from quantdyn.models.gpt import GPT
from quantdyn.models.hf_io import hf_config_dict, save_hf_into
from quantdyn.quantize.apply import ModelQuantization

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                    "merges.txt", "tokenizer.model", "generation_config.json")


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
