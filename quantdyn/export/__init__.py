"""Deployable exports of quantized models: GPTQ and compressed-tensors (pack-quantized), GGUF (llama.cpp).

* :func:`open_export` -> :class:`ExportWriter`: stream quantized layers and plain tensors into a
  sharded safetensors checkpoint that ``transformers.AutoModelForCausalLM.from_pretrained``,
  GPTQModel and vLLM load as a quantized model (writer.py; the layouts in layouts.py).
* :func:`check_exportable`: refuse, before any work, what a format cannot hold.
* :func:`read_export`: quantdyn's own reader (unpack back to codes/scales/zeros/g_idx).
* :func:`push_to_hub`: upload an export to the Hugging Face Hub.
"""
from quantdyn.export.layouts import EXPORT_FORMATS, ExportFormat, ExportSettings, check_exportable
from quantdyn.export import gguf as _gguf  # noqa: F401  (registers 'gguf')
from quantdyn.export.hub import push_to_hub
from quantdyn.export.reader import ExportedLayer, ExportReader, read_export
from quantdyn.export.writer import ExportWriter, open_export

__all__ = [
    "EXPORT_FORMATS", "ExportFormat", "ExportSettings", "ExportWriter", "ExportReader", "ExportedLayer",
    "check_exportable", "open_export", "push_to_hub", "read_export",
]
