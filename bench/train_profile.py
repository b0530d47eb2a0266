"""Where one training step's time goes, and what changes it: torch.profiler's per-kernel CUDA time of a
pythia-160m step (seq 2048, bf16 autocast, torch.compile, fused AdamW), grouped, and tokens/s + MFU of a few
variants of the same step measured in the same run (issue 31: MFU 32.6 % on an H100 against a goal of 50 %).

    python bench/train_profile.py [--device cuda] [--variants base,loss_compiled,batch32,...] [--steps 20]
    python bench/train_profile.py --device cpu --dry-run          # tiny shapes, no compile: the code path only

Variants (each a fresh model, compiled anew, ``--warmup`` steps then ``--steps`` timed; tokens are random ids
drawn on the device, so data loading is not in the figure — bench/train_throughput.py measures the trainer with
its data):
  base           what quantdyn's trainer does: ``torch.compile(model)``, then the loss outside the compiled graph
                 (``F.cross_entropy(logits.float(), y)`` in eager mode: the fp32 logits are written, read, and their
                 gradient written again)
  loss_compiled  the loss inside the compiled function (as nanoGPT does: its model returns the loss), so
                 inductor can fuse the fp32 cast, log-softmax and NLL and their backward
  batch32        base at batch 32 (twice the tokens per step)
  loss_compiled_batch32
  autotune       base compiled with mode="max-autotune-no-cudagraphs" (minutes of autotuning: not in the default)

MFU as bench/train_throughput.py (nanoGPT's estimate_mfu: 6·N + 12·L·d·T FLOPs per token over the dense bf16 peak).
The profile (of ``--profile-variant``, 3 steps after warm-up) groups kernels by name: GEMM (cuBLAS/CUTLASS),
attention (flash/cuDNN SDPA), inductor's fused kernels split by what they fuse (cross-entropy, layer norm, GELU,
rotary, other), the optimizer, copies, other; and gives the GPU's busy time against the step's wall time (the
rest is the GPU waiting for the host). Writes bench/results/train_profile-<machine>-<date>.json (and a copy into
$OUT when that is set) and prints a table.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from train_throughput import flops_per_token, peak_tflops  # noqa: E402

from quantdyn.models.gpt import GPT, ModelConfig, resolve_model_config  # noqa: E402

VARIANTS = {
    "base": {"loss_compiled": False, "batch_factor": 1, "mode": None},
    "loss_compiled": {"loss_compiled": True, "batch_factor": 1, "mode": None},
    "batch32": {"loss_compiled": False, "batch_factor": 2, "mode": None},
    "loss_compiled_batch32": {"loss_compiled": True, "batch_factor": 2, "mode": None},
    "autotune": {"loss_compiled": False, "batch_factor": 1, "mode": "max-autotune-no-cudagraphs"},
}
DEFAULT_VARIANTS = "base,loss_compiled,batch32,loss_compiled_batch32"

# kernel name -> group; the first pattern that matches wins (inductor names its kernels after the aten ops fused)
GROUPS = [
    ("attention", re.compile(r"flash|fmha|attention|sdpa|cudnn", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach|_amp_", re.I)),
    ("cross-entropy", re.compile(r"log_softmax|nll_loss|cross_entropy|logsumexp", re.I)),
    ("GEMM", re.compile(r"gemm|cutlass|nvjet|xmma|cublas|sm90_|sm80_|ampere_|hopper", re.I)),
    ("layer norm", re.compile(r"layer_norm|native_layer_norm|var_mean", re.I)),
    ("GELU", re.compile(r"gelu", re.I)),
    ("rotary", re.compile(r"cat|neg|slice|rotary|rope", re.I)),
    ("copy/cast", re.compile(r"memcpy|memset|copy|_to_copy|convert|elementwise_kernel", re.I)),
    ("reduction (norms, clip)", re.compile(r"reduce|norm|sum|red_", re.I)),
]


def group_of(name: str) -> str:
    for g, rx in GROUPS:
        if rx.search(name):
            return g
    return "triton, other" if name.startswith("triton") else "other"


def make_step(model, opt, loss_compiled: bool, mode: str | None, compile: bool, amp):
    """One optimizer step on (x, y) as a closure; the compiled parts as the variant asks."""
    def loss_of(x, y):
        logits = model(x)
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))

    kw = {"mode": mode} if mode else {}
    if compile and loss_compiled:
        fwd = torch.compile(loss_of, **kw)
    else:
        m = torch.compile(model, **kw) if compile else model

        def fwd(x, y):
            logits = m(x)
            return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))

    def step(x, y):
        with amp:
            loss = fwd(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_variant(name: str, mcfg, device, batch: int, seq: int, steps: int, warmup: int, compile: bool,
                profile_steps: int = 0) -> dict:
    v = VARIANTS[name]
    b = batch * v["batch_factor"]
    torch.manual_seed(0)
    model = GPT(mcfg).to(device)
    fused = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, **fused)
    amp = torch.autocast(device.type, dtype=torch.bfloat16)
    step = make_step(model, opt, v["loss_compiled"], v["mode"], compile, amp)
    g = torch.Generator(device=device).manual_seed(0)
    data = torch.randint(0, mcfg.vocab_size, (steps + warmup + profile_steps, b, seq + 1), device=device,
                         generator=g)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t_compile = time.perf_counter()
    for s in range(warmup):
        step(data[s, :, :-1], data[s, :, 1:])
    sync(device)
    t0 = time.perf_counter()
    for s in range(warmup, warmup + steps):
        loss = step(data[s, :, :-1], data[s, :, 1:])
    sync(device)
    wall = time.perf_counter() - t0
    out = {"variant": name, "batch": b, "seq": seq, "steps": steps, "warmup_s": t0 - t_compile,
           "step_ms": 1e3 * wall / steps, "tokens_per_s": steps * b * seq / wall, "final_loss": float(loss.detach()),
           "peak_gpu_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None}
    if profile_steps:
        out["profile"] = profile(step, data[warmup + steps:], device, profile_steps)
    del model, opt, step, data
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def profile(step, data, device, n: int) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    t0 = time.perf_counter()
    with tprofile(activities=acts) as prof:
        for s in range(n):
            step(data[s, :, :-1], data[s, :, 1:])
        sync(device)
    wall = time.perf_counter() - t0
    kernels: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for ev in prof.events():
        if device.type == "cuda" and ev.device_type == torch.autograd.DeviceType.CUDA:
            kernels[ev.name] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            counts[ev.name] += 1
        elif device.type != "cuda" and ev.device_type == torch.autograd.DeviceType.CPU and not ev.cpu_children:
            kernels[ev.name] += ev.self_cpu_time_total
            counts[ev.name] += 1
    busy_us = sum(kernels.values())
    groups: dict[str, float] = defaultdict(float)
    for k, us in kernels.items():
        groups[group_of(k)] += us
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:25]
    return {"steps": n, "wall_ms_per_step": 1e3 * wall / n, "busy_ms_per_step": busy_us / 1e3 / n,
            "kernel_launches_per_step": sum(counts.values()) / n,
            "groups_ms_per_step": {k: v / 1e3 / n for k, v in sorted(groups.items(), key=lambda kv: -kv[1])},
            "top_kernels": [{"name": k[:160], "ms_per_step": us / 1e3 / n, "calls_per_step": counts[k] / n,
                             "group": group_of(k)} for k, us in top]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="pythia-160m")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--profile-variant", default="base", help="the variant whose kernels are profiled ('' none)")
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=0, help="start no further variant after this many seconds")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--peak-tflops", type=float, default=0)
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes without compile (any device)")
    ap.add_argument("--results-dir", default="", help="default: bench/results (or $QUANTDYN_BENCH_RESULTS_DIR)")
    a = ap.parse_args(argv)
    names = [v for v in a.variants.split(",") if v]
    bad = [v for v in names if v not in VARIANTS]
    if bad:
        print(f"unknown variant {bad[0]!r}: choose from {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    if a.dry_run:
        a.preset, a.seq, a.batch, a.steps, a.warmup, a.no_compile = "tiny-2x64", 32, 2, 2, 1, True
        a.profile_steps = min(a.profile_steps, 1)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: pass --device cpu (with --dry-run for tiny shapes)", file=sys.stderr)
        return 2
    mcfg = resolve_model_config(ModelConfig(preset=a.preset, max_seq_len=a.seq), 50304)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = a.peak_tflops or (peak_tflops(gpu) if device.type == "cuda" else None)
    fpt = flops_per_token(mcfg, a.seq)
    t_start = time.perf_counter()
    results = []
    from common import _git_sha, results_path, write_results

    doc = {"device": gpu, "git_sha": _git_sha(), "preset": a.preset, "seq": a.seq, "flops_per_token": fpt,
           "peak_tflops": peak, "compile": not a.no_compile, "dry_run": a.dry_run, "variants": results}
    root = Path(a.results_dir) if a.results_dir else None
    path = results_path(root, name="train_profile", suffix="dry" if a.dry_run else "")

    def save() -> None:  # after every variant: a run stopped at its time limit keeps what it measured
        write_results("train_profile", doc, out=path)
        if os.environ.get("OUT"):  # the device tool's folder: what comes back from a GPU machine
            shutil.copy(path, Path(os.environ["OUT"]) / path.name)
    for name in names:
        if a.budget_s and time.perf_counter() - t_start > a.budget_s:
            results.append({"variant": name, "status": "not started (budget)"})
            continue
        r = run_variant(name, mcfg, device, a.batch, a.seq, a.steps, a.warmup, not a.no_compile,
                        profile_steps=a.profile_steps if name == a.profile_variant else 0)
        r["mfu"] = fpt * r["tokens_per_s"] / (peak * 1e12) if peak else None
        results.append(r)
        save()
        mfu = f"  MFU {100 * r['mfu']:.1f} %" if r["mfu"] else ""
        print(f"{name:24s} batch {r['batch']:3d}: {r['tokens_per_s']:10.0f} tokens/s, {r['step_ms']:.1f} ms/step"
              f"{mfu}  (warm-up incl. compile {r['warmup_s']:.0f} s, peak {r['peak_gpu_gib'] or 0:.1f} GiB)",
              flush=True)
        if "profile" in r:
            p = r["profile"]
            print(f"  profile of {name}: wall {p['wall_ms_per_step']:.1f} ms/step, GPU busy "
                  f"{p['busy_ms_per_step']:.1f} ms/step, {p['kernel_launches_per_step']:.0f} kernels/step")
            for gname, ms in p["groups_ms_per_step"].items():
                print(f"    {gname:26s} {ms:8.2f} ms  {100 * ms / max(p['busy_ms_per_step'], 1e-9):5.1f} %")
            for k in p["top_kernels"][:12]:
                print(f"    {k['ms_per_step']:8.2f} ms  x{k['calls_per_step']:5.0f}  [{k['group']}] {k['name'][:90]}")
    save()
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
