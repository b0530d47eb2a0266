"""The uncertainty of a reported Δ CE: evaluation windows and the quantization run itself.

A PTQ row's ``delta_ce_se`` is the paired standard error over evaluation windows.  It is blind to what
re-quantizing the same checkpoint changes (calibration draw, float order; issue 22), which a row measures
when it repeats the quantization R times (``quant_repeats``): it then stores the mean over the repeats,
``delta_ce_run_sd`` (SD over repeats) and ``delta_ce_total_se``.  The uncertainty of the mean is

    total SE = sqrt(SE_eval² + SD_run² / R)

and every error bar and every "exceeds its uncertainty" statement in the report uses it: a row's
``delta_ce_total_se`` when present, else the same formula from its parts, else (R = 1, older rows) the
evaluation SE alone.  :func:`parts` also says which of the two terms dominates.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

EVAL = "evaluation windows"
RUN = "quantization run"


def _num(v) -> float | None:
    if v is None or isinstance(v, bool):
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else f


def repeats(row: dict) -> int:
    """R, the number of quantizations the row's Δ CE averages (1 when absent)."""
    r = _num(row.get("quant_repeats"))
    return int(r) if r and r >= 1 else 1


@dataclass(frozen=True)
class Uncertainty:
    """The two parts of a Δ CE's uncertainty and their combination."""

    eval_se: float
    """Paired SE over evaluation windows (``delta_ce_se``)."""
    run_sd: float | None
    """SD of Δ CE over the R repeated quantizations (None when R = 1: not measured)."""
    repeats: int
    """R."""
    total_se: float
    """sqrt(eval_se² + run_sd² / R); eval_se when run_sd is None."""

    @property
    def run_se(self) -> float | None:
        """The run-to-run part of the SE of the mean: run_sd / sqrt(R)."""
        return None if self.run_sd is None else self.run_sd / math.sqrt(self.repeats)

    @property
    def dominant(self) -> str:
        """'quantization run' when run_sd/√R exceeds the evaluation SE, else 'evaluation windows'
        (also when the run-to-run spread was not measured)."""
        return RUN if self.run_se is not None and self.run_se > self.eval_se else EVAL


def parts(row: dict, prefix: str = "delta_ce") -> Uncertainty:
    """The uncertainty of ``row[prefix]`` (``delta_ce``, or ``kl`` with its ``kl_se``/``kl_run_sd``).

    A stored ``<prefix>_total_se`` is taken as it is (the writer's own combination); otherwise it is
    computed from the parts.  Missing SEs count as 0."""
    eval_se = _num(row.get(f"{prefix}_se")) or 0.0
    R = repeats(row)
    sd = _num(row.get(f"{prefix}_run_sd")) if R > 1 else None
    stored = _num(row.get(f"{prefix}_total_se"))
    total = stored if stored is not None else math.sqrt(eval_se ** 2 + (sd or 0.0) ** 2 / R)
    return Uncertainty(eval_se, sd, R, total)


def total_se(row: dict, prefix: str = "delta_ce") -> float:
    """The error bar of ``row[prefix]``: the combined uncertainty (see the module docstring)."""
    return parts(row, prefix).total_se


def columns(row: dict) -> dict:
    """The uncertainty columns a figure's table carries for one PTQ row."""
    u = parts(row)
    return {"delta_ce_se": u.eval_se, "delta_ce_run_sd": u.run_sd, "quant_repeats": u.repeats,
            "delta_ce_total_se": u.total_se, "uncertainty_dominant": row.get("uncertainty_dominant") or u.dominant}


def paired_difference(a: dict, b: dict) -> dict:
    """Δ CE_a − Δ CE_b with its uncertainty: the paired SE over the same evaluation windows (from the rows'
    ``window_delta``; without them, the two SEs in quadrature) and the run-to-run terms of both rows
    (SD_a²/R_a + SD_b²/R_b: their quantizations are independent draws).

    Returns difference, difference_eval_se, difference_run_se (None when neither row repeated its
    quantization), difference_se (combined), z = difference / difference_se and dominant."""
    wa, wb = a.get("window_delta"), b.get("window_delta")
    if wa and wb and len(wa) == len(wb) and len(wa) > 1:
        diffs = [x - y for x, y in zip(wa, wb)]
        d = sum(diffs) / len(diffs)
        var = sum((x - d) ** 2 for x in diffs) / (len(diffs) - 1)
        eval_se = math.sqrt(var / len(diffs))
    else:
        d = a["delta_ce"] - b["delta_ce"]
        eval_se = math.hypot(parts(a).eval_se, parts(b).eval_se)
    pa, pb = parts(a), parts(b)
    run_terms = [p.run_se for p in (pa, pb) if p.run_se is not None]
    run_se = math.sqrt(sum(t * t for t in run_terms)) if run_terms else None
    se = math.hypot(eval_se, run_se or 0.0)
    return {"difference": d, "difference_eval_se": eval_se, "difference_run_se": run_se, "difference_se": se,
            "z": d / se if se > 0 else float("nan"),
            "dominant": RUN if run_se is not None and run_se > eval_se else EVAL}


def exceeds(value: float, se: float, z: float = 2.0) -> bool:
    """Whether |value| exceeds ``z`` times its (combined) uncertainty."""
    return se > 0 and abs(value) > z * se


def note(table: list[dict]) -> str:
    """One sentence for a figure's caption: which uncertainty its error bars and z carry and, per quantizer,
    which part dominates.

    Reads the ``quantizer``, ``quant_repeats``, ``delta_ce_run_sd`` and ``uncertainty_dominant`` columns of a
    figure's table (or ``difference_run_se``/``dominant`` of a table of differences); empty when the table has
    no such columns."""
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
    if not repeated:
        return ("Uncertainty: no point repeats its quantization (R = 1), so error bars and z cover only the "
                "evaluation windows (paired SE), not the run-to-run spread of the quantization itself "
                "(calibration draw, float order), which can be larger; a sweep with quant_repeats R > 1 "
                "(--repeats R) measures it.")
    clauses = [f"{', '.join(qs)} {clause}" for clause, qs in repeated.items()]
    clauses += [f"{', '.join(single)}: not repeated (R = 1), evaluation SE only"] if single else []
    return ("Uncertainty: error bars and z use the combined SE = √(SE_eval² + SD_run²/R), evaluation windows and "
            "repeated quantizations; " + "; ".join(clauses) + ".")
