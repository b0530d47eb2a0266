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
from typing import Callable, Sequence

import torch

from quantdyn.errors import QuantdynError
from quantdyn.quantize.catalogue import QUANTIZERS, QuantConfig, QuantMethod, compute_dtype
from quantdyn.quantize.primitives import (
    QuantResult,
    all_finite,
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
    if not all_finite(X):
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
                  D: torch.Tensor, maxq: int | torch.Tensor, params_at: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                  B: int = 1) -> None:
    """Step 4 inside one block, for B stacks side by side (a stack: the rows of the weights that share one inverse
    Hessian). W1T (count, B*R) holds the block's columns as rows (column i of stack b is ``W1T[i, b*R:(b+1)*R]``)
    and is updated in place; codes, dequantized values and scaled errors go to rows of CTb, QTb, ETb. ``Hinv1``
    is the inverse-Hessian block (count, count) of the one stack, or (count, count, B) with the stack last;
    ``D`` column i's U_ii: (count,) for one stack, else (count, B*R), one per entry. ``maxq`` is an int or one
    per entry (B*R,); ``params_at(i)`` gives column i's grid (scale, zero), each (B*R,). Every operation is
    element-wise per entry with one rounding, so an entry's bits do not depend on what else is in the stack: a
    weight stacked with others gets the bits of its own loop."""
    ws, cs, qs, es, ds = W1T.unbind(0), CTb.unbind(0), QTb.unbind(0), ETb.unbind(0), D.unbind(0)
    count = W1T.shape[0]
    per_entry = isinstance(maxq, torch.Tensor)
    if B == 1:  # views made once per block (indexing per column costs as much as a kernel)
        hs = Hinv1.unbind(0)
    else:  # the update's product goes to a contiguous buffer: a broadcast product would get a strided layout
        W3 = W1T.view(count, B, -1)
        prod = torch.empty_like(W3)
    for i in range(count):
        s, z = params_at(i)
        w, c, q, e = ws[i], cs[i], qs[i], es[i]
        torch.div(w, s, out=c)                      # code = clamp(round(w / s) + z, 0, maxq)
        c.round_().add_(z)
        if per_entry:
            torch.minimum(c.clamp_min_(0), maxq, out=c)
        else:
            c.clamp_(0, maxq)
        torch.sub(c, z, out=q).mul_(s)              # q = s * (code - z)
        torch.sub(w, q, out=e).div_(ds[i])          # err = (w - q) / U_ii
        if i + 1 < count:                           # w_j -= err * U_ij, j > i in the block
            if B == 1:
                W1T[i + 1:].sub_(torch.outer(hs[i][i + 1:], e))
            else:
                n = count - i - 1
                W3[i + 1:].sub_(torch.mul(Hinv1[i, i + 1:, :, None], e.view(1, B, -1), out=prod[:n]))


def _block_views(W_blocks: list[torch.Tensor], H_blocks: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The column loop's inputs for one block of B stacks: W1T (count, B*R), the inverse-Hessian block(s) and
    D (see :func:`_column_steps`)."""
    if len(W_blocks) == 1:
        return W_blocks[0].t().contiguous(), H_blocks[0], H_blocks[0].diagonal()
    count, B, R = W_blocks[0].shape[1], len(W_blocks), W_blocks[0].shape[0]
    # contiguous rows: a reshape would keep the permuted strides and every per-column kernel would be strided
    W1T = torch.stack(W_blocks, 0).permute(2, 0, 1).contiguous().view(count, B * R)
    D = torch.stack([h.diagonal() for h in H_blocks], 1)[:, :, None].expand(count, B, R).reshape(count, B * R)
    return W1T, torch.stack(H_blocks, -1), D


class _Member:
    """One weight matrix of a :func:`gptq_batch` call: its configuration, where its rows sit in the stacked
    buffers, and its grids (fixed per row, static per group, or dynamic: found as its groups start)."""

    def __init__(self, index: int, W: torch.Tensor, cfg: QuantConfig, g: int):
        self.index, self.cfg, self.g = index, cfg, g
        self.maxq = check_bits(cfg.bits)
        self.R = W.shape[0]
        self.W: torch.Tensor | None = W  # the caller's weight, until the stack is laid out
        self.b = self.r0 = 0  # stack and first row in it: set when the stacks are laid out
        self.s = self.z = None  # one grid per row (g == 0)
        self.static_s = self.static_z = None  # (groups, R): static groups
        self.col_group: list[int] = []
        self.dyn_s: list[torch.Tensor] = []
        self.dyn_z: list[torch.Tensor] = []

    @property
    def dynamic(self) -> bool:
        return bool(self.g) and self.static_s is None

    def grid_of(self, W: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, zero) per row of ``W``, this member's rows and a group's columns."""
        return find_params(W, self.cfg.bits, self.cfg.sym, self.cfg.mse)


class _Stack:
    """Weights that share one Hessian and column order: their rows are stacked, one inverse Hessian serves all."""

    def __init__(self, H: torch.Tensor, key: tuple):
        self.H, self.key = H, key
        self.members: list[_Member] = []
        self.W: torch.Tensor | None = None  # (R, C) the stacked working weight, permuted
        self.Hinv: torch.Tensor | None = None
        self.perm: torch.Tensor | None = None
        self.dead: torch.Tensor | None = None
        self.d: torch.Tensor | None = None  # diag of Hinv, kept once Hinv is dropped
        self.damp = 0.0

    @property
    def rows(self) -> int:
        return sum(m.R for m in self.members)


class _GraphedBlock:
    """The column loop of one full block of ``bs`` columns as a CUDA graph over fixed buffers: ``run`` copies a
    block's weights (B, R, bs) and inverse-Hessian blocks (B, bs, bs) in, replays, and leaves the codes,
    dequantized values and scaled errors in ``C``, ``Q``, ``E`` (bs, B*R); it returns, per member, the grids of
    its groups that start in the block (dynamic groups: from the block's weights as they were at its start, as
    the eager loop). Captured at the first ``run`` (capture records without executing, so that run replays too);
    ``capture=False`` runs the same steps over the same buffers directly (a CPU test of everything but the
    capture)."""

    def __init__(self, B: int, R: int, bs: int, members: list[_Member], s_fixed: torch.Tensor,
                 z_fixed: torch.Tensor, maxq, dtype, device, capture: bool = True):
        kw = dict(dtype=dtype, device=device)
        self.B, self.R, self.bs, self.members, self.maxq = B, R, bs, members, maxq
        self.W_in, self.W1T = torch.empty((B, R, bs), **kw), torch.empty((bs, B * R), **kw)
        self.H_in = torch.empty((B, bs, bs), **kw)
        self.H1 = torch.empty((bs, bs) if B == 1 else (bs, bs, B), **kw)
        self.D = torch.empty((bs,) if B == 1 else (bs, B * R), **kw)
        self.C, self.Q, self.E = (torch.empty((bs, B * R), **kw) for _ in range(3))
        self.s_cur, self.z_cur = s_fixed.clone(), z_fixed.clone()  # per-row grids stay; group grids are copied in
        self.S = {m.index: torch.empty((bs // m.g, m.R), **kw) for m in members if m.g}
        self.Z = {m.index: torch.empty((bs // m.g, m.R), **kw) for m in members if m.g}
        self.capture = capture
        self.graph = None

    def _params_at(self, i: int):
        for m in self.members:
            if not m.g:
                continue
            k, r = divmod(i, m.g)
            if r == 0:
                s, z = m.grid_of(self.W_in[m.b, m.r0:m.r0 + m.R, i:i + m.g])
                self.S[m.index][k].copy_(s)
                self.Z[m.index][k].copy_(z)
                lo = m.b * self.R + m.r0
                self.s_cur[lo:lo + m.R].copy_(s)
                self.z_cur[lo:lo + m.R].copy_(z)
        return self.s_cur, self.z_cur

    def run(self, W_blocks: torch.Tensor, H_blocks: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        self.W_in.copy_(W_blocks)
        self.H_in.copy_(H_blocks)
        if not self.capture:
            self._steps()
        else:
            if self.graph is None:
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph):
                    self._steps()
            self.graph.replay()
        return {i: (self.S[i], self.Z[i]) for i in self.S}

    def _steps(self) -> None:
        W1T, H1, D = _block_views(list(self.W_in.unbind(0)), list(self.H_in.unbind(0)))
        self.W1T.copy_(W1T)
        self.H1.copy_(H1)
        self.D.copy_(D)
        _column_steps(self.W1T, self.C, self.Q, self.E, self.H1, self.D, self.maxq, self._params_at, self.B)


# ----------------------------------------------------------------------------- GPTQ


@torch.no_grad()
def gptq(W: torch.Tensor, H: torch.Tensor | ActStats, cfg: QuantConfig, *,
         cuda_graph: bool | None = None) -> QuantResult:
    """Quantize W (out, in) with GPTQ given the layer Hessian H (in, in); pure (inputs untouched).

    ``cuda_graph`` (on a CUDA device; default: the environment variable ``QUANTDYN_GPTQ_CUDA_GRAPH=1``): the
    column loop of every full block after the first is one CUDA graph replay (:class:`_GraphedBlock`): the same
    kernels in the same order, so the same bits, without the ~10 kernel launches per column from Python that
    bound the eager loop on a GPU (0.06-0.31 s per layer on an H100).  Off by default until it has run on a GPU:
    tests/gpu/test_gpu_gptq_graph.py checks the bits there, bench/gptq_speed.py --device cuda times both.
    Several weights at once: :func:`gptq_batch` (the same bits, one column loop)."""
    return gptq_batch([(W, H, cfg)], cuda_graph=cuda_graph)[0]


def _stack_key(H: torch.Tensor, cfg: QuantConfig, g: int) -> tuple:
    """What weights must share to share one inverse Hessian: the Hessian itself, the column order (act-order,
    or group-aware reordering with its group size) and the damping."""
    order = "act" if cfg.act_order else (f"gar{g}" if cfg.act_group_aware and g else "")
    return id(H), order, cfg.damp_percent, cfg.damp_auto_increment


@torch.no_grad()
def gptq_batch(problems: Sequence[tuple[torch.Tensor, torch.Tensor | ActStats, QuantConfig]], *,
               cuda_graph: bool | None = None) -> list[QuantResult]:
    """GPTQ of several weights in as few column loops as their settings allow; one QuantResult per problem
    ``(W, H, cfg)``, in order, each bit for bit what :func:`gptq` gives it alone.

    Weights given the *same* Hessian tensor (q/k/v, gate/up: layers reading one input; or gptq3 and gptq4 of one
    layer) with the same column order and damping share one inverse Hessian: their rows are stacked. Stacks with
    the same width, block size and number of rows (e.g. the same layers of two quantizers, each with its own
    Hessian) run side by side in one loop as well. Per-row settings differ freely: bits, group size, symmetry,
    MSE grids, static groups. A column step is the same ~10 element-wise kernels whatever the stack holds,
    so on a GPU, where the eager loop is bound by kernel launches, one loop over k weights costs about what one
    weight costs; on a CPU it saves the per-call overhead (bench/gptq_speed.py --batched)."""
    t0 = time.perf_counter()
    members: list[_Member] = []
    stacks: dict[tuple, _Stack] = {}
    checked: set[int] = set()
    for index, (W, H, cfg) in enumerate(problems):
        if isinstance(H, ActStats):
            H = H.H
        check_weight(W)
        R, C = W.shape
        if H.shape != (C, C):
            raise QuantdynError(f"GPTQ: Hessian of shape {tuple(H.shape)} does not match weight in_features={C}")
        if id(H) not in checked:
            if not all_finite(H):
                raise QuantdynError("GPTQ: the Hessian contains NaN or Inf; check the calibration activations")
            checked.add(id(H))
        g = check_group_size(cfg.group_size, C)
        m = _Member(index, W, cfg, g)
        members.append(m)
        key = _stack_key(H, cfg, g)
        stacks.setdefault(key, _Stack(H, key)).members.append(m)
    # stacks side by side in one loop: same width, block size, compute dtype, device and rows
    loops: dict[tuple, list[_Stack]] = {}
    for st in stacks.values():
        W0, cfg0 = st.members[0].W, st.members[0].cfg
        for m in st.members:
            if m.cfg.block_size != cfg0.block_size or compute_dtype(m.W) != compute_dtype(W0) or m.W.device != W0.device:
                raise QuantdynError("gptq_batch: weights that share a Hessian must share block_size, dtype and device; "
                                    "quantize them in separate calls")
        key = (W0.shape[1], cfg0.block_size, compute_dtype(W0), W0.device, st.rows)
        loops.setdefault(key, []).append(st)
    results: dict[int, QuantResult] = {}
    t_prep = time.perf_counter() - t0
    total_rows = sum(m.R for m in members)
    for group in loops.values():
        results.update(_gptq_loop(group, cuda_graph, t_prep / total_rows))
    return [results[i] for i in range(len(problems))]


def _prepare_stack(st: _Stack) -> None:
    """Steps 1-3 for one stack: grids that come from the original weights, dead columns, the column order,
    the stacked working weight and the inverse Hessian."""
    W0 = st.members[0].W
    dtype, device = compute_dtype(W0), W0.device
    cfg = st.members[0].cfg
    H = st.H
    Ws = []
    diag_h = torch.diag(H).to(device=device, dtype=dtype)  # a copy
    dead = diag_h == 0
    diag_h[dead] = 1
    for m in st.members:
        W = m.W.to(dtype).clone()
        if not m.g:  # one grid per row, from the weights before dead columns are zeroed (as the reference)
            m.s, m.z = m.grid_of(W)
        W[:, dead] = 0
        if m.g and m.cfg.static_groups:
            sc, zc = group_params(W, m.cfg.bits, m.cfg.sym, m.g, m.cfg.mse)  # (R, G) from the original weights
            m.static_s, m.static_z = sc.t().contiguous(), zc.t().contiguous()
        Ws.append(W)
        m.W = None  # the caller's tensor is not needed any more
    g = st.members[0].g
    perm = None
    if cfg.act_order:
        perm = torch.argsort(diag_h, descending=True)
    elif cfg.act_group_aware and g:
        perm = group_aware_perm(diag_h, g)
    W = Ws[0] if len(Ws) == 1 else torch.cat(Ws)
    del Ws
    if perm is not None:
        W = W[:, perm]
    C = W.shape[1]
    for m in st.members:
        if m.static_s is not None:
            src = perm if perm is not None else torch.arange(C, device=device)
            m.col_group = (src // m.g).tolist()

    def scratch_hessian() -> torch.Tensor:
        """GPTQ's own copy of H: dead columns' diagonal set to 1, rows and columns in the processing order."""
        Hs = H.to(device=device, dtype=dtype).clone()
        Hs[dead, dead] = 1
        if perm is not None:  # one C x C gather at a time
            Hs = Hs.index_select(0, perm)
            Hs = Hs.index_select(1, perm)
        return Hs

    st.Hinv, st.damp = inverse_hessian_cholesky(scratch_hessian, cfg.damp_percent, cfg.damp_auto_increment)
    st.W, st.perm, st.dead = W, perm, dead


def _gptq_loop(stacks: list[_Stack], cuda_graph: bool | None, prep_per_row: float) -> dict[int, QuantResult]:
    """Step 4 for stacks of equal shape side by side, then each member's result (step 5, original order)."""
    t0 = time.perf_counter()
    for st in stacks:
        _prepare_stack(st)
    B, (R, C) = len(stacks), stacks[0].W.shape
    dtype, device = stacks[0].W.dtype, stacks[0].W.device
    bs = stacks[0].members[0].cfg.block_size
    members: list[_Member] = []
    for b, st in enumerate(stacks):
        r0 = 0
        for m in st.members:
            m.b, m.r0 = b, r0
            r0 += m.R
            members.append(m)
    single = len(members) == 1
    # per-entry grids and maxq (fixed per-row grids set once; group grids copied in as their groups start)
    s_cur = torch.ones(B * R, dtype=dtype, device=device)
    z_cur = torch.zeros(B * R, dtype=dtype, device=device)
    for m in members:
        if m.s is not None:
            lo = m.b * R + m.r0
            s_cur[lo:lo + m.R].copy_(m.s)
            z_cur[lo:lo + m.R].copy_(m.z)
    maxqs = {m.maxq for m in members}
    if len(maxqs) == 1:
        maxq: int | torch.Tensor = maxqs.pop()
    else:
        maxq = torch.cat([torch.full((m.R,), m.maxq, dtype=dtype, device=device)
                          for m in sorted(members, key=lambda m: (m.b, m.r0))])
    # grid events per column: which members take a new grid there
    events: dict[int, list[_Member]] = {}
    for m in members:
        if m.static_s is not None:
            for col in range(C):
                if col == 0 or m.col_group[col] != m.col_group[col - 1]:
                    events.setdefault(col, []).append(m)
        elif m.g:
            for col in range(0, C, m.g):
                events.setdefault(col, []).append(m)

    # Transposed buffers: row p holds column p of every stack's (permuted) weight, so every per-column kernel
    # reads and writes contiguous memory.
    QT = torch.empty((C, B * R), dtype=dtype, device=device)   # dequantized values
    CT = torch.empty((C, B * R), dtype=dtype, device=device)   # integer codes (as floats)
    ET = torch.empty((C, B * R), dtype=dtype, device=device)   # scaled errors (w - q) / U_ii
    on_cpu = device.type == "cpu"
    graphed = None
    if cuda_graph is None:
        cuda_graph = os.environ.get(CUDA_GRAPH_ENV, "") == "1"
    if cuda_graph and _graph_capture_possible(stacks[0].W) and all(m.static_s is None for m in members) \
            and all(not m.g or bs % m.g == 0 for m in members) and C // bs >= GRAPH_MIN_BLOCKS:
        graphed = _GraphedBlock(B, R, bs, members, s_cur, z_cur, maxq, dtype, device, capture=stacks[0].W.is_cuda)

    def lazy_update(i1: int, i2: int) -> None:
        """W[:, i2:] -= Err_block @ U[block, i2:], one GEMM per member (the shapes of its own loop: the same bits)."""
        for m in members:
            st = stacks[m.b]
            lo = m.b * R + m.r0
            E_m = ET[i1:i2, lo:lo + m.R].contiguous()
            st.W[m.r0:m.r0 + m.R, i2:] -= E_m.t().matmul(st.Hinv[i1:i2, i2:])

    for i1 in range(0, C, bs):
        i2 = min(i1 + bs, C)
        if graphed is not None and i1 > 0 and i2 - i1 == bs:  # block 0 ran eagerly: the kernels are warm
            grids = graphed.run(torch.stack([st.W[:, i1:i2] for st in stacks]),
                                torch.stack([st.Hinv[i1:i2, i1:i2] for st in stacks]))
            CT[i1:i2].copy_(graphed.C)
            QT[i1:i2].copy_(graphed.Q)
            ET[i1:i2].copy_(graphed.E)
            for m in members:
                if m.g:
                    S, Z = grids[m.index]
                    for k in range(len(S)):
                        m.dyn_s.append(S[k].clone())
                        m.dyn_z.append(Z[k].clone())
        else:
            def params_at(i: int, col0: int = i1):
                col = col0 + i
                for m in events.get(col, ()):
                    if m.static_s is not None:
                        k = m.col_group[col]
                        if single:
                            return m.static_s[k], m.static_z[k]
                        s, z = m.static_s[k], m.static_z[k]
                    else:
                        s, z = m.grid_of(stacks[m.b].W[m.r0:m.r0 + m.R, col:col + m.g])
                        m.dyn_s.append(s)
                        m.dyn_z.append(z)
                    lo = m.b * R + m.r0
                    s_cur[lo:lo + m.R].copy_(s)
                    z_cur[lo:lo + m.R].copy_(z)
                if single and members[0].static_s is not None:
                    m = members[0]
                    k = m.col_group[col]
                    return m.static_s[k], m.static_z[k]
                return s_cur, z_cur

            W1T, H1, D = _block_views([st.W[:, i1:i2] for st in stacks], [st.Hinv[i1:i2, i1:i2] for st in stacks])
            # ~10 small kernels per column: on CPU extra threads only add overhead (elementwise
            # results do not depend on the thread count; the lazy GEMM below keeps the caller's)
            with num_threads(1) if on_cpu else contextlib.nullcontext():
                _column_steps(W1T, CT[i1:i2], QT[i1:i2], ET[i1:i2], H1, D, maxq, params_at, B)
        if i2 < C:
            lazy_update(i1, i2)
    del graphed  # its memory pool (the block's temporaries) goes with it
    loop_seconds = time.perf_counter() - t0
    for st in stacks:  # the inverse Hessians (C x C) and the working weights are done with
        st.d = torch.diagonal(st.Hinv).clone()
        st.Hinv = st.W = None
    results = {}
    for m in members:
        t1 = time.perf_counter()
        lo = m.b * R + m.r0
        QTm, CTm, ETm = (X[:, lo:lo + m.R].contiguous() for X in (QT, CT, ET))
        results[m.index] = _finish(m, stacks[m.b], QTm, CTm, ETm,
                                   (prep_per_row + loop_seconds / (B * R)) * m.R + time.perf_counter() - t1)
    return results


def _finish(m: _Member, st: _Stack, QT: torch.Tensor, CT: torch.Tensor, ET: torch.Tensor,
            seconds: float) -> QuantResult:
    """Step 5 for one member: back to the original column order, its grids, loss and diagnostics."""
    C = QT.shape[0]
    g, perm, cfg = m.g, st.perm, m.cfg
    device = QT.device
    if g and m.static_s is not None:
        scales, zeros = m.static_s.t().contiguous(), m.static_z.t().contiguous()
        g_idx = group_index(C, g, device)
    elif g:
        scales, zeros = torch.stack(m.dyn_s, 1), torch.stack(m.dyn_z, 1)
        g_idx = group_index(C, g, device)
        if cfg.act_order:  # group of permuted position p is p // g
            g_idx = torch.empty_like(g_idx).scatter_(0, perm, g_idx)
        elif perm is not None:  # GAR: permuted group k is original group perm[k*g] // g
            order = perm[::g] // g
            scales = torch.empty_like(scales).index_copy_(1, order, scales)
            zeros = torch.empty_like(zeros).index_copy_(1, order, zeros)
    else:
        scales, zeros = m.s[:, None], m.z[:, None]
        g_idx = group_index(C, 0, device)
    d = st.d
    Q, codes, E = QT.t(), CT.t(), ET.t()
    if perm is not None:
        invperm = torch.argsort(perm)
        Q, codes, E = Q[:, invperm], codes[:, invperm], E[:, invperm]
        d = d[invperm]
    del QT, CT, ET
    loss = 0.5 * float(E.double().pow_(2).sum())
    gi = g_idx.long()
    clipped = float(E.abs().mul_(d).gt_(scales[:, gi].mul_(0.5).mul_(1 + 1e-4)).mean())
    return QuantResult(
        weight=Q.contiguous(),
        codes=codes.to(torch.uint8),
        scales=scales,
        zeros=zeros,
        g_idx=g_idx,
        bits=cfg.bits,
        loss=loss,
        seconds=seconds,
        diagnostics=dict(damp_percent=st.damp, dead_columns=int(st.dead.sum()), clipped_fraction=clipped),
        perm=perm,
    )


def _gptq_entry(W: torch.Tensor, stats: ActStats, cfg: QuantConfig) -> QuantResult:
    if stats is None:
        raise QuantdynError("GPTQ needs calibration data (a Hessian); pass calibration token ids")
    return gptq(W, stats, cfg)


QUANTIZERS.add("gptq", QuantMethod(fn=_gptq_entry, needs_calibration=True))
