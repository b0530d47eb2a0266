"""Tokens/s of the quantdyn trainer against a minimal nanoGPT-style loop on the same model shape,
batch, precision and optimizer, measured in the same run.

    .venv/bin/python bench/train_throughput.py [--preset tiny-4x128] [--steps 30] [--seq 128] [--batch 16] [--quick]
                                               [--device auto|cpu|cuda] [--large] [--no-compile]

1. The configured shape (default tiny-4x128, fp32) on this machine's device: quantdyn's
   ``train()`` against a plain loop (same GPT module, same AdamW, clipping), ratio goal >= 1.0.
2. On a CUDA device (or with ``--large``) also Pythia-160M at sequence length 2048 in bf16 with
   ``torch.compile`` and fused AdamW (issue #16's target shape), both ways, with MFU on a GPU.
   ``--large --device cpu --gpu-preset tiny-2x64 --gpu-seq 64 ...`` runs that code path on a CPU
   in seconds (bench/gpu_check.py --dry-run), so it cannot rot before a GPU is at hand.

MFU = model FLOPs per second / the GPU's dense bf16 peak.  Model FLOPs per token follow nanoGPT's
``estimate_mfu`` (PaLM appendix B): 6·N + 12·L·d·T, with N the parameters that do matmuls (all but
the input embedding, whose lookup does none), L layers, d width, T sequence length.  The peak comes
from the device name (--peak-tflops overrides it; an unknown GPU gets no MFU rather than a guess).
"""
from __future__ import annotations

import argparse
import tempfile
import time

import torch
import torch.nn.functional as F

from quantdyn.config import from_dict
from quantdyn.models.gpt import GPT, ModelConfig, resolve_model_config
from quantdyn.train.checkpoint import read_metrics
from quantdyn.train.config import RunConfig
from quantdyn.train.trainer import train

# dense bf16 peak TFLOP/s (no sparsity) by device-name substring, from the vendors' data sheets
PEAK_BF16_TFLOPS = {
    "H200": 989.4,
    "H100 PCIe": 756.0,
    "H100": 989.4,  # SXM / HBM3
    "A100": 312.0,
    "L40S": 362.1,
    "A10G": 70.0,
    "RTX 4090": 165.2,
}


def peak_tflops(name: str) -> float | None:
    for key, v in PEAK_BF16_TFLOPS.items():  # the more specific names come first
        if key in name:
            return v
    return None


def flops_per_token(cfg: ModelConfig, seq: int) -> float:
    model = GPT(cfg)
    n = model.num_params(non_embedding=True)  # embed_in is a lookup: no FLOPs
    return 6 * n + 12 * cfg.n_layer * cfg.d_model * seq


def plain_loop(cfg: ModelConfig, steps: int, batch: int, seq: int, device, tokens, *, bf16: bool = False,
               compile: bool = False, fused: bool = False, warmup: int = 3) -> float:
    """nanoGPT's train.py reduced to its loop: random windows from the token memmap, pinned and copied
    asynchronously, autocast, clip 1.0, AdamW; tokens/s over ``steps`` after ``warmup`` steps."""
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1,
                            **({"fused": True} if fused else {}))
    step_model = torch.compile(model) if compile else model
    amp = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else torch.autocast(device.type, enabled=False)
    n = len(tokens)
    t0 = None
    for s in range(steps + warmup):
        if s == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        ix = torch.randint(0, n - seq - 1, (batch,))
        rows = torch.stack([torch.from_numpy(tokens[i : i + seq + 1].astype("int64")) for i in ix.tolist()])
        if device.type == "cuda":
            rows = rows.pin_memory()
        rows = rows.to(device, non_blocking=True)
        with amp:
            logits = step_model(rows[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), rows[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return steps * batch * seq / (time.perf_counter() - t0)


def quantdyn_loop(tmp: str, name: str, model: dict, data: dict, steps: int, batch: int, seq: int, device,
                  *, compile: bool = False, dtype: str = "float32", optim_extra: dict | None = None,
                  warmup: int = 3, log_every: int = 1):
    """quantdyn's ``train()`` on the same shape: tokens/s over the ``steps`` after ``warmup`` steps, from
    the logged rates (the trainer reads the loss on the host only at logged steps, as nanoGPT does)."""
    if warmup % log_every or steps % log_every:
        raise ValueError("warmup and steps must be multiples of log_every")
    cfg = from_dict(RunConfig, {
        "name": name, "out_dir": tmp, "model": model, "data": data,
        "optim": {"name": "adamw", "extra": optim_extra or {}},
        "schedule": {"name": "constant", "warmup": 0},
        "train": {"steps": steps + warmup + 1, "batch_size": batch, "seq_len": seq, "eval_every": 0,
                  "eval_windows": 1, "checkpoint_every": 0, "log_every": log_every, "device": str(device),
                  "compile": compile, "dtype": dtype},
    })
    run = train(cfg, progress=False)
    rates = [r["train/tokens_per_s"] for r in read_metrics(run)
             if "train/tokens_per_s" in r and warmup < r["step"] <= warmup + steps]
    return len(rates) / sum(1.0 / x for x in rates), cfg  # equal tokens per row: the harmonic mean is the total rate


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny-4x128")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--peak-tflops", type=float, default=0.0, help="bf16 dense peak (default: from the GPU's name)")
    ap.add_argument("--gpu-steps", type=int, default=0,
                    help="timed steps of the Pythia-160M comparison (default 50; 20 with --quick)")
    ap.add_argument("--gpu-batch", type=int, default=16, help="sequences per step of the CUDA comparison")
    ap.add_argument("--gpu-preset", default="pythia-160m", help="model of the CUDA comparison")
    ap.add_argument("--gpu-seq", type=int, default=2048, help="sequence length of the CUDA comparison")
    ap.add_argument("--gpu-max-tokens", type=int, default=0,
                    help="train-split token budget of the large comparison's data (0 = all of KJV)")
    ap.add_argument("--large", action="store_true", help="run the bf16/compile/fused comparison on a CPU too")
    ap.add_argument("--no-compile", action="store_true", help="the large comparison without torch.compile")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                    help="auto: cuda when a GPU is visible, else cpu")
    ap.add_argument("--quick", action="store_true", help="fewer steps and a smaller token budget")
    a = ap.parse_args()
    if a.quick:
        a.steps, a.batch = 10, 8
    a.gpu_steps = a.gpu_steps or (20 if a.quick else 50)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU is visible here (torch.cuda.is_available() is False)")
    device = torch.device(a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    data = {"tokenizer": "bpe:4096", **({"max_tokens": 300_000, "bpe_train_chars": 2_000_000} if a.quick else {})}
    figures: dict = {"device": str(device), "threads": torch.get_num_threads()}
    with tempfile.TemporaryDirectory() as tmp:
        ours, cfg = quantdyn_loop(tmp, "bench", {"preset": a.preset, "max_seq_len": max(a.seq, 256)}, data, a.steps,
                                  a.batch, a.seq, device)
        from quantdyn.data.prepare import prepare_data

        td = prepare_data(cfg.data, progress=False)
        mcfg = resolve_model_config(cfg.model, td.vocab_size)
        ref = plain_loop(mcfg, a.steps, a.batch, a.seq, device, td.train)
    n_params = sum(p.numel() for p in GPT(mcfg).parameters())
    print(f"device {device}  threads {torch.get_num_threads()}  model {a.preset} ({n_params / 1e6:.2f} M params)  "
          f"batch {a.batch} x seq {a.seq}  fp32")
    print(f"quantdyn trainer : {ours:10.0f} tokens/s")
    print(f"plain PyTorch    : {ref:10.0f} tokens/s")
    print(f"ratio            : {ours / ref:10.3f}  (goal >= 1.0)")
    figures["small"] = {"preset": a.preset, "params_m": round(n_params / 1e6, 3), "batch": a.batch, "seq": a.seq,
                        "dtype": "float32", "quantdyn_tokens_per_s": ours, "plain_tokens_per_s": ref,
                        "ratio": ours / ref}
    if device.type == "cuda" or a.large:
        figures["pythia160m"] = gpu_suite(a, device)
    try:
        from common import record
    except ImportError:  # run from elsewhere than bench/
        return
    record("train_throughput", figures, a)


def gpu_suite(a, device) -> dict:
    """Pythia-160M (--gpu-preset), sequence 2048 (--gpu-seq), bf16 autocast, torch.compile (unless
    --no-compile), fused AdamW: quantdyn vs the plain loop."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({device})"
    peak = a.peak_tflops or (peak_tflops(name) if device.type == "cuda" else None)
    compile = not a.no_compile
    seq, batch, steps = a.gpu_seq, a.gpu_batch, max(10, a.gpu_steps // 10 * 10)
    model = {"preset": a.gpu_preset, "max_seq_len": seq}
    data = {"tokenizer": "gpt2",  # 50257 tokens -> Pythia's padded vocabulary of 50304
            **({"max_tokens": a.gpu_max_tokens} if a.gpu_max_tokens else {})}
    with tempfile.TemporaryDirectory() as tmp:
        ours, cfg = quantdyn_loop(tmp, "p160", model, data, steps, batch, seq, device, compile=compile,
                                  dtype="bfloat16", optim_extra={"fused": True}, warmup=10, log_every=10)
        from quantdyn.data.prepare import prepare_data

        td = prepare_data(cfg.data, progress=False)
        mcfg = resolve_model_config(cfg.model, td.vocab_size)
        ref = plain_loop(mcfg, steps, batch, seq, device, td.train, bf16=True, compile=compile, fused=True,
                         warmup=10)
    fpt = flops_per_token(mcfg, seq)
    out = {"gpu": name, "preset": a.gpu_preset, "batch": batch, "steps": steps, "seq": seq, "dtype": "bfloat16",
           "compile": compile, "fused_adamw": True,
           "flops_per_token": fpt, "peak_tflops": peak, "quantdyn_tokens_per_s": ours, "plain_tokens_per_s": ref,
           "ratio": ours / ref,
           "quantdyn_mfu": fpt * ours / (peak * 1e12) if peak else None,
           "plain_mfu": fpt * ref / (peak * 1e12) if peak else None}
    print(f"\n{name}: {a.gpu_preset}, batch {batch} x seq {seq}, bf16, {'compile' if compile else 'eager'}, fused AdamW")
    print(f"quantdyn trainer : {ours:10.0f} tokens/s" + (f"  MFU {100 * out['quantdyn_mfu']:.1f} %" if peak else ""))
    print(f"plain loop       : {ref:10.0f} tokens/s" + (f"  MFU {100 * out['plain_mfu']:.1f} %" if peak else ""))
    print(f"ratio            : {ours / ref:10.3f}  (goal >= 1.0; MFU goal >= 50 % on an H100)")
    if not peak and device.type == "cuda":
        print(f"no bf16 peak known for '{name}': pass --peak-tflops for MFU")
    return out


if __name__ == "__main__":
    main()
