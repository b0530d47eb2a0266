"""What the screen of `quantdyn ship` saves: the whole ship (every candidate x quantization on the first quarter of
the windows, the survivors on the rest) against the reference, every candidate x quantization measured on every
window, in one process on the same run (issue 46, item 3; target: ship <= 0.5 x the reference).

    .venv/bin/python bench/ship_cost.py --run runs/demo --budget 4.5                  # ship's defaults, the demo's run
    .venv/bin/python bench/ship_cost.py --run runs/demo --budget 4.5 --quantizers q4_0,gptq4 --last 1  # the demo's
    .venv/bin/python bench/ship_cost.py --quick          # the demo at its smoke size, trained here: the code path

Both are `ship()` itself, each into a fresh store and output directory (so nothing is reused between them): the
reference with ``screen_windows`` = every window, i.e. no screen. An untimed warm-up (one candidate on 16 windows)
runs before both, so that the one-off imports (transformers for the tokenizer, the export writers) fall on
neither; ship runs first, so it pays any warm-up left (the page cache of the checkpoints). Wall (perf_counter) and CPU time (process_time: every
thread of this process) of each; whether the decisions agree (the option shipped, the tied set, the gain over the
naive choice); and, from the reference (every option on every window), the paired comparisons that paper A's
finding (c) becomes for a user at this budget: each constant-LR control against its decayed endpoint at equal
tokens, LAWA and the soup against the main run's final checkpoint (the run's own decayed endpoint), per
quantization, CE(q) and Δ CE (the quantization error) differences with their paired SE and z.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import record, write_results  # noqa: E402

from quantdyn.results.schema import SHIP  # noqa: E402
from quantdyn.results.stats import format_estimate  # noqa: E402
from quantdyn.results.store import ResultStore  # noqa: E402
from quantdyn.ship.candidates import CandidateSpec  # noqa: E402
from quantdyn.ship.decide import Option, paired  # noqa: E402
from quantdyn.ship.ship import ShipConfig, ship  # noqa: E402


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def timed(cfg: ShipConfig) -> tuple[dict, dict]:
    """ship(cfg) with its wall and CPU seconds; returns (ship.json, timing)."""
    load0, w0, c0 = loadavg(), time.perf_counter(), time.process_time()
    res = ship(cfg, echo=lambda line: None, progress=False)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    return res.report, {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "rows": res.measured,
                        "load_before": load0, "load_after": loadavg()}


def decision_of(s: dict) -> dict:
    return {"chosen": [s["artifact"]["name"], s["quantizer"]],
            "tied": sorted([t["candidate"], t["quantizer"]] for t in s["tied"]),
            "naive": [s["naive"]["artifact"], s["naive"]["quantizer"]] if s.get("naive") else None,
            "gain": s["gain"], "gain_se": s["gain_se"], "gain_resolved": s["gain_resolved"],
            "options_full": len(s["options"]), "dropped": len(s["dropped"])}


def options_of(store: Path) -> dict[tuple[str, str], dict]:
    """Every (candidate, quantization) of a store's ship rows: per-window CE(q) and FP CE, windows in order."""
    parts: dict[tuple[str, str], list[dict]] = {}
    for r in ResultStore(store).rows():
        if SHIP.matches(r):
            parts.setdefault((r["ship_candidate"], r["ship_quantization"]), []).append(r)
    out = {}
    for k, rs in parts.items():
        rs.sort(key=lambda r: r["ship_windows"][0])
        q = np.concatenate([np.asarray(r["window_ce_q"], dtype=np.float64) for r in rs])
        fp = q - np.concatenate([np.asarray(r["window_delta"], dtype=np.float64) for r in rs])
        out[k] = {"ce_q": q, "ce_fp": fp, "recipe": rs[0]["ship_recipe"], "bpw": rs[0].get("bits_per_weight") or 0.0}
    return out


def _diff(a: np.ndarray, b: np.ndarray) -> dict:
    d = paired(Option("a", "q", 0.0, a), Option("b", "q", 0.0, b))
    e, se, z = format_estimate(d.difference, d.se)
    return {"difference": d.difference, "se": d.se, "z": d.difference / d.se if d.se > 0 else None,
            "text": f"{e} ± {se} (z {z})"}


def comparisons(store: Path, candidates: list[dict]) -> list[dict]:
    """Paper A's (c) as the decision at this budget, from the reference's full measurement: for each quantization,
    each control minus its decayed endpoint (same branch point, same tokens), LAWA and the soup minus the main run's
    final checkpoint; positive = the alternative quantizes to a worse CE (the decayed endpoint is the better
    deployment). Δ CE: the same for the quantization error alone (CE(q) − CE(FP))."""
    opts = options_of(store)
    by = {c["name"]: c for c in candidates}
    main = max((c for c in candidates if c["how"] == "checkpoint"), key=lambda c: c["step"] or 0)["name"]
    pairs = []
    for c in candidates:
        if c["how"] == "control":
            twin = next((d["name"] for d in candidates if d["how"] == "cooldown" and d["step"] == c["step"]
                         and d["branch"].startswith(c["branch"].replace("control-", "cooldown-"))), None)
            if twin:
                pairs.append((c["name"], twin, "constant-LR control minus its decayed endpoint (equal tokens)"))
        elif c["how"] in ("lawa", "soup", "ema"):
            pairs.append((c["name"], main, f"{c['how']} minus the main run's final checkpoint"))
    out = []
    for quant in sorted({q for _, q in opts}):
        for alt, ref, what in pairs:
            a, b = opts.get((alt, quant)), opts.get((ref, quant))
            if a is None or b is None or alt not in by:
                continue
            dq = _diff(a["ce_q"], b["ce_q"])
            dd = _diff(a["ce_q"] - a["ce_fp"], b["ce_q"] - b["ce_fp"])
            out.append({"quantizer": quant, "alternative": alt, "reference": ref, "what": what,
                        "ce_q": dq, "delta_ce": dd, "ce_fp_difference": float(np.mean(a["ce_fp"] - b["ce_fp"]))})
    return out


def quick_run(root: Path) -> Path:
    """The demo at its smoke size (scale cpu-tiny: 2 x 64, 30 steps, two cooldowns with controls), trained here."""
    from quantdyn.studies.pipeline import plan_runs, run_dir_of
    from quantdyn.studies.spec import demo_spec
    from quantdyn.train.branches import cooldown
    from quantdyn.train.trainer import train

    spec = demo_spec(["scale=cpu-tiny", f"run.out_dir={root}", "run.train.eval_every=0"])
    cfg = plan_runs(spec)[0]
    run = run_dir_of(cfg)
    train(cfg, run, progress=False)
    for s in spec.cooldowns.from_steps:
        cooldown(run, s, [spec.cooldowns.decay_of(s)], spec.cooldowns.shape, True, progress=False)
    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", default="", help="a quantdyn run directory (make demo's: runs/demo)")
    ap.add_argument("--budget", type=float, default=4.5)
    ap.add_argument("--quantizers", default="", help="uniform types (default: ship's, those that fit)")
    ap.add_argument("--last", type=int, default=2, help="ship --last")
    ap.add_argument("--no-auto", action="store_true", help="leave auto@BUDGET out")
    ap.add_argument("--eval-tokens", type=int, default=25600, help="ship --eval-tokens (25600: the demo's 200 windows)")
    ap.add_argument("--seq", type=int, default=128, help="evaluation and calibration sequence length")
    ap.add_argument("--calib", type=int, default=32, help="calibration sequences")
    ap.add_argument("--quick", action="store_true", help="a tiny run trained here (the code path, not the figure)")
    ap.add_argument("--keep", default="", help="keep both stores and ship directories here (default: a temp dir)")
    ap.add_argument("--out", default="", help="results file (default bench/results/ship_cost-<machine>-<date>.json)")
    args = ap.parse_args(argv)
    if not args.run and not args.quick:
        ap.error("give --run (a quantdyn run directory, e.g. make demo's runs/demo) or --quick")
    tmp = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="ship_cost-"))
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        if args.quick:
            args.run = str(quick_run(tmp / "runs"))
            args.eval_tokens, args.seq, args.calib = min(args.eval_tokens, 64 * 64), 64, min(args.calib, 8)
            args.quantizers, args.last = args.quantizers or "q4_0,gptq4", 1  # the demo's own choice of options
        base = dict(source=(args.run,), budget=args.budget, auto=not args.no_auto,
                    quantizers=tuple(q for q in args.quantizers.split(",") if q),
                    candidates=CandidateSpec(last=args.last), eval_tokens=args.eval_tokens, eval_seq_len=args.seq,
                    calib_samples=args.calib, calib_seq_len=args.seq)
        windows = args.eval_tokens // args.seq
        # untimed warm-up, so that neither side pays the one-off imports (the tokenizer's transformers, the export
        # writers: ~1.6 s, which the first of the two would otherwise carry alone): one candidate on 16 windows
        ship(ShipConfig(**{**base, "candidates": CandidateSpec(last=1, lawa=0, soup=False),
                           "eval_tokens": 16 * args.seq}, out=str(tmp / "warm-up"), store=str(tmp / "store-warm-up")),
             echo=lambda line: None, progress=False)
        shipped, t_ship = timed(ShipConfig(**base, out=str(tmp / "ship"), store=str(tmp / "store-ship")))
        ref, t_ref = timed(ShipConfig(**base, out=str(tmp / "reference"), store=str(tmp / "store-reference"),
                                      screen_windows=windows))
        a, b = decision_of(shipped), decision_of(ref)
        agree = a["chosen"] == b["chosen"] and a["tied"] == b["tied"]
        found = comparisons(tmp / "store-reference", ref["candidates"])
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    n_opts = len(ref["options"]) + len(ref["dropped"])
    out = {"run": args.run, "budget": args.budget, "quantizations": [q["name"] for q in ref["quantizations"]],
           "candidates": [c["name"] for c in ref["candidates"]], "options": n_opts, "windows": windows,
           "screen_windows": shipped["screen"]["screen_windows"], "ship": t_ship, "reference": t_ref,
           "wall_ratio": t_ship["wall_s"] / t_ref["wall_s"], "cpu_ratio": t_ship["cpu_s"] / t_ref["cpu_s"],
           "decision_ship": a, "decision_reference": b, "decisions_agree": agree, "finding_c": found,
           "quick": args.quick}
    print(f"ship_cost: {n_opts} options ({len(out['candidates'])} candidates x {len(out['quantizations'])} "
          f"quantizations) at {args.budget:g} bpw, {windows} windows of {args.seq} tokens")
    print(f"  ship (screen on {out['screen_windows']} windows, {a['options_full']} measured in full): "
          f"{t_ship['wall_s']:.1f} s wall, {t_ship['cpu_s']:.1f} s CPU")
    print(f"  reference (every option on every window): {t_ref['wall_s']:.1f} s wall, {t_ref['cpu_s']:.1f} s CPU")
    print(f"  ratio ship / reference: wall {out['wall_ratio']:.2f}, CPU {out['cpu_ratio']:.2f} (target <= 0.5)")
    print(f"  decision: ship {' x '.join(a['chosen'])}, reference {' x '.join(b['chosen'])}; tied sets "
          f"{'equal' if a['tied'] == b['tied'] else 'differ'}: {'agree' if agree else 'DIFFER'}")
    for d, name in ((a, "ship"), (b, "reference")):
        if d["gain_se"]:
            e, s, z = format_estimate(d["gain"], d["gain_se"])
            print(f"  gain over the naive choice ({name}): {e} ± {s} nats (z {z}), "
                  f"{'resolved' if d['gain_resolved'] else 'not resolved'}")
    for f in found:
        print(f"  {f['quantizer']}: {f['alternative']} − {f['reference']}: CE(q) {f['ce_q']['text']}; "
              f"Δ CE {f['delta_ce']['text']}; FP {f['ce_fp_difference']:+.4f}")
    path = write_results("ship_cost", {"args": vars(args), **out}, args.out, suffix="quick" if args.quick else "")
    record("ship_cost", {k: v for k, v in out.items() if k != "finding_c"}, args)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
