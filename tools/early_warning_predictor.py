"""The early warning as a predictor (issue 48.5), post hoc on a swept quantdyn run: for every checkpoint that has a
predecessor (the run's previous checkpoint, or a branch's branch point), the loss's curvature along the update
between them (analysis/hessian.curvature_along, what PTQMonitor's warning_every logs during training), against the
Δ CE the sweep measured at that checkpoint per quantizer: Spearman's rho with a bootstrap interval over the
checkpoints, and the values in order along each branch (does the signal rise before the decay's Δ CE does?).

    .venv/bin/python tools/early_warning_predictor.py runs/demo --store results [--windows 8] [--json out.json]
"""
from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from quantdyn.analysis.correlate import spearman
from quantdyn.analysis.hessian import curvature_along, next_token_loss
from quantdyn.data.prepare import prepare_data
from quantdyn.models.hf_io import load_gpt
from quantdyn.results.store import ResultStore
from quantdyn.runs import RunDir, branch_runs, list_checkpoints
from quantdyn.train.config import data_config_of, load_run_config


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run")
    ap.add_argument("--store", default="results")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--boot", type=int, default=2000)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    run = Path(a.run)
    cfg = load_run_config(run)
    ids = prepare_data(data_config_of(cfg), progress=False).eval_windows(cfg.train.seq_len, a.windows)
    ids = torch.as_tensor(np.asarray(ids)).long()
    pairs = []  # (branch, step, checkpoint, previous checkpoint)
    main = list_checkpoints(run)
    pairs += [("main", c.step, c.path, p.path) for p, c in zip(main, main[1:])]
    for b in branch_runs(run):
        info = b.read_info().get("parent") or {}
        start = RunDir(run).checkpoint(int(info.get("from_step", 0)))
        pts = [c for c in list_checkpoints(b.path) if c.step > int(info.get("from_step", 0))]
        prev = [start] + [c.path for c in pts]
        pairs += [(b.path.name, c.step, c.path, p) for c, p in zip(pts, prev)]
    rows = [r for r in ResultStore(a.store).rows() if r.get("kind") == "ptq"]
    out, seen = [], {}
    for branch, step, ckpt, prev in pairs:
        digest = hashlib.sha256((Path(ckpt) / "model.safetensors").read_bytes()).hexdigest()
        if digest in seen:  # the same weights (a control twin of a stable-phase main checkpoint): one point
            print(f"{branch}@{step}: the same weights as {seen[digest]}, counted once")
            continue
        seen[digest] = f"{branch}@{step}"
        model, before = load_gpt(ckpt).eval(), load_gpt(prev)
        params = list(model.parameters())
        d = [p.detach() - q.detach() for p, q in zip(params, before.parameters())]
        with torch.no_grad():
            k = curvature_along(lambda: next_token_loss(model, ids), params, d)["curvature"]
        dce = {r["quantizer"]: r["delta_ce"] for r in rows
               if Path(str(r.get("checkpoint", ""))).resolve() == Path(ckpt).resolve()
               or (r.get("branch") == branch and r.get("step") == step and r.get("run") == cfg.name)}
        out.append({"branch": branch, "step": step, "curvature": k, "delta_ce": dce})
        print(f"{branch:28s} {step:6d} curvature {k:10.4g}  " + "  ".join(f"{q} {v:+.4f}" for q, v in sorted(dce.items())))
    rng = np.random.default_rng(0)
    quantizers = sorted({q for o in out for q in o["delta_ce"]})
    result = {"points": out, "spearman": {}}
    for q in quantizers:
        pts = [(o["curvature"], o["delta_ce"][q]) for o in out if q in o["delta_ce"]]
        x, y = np.array([p[0] for p in pts]), np.array([p[1] for p in pts])
        rho = spearman(x, y)
        boots = []
        for _ in range(a.boot):
            i = rng.integers(0, len(x), len(x))
            if len(set(x[i])) > 2 and len(set(y[i])) > 2:
                boots.append(spearman(x[i], y[i]))
        lo, hi = np.percentile(boots, [2.5, 97.5])
        result["spearman"][q] = {"rho": rho, "ci95": [float(lo), float(hi)], "n": len(x)}
        print(f"{q:8s} Spearman rho {rho:+.2f}  95 % bootstrap interval [{lo:+.2f}, {hi:+.2f}]  over {len(x)} checkpoints")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
