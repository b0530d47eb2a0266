"""Does a rotation remove the LR-decay effect? The decay effect measured with and without a rotation before
quantizing, and the difference of the two effects with its uncertainty (issue 37).

Paper A's mechanism for "the decayed endpoint quantizes worse than its constant-LR control" is curvature: the
decay moves the model into a sharper basin. A rotation (``+had``: every layer's input rotated by a randomized
Hadamard transform) spreads outlier channels over all features but leaves the loss landscape as it is. If the
decay effect came from outliers, the rotation would remove it; if from curvature, it would survive.

For one run, one cooldown branch and one pair (plain quantizer q, its rotated twin q+had), all four measured on
the same evaluation windows:

    decay(q)      = Δ CE(q, decayed endpoint) − Δ CE(q, constant-LR control)
    decay(q+had)  = the same with the rotation
    difference    = decay(q+had) − decay(q)
                  = [CE(q+had) − CE(q)](decayed) − [CE(q+had) − CE(q)](control)

paired window by window (the FP CE cancels), with the run-to-run SE of the quantization where measured and the
stable-phase jitter of Δ CE(q+had) − Δ CE(q) along the main run (the same rule as the decay finding:
results/stats.py). Seeds are combined with ``combine``: the mean difference, its uncertainty max(within, seeds).

The finding's claim is the outlier story's: "the rotation shrinks the decay effect", i.e. the difference has the
sign opposite to the unrotated decay effect. Its sentence says what the numbers show: the rotation *removes* the
effect (it shrinks it and the rotated effect is within its uncertainty of zero), *shrinks* it, *reverses* it,
*enlarges* it, or *does not change it measurably* (the difference within its uncertainty).
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Mapping, Sequence

import numpy as np

from quantdyn.quantize.catalogue import parse_quantizer
from quantdyn.results.schema import PTQ, number
from quantdyn.results.stats import (
    Z,
    Difference,
    combine,
    decay_difference,
    mean_se,
    paired_difference,
    same_windows,
    stable_jitter,
    uncertainty,
    verdict_sign,
)
from quantdyn.runs import control_of
from quantdyn.studies.findings import family_of, finding_row

FINDING = "a rotation before quantizing removes the LR-decay effect"
FAMILY = "rotations"


def plain_twin(label: str) -> str | None:
    """The label without its rotation (``rtn4+had`` -> ``rtn4``), or None when ``label`` has none."""
    try:
        qc = parse_quantizer(label)
    except Exception:  # a label from another tool or version: not one of ours to pair
        return None
    if not (qc.hadamard or qc.r1):
        return None
    return replace(qc, hadamard=False, r1=False, rotation_seed=0).name


def rotation_pairs(quantizers: Sequence[str]) -> list[tuple[str, str]]:
    """(plain, rotated) for every rotated label in ``quantizers`` whose plain twin is there too, in order."""
    have = set(quantizers)
    return [(p, q) for q in quantizers if (p := plain_twin(q)) is not None and p in have]


def _last(rows: list[Mapping]) -> Mapping | None:
    return max(rows, key=lambda r: (number(r.get("tokens")) or 0, number(r.get("step")) or 0)) if rows else None


def _windows(row: Mapping) -> np.ndarray | None:
    wd = row.get("window_delta")
    return np.asarray(wd, dtype=np.float64) if wd else None


def _interaction(ends: Sequence[Mapping], jitter: float | None) -> Difference:
    """(rotated decayed, rotated control, plain decayed, plain control) -> the difference of the two decay effects,
    paired over windows when all four carry the same windows, else the two decay differences' SEs in quadrature."""
    rd, rc, pd, pc = ends
    d = (float(rd["delta_ce"]) - float(rc["delta_ce"])) - (float(pd["delta_ce"]) - float(pc["delta_ce"]))
    ws = [_windows(r) for r in ends]
    paired = (all(w is not None and len(w) == len(ws[0]) and len(w) > 1 for w in ws)
              and all(same_windows(ends[0], r) for r in ends[1:]))
    if paired:
        eval_se = mean_se((ws[0] - ws[1]) - (ws[2] - ws[3]))[1]
    else:
        eval_se = math.hypot(decay_difference(rd, rc, None).eval_se, decay_difference(pd, pc, None).eval_se)
    runs = [u.run_se for u in (uncertainty(dict(r)) for r in ends) if u.run_se is not None]
    run_se = math.sqrt(sum(r * r for r in runs)) if runs else None
    return Difference(d, eval_se, run_se, jitter, paired)


def _gap_jitter(plain: list[Mapping], rotated: list[Mapping]) -> float | None:
    """Stable-phase jitter of Δ CE(rotated) − Δ CE(plain) along the main run (checkpoints paired by step)."""
    by_step = {(r.get("branch"), r.get("step")): r for r in plain}
    gaps = []
    for r in rotated:
        p = by_step.get((r.get("branch"), r.get("step")))
        if p is not None and number(r.get("delta_ce")) is not None and number(p.get("delta_ce")) is not None:
            gaps.append({**r, "delta_ce": number(r["delta_ce"]) - number(p["delta_ce"])})
    return stable_jitter(gaps)


def rotation_table(rows: Sequence[Mapping], run: str, pairs: Sequence[tuple[str, str]], z: float = Z) -> list[dict]:
    """Per (plain, rotated) pair and cooldown branch of ``run``: both decay effects and their difference (module
    docstring). A branch whose control, or one of the four rows, is missing or ends at other tokens is left out."""
    mine = [r for r in rows if PTQ.matches(r) and r.get("run") == run]
    branches = sorted({r.get("branch") for r in mine
                       if r.get("ckpt_kind") == "cooldown" and control_of(r.get("branch")) is not None})
    table = []
    for plain, rot in pairs:
        of = {q: [r for r in mine if r.get("quantizer") == q] for q in (plain, rot)}
        jitters = {q: stable_jitter(of[q]) for q in (plain, rot)}
        gap_jitter = _gap_jitter(of[plain], of[rot])
        for b in branches:
            ends = [_last([r for r in of[q] if r.get("branch") == br]) for q in (rot, plain)
                    for br in (b, control_of(b))]
            if any(e is None for e in ends) or len({e.get("tokens") for e in ends}) != 1:
                continue
            rd, rc, pd, pc = ends
            dec_rot, dec_plain = decay_difference(rd, rc, jitters[rot]), decay_difference(pd, pc, jitters[plain])
            d = _interaction(ends, gap_jitter)
            table.append({"run": run, "quantizer": rot, "plain": plain, "branch": b, "step": rd.get("step"),
                          "tokens": rd.get("tokens"),
                          "decay_plain": dec_plain.difference, "decay_plain_se": dec_plain.se,
                          "decay_rotated": dec_rot.difference, "decay_rotated_se": dec_rot.se,
                          "difference": d.difference, "difference_eval_se": d.eval_se,
                          "difference_run_se": d.run_se, "stable_jitter": d.jitter, "difference_se": d.se,
                          "z": d.z, "paired": d.paired, "sign": verdict_sign(d.difference, d.se, z),
                          "quant_repeats": min(uncertainty(dict(e)).repeats for e in ends)})
    return table


def _difference(t: Mapping) -> Difference:
    return Difference(t["difference"], t["difference_eval_se"], t.get("difference_run_se"), t.get("stable_jitter"),
                      bool(t.get("paired")))


def rotation_findings(rows: Sequence[Mapping], runs: Sequence[str], quantizers: Sequence[str] = (),
                      z: float = Z) -> tuple[list[dict], dict]:
    """The rotations family: per run family (seeds combined), rotated quantizer and cooldown branch, the difference
    of the decay effect with and without the rotation (module docstring); its details also hold ``rotation_gains``
    (Δ CE with the rotation minus without, per checkpoint)."""
    qs = list(quantizers) or sorted({r["quantizer"] for r in PTQ.select(rows) if r.get("quantizer")})
    pairs = rotation_pairs(qs)
    tables = [t for run in runs for t in rotation_table(rows, run, pairs, z)]
    groups: dict[tuple, list[dict]] = {}
    for t in tables:
        groups.setdefault((family_of(t["run"]), t["quantizer"], t["branch"]), []).append(t)
    order = {q: i for i, (_, q) in enumerate(pairs)}
    out = []
    for (fam, q, b), ts in sorted(groups.items(), key=lambda kv: (kv[0][0], order[kv[0][1]], kv[0][2])):
        eff = combine([_difference(t) for t in ts])
        plain = ts[0]["plain"]
        dec_plain = combine([Difference(t["decay_plain"], t["decay_plain_se"]) for t in ts])
        dec_rot = combine([Difference(t["decay_rotated"], t["decay_rotated_se"]) for t in ts])
        expected = -1 if dec_plain.effect >= 0 else +1  # the claim: the difference shrinks the plain effect
        out.append(finding_row(
            FINDING, FAMILY, q, f"{fam}: decay effect with {q} minus without ({plain}), {b} (step {ts[0]['step']})",
            "Δ CE", eff, expected, z, "findings_rotations.png", quant_repeats=min(t["quant_repeats"] for t in ts),
            seed_family=fam, branch=b, control=control_of(b), plain=plain,
            decay_plain=dec_plain.effect, decay_plain_se=dec_plain.se,
            decay_rotated=dec_rot.effect, decay_rotated_se=dec_rot.se,
            baseline=dec_plain.effect, baseline_of="the decay effect without rotation", baseline_se=dec_plain.se))
    return out, {FAMILY: tables, "rotation_gains": rotation_gains(rows, pairs, z)}


def rotation_gains(rows: Sequence[Mapping], pairs: Sequence[tuple[str, str]], z: float = Z) -> list[dict]:
    """Does the rotation lower the error where it is measured? Per (plain, rotated) pair and checkpoint measured with
    both on the same windows: Δ CE(rotated) − Δ CE(plain), paired window by window (results/stats.py
    paired_difference; the FP CE cancels), its SE and its sign at ``z`` (−1: the rotation lowers Δ CE)."""
    ptq = [r for r in rows if PTQ.matches(r) and r.get("checkpoint_hash")]
    out = []
    for plain, rot in pairs:
        of_plain = {(r.get("checkpoint_hash"), r.get("eval_hash")): r for r in ptq if r.get("quantizer") == plain}
        for r in ptq:
            p = of_plain.get((r.get("checkpoint_hash"), r.get("eval_hash"))) if r.get("quantizer") == rot else None
            if p is None:
                continue
            d = paired_difference(r, p)
            out.append({"run": r.get("run"), "branch": r.get("branch"), "step": r.get("step"),
                        "ckpt_kind": r.get("ckpt_kind"), "quantizer": rot, "plain": plain,
                        "delta_plain": float(p["delta_ce"]), "delta_rotated": float(r["delta_ce"]),
                        "difference": d.difference, "difference_se": d.se, "paired": d.paired,
                        "sign": verdict_sign(d.difference, d.se, z)})
    return sorted(out, key=lambda t: (t["plain"], str(t["run"]), str(t["branch"]), t["step"] or 0))


def rotation_effect_words(f: Mapping, z: float = Z) -> str:
    """What the rotation does to the decay effect, from a finding row: removes / shrinks / reverses / enlarges /
    does not change it measurably (module docstring)."""
    d, se = number(f.get("effect")), number(f.get("se"))
    plain, rot, rot_se = number(f.get("decay_plain")), number(f.get("decay_rotated")), number(f.get("decay_rotated_se"))
    sign = verdict_sign(d, se, z)
    if sign == 0 or plain is None or d is None:
        return "does not change the decay effect measurably"
    if plain == 0 or (d > 0) == (plain > 0):
        return "enlarges the decay effect"
    if verdict_sign(rot, rot_se, z) == 0:
        return "removes the decay effect"
    return "shrinks the decay effect" if (rot > 0) == (plain > 0) else "reverses the decay effect"


def rotation_sentence(f: Mapping, amount: str, z: float) -> tuple[str, str] | None:
    """The answer's sentence of a rotations finding (FindingFamily.sentence)."""
    if not f.get("plain"):
        return None
    words = rotation_effect_words(f, z)
    what = (f"{f['quantizer']} against {f['plain']}, {f['branch']}: the decay effect goes from "
            f"{f['decay_plain']:+.4g} to {f['decay_rotated']:+.4g} nats, a difference of {amount}")
    return what, f"the rotation {words} — {f['verdict']}"


def rotation_label(f: Mapping, with_family: bool) -> str | None:
    """The overview's label: rotated vs plain quantizer and branch."""
    if not f.get("plain"):
        return None
    fam = f"{f['seed_family']} · " if with_family and f.get("seed_family") else ""
    return f"{fam}{f['quantizer']} − {f['plain']} · {f['branch']}"
