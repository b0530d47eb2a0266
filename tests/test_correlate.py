"""Correlations with bootstrap CIs on synthetic tables."""
from __future__ import annotations

import math

import numpy as np
import pytest

from quantdyn.analysis.correlate import CorrelateConfig, correlate, pearson, rankdata, spearman
from quantdyn.errors import QuantdynError


def test_rankdata_average_ties_and_spearman_known():
    assert rankdata(np.array([10, 20, 20, 5, 20])).tolist() == [2.0, 4.0, 4.0, 1.0, 4.0]
    # x = [1,2,3,4,5], y = [5,6,7,8,7]: ranks y = [1,2,3.5,5,3.5]
    # r of ranks: Σdxdy = 8, Σdx² = 10, Σdy² = 9.5 -> 8 / sqrt(95)
    assert spearman([1, 2, 3, 4, 5], [5, 6, 7, 8, 7]) == pytest.approx(8 / math.sqrt(95))
    assert pearson([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0)
    assert math.isnan(pearson([1, 1, 1], [1, 2, 3]))


def test_monotone_independent_and_sorting():
    rng = np.random.default_rng(0)
    n = 60
    x = rng.normal(size=n)
    table = [
        {"delta_ce": float(np.exp(v)), "mono": float(v), "noise": float(rng.normal()), "label": "run"}
        for v in x
    ]
    table[3]["noise"] = None  # missing value: pairwise deletion
    rows = correlate(table, "delta_ce", cfg=CorrelateConfig(n_boot=300, seed=1))
    assert [r["metric"] for r in rows] == ["mono", "noise"]  # sorted by |spearman|; 'label' is not numeric
    mono, noise = rows
    assert mono["spearman"] == pytest.approx(1.0) and mono["n"] == n
    assert mono["spearman_lo"] <= 1.0 + 1e-12 and mono["spearman_hi"] >= 1.0 - 1e-12
    assert mono["pearson"] < 1.0  # exp is monotone, not linear
    assert noise["n"] == n - 1 and noise["n_boot_valid"] == 300
    assert noise["spearman_lo"] < 0.0 < noise["spearman_hi"]
    assert noise["pearson_lo"] < 0.0 < noise["pearson_hi"]
    # seeded: same numbers again; dict-of-columns input gives the same answer
    cols = {k: [r[k] for r in table] for k in ("delta_ce", "mono", "noise")}
    again = correlate(cols, "delta_ce", ["noise"], CorrelateConfig(n_boot=300, seed=1))
    assert again[0]["spearman"] == noise["spearman"]


def test_errors():
    with pytest.raises(QuantdynError, match="did you mean 'delta_ce'"):
        correlate({"delta_ce": [1, 2, 3], "m": [1, 2, 3]}, "delta_cee")
    with pytest.raises(QuantdynError, match="different lengths"):
        correlate({"delta_ce": [1, 2, 3], "m": [1, 2]}, "delta_ce")
    with pytest.raises(QuantdynError):
        CorrelateConfig(ci=95)
