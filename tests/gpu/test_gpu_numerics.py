"""CUDA against CPU: the training step, the quantizers' integer codes, flash attention, FSDP2 in bf16."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from quantdyn.models.gpt import GPT, ModelConfig
from quantdyn.quantize.catalogue import QuantConfig

SHAPE = ModelConfig(n_layer=2, d_model=128, n_head=4, vocab_size=512, max_seq_len=256)


def _model(device):
    torch.manual_seed(0)
    return GPT(SHAPE).to(device)


def _batch(device, B=4, T=128):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, SHAPE.vocab_size, (B, T + 1), generator=g)
    return x[:, :-1].to(device), x[:, 1:].to(device)


def test_training_step_on_cuda_matches_cpu(no_tf32):
    """One forward/backward and 5 SGD steps in fp32: losses and gradients on CUDA equal the CPU's
    within fp32 summation-order noise.

    Tolerances: each logit is a dot product of length d_model=128 (and the attention sums over
    T=128); CUDA and CPU kernels sum in different orders, each differing by ~sqrt(K) roundings
    (unit roundoff 6e-8) -> relative ~1e-6 per layer, a few layers deep.  Loss: rtol 1e-5.
    Gradients: rtol 1e-4 relative to each tensor's largest entry (atol = 1e-4 * max|g|), since
    entries near zero carry absolute, not relative, noise.  SGD (not Adam) keeps the weight
    difference after 5 steps proportional to the gradient difference (lr * Δg per step)."""
    losses, grads = {}, {}
    for dev in ("cpu", "cuda"):
        model = _model(dev)
        x, y = _batch(dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        out = []
        for step in range(5):
            loss = F.cross_entropy(model(x).float().reshape(-1, SHAPE.vocab_size), y.reshape(-1))
            loss.backward()
            if step == 0:
                grads[dev] = {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters()}
            opt.step()
            opt.zero_grad()
            out.append(float(loss))
        losses[dev] = out
    print("max relative loss difference", max(abs(a - b) / a for a, b in zip(losses["cpu"], losses["cuda"])))
    assert losses["cuda"] == pytest.approx(losses["cpu"], rel=1e-5)
    for n, g in grads["cpu"].items():
        torch.testing.assert_close(grads["cuda"][n], g, rtol=0, atol=1e-4 * float(g.abs().max()) + 1e-12, msg=n)


def test_quantdyn_trainer_on_cuda_matches_cpu(tmp_path, no_tf32):
    """The trainer itself (AdamW, WSD, clipping) on device=cuda with train.dtype=float32 logs the CPU
    run's losses within rtol 1e-4 over 8 steps (Adam amplifies rounding noise only in entries whose
    gradient is ~0, whose effect on the loss is second order); with bf16 autocast within 2e-2
    (bf16 keeps 8 bits of mantissa: ~4e-3 relative per rounding)."""
    from quantdyn.config import from_dict, to_dict
    from quantdyn.data.prepare import DataConfig
    from quantdyn.train.checkpoint import read_metrics
    from quantdyn.train.config import RunConfig
    from quantdyn.train.trainer import train

    data = DataConfig(source="builtin:kjv", tokenizer="bpe:512", max_tokens=100_000, bpe_train_chars=300_000,
                      cache_dir=str(tmp_path / "cache"))

    def run(name, device, dtype):
        d = {"name": name, "out_dir": str(tmp_path), "seed": 3, "data": to_dict(data),
             "model": {"n_layer": 2, "d_model": 64, "n_head": 2, "max_seq_len": 64},
             "schedule": {"name": "wsd", "warmup": 2, "decay": 4},
             "train": {"steps": 8, "batch_size": 8, "seq_len": 64, "eval_every": 0, "eval_windows": 4,
                       "checkpoint_every": 8, "log_every": 1, "device": device, "dtype": dtype}}
        return [r["train/loss"] for r in read_metrics(train(from_dict(RunConfig, d), progress=False))
                if "train/loss" in r]

    cpu = run("ref-cpu", "cpu", "float32")
    cuda = run("gpu-fp32", "cuda", "float32")
    bf16 = run("gpu-bf16", "cuda", "bfloat16")
    print("max relative difference fp32", max(abs(a - b) / a for a, b in zip(cpu, cuda)),
          "bf16", max(abs(a - b) / a for a, b in zip(cpu, bf16)))
    assert cuda == pytest.approx(cpu, rel=1e-4)
    assert bf16 == pytest.approx(cpu, rel=2e-2)


def _layer(seed=0, out=256, inp=512, tokens=2048):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(out, inp, generator=g) * 0.02
    X = torch.randn(tokens, inp, generator=g) * (0.2 + 2 * torch.rand(inp, generator=g))  # uneven channels
    return W, X


@pytest.mark.parametrize("method", ["rtn", "gptq", "awq"])
def test_quantizer_codes_on_cuda_match_cpu(method, no_tf32):
    """Integer codes of one layer quantized on CUDA and on the CPU (4 bit, group 128).

    RTN is elementwise (min/max, one IEEE division by a maxq tensor on the device, round-half-even): codes and
    scales must be identical. (The first H100 run, 2026-11-24, found 69 % of the scales one ulp apart: the
    division was by a Python int, which CUDA turns into a multiplication by the reciprocal; find_params now
    divides by a device tensor, as the reference does.)
    GPTQ propagates each column's error through a Cholesky factor of H^-1 computed with other kernels: a code may
    flip (by one level) where a value sits within rounding noise of a grid midpoint. Measured on the H100: 0 of
    the codes differ. Bound: at most 0.5 % of codes differ, each by one level; the layer losses agree within 1 %.
    AWQ chooses a scale exponent and, per (row, group), a clipping bound from loss comparisons evaluated with
    cuBLAS against MKL, and ``x_mean ** alpha`` is not correctly rounded on either device: where two choices
    score within rounding of each other a whole group's codes move together. Measured on the H100: 6.5 % of
    the codes differ. What the measurement depends on must agree: the same exponent, and the layer loss (the
    calibration objective) within 1 %."""
    from quantdyn.quantize.awq import awq
    from quantdyn.quantize.gptq import gptq, stats_from
    from quantdyn.quantize.rtn import rtn

    W, X = _layer()
    cfg = QuantConfig(method=method, bits=4, group_size=128)
    results = {}
    for dev in ("cpu", "cuda"):
        Wd, Xd = W.to(dev), X.to(dev)
        if method == "rtn":
            r = rtn(Wd, cfg)
        elif method == "gptq":
            r = gptq(Wd, stats_from(Xd), cfg)
        else:
            r = awq(Wd, stats_from(Xd), cfg)
        results[dev] = r
    a, b = results["cpu"].codes.cpu().int(), results["cuda"].codes.cpu().int()
    flips = float((a != b).float().mean())
    print(f"{method}: fraction of codes that differ CUDA vs CPU = {flips:.2e}")
    if method == "rtn":
        assert flips == 0.0
        torch.testing.assert_close(results["cuda"].scales.cpu(), results["cpu"].scales, rtol=0, atol=0)
        return
    if method == "gptq":
        assert flips <= 5e-3 and int((a - b).abs().max()) <= 1
    else:
        assert results["cuda"].diagnostics["awq_alpha"] == results["cpu"].diagnostics["awq_alpha"]
    assert results["cuda"].loss == pytest.approx(results["cpu"].loss, rel=1e-2)


def test_flash_sdpa_runs_quantdyn_attention():
    """quantdyn's GPT attention runs under the flash kernel alone (bf16, head_dim 64, causal): if
    the call could not use flash attention, sdpa_kernel([FLASH_ATTENTION]) would raise 'No available
    kernel'. The flash output equals the math kernel's within bf16 rounding (atol 2e-2 on logits)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cfg = ModelConfig(n_layer=2, d_model=768, n_head=12, vocab_size=512, max_seq_len=2048)  # Pythia head_dim 64
    torch.manual_seed(0)
    model = GPT(cfg).to("cuda", torch.bfloat16)
    x = torch.randint(0, 512, (2, 1024), device="cuda")
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        flash = model(x)
        flash.float().logsumexp(-1).mean().backward()  # the backward must run on flash too
    with torch.no_grad(), sdpa_kernel([SDPBackend.MATH]):
        math = model(x)
    torch.testing.assert_close(flash.detach().float(), math.float(), rtol=0, atol=2e-2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fsdp2_bf16_on_gpus_trains_and_saves_a_transformers_checkpoint(tmp_path):
    """torchrun with one process per GPU (at most 2), dist.strategy=fsdp2, bf16 compute with fp32
    reductions: it trains (loss falls), and the gathered checkpoint loads in transformers."""
    import yaml

    from quantdyn.config import to_dict
    from quantdyn.data.prepare import DataConfig
    from quantdyn.train.checkpoint import read_metrics

    n = min(2, torch.cuda.device_count())
    data = DataConfig(source="builtin:kjv", tokenizer="bpe:512", max_tokens=200_000, bpe_train_chars=300_000,
                      cache_dir=str(tmp_path / "cache"))
    d = {"name": "f", "out_dir": str(tmp_path), "data": to_dict(data), "dist": {"strategy": "fsdp2"},
         "model": {"n_layer": 2, "d_model": 128, "n_head": 2, "max_seq_len": 128},
         "train": {"steps": 30, "batch_size": 8, "seq_len": 128, "eval_every": 0, "eval_windows": 8,
                   "checkpoint_every": 30, "log_every": 5, "device": "cuda"}}
    p = tmp_path / "f.yaml"
    p.write_text(yaml.safe_dump(d))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n), "--master_port",
                        str(_free_port()), "-m", "quantdyn.cli", "train", str(p), "--quiet"],
                       capture_output=True, text=True, env=dict(os.environ), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [x["train/loss"] for x in read_metrics(tmp_path / "f") if "train/loss" in x]
    assert losses[-1] < losses[0] - 0.5
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "f" / "checkpoints" / "step-0000030")
    assert next(hf.parameters()).dtype == torch.float32  # fp32 master weights are what is saved
