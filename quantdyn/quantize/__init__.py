"""Post-training weight quantization: pure tensor algorithms (rtn, gptq, awq)
on the grid of ``primitives`` and the deployment formats (``gguf``, ``float_formats``, registered by
``formats``), configured by ``QuantConfig``; the engine walks a model block by block.

QUANTIZERS imports the modules that register the built-in quantizers on its first lookup, so that importing
this package and parsing a label need no torch (``quantize.catalogue``, ``label_catalogue``).
"""
from quantdyn.quantize.catalogue import PRESETS, QUANTIZERS, QuantConfig, parse_quantizer, quant_preset

__all__ = ["PRESETS", "QUANTIZERS", "QuantConfig", "QuantResult", "num_threads", "parse_quantizer", "quant_preset"]


def __getattr__(name: str):
    if name in ("QuantResult", "num_threads"):  # torch: imported when asked for
        from quantdyn.quantize import primitives

        return getattr(primitives, name)
    raise AttributeError(f"module 'quantdyn.quantize' has no attribute '{name}'")
