"""Cross-check quantdyn's AWQ (and RTN) against llm-compressor's AWQModifier, on CPU.

    .venv-with-llmcompressor/bin/python bench/crosscheck_awq.py [--quick]

llm-compressor pins transformers <= 5.17 and compressed-tensors 0.19, so it is not part of any
quantdyn extra; install it into a separate environment (``pip install llmcompressor torch==2.13.0``
beside quantdyn). Its AWQ pins calibration tensors to page-locked memory (``pin_memory``), which
fails on a machine without an accelerator ("Cannot access accelerator device"); this script
replaces that speed-only step with a no-op, which changes no number.

One tiny Llama (2 layers, width 64, GQA), trained for a few hundred steps on the built-in KJV text,
one calibration set, one set of held-out windows, asymmetric groups of 32. Rows: quantdyn rtn,
awq (clip search on, its default) and awq without clipping; llm-compressor RTN (QuantizationModifier
alone, minmax observer), AWQ with ``duo_scaling=False`` (the llm-awq scale formula quantdyn uses) and
AWQ with its default ``duo_scaling=True``. Reported: Δ CE on the held-out windows; for RTN also the
fraction of identical zero points and of scales equal to 1e-6 relative (the grids should agree).

quantdyn's AWQ deviates from llm-compressor's by design (see BENCHMARKS.md, "Cross-checks"), so the
AWQ rows are compared for size, not equality: the stated tolerance is |Δ CE(quantdyn awq, no clip) -
Δ CE(llm-compressor awq, duo_scaling=False)| <= max(0.5 * Δ CE(llm-compressor RTN) , 0.005) nats, and
both AWQ variants must not be worse than their own RTN by more than that. RTN must agree to 1e-3 nats.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from quantdyn.engine.walk import quantize_model  # noqa: E402


def ce(model, windows: torch.Tensor, batch: int = 16) -> float:
    total, n = 0.0, 0
    with torch.no_grad():
        for x in windows.split(batch):
            logits = model(x).logits.float()
            total += float(F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                           reduction="sum"))
            n += x[:, 1:].numel()
    return total / n


def train_tiny_llama(data, steps: int, seq_len: int, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=data.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq_len,
        bos_token_id=data.eos_id, eos_token_id=data.eos_id, tie_word_embeddings=False))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    tokens = torch.from_numpy(data.train.astype("int64"))
    g = torch.Generator().manual_seed(seed)
    model.train()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = 3e-3 * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / steps))
        starts = torch.randint(0, len(tokens) - seq_len - 1, (16,), generator=g)
        x = torch.stack([tokens[s:s + seq_len + 1] for s in starts.tolist()])
        loss = F.cross_entropy(model(x[:, :-1]).logits.reshape(-1, data.vocab_size), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return model.eval()


def llmcompressor_run(src: Path, tokenizer, calib: torch.Tensor, bits: int, group: int, duo: bool | None):
    """Load src, run llm-compressor oneshot (RTN if duo is None, else AWQ with duo_scaling=duo); the model
    comes back fake-quantized (its forward quantizes the weights)."""
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.pipelines.cache import IntermediatesCache
    from transformers import AutoModelForCausalLM

    IntermediatesCache.pin_memory = lambda self, *a, **k: None  # page-locking needs an accelerator; speed only
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    scheme = {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": bits, "type": "int", "symmetric": False, "strategy": "group", "group_size": group}}}
    recipe = [QuantizationModifier(config_groups=scheme, ignore=["lm_head"])]
    if duo is not None:
        from llmcompressor.modifiers.transform.awq import AWQModifier

        recipe.insert(0, AWQModifier(duo_scaling=duo))
    ds = Dataset.from_dict({"input_ids": calib.tolist(), "attention_mask": [[1] * calib.shape[1]] * len(calib)})
    oneshot(model=model, dataset=ds, recipe=recipe, processor=tokenizer, num_calibration_samples=len(calib),
            max_seq_length=calib.shape[1], pipeline="sequential")
    return model.eval()


def grid_agreement(lc_model, res, bits: int) -> dict:
    mods = dict(lc_model.named_modules())
    zp_same = scale_close = total = 0
    for key in (k for k in res.packed if k.endswith(".codes")):
        name = key[: -len(".codes")]
        m = mods[name]
        zp = m.weight_zero_point.detach().long() + 2 ** (bits - 1)
        zp_same += int((zp == res.packed[f"{name}.zeros"].long()).sum())
        s_lc, s_qd = m.weight_scale.detach().float(), res.packed[f"{name}.scales"]
        scale_close += int(((s_lc - s_qd).abs() <= 1e-6 * s_qd.abs()).sum())
        total += s_qd.numel()
    return {"zero_points_identical": zp_same / total, "scales_equal_1e-6": scale_close / total, "groups": total}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--bits", default="2,3,4", help="comma-separated bit widths")
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--calib", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--eval-windows", type=int, default=128)
    ap.add_argument("--out", default=str(ROOT / ".cache" / "crosscheck"))
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    if a.quick:
        a.steps, a.calib, a.eval_windows, a.bits = 60, 16, 32, "4"
    try:
        import llmcompressor
    except ImportError:  # `make bench` runs every bench script in the main venv
        print("crosscheck_awq: skipped, llmcompressor is not installed here (it needs its own environment)")
        return 0
    import transformers
    from common import crosscheck_setup  # bench/common.py (this directory is on sys.path)

    out, data = crosscheck_setup(a.out)
    t0 = time.perf_counter()
    fp = train_tiny_llama(data, a.steps, a.seq_len)
    train_s = time.perf_counter() - t0
    src = out / "llama-fp"
    fp.save_pretrained(str(src))
    data.tokenizer.save_pretrained(str(src))
    calib = data.calib_windows(a.calib, a.seq_len, seed=0)
    windows = data.eval_windows(a.seq_len, a.eval_windows)
    ce_fp = ce(fp, windows)
    report = dict(machine=f"{platform.processor() or platform.machine()} x{os.cpu_count()}",
                  date=time.strftime("%Y-%m-%d"), torch=torch.__version__, transformers=transformers.__version__,
                  llmcompressor=llmcompressor.__version__, train_steps=a.steps, train_seconds=train_s,
                  model="Llama 2x64 (GQA 4/2 heads), vocab 512", calib=f"{a.calib} x {a.seq_len}",
                  eval=f"{len(windows)} x {a.seq_len}", ce_fp=ce_fp, rows=[])
    ok = True
    for bits in (int(b) for b in a.bits.split(",")):
        got: dict[str, float] = {}
        rtn_res = None
        for label, spec in (("quantdyn rtn", f"rtn{bits}g{a.group_size}"), ("quantdyn awq", f"awq{bits}g{a.group_size}"),
                            ("quantdyn awq, no clip", {"name": f"awq{bits}g{a.group_size}", "awq_clip": False})):
            q = copy.deepcopy(fp)
            t1 = time.perf_counter()
            res = quantize_model(q, calib, spec, progress=False, threads=1)
            got[label] = ce(q, windows) - ce_fp
            report["rows"].append(dict(bits=bits, tool=label, delta_ce=got[label], seconds=time.perf_counter() - t1))
            if label == "quantdyn rtn":
                rtn_res = res
        for label, duo in (("llm-compressor rtn", None), ("llm-compressor awq, duo_scaling=False", False),
                           ("llm-compressor awq, duo_scaling=True", True)):
            t1 = time.perf_counter()
            m = llmcompressor_run(src, data.tokenizer, calib, bits, a.group_size, duo)
            got[label] = ce(m, windows) - ce_fp
            row = dict(bits=bits, tool=label, delta_ce=got[label], seconds=time.perf_counter() - t1)
            if label == "llm-compressor rtn":
                row["grid_vs_quantdyn_rtn"] = grid_agreement(m, rtn_res, bits)
            report["rows"].append(row)
        rtn_ok = abs(got["quantdyn rtn"] - got["llm-compressor rtn"]) <= 1e-3
        tol = max(0.5 * abs(got["llm-compressor rtn"]), 0.005)
        awq_ok = abs(got["quantdyn awq, no clip"] - got["llm-compressor awq, duo_scaling=False"]) <= tol
        not_worse = (got["quantdyn awq"] <= got["quantdyn rtn"] + tol
                     and got["llm-compressor awq, duo_scaling=False"] <= got["llm-compressor rtn"] + tol)
        report.setdefault("checks", []).append(dict(bits=bits, rtn_agree_to_1e_3=rtn_ok, awq_within=tol,
                                                    awq_ok=awq_ok, awq_not_worse_than_rtn=not_worse))
        ok &= rtn_ok and awq_ok and not_worse
    (out / "awq.json").write_text(json.dumps(report, indent=2))
    print(f"\nAWQ cross-check ({report['machine']}, {report['date']}; llmcompressor {report['llmcompressor']}, "
          f"transformers {report['transformers']}); CE(fp) = {ce_fp:.4f}")
    for r in report["rows"]:
        extra = f"  {r['grid_vs_quantdyn_rtn']}" if "grid_vs_quantdyn_rtn" in r else ""
        print(f"  {r['bits']} bit  {r['tool']:40s} ΔCE {r['delta_ce']:.4f}  ({r['seconds']:.0f} s){extra}")
    for c in report["checks"]:
        print(f"  {c}")
    print(f"written: {out / 'awq.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
