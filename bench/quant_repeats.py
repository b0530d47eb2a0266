"""Run-to-run spread of Δ CE when the same checkpoint is quantized again (issue: uncertainty must include the
quantization run itself), against the evaluation SE the rows carried before.

    .venv/bin/python bench/quant_repeats.py [--quick] [--repeats 5] [--workdir DIR]

Two models, both trained here on builtin:kjv so the bench needs no network:
* the demo's model: quantdyn's 4x128 GPT-NeoX with the demo's recipe (BPE 4096, 600 steps of AdamW 3e-3, WSD);
* a small LLaMA-family model (transformers' LlamaForCausalLM, 4 layers, width 128, GQA 4/2, SwiGLU, RMSNorm,
  RoPE; same tokenizer and data), trained with a plain AdamW loop.
Each is quantized R times per quantizer (RTN 3-bit, GPTQ 3-bit, GPTQ 4-bit, AWQ 4-bit; group 128) with the
calibration draw varied (``draw``: windows drawn with seed + r) and, separately, only the calibration order
varied (``order``), through the streamed engine in one pass per setting. RTN does not use the calibration
in its weights: its spread must be exactly 0 (the check on the mechanism).
Prints a table (and writes bench/results/quant_repeats-<machine>-<date>.json): mean Δ CE, evaluation SE,
SD over repeats, combined SE, which dominates.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import record, write_results

QUANTIZERS = ["rtn3", "gptq3", "gptq4", "awq4"]


def train_gpt(work: Path, steps: int) -> tuple[Path, object]:
    from quantdyn.config import from_dict
    from quantdyn.runs import list_checkpoints
    from quantdyn.train.config import RunConfig
    from quantdyn.train.trainer import train

    cfg = from_dict(RunConfig, {
        "name": "repeats-gpt", "out_dir": str(work), "seed": 0,
        "model": {"n_layer": 4, "d_model": 128, "n_head": 4, "max_seq_len": 256},
        "data": {"source": "builtin:kjv", "tokenizer": "bpe:4096"},
        "optim": {"name": "adamw", "lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.1},
        "schedule": {"name": "wsd", "warmup": 30, "decay": 0.2},
        "train": {"steps": steps, "batch_size": 16, "seq_len": 128, "eval_every": 0, "checkpoint_every": steps,
                  "log_every": 50}})
    run = Path(work) / "repeats-gpt"
    if not list_checkpoints(run):
        train(cfg, progress=False)
    return list_checkpoints(run)[-1].path, cfg.data


def train_llama(work: Path, data_cfg, steps: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from quantdyn.data.prepare import prepare_data

    out = Path(work) / "tiny-llama"
    if (out / "config.json").is_file():
        return out
    data = prepare_data(data_cfg, progress=False)
    torch.manual_seed(0)
    vocab = -(-data.vocab_size // 64) * 64
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                         tie_word_embeddings=False))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    toks = torch.from_numpy(data.train.astype("int64"))
    g = torch.Generator().manual_seed(0)
    model.train()
    for step in range(steps):
        lr = 3e-3 * min(1.0, (step + 1) / 30) * (1.0 if step < 0.8 * steps else (steps - step) / (0.2 * steps))
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(toks) - 129, (16,), generator=g)
        x = torch.stack([toks[s : s + 129] for s in starts])
        logits = model(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    model.eval().save_pretrained(out)
    data.tokenizer.save_pretrained(str(out))
    return out


def spread(ck: Path, data_cfg, repeats: int, vary: str, windows: int) -> dict:
    from quantdyn.data.prepare import prepare_data
    from quantdyn.engine.measure import MeasureConfig, measure
    from quantdyn.engine.rows import calibration_draws, ptq_fields, repeat_labels
    from quantdyn.quantize.catalogue import parse_quantizer

    data = prepare_data(data_cfg, progress=False)
    draws = calibration_draws(data, 32, 128, 0, repeats, vary)
    variants, calib = {}, {}
    for q in QUANTIZERS:
        for r, label in enumerate(repeat_labels(q, repeats)):
            variants[label], calib[label] = parse_quantizer(q), draws[r]
    cfg = MeasureConfig()
    t0 = time.perf_counter()
    m = measure(ck, variants, data.eval_windows(128, windows), calib, cfg=cfg)
    out = {"seconds": time.perf_counter() - t0}
    for q in QUANTIZERS:
        f = ptq_fields(q, parse_quantizer(q), m, cfg, 1, repeats, vary)
        out[q] = {k: f[k] for k in ("delta_ce", "delta_ce_se", "delta_ce_run_sd", "delta_ce_total_se",
                                     "uncertainty_dominant", "delta_ce_repeats", "ce_fp")}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="short training, 3 repeats, 50 windows")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--windows", type=int, default=200)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--workdir", default="")
    a = ap.parse_args()
    if a.quick:
        a.repeats, a.windows, a.steps = 3, 50, 150
    work = Path(a.workdir or tempfile.mkdtemp(prefix="qd-repeats-"))
    gpt, data_cfg = train_gpt(work, a.steps)
    llama = train_llama(work, data_cfg, a.steps)
    res = {"repeats": a.repeats, "windows": a.windows, "steps": a.steps, "models": {}}
    print(f"{'model':<12}{'vary':<7}{'quantizer':<10}{'mean dCE':>10}{'eval SE':>10}{'run SD':>10}{'total SE':>10}"
          f"{'SD/SE':>7}  dominant")
    for name, ck in (("demo-gpt", gpt), ("tiny-llama", llama)):
        for vary in ("draw", "order"):
            r = spread(ck, data_cfg, a.repeats, vary, a.windows)
            res["models"].setdefault(name, {})[vary] = r
            for q in QUANTIZERS:
                x = r[q]
                print(f"{name:<12}{vary:<7}{q:<10}{x['delta_ce']:>10.4f}{x['delta_ce_se']:>10.4f}"
                      f"{x['delta_ce_run_sd']:>10.4f}{x['delta_ce_total_se']:>10.4f}"
                      f"{x['delta_ce_run_sd'] / x['delta_ce_se']:>7.2f}  {x['uncertainty_dominant']}", flush=True)
    record("quant_repeats", res, a)
    print(f"wrote {write_results('quant_repeats', res)}")


if __name__ == "__main__":
    main()
