"""`quantdyn scaling`: per-optimizer scaling laws for full-precision and QAT
runs (paper B), fitted from the results store.

Points: by default each run's final main-branch checkpoint (paper B trains
each size to its Chinchilla-optimal token count, so one point per run);
``all_checkpoints`` uses every checkpoint. N = non-embedding parameters,
D = tokens, loss = held-out CE: the FP model's for full-precision runs and
the deployed (W+A fake-quantized) model's for QAT runs. The FP law
L = A·N^-α + B·D^-β + E is fitted first, then only ρ on the QAT points:
ρ < 1 is the optimizer's parameter efficiency under quantization.
"""
from __future__ import annotations

import hashlib
import json

from quantdyn.analysis.scaling import ScalingFitConfig, fit_by_optimizer
from quantdyn.errors import QuantdynError
from quantdyn.results.schema import FP, QAT, SCALING
from quantdyn.results.store import ResultStore
from quantdyn.runtime import provenance

BY_ALIASES = {"optim.name": "optimizer", "optim.weight_decay": "weight_decay", "optimizer": "optimizer"}


def scaling_points(rows: list[dict], by: str = "optim.name", all_checkpoints: bool = False) -> list[dict]:
    col = BY_ALIASES.get(by, by)
    fp = {}
    qat = {}
    for r in rows:
        if r.get("branch") != "main" or r.get("n_params") is None or r.get("tokens") is None:
            continue
        if FP.matches(r) and not r.get("qat"):
            fp.setdefault(r["run"], []).append(r)
        elif QAT.matches(r):
            qat.setdefault(r["run"], []).append(r)
    pts = []
    for runs, precision, loss_key in ((fp, "fp", "ce_fp"), (qat, "qat", "ce_q")):
        for run, rs in runs.items():
            rs = sorted(rs, key=lambda r: r["tokens"])
            for r in rs if all_checkpoints else rs[-1:]:
                if col not in r:
                    raise QuantdynError(f"rows have no column '{by}'; use --by optim.name or a row column")
                pts.append({"optimizer": str(r[col]), "precision": precision, "N": r["n_params"], "D": r["tokens"],
                            "loss": r[loss_key], "run": run})
    return pts


def fit_scaling(store: str, by: str = "optim.name", all_checkpoints: bool = False, bootstrap: int = 200,
                write: bool = True) -> list[dict]:
    st = ResultStore(store, create=False)
    pts = scaling_points(st.rows(), by, all_checkpoints)
    if not pts:
        raise QuantdynError(f"no swept runs with parameter counts in '{store}'; sweep the runs of a grid first")
    groups = {}
    for p in pts:
        groups.setdefault(p["optimizer"], {"fp": 0, "qat": 0})[p["precision"]] += 1
    few = [g for g, c in groups.items() if c["fp"] < 5]
    if few:
        raise QuantdynError(
            f"{by}={few[0]} has {groups[few[0]]['fp']} full-precision points; a 5-parameter law needs at least 5 "
            "(more model sizes or token budgets per group, or --all-checkpoints)"
        )
    fits = fit_by_optimizer(pts, ScalingFitConfig(bootstrap=bootstrap))
    out = []
    for g, f in fits.items():
        for precision, fit in (("fp", f.fp), ("qat", f.qat)):
            if fit is None:
                continue
            d = fit.as_dict()
            key = hashlib.sha256(json.dumps([g, precision, sorted((p["N"], p["D"], p["loss"]) for p in pts
                                                                  if p["optimizer"] == g)]).encode()).hexdigest()[:24]
            out.append({"key": key, "kind": SCALING.name, "by": by, "group": g, "precision": precision,
                        **{k: v for k, v in d.items() if k != "intervals"},
                        **{f"{k}_lo": v[0] for k, v in d["intervals"].items()},
                        **{f"{k}_hi": v[1] for k, v in d["intervals"].items()},
                        "points": [p for p in pts if p["optimizer"] == g and p["precision"] == precision],
                        **provenance()})
    if write:
        done = st.keys()
        st.append([r for r in out if r["key"] not in done])
    return out
