"""decayed - control Δ CE per quantizer, paired over windows, from a store's rows."""
import json, math, sys
from quantdyn.results.store import ResultStore
rows = [r for r in ResultStore(sys.argv[1]).rows() if r.get("kind") == "ptq"]
by = {}
for r in rows:
    which = "decayed" if "cooldown" in str(r.get("checkpoint")) or "cooldown" in str(r.get("branch")) else "control"
    by[(r["quantizer"], which, r.get("step"))] = r
for (q, w, step), r in sorted(by.items()):
    if w != "decayed":
        continue
    c = by.get((q, "control", step))
    if c is None:
        continue
    d = [a - b for a, b in zip(r["window_delta"], c["window_delta"])]
    m = sum(d) / len(d); sd = math.sqrt(sum((x - m) ** 2 for x in d) / (len(d) - 1))
    print(f"{q:6} step {step}: decayed {r['delta_ce']:+.5f} control {c['delta_ce']:+.5f} diff {r['delta_ce'] - c['delta_ce']:+.5f} "
          f"(paired mean {m:+.5f} ± {sd / math.sqrt(len(d)):.5f})  ce_fp {r['ce_fp']:.4f} / {c['ce_fp']:.4f}")
