"""Cross-check quantdyn's `gptqmodel` presets against GPTQModel itself, on CPU.

    make crosscheck            # builds .cache/venv-crosscheck with the crosscheck extra, runs this
    GPTQMODEL_CPU_WORKERS=2 .cache/venv-crosscheck/bin/python bench/crosscheck_gptqmodel.py [--quick]

One tiny GPT-NeoX model (quantdyn's GPT, trained for a few hundred steps on the built-in KJV
text so that quantization error means something), one calibration set and one set of held-out
windows. For each pair below both tools quantize the same checkpoint with the same calibration
token ids; then

* codes: the fraction of weights whose integer code is identical (and within +-1), per layer
  type -- GPTQModel's codes are read from its saved GPTQ checkpoint with quantdyn's own reader;
* CE: held-out cross-entropy of quantdyn's fake-quantized model, of GPTQModel's checkpoint loaded
  by transformers (GPTQModel's kernels), and of GPTQModel's codes dequantized into quantdyn's
  model (separates the algorithm from the kernel).

Pairs: preset ``gptqmodel`` (GPTQModel v4.2.5 defaults: desc_act, sym, damp 0.05 + auto increment,
true sequential) against GPTQModel 7.6 configured with those values, and preset ``gptqmodel-v5``
(group-aware reordering) against GPTQModel 7.6's own defaults. Tolerances (stated before the run):
|Δ CE(quantdyn) - Δ CE(GPTQModel)| <= max(0.15 * Δ CE(GPTQModel), 0.005) nats and >= 80 % identical
codes overall. The script prints a table and writes JSON to --out; exit status 1 if a tolerance fails.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(max(2, os.cpu_count() or 2)))  # 1 worker fails on 2 cores

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from quantdyn.engine.walk import quantize_model  # noqa: E402
from quantdyn.export import read_export  # noqa: E402
from quantdyn.models.gpt import GPT, ModelConfig, resolve_model_config  # noqa: E402
from quantdyn.models.hf_io import load_gpt, save_hf  # noqa: E402

CE_REL_TOL, CE_ABS_TOL, CODE_MATCH_MIN = 0.15, 0.005, 0.80


def ce(model, windows: torch.Tensor, batch: int = 16) -> float:
    """Mean next-token cross-entropy (nats) of ``model`` on ``windows``, moved to the model's device."""
    total, n = 0.0, 0
    device = getattr(model, "device", None) or next(model.parameters()).device
    with torch.no_grad():
        for x in windows.split(batch):
            x = x.to(device)
            out = model(x)
            logits = (out.logits if hasattr(out, "logits") else out).float()
            total += float(F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                           reduction="sum"))
            n += x[:, 1:].numel()
    return total / n


def train_tiny(data, steps: int, seq_len: int, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    model = GPT(resolve_model_config(ModelConfig(n_layer=2, d_model=64, n_head=4, max_seq_len=seq_len),
                                     data.vocab_size))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    tokens = torch.from_numpy(data.train.astype("int64"))
    g = torch.Generator().manual_seed(seed)
    model.train()
    for step in range(steps):
        lr = 3e-3 * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(tokens) - seq_len - 1, (16,), generator=g)
        x = torch.stack([tokens[s:s + seq_len + 1] for s in starts.tolist()])
        logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return model.eval()


def gptqmodel_quantize(src: Path, dst: Path, calib: torch.Tensor, bits: int, group: int, v5_defaults: bool,
                       device: str = "cpu", dtype: torch.dtype = torch.float32):
    """GPTQModel.load (in ``dtype``, on ``device``) -> quantize on ``calib``'s token ids -> save to ``dst``; returns
    (seconds, the quantize config GPTQModel used)."""
    from gptqmodel import GPTQModel, QuantizeConfig

    kw = dict(bits=bits, group_size=group, sym=True, offload_to_disk=False)
    if not v5_defaults:  # what GPTQModel v4.2.5 used by default (quantdyn preset 'gptqmodel')
        kw.update(desc_act=True, act_group_aware=False, damp_percent=0.05, damp_auto_increment=0.01,
                  true_sequential=True, static_groups=False, mse=0.0)
    known = {f.name for f in dataclasses.fields(QuantizeConfig)}  # older releases lack some fields
    kw = {k: v for k, v in kw.items() if k in known}
    t0 = time.perf_counter()
    try:
        model = GPTQModel.load(str(src), QuantizeConfig(**kw), device=device, dtype=dtype)
    except TypeError:  # GPTQModel < 5 names it torch_dtype
        model = GPTQModel.load(str(src), QuantizeConfig(**kw), device=device, torch_dtype=dtype)
    rows = [{"input_ids": r.tolist(), "attention_mask": [1] * len(r)} for r in calib]
    model.quantize(rows, batch_size=8)
    model.save(str(dst))
    return time.perf_counter() - t0, model.quantize_config


def layer_type(name: str) -> str:
    return name.split(".", 3)[-1]


def compare(res, reader) -> dict:
    per: dict[str, list[int]] = {}
    for name, layer in reader.layers():
        ours = res.packed[f"{name}.codes"].long()
        theirs = layer.codes.long()
        t = per.setdefault(layer_type(name), [0, 0, 0])
        t[0] += int((ours == theirs).sum())
        t[1] += int(((ours - theirs).abs() <= 1).sum())
        t[2] += ours.numel()
    out = {k: {"identical": v[0] / v[2], "within_1": v[1] / v[2], "weights": v[2]} for k, v in per.items()}
    tot = [sum(v[i] for v in per.values()) for i in range(3)]
    out["all"] = {"identical": tot[0] / tot[2], "within_1": tot[1] / tot[2], "weights": tot[2]}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--bits", default="2,3,4", help="comma-separated bit widths")
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--calib", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--eval-windows", type=int, default=128)
    ap.add_argument("--presets", default="gptqmodel,gptqmodel-v5",
                    help="quantdyn presets to compare (gptqmodel-v5 only makes sense against GPTQModel >= 5)")
    ap.add_argument("--out", default=str(ROOT / ".cache" / "crosscheck"))
    ap.add_argument("--quick", action="store_true", help="fewer steps, samples and windows (a smoke run)")
    a = ap.parse_args()
    if a.quick:
        a.steps, a.calib, a.eval_windows = 60, 16, 32
    try:
        import gptqmodel
    except ImportError:  # `make bench` runs every bench script in the main venv, which has no GPTQModel
        print("crosscheck_gptqmodel: skipped, gptqmodel is not installed here; run `make crosscheck`")
        return 0
    import transformers
    from common import crosscheck_setup  # bench/common.py (this directory is on sys.path)
    from transformers import AutoModelForCausalLM

    out, data = crosscheck_setup(a.out)
    t0 = time.perf_counter()
    model = train_tiny(data, a.steps, a.seq_len)
    train_s = time.perf_counter() - t0
    src = out / "fp"
    save_hf(model, src)
    data.tokenizer.save_pretrained(str(src))
    calib = data.calib_windows(a.calib, a.seq_len, seed=0)
    windows = data.eval_windows(a.seq_len, a.eval_windows)
    ce_fp = ce(load_gpt(src), windows)
    report = dict(machine=f"{platform.processor() or platform.machine()} x{os.cpu_count()}", date=time.strftime(
        "%Y-%m-%d"), torch=torch.__version__, transformers=transformers.__version__, gptqmodel=gptqmodel.__version__,
        model="quantdyn GPT 2x64 (GPT-NeoX layout), vocab 512", train_steps=a.steps, train_seconds=train_s,
        calib=f"{a.calib} x {a.seq_len} tokens (KJV calib split)", eval=f"{len(windows)} x {a.seq_len} tokens (val)",
        ce_fp=ce_fp, tolerances=dict(ce_rel=CE_REL_TOL, ce_abs=CE_ABS_TOL, codes_identical_min=CODE_MATCH_MIN),
        pairs=[])
    ok = True
    presets = [p.strip() for p in a.presets.split(",") if p.strip()]
    for bits, preset in ((int(b), p) for b in a.bits.split(",") for p in presets):
        v5 = preset == "gptqmodel-v5"
        spec = f"gptq{bits}g{a.group_size}-{preset}"
        q = load_gpt(src)
        t1 = time.perf_counter()
        res = quantize_model(q, calib, spec, progress=False, threads=1)
        q_s = time.perf_counter() - t1
        ce_q = ce(q, windows)
        dst = out / f"gptqmodel-{bits}bit-{preset}"
        g_s, qc = gptqmodel_quantize(src, dst, calib, bits, a.group_size, v5)
        reader = read_export(dst)
        codes = compare(res, reader)
        try:
            ce_g = ce(AutoModelForCausalLM.from_pretrained(str(dst), dtype=torch.float32).eval(), windows)
        except ImportError as e:  # an old GPTQModel's loader stack may not import beside the current datasets
            print(f"transformers cannot load GPTQModel's checkpoint here ({e}); using its codes in quantdyn's model")
            ce_g = None
        deq = load_gpt(src)  # GPTQModel's codes dequantized into quantdyn's model
        mods = dict(deq.named_modules())
        with torch.no_grad():
            for name, layer in reader.layers():
                mods[name].weight.copy_(layer.weight())
        ce_g_deq = ce(deq, windows)
        ce_g_ref = ce_g if ce_g is not None else ce_g_deq
        d_q, d_g = ce_q - ce_fp, ce_g_ref - ce_fp
        tol = max(CE_REL_TOL * abs(d_g), CE_ABS_TOL)
        pair_ok = abs(d_q - d_g) <= tol and codes["all"]["identical"] >= CODE_MATCH_MIN
        ok &= pair_ok
        report["pairs"].append(dict(
            quantdyn=spec, gptqmodel=dict(desc_act=qc.desc_act, act_group_aware=getattr(qc, "act_group_aware", None),
                                          damp_percent=qc.damp_percent, sym=qc.sym, true_sequential=qc.true_sequential),
            ce_quantdyn=ce_q, ce_gptqmodel=ce_g, ce_gptqmodel_codes_in_quantdyn=ce_g_deq, delta_ce_quantdyn=d_q,
            delta_ce_gptqmodel=d_g, delta_ce_difference=d_q - d_g, tolerance=tol, codes=codes,
            seconds_quantdyn=q_s, seconds_gptqmodel=g_s, within_tolerance=pair_ok))
    (out / "gptqmodel.json").write_text(json.dumps(report, indent=2))
    print(f"\nGPTQModel cross-check ({report['machine']}, {report['date']}; gptqmodel {report['gptqmodel']}, "
          f"torch {report['torch']}); CE(fp) = {ce_fp:.4f}")
    print(f"{'quantdyn preset':28s} {'ΔCE quantdyn':>12s} {'ΔCE GPTQModel':>13s} {'(codes→qd)':>10s} "
          f"{'identical':>9s} {'±1':>6s}  ok")
    for p in report["pairs"]:
        print(f"{p['quantdyn']:28s} {p['delta_ce_quantdyn']:12.4f} {p['delta_ce_gptqmodel']:13.4f}"
              f"{'' if p['ce_gptqmodel'] is not None else '*'} "
              f"{p['ce_gptqmodel_codes_in_quantdyn'] - ce_fp:10.4f} {p['codes']['all']['identical']:9.3f} "
              f"{p['codes']['all']['within_1']:6.3f}  {p['within_tolerance']}")
        for k, v in p["codes"].items():
            if k != "all":
                print(f"    {k:30s} identical {v['identical']:.3f}  within ±1 {v['within_1']:.3f}")
    print(f"written: {out / 'gptqmodel.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
