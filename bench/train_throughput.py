"""Tokens/s of the quantdyn trainer against a minimal plain-PyTorch loop on
the same model shape, batch and optimizer, measured in the same run.

    .venv/bin/python bench/train_throughput.py [--preset tiny-4x128] [--steps 30] [--seq 128] [--batch 16]

Prints both throughputs and their ratio (goal >= 1.0 on CPU). On a GPU it
also prints MFU (6·N·tokens/s over the device's bf16 peak, --peak-tflops).
"""
from __future__ import annotations

import argparse
import tempfile
import time

import torch
import torch.nn.functional as F

from quantdyn.config import from_dict
from quantdyn.models.gpt import GPT, ModelConfig, resolve_model_config
from quantdyn.train.config import RunConfig
from quantdyn.train.trainer import read_metrics, train


def plain_loop(cfg: ModelConfig, steps: int, batch: int, seq: int, device, tokens) -> float:
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    n = len(tokens)
    t0 = None
    for s in range(steps + 3):
        if s == 3:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        ix = torch.randint(0, n - seq - 1, (batch,))
        rows = torch.stack([torch.from_numpy(tokens[i : i + seq + 1].astype("int64")) for i in ix.tolist()]).to(device)
        with amp:
            logits = model(rows[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), rows[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return steps * batch * seq / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny-4x128")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense peak (H100 SXM: 989)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        cfg = from_dict(RunConfig, {
            "name": "bench", "out_dir": tmp, "model": {"preset": a.preset, "max_seq_len": max(a.seq, 256)},
            "data": {"tokenizer": "bpe:4096"},
            "schedule": {"name": "constant", "warmup": 0},
            "train": {"steps": a.steps + 3, "batch_size": a.batch, "seq_len": a.seq, "eval_every": 0,
                      "eval_windows": 1, "checkpoint_every": 0, "log_every": 1, "device": str(device)},
        })
        run = train(cfg, progress=False)
        rows = [r for r in read_metrics(run) if "tokens_per_s" in r][3:-1]  # skip warm-up and the checkpointing step
        ours = sum(r["tokens_per_s"] for r in rows) / len(rows)
        from quantdyn.data.prepare import prepare_data

        data = prepare_data(cfg.data, progress=False)
        mcfg = resolve_model_config(cfg.model, data.vocab_size)
        ref = plain_loop(mcfg, a.steps, a.batch, a.seq, device, data.train)
    n_params = sum(p.numel() for p in GPT(mcfg).parameters())
    print(f"device {device}  threads {torch.get_num_threads()}  model {a.preset} ({n_params / 1e6:.2f} M params)  "
          f"batch {a.batch} x seq {a.seq}")
    print(f"quantdyn trainer : {ours:10.0f} tokens/s")
    print(f"plain PyTorch    : {ref:10.0f} tokens/s")
    print(f"ratio            : {ours / ref:10.3f}  (goal >= 1.0)")
    if device.type == "cuda":
        mfu = 6 * n_params * ours / (a.peak_tflops * 1e12)
        print(f"MFU              : {100 * mfu:9.1f} %  (6·N·tokens/s over {a.peak_tflops} TFLOP/s)")


if __name__ == "__main__":
    main()
