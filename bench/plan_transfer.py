"""Does a plan made before the decay still hold after it? The plan allocated at a cooldown's branch point against
the plan allocated at the decayed endpoint itself, both measured at the endpoint (issue 41, item 4).

    .venv/bin/python bench/plan_transfer.py --branch-point runs/demo/checkpoints/step-0000400 \\
        --endpoint runs/demo/branches/cooldown-s400-d100-linear/checkpoints/step-0000500 [--budgets 3.9,4.5]

For each budget: the sensitivity pass (engine/sensitivity.py) on the calibration windows of each checkpoint, the
allocator's plan of each, and both plans measured on the endpoint's evaluation windows in one pass; the regret is
KL(branch-point plan) − KL(endpoint plan) paired window by window (results/stats.py, resolved when |z| > 2),
also relative to the endpoint plan's KL, with the fraction of tensors whose type differs. Positive: the decay
moved sensitivity enough that re-allocating at the endpoint pays. ``--control`` adds the constant-LR control's
own plan measured at the endpoint for comparison.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from allocation import add_plan_options, loadavg, windows  # noqa: E402
from common import record, write_results  # noqa: E402

from quantdyn.engine.measure import measure  # noqa: E402
from quantdyn.engine.rows import storage_fields  # noqa: E402
from quantdyn.engine.sensitivity import SensitivityConfig, measure_sensitivity  # noqa: E402
from quantdyn.quantize.plan import register_plan  # noqa: E402
from quantdyn.results.stats import format_estimate, paired_difference, verdict_sign  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--branch-point", required=False)
    ap.add_argument("--endpoint", required=False)
    ap.add_argument("--control", default=None, help="the constant-LR control's last checkpoint (optional)")
    ap.add_argument("--budgets", default="3.9,4.5")
    add_plan_options(ap)
    ap.add_argument("--quick", action="store_true", help="without checkpoints: two random models (code path only)")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    types = tuple(t.strip() for t in args.types.split(",") if t.strip())
    budgets = [float(b) for b in args.budgets.split(",") if b.strip()]
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        if not (args.branch_point and args.endpoint):
            if not args.quick:
                ap.error("give --branch-point and --endpoint (or --quick)")
            from allocation import random_checkpoint

            args.branch_point = str(random_checkpoint(Path(tmp) / "a"))
            end = Path(tmp) / "b"
            random_checkpoint(end)
            from safetensors.torch import load_file, save_file

            w = load_file(str(end / "model.safetensors"))
            g = torch.Generator().manual_seed(1)
            save_file({k: v + 0.02 * torch.randn(v.shape, generator=g) if v.dim() == 2 else v for k, v in w.items()},
                      str(end / "model.safetensors"))
            args.endpoint, args.tokenizer = str(end), args.tokenizer or "bpe:512"
            args.calib, args.eval = min(args.calib, 8), min(args.eval, 16)
        out = run(args, types, budgets)
    for r in out["budgets"]:
        print(f"budget {r['budget']:g}: endpoint plan KL {r['kl_endpoint_plan']:.4g}, branch-point plan KL "
              f"{r['kl_branch_plan']:.4g}: regret {r['regret_text']} ({100 * r['regret_relative']:+.1f} %), "
              f"{r['types_changed']} of {r['tensors']} tensors typed differently")
    path = write_results("plan_transfer", {"args": vars(args), **out}, args.out)
    record("plan_transfer", out, args)
    print("wrote", path)
    return 0


def run(args, types, budgets) -> dict:
    t0 = time.perf_counter()
    load0 = loadavg()
    calib_b, _ = windows(args.branch_point, args.data, args.tokenizer, args.calib, args.eval)
    calib_e, evals = windows(args.endpoint, args.data, args.tokenizer, args.calib, args.eval)
    cfg = SensitivityConfig(draws=args.draws)
    sens = {"branch": measure_sensitivity(args.branch_point, types, calib_b, cfg=cfg),
            "endpoint": measure_sensitivity(args.endpoint, types, calib_e, cfg=cfg)}
    if args.control:
        calib_c, _ = windows(args.control, args.data, args.tokenizer, args.calib, args.eval)
        sens["control"] = measure_sensitivity(args.control, types, calib_c, cfg=cfg)
    rows = []
    for budget in budgets:
        plans = {k: s.plan(budget)[0] for k, s in sens.items()}
        labels = {k: register_plan(p) for k, p in plans.items()}
        m = measure(args.endpoint, {k: labels[k] for k in plans}, evals, calib_e)
        d = paired_difference(m.metrics["branch"], m.metrics["endpoint"], "kl")
        eff, se, z = format_estimate(d.difference, d.se)
        a, b = plans["branch"].assignment(), plans["endpoint"].assignment()
        row = {"budget": budget, "kl_endpoint_plan": m.metrics["endpoint"]["kl"], "kl_branch_plan": m.metrics["branch"]["kl"],
               "bpw_endpoint_plan": storage_fields(m.quantizations["endpoint"].rows)["bits_per_weight"],
               "bpw_branch_plan": storage_fields(m.quantizations["branch"].rows)["bits_per_weight"],
               "regret": d.difference, "regret_se": d.se, "regret_z": d.z, "paired": d.paired,
               "resolved": verdict_sign(d.difference, d.se) != 0, "regret_text": f"{eff} ± {se} (z {z})",
               "regret_relative": d.difference / m.metrics["endpoint"]["kl"],
               "types_changed": sum(a[n] != b[n] for n in a), "tensors": len(a)}
        if "control" in plans:
            c = paired_difference(m.metrics["control"], m.metrics["endpoint"], "kl")
            row.update(kl_control_plan=m.metrics["control"]["kl"], control_regret=c.difference, control_regret_se=c.se)
        rows.append(row)
    return {"branch_point": args.branch_point, "endpoint": args.endpoint, "control": args.control,
            "types": list(types), "budgets": rows, "seconds": time.perf_counter() - t0,
            "sensitivity_seconds": {k: s.seconds for k, s in sens.items()}, "load_before": load0,
            "load_after": loadavg()}


if __name__ == "__main__":
    sys.exit(main())
