"""The interventions league (issue 48.4): from one stable-phase checkpoint per seed, each intervention's
branch (a cooldown with SAM or QAT in a format, a no-decay branch with an average) against the standard linear
decay from the same checkpoint over the same steps, measured on what a deployer gets: the quantized model's CE.

Per run (seed), quantizer and intervention branch B: CE(q) of B's endpoint minus CE(q) of the standard endpoint S
(``runs.standard_of``: the same start, length and shape without the intervention; for a no-decay branch the linear
cooldown of its start and length), at equal tokens, paired over the evaluation windows (results/stats.py
paired_difference with the FP window CE), then the seeds combined and the one verdict rule applied (``combine``,
``finding_row``: |effect| > z x uncertainty, else not resolved). The claim tested is that the intervention
lowers the quantized CE (expected sign −). Beside it: the FP CE difference (paired the same way where the rows
carry the windows) and the cost of one step of B relative to S (forward/backward passes; QAT's fake
quantization per step), read from B's name, which carries every intervention (runs.intervention_tag). A QAT
branch's own format is marked (``deployed_format``): that row is the artifact it was trained for.

Bad input: intervention branches of one run that start from different checkpoints (a league compares branches
from one checkpoint per seed) are one line naming them.

The warmdown grid (issue 48.3, :func:`warmdown_findings`) is the same comparison between whole runs: each warmdown
length x shape of a grid's runs against the 20 % linear warmdown of the same seed, at their final checkpoints.
"""
from __future__ import annotations

import math
import re
import statistics
from typing import Mapping, Sequence

import numpy as np

from quantdyn.errors import QuantdynError
from quantdyn.launch.grid import grid_values
from quantdyn.results.schema import FP, PTQ, number
from quantdyn.results.stats import Difference, combine, mean_se, paired_difference
from quantdyn.runs import cooldown_branch, is_intervention, is_nodecay, parse_branch, standard_of
from quantdyn.studies.findings import family_of, finding_row, quantizers_of

CLAIM = "Interventions: the quantized CE against the standard linear decay"
FIGURE = "findings_interventions.png"


def league_branches(rows: Sequence[Mapping]) -> list[tuple[str, str]]:
    """(run, intervention branch) of every SAM/QAT cooldown and no-decay branch the PTQ rows hold."""
    return sorted({(r.get("run"), r.get("branch")) for r in rows if PTQ.matches(r)
                   and (is_intervention(r.get("branch")) or is_nodecay(r.get("branch")))})


def baseline_of(branch: str) -> str | None:
    """The standard endpoint an intervention branch is compared with (None for any other branch)."""
    if is_nodecay(branch):
        b = parse_branch(branch)
        return cooldown_branch(b.from_step, b.decay_steps, "linear")
    return standard_of(branch)


def step_cost(branch: str) -> dict:
    """What one step of the branch costs beside the standard cooldown's, from its name: forward/backward passes
    (SAM: 2) and the format fake-quantized once per pass (QAT)."""
    b = parse_branch(branch)
    tag = b.intervention or ""
    sam = tag.startswith(("sam", "asam"))
    fmt = tag.partition("qat-")[2] or None
    return {"forward_backward_per_step": 2 if sam else 1, "fake_quant": fmt,
            "fake_quant_per_step": (2 if sam else 1) if fmt else 0, "average": b.average}


def _last(rows: list[Mapping]) -> Mapping | None:
    return max(rows, key=lambda r: (r.get("tokens") or 0, r.get("step") or 0)) if rows else None


def _fp_difference(a: Mapping, b: Mapping, fp_windows: Mapping[str, Sequence[float]] | None) -> Difference:
    """FP CE of a minus b: paired over the windows when both checkpoints' FP window CE is known, else the FP
    rows' SEs in quadrature."""
    wa = (fp_windows or {}).get(str(a.get("checkpoint")))
    wb = (fp_windows or {}).get(str(b.get("checkpoint")))
    d = float(a["ce_fp"]) - float(b["ce_fp"])
    if wa is not None and wb is not None and len(wa) == len(wb) > 1:
        return Difference(d, mean_se(np.asarray(wa, float) - np.asarray(wb, float))[1], paired=True)
    return Difference(d, math.hypot(number(a.get("ce_fp_se")) or 0.0, number(b.get("ce_fp_se")) or 0.0))


def check_one_branch_point(rows: Sequence[Mapping], pairs: Sequence[tuple[str, str]]) -> None:
    """Every intervention branch of a run starts from one checkpoint (one line naming two that do not)."""
    starts: dict[str, dict[int, str]] = {}
    for run, b in pairs:
        starts.setdefault(run, {}).setdefault(parse_branch(b).from_step, b)
    for run, by_step in starts.items():
        if len(by_step) > 1:
            (s1, b1), (s2, b2) = sorted(by_step.items())[:2]
            raise QuantdynError(f"the interventions league of run '{run}' has branches from two checkpoints ({b1} "
                                f"from step {s1}, {b2} from step {s2}); a league compares branches from one "
                                "stable-phase checkpoint per seed: sweep them into separate stores")


def league_findings(rows: list[dict], runs: Sequence[str], quantizers: Sequence[str] = (), z: float = 2.0,
                    fp_windows: Mapping[str, Sequence[float]] | None = None) -> tuple[list[dict], dict]:
    """(finding rows, {"interventions": detail table}): the module docstring's comparison, per quantizer, sorted
    by the deployed quantity (the combined CE(q) difference, best first)."""
    pairs = [(run, b) for run, b in league_branches(rows) if run in set(runs)]
    check_one_branch_point(rows, pairs)
    qs = quantizers_of(rows, quantizers)
    fp_rows = {(r.get("run"), r.get("branch"), r.get("step")): r for r in rows if FP.matches(r)}
    detail: list[dict] = []
    groups: dict[tuple, dict] = {}
    for run, b in pairs:
        base = baseline_of(b)
        for q in qs:
            end = _last([r for r in rows if PTQ.matches(r) and r.get("run") == run and r.get("branch") == b
                         and r.get("quantizer") == q])
            ref = _last([r for r in rows if PTQ.matches(r) and r.get("run") == run and r.get("branch") == base
                         and r.get("quantizer") == q])
            if end is None or ref is None or end.get("tokens") != ref.get("tokens"):
                continue
            dq = paired_difference(end, ref, "ce_q", fp_windows)
            fe = fp_rows.get((run, b, end.get("step"))) or end
            fr = fp_rows.get((run, base, ref.get("step"))) or ref
            dfp = _fp_difference(fe, fr, fp_windows)
            dd = paired_difference(end, ref, "delta_ce")  # the quantization error alone, paired over windows
            cost = step_cost(b)
            detail.append({"run": run, "quantizer": q, "branch": b, "baseline": base, "tokens": end.get("tokens"),
                           "ce_q": end["ce_q"], "ce_q_baseline": ref["ce_q"], "d_ce_q": dq.difference,
                           "d_ce_q_se": dq.se, "paired": dq.paired, "ce_fp": end.get("ce_fp"),
                           "ce_fp_baseline": ref.get("ce_fp"), "d_ce_fp": dfp.difference, "d_ce_fp_se": dfp.se,
                           "d_delta_ce": dd.difference, "d_delta_ce_se": dd.se, **cost})
            g = groups.setdefault((family_of(run), q, b, base),
                                  {"q": [], "fp": [], "dd": [], "ref": [], "fpref": [], "cost": cost})
            g["q"].append(dq)
            g["fp"].append(dfp)
            g["dd"].append(dd)
            g["ref"].append(float(ref["ce_q"]))
            g["fpref"].append(float(ref.get("ce_fp") or math.nan))
    out = []
    for (fam, q, b, base), g in groups.items():
        eff, fp, dd = combine(g["q"]), combine(g["fp"]), combine(g["dd"])
        cost = g["cost"]
        out.append(finding_row(
            CLAIM, "interventions", q, f"{fam}: {b} − {base} (equal tokens)", "CE(quantized)", eff, -1, z, FIGURE,
            seed_family=fam, branch=b, intervention=parse_branch(b).intervention or f"nodecay {parse_branch(b).average}",
            baseline_branch=base, deployed_format=cost["fake_quant"] == q, d_ce_fp=fp.effect, d_ce_fp_se=fp.se,
            d_delta_ce=dd.effect, d_delta_ce_se=dd.se,
            ce_q_baseline=statistics.fmean(g["ref"]), ce_fp_baseline=statistics.fmean(g["fpref"]),
            baseline=statistics.fmean(g["ref"]), baseline_of="the standard endpoint's CE(quantized)", **cost))
    out.sort(key=lambda f: (qs.index(f["quantizer"]), f["effect"]))
    return out, {"interventions": detail}


# ------------------------------------------------------------------ the warmdown grid (issue 48.3)
WARMDOWN_KEYS = ("schedule.decay", "schedule.decay_shape")
"""The grid axes of a warmdown study: its length (a fraction of the run, or steps) and its shape."""
WARMDOWN_BASELINE = {"schedule.decay": 0.2, "schedule.decay_shape": "linear"}
"""What every warmdown is compared with: paper A's WSD, a 20 % linear decay (the house default)."""
WARMDOWN_CLAIM = "Warmdown length and shape: the quantized CE against a 20 % linear warmdown"
WARMDOWN_FIGURE = "findings.png"


def warmdown_points(runs: Sequence[str]) -> tuple[tuple[str, ...], dict[str, tuple]]:
    """(the warmdown keys the run names vary, {run: its values}) for the runs a grid named with them
    (launch/grid.py names: ``wd-decay0.33-shape1-sqrt-s0``); ({}, ...) when none."""
    for keys in (WARMDOWN_KEYS, WARMDOWN_KEYS[:1], WARMDOWN_KEYS[1:]):
        got = {r: grid_values(r, keys) for r in runs}
        got = {r: tuple(v[k] for k in keys) for r, v in got.items() if v is not None}
        if len({v for v in got.values()}) >= 2:
            return keys, got
    return (), {}


def _is_baseline(keys: Sequence[str], values: Sequence[str]) -> bool:
    for k, v in zip(keys, values):
        want = WARMDOWN_BASELINE[k]
        try:
            same = float(v) == want if isinstance(want, float) else v == want
        except ValueError:
            same = False
        if not same:
            return False
    return True


def warmdown_findings(rows: list[dict], runs: Sequence[str], quantizers: Sequence[str] = (), z: float = 2.0,
                      fp_windows: Mapping[str, Sequence[float]] | None = None) -> tuple[list[dict], dict]:
    """Per quantizer and warmdown (length x shape) of a grid: the final checkpoint's CE(quantized) minus that of
    the 20 % linear warmdown of the same seed (equal tokens: the runs have the same steps), paired over windows,
    seeds combined, the verdict rule (claim: it lowers the quantized CE); FP CE beside it."""
    keys, points = warmdown_points(list(runs))
    base_runs = {re.sub(r".*-s(\d+)$", r"\1", r) if re.search(r"-s\d+$", r) else "": r
                 for r, v in points.items() if _is_baseline(keys, v)}
    if not base_runs:
        return [], {"warmdown": []}
    qs = quantizers_of(rows, quantizers)
    fp_rows = {(r.get("run"), r.get("step")): r for r in rows if FP.matches(r) and r.get("branch") == "main"}
    groups: dict[tuple, dict] = {}
    detail: list[dict] = []
    for run, values in sorted(points.items()):
        if _is_baseline(keys, values):
            continue
        seed = re.sub(r".*-s(\d+)$", r"\1", run) if re.search(r"-s\d+$", run) else ""
        base = base_runs.get(seed)
        if base is None:
            continue
        for q in qs:
            end = _last([r for r in rows if PTQ.matches(r) and r.get("run") == run and r.get("branch") == "main"
                         and r.get("quantizer") == q])
            ref = _last([r for r in rows if PTQ.matches(r) and r.get("run") == base and r.get("branch") == "main"
                         and r.get("quantizer") == q])
            if end is None or ref is None or end.get("tokens") != ref.get("tokens"):
                continue
            dq = paired_difference(end, ref, "ce_q", fp_windows)
            dfp = _fp_difference(fp_rows.get((run, end.get("step"))) or end, fp_rows.get((base, ref.get("step"))) or ref,
                                 fp_windows)
            dd = paired_difference(end, ref, "delta_ce")
            what = " ".join(f"{v}" for v in values)
            detail.append({"run": run, "baseline_run": base, "quantizer": q, "warmdown": what, "tokens": end.get("tokens"),
                           "ce_q": end["ce_q"], "ce_q_baseline": ref["ce_q"], "d_ce_q": dq.difference,
                           "d_ce_q_se": dq.se, "paired": dq.paired, "d_ce_fp": dfp.difference, "d_ce_fp_se": dfp.se,
                           "d_delta_ce": dd.difference, "d_delta_ce_se": dd.se})
            g = groups.setdefault((q, values), {"q": [], "fp": [], "dd": [], "ref": [], "fam": family_of(run),
                                                "base": family_of(base)})
            g["q"].append(dq)
            g["fp"].append(dfp)
            g["dd"].append(dd)
            g["ref"].append(float(ref["ce_q"]))
    out = []
    for (q, values), g in groups.items():
        eff, fp, dd = combine(g["q"]), combine(g["fp"]), combine(g["dd"])
        out.append(finding_row(
            WARMDOWN_CLAIM, "warmdown", q, f"{g['fam']} − {g['base']} (final checkpoints, equal tokens)",
            "CE(quantized)", eff, -1, z, WARMDOWN_FIGURE, seed_family=g["fam"],
            warmdown={k: v for k, v in zip(keys, values)}, d_ce_fp=fp.effect, d_ce_fp_se=fp.se,
            d_delta_ce=dd.effect, d_delta_ce_se=dd.se,
            baseline=statistics.fmean(g["ref"]), baseline_of="the 20 % linear warmdown's CE(quantized)"))
    out.sort(key=lambda f: (qs.index(f["quantizer"]), f["effect"]))
    return out, {"warmdown": detail}
