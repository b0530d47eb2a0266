"""Tokens/s and peak memory of a training step of a Hugging Face LLaMA-architecture model in quantdyn's trainer
(``model: {hf: DIR}``) against a plain PyTorch loop over the same transformers model and batches (issue 36).

    .venv/bin/python bench/hf_train_step.py [--batch 1] [--seq 128] [--steps 4] [--rounds 3] [--quick]
                                            [--device auto|cpu|cuda] [--dtype float32|bfloat16]

The model has SmolLM-135M's shape (hidden 576, 30 layers, 9 heads / 3 KV heads, MLP 1536, vocabulary 49152,
tied embeddings; 134.5 M parameters) with random weights, written once as an HF directory with a 4096-token BPE
tokenizer of KJV (the token ids only need to fit the vocabulary). Both sides run the same
``LlamaForCausalLM`` from that directory, the same global batches (``data/batches.py`` from (seed, step)),
AdamW (0.9, 0.95, weight decay 0.1; decay on every parameter in the plain loop — quantdyn's groups leave
norms without it, the same arithmetic), gradient clipping at 1.0, the loss as F.cross_entropy over float32
logits. Both sides are timed per optimizer step, from the end of one step to the end of the next (quantdyn: a
step hook, called after the step's logging), in wall-clock and in process CPU time, after ``--warmup`` steps.
The two alternate ``--rounds`` times; the figure is each side's fastest step over all rounds (the machine is
shared: the fastest step is the least disturbed one) and its tokens/s; the medians are kept beside it.
Goal: ratio >= 0.95.

Peak memory of one step: CPU — the process's peak resident set (VmHWM, reset through /proc/self/clear_refs just
before the step) during one optimizer step after the first (weights, gradients and AdamW's two moments exist);
CUDA — torch.cuda.max_memory_allocated over the step. Measured for both sides, each in a fresh process.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SMOLLM_135M = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                   intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=2048,
                   rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=0, eos_token_id=0)
DATA = {"source": "builtin:kjv", "max_tokens": 400_000, "bpe_train_chars": 400_000}


def make_model(root: Path, layers: int) -> Path:
    """SmolLM-135M's shape (``layers`` decoder layers; 30 is the model's), random weights (seed 0), with a
    4096-token BPE tokenizer, as an HF directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from quantdyn.data.prepare import DataConfig, prepare_data

    out = root / f"smollm-135m-shape-{layers}l"
    if (out / "model.safetensors").is_file():
        return out
    tok = prepare_data(DataConfig(tokenizer="bpe:4096", **DATA), progress=False).tokenizer
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**SMOLLM_135M, "num_hidden_layers": layers})).save_pretrained(out)
    tok.save_pretrained(out)
    return out


class Memory:
    """Peak memory of the step between :meth:`reset` and :meth:`read` (bytes)."""

    def __init__(self, device: torch.device):
        self.device = device

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            Path("/proc/self/clear_refs").write_text("5")

    def read(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated(self.device)
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmHWM in /proc/self/status")


class StepClock:
    """A trainer step hook that notes the wall and CPU time at the end of every step (1-based)."""

    def __init__(self):
        self.wall, self.cpu = {}, {}

    def due(self, step):
        return True

    def step(self, model, step, lr=None, tokens=None):
        self.wall[step], self.cpu[step] = time.perf_counter(), time.process_time()
        return {}


def step_times(clock: dict, first: int, last: int) -> list[float]:
    """Seconds of each step ``first``..``last`` (1-based) from the clock at the end of every step."""
    return [clock[s] - clock[s - 1] for s in range(first, last + 1)]


class StepMemory:
    """A trainer step hook: resets the peak after step 1, reads it after step 2 (one whole step between)."""

    def __init__(self, memory: Memory):
        self.memory, self.peak = memory, None

    def due(self, step):
        return step in (1, 2)

    def step(self, model, step, lr=None, tokens=None):
        if step == 1:
            self.memory.reset()
        else:
            self.peak = self.memory.read()
        return {}


def run_config(model_dir: Path, out: Path, name: str, a, steps: int):
    from quantdyn.config import from_dict
    from quantdyn.train.config import RunConfig

    return from_dict(RunConfig, {
        "name": name, "out_dir": str(out), "model": {"hf": str(model_dir)}, "data": DATA,
        "optim": {"name": "adamw", "lr": 3e-4}, "schedule": {"name": "constant", "warmup": 0},
        "optimizer_start": {"mode": "fresh"},
        "train": {"steps": steps, "batch_size": a.batch, "seq_len": a.seq, "eval_every": 0, "eval_windows": 1,
                  "checkpoint_every": 0, "log_every": 1, "device": a.device, "dtype": a.dtype}})


def quantdyn_steps(model_dir: Path, a) -> tuple[list[float], list[float]]:
    """(wall, CPU) seconds of quantdyn's timed steps (one run; the step-0 and final checkpoints are outside)."""
    from quantdyn.train.trainer import train

    clock = StepClock()
    with tempfile.TemporaryDirectory() as tmp:
        train(run_config(model_dir, Path(tmp), "q", a, a.warmup + a.steps), progress=False, hooks=[clock])
    first, last = a.warmup + 1, a.warmup + a.steps
    return step_times(clock.wall, first, last), step_times(clock.cpu, first, last)


def plain_loop(model_dir: Path, a, memory: Memory | None = None) -> tuple[list[float], list[float], int | None]:
    """The same model and batches in a plain loop: (wall, CPU) seconds of the timed steps, peak bytes of step 2."""
    from transformers import AutoModelForCausalLM

    from quantdyn.data.batches import batch_starts, get_batch
    from quantdyn.data.prepare import DataConfig, prepare_data

    device = torch.device(a.device)
    data = prepare_data(DataConfig(tokenizer=str(model_dir), **DATA), progress=False)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).train()
    model.config.use_cache = False
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    amp = torch.autocast(device.type, dtype=torch.bfloat16) if a.dtype == "bfloat16" else torch.autocast(
        device.type, enabled=False)
    peak, wall, cpu = None, {0: time.perf_counter()}, {0: time.process_time()}
    for s in range(a.warmup + a.steps):
        if s == 1 and memory is not None:
            memory.reset()
        x, y = get_batch(data.train, batch_starts(len(data.train), a.seq, 0, s, a.batch), a.seq)
        x, y = x.to(device), y.to(device)
        with amp:
            logits = model(input_ids=x, use_cache=False).logits
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if not math.isfinite(float(loss.detach())):  # the loss on the host every step, as quantdyn logs it
            raise RuntimeError("the plain loop diverged")
        wall[s + 1], cpu[s + 1] = time.perf_counter(), time.process_time()
        if s == 1 and memory is not None:
            peak = memory.read()
    first, last = a.warmup + 1, a.warmup + a.steps
    return step_times(wall, first, last), step_times(cpu, first, last), peak


def n_parameters(model_dir: Path) -> int:
    """Parameters stored in the checkpoint (the tied output head is the embedding: stored once)."""
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def memory_child(side: str, model_dir: Path, a) -> None:
    """In a fresh process: the peak of one step of ``side`` (printed as JSON)."""
    from quantdyn.train.trainer import train

    memory = Memory(torch.device(a.device))
    if side == "plain":
        a.steps, a.warmup = 2, 0
        peak = plain_loop(model_dir, a, memory)[2]
    else:
        hook = StepMemory(memory)
        with tempfile.TemporaryDirectory() as tmp:
            train(run_config(model_dir, Path(tmp), "m", a, 3), progress=False, hooks=[hook])
        peak = hook.peak
    print(json.dumps({"peak_bytes": peak}))


def step_memory(side: str, model_dir: Path, a) -> int:
    args = [sys.executable, __file__, "--memory-child", side, "--model-dir", str(model_dir), "--batch", str(a.batch),
            "--seq", str(a.seq), "--device", a.device, "--dtype", a.dtype, "--threads", str(torch.get_num_threads())]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    return int(json.loads(out.strip().splitlines()[-1])["peak_bytes"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per round")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds; each side's best counts")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--cache", default=".cache/quantdyn/bench", help="where the model directory is written once")
    ap.add_argument("--layers", type=int, default=30, help="decoder layers (30: SmolLM-135M; fewer for a smoke run)")
    ap.add_argument("--quick", action="store_true", help="2 timed steps, 2 rounds")
    ap.add_argument("--memory-child", default="", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    a.device = a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if a.memory_child:
        memory_child(a.memory_child, Path(a.model_dir), a)
        return
    if a.quick:
        a.steps, a.rounds, a.warmup = 2, 2, 1
    if a.warmup < 1:
        raise SystemExit("--warmup must be >= 1 (a step's time runs from the end of the step before)")
    model_dir = make_model(Path(a.cache), a.layers)
    times = {"quantdyn": ([], []), "plain": ([], [])}
    loads = [os.getloadavg()[0]]
    for r in range(a.rounds):
        for side, fn in (("quantdyn", quantdyn_steps), ("plain", lambda m, x: plain_loop(m, x)[:2])):
            wall, cpu = fn(model_dir, a)
            times[side][0].extend(wall)
            times[side][1].extend(cpu)
        loads.append(os.getloadavg()[0])
        print(f"round {r + 1}: fastest step quantdyn {min(times['quantdyn'][0]):.2f} s, plain "
              f"{min(times['plain'][0]):.2f} s (load {loads[-1]:.1f})", flush=True)
    mem = {side: step_memory(side, model_dir, a) for side in ("quantdyn", "plain")}
    tokens = a.batch * a.seq
    best = {side: {"wall": min(w), "cpu": min(c), "median_wall": statistics.median(w),
                   "median_cpu": statistics.median(c)} for side, (w, c) in times.items()}
    n_params = n_parameters(model_dir)
    print(f"SmolLM-135M shape, {a.layers} layers ({n_params / 1e6:.1f} M params), batch {a.batch} x seq {a.seq}, {a.dtype}, {a.device}, "
          f"{torch.get_num_threads()} threads, load {min(loads):.1f}-{max(loads):.1f}")
    for side in ("quantdyn", "plain"):
        b = best[side]
        print(f"{side:9}: fastest step {tokens / b['wall']:8.1f} tokens/s wall, {tokens / b['cpu']:8.1f} tokens/CPU-s "
              f"(medians {tokens / b['median_wall']:.1f}, {tokens / b['median_cpu']:.1f}; {len(times[side][0])} steps)")
    ratio, ratio_cpu = best["plain"]["wall"] / best["quantdyn"]["wall"], best["plain"]["cpu"] / best["quantdyn"]["cpu"]
    print(f"ratio quantdyn / plain: {ratio:.3f} wall, {ratio_cpu:.3f} CPU time  (goal >= 0.95)")
    print(f"peak memory of one step: quantdyn {mem['quantdyn'] / 2**30:.2f} GiB, plain {mem['plain'] / 2**30:.2f} GiB "
          f"({'VmHWM' if a.device == 'cpu' else 'max_memory_allocated'})")
    figures = {"model": "SmolLM-135M shape (LlamaForCausalLM, random weights)", "layers": a.layers, "params": n_params,
               "batch": a.batch, "seq": a.seq, "dtype": a.dtype, "device": a.device,
               "threads": torch.get_num_threads(), "loadavg_1m": loads, "rounds": a.rounds, "steps": a.steps,
               "step_seconds": {k: {"wall": w, "cpu": c} for k, (w, c) in times.items()}, "best": best,
               "ratio_wall": ratio, "ratio_cpu": ratio_cpu, "peak_step_bytes": mem}
    try:
        from common import record
    except ImportError:  # run from elsewhere than bench/
        return
    record("hf_train_step", figures, a)


if __name__ == "__main__":
    main()
