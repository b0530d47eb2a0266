"""Rotations before quantization (QuaRot, QuIP#): a randomized Hadamard transform R on a linear layer's input
features, so that the weight is quantized as Q(W R) and the layer computes (x R) Q(W R)ᵀ.

In full precision R Rᵀ = I and the layer is unchanged; quantized, the rotation spreads a large input channel (an
outlier) over all of them, which makes the rows of W R and the activations x R "incoherent" (no entry much
larger than the rest), so a uniform grid fits them better (Chee et al. 2023, QuIP; Ashkboos et al. 2024, QuaRot;
Tseng et al. 2024, QuIP#).

The matrix
----------
``R = D H / sqrt(n)``: D = diag(s) with random signs s ∈ {±1}ⁿ, H an n × n Hadamard matrix (entries ±1,
H Hᵀ = n I). The signs are ``torch.randint(0, 2, (n,), generator=torch.Generator().manual_seed(seed)) * 2 - 1``,
the first draw of a generator seeded with the rotation seed — what compressed-tensors' ``random_hadamard_matrix``
draws from the same generator, so that for power-of-two widths (other than 32, whose stored matrix there is not
Sylvester's) the two libraries give the same R (tests/test_rotation.py).

H for a width n is ``H_m ⊗ H_p`` with n = m · p, p a power of two (Sylvester's H_p, whose rows are those of
``scipy.linalg.hadamard(p)``) and m = 1 or the order of a Paley matrix (Paley 1933): construction I for a prime
power q ≡ 3 (mod 4) gives order q + 1 (12, 20, 24, 28, 44, 48, 60, 72, 80, 84, 104, 108, ...); construction II
for a prime power q ≡ 1 (mod 4) gives 2(q + 1) (12, 20, 28, 36, 52, 60, 76, 100, ...). m is the smallest
such order with n / m a power of two. Why this and not block-diagonal blocks: a full-width transform mixes an
outlier into all n features (the incoherence bound is in n), blocks only into their block; and every width
transformers of interest have factors this way — 1536 = 12·128, 576 = 36·16, 6144 = 12·512, 896 = 28·32,
4864 = 76·64, 8960 = 140·64, 11008 = 344·32 (Paley I with q = 7³), 13824 = 108·128, 18944 = 148·128.
A width with no such factorisation (an odd width, 2·odd, or e.g. 4·43·... when no Paley order fits) has no
supported construction and is refused naming the layer (:func:`check_width`). Prime powers with exponent ≤ 3 are
supported (GF(pᵏ) arithmetic with a brute-force irreducible polynomial).

Applying R to a wide tensor costs O(n log n) per row, never an n × n product: the signs, Sylvester's fast
Walsh-Hadamard transform along the power-of-two factor, a dense m × m product along the other (:func:`rotate`);
up to DENSE_MAX_WIDTH features one product with the dense R is faster on a CPU and is used instead.

Calibration statistics are rotated, not recollected: GPTQ's H = 2/N Σ x xᵀ of the rotated inputs is Rᵀ H R
(:func:`rotate_stats`); AWQ's mean |x| is not a function of H, so the engine sums |x R| of the calibration inputs
in the same pass (:func:`fold_stats`).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import time
from functools import lru_cache
from typing import Callable

import torch

from quantdyn.errors import QuantdynError
from quantdyn.quantize.gptq import ActStats, stats_update
from quantdyn.quantize.primitives import QuantResult

# ----------------------------------------------------------------------------- Hadamard matrices


def _prime_power(q: int) -> tuple[int, int] | None:
    """(p, k) with q = pᵏ, p prime, k >= 1; None otherwise."""
    if q < 2:
        return None
    p = next(d for d in range(2, q + 1) if q % d == 0)
    k, r = 0, q
    while r % p == 0:
        r //= p
        k += 1
    return (p, k) if r == 1 else None


_MAX_FIELD_DEGREE = 3
"""GF(pᵏ) with k <= 3: irreducibility of a degree-2 or -3 polynomial is the absence of a root."""


@lru_cache(maxsize=None)
def _field(q: int) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]] | None:
    """GF(q) as (subtraction table a − b, quadratic character χ(a)) over element indices 0..q-1; None when q is
    not a prime power with exponent <= 3."""
    pk = _prime_power(q)
    if pk is None or pk[1] > _MAX_FIELD_DEGREE:
        return None
    p, k = pk
    elems = list(itertools.product(range(p), repeat=k))  # coefficient tuples (c_{k-1}, ..., c_0)
    index = {e: i for i, e in enumerate(elems)}

    if k == 1:
        def mul(a, b):
            return ((a[0] * b[0]) % p,)
    else:
        # a monic irreducible x^k + c_{k-1} x^{k-1} + ... + c_0: no root in GF(p) (enough for k = 2, 3)
        poly = next(c for c in itertools.product(range(p), repeat=k)
                    if all((x ** k + sum(ci * x ** (k - 1 - j) for j, ci in enumerate(c))) % p for x in range(p)))

        def mul(a, b):
            prod = [0] * (2 * k - 1)  # highest degree first
            for i, ai in enumerate(a):
                for j, bj in enumerate(b):
                    prod[i + j] = (prod[i + j] + ai * bj) % p
            for i in range(k - 1):  # reduce x^(2k-2-i) by the polynomial
                lead = prod[i]
                if lead:
                    prod[i] = 0
                    for j, cj in enumerate(poly):
                        prod[i + 1 + j] = (prod[i + 1 + j] - lead * cj) % p
            return tuple(prod[k - 1:])

    squares = {index[mul(e, e)] for e in elems if any(e)}
    chi = tuple(0 if i == 0 else (1 if i in squares else -1) for i in range(q))
    sub = tuple(tuple(index[tuple((x - y) % p for x, y in zip(a, b))] for b in elems) for a in elems)
    return sub, chi


def _jacobsthal(q: int) -> torch.Tensor:
    sub, chi = _field(q)
    return torch.tensor([[chi[sub[a][b]] for b in range(q)] for a in range(q)], dtype=torch.float64)


@lru_cache(maxsize=None)
def _paley(m: int) -> torch.Tensor | None:
    """A Hadamard matrix of order m by Paley's construction I or II (float64 ±1), or None."""
    q = m - 1
    if q % 4 == 3 and _field(q) is not None:  # construction I: H = I + S, S skew conference matrix
        Q = _jacobsthal(q)
        S = torch.zeros(m, m, dtype=torch.float64)
        S[0, 1:], S[1:, 0], S[1:, 1:] = 1.0, -1.0, Q
        return torch.eye(m, dtype=torch.float64) + S
    if m % 2 == 0:
        q = m // 2 - 1
        if q % 4 == 1 and _field(q) is not None:  # construction II: C ⊗ [[1,-1],[-1,-1]] + I ⊗ [[1,1],[1,-1]]
            Q = _jacobsthal(q)
            C = torch.zeros(q + 1, q + 1, dtype=torch.float64)
            C[0, 1:], C[1:, 0], C[1:, 1:] = 1.0, 1.0, Q
            A = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
            B = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
            return torch.kron(C, A) + torch.kron(torch.eye(q + 1, dtype=torch.float64), B)
    return None


@lru_cache(maxsize=None)
def hadamard_factor(n: int) -> int | None:
    """The order m of the non-Sylvester factor of width ``n`` (n = m · 2ᵏ, m = 1 or a Paley order; the
    smallest such m), or None when ``n`` has no supported construction."""
    if n < 1:
        return None
    odd = n
    while odd % 2 == 0:
        odd //= 2
    m = odd
    while m <= n:
        if m == 1 or _paley(m) is not None:
            return m
        m *= 2
    return None


@lru_cache(maxsize=None)
def small_hadamard(m: int) -> torch.Tensor:
    """The m × m factor (float64 ±1): [[1]] for m = 1, else the Paley matrix of order m."""
    if m == 1:
        return torch.ones(1, 1, dtype=torch.float64)
    H = _paley(m)
    if H is None:
        raise QuantdynError(f"no Paley Hadamard matrix of order {m}")
    return H


def check_width(n: int, where: str) -> int:
    """The factor m of width ``n`` (hadamard_factor), or a one-line error naming ``where`` (the layer)."""
    m = hadamard_factor(n)
    if m is None:
        raise QuantdynError(f"+had: {where} has {n} input features, a width with no supported Hadamard matrix "
                            f"(n = m * 2^k with m = 1 or a Paley order: 12, 20, 28, 36, ...); quantize this model "
                            f"without +had")
    return m


def signs(n: int, seed: int) -> torch.Tensor:
    """The random signs s ∈ {±1}ⁿ (float64) of the rotation with ``seed`` (module docstring)."""
    g = torch.Generator().manual_seed(int(seed))
    return torch.randint(0, 2, (n,), generator=g, dtype=torch.int64).to(torch.float64) * 2 - 1


@lru_cache(maxsize=64)
def _signs_on(n: int, seed: int, device: str, dtype: torch.dtype) -> torch.Tensor:
    return signs(n, seed).to(device=device, dtype=dtype)


@lru_cache(maxsize=64)
def _small_on(m: int, transpose: bool, device: str, dtype: torch.dtype) -> torch.Tensor:
    H = small_hadamard(m)
    return (H.t() if transpose else H).contiguous().to(device=device, dtype=dtype)


def _fwht(x: torch.Tensor) -> torch.Tensor:
    """x H_p along the last dimension (p a power of two; Sylvester's H, unnormalized)."""
    p = x.shape[-1]
    y = x.reshape(-1, p)
    h = 1
    while h < p:
        y = y.view(-1, p // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return y.reshape(x.shape)


def hadamard_product(x: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """x H (or x Hᵀ) along the last dimension, H = H_m ⊗ H_p the unnormalized Hadamard matrix of its width."""
    n = x.shape[-1]
    m = check_width(n, "a tensor")
    p = n // m
    y = _fwht(x.reshape(*x.shape[:-1], m, p))  # along the power-of-two factor (H_p is symmetric)
    if m > 1:
        Hm = _small_on(m, transpose, str(x.device), x.dtype)
        y = torch.einsum("...ap,ab->...bp", y, Hm)
    return y.reshape(x.shape)


DENSE_MAX_WIDTH = 512
"""Widths up to this are rotated by one product with the dense R (cached per width, seed, device and dtype): on a
CPU one GEMM beats the transform's log2(n) passes there (2,048 rows: 3.3x faster at n = 128, 1.4x at 512, but 2x
slower at 2,048; BENCHMARKS.md, "Rotations before quantization"). Wider ones use the fast transform."""


@lru_cache(maxsize=32)
def _dense_on(n: int, seed: int, device: str, dtype: torch.dtype) -> torch.Tensor:
    return (hadamard_matrix(n, seed) / math.sqrt(n)).to(device=device, dtype=dtype)


def rotate(x: torch.Tensor, seed: int, inverse: bool = False) -> torch.Tensor:
    """x R (or x Rᵀ with ``inverse``) along the last dimension, R = D H / sqrt(n) (module docstring).

    A weight W (out, in) rotated on its input features is ``rotate(W, seed)`` = W R; an activation x (..., in)
    ``rotate(x, seed)`` = x R; ``rotate(rotate(x, s), s, inverse=True)`` is x again up to float rounding."""
    n = x.shape[-1]
    if n <= DENSE_MAX_WIDTH and check_width(n, "a tensor"):
        R = _dense_on(n, int(seed), str(x.device), x.dtype)
        return x @ (R.t() if inverse else R)
    s = _signs_on(n, int(seed), str(x.device), x.dtype)
    if not inverse:
        return hadamard_product(x * s) / math.sqrt(n)
    return hadamard_product(x, transpose=True).mul_(s) / math.sqrt(n)


def hadamard_matrix(n: int, seed: int | None = None) -> torch.Tensor:
    """The dense n × n matrix D H (float64 ±1, unnormalized; D = I without a seed): what a compressed-tensors
    checkpoint stores as a transform weight (readers divide by sqrt(n))."""
    eye = torch.eye(n, dtype=torch.float64)
    if seed is not None:
        eye = eye * signs(n, seed)
    return hadamard_product(eye)


# ----------------------------------------------------------------------------- calibration statistics


def rotate_hessian(H: torch.Tensor, seed: int) -> torch.Tensor:
    """Rᵀ H R: the second moment of the rotated inputs x R from that of x (symmetrised)."""
    A = rotate(H, seed)  # H R (rows of H rotated)
    B = rotate(A.t().contiguous(), seed)  # (H R)ᵀ R = Rᵀ H R (H symmetric)
    return (B + B.t()).mul_(0.5)


def rotate_stats(stats: ActStats | None, seed: int) -> ActStats | None:
    """The statistics of a rotated layer's inputs: H -> Rᵀ H R; ``abs_sum`` is already that of x R
    (:func:`fold_stats` sums it rotated)."""
    if stats is None:
        return None
    return dataclasses.replace(stats, H=rotate_hessian(stats.H, seed))


def fold_stats(stats: ActStats | None, x: torch.Tensor, need_abs: bool, seed: int | None) -> ActStats:
    """Fold one batch of layer inputs into ``stats`` (gptq.stats_update); with a rotation ``seed`` the
    sum of |x| AWQ needs (``need_abs``) is that of the rotated inputs x R, while H stays that of x (rotated
    once per layer by :func:`rotate_stats`)."""
    if seed is None or not need_abs:
        return stats_update(stats, x, need_abs=need_abs)
    out = stats_update(stats, x, need_abs=False)
    a = rotate(x.reshape(-1, x.shape[-1]).float(), seed).abs().sum(0, dtype=torch.float64)
    return dataclasses.replace(out, abs_sum=a if stats is None else stats.abs_sum + a)


# ----------------------------------------------------------------------------- a rotated layer


def hadamard_seed(cfg) -> int | None:
    """The sign seed of a config's per-layer rotation (``+had``), None without one."""
    return cfg.rotation_seed if cfg.hadamard else None


def quantize_rotated(fn: Callable[..., QuantResult], W: torch.Tensor, stats: ActStats | None, cfg,
                     where: str) -> QuantResult:
    """``fn`` (a registered quantizer) applied to W R with the rotated statistics; the result's ``weight`` is
    rotated back, Q(W R) Rᵀ: the layer's function (x R) Q(W R)ᵀ as one weight, with no online rotation
    (QuantResult.rotation_seed says its codes are of W R). ``where`` names the layer in errors."""
    return quantize_rotated_batch(lambda problems: [fn(*p) for p in problems], [(W, stats, cfg)], [where])[0]


def quantize_rotated_batch(batch_fn: Callable[[list], list[QuantResult]], problems: list[tuple], where: list[str]
                           ) -> list[QuantResult]:
    """:func:`quantize_rotated` for several (W, statistics, config) problems solved by one call of ``batch_fn``
    (the engine's ``gptq_batch``: layers that share a Hessian in one column loop). A problem whose config has no
    ``+had`` passes unchanged; statistics shared by problems with the same seed are rotated once (so they stay
    one object, and share a loop, after the rotation)."""
    prepared, meta, rotated_stats = [], [], {}
    for (W, stats, cfg), name in zip(problems, where):
        seed = hadamard_seed(cfg)
        if seed is None:
            prepared.append((W, stats, cfg))
            meta.append(None)
            continue
        m = check_width(W.shape[1], name)
        t0 = time.perf_counter()
        key = (id(stats), seed)
        if key not in rotated_stats:
            rotated_stats[key] = rotate_stats(stats, seed)
        prepared.append((rotate(W, seed), rotated_stats[key], cfg))
        meta.append((seed, m, time.perf_counter() - t0))
    del rotated_stats
    out = []
    for res, (W, _, _), mt in zip(batch_fn(prepared), problems, meta):
        if mt is None:
            out.append(res)
            continue
        seed, m, t_rot = mt
        t0 = time.perf_counter()
        weight = rotate(res.weight.to(W.dtype), seed, inverse=True)
        notes = {"rotation": "had", "rotation_seed": seed, "hadamard_factor": m,
                 "rotation_seconds": t_rot + time.perf_counter() - t0}
        out.append(dataclasses.replace(res, weight=weight, rotation_seed=seed,
                                       diagnostics={**res.diagnostics, **notes}))
    return out


def rotated_act_quant(act_quant: Callable[[torch.Tensor], torch.Tensor], seed: int
                      ) -> Callable[[torch.Tensor], torch.Tensor]:
    """Activation fake quantization of the rotated input: x -> A(x R) Rᵀ. With the module holding Q(W R) Rᵀ the
    layer computes A(x R) Q(W R)ᵀ, what a deployment computes with its online rotation."""
    def aq(x: torch.Tensor) -> torch.Tensor:
        xr = rotate(x.float(), seed)
        return rotate(act_quant(xr).float(), seed, inverse=True)
    return aq
