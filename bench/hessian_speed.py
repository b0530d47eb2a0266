"""Seconds per Hessian-vector product and per Hutchinson trace estimate.

Model: quantdyn GPT with the pythia-14m preset (6 layers, d 128, vocab 50304),
random init, one batch of random token ids (default 4 × 128), loss = mean
next-token CE, all parameters.  Compared in the same run against

  * PyHessian (``pip install pyhessian``; optional, never a requirement):
    ``hessian(model, criterion, data=(x, y), cuda=False)`` — builds the
    gradient graph once, as ``reuse_graph=True`` does here;
  * a naive loop: ``torch.autograd.functional.hvp`` on
    ``torch.func.functional_call`` (forward + double backward every call).

Ratios are (other seconds) / (quantdyn seconds), medians over interleaved
rounds, in wall and CPU time: > 1 means quantdyn is faster.

    .venv/bin/python bench/hessian_speed.py [--batch 4] [--seq 128] [--reps 3] [--probes 3] [--threads 0]
"""
from __future__ import annotations

import argparse
import statistics
import time
import warnings
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from quantdyn.analysis.hessian import hutchinson_trace, hvp_from_loss, next_token_loss
from quantdyn.models.gpt import GPT, ModelConfig, resolve_model_config


def _interleaved(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, list[tuple[float, float]]]:
    """(wall, CPU) seconds per call of each fn.  Calls alternate, so load from
    other processes on a shared machine hits every method alike; CPU time
    (``time.process_time``, all threads) is the steadier number there.  One
    warm-up call each."""
    for fn in fns.values():
        fn()
    out: dict[str, list[tuple[float, float]]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            out[k].append((time.perf_counter() - t0, time.process_time() - c0))
    return out


def _med(times: dict[str, list[tuple[float, float]]], k: str) -> str:
    return (f"{statistics.median(w for w, _ in times[k]):.3f} s wall / "
            f"{statistics.median(c for _, c in times[k]):.3f} s CPU")


def _ratio(times: dict[str, list[tuple[float, float]]], other: str, ours: str) -> str:
    """Median over rounds of the per-round ratio other/ours, wall and CPU."""
    w = statistics.median(o[0] / q[0] for o, q in zip(times[other], times[ours]))
    c = statistics.median(o[1] / q[1] for o, q in zip(times[other], times[ours]))
    return f"{w:.2f}x wall, {c:.2f}x CPU"


class _FlatLogits(nn.Module):
    """PyHessian calls criterion(model(x), y): give it (B·(T−1), V) logits."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.model(ids)
        return logits[:, :-1].reshape(-1, logits.size(-1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3, help="timed HVPs per method (rounds, interleaved)")
    ap.add_argument("--probes", type=int, default=3, help="probes per timed trace estimate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    ap.add_argument("--quick", action="store_true", help="batch 2 x 64 tokens, one timed round, 2 probes")
    args = ap.parse_args()
    if args.quick:
        args.batch, args.seq, args.reps, args.probes = 2, 64, 1, 2
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(args.seed)
    model = GPT(resolve_model_config(ModelConfig(preset="pythia-14m"))).eval()
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq))
    params = list(model.parameters())
    n_params = sum(p.numel() for p in params)
    print(f"pythia-14m shape: {n_params / 1e6:.1f}M params, batch {args.batch} x seq {args.seq}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")

    def loss():
        with sdpa_kernel(SDPBackend.MATH):
            return next_token_loss(model, ids)

    gen = torch.Generator().manual_seed(1)
    v = [torch.randn(p.shape, generator=gen) for p in params]

    # --- quantdyn (graph built once) and PyHessian (same trick), if installed
    t0 = time.perf_counter()
    hvp, _ = hvp_from_loss(loss, params, reuse_graph=True)
    build = time.perf_counter() - t0
    hv_ours = hvp(v)
    try:
        from pyhessian import hessian as PyHessian
        from pyhessian.utils import hessian_vector_product
    except ImportError:
        PyHessian = None
    fast: dict[str, Callable[[], object]] = {"quantdyn": lambda: hvp(v)}
    traces: dict[str, Callable[[], object]] = {
        "quantdyn": lambda: hutchinson_trace(hvp, params, max_probes=args.probes, tol=0.0, min_probes=2, seed=0)
    }
    if PyHessian is not None:
        t0 = time.perf_counter()
        with sdpa_kernel(SDPBackend.MATH), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Using backward\\(\\) with create_graph=True")
            ph = PyHessian(_FlatLogits(model), nn.CrossEntropyLoss(), data=(ids, ids[:, 1:].reshape(-1)), cuda=False)
        ph_build = time.perf_counter() - t0
        hv_ph = hessian_vector_product(ph.gradsH, ph.params, v)
        fast["pyhessian"] = lambda: hessian_vector_product(ph.gradsH, ph.params, v)
        # tol=-inf: PyHessian's relative test divides by (trace + 1e-6) and stops
        # at once when the running trace is negative; -inf forces all probes
        traces["pyhessian"] = lambda: ph.trace(maxIter=args.probes, tol=float("-inf"))
    # per-call HVPs (forward + 2 backward each): quantdyn recompute mode, naive functional hvp
    names = [n for n, _ in model.named_parameters()]

    def f(*flat):
        with sdpa_kernel(SDPBackend.MATH):
            logits = torch.func.functional_call(model, dict(zip(names, flat)), (ids,))
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))

    primals = tuple(p.detach() for p in params)
    hvp_rc, _ = hvp_from_loss(loss, params, reuse_graph=False)
    hv_naive = torch.autograd.functional.hvp(f, primals, tuple(v))[1]
    fast["quantdyn_recompute"] = lambda: hvp_rc(v)
    fast["naive"] = lambda: torch.autograd.functional.hvp(f, primals, tuple(v))
    t_hvp = _interleaved(fast, args.reps)
    t_tr = _interleaved(traces, max(1, args.reps // 2))
    tr = hutchinson_trace(hvp, params, max_probes=args.probes, tol=0.0, min_probes=2, seed=0)
    print(f"quantdyn  graph build {build:.3f} s | HVP {_med(t_hvp, 'quantdyn')} | trace ({args.probes} probes) "
          f"{_med(t_tr, 'quantdyn')} = {tr['trace']:.4g} ± {tr['se']:.2g}")
    if PyHessian is not None:
        ph_tr = ph.trace(maxIter=args.probes, tol=float("-inf"))
        print(f"pyhessian graph build {ph_build:.3f} s | HVP {_med(t_hvp, 'pyhessian')} | trace ({args.probes} probes) "
              f"{_med(t_tr, 'pyhessian')} = {sum(ph_tr) / len(ph_tr):.4g}")
        print(f"ratio pyhessian/quantdyn: HVP {_ratio(t_hvp, 'pyhessian', 'quantdyn')}; "
              f"trace {_ratio(t_tr, 'pyhessian', 'quantdyn')}; graph build {ph_build / build:.2f}x wall; "
              f"HVP max rel diff {_rel(hv_ph, hv_ours):.1e}")
        model.zero_grad(set_to_none=True)  # PyHessian leaves graph-holding .grad behind
    else:
        print("pyhessian not installed (pip install pyhessian); skipped")
    print(f"per-call HVP (no graph reuse): quantdyn recompute {_med(t_hvp, 'quantdyn_recompute')}, "
          f"naive autograd.functional.hvp {_med(t_hvp, 'naive')}")
    print(f"ratio naive/quantdyn: vs reuse_graph HVP {_ratio(t_hvp, 'naive', 'quantdyn')}; "
          f"vs recompute {_ratio(t_hvp, 'naive', 'quantdyn_recompute')}; HVP max rel diff {_rel(hv_naive, hv_ours):.1e}")
    from common import record  # bench/common.py (this script's directory is on sys.path)

    def medians(times):
        return {k: {"wall_s": statistics.median(w for w, _ in v), "cpu_s": statistics.median(c for _, c in v)}
                for k, v in times.items()}

    record("hessian_speed", {"params_m": n_params / 1e6, "graph_build_s": build, "hvp": medians(t_hvp),
                             "trace": medians(t_tr), "trace_value": tr["trace"], "trace_se": tr["se"]}, args)


def _rel(a, b) -> float:
    return max(float((x - y).abs().max() / (y.abs().max() + 1e-30)) for x, y in zip(a, b))


if __name__ == "__main__":
    main()
