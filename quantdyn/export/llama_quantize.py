"""The ``llama-quantize`` command line that makes llama.cpp's own GGUF of a per-tensor plan.

    llama-quantize --token-embedding-type f32 --output-tensor-type f32 \\
        --tensor-type '^blk\\.0\\.attn_qkv\\.weight$=q4_K' ... model-f32.gguf model-plan.gguf 14

llama.cpp (``tools/quantize/quantize.cpp`` and ``llama_tensor_get_type`` in ``src/llama-quant.cpp``, commit
0c1e570) matches every ``--tensor-type PATTERN=TYPE`` as a regular expression against each tensor's name, in the
order given, with ``regex_search`` (so ``blk.1.`` would also match ``blk.11.``): each pattern here is anchored
and escaped, one per quantized tensor, and names the tensor exactly. A tensor named this way takes its type as
given (llama.cpp's own mix does not apply; its shape fallback still does, which a plan never needs: allocate
refuses types a tensor cannot hold). The token embedding and the head stay F32 (``--token-embedding-type``,
``--output-tensor-type``) as in quantdyn's GGUF export; norms and biases are never quantized. The positional
type is the plan's largest type as a llama_ftype number (it only names the file type: every tensor is overridden).
The input is an F32 GGUF of the full-precision model (llama.cpp's ``convert_hf_to_gguf.py --outtype f32``).
"""
from __future__ import annotations

import re

from quantdyn.export.gguf import gguf_arch, gguf_tensor_name
from quantdyn.quantize.gguf import GGML_TYPES
from quantdyn.quantize.plan import KEEP, Plan


def _ggml_name(label: str) -> str | None:
    if label == KEEP:
        return "f16"
    return GGML_TYPES.get(label).name if label in GGML_TYPES else None


def tensor_type_lines(plan: Plan) -> list[str] | None:
    """``PATTERN=TYPE`` for every tensor of the plan (what ``--tensor-type`` or a ``--tensor-type-file`` takes), or
    None when a type is not a plain GGUF block type or f16 (integer grids; -imatrix types need llama.cpp's own
    importance-matrix file)."""
    arch = gguf_arch(plan.model_type)
    lines = []
    for t in plan.tensors:
        ggml = _ggml_name(t.type)
        if ggml is None:
            return None
        name = gguf_tensor_name(arch, f"{t.name}.weight")
        lines.append(f"^{re.escape(name)}$={ggml}")
    return lines


def llama_quantize_args(plan: Plan, source: str = "model-f32.gguf", out: str = "model-plan.gguf") -> list[str] | None:
    """The argument list of ``llama-quantize`` (after the program name) that writes ``plan`` from an F32 GGUF
    ``source`` into ``out`` (module docstring), or None when the plan holds a type llama-quantize cannot be told."""
    lines = tensor_type_lines(plan)
    if lines is None:
        return None
    main = plan.main_type
    ftype = GGML_TYPES.get(main).file_type if main is not None else 1  # 1: LLAMA_FTYPE_MOSTLY_F16
    args = ["--token-embedding-type", "f32", "--output-tensor-type", "f32"]
    for line in lines:
        args += ["--tensor-type", line]
    return args + [source, out, str(ftype)]
