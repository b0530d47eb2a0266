"""Issue 41's goals: an allocated plan against llama.cpp's own mixes and uniform GPTQ at equal bits per weight, and
what the sensitivity pass costs against one ordinary measurement.

    .venv/bin/python bench/allocation.py CKPT [CKPT ...] [--types q3_k,q4_k,q5_k,q6_k] [--reps 2] [--quick]

``--types``: the GGUF candidates (default the k-quants; a model whose rows are not multiples of 256, like the
demo's width 128, takes the 32-weight types, e.g. q4_0,q5_0,q5_1,q8_0). A budget the types cannot reach is
recorded as such. Per checkpoint, on one set of windows (``--calib`` calibration windows, which are also the sensitivity windows;
``--eval`` held-out evaluation windows of 128 tokens, never seen by the allocation):

1. the baselines Q4_K_M, Q3_K_M and gptq4 (GPTQ 4-bit, group 128) are measured in one pass with the bf16 noise
   floor; each one's *measured* bits per weight (the rows' bits_per_weight: its tensors' storage with scales,
   the head in full precision as for every quantizer here) is a budget;
2. the sensitivity pass (engine/sensitivity.py, ``--draws`` label draws) runs once for the GGUF types and once
   for the integer types ``gptq3..gptq6`` (group 128); the allocator makes a plan under each budget;
3. every plan is measured on the same evaluation windows, its KL mean set against the baseline's paired window
   by window (results/stats.py paired_difference on window_kl): resolved when |z| > 2, and each KL is reported
   beside the bf16 noise floor's (the KL that merely storing the model in bf16 costs);
4. cost: the sensitivity pass for the 4 GGUF types against one ordinary measurement of the checkpoint (measure
   with one quantizer, q4_k_m, and the noise floor, as a sweep measures it), interleaved ``--reps`` times in
   the same process, best of each; load average and CPU recorded (the machine is shared).

Goals (issue 41, item 5): plan KL < Q4_K_M's, Q3_K_M's and gptq4's at equal bpw (± 0.05), resolved; the pass for
4 types <= 3x one ordinary measurement. The figures are whatever the run measured.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import record, write_results  # noqa: E402

from quantdyn.data.prepare import DataConfig, prepare_data  # noqa: E402
from quantdyn.engine.measure import measure  # noqa: E402
from quantdyn.engine.rows import storage_fields  # noqa: E402
from quantdyn.engine.sensitivity import SensitivityConfig, measure_sensitivity  # noqa: E402
from quantdyn.errors import QuantdynError  # noqa: E402
from quantdyn.quantize.plan import register_plan  # noqa: E402
from quantdyn.results.stats import format_estimate, paired_difference, verdict_sign  # noqa: E402
from quantdyn.sources.hub import open_checkpoint  # noqa: E402

BASELINES = ("q4_k_m", "q3_k_m", "gptq4")
INT_TYPES = ("gptq3", "gptq4", "gptq5", "gptq6")


def random_checkpoint(path: Path) -> Path:
    """2 blocks of width 256 (every k-quant fits), vocabulary 512, weights N(0, 0.06): a stand-in for make bench."""
    from quantdyn.models.gpt import GPT, ModelConfig, resolve_model_config
    from quantdyn.models.hf_io import save_hf

    torch.manual_seed(0)
    model = GPT(resolve_model_config(ModelConfig(n_layer=2, d_model=256, n_head=4, max_seq_len=256, vocab_size=512)))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.06)
    return save_hf(model, path)


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def windows(ckpt: str, data_source: str, tokenizer: str | None, n_calib: int, n_eval: int):
    weights = open_checkpoint(ckpt)
    tok = tokenizer or str(weights.path)
    data = prepare_data(DataConfig(source=data_source, tokenizer=tok), progress=False)
    return data.calib_windows(n_calib, 128, 0), data.eval_windows(128, n_eval)


def bpw_of(m, label: str) -> float:
    return storage_fields(m.quantizations[label].rows)["bits_per_weight"]


def compare(plan_metrics: dict, base_metrics: dict) -> dict:
    d = paired_difference(plan_metrics, base_metrics, "kl")
    eff, se, z = format_estimate(d.difference, d.se)
    return {"difference": d.difference, "se": d.se, "z": d.z, "paired": d.paired,
            "resolved": verdict_sign(d.difference, d.se) != 0, "text": f"{eff} ± {se} (z {z})"}


def run_checkpoint(ckpt: str, args) -> dict:
    calib, evals = windows(ckpt, args.data, args.tokenizer, args.calib, args.eval)
    t0 = time.perf_counter()
    base = measure(ckpt, list(BASELINES), evals, calib, noise_floor=True)
    floor = base.noise_floor
    out: dict = {"checkpoint": ckpt, "load_before": loadavg(), "floor_kl": floor["kl"], "floor_kl_se": floor["kl_se"],
                 "baselines": {}, "plans": {}}
    for b in BASELINES:
        out["baselines"][b] = {"kl": base.metrics[b]["kl"], "kl_se": base.metrics[b]["kl_se"],
                               "bits_per_weight": bpw_of(base, b), "delta_ce": base.metrics[b]["delta_ce"]}
    cfg = SensitivityConfig(draws=args.draws)
    sens = {"gguf": measure_sensitivity(ckpt, args.types, calib, cfg=cfg)}
    if not args.quick:
        sens["int"] = measure_sensitivity(ckpt, INT_TYPES, calib, cfg=cfg)
    out["sensitivity_seconds"] = {k: s.seconds for k, s in sens.items()}
    out["rank_correlations"] = {k: s.rank_correlations() for k, s in sens.items()}
    for b in BASELINES:
        budget = out["baselines"][b]["bits_per_weight"]
        for kind, s in sens.items():
            try:
                plan, alloc = s.plan(budget)
            except QuantdynError as e:  # a budget the types cannot reach: recorded, not compared
                out["plans"][f"{b}/{kind}"] = {"types": list(s.types), "budget": budget, "skipped": str(e)}
                continue
            label = register_plan(plan)
            m = measure(ckpt, {"plan": label}, evals, calib)
            pm = m.metrics["plan"]
            bpw = bpw_of(m, "plan")
            entry = {"types": list(s.types), "budget": budget, "bits_per_weight": bpw,
                     "equal_bpw": abs(bpw - budget) <= 0.05, "kl": pm["kl"], "kl_se": pm["kl_se"],
                     "delta_ce": pm["delta_ce"], "predicted_kl": alloc.error,
                     "counts": {t: sum(e.type == t for e in plan.tensors) for t in s.types},
                     "vs_baseline": compare(pm, base.metrics[b]),
                     "above_floor": pm["kl"] - 2 * pm["kl_se"] > floor["kl"] + 2 * floor["kl_se"]}
            out["plans"][f"{b}/{kind}"] = entry
    out["seconds"] = time.perf_counter() - t0
    out["cost"] = cost(ckpt, args, calib, evals)
    out["load_after"] = loadavg()
    return out


def cost(ckpt: str, args, calib, evals) -> dict:
    """Sensitivity pass (the GGUF types) against one ordinary measurement, interleaved, best of --reps."""
    sens_w, meas_w, sens_c, meas_c = [], [], [], []
    for r in range(args.reps):
        order = ("sens", "meas") if r % 2 == 0 else ("meas", "sens")
        for what in order:
            w0, c0 = time.perf_counter(), time.process_time()
            if what == "sens":
                measure_sensitivity(ckpt, args.types, calib, cfg=SensitivityConfig(draws=args.draws))
                sens_w.append(time.perf_counter() - w0)
                sens_c.append(time.process_time() - c0)
            else:
                measure(ckpt, ["q4_k_m"], evals, calib, noise_floor=True)
                meas_w.append(time.perf_counter() - w0)
                meas_c.append(time.process_time() - c0)
    return {"sensitivity_wall": min(sens_w), "measure_wall": min(meas_w), "ratio_wall": min(sens_w) / min(meas_w),
            "sensitivity_cpu": min(sens_c), "measure_cpu": min(meas_c), "ratio_cpu": min(sens_c) / min(meas_c),
            "reps": args.reps, "goal": 3.0}


def add_plan_options(ap: argparse.ArgumentParser) -> None:
    """The candidate types, data, window counts and Fisher draws of a plan (shared with bench/plan_transfer.py, so
    the two benchmarks measure the same plans by default)."""
    ap.add_argument("--types", default="q3_k,q4_k,q5_k,q6_k")
    ap.add_argument("--data", default="builtin:kjv")
    ap.add_argument("--tokenizer", default=None, help="default: the checkpoint's own")
    ap.add_argument("--calib", type=int, default=32)
    ap.add_argument("--eval", type=int, default=200)
    ap.add_argument("--draws", type=int, default=2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkpoints", nargs="*", help="default: a random-weight 2 x 256 GPT-NeoX written here (only "
                    "exercises the code: its numbers mean nothing)")
    add_plan_options(ap)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="GGUF plans only, 1 cost repetition")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    args.types = tuple(t.strip() for t in args.types.split(",") if t.strip())
    if args.quick:
        args.reps = 1
    torch.set_num_threads(1)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        if not args.checkpoints:
            args.checkpoints = [str(random_checkpoint(Path(tmp) / "random"))]
            args.tokenizer = args.tokenizer or "bpe:512"
            args.calib, args.eval = min(args.calib, 8), min(args.eval, 16)
        results = [run_checkpoint(c, args) for c in args.checkpoints]
    for r in results:
        print(f"{r['checkpoint']}: bf16 floor KL {r['floor_kl']:.3g} ± {r['floor_kl_se']:.2g}")
        for b, v in r["baselines"].items():
            print(f"  {b:<8} {v['bits_per_weight']:.4f} bpw  KL {v['kl']:.4g} ± {v['kl_se']:.2g}")
        for k, v in r["plans"].items():
            if "skipped" in v:
                print(f"  plan@{k:<13} not made: {v['skipped']}")
                continue
            print(f"  plan@{k:<13} {v['bits_per_weight']:.4f} bpw (equal: {v['equal_bpw']})  KL {v['kl']:.4g} ± "
                  f"{v['kl_se']:.2g}  plan - baseline {v['vs_baseline']['text']}")
        c = r["cost"]
        print(f"  cost: sensitivity {c['sensitivity_wall']:.1f}s vs measurement {c['measure_wall']:.1f}s = "
              f"{c['ratio_wall']:.2f}x wall ({c['ratio_cpu']:.2f}x CPU); load {r['load_before']} -> {r['load_after']}")
    path = write_results("allocation", {"args": {k: v for k, v in vars(args).items()}, "results": results}, args.out)
    record("allocation", {"results": json.loads(json.dumps(results, default=str))}, args)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
