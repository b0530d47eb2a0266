"""quantdyn's own small reader of GPTQ and compressed-tensors pack-quantized checkpoints.

It unpacks what :mod:`quantdyn.export.writer` writes (and checkpoints of the same layout
written by GPTQModel or llm-compressor) back into quantdyn's layout -- codes (out, in),
scales and zeros (out, groups), g_idx (in,) -- so an export can be checked code for code
without the libraries that serve it. Tensors are read lazily from the safetensors shards
(``safe_open``), one layer at a time.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from quantdyn.errors import QuantdynError
from quantdyn.export.packing import unpack_rows
from quantdyn.quantize.primitives import dequantize_weight


@dataclass(frozen=True)
class ExportedLayer:
    """One quantized linear read back from a checkpoint, in quantdyn's layout."""

    codes: torch.Tensor
    """uint8 (out, in)."""
    scales: torch.Tensor
    """float32 (out, groups), the stored scales widened exactly."""
    zeros: torch.Tensor
    """float32 (out, groups), integer zero points in [0, 2^bits)."""
    g_idx: torch.Tensor
    """int32 (in,)."""
    bits: int
    """Bit width."""

    def weight(self) -> torch.Tensor:
        """The dequantized weight (out, in), float32: scales[:, g] * (codes - zeros[:, g])."""
        return dequantize_weight(self.codes, self.scales, self.zeros, self.g_idx)


class ExportReader:
    """Lazy view of an exported checkpoint directory."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        cfg_file = self.path / "config.json"
        if not cfg_file.is_file():
            raise QuantdynError(f"'{self.path}' has no config.json; pass an exported checkpoint directory")
        self.config: dict = json.loads(cfg_file.read_text())
        self.quantization_config: dict = self.config.get("quantization_config") or {}
        method = self.quantization_config.get("quant_method")
        if method not in ("gptq", "compressed-tensors"):
            raise QuantdynError(f"'{self.path}' is not a GPTQ or compressed-tensors checkpoint (quant_method {method!r})")
        self.format = "gptq" if method == "gptq" else "compressed-tensors"
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            self._where = {k: self.path / v for k, v in json.loads(index.read_text())["weight_map"].items()}
        else:
            from safetensors import safe_open

            single = self.path / "model.safetensors"
            if not single.is_file():
                raise QuantdynError(f"'{self.path}' has neither model.safetensors nor an index; the export is incomplete")
            with safe_open(str(single), "pt") as f:
                self._where = dict.fromkeys(f.keys(), single)
        suffix = ".qweight" if self.format == "gptq" else ".weight_packed"
        self.layer_names = sorted(k[: -len(suffix)] for k in self._where if k.endswith(suffix))

    @property
    def names(self) -> list[str]:
        """Every tensor name in the checkpoint."""
        return sorted(self._where)

    def tensor(self, name: str) -> torch.Tensor:
        """One stored tensor, as stored."""
        from safetensors import safe_open

        if name not in self._where:
            raise QuantdynError(f"tensor '{name}' is not in the export '{self.path}'")
        with safe_open(str(self._where[name]), "pt") as f:
            return f.get_tensor(name)

    def _ct_weights_args(self, name: str) -> dict:
        groups = self.quantization_config.get("config_groups") or {}
        for grp in groups.values():
            targets = grp.get("targets") or []
            if name in targets or len(groups) == 1:
                return grp["weights"]
        raise QuantdynError(f"layer '{name}' matches no config group of '{self.path}'")

    def layer(self, name: str) -> ExportedLayer:
        """Unpack one quantized layer."""
        if name not in self.layer_names:
            raise QuantdynError(f"'{name}' is not a quantized layer of '{self.path}'")
        if self.format == "gptq":
            qc = self.quantization_config
            bits = int(qc["bits"])
            qweight, qzeros = self.tensor(f"{name}.qweight"), self.tensor(f"{name}.qzeros")
            scales = self.tensor(f"{name}.scales").float().t().contiguous()          # (out, groups)
            g_idx = self.tensor(f"{name}.g_idx").to(torch.int32)
            in_f, out_f = g_idx.numel(), scales.shape[0]
            codes = unpack_rows(qweight.t().contiguous(), bits, in_f)                # (out, in)
            zeros = unpack_rows(qzeros, bits, out_f).t()                             # (out, groups)
            fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
            if fmt == "gptq":  # v1 stores zero - 1 per field
                zeros = (zeros + 1) & (2**bits - 1)
        else:
            w = self._ct_weights_args(name)
            bits = int(w["num_bits"])
            out_f, in_f = (int(x) for x in self.tensor(f"{name}.weight_shape").tolist())
            codes = unpack_rows(self.tensor(f"{name}.weight_packed"), bits, in_f)
            scales = self.tensor(f"{name}.weight_scale").float()
            if scales.dim() == 1:
                scales = scales[:, None]
            g = w.get("group_size") or 0
            g_idx = (torch.arange(in_f) // g if g and w.get("strategy") == "group"
                     else torch.zeros(in_f, dtype=torch.long)).to(torch.int32)
            if w.get("symmetric", True):
                zeros = torch.full(scales.shape, 2 ** (bits - 1), dtype=torch.int32)
            else:
                zp = self.tensor(f"{name}.weight_zero_point")
                zeros = unpack_rows(zp.t().contiguous(), bits, out_f).t()             # unsigned = signed + offset
        return ExportedLayer(codes=codes.to(torch.uint8), scales=scales.contiguous(),
                             zeros=zeros.float().contiguous(), g_idx=g_idx.contiguous(), bits=bits)

    def layers(self) -> Iterator[tuple[str, ExportedLayer]]:
        """(name, layer) for every quantized layer, one at a time."""
        for name in self.layer_names:
            yield name, self.layer(name)


def read_export(path: str | Path) -> ExportReader:
    """Open an exported checkpoint directory for reading (see :class:`ExportReader`)."""
    return ExportReader(path)
