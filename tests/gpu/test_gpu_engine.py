"""The streamed measurement engine on a GPU: blocks onloaded one at a time from a checkpoint on disk, the
same decisions and numbers as on the CPU, and GPU memory bounded by a block plus the streams (not the model).

Tolerances: RTN codes are computed elementwise from the same weights, so they must be identical. GPTQ's
error feedback runs through GEMMs whose rounding differs between cuBLAS and MKL, and in the engine its Hessian
comes from activations the GPU computed (their last bits differ too): a code can flip where a weight lies within
a rounding error of a decision boundary, and a flip's error, fed to the later columns, can move a later code by
more than one level. Measured on an H100 (2026-11-24): at most 0.28 % of a layer's codes differ (dense_4h_to_h
of block 0), some by 2-3 levels. Bound: at most 0.5 % of each layer's codes; Δ CE on the GPU equals the CPU's
within 2 % of its value plus 1e-4 nats (the flips move it by at most that much on these tiny models).
"""
from __future__ import annotations

import pytest
import torch

from quantdyn.engine.measure import MeasureConfig, measure
from quantdyn.models.gpt import GPT, ModelConfig, resolve_model_config
from quantdyn.models.hf_io import save_hf


def _checkpoint(tmp_path):
    torch.manual_seed(0)
    m = GPT(resolve_model_config(ModelConfig(n_layer=6, d_model=256, n_head=4, max_seq_len=256, vocab_size=512)))
    return save_hf(m, tmp_path / "ck"), sum(p.numel() for p in m.gpt_neox.layers[0].parameters())


def test_engine_on_cuda_matches_cpu_and_onloads_one_block(tmp_path, no_tf32):
    ck, block_params = _checkpoint(tmp_path)
    g = torch.Generator().manual_seed(1)
    calib, ev = torch.randint(0, 512, (16, 64), generator=g), torch.randint(0, 512, (24, 65), generator=g)
    specs = {"rtn4": "rtn4", "gptq3": "gptq3"}
    codes = {"cpu": {}, "cuda": {}}

    def keep(dev):
        return lambda label, full, res, m: codes[dev].__setitem__((label, full), res.codes.cpu())

    cpu = measure(ck, specs, ev, calib, device="cpu", cfg=MeasureConfig(batch_size=8), on_layer=keep("cpu"))
    torch.cuda.reset_peak_memory_stats()
    gpu = measure(ck, specs, ev, calib, device="cuda", cfg=MeasureConfig(batch_size=8), on_layer=keep("cuda"))
    peak = torch.cuda.max_memory_allocated()
    for (label, layer), c in codes["cpu"].items():
        d = codes["cuda"][(label, layer)]
        if label == "rtn4":
            assert torch.equal(c, d), layer
        else:
            flips = float((c != d).float().mean())
            print(f"{layer}: fraction of gptq3 codes that differ CUDA vs CPU = {flips:.2e}")
            assert flips <= 0.005, (layer, flips)
    for label in specs:
        a, b = cpu.metrics[label]["delta_ce"], gpu.metrics[label]["delta_ce"]
        assert abs(a - b) <= 0.02 * abs(a) + 1e-4, (label, a, b)
    # onloaded one block at a time: far below the whole model's parameters
    model_bytes = sum(f.stat().st_size for f in ck.glob("*.safetensors"))
    assert peak < model_bytes, (peak, model_bytes)
    print(f"peak GPU memory {peak / 2**20:.1f} MiB for a {model_bytes / 2**20:.1f} MiB checkpoint "
          f"(one block: {block_params * 4 / 2**20:.1f} MiB)")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_engine_half_precision_checkpoint_on_cuda(tmp_path, dtype):
    """A bf16/fp16 checkpoint stays in its dtype on the GPU (the compute dtype is the checkpoint's)."""
    torch.manual_seed(0)
    m = GPT(resolve_model_config(ModelConfig(n_layer=2, d_model=128, n_head=4, max_seq_len=128, vocab_size=256)))
    ck = save_hf(m.to(getattr(torch, dtype)), tmp_path / dtype)
    ev = torch.randint(0, 256, (8, 65), generator=torch.Generator().manual_seed(2))
    r = measure(ck, {"rtn4": "rtn4"}, ev, None, device="cuda")
    assert r.dtype == dtype and abs(r.metrics["rtn4"]["delta_ce"]) < 1.0
