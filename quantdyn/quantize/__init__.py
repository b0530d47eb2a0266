"""Post-training weight quantization: pure tensor algorithms (rtn, gptq, awq)
on the grid of ``primitives`` and the deployment formats (``gguf``, ``float_formats``, registered by
``formats``), configured by ``QuantConfig``; the engine walks a model block by block.

Importing this package registers every built-in quantizer in QUANTIZERS.
"""
from quantdyn.quantize import awq as _awq  # noqa: F401  (registers 'awq')
from quantdyn.quantize import formats as _formats  # noqa: F401  (registers the GGUF, FP8, NF4, MXFP4, NVFP4 formats)
from quantdyn.quantize import gptq as _gptq  # noqa: F401  (registers 'gptq')
from quantdyn.quantize import plan as _plan  # noqa: F401  (registers the plan:FILE and auto@BUDGET:TYPES families)
from quantdyn.quantize import rtn as _rtn  # noqa: F401  (registers 'rtn')
from quantdyn.quantize.config import PRESETS, QUANTIZERS, QuantConfig, parse_quantizer, quant_preset
from quantdyn.quantize.primitives import QuantResult, num_threads

__all__ = ["PRESETS", "QUANTIZERS", "QuantConfig", "QuantResult", "num_threads", "parse_quantizer", "quant_preset"]
