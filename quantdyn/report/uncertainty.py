"""How the report words the uncertainty of a Δ CE: the columns a figure's table carries and the sentence
under it.

The uncertainty itself is computed in one place, :mod:`quantdyn.results.stats` (:class:`Uncertainty`: a row's
paired evaluation SE, its run-to-run SD over R repeated quantizations, and their combination
SE_total = sqrt(SE_eval² + SD_run² / R), which every error bar uses; paired differences, the stable-phase
jitter, the verdict rule).
"""
from __future__ import annotations

from quantdyn.results.stats import RUN, uncertainty


def columns(row: dict) -> dict:
    """The uncertainty columns a figure's table carries for one PTQ row."""
    u = uncertainty(row)
    return {"delta_ce_se": u.eval_se, "delta_ce_run_sd": u.run_sd, "quant_repeats": u.repeats,
            "delta_ce_total_se": u.total_se, "uncertainty_dominant": row.get("uncertainty_dominant") or u.dominant}


def note(table: list[dict]) -> str:
    """One sentence for a figure's caption: which uncertainty its error bars and z carry and, per quantizer,
    which part dominates.

    Reads the ``quantizer``, ``quant_repeats``, ``delta_ce_run_sd`` and ``uncertainty_dominant`` columns of a
    figure's table (or ``difference_run_se``/``dominant``/``stable_jitter`` of a table of differences); empty
    when the table has no such columns."""
    pts = [t for t in table if t.get("uncertainty_dominant") or t.get("dominant")]
    if not pts:
        return ""
    by_q: dict[str, list[dict]] = {}
    for t in pts:
        by_q.setdefault(str(t.get("quantizer") or "all points"), []).append(t)
    repeated: dict[str, list[str]] = {}  # clause -> quantizers it describes
    single = []
    for q, ts in by_q.items():
        rep = [t for t in ts if t.get("delta_ce_run_sd") is not None or t.get("difference_run_se") is not None]
        if not rep:
            single.append(q)
            continue
        rs = sorted({int(t.get("quant_repeats") or 1) for t in rep})
        r_txt = "R = " + "/".join(map(str, rs))
        spread = [t.get("delta_ce_run_sd") if t.get("delta_ce_run_sd") is not None else t.get("difference_run_se")
                  for t in rep]
        if all(v == 0 for v in spread):
            clause = f"({r_txt}): no run-to-run spread (the repeats agree exactly)"
        else:
            n_run = sum(1 for t in rep if (t.get("uncertainty_dominant") or t.get("dominant")) == RUN)
            clause = f"({r_txt}): the run-to-run part is the larger at {n_run} of {len(rep)} points"
        repeated.setdefault(clause, []).append(q)
    jitter = (" Decayed-minus-control differences add the stable-phase jitter in quadrature (one more "
              "independent noise source of a single difference)." if any(t.get("stable_jitter") is not None
                                                                       for t in pts) else "")
    if not repeated:
        return ("Uncertainty: no point repeats its quantization (R = 1), so error bars and z cover only the "
                "evaluation windows (paired SE), not the run-to-run spread of the quantization itself "
                "(calibration draw, float order), which can be larger; a sweep with quant_repeats R > 1 "
                "(--repeats R) measures it." + jitter)
    clauses = [f"{', '.join(qs)} {clause}" for clause, qs in repeated.items()]
    clauses += [f"{', '.join(single)}: not repeated (R = 1), evaluation SE only"] if single else []
    return ("Uncertainty: error bars and z use the combined SE = √(SE_eval² + SD_run²/R), evaluation windows and "
            "repeated quantizations; " + "; ".join(clauses) + "." + jitter)
