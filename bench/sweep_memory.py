"""Peak memory and wall time of sweeping one checkpoint, streamed engine vs the in-memory path.

    .venv/bin/python bench/sweep_memory.py [--quick] [--sizes 14m,70m,160m,410m,1b] [--counts 1,3,5,8]
                                           [--llama7b] [--device cpu|cuda] [--workdir DIR]

Every case runs in a fresh child process and reports its peak resident memory (``ru_maxrss`` of
the child, which includes the interpreter and its imports) and wall time:

* ``engine``    — what ``quantdyn sweep`` runs now: ``quantdyn.engine.measure.measure`` over the checkpoint,
                  read lazily one decoder block at a time in its own dtype, all quantizers in one
                  pass sharing the FP forward;
* ``in-memory`` — the reference, measured in the same run: the path sweeps took before the engine
                  (the whole model loaded in float32, its FP window CE, then per group of up to 8
                  quantizers one deep copy each, ``quantize_model`` on each, ``compare_many``).

Scans: model size (Pythia shapes with random weights written here, fp32 safetensors as quantdyn
saves them; 1b = pythia-1b's shape) with 5 quantizers (gptq3, gptq4, rtn2, rtn3, rtn4), and the
number of quantizers (1, 3, 5, 8) at one size. ``--llama7b`` writes a Llama-2-7B-shape bf16
checkpoint with random weights (13.5 GB in 2 GB safetensors shards, never instantiated as a model)
and sweeps it with rtn4 and rtn3 (the engine only: the in-memory path needs ~27 GB in float32).
Calibration 32 x 128 tokens and 200 x 128 evaluation windows of builtin:kjv (gpt2 tokenizer),
quantize_threads 1, as the sweep's defaults; ``--quick`` uses 14m/70m, 1/3 quantizers, 50 windows.
Results are printed as a table and written to bench/results/sweep_memory-<machine>-<date>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import record, write_results

SIZES = {"14m": "pythia-14m", "70m": "pythia-70m", "160m": "pythia-160m", "410m": "pythia-410m", "1b": "pythia-1b"}
PYTHIA_1B = {"n_layer": 16, "d_model": 2048, "n_head": 8, "max_seq_len": 2048, "vocab_size": 50304}
QUANTIZERS = ["gptq3", "gptq4", "rtn2", "rtn3", "rtn4", "gptq2", "awq4", "rtn8"]


# ----------------------------------------------------------------------------- checkpoints
def model_config(size: str):
    """The ModelConfig of a Pythia size of SIZES (1b: pythia-1b's shape)."""
    from quantdyn.models.gpt import ModelConfig

    return ModelConfig(**PYTHIA_1B) if size == "1b" else ModelConfig(preset=SIZES[size])


def write_pythia(size: str, out: Path) -> Path:
    """A Pythia-shaped checkpoint with random weights (fp32 safetensors, as quantdyn saves them)."""
    from quantdyn.models.gpt import GPT, resolve_model_config
    from quantdyn.models.hf_io import save_hf

    if (out / "model.safetensors").is_file():
        return out
    torch.manual_seed(0)
    save_hf(GPT(resolve_model_config(model_config(size))), out)
    return out


LLAMA_SHAPES = {  # name -> LlamaConfig keys; 'tiny' is the same code path in seconds (the CPU dry run)
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096),
    "tiny": dict(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, vocab_size=512, max_position_embeddings=256),
}


def write_llama7b(out: Path, shard_bytes: int = 2 * 10**9, shape: str = "7b", gen_device: str = "cpu") -> Path:
    """Llama-2-7B-shape bf16 checkpoint with random weights, written tensor by tensor into shards.

    gen_device: where the random numbers are drawn (cuda: seconds instead of a minute for 6.7 B values; a
    different stream than the CPU's, so the two checkpoints differ: only their shapes matter)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    from quantdyn.engine.lazy_model import params_on_meta

    if (out / "model.safetensors.index.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(**LLAMA_SHAPES[shape], rms_norm_eps=1e-5, tie_word_embeddings=False, torch_dtype="bfloat16")
    with params_on_meta():
        skel = AutoModelForCausalLM.from_config(cfg)
    cfg.save_pretrained(out)
    g = torch.Generator(device=gen_device).manual_seed(0)
    shard: dict[str, torch.Tensor] = {}
    size, files, weight_map = 0, [], {}

    def flush():
        nonlocal shard, size
        if shard:
            name = f"model-{len(files) + 1:05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            files.append((name, list(shard)))
            shard, size = {}, 0

    for name, p in skel.named_parameters():
        if p.dim() == 1:
            t = torch.ones(p.shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(p.shape, generator=g, dtype=torch.float32, device=gen_device) * 0.02).to(
                torch.bfloat16).cpu()
        shard[name] = t
        size += t.numel() * 2
        if size >= shard_bytes:
            flush()
    flush()
    n = len(files)
    for k, (name, names) in enumerate(files, 1):
        final = f"model-{k:05d}-of-{n:05d}.safetensors"
        (out / name).rename(out / final)
        weight_map.update({t: final for t in names})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


# ----------------------------------------------------------------------------- the measured child
def child(a) -> None:
    from quantdyn.data.prepare import DataConfig, prepare_data

    data = prepare_data(DataConfig(source="builtin:kjv", tokenizer="gpt2"), progress=False)
    calib = data.calib_windows(a.calib, 128, 0)
    ev = data.eval_windows(128, a.windows)
    vocab = json.loads((Path(a.ckpt) / "config.json").read_text()).get("vocab_size")
    if vocab and max(int(calib.max()), int(ev.max())) >= vocab:
        # the Llama-2 shape has 32,000 tokens, gpt2's ids go to 50,256: fold them into the model's vocabulary
        # (random weights: the text does not matter, only the shapes and the token count)
        calib, ev = calib % vocab, ev % vocab
    qs = {q: q for q in a.quantizers.split(",") if q}
    dev = torch.device(a.device)
    t0 = time.perf_counter()
    if a.child == "engine":
        from quantdyn.engine.measure import MeasureConfig, measure
        from quantdyn.models.hf_io import checkpoint_hash

        checkpoint_hash(a.ckpt)  # a sweep hashes the weights for its row keys
        m = measure(a.ckpt, qs, ev, None if a.no_calib else calib, device=dev,
                    cfg=MeasureConfig(layer_diagnostics=not a.no_calib, streams=a.streams))
        dce = {k: v["delta_ce"] for k, v in m.metrics.items()}
        extra = {"streams": m.streams, "dtype": m.dtype}
    else:
        import copy

        from quantdyn.engine.walk import num_threads, quantize_model
        from quantdyn.evaluate.loss import window_losses
        from quantdyn.evaluate.quant_error import compare_many
        from quantdyn.models.hf_io import checkpoint_hash, load_causal_lm

        checkpoint_hash(a.ckpt)
        model = load_causal_lm(a.ckpt, device=dev)
        fp = window_losses(model, ev, 16)
        dce, labels = {}, list(qs)
        for g in range(0, len(labels), 8):
            qmodels = {}
            for label in labels[g : g + 8]:
                qmodels[label] = copy.deepcopy(model)
                with num_threads(1 if dev.type == "cpu" else torch.get_num_threads()):
                    quantize_model(qmodels[label], calib, label, device=dev, progress=False)
            for k, v in compare_many(model, qmodels, ev, fp_window_ce=fp, batch_size=16).items():
                dce[k] = v["delta_ce"]
            del qmodels
        extra = {}
    out = {"seconds": time.perf_counter() - t0, "delta_ce": dce, **extra}
    if dev.type == "cuda":
        out["gpu_peak_bytes"] = torch.cuda.max_memory_allocated(dev)
    print("RESULT " + json.dumps(out))


def run_case(path: str, mode: str, quantizers: list[str], a, no_calib: bool = False) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, "--ckpt", path, "--quantizers", ",".join(quantizers),
           "--windows", str(a.windows), "--calib", str(a.calib), "--device", a.device, "--streams", a.streams]
    if no_calib:
        cmd.append("--no-calib")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    out, err = proc.stdout.read(), proc.stderr.read()
    wall = time.perf_counter() - t0
    if status != 0:
        raise SystemExit(f"child {mode} on {path} failed:\n{err[-3000:]}")
    res = json.loads(next(line[7:] for line in out.splitlines() if line.startswith("RESULT ")))
    return {"mode": mode, "peak_rss_bytes": usage.ru_maxrss * 1024, "process_wall": wall, **res}


def file_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sizes", default="14m,70m,160m,410m")
    ap.add_argument("--counts", default="1,3,5,8")
    ap.add_argument("--count-size", default="160m", help="model size of the quantizer-count scan")
    ap.add_argument("--llama7b", action="store_true")
    ap.add_argument("--no-reference", action="store_true", help="skip the in-memory reference path")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--workdir", default="")
    ap.add_argument("--windows", type=int, default=200)
    ap.add_argument("--calib", type=int, default=32)
    ap.add_argument("--llama-counts", default="1,2", help="--llama7b cases: 1 = rtn4, 2 = rtn4,rtn3")
    ap.add_argument("--llama-shape", default="7b", choices=sorted(LLAMA_SHAPES),
                    help="--llama7b: the shape (tiny: the same code path in seconds, for the CPU dry run)")
    ap.add_argument("--out", default="", help="results JSON (default bench/results/sweep_memory-<machine>-<date>"
                                             "-<cases>.json)")
    ap.add_argument("--child", default="")
    ap.add_argument("--ckpt", default="")
    ap.add_argument("--quantizers", default="")
    ap.add_argument("--no-calib", action="store_true")
    ap.add_argument("--streams", default="auto", choices=("auto", "memory", "disk"),
                    help="where the engine keeps activation streams (MeasureConfig.streams)")
    a = ap.parse_args()
    if a.child:
        return child(a)
    if a.quick:
        a.sizes, a.counts, a.count_size, a.windows = "14m,70m", "1,3", "14m", 50
    work = Path(a.workdir or tempfile.mkdtemp(prefix="qd-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    results = {"device": a.device, "windows": a.windows, "calib": a.calib, "sizes": [], "counts": [], "llama7b": None}
    print(f"{'case':<22}{'file':>10}{'engine RSS':>12}{'x file':>8}{'in-mem RSS':>12}{'x file':>8}"
          f"{'engine s':>10}{'in-mem s':>10}{'time ratio':>11}")

    def row(label, ck, quantizers):
        ck = Path(ck)
        fb = file_bytes(ck)
        e = run_case(str(ck), "engine", quantizers, a)
        r = None if a.no_reference else run_case(str(ck), "in-memory", quantizers, a)
        same = r is None or all(abs(e["delta_ce"][k] - r["delta_ce"][k]) <= 1e-6 * max(1, abs(r["delta_ce"][k]))
                                for k in r["delta_ce"])
        print(f"{label:<22}{fb / 2**30:>9.2f}G{e['peak_rss_bytes'] / 2**30:>11.2f}G{e['peak_rss_bytes'] / fb:>8.2f}"
              + (f"{r['peak_rss_bytes'] / 2**30:>11.2f}G{r['peak_rss_bytes'] / fb:>8.2f}" if r else f"{'-':>12}{'-':>8}")
              + f"{e['seconds']:>10.1f}" + (f"{r['seconds']:>10.1f}{e['seconds'] / r['seconds']:>11.2f}" if r else "")
              + ("" if same else "  (Δ CE differs!)"), flush=True)
        return {"case": label, "file_bytes": fb, "quantizers": quantizers, "engine": e, "in_memory": r,
                "same_delta_ce": same}

    for size in [s for s in a.sizes.split(",") if s]:
        ck = write_pythia(size, work / f"pythia-{size}")
        results["sizes"].append(row(f"pythia-{size} x5", ck, QUANTIZERS[:5]))
    counts = [int(c) for c in a.counts.split(",") if c]
    ck = write_pythia(a.count_size, work / f"pythia-{a.count_size}") if counts else None
    for n in counts:
        results["counts"].append(row(f"pythia-{a.count_size} x{n}", ck, QUANTIZERS[:n]))
    if a.llama7b:
        ck = write_llama7b(work / f"llama2-{a.llama_shape}-shape", shape=a.llama_shape,
                           gen_device="cuda" if a.device.startswith("cuda") else "cpu")
        fb = file_bytes(ck)
        keep = a.no_reference
        a.no_reference, a.windows = True, min(a.windows, 8)
        llama_cases = {1: ["rtn4"], 2: ["rtn4", "rtn3"]}
        for n, qs in ((int(c), llama_cases[int(c)]) for c in a.llama_counts.split(",") if c):
            e = run_case(str(ck), "engine", qs, a, no_calib=True)
            label = f"llama2-{a.llama_shape}-shape bf16 x{n}"
            print(f"{label:<22}{fb / 2**30:>9.2f}G{e['peak_rss_bytes'] / 2**30:>11.2f}G"
                  f"{e['peak_rss_bytes'] / fb:>8.2f}{'-':>12}{'-':>8}{e['seconds']:>10.1f}"
                  + (f"   peak GPU memory {e['gpu_peak_bytes'] / 2**30:.2f} GiB" if e.get("gpu_peak_bytes") else ""),
                  flush=True)
            results.setdefault("llama7b_runs", []).append({"file_bytes": fb, "quantizers": qs, "engine": e,
                                                           "windows": a.windows})
        a.no_reference = keep
    cases = "_".join([f"s{s}" for s in a.sizes.split(",") if s] + [f"n{a.count_size}x{c}" for c in counts]
                     + ([f"llama{a.llama_shape}"] if a.llama7b else []))
    print(f"wrote {write_results('sweep_memory', results, a.out, suffix=cases)}")
    record("sweep_memory", results, a)  # the same figures in a `make bench` / gpu_check run's file


if __name__ == "__main__":
    main()
