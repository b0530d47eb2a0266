"""results/stats.py: mean ± SE, paired differences with the eval-hash check, the stable-phase jitter, the one
verdict rule (windows, run-to-run, jitter, seeds) and the digits it is printed with, bootstrap intervals."""
from __future__ import annotations

import math
import re
import statistics

import numpy as np
import pytest
import torch

from quantdyn.results import stats
from quantdyn.results.stats import Difference, combine, format_estimate, paired_difference, verdict_sign
from quantdyn.studies import findings as fd


# ------------------------------------------------------------------ mean and SE
def test_mean_se_is_the_n_minus_1_standard_error_for_lists_arrays_and_tensors():
    m, se = stats.mean_se([1.0, 2.0, 3.0, 4.0])
    assert m == 2.5 and se == pytest.approx(math.sqrt(5 / 3) / 2)  # s² = 5/3, n = 4
    x = np.random.default_rng(0).normal(3.0, 2.0, 101)
    assert stats.mean_se(x) == pytest.approx((statistics.fmean(x), statistics.stdev(x) / math.sqrt(101)))
    assert stats.mean_se(torch.tensor(x)) == pytest.approx(stats.mean_se(x))
    one = stats.mean_se([0.7])
    assert one[0] == 0.7 and math.isnan(one[1])  # one value: no SE
    assert all(math.isnan(v) for v in stats.mean_se([]))
    assert stats.se_of_mean([0.003, 0.004]) == pytest.approx(0.0025)
    with pytest.raises(ValueError):
        stats.se_of_mean([])


# ------------------------------------------------------------------ paired differences
def _row(dce, wd=None, se=0.003, **kw):
    r = {"kind": "ptq", "delta_ce": dce, "delta_ce_se": se, "eval_hash": "e", "quant_repeats": 1,
         "checkpoint": kw.pop("checkpoint", "/c"), "ce_fp": 4.0}
    if wd is not None:
        r["window_delta"] = list(wd)
    r["ce_q"] = r["ce_fp"] + dce
    r.update(kw)
    return r


def test_paired_difference_pairs_windows_only_on_the_same_eval_windows():
    rng = np.random.default_rng(0)
    base = rng.normal(0.05, 0.02, 50)  # window difficulty, shared by both checkpoints
    a = _row(float((base + 0.01).mean()), base + 0.01 + rng.normal(0, 1e-4, 50), checkpoint="/a")
    b = _row(float(base.mean()), base, checkpoint="/b")
    p = paired_difference(a, b)
    assert p.paired and p.difference == pytest.approx(0.01, abs=1e-4)
    assert p.eval_se < 1e-4 < math.hypot(0.003, 0.003)  # pairing removes the shared window difficulty
    assert p.eval_se == pytest.approx(statistics.stdev(np.array(a["window_delta"]) - base) / math.sqrt(50))
    assert p.run_se is None and p.jitter is None and p.se == pytest.approx(p.eval_se)
    # repeated quantizations add their run-to-run part in quadrature
    p2 = paired_difference({**a, "quant_repeats": 4, "delta_ce_run_sd": 0.004},
                           {**b, "quant_repeats": 2, "delta_ce_run_sd": 0.002})
    assert p2.run_se == pytest.approx(math.hypot(0.004 / 2, 0.002 / math.sqrt(2)))
    assert p2.se == pytest.approx(math.hypot(p2.eval_se, p2.run_se))
    # other evaluation windows (another eval_hash) are never paired, even with equal window counts
    p3 = paired_difference(a, {**b, "eval_hash": "other"})
    assert not p3.paired and p3.eval_se == pytest.approx(math.hypot(0.003, 0.003))
    # a row written before eval_hash existed pairs on its window count
    assert paired_difference(a, {k: v for k, v in b.items() if k != "eval_hash"}).paired
    # CE of the quantized model: FP window CE + window delta, paired when the FP windows are known
    fp = {"/a": list(4.0 + base * 10), "/b": list(4.0 + base * 10 + 0.02)}
    pq = paired_difference(a, b, "ce_q", fp)
    assert pq.paired and pq.difference == pytest.approx(a["ce_q"] - b["ce_q"])
    unpaired = paired_difference({**a, "ce_fp_se": 0.05}, {**b, "ce_fp_se": 0.05}, "ce_q")
    assert not unpaired.paired and unpaired.eval_se == pytest.approx(math.hypot(0.05, 0.05))
    with pytest.raises(ValueError):
        paired_difference(a, b, "top1_agree")
    wk = np.linspace(0.01, 0.02, 50)  # KL per window pairs the same way (rows with window_kl)
    pk = paired_difference({**a, "kl": float(wk.mean()) + 1e-3, "window_kl": list(wk + 1e-3)},
                           {**b, "kl": float(wk.mean()), "window_kl": list(wk)}, "kl")
    assert pk.paired and pk.difference == pytest.approx(1e-3) and pk.eval_se < 1e-12
    nk = paired_difference({**a, "kl": 0.02, "kl_se": 0.003}, {**b, "kl": 0.01, "kl_se": 0.004}, "kl")
    assert not nk.paired and nk.eval_se == pytest.approx(0.005)


def test_old_rows_without_windows_hashes_or_repeats_still_compare():
    a = {"delta_ce": 0.05, "delta_ce_se": 0.003}
    b = {"delta_ce": 0.04, "delta_ce_se": None}  # a missing SE counts as 0, not as an error
    p = paired_difference(a, b)
    assert not p.paired and p.difference == pytest.approx(0.01) and p.eval_se == pytest.approx(0.003)
    assert p.run_se is None


# ------------------------------------------------------------------ jitter and the combined rule
def test_stable_jitter_is_the_scatter_about_a_line_through_peak_lr_main_checkpoints():
    noise = [0.002, -0.001, -0.002, 0.001, 0.0]
    rows = [{"branch": "main", "tokens": 100, "lr": 1e-4, "delta_ce": 9.0}]  # warmup: not at peak LR
    rows += [{"branch": "main", "tokens": 1000 * (i + 1), "lr": 3e-3, "delta_ce": 0.01 + 0.003 * i + e}
             for i, e in enumerate(noise)]
    rows += [{"branch": "main", "tokens": 6000, "lr": 3e-3, "delta_ce": 5.0, "decaying": True},
             {"branch": "control-s4-d2", "tokens": 7000, "lr": 3e-3, "delta_ce": 7.0}]
    x = np.arange(1, 6) * 1000.0
    y = np.array([0.01 + 0.003 * i + e for i, e in enumerate(noise)])
    res = y - np.polyval(np.polyfit(x, y, 1), x)
    assert stats.stable_jitter(rows) == pytest.approx(float(np.sqrt((res ** 2).sum() / 3)))
    assert stats.stable_jitter(rows[:4]) is None  # three stable checkpoints: too few


def test_combine_takes_the_larger_of_within_and_between_with_every_part_in_quadrature():
    e = combine([Difference(0.02, 0.003, 0.004), Difference(-0.01, 0.004, None)])
    assert e.effect == pytest.approx(0.005) and e.n_seeds == 2
    assert e.se_windows == pytest.approx(0.0025) and e.se_run == pytest.approx(0.002) and e.se_jitter is None
    assert e.se_seeds == pytest.approx(0.015) and e.se == pytest.approx(0.015) and not e.same_sign
    one = combine([Difference(0.02, 0.003, 0.004, jitter=0.012)])
    assert one.se_seeds is None and one.se == pytest.approx(math.sqrt(0.003 ** 2 + 0.004 ** 2 + 0.012 ** 2))
    assert one.fields()["se_jitter"] == pytest.approx(0.012) and one.fields()["z"] == pytest.approx(one.z)
    with pytest.raises(ValueError):
        combine([])


def test_the_demo_line_that_ignored_its_jitter_is_now_within_uncertainty():
    """issue 27: 'rtn3 cooldown-s200-d100-linear ... -0.0016 ± 0.0007 0.0022 decay lowers the error'."""
    d = Difference(-0.0016, 0.0007, None, jitter=0.0022, paired=True)
    assert abs(d.difference) > 2 * d.eval_se  # what the demo's verdict used to look at
    assert d.se == pytest.approx(math.hypot(0.0007, 0.0022))
    assert verdict_sign(d.difference, d.se) == 0
    assert stats.decay_verdict(verdict_sign(d.difference, d.se)) == "within uncertainty (|z| <= 2)"
    # beyond the jitter the decay is claimed, in the findings' words too
    assert stats.decay_verdict(verdict_sign(0.01, d.se)) == stats.DECAY_RAISES
    assert fd.verdict(0.01, d.se, +1) == fd.REPRODUCED and fd.verdict(-0.01, d.se, +1) == fd.OPPOSITE


def _decay_rows(jitter_noise: float, diff: float) -> list[dict]:
    """Main run with 6 stable checkpoints (Δ CE scattered by ``jitter_noise``), a cooldown and its control whose
    per-window deltas differ by ``diff`` with little window noise."""
    rng = np.random.default_rng(1)
    w = rng.normal(0.05, 0.01, 64)
    rows = []
    for i, e in enumerate((1, -1, 1, -1, 1, -1)):
        rows.append({"kind": "ptq", "run": "r", "branch": "main", "ckpt_kind": "checkpoint", "quantizer": "rtn3",
                     "bits": 3, "step": 10 * (i + 1), "tokens": 1000 * (i + 1), "lr": 3e-3, "decaying": False,
                     "delta_ce": 0.05 + e * jitter_noise, "delta_ce_se": 0.001})
    for branch, kind, shift in (("cooldown-s40-d20-cosine", "cooldown", diff), ("control-s40-d20", "control", 0.0)):
        wd = w + shift + rng.normal(0, 1e-4, 64)
        rows.append({"kind": "ptq", "run": "r", "branch": branch, "ckpt_kind": kind, "quantizer": "rtn3", "bits": 3,
                     "step": 60, "tokens": 60000, "lr": 3e-3 if kind == "control" else 0.0, "delta_ce": float(wd.mean()),
                     "delta_ce_se": 0.001, "window_delta": list(wd), "eval_hash": "e", "parent_step": 40})
    return rows


def test_decay_table_verdict_counts_the_jitter():
    (t,) = stats.decay_table(_decay_rows(jitter_noise=0.004, diff=0.004), "r")
    assert t["branch"] == "cooldown-s40-d20-cosine" and t["paired"]
    assert abs(t["difference"]) > 10 * t["difference_eval_se"]  # far beyond the paired window SE ...
    assert t["stable_jitter"] > t["difference"] / 2  # ... but not beyond the jitter
    assert t["difference_se"] == pytest.approx(math.hypot(t["difference_eval_se"], t["stable_jitter"]))
    assert t["z"] == pytest.approx(t["difference"] / t["difference_se"]) and abs(t["z"]) <= 2
    assert not t["exceeds_uncertainty"] and t["verdict"] == "within uncertainty (|z| <= 2)"
    (quiet,) = stats.decay_table(_decay_rows(jitter_noise=0.0002, diff=0.004), "r")
    assert quiet["exceeds_uncertainty"] and quiet["verdict"] == stats.DECAY_RAISES
    # the findings, the demo's table and the report read this same table
    found, detail = fd.decay_findings(_decay_rows(0.004, 0.004), ["r"])
    assert detail["decay"] == [t] and found[0]["verdict"] == fd.NOT_RESOLVED
    assert found[0]["se_jitter"] == pytest.approx(t["stable_jitter"]) and found[0]["se"] == pytest.approx(t["difference_se"])
    from quantdyn.report.figures import rainbow_table

    assert rainbow_table(_decay_rows(0.004, 0.004), "r") == [t]


# ------------------------------------------------------------------ the verdict and its digits
def test_verdict_sign_is_z_against_the_threshold_and_unknown_is_unresolved():
    assert verdict_sign(0.021, 0.01) == 1 and verdict_sign(-0.021, 0.01) == -1
    assert verdict_sign(0.02, 0.01) == 0  # |z| = 2 exactly: inside
    assert verdict_sign(0.021, 0.01, z=3) == 0
    for se in (None, 0.0, -1.0, float("nan"), float("inf")):
        assert verdict_sign(0.5, se) == 0
    assert verdict_sign(None, 0.1) == 0 and verdict_sign(float("nan"), 0.1) == 0
    assert stats.interval_sign(0.001, 0.5) == 1 and stats.interval_sign(-0.5, -0.1) == -1
    assert stats.interval_sign(-0.1, 0.5) == 0 and stats.interval_sign(None, 0.5) == 0


def _agrees(e_txt: str, s_txt: str, z_txt: str, sign: int, z: float) -> bool:
    e, s, t = float(e_txt), float(s_txt), float(z_txt)
    return s > 0 and (abs(t) > z) == (sign != 0) and (abs(e) / s > z) == (sign != 0) and \
        (sign == 0 or (t > 0) == (sign > 0) and (e > 0) == (sign > 0))


def test_printed_z_and_printed_effect_over_se_agree_with_the_verdict():
    rng = np.random.default_rng(27)
    n = 0
    for _ in range(20000):
        se = 10 ** rng.uniform(-7, 1)
        z = rng.choice([2.0, 2.0, 3.0, 1.5])
        t = rng.choice([rng.uniform(-6, 6), z * (1 + rng.normal(0, 1e-3)), -z * (1 + rng.normal(0, 1e-5))])
        effect = t * se
        sign = verdict_sign(effect, se, z)
        e_txt, s_txt, z_txt = format_estimate(effect, se, z)
        assert _agrees(e_txt, s_txt, z_txt, sign, z), (effect, se, z, e_txt, s_txt, z_txt)
        n += abs(abs(t) - z) < 0.01 * z
    assert n > 2000  # many cases sat right at the threshold, where rounding used to contradict the verdict


def test_issue_examples_print_consistently():
    # '+0.0005 ± 0.0002 ... within uncertainty (|z| <= 2)' looked like z = 2.5
    e, s, t = format_estimate(0.00046, 0.00024)
    assert (e, s, t) == ("+0.00046", "0.00024", "+1.9")
    # z = 2.01 is resolved: not printed as 0.0020 ± 0.0010 (z 2.0)
    e, s, t = format_estimate(0.00201, 0.001)
    assert float(e) / float(s) > 2 and float(t) > 2 and (e, s) == ("+0.00201", "0.00100")
    assert format_estimate(0.0123, 0.0031) == ("+0.0123", "0.0031", "+4.0")
    assert format_estimate(0.5, 0.0) == ("+0.5", "n/a", "n/a") and format_estimate(None, 0.1)[0] == "n/a"
    assert format_estimate(3e13, 1e12)[1] == "1.0e+12"


def test_printed_intervals_exclude_zero_exactly_when_the_interval_does():
    assert stats.format_interval(0.45, 0.12, 0.71) == "+0.45 [+0.12, +0.71]"
    got = stats.format_interval(0.3, 0.001, 0.6)  # resolved: must not print [+0.00, ...]
    assert float(got.split("[")[1].split(",")[0]) > 0
    assert stats.format_interval(0.3, -0.001, 0.6).startswith("+0.30 [-0.00")  # not resolved, and it shows
    assert stats.format_interval(0.3, None, 0.6) == "+0.30 [n/a]" and stats.format_interval(None, 0, 1) == "n/a"


def test_the_demo_and_findings_printouts_keep_z_and_verdict_consistent():
    rng = np.random.default_rng(5)
    tables = []
    for k in range(400):
        se = 10 ** rng.uniform(-5, -2)
        t = rng.choice([rng.uniform(-5, 5), 2 * (1 + rng.normal(0, 1e-3))])
        tables.append({"run": f"r{k}", "quantizer": "rtn3", "branch": "cooldown-s4-d2-1-sqrt",
                       "delta_ce_decayed": 0.1, "delta_ce_control": 0.1, "difference": t * se,
                       "difference_se": se, "difference_eval_se": se, "difference_run_se": None,
                       "stable_jitter": None, "verdict": stats.decay_verdict(verdict_sign(t * se, se))})
    lines = fd.format_decay_table(tables)  # prints the verdict decay_table decided (as above), never its own
    body = [ln for ln in lines if "cooldown-s4-d2-1-sqrt" in ln]
    assert len(body) == len(tables)
    for ln, row in zip(body, tables):
        m = re.search(r"([+-]?[\d.e+-]+) ± ([\d.e+-]+) \(z ([+-]?[\d.]+)\)", ln)
        sign = verdict_sign(row["difference"], row["difference_se"])
        assert _agrees(m.group(1), m.group(2), m.group(3), sign, 2.0), ln
        assert ln.rstrip().endswith(stats.decay_verdict(sign)), ln
    # and the findings table
    for row in tables[:100]:
        f = {"effect": row["difference"], "se": row["difference_se"], "z_threshold": 2.0}
        m = re.fullmatch(r"([+-]?[\d.e+-]+) ± ([\d.e+-]+) \(z ([+-]?[\d.]+)\)", fd.format_effect(f))
        assert _agrees(*m.groups(), verdict_sign(f["effect"], f["se"]), 2.0)


# ------------------------------------------------------------------ bootstrap
def test_bootstrap_intervals_share_resamples_and_drop_undefined_ones():
    x = np.arange(20, dtype=np.float64)
    got = stats.bootstrap_intervals([lambda i: x[i].mean(), lambda i: math.nan if x[i].max() < 19 else 1.0], 20,
                                    500, 0.9, np.random.default_rng(4))
    idx = np.random.default_rng(4).integers(0, 20, size=(500, 20))
    means = x[idx].mean(axis=1)
    assert got[0][:2] == pytest.approx(tuple(np.quantile(means, [0.05, 0.95]))) and got[0][2] == 500
    has_max = int((x[idx].max(axis=1) == 19).sum())
    assert 0 < has_max < 500 and got[1] == (1.0, 1.0, has_max)
    assert all(math.isnan(v) for v in stats.percentile_interval([math.nan, math.nan], 0.9))


def test_format_estimate_prints_a_zero_without_a_sign():
    """An effect or z that rounds to zero at the digits printed carries no sign ('-0.0000 ± 0.0036' read as a
    direction the digits do not show); the digits rule is unchanged."""
    assert format_estimate(-4e-7, 0.0036) == ("0.0000", "0.0036", "0.0")
    assert format_estimate(4e-7, 0.0036) == ("0.0000", "0.0036", "0.0")
    assert format_estimate(-0.0004, 0.0036) == ("-0.0004", "0.0036", "-0.1")


def test_a_row_is_read_against_its_checkpoints_noise_floor():
    from quantdyn.results.stats import floor_difference, within_noise_floor

    floor = [0.001, 0.003, 0.002, 0.002]
    fp_row = {"kind": "fp", "floor_delta_ce": 0.002, "floor_delta_ce_se": 0.0004, "floor_window_delta": floor,
              "eval_hash": "e"}

    def row(shift, noise=(0.0, 0.0, 0.0, 0.0)):
        wd = [f + shift + n for f, n in zip(floor, noise)]
        return {"kind": "ptq", "delta_ce": sum(wd) / 4, "window_delta": wd, "eval_hash": "e"}

    near = row(0.0005, (0.001, -0.001, 0.0005, -0.0005))  # paired SE ~0.0005: 0.0005 above is not resolved
    d = floor_difference(near, fp_row)
    assert d.paired and d.difference == pytest.approx(0.0005) and within_noise_floor(near, fp_row) is True
    far = row(0.01, (0.001, -0.001, 0.0005, -0.0005))
    assert within_noise_floor(far, fp_row) is False and floor_difference(far, fp_row).z > 2
    assert within_noise_floor(row(-0.001), fp_row) is True  # better than bf16 storage: inside
    # exactly shifted windows: SE 0, any excess is resolved
    assert within_noise_floor(row(1e-6), fp_row) is False and within_noise_floor(row(0.0), fp_row) is True
    # no floor measured (an fp row written before it): no verdict, never an error
    assert within_noise_floor(far, {"kind": "fp", "ce_fp": 3.0}) is None and floor_difference(far, {}) is None


def test_rel_delta_ce_and_combined_se_read_old_rows():
    assert stats.rel_delta_ce({"rel_delta_ce": 0.123, "delta_ce": 1.0, "ce_fp": 2.0}) == 0.123
    assert stats.rel_delta_ce({"delta_ce": 1.0, "ce_fp": 2.5}) == pytest.approx(0.4)  # before the field
    assert stats.rel_delta_ce({"rel_delta_ce": float("nan"), "delta_ce": 1.0, "ce_fp": 2.0}) == 0.5
    assert stats.rel_delta_ce({"delta_ce": 1.0}) is None and stats.rel_delta_ce({"delta_ce": 1.0, "ce_fp": 0}) is None
    r = {"delta_ce": 0.5, "delta_ce_se": 0.003, "quant_repeats": 4, "delta_ce_run_sd": 0.02}
    u = stats.uncertainty(r)
    assert u.total_se == pytest.approx(math.sqrt(0.003 ** 2 + 0.02 ** 2 / 4)) and u.run_se == pytest.approx(0.01)
    assert u.dominant == stats.RUN and stats.total_se({**r, "delta_ce_total_se": 0.5}) == 0.5
    old = stats.uncertainty({"delta_ce": 0.5})  # no SE, no repeats: reads, as zeros and R = 1
    assert (old.eval_se, old.run_sd, old.repeats, old.total_se, old.dominant) == (0.0, None, 1, 0.0, stats.EVAL)
    assert stats.repeats({"quant_repeats": "3"}) == 1 and stats.repeats({"quant_repeats": 3}) == 3
    assert stats.rel_delta_ce_se({**r, "ce_fp": 2.0}) == pytest.approx(stats.total_se(r) / 2.0)
