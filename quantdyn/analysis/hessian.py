"""Curvature of the loss: Hessian trace (Hutchinson) and top eigenvalues.

Paper A (arXiv 2510.06213, "Training Dynamics Impact Post-Training
Quantization Robustness") tracks the Hessian trace and top eigenvalue of the
held-out loss along training; both surge when the learning rate decays.  They
report Hutchinson's estimator with "up to 200 iterations, tol 1e-5" and power
iteration with "up to 1000 iterations, tol 1e-5" (PyHessian's conventions);
those are the defaults of :class:`HessianConfig`.

Notation.  θ = the selected parameters (flattened and concatenated), L(θ) =
mean next-token cross-entropy over the held-out batches, H = ∇²L(θ).  A
Hessian-vector product (HVP) Hv = ∇_θ (∇_θ L · v) is computed by double
backward (``torch.autograd.grad`` with ``create_graph=True``), never by forming
H.

Layers:
  * generic core over an HVP closure ``hvp_fn(vs) -> Hvs`` (``vs`` a list of
    tensors shaped like ``params``): :func:`hutchinson_trace`,
    :func:`top_eigenvalues` (power iteration with deflation) and
    :func:`lanczos_top_eigenvalues`; tests check them on known quadratics;
  * :func:`hvp_from_loss` turns loss closures into an HVP closure;
  * :func:`hessian_metrics` for quantdyn GPT models and HF causal LMs.

SDPA: the fused CPU/GPU attention kernels have no double backward, so the
forward passes whose graphs are differentiated twice run inside
``torch.nn.attention.sdpa_kernel(SDPBackend.MATH)``.  HF models whose attention
goes through ``F.scaled_dot_product_attention`` are covered by the same
context; ``attn_implementation='eager'`` works too.
"""
from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from quantdyn.errors import QuantdynError, unknown_name
from quantdyn.models.gpt import logits_of
from quantdyn.results.stats import mean_se

Tensors = list[torch.Tensor]
HVPFn = Callable[[Tensors], Tensors]
GroupSpec = Mapping[str, Sequence[torch.Tensor]] | Callable[[str, torch.Tensor], "str | None"]

GROUPINGS = ("none", "block", "layer_type")


@dataclass(frozen=True)
class HessianConfig:
    """What to estimate and how hard to try."""

    trace_max_probes: int = 200
    """Probe budget for Hutchinson's estimator (paper A: up to 200 iterations)."""
    trace_min_probes: int = 10
    """Probes drawn before the tolerance test may stop the estimate (so the
    standard error rests on at least this many samples)."""
    trace_tol: float = 1e-5
    """Stop when the running mean changes by less than this, relatively, after
    one more probe: |mean_n − mean_{n−1}| / (|mean_{n−1}| + 1e-6) < tol
    (PyHessian's criterion; paper A: 1e-5).  0 = always use the full budget."""
    top_k: int = 1
    """Number of top eigenvalues (0 = skip the eigenvalue computation)."""
    eig_method: str = "power"
    """'power' (power iteration with deflation, as PyHessian and paper A;
    finds the largest-|λ| eigenvalues) or 'lanczos' (Lanczos with full
    re-orthogonalisation; finds the algebraically largest eigenvalues)."""
    eig_max_iter: int = 1000
    """Iteration cap per eigenvalue for power iteration, total Lanczos steps
    for Lanczos (paper A: up to 1000)."""
    eig_tol: float = 1e-5
    """Power iteration: stop when the Rayleigh quotient changes by less than
    this, relatively, between iterations (paper A: 1e-5).  Lanczos: stop when
    every wanted Ritz value has residual below tol·|λ|."""
    batches: int = 0
    """Use only the first this many held-out batches (0 = all given).  Every
    HVP is over all used batches, i.e. of the mean loss over them."""
    reuse_graph: bool = True
    """Build each batch's gradient graph once and reuse it for every HVP (fast,
    PyHessian's single-batch trick; memory grows with the number of batches).
    False = one forward and two backward passes per batch per HVP."""
    groups: str = "none"
    """Per-parameter-group results: 'none', 'block' (one group per transformer
    block plus 'embed', 'head', 'other') or 'layer_type' (one group per module
    role, e.g. 'attention.query_key_value', pooled over blocks)."""
    group_top_k: int = 0
    """Top eigenvalues of each group's diagonal Hessian block H_gg (costs a
    full eigen-solve per group; 0 = none)."""
    seed: int = 0
    """Seed of the Rademacher probes and the eigen-solver start vectors."""

    def __post_init__(self):
        if self.trace_max_probes < 1 and self.top_k == 0:
            raise QuantdynError("hessian: trace_max_probes and top_k are both 0; nothing to compute")
        if self.trace_max_probes < 0:
            raise QuantdynError(f"hessian.trace_max_probes={self.trace_max_probes} must be >= 0")
        if self.trace_min_probes < 2:
            raise QuantdynError(f"hessian.trace_min_probes={self.trace_min_probes} must be >= 2 (needed for a standard error)")
        if self.trace_tol < 0 or self.eig_tol <= 0:
            raise QuantdynError("hessian: trace_tol must be >= 0 and eig_tol > 0")
        if self.top_k < 0 or self.group_top_k < 0:
            raise QuantdynError("hessian: top_k and group_top_k must be >= 0")
        if self.eig_max_iter < 1:
            raise QuantdynError(f"hessian.eig_max_iter={self.eig_max_iter} must be >= 1")
        if self.eig_method not in ("power", "lanczos"):
            raise unknown_name("hessian.eig_method", self.eig_method, ("power", "lanczos"))
        if self.batches < 0:
            raise QuantdynError(f"hessian.batches={self.batches} must be >= 0 (0 = all)")
        if self.groups not in GROUPINGS:
            raise unknown_name("hessian.groups", self.groups, GROUPINGS)


# ----------------------------------------------------------------------------
# vector helpers over lists of tensors


def _dot(a: Tensors, b: Tensors) -> float:
    return float(sum((x * y).sum(dtype=torch.float64) for x, y in zip(a, b)))


def _norm(a: Tensors) -> float:
    return math.sqrt(_dot(a, a))


def _scale(a: Tensors, s: float) -> Tensors:
    return [x * s for x in a]


def _axpy(alpha: float, x: Tensors, y: Tensors) -> Tensors:
    """alpha * x + y."""
    return [yi + alpha * xi for xi, yi in zip(x, y)]


def _rademacher(params: Tensors, gen: torch.Generator) -> Tensors:
    # drawn on CPU so a seed gives the same probes on every device
    return [
        torch.randint(0, 2, p.shape, generator=gen, dtype=p.dtype).mul_(2).sub_(1).to(p.device)
        for p in params
    ]


def _gaussian(params: Tensors, gen: torch.Generator) -> Tensors:
    return [torch.randn(p.shape, generator=gen, dtype=torch.float64).to(device=p.device, dtype=p.dtype) for p in params]


# ----------------------------------------------------------------------------
# generic core


def hutchinson_trace(
    hvp_fn: HVPFn,
    params: Sequence[torch.Tensor],
    max_probes: int = 200,
    tol: float = 1e-5,
    min_probes: int = 10,
    seed: int = 0,
    groups: Sequence[Sequence[int]] | None = None,
) -> dict:
    """Hutchinson's estimator tr(H) ≈ mean_i v_iᵀ H v_i over Rademacher v_i.

    Args:
      hvp_fn: ``vs -> H vs`` for lists of tensors shaped like ``params``.
      params: tensors fixing the shapes, dtypes and devices of the probes.
      max_probes: probe budget (paper A: 200).
      tol: stop once ``|mean_n − mean_{n−1}| / (|mean_{n−1}| + 1e-6) < tol``
        and at least ``min_probes`` probes were drawn (PyHessian's criterion).
      min_probes: probes before the tolerance may stop (>= 2).
      seed: seed of the probes.
      groups: optional partition of ``params`` by index; each group g gets the
        estimate mean_i v_{i,g}ᵀ (H v_i)_g of tr(H_gg) from the same probes.
        It is unbiased (E[v_g v_hᵀ] = 0 for g ≠ h) and the group estimates add
        up to the total.

    Returns dict: ``trace`` (mean), ``se`` (sample std / sqrt(n)), ``probes``
    (n), ``converged`` (the tolerance stopped it), ``samples`` (the per-probe
    vᵀHv), and ``groups`` (list of {trace, se} in ``groups`` order) if asked.
    """
    params = list(params)
    if max_probes < 1:
        raise QuantdynError(f"hutchinson_trace: max_probes={max_probes} must be >= 1")
    if min_probes < 2:
        raise QuantdynError(f"hutchinson_trace: min_probes={min_probes} must be >= 2")
    gen = torch.Generator().manual_seed(seed)
    samples: list[float] = []
    group_samples: list[list[float]] = [[] for _ in (groups or [])]
    converged = False
    prev = 0.0
    for i in range(max_probes):
        v = _rademacher(params, gen)
        hv = hvp_fn(v)
        per_param = [float((a * b).sum(dtype=torch.float64)) for a, b in zip(v, hv)]
        samples.append(sum(per_param))
        for gi, idx in enumerate(groups or []):
            group_samples[gi].append(sum(per_param[j] for j in idx))
        mean = sum(samples) / len(samples)
        if i > 0 and len(samples) >= min_probes and abs(mean - prev) / (abs(prev) + 1e-6) < tol:
            converged = True
            break
        prev = mean
    out = {**_trace_se(samples), "probes": len(samples), "converged": converged, "samples": samples}
    if groups is not None:
        out["groups"] = [_trace_se(s) for s in group_samples]
    return out


def _trace_se(samples: list[float]) -> dict:
    mean, se = mean_se(samples)
    return {"trace": mean, "se": se}


def top_eigenvalues(
    hvp_fn: HVPFn,
    params: Sequence[torch.Tensor],
    k: int = 1,
    max_iter: int = 1000,
    tol: float = 1e-5,
    seed: int = 0,
) -> dict:
    """Top-k eigenvalues (largest |λ|) by power iteration with deflation.

    For j = 1..k: start from a Gaussian vector, and repeat v ← H v / ‖H v‖
    after projecting v orthogonal to the eigenvectors already found (PyHessian's
    deflation; also removes drift back into them), with eigenvalue estimate the
    Rayleigh quotient λ = vᵀ H v (‖v‖ = 1).  Stop when
    ``|λ_t − λ_{t−1}| / (|λ_{t−1}| + 1e-6) < tol`` or after ``max_iter`` HVPs.

    Power iteration converges to the eigenvalue of largest magnitude, which for
    a non-convex loss can be negative; use :func:`lanczos_top_eigenvalues` for
    the algebraically largest ones.  Convergence is slow when |λ_{j+1}/λ_j| is
    close to 1; ``converged`` says whether the tolerance was met.

    Returns dict: ``eigenvalues`` (list, in order found), ``eigenvectors``
    (list of lists of tensors), ``iterations`` and ``converged`` (per value).
    """
    params = list(params)
    if k < 1:
        raise QuantdynError(f"top_eigenvalues: k={k} must be >= 1")
    gen = torch.Generator().manual_seed(seed)
    values: list[float] = []
    vectors: list[Tensors] = []
    iters: list[int] = []
    conv: list[bool] = []
    for _ in range(k):
        v = _gaussian(params, gen)
        v = _orthonormalize(v, vectors)
        lam: float | None = None
        ok = False
        it = 0
        for it in range(1, max_iter + 1):
            hv = hvp_fn(v)
            new = _dot(v, hv)
            v = _orthonormalize(hv, vectors)
            if lam is not None and abs(new - lam) / (abs(lam) + 1e-6) < tol:
                lam, ok = new, True
                break
            lam = new
        values.append(float(lam))
        vectors.append(v)
        iters.append(it)
        conv.append(ok)
    return {"eigenvalues": values, "eigenvectors": vectors, "iterations": iters, "converged": conv}


def _orthonormalize(v: Tensors, basis: list[Tensors]) -> Tensors:
    for b in basis:
        v = _axpy(-_dot(b, v), b, v)
    n = _norm(v)
    if n == 0.0:
        raise QuantdynError("Hessian-vector product vanished: the Hessian is zero on the remaining subspace")
    return _scale(v, 1.0 / n)


def lanczos_top_eigenvalues(
    hvp_fn: HVPFn,
    params: Sequence[torch.Tensor],
    k: int = 1,
    max_iter: int = 1000,
    tol: float = 1e-5,
    seed: int = 0,
) -> dict:
    """Top-k (algebraically largest) eigenvalues by Lanczos.

    Builds the Krylov basis q_1..q_m of H from a Gaussian start with full
    re-orthogonalisation (the basis is kept, so memory is m parameter vectors),
    and the tridiagonal T_m = Q_mᵀ H Q_m (α on the diagonal, β off it).  Its
    top-k eigenvalues θ_j (Ritz values) approximate H's; the residual of Ritz
    pair j is |β_m · s_{m,j}| (s = eigenvectors of T_m).  Stops once every
    wanted residual is below ``tol·|θ_j|``, after ``max_iter`` steps, or when
    the Krylov space is invariant (β = 0; exact).

    Returns dict: ``eigenvalues`` (descending), ``residuals``, ``iterations``
    (HVPs used), ``converged`` (per value).
    """
    params = list(params)
    if k < 1:
        raise QuantdynError(f"lanczos_top_eigenvalues: k={k} must be >= 1")
    gen = torch.Generator().manual_seed(seed)
    q = _orthonormalize(_gaussian(params, gen), [])
    basis: list[Tensors] = []
    alphas: list[float] = []
    betas: list[float] = []
    theta: list[float] = []
    resid: list[float] = []
    for m in range(1, max_iter + 1):
        basis.append(q)
        w = hvp_fn(q)
        alphas.append(_dot(q, w))
        # full re-orthogonalisation (twice is enough: Kahan/Parlett)
        for _ in range(2):
            for b in basis:
                w = _axpy(-_dot(b, w), b, w)
        beta = _norm(w)
        T = torch.diag(torch.tensor(alphas, dtype=torch.float64))
        if m > 1:
            off = torch.tensor(betas, dtype=torch.float64)
            T += torch.diag(off, 1) + torch.diag(off, -1)
        evals, evecs = torch.linalg.eigh(T)
        order = torch.argsort(evals, descending=True)[:k]
        theta = [float(evals[i]) for i in order]
        resid = [abs(beta * float(evecs[-1, i])) for i in order]
        invariant = beta <= 1e-12 * max(1.0, max(abs(a) for a in alphas))
        if invariant or (m >= k and all(r <= tol * max(abs(t), 1e-12) for r, t in zip(resid, theta))):
            break
        betas.append(beta)
        q = _scale(w, 1.0 / beta)
    conv = [r <= tol * max(abs(t), 1e-12) for r, t in zip(resid, theta)]
    return {"eigenvalues": theta, "residuals": resid, "iterations": len(alphas), "converged": conv}


# ----------------------------------------------------------------------------
# HVP from a loss


def hvp_from_loss(
    loss_fns: Callable[[], torch.Tensor] | Sequence[Callable[[], torch.Tensor]],
    params: Sequence[torch.Tensor],
    weights: Sequence[float] | None = None,
    reuse_graph: bool = True,
) -> tuple[HVPFn, dict]:
    """HVP closure of L = Σ_b w_b · loss_b() with respect to ``params``.

    Each ``loss_fns[b]`` builds a scalar loss from ``params`` (it runs the
    forward pass; wrap SDPA models yourself, :func:`hessian_metrics` does).
    ``weights`` default to 1/B (mean).  With ``reuse_graph`` the gradients
    g = ∇L are built once with ``create_graph=True`` and every HVP is one
    backward pass through them (``retain_graph=True``); otherwise each HVP
    recomputes the forward and first backward per batch (less memory).

    Returns (hvp_fn, stats) where ``stats['hvp_calls']`` counts HVPs and
    ``stats['loss']`` is L at ``params`` (float).
    """
    fns = [loss_fns] if callable(loss_fns) else list(loss_fns)
    params = list(params)
    if not fns:
        raise QuantdynError("hvp_from_loss: no loss (no batches given)")
    w = [1.0 / len(fns)] * len(fns) if weights is None else [float(x) for x in weights]
    stats = {"hvp_calls": 0, "loss": 0.0}

    def grads_of(fn: Callable[[], torch.Tensor], wb: float) -> tuple[Tensors, float]:
        loss = fn()
        g = torch.autograd.grad(loss * wb, params, create_graph=True, allow_unused=True)
        g = [torch.zeros_like(p) if gi is None else gi for gi, p in zip(g, params)]
        return g, float(loss.detach()) * wb

    if reuse_graph:
        total: Tensors | None = None
        for fn, wb in zip(fns, w):
            g, lv = grads_of(fn, wb)
            stats["loss"] += lv
            total = g if total is None else [a + b for a, b in zip(total, g)]
        grads = total

        live = [i for i, g in enumerate(grads) if g.requires_grad]  # others: H rows are 0

        def hvp(vs: Tensors) -> Tensors:
            stats["hvp_calls"] += 1
            if not live:
                return [torch.zeros_like(p) for p in params]
            hv = torch.autograd.grad(
                [grads[i] for i in live], params, grad_outputs=[vs[i] for i in live],
                retain_graph=True, allow_unused=True,
            )
            return [torch.zeros_like(p) if h is None else h.detach() for h, p in zip(hv, params)]

        return hvp, stats

    with torch.no_grad():
        stats["loss"] = sum(float(fn()) * wb for fn, wb in zip(fns, w))

    def hvp_recompute(vs: Tensors) -> Tensors:
        stats["hvp_calls"] += 1
        out = [torch.zeros_like(p) for p in params]
        for fn, wb in zip(fns, w):
            g, _ = grads_of(fn, wb)
            live = [i for i, gi in enumerate(g) if gi.requires_grad]
            if not live:
                continue
            hv = torch.autograd.grad([g[i] for i in live], params, grad_outputs=[vs[i] for i in live], allow_unused=True)
            out = [o if h is None else o + h.detach() for o, h in zip(out, hv)]
        return out

    return hvp_recompute, stats


def next_token_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``ids`` (LongTensor [B, T]) under ``model``
    (quantdyn GPT or HF causal LM)."""

    logits = logits_of(model, ids)  # (B, T, V)
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))


# ----------------------------------------------------------------------------
# parameter groups

_BLOCK_RE = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer|block)\.(\d+)\.(.+)$")


def block_group(name: str, param: torch.Tensor | None = None) -> str:
    """Group of a parameter by transformer block: 'block.<i>' for parameters
    under ``...layers.<i>.`` (also ``h``, ``blocks``, ``layer``), 'embed' for
    input embeddings, 'head' for the output head, 'other' otherwise (final norm)."""
    m = _BLOCK_RE.search(name)
    if m:
        return f"block.{int(m.group(1))}"
    low = name.lower()
    if "embed_in" in low or "wte" in low or "wpe" in low or "embed_tokens" in low:
        return "embed"
    if "embed_out" in low or "lm_head" in low:
        return "head"
    return "other"


def layer_type_group(name: str, param: torch.Tensor | None = None) -> str:
    """Group of a parameter by module role, pooled over blocks: the module
    path inside the block, e.g. 'attention.query_key_value', 'mlp.dense_4h_to_h',
    'input_layernorm'; parameters outside blocks keep their module path
    ('gpt_neox.embed_in', 'embed_out', ...)."""
    m = _BLOCK_RE.search(name)
    path = m.group(2) if m else name
    return path.rsplit(".", 1)[0] if "." in path else path


def resolve_groups(
    named_params: Sequence[tuple[str, torch.Tensor]], groups: GroupSpec | str | None
) -> dict[str, list[int]] | None:
    """Map a grouping (dict name -> params, function (name, param) -> group or
    None to leave out, or 'none'/'block'/'layer_type') to indices into
    ``named_params``; groups are kept in first-seen order."""
    if groups is None or groups == "none":
        return None
    if isinstance(groups, str):
        if groups not in GROUPINGS:
            raise unknown_name("parameter grouping", groups, GROUPINGS)
        groups = block_group if groups == "block" else layer_type_group
    out: dict[str, list[int]] = {}
    if callable(groups):
        for i, (n, p) in enumerate(named_params):
            g = groups(n, p)
            if g is not None:
                out.setdefault(str(g), []).append(i)
        return out
    by_id = {id(p): i for i, (_, p) in enumerate(named_params)}
    for g, ps in groups.items():
        idx = []
        for p in ps:
            if id(p) not in by_id:
                raise QuantdynError(f"parameter group '{g}' holds a tensor that is not among the parameters analysed")
            idx.append(by_id[id(p)])
        out[str(g)] = idx
    return out


# ----------------------------------------------------------------------------
# model-level wrapper


def hessian_metrics(
    model: nn.Module,
    batches: torch.Tensor | Sequence[torch.Tensor],
    cfg: HessianConfig = HessianConfig(),
    params: Sequence[tuple[str, torch.Tensor]] | None = None,
    groups: GroupSpec | None = None,
) -> dict:
    """Hessian trace and top eigenvalues of the held-out next-token loss.

    Args:
      model: quantdyn ``GPT`` or HF causal LM; put in eval mode while measuring
        (restored after), and ``requires_grad`` is switched on for the analysed
        parameters only (restored after).
      batches: LongTensor [B, T] or a sequence of them (held-out token ids).
        The loss is the token-weighted mean CE over the first ``cfg.batches``.
      cfg: :class:`HessianConfig`.
      params: (name, parameter) pairs to analyse (default: all of
        ``model.named_parameters()``, as PyHessian).
      groups: overrides ``cfg.groups``: dict group -> list of parameters, or a
        function (name, param) -> group name (None = in no group).

    Returns a dict: ``loss``, ``n_params``, ``n_batches``, ``n_tokens``,
    ``trace``, ``trace_se``, ``trace_probes``, ``trace_converged``,
    ``top_eigenvalues``, ``eig_iterations``, ``eig_converged``, ``hvp_calls``,
    ``seconds`` and, with groups, ``groups``: {name: {n_params, trace,
    trace_se[, top_eigenvalues]}}.  Group traces are tr(H_gg) estimated from
    the same probes and sum to ``trace``.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if isinstance(batches, torch.Tensor):
        batches = [batches]
    batches = list(batches)
    if cfg.batches:
        batches = batches[: cfg.batches]
    if not batches:
        raise QuantdynError("hessian: no held-out batches given")
    for b in batches:
        if b.dim() != 2 or b.dtype not in (torch.long, torch.int32) or b.size(1) < 2:
            raise QuantdynError(
                f"hessian: batches must be integer token ids shaped [B, T] with T >= 2, got {tuple(b.shape)} {b.dtype}"
            )
    named = list(model.named_parameters()) if params is None else list(params)
    if not named:
        raise QuantdynError("hessian: no parameters to analyse")
    spec = groups if groups is not None else cfg.groups
    group_idx = resolve_groups(named, spec)
    tensors = [p for _, p in named]
    device = tensors[0].device
    n_tok = [b.size(0) * (b.size(1) - 1) for b in batches]
    weights = [n / sum(n_tok) for n in n_tok]

    def loss_fn(b: torch.Tensor) -> Callable[[], torch.Tensor]:
        def f() -> torch.Tensor:
            with sdpa_kernel(SDPBackend.MATH):
                return next_token_loss(model, b.to(device))

        return f

    was_training = model.training
    old_flags = {id(p): p.requires_grad for p in model.parameters()}
    chosen = {id(p) for p in tensors}
    t0 = time.perf_counter()
    try:
        model.eval()
        for p in model.parameters():
            p.requires_grad_(id(p) in chosen)
        hvp, stats = hvp_from_loss([loss_fn(b) for b in batches], tensors, weights, cfg.reuse_graph)
        out: dict = {
            "loss": stats["loss"],
            "n_params": sum(p.numel() for p in tensors),
            "n_batches": len(batches),
            "n_tokens": sum(n_tok),
        }
        if cfg.trace_max_probes:
            tr = hutchinson_trace(
                hvp, tensors, cfg.trace_max_probes, cfg.trace_tol, cfg.trace_min_probes, cfg.seed,
                None if group_idx is None else list(group_idx.values()),
            )
            out.update(trace=tr["trace"], trace_se=tr["se"], trace_probes=tr["probes"], trace_converged=tr["converged"])
        if cfg.top_k:
            eig = _eigs(hvp, tensors, cfg.top_k, cfg)
            out.update(top_eigenvalues=eig["eigenvalues"], eig_iterations=eig["iterations"], eig_converged=eig["converged"])
        if group_idx is not None:
            gout: dict[str, dict] = {}
            for gi, (g, idx) in enumerate(group_idx.items()):
                row: dict = {"n_params": sum(tensors[j].numel() for j in idx)}
                if cfg.trace_max_probes:
                    row.update(trace=tr["groups"][gi]["trace"], trace_se=tr["groups"][gi]["se"])
                if cfg.group_top_k:
                    row["top_eigenvalues"] = _eigs(_restrict(hvp, tensors, idx), [tensors[j] for j in idx], cfg.group_top_k, cfg)["eigenvalues"]
                gout[g] = row
            out["groups"] = gout
        out["hvp_calls"] = stats["hvp_calls"]
        out["seconds"] = time.perf_counter() - t0
        return out
    finally:
        for p in model.parameters():
            p.requires_grad_(old_flags[id(p)])
        model.train(was_training)


def _eigs(hvp: HVPFn, tensors: Tensors, k: int, cfg: HessianConfig) -> dict:
    fn = top_eigenvalues if cfg.eig_method == "power" else lanczos_top_eigenvalues
    out = fn(hvp, tensors, k, cfg.eig_max_iter, cfg.eig_tol, cfg.seed)
    if cfg.eig_method == "lanczos":  # one Krylov run serves all k values
        out["iterations"] = [out["iterations"]] * len(out["eigenvalues"])
    return out


def _restrict(hvp: HVPFn, tensors: Tensors, idx: list[int]) -> HVPFn:
    """HVP of the diagonal block H_gg: zero-pad v outside the group, keep (Hv)_g."""

    def f(vs: Tensors) -> Tensors:
        full = [torch.zeros_like(p) for p in tensors]
        for j, v in zip(idx, vs):
            full[j] = v
        hv = hvp(full)
        return [hv[j] for j in idx]

    return f


# ----------------------------------------------------------------------------
# the cheap early warning: curvature along one direction from three losses


@torch.no_grad()
def curvature_along(
    loss_fn: Callable[[], torch.Tensor], params: Sequence[torch.Tensor], direction: Sequence[torch.Tensor],
    rel_step: float = 1e-2,
) -> dict:
    """The curvature of the loss along ``direction`` d, k = uᵀ H u with u = d / |d|, by a central finite
    difference of three losses on the batch ``loss_fn`` evaluates: (L(w + h u) − 2 L(w) + L(w − h u)) / h².

    Why this signal (issue 48.5): it costs three forward passes and no double backward (a Hutchinson trace needs
    a Hessian-vector product per probe), and along the optimizer's last update it is the curvature the training
    step itself sees, the direction in which the LR decay settles the weights into a sharper valley.

    ``h = rel_step · |w|`` (the norm of all ``params``): a step relative to the weights, so the same setting
    serves any model size. Its error: truncation O(h² · L⁗) and rounding ≈ 4 ε |L| / h² (ε of the losses'
    dtype). The default 1e-2 is for float32 losses: on a 1-layer d=32 GPT (|w| ≈ 13) rounding is then ≈ 1e-4
    in absolute curvature, truncation ≈ 0.6 % relative (5.7e-5 at 1e-3, measured in float64); curvature along
    a random direction of an untrained model (6.6e-4) is below that floor, along a trained model's update it is
    orders of magnitude above it. The weights are restored bit for bit
    (copied back from a clone). Returns {"curvature", "slope" (the first derivative along u), "loss", "h"}."""
    params = list(params)
    norm_d = math.sqrt(sum(float(d.double().pow(2).sum()) for d in direction))
    if not norm_d > 0:
        raise QuantdynError("curvature_along: the direction is zero (no update since the last call?)")
    norm_w = math.sqrt(sum(float(p.double().pow(2).sum()) for p in params))
    h = rel_step * (norm_w if norm_w > 0 else 1.0)
    saved = [p.detach().clone() for p in params]
    units = [d.to(p.dtype) / norm_d for d, p in zip(direction, params)]
    try:
        l0 = float(loss_fn())
        for p, u in zip(params, units):
            p.add_(u, alpha=h)
        lp = float(loss_fn())
        for p, s, u in zip(params, saved, units):
            p.copy_(s).add_(u, alpha=-h)
        lm = float(loss_fn())
    finally:
        for p, s in zip(params, saved):
            p.copy_(s)
    return {"curvature": (lp - 2 * l0 + lm) / (h * h), "slope": (lp - lm) / (2 * h), "loss": l0, "h": h}
