"""Per-format quantization time per layer: quantdyn against the reference implementation, in one run.

    .venv/bin/python bench/formats_speed.py [--quick] [--ggml-base PATH/libggml-base.so]

For pythia-160m's four layer shapes (W random, bf16-rounded like a checkpoint), each format's pure function
(quantdyn.quantize.gguf / float_formats) and its reference, on identical inputs, with a check that the
outputs are equal:

* GGUF types (with and without an importance matrix): ggml's ``ggml_quantize_chunk`` when ``--ggml-base``
  (or an installed llama-cpp-python) gives libggml-base.so, else the ``gguf`` package's numpy quantizers for
  the five types it implements;
* FP8 per tensor / per channel, MXFP4, NVFP4: torchao; NF4: bitsandbytes (CPU).

A reference that is not installed is left out (printed). Seconds are the best of ``--repeat`` calls at one
torch thread (the engine's default), ratio = quantdyn / reference: GGUF's scale searches run in ggml's C
loop order, so quantdyn pays Python-level loops over the 16-32 elements of a block, vectorised across blocks.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "fixtures"))

from make_gguf_reference import ggml_bytes, load_ggml  # noqa: E402  (tests/fixtures: ggml through ctypes)
from quantdyn.quantize import float_formats as ff  # noqa: E402
from quantdyn.quantize import gguf as qg  # noqa: E402
from quantdyn.quantize.primitives import num_threads  # noqa: E402

LAYERS = {  # pythia-160m: d_model 768, d_ff 3072
    "query_key_value": (2304, 768),
    "attention.dense": (768, 768),
    "dense_h_to_4h": (3072, 768),
    "dense_4h_to_h": (768, 3072),
}
GGUF_TYPES = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k"]


def best(fn, repeat: int) -> tuple[float, object]:
    out, t = None, float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        t = min(t, time.perf_counter() - t0)
    return t, out


def ggml_lib(path: str | None):
    """libggml-base through ctypes (the fixture maker's loader), or None without one."""
    if path is None:
        try:
            import llama_cpp
            path = str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so")
        except ImportError:
            return None
    return load_ggml(path)


def ggml_quantize(lib, W: np.ndarray, t: str, im: np.ndarray | None) -> torch.Tensor:
    return torch.from_numpy(ggml_bytes(lib, np.ascontiguousarray(W, dtype=np.float32), t, im))


def references(lib):
    """{format: (reference name, fn(W) -> comparable output, fn(quantdyn result) -> same)}."""
    refs = {}
    if lib is not None:
        for t in GGUF_TYPES:
            refs[t] = ("ggml", lambda W, t=t: ggml_quantize(lib, W.numpy(), t, None),
                       lambda W, t=t: qg.pack_gguf(qg.quantize_gguf(W, t)))
            if t != "q8_0":
                refs[f"{t}-imatrix"] = ("ggml", lambda W, t=t: ggml_quantize(lib, W.numpy(), t, IM[W.shape[1]].numpy()),
                                        lambda W, t=t: qg.pack_gguf(qg.quantize_gguf(W, t, IM[W.shape[1]])))
    else:
        try:
            import gguf
            for t in ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"]:
                qt = getattr(gguf.GGMLQuantizationType, t.upper())
                refs[t] = ("gguf", lambda W, qt=qt: torch.from_numpy(gguf.quants.quantize(W.numpy(), qt)),
                           lambda W, t=t: qg.pack_gguf(qg.quantize_gguf(W, t)))
        except ImportError:
            print("no GGUF reference: install llama-cpp-python or gguf")
    logging.disable(logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            from torchao.prototype.mx_formats.mx_tensor import to_mx
            from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale
            from torchao.quantization.granularity import PerRow, PerTensor
            from torchao.quantization.quantize_.workflows.float8.float8_tensor import Float8Tensor

            refs["fp8"] = ("torchao", lambda W: Float8Tensor.from_hp(W, granularity=PerTensor()).qdata.view(torch.uint8),
                           lambda W: ff.fp8_per_tensor(W).codes)
            refs["fp8-channel"] = ("torchao", lambda W: Float8Tensor.from_hp(W, granularity=PerRow()).qdata.view(torch.uint8),
                                   lambda W: ff.fp8_per_channel(W).codes)
            refs["mxfp4"] = ("torchao", lambda W: to_mx(W, torch.float4_e2m1fn_x2, 32)[0].view(torch.uint8).reshape(W.shape[0], -1),
                             lambda W: ff.mxfp4(W).storage["e8m0"])
            refs["nvfp4"] = ("torchao", lambda W: nvfp4_quantize(W, 16, per_tensor_amax_to_scale(W.abs().amax()))[0].view(torch.uint8),
                             lambda W: ff.nvfp4(W).storage["e4m3"])
        except ImportError:
            print("no torchao: FP8/MXFP4/NVFP4 left out")
        try:
            import bitsandbytes.functional as F

            def bnb(W):
                packed, _ = F.quantize_4bit(W, blocksize=64, compress_statistics=True, quant_type="nf4")
                flat = packed.reshape(-1)
                return torch.stack([flat >> 4, flat & 0xF], 1).reshape(W.shape)
            refs["nf4"] = ("bitsandbytes", bnb, lambda W: ff.nf4(W).codes)
        except ImportError:
            print("no bitsandbytes: NF4 left out")
    logging.disable(logging.NOTSET)
    return refs


IM: dict[int, torch.Tensor] = {}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="two layer shapes, one timing each, the k-quants and floats")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--ggml-base", default=None, help="libggml-base.so of a llama.cpp build (default: llama-cpp-python's)")
    args = p.parse_args()
    layers = dict(list(LAYERS.items())[1:3]) if args.quick else LAYERS
    repeat = 1 if args.quick else args.repeat
    refs = references(ggml_lib(args.ggml_base))
    if args.quick:
        refs = {k: v for k, v in refs.items() if k in ("q8_0", "q4_0", "q4_k", "q6_k", "q4_k-imatrix", "fp8", "nf4",
                                                       "mxfp4", "nvfp4")}
    g = torch.Generator().manual_seed(0)
    figures: dict = {}
    print(f"torch {torch.__version__}, 1 thread; seconds per layer (best of {repeat}); ratio = quantdyn / reference")
    with num_threads(1):
        for lname, (R, C) in layers.items():
            W = (torch.randn(R, C, generator=g) * 0.02).bfloat16().float()
            IM[C] = torch.rand(C, generator=g) ** 4 * 10
            for fmt, (rname, ref_fn, ours_fn) in refs.items():
                t_ref, r = best(lambda: ref_fn(W), repeat)
                t_ours, o = best(lambda: ours_fn(W), repeat)
                equal = bool(torch.equal(torch.as_tensor(o), torch.as_tensor(r)))
                figures.setdefault(fmt, {})[lname] = {"quantdyn_s": round(t_ours, 4), "reference_s": round(t_ref, 4),
                                                      "ratio": round(t_ours / t_ref, 2), "reference": rname,
                                                      "equal": equal, "shape": [R, C]}
                print(f"  {lname:16s} {fmt:14s} quantdyn {t_ours:7.3f}s  {rname:12s} {t_ref:7.3f}s  "
                      f"ratio {t_ours / t_ref:6.2f}  {'equal' if equal else 'DIFFERENT'}")
    from common import record  # bench/common.py (this directory is on sys.path)

    record("formats_speed", figures, args)


if __name__ == "__main__":
    main()
