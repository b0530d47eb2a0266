"""GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for
Generative Pre-trained Transformers", Algorithm 1), as in IST-DASLab/gptq.

Symbols: W (out x in) the weight, one row per output channel; X the layer
inputs; H = 2/N sum_n X_n X_n^T the Hessian of the layer loss
||W X - W_hat X||^2 (N = number of calibration samples, a running average over
streamed batches, :func:`hessian_update`). Per layer:

1. dead columns (H_ii = 0): H_ii = 1, W[:, i] = 0;
2. optional column order: act-order (decreasing H_ii) or group-aware reordering;
3. H += damp_percent * mean(diag H) * I; Hinv = upper Cholesky factor U of H^-1
   (H^-1 = U^T U), so that step i of the OBS update only needs row i of U;
4. columns in blocks of ``block_size``: q_i = Q(w_i), err_i = (w_i - q_i) / U_ii,
   w_j -= err_i U_ij for the remaining columns j of the block, then one lazy
   update W[:, later] -= Err_block @ U[block, later];
5. groups: "dynamic" grids (min-max of the current, partly updated weights when
   column i starts a group, i % group_size == 0) or "static" grids (of the
   original weights; with act-order a column's group is perm[i] // group_size).

Faithfulness: the column loop performs the reference's element-wise
operations in the same order, so codes and dequantized weights are bitwise
equal to the reference in float32 (tests/test_gptq.py checks golden fixtures).
That includes one quirk of the reference: a dynamic group that starts inside a
lazy block takes its grid from the weights as they were at the block's start.
Speed comes from doing fewer, contiguous kernel calls per column (the block
is processed transposed, losses are summed once per layer) — see
bench/gptq_speed.py; on few CPU cores wrap calls in ``num_threads(1)``.
"""
from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass
from typing import Callable

import torch

from quantdyn.errors import QuantdynError
from quantdyn.quantize.config import QUANTIZERS, QuantConfig, QuantMethod, compute_dtype
from quantdyn.quantize.primitives import (
    QuantResult,
    check_bits,
    check_group_size,
    check_weight,
    find_params,
    group_index,
    group_params,
    num_threads,
)

# ----------------------------------------------------------------------------- statistics


@dataclass(frozen=True)
class ActStats:
    """Calibration statistics of one linear layer's inputs (pure value; see stats_update)."""

    H: torch.Tensor
    """(in, in) float32: 2/n * sum over samples of sum_tokens x x^T (reference add_batch)."""
    n: int
    """Number of samples (sequences) averaged into H."""
    abs_sum: torch.Tensor
    """(in,) float64: sum over tokens of |x| (AWQ activation scale = abs_sum / tokens)."""
    tokens: int
    """Number of token rows seen."""

    @property
    def abs_mean(self) -> torch.Tensor:
        return (self.abs_sum / max(self.tokens, 1)).float()


def hessian_update(H: torch.Tensor | None, n: int, X: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Running average H = 2/n sum x x^T after one more batch X (batch, tokens, in) or (tokens, in).

    As the reference ``GPTQ.add_batch``: a 2-D X counts as one sample, a 3-D X
    as X.shape[0] samples; H is scaled by n / (n + batch) before adding
    (sqrt(2/n) X)(sqrt(2/n) X)^T, so the streamed result equals the batch one.
    """
    if X.dim() == 2:
        X = X.unsqueeze(0)
    if X.dim() != 3:
        raise QuantdynError(f"layer input must be (batch, tokens, features), got shape {tuple(X.shape)}")
    batch = X.shape[0]
    d = X.shape[-1]
    X = X.reshape(-1, d).t()
    if H is None:
        H = torch.zeros((d, d), device=X.device, dtype=torch.float32)
    else:
        H = H.clone()
    H *= n / (n + batch)
    n += batch
    X = math.sqrt(2 / n) * X.float()
    H += X.matmul(X.t())
    return H, n


def stats_update(stats: ActStats | None, X: torch.Tensor, need_abs: bool = True) -> ActStats:
    """Fold one batch of layer inputs into ActStats (H as :func:`hessian_update`, plus sum |x|)."""
    if not torch.isfinite(X).all():
        raise QuantdynError("calibration activations contain NaN or Inf; check the model weights "
                            "and the calibration data (or run in float32)")
    H, n = hessian_update(None if stats is None else stats.H, 0 if stats is None else stats.n, X)
    flat = X.reshape(-1, X.shape[-1])
    if need_abs:
        a = flat.abs().sum(0, dtype=torch.float64)
        abs_sum = a if stats is None else stats.abs_sum + a
    else:
        abs_sum = torch.zeros(X.shape[-1], dtype=torch.float64, device=X.device) if stats is None else stats.abs_sum
    return ActStats(H=H, n=n, abs_sum=abs_sum, tokens=(0 if stats is None else stats.tokens) + flat.shape[0])


def stats_from(X: torch.Tensor) -> ActStats:
    """ActStats of one tensor of inputs (batch, tokens, in) or (tokens, in)."""
    return stats_update(None, X)


# ----------------------------------------------------------------------------- pieces


def group_aware_perm(diag_h: torch.Tensor, group_size: int) -> torch.Tensor:
    """GPTQModel's group-aware reordering (GAR): groups stay contiguous, ordered by
    their largest H_ii (descending), columns inside a group by H_ii (descending)."""
    C = diag_h.numel()
    if C % group_size:
        raise QuantdynError(
            f"act_group_aware needs group_size={group_size} to divide in_features={C}; "
            f"choose a divisor or use act_order"
        )
    d = diag_h.reshape(C // group_size, group_size)
    local = torch.argsort(d, dim=1, descending=True)
    order = torch.argsort(d.max(1).values, descending=True)
    return (local[order] + order[:, None] * group_size).reshape(-1)


def inverse_hessian_cholesky(
    H: torch.Tensor | Callable[[], torch.Tensor], damp_percent: float, damp_auto_increment: float = 0.0
) -> tuple[torch.Tensor, float]:
    """Upper Cholesky factor U of (H + damp * mean(diag H) I)^-1 and the damp fraction used.

    Retries with damp raised by ``damp_auto_increment`` while the damped H is not
    positive definite (GPTQModel); without it, an error says what to change.
    ``H`` is the Hessian (left untouched: it is damped on a copy) or a function that returns a fresh scratch
    copy of it at each call: that copy is damped in place and dropped as soon as it is factored, so at most
    three C x C matrices exist at once with the caller's H instead of four (1 GB less at C = 11,008, 3 GB at
    C = 27,648). The values are the same either way.
    """
    scratch = H if callable(H) else H.clone
    H2 = scratch()
    C = H2.shape[0]
    idx = torch.arange(C, device=H2.device)
    mean_diag = torch.mean(torch.diag(H2))
    pct = damp_percent
    while True:
        H2 = scratch() if H2 is None else H2
        H2[idx, idx] += pct * mean_diag
        L, info = torch.linalg.cholesky_ex(H2)
        H2 = None  # intermediates are dropped as soon as possible: each is a C x C matrix (64 MB at C = 4096)
        if int(info) == 0:
            inv = torch.cholesky_inverse(L)
            del L
            U, info = torch.linalg.cholesky_ex(inv, upper=True)
            del inv
            if int(info) == 0:
                return U, pct
        if damp_auto_increment <= 0 or pct + damp_auto_increment >= 1:
            raise QuantdynError(
                f"GPTQ: the damped Hessian is not positive definite (damp_percent={pct:g}); raise "
                f"damp_percent, set damp_auto_increment > 0, or use more calibration data"
            )
        pct += damp_auto_increment


#: the column loop is graphed only for layers of at least this many full blocks (capturing costs one block's
#: Python time; block 0 runs eagerly)
GRAPH_MIN_BLOCKS = 3
CUDA_GRAPH_ENV = "QUANTDYN_GPTQ_CUDA_GRAPH"


def _graph_capture_possible(W: torch.Tensor) -> bool:
    """CUDA graphs exist on CUDA devices only (tests replace this to run :class:`_GraphedBlock`'s buffers and
    order on a CPU without capturing)."""
    return W.is_cuda


def _column_steps(W1T: torch.Tensor, CTb: torch.Tensor, QTb: torch.Tensor, ETb: torch.Tensor, Hinv1: torch.Tensor,
                  maxq: int, params_at: Callable[[int], tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Step 4 inside one block: W1T (count, R) holds the block's columns as rows and is updated in place;
    codes, dequantized values and scaled errors go to rows of CTb, QTb, ETb; ``params_at(i)`` gives column i's
    grid (scale, zero)."""
    # views made once per block (indexing per column costs as much as a kernel)
    ws, cs, qs, es = W1T.unbind(0), CTb.unbind(0), QTb.unbind(0), ETb.unbind(0)
    hs, ds = Hinv1.unbind(0), Hinv1.diagonal().unbind(0)
    count = W1T.shape[0]
    for i in range(count):
        s, z = params_at(i)
        w, c, q, e = ws[i], cs[i], qs[i], es[i]
        torch.div(w, s, out=c)                      # code = clamp(round(w / s) + z, 0, maxq)
        c.round_().add_(z).clamp_(0, maxq)
        torch.sub(c, z, out=q).mul_(s)              # q = s * (code - z)
        torch.sub(w, q, out=e).div_(ds[i])          # err = (w - q) / U_ii
        if i + 1 < count:                           # w_j -= err * U_ij, j > i in the block
            W1T[i + 1:].sub_(torch.outer(hs[i][i + 1:], e))


class _GraphedBlock:
    """The column loop of one full block of ``bs`` columns as a CUDA graph over fixed buffers: ``run`` copies a
    block's weights (R, bs) and inverse-Hessian block (bs, bs) in, replays, and leaves the codes, dequantized
    values and scaled errors in ``C``, ``Q``, ``E`` (bs, R); it returns the grids of the groups that start in the
    block (dynamic groups: from the block's weights as they were at its start, as the eager loop).  Captured at
    the first ``run`` (capture records without executing, so that run replays too); ``capture=False`` runs the
    same steps over the same buffers directly (a CPU test of everything but the capture)."""

    def __init__(self, R: int, bs: int, g: int, dtype, device, bits: int, sym: bool, mse: bool,
                 fixed: tuple[torch.Tensor, torch.Tensor] | None, capture: bool = True):
        kw = dict(dtype=dtype, device=device)
        self.bs, self.g, self.bits, self.sym, self.mse, self.maxq = bs, g, bits, sym, mse, check_bits(bits)
        self.W_in, self.W1T = torch.empty((R, bs), **kw), torch.empty((bs, R), **kw)
        self.H1 = torch.empty((bs, bs), **kw)
        self.C, self.Q, self.E = (torch.empty((bs, R), **kw) for _ in range(3))
        n_groups = bs // g if g else 0
        self.S, self.Z = torch.empty((n_groups, R), **kw), torch.empty((n_groups, R), **kw)
        self.fixed, self.capture = fixed, capture
        self.graph = None

    def _params_at(self, i: int):
        if not self.g:
            return self.fixed
        k, r = divmod(i, self.g)
        if r == 0:
            s, z = find_params(self.W_in[:, i:i + self.g], self.bits, self.sym, self.mse)
            self.S[k].copy_(s)
            self.Z[k].copy_(z)
        return self.S[k], self.Z[k]

    def run(self, W_block: torch.Tensor, Hinv1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.W_in.copy_(W_block)
        self.H1.copy_(Hinv1)
        if not self.capture:
            self._steps()
        else:
            if self.graph is None:
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph):
                    self._steps()
            self.graph.replay()
        return self.S, self.Z

    def _steps(self) -> None:
        self.W1T.copy_(self.W_in.t())
        _column_steps(self.W1T, self.C, self.Q, self.E, self.H1, self.maxq, self._params_at)


# ----------------------------------------------------------------------------- GPTQ


@torch.no_grad()
def gptq(W: torch.Tensor, H: torch.Tensor | ActStats, cfg: QuantConfig, *,
         cuda_graph: bool | None = None) -> QuantResult:
    """Quantize W (out, in) with GPTQ given the layer Hessian H (in, in); pure (inputs untouched).

    ``cuda_graph`` (on a CUDA device; default: the environment variable ``QUANTDYN_GPTQ_CUDA_GRAPH=1``): the
    column loop of every full block after the first is one CUDA graph replay (:class:`_GraphedBlock`): the same
    kernels in the same order, so the same bits, without the ~10 kernel launches per column from Python that
    bound the eager loop on a GPU (0.06-0.31 s per layer on an H100).  Off by default until it has run on a GPU:
    tests/gpu/test_gpu_gptq_graph.py checks the bits there, bench/gptq_speed.py --device cuda times both."""
    if isinstance(H, ActStats):
        H = H.H
    check_weight(W)
    maxq = check_bits(cfg.bits)
    R, C = W.shape
    if H.shape != (C, C):
        raise QuantdynError(f"GPTQ: Hessian of shape {tuple(H.shape)} does not match weight in_features={C}")
    if not torch.isfinite(H).all():
        raise QuantdynError("GPTQ: the Hessian contains NaN or Inf; check the calibration activations")
    t0 = time.perf_counter()
    dtype = compute_dtype(W)
    W = W.to(dtype).clone()
    g = check_group_size(cfg.group_size, C)
    bits, sym, mse = cfg.bits, cfg.sym, cfg.mse

    s = z = None
    if not g:  # one grid per row, from the weights before dead columns are zeroed (as the reference)
        s, z = find_params(W, bits, sym, mse)
    diag_h = torch.diag(H).to(device=W.device, dtype=dtype)  # a copy
    dead = diag_h == 0
    diag_h[dead] = 1
    W[:, dead] = 0

    static_s = static_z = None
    if g and cfg.static_groups:
        sc, zc = group_params(W, bits, sym, g, mse)  # (R, G) from the original weights
        static_s, static_z = sc.t().contiguous(), zc.t().contiguous()

    perm = None
    if cfg.act_order:
        perm = torch.argsort(diag_h, descending=True)
    elif cfg.act_group_aware and g:
        perm = group_aware_perm(diag_h, g)
    if perm is not None:
        W = W[:, perm]

    device = W.device

    def scratch_hessian() -> torch.Tensor:
        """GPTQ's own copy of H: dead columns' diagonal set to 1, rows and columns in the processing order."""
        Hs = H.to(device=device, dtype=dtype).clone()
        Hs[dead, dead] = 1
        if perm is not None:  # one C x C gather at a time
            Hs = Hs.index_select(0, perm)
            Hs = Hs.index_select(1, perm)
        return Hs

    Hinv, damp = inverse_hessian_cholesky(scratch_hessian, cfg.damp_percent, cfg.damp_auto_increment)

    # Transposed buffers: row p holds column p of the (permuted) weight, so every
    # per-column kernel reads and writes contiguous memory.
    QT = torch.empty((C, R), dtype=dtype, device=W.device)   # dequantized values
    CT = torch.empty((C, R), dtype=dtype, device=W.device)   # integer codes (as floats)
    ET = torch.empty((C, R), dtype=dtype, device=W.device)   # scaled errors (w - q) / U_ii
    if static_s is not None:
        src = perm if perm is not None else torch.arange(C, device=W.device)
        col_group = (src // g).tolist()
    dyn_s: list[torch.Tensor] = []
    dyn_z: list[torch.Tensor] = []
    bs = cfg.block_size
    on_cpu = W.device.type == "cpu"
    graphed = None
    if cuda_graph is None:
        cuda_graph = os.environ.get(CUDA_GRAPH_ENV, "") == "1"
    if cuda_graph and _graph_capture_possible(W) and static_s is None and (not g or bs % g == 0) \
            and C // bs >= GRAPH_MIN_BLOCKS:
        graphed = _GraphedBlock(R, bs, g, W.dtype, W.device, bits, sym, mse, None if g else (s, z),
                                capture=W.is_cuda)
    for i1 in range(0, C, bs):
        i2 = min(i1 + bs, C)
        if graphed is not None and i1 > 0 and i2 - i1 == bs:  # block 0 ran eagerly: the kernels are warm
            s_blk, z_blk = graphed.run(W[:, i1:i2], Hinv[i1:i2, i1:i2])
            CT[i1:i2].copy_(graphed.C)
            QT[i1:i2].copy_(graphed.Q)
            ET[i1:i2].copy_(graphed.E)
            for k in range(len(s_blk)):
                dyn_s.append(s_blk[k].clone())
                dyn_z.append(z_blk[k].clone())
        else:
            def params_at(i: int, col0: int = i1, W: torch.Tensor = W):
                nonlocal s, z
                col = col0 + i
                if g:
                    if static_s is not None:
                        return static_s[col_group[col]], static_z[col_group[col]]
                    if col % g == 0:
                        s, z = find_params(W[:, col:col + g], bits, sym, mse)
                        dyn_s.append(s)
                        dyn_z.append(z)
                return s, z

            # ~10 small kernels per column: on CPU extra threads only add overhead (elementwise
            # results do not depend on the thread count; the lazy GEMM below keeps the caller's)
            with num_threads(1) if on_cpu else contextlib.nullcontext():
                _column_steps(W[:, i1:i2].t().contiguous(), CT[i1:i2], QT[i1:i2], ET[i1:i2], Hinv[i1:i2, i1:i2],
                              maxq, params_at)
        if i2 < C:
            W[:, i2:] -= ET[i1:i2].t().matmul(Hinv[i1:i2, i2:])
    del graphed  # its memory pool (the block's temporaries) goes with it

    # back to the original column order
    if g and static_s is not None:
        scales, zeros = static_s.t().contiguous(), static_z.t().contiguous()
        g_idx = group_index(C, g, W.device)
    elif g:
        scales, zeros = torch.stack(dyn_s, 1), torch.stack(dyn_z, 1)
        g_idx = group_index(C, g, W.device)
        if cfg.act_order:  # group of permuted position p is p // g
            g_idx = torch.empty_like(g_idx).scatter_(0, perm, g_idx)
        elif perm is not None:  # GAR: permuted group k is original group perm[k*g] // g
            order = perm[::g] // g
            scales = torch.empty_like(scales).index_copy_(1, order, scales)
            zeros = torch.empty_like(zeros).index_copy_(1, order, zeros)
    else:
        scales, zeros = s[:, None], z[:, None]
        g_idx = group_index(C, 0, W.device)

    # the inverse Hessian (C x C) and the working weight are done with: dropped before the result is assembled,
    # whose temporaries are out x in each (in place where the values allow)
    d = torch.diagonal(Hinv).clone()
    del Hinv, W
    Q, codes, E = QT.t(), CT.t(), ET.t()
    if perm is not None:
        invperm = torch.argsort(perm)
        Q, codes, E = Q[:, invperm], codes[:, invperm], E[:, invperm]
        d = d[invperm]
    del QT, CT, ET
    seconds = time.perf_counter() - t0
    loss = 0.5 * float(E.double().pow_(2).sum())
    gi = g_idx.long()
    clipped = float(E.abs().mul_(d).gt_(scales[:, gi].mul_(0.5).mul_(1 + 1e-4)).mean())
    return QuantResult(
        weight=Q.contiguous(),
        codes=codes.to(torch.uint8),
        scales=scales,
        zeros=zeros,
        g_idx=g_idx,
        bits=bits,
        loss=loss,
        seconds=seconds,
        diagnostics=dict(damp_percent=damp, dead_columns=int(dead.sum()), clipped_fraction=clipped),
        perm=perm,
    )


def _gptq_entry(W: torch.Tensor, stats: ActStats, cfg: QuantConfig) -> QuantResult:
    if stats is None:
        raise QuantdynError("GPTQ needs calibration data (a Hessian); pass calibration token ids")
    return gptq(W, stats, cfg)


QUANTIZERS.add("gptq", QuantMethod(fn=_gptq_entry, needs_calibration=True))
