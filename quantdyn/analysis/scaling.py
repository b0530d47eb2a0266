"""Scaling-law fits: L(N, D) = A * (rho*N)^(-alpha) + B * D^(-beta) + E  (paper B).

Full precision (rho = 1): fit A, alpha, B, beta, E as Chinchilla (Hoffmann et
al. 2022, App. D.2) did -- in log space with ``a = log A``, ``b = log B``,
``e = log E``, the prediction ``log L = LSE(a - alpha log N, b - beta log D, e)``,
the Huber loss (delta = 1e-3) of the log residuals summed over points, L-BFGS
(float64, strong Wolfe line search) from the best few starts of a grid of
initialisations.

Quantized training (QAT): keep A, alpha, B, beta, E from the optimizer's
full-precision fit and fit only ``rho`` (the parameter efficiency; rho < 1 =
a quantized parameter is worth rho full-precision ones).

Bootstrap intervals: refit on ``bootstrap`` resamples of the points (with
replacement, seeded) and report the central ``confidence`` percentile interval
of every parameter.  All functions are pure; results are frozen dataclasses.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from quantdyn.errors import QuantdynError

PARAMS = ("A", "alpha", "B", "beta", "E")


@dataclass(frozen=True)
class ScalingFitConfig:
    """How scaling laws are fitted."""

    huber_delta: float = 1e-3
    """Huber threshold on log-loss residuals (Chinchilla: 1e-3)."""
    restarts: int = 8
    """L-BFGS runs, started from the best grid initialisations."""
    max_iter: int = 500
    """L-BFGS iterations per run."""
    bootstrap: int = 0
    """Bootstrap resamples for intervals (0 = none)."""
    confidence: float = 0.95
    """Central coverage of the bootstrap percentile intervals."""
    seed: int = 0
    """Seed of the bootstrap resampling."""

    def __post_init__(self):
        if not self.huber_delta > 0:
            raise QuantdynError(f"scaling.huber_delta={self.huber_delta} must be positive (Chinchilla: 1e-3)")
        if self.restarts < 1 or self.max_iter < 1:
            raise QuantdynError("scaling.restarts and scaling.max_iter must be >= 1")
        if self.bootstrap < 0:
            raise QuantdynError(f"scaling.bootstrap={self.bootstrap} must be >= 0")
        if not 0 < self.confidence < 1:
            raise QuantdynError(f"scaling.confidence={self.confidence} must lie in (0, 1)")


@dataclass(frozen=True)
class ScalingFit:
    """A fitted L(N, D) = A*(rho*N)^-alpha + B*D^-beta + E."""

    A: float
    alpha: float
    B: float
    beta: float
    E: float
    rho: float = 1.0
    """Parameter efficiency (1 for full precision)."""
    objective: float = 0.0
    """Huber loss of the log residuals at the optimum (sum over points)."""
    n_points: int = 0
    intervals: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    """Bootstrap percentile interval per fitted parameter (empty without bootstrap)."""

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in (*PARAMS, "rho", "objective", "n_points")} | {
            "intervals": {k: list(v) for k, v in self.intervals.items()}
        }


def predict(fit: ScalingFit, N, D):
    """Predicted loss at N parameters and D tokens (scalars or arrays)."""
    N = np.asarray(N, dtype=np.float64)
    D = np.asarray(D, dtype=np.float64)
    out = fit.A * (fit.rho * N) ** (-fit.alpha) + fit.B * D ** (-fit.beta) + fit.E
    return float(out) if out.ndim == 0 else out


# --------------------------------------------------------------------------- internals


def _points(N, D, loss) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, d, l_ = (torch.as_tensor(np.asarray(v, dtype=np.float64)).reshape(-1) for v in (N, D, loss))
    if not (len(n) == len(d) == len(l_)):
        raise QuantdynError(f"scaling fit: N, D and loss have different lengths ({len(n)}, {len(d)}, {len(l_)})")
    if len(n) == 0:
        raise QuantdynError("scaling fit: no points given")
    if not (torch.isfinite(n).all() and torch.isfinite(d).all() and torch.isfinite(l_).all()):
        raise QuantdynError("scaling fit: N, D and loss must be finite numbers")
    if (n <= 0).any() or (d <= 0).any() or (l_ <= 0).any():
        raise QuantdynError("scaling fit: N, D and loss must all be positive")
    return n.log(), d.log(), l_.log()


def _huber(r: torch.Tensor, delta: float) -> torch.Tensor:
    a = r.abs()
    return torch.where(a <= delta, 0.5 * r * r, delta * (a - 0.5 * delta))


def _log_pred(theta: torch.Tensor, logN: torch.Tensor, logD: torch.Tensor, log_rho: torch.Tensor) -> torch.Tensor:
    """theta = (a, alpha, b, beta, e) (batched over leading dims) -> log L per point."""
    a, al, b, be, e = (theta[..., i : i + 1] for i in range(5))
    terms = torch.stack(
        [a - al * (logN + log_rho), b - be * logD, e.expand(*e.shape[:-1], logN.shape[-1])], dim=-1
    )
    return torch.logsumexp(terms, dim=-1)


def _objective(theta, logN, logD, logL, log_rho, w, delta) -> torch.Tensor:
    r = _log_pred(theta, logN, logD, log_rho) - logL
    return (_huber(r, delta) * w).sum(-1)


def _lbfgs(params: torch.Tensor, closure_fn, max_iter: int) -> tuple[torch.Tensor, float]:
    p = params.clone().requires_grad_(True)
    opt = torch.optim.LBFGS([p], lr=1.0, max_iter=max_iter, tolerance_grad=1e-12, tolerance_change=1e-13,
                            history_size=50, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        f = closure_fn(p)
        f.backward()
        return f

    opt.step(closure)
    with torch.no_grad():
        f = float(closure_fn(p))
    return p.detach(), f


_GRID = dict(  # Chinchilla's initialisation grid (App. D.2), coarsened
    a=(0.0, 5.0, 10.0, 15.0, 20.0, 25.0),
    alpha=(0.0, 0.5, 1.0, 1.5, 2.0),
    b=(0.0, 5.0, 10.0, 15.0, 20.0, 25.0),
    beta=(0.0, 0.5, 1.0, 1.5, 2.0),
    e=(-1.0, -0.5, 0.0, 0.5, 1.0, 1.5),
)


def _fit_fp(logN, logD, logL, w, cfg: ScalingFitConfig, starts: torch.Tensor | None = None):
    if starts is None:
        grid = torch.tensor(list(itertools.product(*_GRID.values())), dtype=torch.float64)  # (G, 5)
        with torch.no_grad():
            obj = _objective(grid, logN, logD, logL, torch.zeros(()), w, cfg.huber_delta)
        obj = torch.nan_to_num(obj, nan=float("inf"))
        starts = grid[torch.argsort(obj)[: cfg.restarts]]
    best, best_f = None, float("inf")
    zero = torch.zeros((), dtype=torch.float64)
    for s in starts:
        theta, f = _lbfgs(s, lambda p: _objective(p, logN, logD, logL, zero, w, cfg.huber_delta), cfg.max_iter)
        if math.isfinite(f) and f < best_f and torch.isfinite(theta).all():
            best, best_f = theta, f
    if best is None:
        raise QuantdynError("scaling fit did not converge from any start; check the points")
    return best, best_f


def _fit_rho(theta, logN, logD, logL, w, cfg: ScalingFitConfig):
    grid = torch.linspace(math.log(1e-4), math.log(1e2), 121, dtype=torch.float64)
    with torch.no_grad():
        obj = torch.stack([_objective(theta, logN, logD, logL, g, w, cfg.huber_delta) for g in grid])
    start = grid[int(torch.argmin(obj))].reshape(1)
    lr, f = _lbfgs(start, lambda p: _objective(theta, logN, logD, logL, p[0], w, cfg.huber_delta), cfg.max_iter)
    return float(lr[0]), f


def _to_fit(theta: torch.Tensor, f: float, n: int, rho: float = 1.0) -> ScalingFit:
    a, al, b, be, e = (float(v) for v in theta)
    return ScalingFit(A=math.exp(a), alpha=al, B=math.exp(b), beta=be, E=math.exp(e), rho=rho,
                      objective=f, n_points=n)


def _theta(fit: ScalingFit) -> torch.Tensor:
    return torch.tensor([math.log(fit.A), fit.alpha, math.log(fit.B), fit.beta, math.log(fit.E)],
                        dtype=torch.float64)


def _bootstrap_weights(n: int, cfg: ScalingFitConfig) -> Iterable[torch.Tensor]:
    g = torch.Generator().manual_seed(cfg.seed)
    for _ in range(cfg.bootstrap):
        idx = torch.randint(0, n, (n,), generator=g)
        yield torch.bincount(idx, minlength=n).to(torch.float64)  # resampling = integer weights


def _interval(values: Sequence[float], confidence: float) -> tuple[float, float]:
    q = (1 - confidence) / 2
    v = np.asarray(values, dtype=np.float64)
    return float(np.quantile(v, q)), float(np.quantile(v, 1 - q))


# --------------------------------------------------------------------------- public


def fit_scaling_law(N, D, loss, cfg: ScalingFitConfig = ScalingFitConfig()) -> ScalingFit:
    """Fit A, alpha, B, beta, E (rho = 1) to full-precision points (N params, D tokens, loss)."""
    logN, logD, logL = _points(N, D, loss)
    if len(logN) < 5:
        raise QuantdynError(f"scaling fit needs at least 5 points for 5 parameters, got {len(logN)}")
    w = torch.ones_like(logN)
    theta, f = _fit_fp(logN, logD, logL, w, cfg)
    fit = _to_fit(theta, f, len(logN))
    if cfg.bootstrap:
        samples = []
        starts = theta.unsqueeze(0)
        for wb in _bootstrap_weights(len(logN), cfg):
            th, _ = _fit_fp(logN, logD, logL, wb, cfg, starts=starts)
            samples.append(_to_fit(th, 0.0, len(logN)))
        fit = replace(fit, intervals={k: _interval([getattr(s, k) for s in samples], cfg.confidence) for k in PARAMS})
    return fit


def fit_parameter_efficiency(fp_fit: ScalingFit, N, D, loss, cfg: ScalingFitConfig = ScalingFitConfig()) -> ScalingFit:
    """Fit only rho to quantized-training points, the other parameters fixed at ``fp_fit``."""
    logN, logD, logL = _points(N, D, loss)
    theta = _theta(fp_fit)
    w = torch.ones_like(logN)
    log_rho, f = _fit_rho(theta, logN, logD, logL, w, cfg)
    fit = replace(fp_fit, rho=math.exp(log_rho), objective=f, n_points=len(logN), intervals={})
    if cfg.bootstrap:
        rhos = [math.exp(_fit_rho(theta, logN, logD, logL, wb, cfg)[0]) for wb in _bootstrap_weights(len(logN), cfg)]
        fit = replace(fit, intervals={"rho": _interval(rhos, cfg.confidence)})
    return fit


@dataclass(frozen=True)
class OptimizerScaling:
    """Scaling fits of one optimizer: full precision and, if given, QAT."""

    optimizer: str
    fp: ScalingFit
    qat: ScalingFit | None = None


def fit_by_optimizer(rows: Iterable[Mapping[str, Any]], cfg: ScalingFitConfig = ScalingFitConfig()) -> dict[str, OptimizerScaling]:
    """Rows with keys optimizer, precision ('fp' or 'qat'), N, D, loss -> per-optimizer fits
    (FP first with rho = 1, then rho alone on that optimizer's QAT rows)."""
    by: dict[str, dict[str, list[tuple[float, float, float]]]] = {}
    for i, r in enumerate(rows):
        missing = [k for k in ("optimizer", "precision", "N", "D", "loss") if k not in r]
        if missing:
            raise QuantdynError(f"scaling row {i} lacks {', '.join(missing)}; each row needs optimizer, precision, N, D, loss")
        if r["precision"] not in ("fp", "qat"):
            raise QuantdynError(f"scaling row {i}: precision '{r['precision']}' must be 'fp' or 'qat'")
        by.setdefault(str(r["optimizer"]), {"fp": [], "qat": []})[r["precision"]].append(
            (float(r["N"]), float(r["D"]), float(r["loss"])))
    out = {}
    for opt, parts in by.items():
        if not parts["fp"]:
            raise QuantdynError(f"optimizer '{opt}' has QAT points but no full-precision points to fit first")
        fp = fit_scaling_law(*zip(*parts["fp"]), cfg=cfg)
        qat = fit_parameter_efficiency(fp, *zip(*parts["qat"]), cfg=cfg) if parts["qat"] else None
        out[opt] = OptimizerScaling(opt, fp, qat)
    return out


__all__ = [
    "ScalingFitConfig", "ScalingFit", "OptimizerScaling", "predict", "fit_scaling_law",
    "fit_parameter_efficiency", "fit_by_optimizer",
]
