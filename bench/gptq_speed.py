"""GPTQ speed: quantdyn vs a textbook column-by-column GPTQ vs the reference.

    .venv/bin/python bench/gptq_speed.py [--reference-dir /tmp/gptqref] [--quick]
    .venv/bin/python bench/gptq_speed.py --batched          # gptq_batch against one gptq() per weight
    python3 bench/gptq_speed.py --device cuda --model-sizes 160m,1b --n-calib 128 --seq-len 2048   # a GPU

Per layer (pythia-70m shapes, W random, H from correlated random inputs):
seconds of quantdyn's ``gptq`` at 1 and 2 threads, of the textbook version in
tests/test_gptq.py, and — when ``--reference-dir`` holds IST-DASLab/gptq's
``gptq.py`` and ``quant.py`` (not part of quantdyn; fetch them yourself) — of
the reference ``GPTQ.fasterquant`` on identical inputs, with a check that the
outputs are equal. Then the whole-model time of ``quantize_model`` on a
pythia-70m-shaped quantdyn GPT at 1 and 2 threads. Everything is printed as
seconds and ratios from one run of this script (per-layer numbers: best of
``--repeat`` calls; on a shared machine they are noisy).

``--batched``: several weights in one column loop (``gptq_batch``: gptq4 and gptq3 of Pythia-160M's layers, each
with its own Hessian; SmolLM-135M's q/k/v and gate/up, which share one, for both and for gptq4 alone — the CPU's
default) against one ``gptq`` call per weight, with a check that the codes are the same.

``--device cuda``: the per-layer times on the GPU (threads do not apply; the textbook version is
skipped), then whole-model GPTQ 4-bit g128 of each ``--model-sizes`` shape (Pythia shapes with
random weights, the model kept on the GPU) with its seconds and the GPU's peak memory; the batched cases above,
each also with the column loop as CUDA graphs.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from quantdyn.quantize import QuantConfig, num_threads  # noqa: E402
from quantdyn.quantize.gptq import gptq  # noqa: E402

LAYERS = {  # pythia-70m: d_model 512, d_ff 2048
    "query_key_value": (1536, 512),
    "attention.dense": (512, 512),
    "dense_h_to_4h": (2048, 512),
    "dense_4h_to_h": (512, 2048),
}


def layer_inputs(R: int, C: int, tokens: int = 4096, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(R, C, generator=g) * 0.02
    X = torch.randn(tokens, C, generator=g) * (0.2 + torch.rand(C, generator=g))
    X = X @ (torch.eye(C) + 0.3 * torch.randn(C, C, generator=g) / C**0.5)
    return W, (2 / tokens) * X.T @ X


def load_reference(path: Path):
    """Import the reference's gptq.py/quant.py from a directory outside the repo."""
    if not (path / "gptq.py").is_file() or not (path / "quant.py").is_file():
        raise SystemExit(f"--reference-dir {path}: needs gptq.py and quant.py of IST-DASLab/gptq")
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *a, **k: None  # the reference syncs CUDA unconditionally
    sys.path.insert(0, str(path))
    with contextlib.redirect_stdout(io.StringIO()):
        import gptq as ref_gptq  # type: ignore
        import quant as ref_quant  # type: ignore
    return ref_gptq, ref_quant


def run_reference(ref, W, H, cfg: QuantConfig):
    ref_gptq, ref_quant = ref
    layer = torch.nn.Linear(W.shape[1], W.shape[0], bias=False)
    layer.weight.data = W.clone()
    g = ref_gptq.GPTQ(layer)
    g.H = H.clone()
    g.quantizer = ref_quant.Quantizer()
    g.quantizer.configure(cfg.bits, perchannel=True, sym=cfg.sym, mse=cfg.mse)
    t = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        g.fasterquant(blocksize=cfg.block_size, percdamp=cfg.damp_percent, groupsize=cfg.group_size or -1,
                      actorder=cfg.act_order, static_groups=cfg.static_groups)
    return time.perf_counter() - t, layer.weight.data


def timed(fn, repeat: int = 1):
    """(best seconds over ``repeat`` calls, last output)."""
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_layers_device(args, device: torch.device) -> list[dict]:
    """Per-layer GPTQ seconds on ``device`` (best of --repeat, synchronized)."""
    cfg = QuantConfig(bits=4, group_size=128)
    layers = dict(list(LAYERS.items())[:2]) if args.quick else LAYERS
    graphs = device.type == "cuda"
    print(f"per layer on {device}, {cfg.name} (best of {args.repeat} calls, seconds)"
          + ("; eager column loop | CUDA graph per block (same bits)" if graphs else ""))
    rows = []
    for name, (R, C) in layers.items():
        W, H = (t.to(device) for t in layer_inputs(R, C))
        gptq(W[:8], H, cfg)  # warm-up (kernels, cuBLAS/cuSOLVER handles)
        _sync(device)

        def run(cuda_graph: bool):
            out = gptq(W, H, cfg, cuda_graph=cuda_graph)
            _sync(device)
            return out
        t, eager = timed(lambda: run(False), args.repeat)
        row = {"layer": name, "shape": [R, C], "device": str(device), "seconds": t}
        if graphs:
            tg, graphed = timed(lambda: run(True), args.repeat)
            row |= {"seconds_cuda_graph": tg, "eager_over_graph": t / tg,
                    "same_codes": bool(torch.equal(graphed.codes, eager.codes))}
        print(f"{name:>16} {R:>4}x{C:<5} {t:8.4f}" + (f" | {tg:8.4f}  ({t / tg:.1f}x, same codes: "
                                                       f"{row['same_codes']})" if graphs else ""), flush=True)
        rows.append(row)
    return rows


def bench_model_device(args, device: torch.device, size: str, graph: bool = False) -> dict:
    """Whole-model GPTQ 4-bit g128 of a Pythia ``size`` shape (random weights) on ``device``; ``graph``: with
    the CUDA graphs of the column loop (quantize/gptq.py, QUANTDYN_GPTQ_CUDA_GRAPH)."""
    from sweep_memory import model_config  # the Pythia shapes the benchmarks share (1b included)

    from quantdyn.engine.walk import quantize_model
    from quantdyn.models.gpt import GPT, resolve_model_config

    torch.manual_seed(0)
    mcfg = resolve_model_config(model_config(size))
    model = GPT(mcfg).to(device)
    ids = torch.randint(0, mcfg.vocab_size, (args.n_calib, args.seq_len))
    cfg = QuantConfig(bits=4, group_size=128, true_sequential=True)
    from quantdyn.quantize.gptq import CUDA_GRAPH_ENV

    saved = os.environ.get(CUDA_GRAPH_ENV)
    os.environ[CUDA_GRAPH_ENV] = "1" if graph else "0"  # quantize_model calls gptq() with its defaults
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _sync(device)
    t = time.perf_counter()
    try:
        res = quantize_model(model, ids, cfg, device=device, progress=False, batch_size=args.calib_batch)
        _sync(device)
    finally:
        if saved is None:
            os.environ.pop(CUDA_GRAPH_ENV)
        else:
            os.environ[CUDA_GRAPH_ENV] = saved
    t = time.perf_counter() - t
    n = sum(p.numel() for p in model.parameters())
    out = {"model": f"pythia-{size} shape", "column_loop": "cuda graph" if graph and device.type == "cuda" else "eager",
           "params_m": round(n / 1e6, 1), "device": str(device),
           "quantizer": cfg.name, "calib": [args.n_calib, args.seq_len], "seconds": t,
           "gptq_seconds": sum(r["seconds"] for r in res.rows), "layers": len(res.rows),
           "peak_gpu_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}
    print(f"whole model pythia-{size} shape ({n / 1e6:.0f} M params), {out['column_loop']}, {cfg.name}, "
          f"calibration {args.n_calib} x {args.seq_len}: {t:.1f} s ({out['gptq_seconds']:.1f} s inside gptq(), "
          f"{len(res.rows)} layers)"
          + (f", peak GPU memory {out['peak_gpu_bytes'] / 2**30:.2f} GiB" if out["peak_gpu_bytes"] else ""),
          flush=True)
    del model
    return out


BATCH_CASES = {
    # pythia-160m's four linears, gptq4 and gptq3 of each, each quantizer with its own Hessian (in a sweep every
    # quantizer calibrates on its own stream): two stacks of one weight side by side (WalkConfig.batch_quantizers)
    "160m qkv x2q": [(2304, 768)], "160m dense x2q": [(768, 768)], "160m h_to_4h x2q": [(3072, 768)],
    "160m 4h_to_h x2q": [(768, 3072)],
    # SmolLM-135M's q/k/v and gate/up: one input, one Hessian (stacked rows), for gptq4 and gptq3
    "135m q/k/v x2q": [(576, 576), (192, 576), (192, 576)], "135m gate/up x2q": [(1536, 576), (1536, 576)],
    # the same for gptq4 alone: what a CPU batches by default (stacked layers, one loop per quantizer)
    "135m q/k/v x1q": [(576, 576), (192, 576), (192, 576)], "135m gate/up x1q": [(1536, 576), (1536, 576)],
}


def batch_problems(shapes: list[tuple[int, int]], device: torch.device, both: bool = True) -> list[tuple]:
    """gptq4 and gptq3 (``both``; else gptq4 alone) of weights of ``shapes`` that share one input (one Hessian per
    quantizer)."""
    C = shapes[0][1]
    _, H4 = layer_inputs(8, C, seed=1)
    _, H3 = layer_inputs(8, C, seed=2)
    Ws = [layer_inputs(R, C, seed=10 + i)[0] for i, (R, _) in enumerate(shapes)]
    return [(W.to(device), H.to(device), QuantConfig(bits=b, group_size=128))
            for H, b in ((H4, 4), (H3, 3))[: 2 if both else 1] for W in Ws]


def bench_batched(args, device: torch.device) -> list[dict]:
    """Seconds of one gptq() call per weight against one gptq_batch call for all of them (the same bits, checked),
    and on a GPU each with the column loop as CUDA graphs. On a CPU at one thread (the engine's default)."""
    from quantdyn.quantize.gptq import gptq_batch

    graphs = device.type == "cuda"
    cases = dict(list(BATCH_CASES.items())[:2]) if args.quick else BATCH_CASES
    print(f"\nbatched GPTQ on {device} (best of {args.repeat}, seconds): one gptq() per weight | one gptq_batch call"
          + (" | the same with CUDA graphs" if graphs else ""))
    rows = []
    for name, shapes in cases.items():
        problems = batch_problems(shapes, device, both=name.endswith("x2q"))
        gptq_batch(problems[:1])  # warm-up

        def each(graph: bool):
            out = [gptq(*p, cuda_graph=graph) for p in problems]
            _sync(device)
            return out

        def batched(graph: bool):
            out = gptq_batch(problems, cuda_graph=graph)
            _sync(device)
            return out
        with num_threads(1) if device.type == "cpu" else contextlib.nullcontext():
            t_each = t_batch = cpu_each = cpu_batch = float("inf")
            for _ in range(args.repeat):  # interleaved; on a CPU also the thread's CPU seconds (steadier when shared)
                c0 = time.thread_time()
                t, ref = timed(lambda: each(False))
                c1 = time.thread_time()
                t_each, cpu_each = min(t_each, t), min(cpu_each, c1 - c0)
                t, got = timed(lambda: batched(False))
                t_batch, cpu_batch = min(t_batch, t), min(cpu_batch, time.thread_time() - c1)
            row = {"case": name, "weights": len(problems), "device": str(device), "each_s": t_each, "batch_s": t_batch,
                   "batch_over_each": t_batch / t_each,
                   "same_codes": all(torch.equal(a.codes, b.codes) for a, b in zip(got, ref))}
            if device.type == "cpu":
                row |= {"each_cpu_s": cpu_each, "batch_cpu_s": cpu_batch, "batch_over_each_cpu": cpu_batch / cpu_each}
            if graphs:
                t_each_g, _ = timed(lambda: each(True), args.repeat)
                t_batch_g, got_g = timed(lambda: batched(True), args.repeat)
                row |= {"each_graph_s": t_each_g, "batch_graph_s": t_batch_g, "each_over_batch_graph": t_each / t_batch_g,
                        "same_codes_graph": all(torch.equal(a.codes, b.codes) for a, b in zip(got_g, ref))}
        print(f"{name:>18} {len(problems):>2} weights  {t_each:8.3f} | {t_batch:8.3f} ({t_batch / t_each:.2f}x)"
              + (f", CPU {cpu_each:.3f} | {cpu_batch:.3f} ({cpu_batch / cpu_each:.2f}x)" if device.type == "cpu" else "")
              + (f" | {row['each_graph_s']:8.3f} | {row['batch_graph_s']:8.3f} (eager each / batched graph "
                 f"{row['each_over_batch_graph']:.1f}x)" if graphs else "") + f"  same codes: {row['same_codes']}",
              flush=True)
        rows.append(row)
    return rows


def bench_layers(args, ref) -> list[dict]:
    cfg = QuantConfig(bits=4, group_size=128)
    rows = []
    print(f"per layer, {cfg.name} (best of {args.repeat} calls, seconds; qd/ref = quantdyn / reference)")
    head = f"{'layer':>16} {'shape':>10} {'qd 1T':>7} {'qd 2T':>7} {'textbk 1T':>9}"
    if ref:
        head += f" {'ref 1T':>7} {'ref 2T':>7} {'qd/ref 1T':>9} {'qd/ref 2T':>9} {'qd1T/ref2T':>10} {'equal':>5}"
    print(head)
    layers = dict(list(LAYERS.items())[:2]) if args.quick else LAYERS
    for name, (R, C) in layers.items():
        W, H = layer_inputs(R, C)
        gptq(W[:8], H, cfg)  # warm-up
        with num_threads(1):
            t1, r1 = timed(lambda: gptq(W, H, cfg), args.repeat)
        with num_threads(2):
            t2, _ = timed(lambda: gptq(W, H, cfg), args.repeat)
        tb = float("nan")
        if not args.no_textbook:
            from test_gptq import textbook_gptq

            with num_threads(1):
                tb, _ = timed(lambda: textbook_gptq(W, H, cfg.bits, cfg.sym, cfg.group_size))
        line = f"{name:>16} {R:>4}x{C:<5} {t1:7.2f} {t2:7.2f} {tb:9.2f}"
        if ref:
            with num_threads(1):
                rt1 = min(run_reference(ref, W, H, cfg)[0] for _ in range(args.repeat))
                Q1 = run_reference(ref, W, H, cfg)[1]
            with num_threads(2):
                rt2 = min(run_reference(ref, W, H, cfg)[0] for _ in range(args.repeat))
            equal = torch.equal(Q1, r1.weight)
            line += f" {rt1:7.2f} {rt2:7.2f} {t1 / rt1:9.2f} {t2 / rt2:9.2f} {t1 / rt2:10.2f} {str(equal):>5}"
        print(line, flush=True)
        rows.append({"layer": name, "shape": [R, C], "quantdyn_1t_s": t1, "quantdyn_2t_s": t2,
                     "textbook_1t_s": None if tb != tb else tb,
                     **({"reference_1t_s": rt1, "reference_2t_s": rt2, "equal": equal} if ref else {})})
    return rows


def bench_model(args) -> dict:
    from quantdyn.engine.walk import quantize_model
    from quantdyn.models.gpt import GPT, ModelConfig, resolve_model_config

    torch.manual_seed(0)
    model = GPT(resolve_model_config(ModelConfig(preset="pythia-70m")))
    ids = torch.randint(0, model.config.vocab_size, (args.n_calib, args.seq_len))
    cfg = QuantConfig(bits=4, group_size=128, true_sequential=True)
    print(f"\nwhole model: pythia-70m shape, {cfg.name}, calibration {args.n_calib} x {args.seq_len} tokens")
    times = {}
    for th in (1, 2):
        state = {k: v.clone() for k, v in model.state_dict().items()}
        with num_threads(th):
            t, res = timed(lambda: quantize_model(model, ids, cfg, progress=False))
        model.load_state_dict(state)
        gptq_s = sum(r["seconds"] for r in res.rows)
        times[th] = t
        print(f"  {th} thread(s): {t:6.2f} s total, {gptq_s:6.2f} s inside gptq(), {len(res.rows)} layers")
    print(f"  ratio 1 thread / 2 threads: {times[1] / times[2]:.2f}")
    return {"model": "pythia-70m shape", "quantizer": cfg.name, "calib": [args.n_calib, args.seq_len],
            "seconds_1t": times[1], "seconds_2t": times[2]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reference-dir", type=Path, default=None, help="directory with IST-DASLab gptq.py + quant.py")
    p.add_argument("--quick", action="store_true", help="two layers, one timing each, no textbook, a short calibration set")
    p.add_argument("--no-textbook", action="store_true", help="skip the slow textbook timing")
    p.add_argument("--no-model", action="store_true", help="skip the whole-model timing")
    p.add_argument("--repeat", type=int, default=3, help="per-layer timings: best of this many calls")
    p.add_argument("--n-calib", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cuda: per-layer and whole-model times on the GPU (--model-sizes)")
    p.add_argument("--model-sizes", default="", help="--device runs: whole-model GPTQ of these Pythia shapes, "
                                                      "e.g. 160m,1b (default 70m)")
    p.add_argument("--cuda-graph", action="store_true", help="--device cuda: the whole models with GPTQ's column "
                   "loop as CUDA graphs (QUANTDYN_GPTQ_CUDA_GRAPH=1; per layer both ways are timed anyway)")
    p.add_argument("--calib-batch", type=int, default=8, help="calibration sequences per forward")
    p.add_argument("--batched", action="store_true", help="only the batched column loop (gptq_batch) against one "
                   "gptq() per weight (on --device cuda it runs anyway, with and without CUDA graphs)")
    args = p.parse_args()
    if args.quick:
        args.n_calib, args.seq_len, args.repeat, args.no_textbook = 4, 64, 1, True
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU is visible here (torch.cuda.is_available() is False)")
    print(f"torch {torch.__version__}, default threads {torch.get_num_threads()}")
    if args.device == "cuda" or args.model_sizes:
        device = torch.device(args.device)
        figures = {"layers": bench_layers_device(args, device)}
        if args.batched or device.type == "cuda":
            figures["batched"] = bench_batched(args, device)
        if not args.no_model:
            sizes = (args.model_sizes or "70m").split(",")
            graph = device.type == "cuda" and args.cuda_graph
            figures["models"] = [bench_model_device(args, device, s, graph=graph) for s in sizes]
        from common import record

        record("gptq_speed", figures, args)
        return
    if args.batched:  # the batched column loop against one call per weight, on this CPU
        from common import record

        record("gptq_speed", {"batched": bench_batched(args, torch.device("cpu"))}, args)
        return
    ref = load_reference(args.reference_dir) if args.reference_dir else None
    figures = {"layers": bench_layers(args, ref)}
    if not args.no_model:
        figures["model"] = bench_model(args)
    from common import record  # bench/common.py (this directory is on sys.path)

    record("gptq_speed", figures, args)


if __name__ == "__main__":
    main()
