"""Scaling-law fits (quantdyn/analysis/scaling.py)."""
from __future__ import annotations

import numpy as np
import pytest

from quantdyn.analysis.scaling import ScalingFit, ScalingFitConfig, fit_by_optimizer, fit_parameter_efficiency, predict
from quantdyn.errors import QuantdynError

FAST = ScalingFitConfig(restarts=3)
CHINCHILLA = dict(A=406.4, alpha=0.34, B=410.7, beta=0.28, E=1.69)
OTHER = dict(A=250.0, alpha=0.30, B=600.0, beta=0.30, E=1.9)


def grid():
    N = np.repeat(np.geomspace(2e7, 1.5e9, 5), 5)
    D = np.tile(np.geomspace(4e8, 3e10, 5), 5)
    return N, D


def test_fit_by_optimizer_recovers_parameters_and_rho():
    N, D = grid()
    truth = {"adamw": (CHINCHILLA, 0.55), "shampoo": (OTHER, 0.8)}
    rows = []
    for opt, (params, rho) in truth.items():
        for prec, r in (("fp", 1.0), ("qat", rho)):
            L = predict(ScalingFit(**params, rho=r), N, D)
            rows += [dict(optimizer=opt, precision=prec, N=n, D=d, loss=l) for n, d, l in zip(N, D, L)]
    fits = fit_by_optimizer(rows, FAST)
    assert set(fits) == {"adamw", "shampoo"}
    for opt, (params, rho) in truth.items():
        fp = fits[opt].fp
        assert fp.n_points == len(N)  # the full-precision points only
        # the FP points measured against their own law have efficiency 1
        L_fp = predict(ScalingFit(**params), N, D)
        assert fit_parameter_efficiency(fp, N, D, L_fp, FAST).rho == pytest.approx(1.0, rel=1e-3)
        for k, v in params.items():
            assert getattr(fp, k) == pytest.approx(v, rel=1e-3), (opt, k)
        assert fits[opt].qat.rho == pytest.approx(rho, rel=0.02)
        assert fits[opt].qat.alpha == fp.alpha  # only rho is fitted for QAT
        np.testing.assert_allclose(predict(fits[opt].qat, N, D), predict(ScalingFit(**params, rho=rho), N, D),
                                   rtol=1e-4)


def test_rho_bootstrap_interval_is_seeded_and_covers_truth():
    N, D = grid()
    fp = ScalingFit(**CHINCHILLA)
    rng = np.random.default_rng(0)
    L = predict(ScalingFit(**CHINCHILLA, rho=0.6), N, D) * np.exp(rng.normal(0, 0.002, N.shape))
    cfg = ScalingFitConfig(bootstrap=30, seed=3)
    a = fit_parameter_efficiency(fp, N, D, L, cfg)
    b = fit_parameter_efficiency(fp, N, D, L, cfg)
    assert a.intervals == b.intervals
    lo, hi = a.intervals["rho"]
    assert lo < 0.6 < hi and lo <= a.rho <= hi
    assert a.rho == pytest.approx(0.6, rel=0.02)


def test_bad_points_raise():
    from quantdyn.analysis.scaling import fit_scaling_law

    with pytest.raises(QuantdynError, match="at least 5 points"):
        fit_scaling_law([1e7, 1e8], [1e9, 1e9], [3.0, 2.9])
    with pytest.raises(QuantdynError, match="positive"):
        fit_scaling_law([1e7] * 5, [1e9] * 5, [3.0, 2.9, -1.0, 2.0, 2.0])
    with pytest.raises(QuantdynError, match="no full-precision points"):
        fit_by_optimizer([dict(optimizer="x", precision="qat", N=1e7, D=1e9, loss=3.0)])
