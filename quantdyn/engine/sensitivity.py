"""Per-tensor sensitivity: what quantizing one linear alone (or one group of them) at a candidate type costs the
model end to end, for every tensor and type, in one streamed forward and one streamed backward pass.

How (a second-order estimate, no model pass per tensor)
-------------------------------------------------------
The quantity is the mean KL(FP ‖ Q) per token when tensor j alone is stored in type t. KL vanishes with its
gradient at the full-precision weights, so its leading term is the Fisher quadratic form:

    KL_j(t) ≈ ½ E_x E_{ŷ ~ p_FP(·|x)} [ <G_j(x, ŷ), ΔW_j(t)>² ],   G_j = ∇_{W_j} Σ_positions log p(ŷ | x),

the Gauss-Newton term of the network linearised around FP (Martens 2014; the "sampled" Fisher of K-FAC). Labels
ŷ are drawn from the FP model's own predictions, ``draws`` per sequence; different positions' draws are
independent, so the cross terms of the sum over positions vanish in expectation and one backward pass per draw
and sequence gives an unbiased estimate of the sum of the per-token KLs. The pass:

1. capture block 0's inputs for the sensitivity windows (the calibration windows: never the evaluation ones) and
   run the FP blocks forward, keeping every block's input;
2. at the head, sample ŷ and take the gradient of Σ log p(ŷ) with respect to the last hidden states;
3. walk the blocks backwards, one loaded at a time: collect each linear's FP input statistics, quantize it with
   every candidate type (ΔW = Q(W) − W: the same pure functions, shape fallbacks and ``+had`` rotations the
   engine quantizes with, blockwise.quantize_weight; with ``+had`` ΔW = Q(W R) Rᵀ − W),
   rerun the block with gradients and pull the adjoint through it, read every linear's output gradient g and
   input x, form each sequence's weight gradient G = Σ_positions gᵀx and record s = <G, ΔW> per sequence, draw,
   tensor and type.

From s every estimate follows without touching the model again: a tensor alone (½ mean s²), a group of tensors
with all their interactions (½ mean (Σ s)²: a block's attention, its MLP, the whole model at one type) and any
plan. Cost: one forward pass, ``draws`` backward passes through every block (each: a forward with graph and a
backward), one pass for the statistics, and the candidate types' quantizations; measured against one ordinary
measurement in bench/allocation.py. It is validated against true single-tensor measurements (a whole
``measure`` per tensor, with every other tensor in f16) in tests/test_sensitivity.py.

The proxies beside it, for each (tensor, type): ``layer_loss`` = ½ tr(ΔW H ΔWᵀ) with H = 2/n Σ x xᵀ of the FP
inputs (GPTQ's objective, what layer rows call output_error), and ``fisher_diag`` = ½ Σ_i F_ii ΔW_i² / tokens with
the diagonal of the same Fisher (weight-space Fisher-weighted error, HAWQ/"OBD" style). Their Spearman rank
correlation with the estimate tells when the cheap one is enough (``rank_correlations``).

Memory: one block, the sensitivity windows' hidden states at every block boundary (blocks x windows x tokens x
width floats) and their adjoints, and one block's candidate weights (types x block parameters).
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from quantdyn.engine.blockwise import (block_output, capture_block_inputs, check_calibration, quantize_weight,
                                      vocab_size_of)
from quantdyn.engine.lazy_model import BlockSource, block_source
from quantdyn.engine.phases import PhaseTimer
from quantdyn.engine.streams import trim_heap
from quantdyn.errors import QuantdynError
from quantdyn.models.adapters import get_weight, hf_model_type, model_type_of
from quantdyn.quantize.allocate import Allocation, allocate
from quantdyn.quantize.catalogue import QuantConfig, TensorSite, config_for_tensor, grid_bits_per_weight
from quantdyn.quantize.gptq import stats_update
from quantdyn.quantize.plan import (ModelTensor, Plan, PlanTensor, budget_range, check_candidate,
                                    check_plan_budget, check_types_fit, is_auto, parse_auto, plan_of, register_plan)
from quantdyn.results.schema import SENSITIVITY


@dataclass(frozen=True)
class SensitivityConfig:
    """How the sensitivity pass samples and batches."""

    draws: int = 2
    """Labels drawn from the FP model per sequence (Monte Carlo draws of the Fisher); each adds one backward pass."""
    seed: int = 0
    """Seed of the label draws."""
    batch_size: int = 8
    """Sequences per block call."""
    logits_budget_mb: int = 64
    """Largest logits tensor at the head (MiB); larger batches are sliced by windows."""

    def __post_init__(self):
        if self.draws < 1 or self.batch_size < 1 or self.logits_budget_mb < 1:
            raise QuantdynError(f"sensitivity draws ({self.draws}), batch_size ({self.batch_size}) and "
                                f"logits_budget_mb ({self.logits_budget_mb}) must be >= 1")


def tensor_group(t: ModelTensor) -> str:
    return f"{t.block}.{t.group}"


@dataclass
class Sensitivity:
    """What the pass found on one checkpoint (module docstring)."""

    tensors: list[ModelTensor]
    types: list[str]
    model_type: str
    n_blocks: int
    n_tokens: int
    """Sensitivity tokens (windows x positions)."""
    s: torch.Tensor
    """(draws, windows, tensors, types) float64: <G, ΔW> per sequence and draw."""
    layer_loss: torch.Tensor
    """(tensors, types): ½ tr(ΔW H ΔWᵀ), H from the FP inputs of the sensitivity windows."""
    fisher_diag: torch.Tensor
    """(tensors, types): ½ Σ F_ii ΔW_i² per token."""
    bits_per_weight: torch.Tensor
    """(tensors, types): as the layer rows count them."""
    seconds: float = 0.0
    phase_seconds: dict[str, float] = field(default_factory=dict)
    config: SensitivityConfig = field(default_factory=SensitivityConfig)

    def estimate(self, picks: list[tuple[int, int]]) -> tuple[float, float]:
        """(mean KL per token, its SE over windows) when the (tensor, type) pairs ``picks`` are quantized together,
        their interactions included."""
        idx_t = torch.tensor([p[0] for p in picks])
        idx_k = torch.tensor([p[1] for p in picks])
        v = self.s[:, :, idx_t, idx_k].sum(-1)  # (draws, windows)
        per_window = 0.5 * (v * v).mean(0)
        n = per_window.numel()
        mean = float(per_window.sum()) / self.n_tokens
        se = float(per_window.std()) * math.sqrt(n) / self.n_tokens if n > 1 else float("nan")
        return mean, se

    def single(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, SE), each (tensors, types): every tensor quantized alone."""
        per_window = 0.5 * (self.s * self.s).mean(0)  # (windows, tensors, types)
        n = per_window.shape[0]
        mean = per_window.sum(0) / self.n_tokens
        se = per_window.std(0) * math.sqrt(n) / self.n_tokens if n > 1 else torch.full_like(mean, float("nan"))
        return mean, se

    def groups(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for j, t in enumerate(self.tensors):
            out.setdefault(tensor_group(t), []).append(j)
        return out

    def curves(self) -> dict[str, dict[str, tuple[int, float]]]:
        """The allocator's input: tensor -> type -> (bits, predicted KL alone)."""
        mean, _ = self.single()
        return {t.name: {k: (round(float(self.bits_per_weight[j, i]) * t.shape[0] * t.shape[1]), float(mean[j, i]))
                         for i, k in enumerate(self.types)} for j, t in enumerate(self.tensors)}

    def rank_correlations(self) -> dict[str, float | None]:
        """Spearman correlation of each proxy with the estimate over every (tensor, type), and within each type
        across tensors (the ranking an allocator relies on), e.g. ``layer_loss``, ``layer_loss@q4_k``."""
        mean, _ = self.single()
        out: dict[str, float | None] = {}
        for proxy, values in (("layer_loss", self.layer_loss), ("fisher_diag", self.fisher_diag)):
            out[proxy] = spearman(values.flatten(), mean.flatten())
            for i, k in enumerate(self.types):
                out[f"{proxy}@{k}"] = spearman(values[:, i], mean[:, i])
        return out

    def rows(self, base: dict | None = None) -> list[dict]:
        """One row per tensor x type (scope ``tensor``), per tensor group x type (``group``) and per type for the
        whole model (``model``), kind ``sensitivity``."""
        base = dict(base or {})
        mean, se = self.single()
        common = {"kind": SENSITIVITY.name, **base, "sens_tokens": self.n_tokens, "sens_draws": self.config.draws,
                  "sens_seconds": self.seconds, "sens_types": list(self.types)}
        rows = []
        for j, t in enumerate(self.tensors):
            n = t.shape[0] * t.shape[1]
            for i, k in enumerate(self.types):
                rows.append({**common, "scope": "tensor", "tensor": t.name, "block": t.block, "tensor_group": t.group,
                             "layer_path": t.path, "type": k, "n_weights": n,
                             "bits_per_weight": float(self.bits_per_weight[j, i]), "kl_pred": float(mean[j, i]),
                             "kl_pred_se": float(se[j, i]), "layer_loss": _f(self.layer_loss[j, i]),
                             "fisher_diag": _f(self.fisher_diag[j, i])})
        sizes = [t.shape[0] * t.shape[1] for t in self.tensors]
        for g, members in self.groups().items():
            block, _, kind = g.partition(".")
            n = sum(sizes[j] for j in members)
            for i, k in enumerate(self.types):
                m, s = self.estimate([(j, i) for j in members])
                bpw = sum(float(self.bits_per_weight[j, i]) * sizes[j] for j in members) / n
                rows.append({**common, "scope": "group", "tensor": g, "block": int(block), "tensor_group": kind, "type": k,
                             "n_weights": n, "bits_per_weight": bpw, "kl_pred": m, "kl_pred_se": s,
                             "kl_pred_additive": float(mean[members, i].sum())})
        corr = self.rank_correlations()
        total = sum(sizes)
        for i, k in enumerate(self.types):
            m, s = self.estimate([(j, i) for j in range(len(self.tensors))])
            bpw = sum(float(self.bits_per_weight[j, i]) * sizes[j] for j in range(len(sizes))) / total
            rows.append({**common, "scope": "model", "tensor": "all", "block": None, "tensor_group": "all", "type": k,
                         "n_weights": total, "bits_per_weight": bpw, "kl_pred": m, "kl_pred_se": s,
                         "kl_pred_additive": float(mean[:, i].sum()),
                         "rho_layer_loss": corr["layer_loss"], "rho_fisher_diag": corr["fisher_diag"],
                         "rho_layer_loss_type": corr[f"layer_loss@{k}"],
                         "rho_fisher_diag_type": corr[f"fisher_diag@{k}"]})
        return rows

    def plan(self, budget: float, types: tuple[str, ...] | None = None, checkpoint: str = "") -> tuple[Plan, Allocation]:
        """The allocation under ``budget`` bits per weight over ``types`` (default: all measured types) as a plan;
        one line when the budget is out of reach."""
        types = tuple(types or self.types)
        missing = [t for t in types if t not in self.types]
        if missing:
            raise QuantdynError(f"type {missing[0]} was not measured in this sensitivity pass ({', '.join(self.types)})")
        entries = [(t.name, t.block, t.path, t.shape) for t in self.tensors]
        check_plan_budget(budget, *budget_range(entries, self.n_blocks, types), types)
        curves = {name: {k: v for k, v in c.items() if k in types} for name, c in self.curves().items()}
        n = sum(t.shape[0] * t.shape[1] for t in self.tensors)
        alloc = allocate(curves, math.floor(budget * n + 1e-9))
        plan = Plan(self.model_type, self.n_blocks,
                    tuple(PlanTensor(t.name, t.block, t.path, t.shape, alloc.choice[t.name]) for t in self.tensors),
                    budget, types, alloc.error, alloc.method, checkpoint,
                    {"sensitivity_tokens": self.n_tokens, "sensitivity_draws": self.config.draws,
                     "sensitivity_seconds": round(self.seconds, 3)})
        return plan, alloc

    def plan_estimate(self, plan: Plan) -> tuple[float, float]:
        """The estimate (with interactions) of quantizing every tensor as ``plan`` says (types measured here)."""
        index = {t.name: j for j, t in enumerate(self.tensors)}
        picks = [(index[e.name], self.types.index(e.type)) for e in plan.tensors]
        return self.estimate(picks)


def _f(x: torch.Tensor) -> float | None:
    v = float(x)
    return v if math.isfinite(v) else None


def spearman(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """Spearman's rank correlation (average ranks for ties); None with fewer than 3 finite pairs or no spread."""
    a, b = a.double().flatten(), b.double().flatten()
    ok = torch.isfinite(a) & torch.isfinite(b)
    a, b = a[ok], b[ok]
    if a.numel() < 3:
        return None

    def ranks(x):
        order = torch.argsort(x, stable=True)
        r = torch.empty_like(x)
        r[order] = torch.arange(len(x), dtype=torch.float64)
        for v in torch.unique(x):  # ties: average rank
            tie = x == v
            if int(tie.sum()) > 1:
                r[tie] = r[tie].mean()
        return r

    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = float(ra.norm() * rb.norm())
    return float((ra * rb).sum()) / den if den > 0 else None


# ----------------------------------------------------------------------------- the pass


def model_tensors(source: BlockSource) -> list[ModelTensor]:
    """Every quantizable linear of the blocks, from the skeleton (no weight is read)."""
    out = []
    prefix = source.adapter.blocks
    for b, block in enumerate(source.blocks):
        for grp in source.adapter.linear_groups(block):
            for name, m in grp:
                out.append(ModelTensor(f"{prefix}.{b}.{name}", b, name, tuple(get_weight(m).shape)))
    return out


def model_type_of_source(source: BlockSource) -> str:
    """The architecture a plan records: the HF model_type (quantdyn's GPT is GPT-NeoX on disk)."""
    return hf_model_type(model_type_of(source.model))


@torch.no_grad()
def _quantize_candidates(layers, types, stats, b: int, n_blocks: int, prefix: str):
    """Per layer: {type index: ΔW}, layer losses and bits per weight. ΔW is in the layer's own basis: for a ``+had``
    type Q(W R) Rᵀ − W, the weight the engine's measurement puts in the layer (blockwise.quantize_weight)."""
    deltas, losses, bpws = [], [], []
    for name, m in layers:
        W = get_weight(m).detach().float()
        st = stats.get(name)
        d, lo, bp = {}, [], []
        for i, label in enumerate(types):
            qc = check_candidate(label)
            resolved, _ = config_for_tensor(qc, TensorSite(name, b, n_blocks, tuple(W.shape)))
            res = quantize_weight(W.clone(), st, resolved, f"{prefix}.{b}.{name}")  # +had: rotated, as measured
            Wq = res.weight.float()
            bpw = res.bits_per_weight if res.bits_per_weight is not None else grid_bits_per_weight(resolved, *W.shape)
            dW = Wq - W
            d[i] = dW
            if st is not None:
                H = st.H.to(W)
                lo.append(0.5 * float((dW @ H).mul_(dW).sum()))
            else:
                lo.append(float("nan"))
            bp.append(float(bpw))
        deltas.append(d)
        losses.append(lo)
        bpws.append(bp)
    return deltas, losses, bpws


def measure_sensitivity(model, types: list[str] | tuple[str, ...], ids: torch.Tensor, *,
                        device: str | torch.device = "cpu", cfg: SensitivityConfig = SensitivityConfig(),
                        on_block: Callable[[str], None] | None = None) -> Sensitivity:
    """The sensitivity of every block linear of ``model`` to each of ``types`` on the token windows ``ids``
    [N, T] (module docstring). ``model``: a checkpoint reference, CheckpointWeights, BlockSource or nn.Module
    (left untouched)."""
    t_start = time.perf_counter()
    device = torch.device(device)
    types = list(dict.fromkeys(types))
    if not types:
        raise QuantdynError("the sensitivity pass needs at least one candidate type")
    for t in types:
        check_candidate(t)
    source = block_source(model, torch.float32, device)  # gradients in float32 whatever the checkpoint stores
    mdl, blocks, adapter = source.model, source.blocks, source.adapter
    ids = check_calibration(ids, vocab_size_of(mdl))
    tensors = model_tensors(source)
    n_blocks = len(blocks)
    timer = PhaseTimer()  # reading and converting weights
    secs: dict[str, float] = {}
    was_training = mdl.training
    grad_flags = [(p, p.requires_grad) for p in mdl.parameters()]  # a model in training keeps its own flags
    mdl.eval()
    M = cfg.draws
    N, T = ids.shape
    s = torch.zeros(M, N, len(tensors), len(types), dtype=torch.float64)
    layer_loss = torch.full((len(tensors), len(types)), float("nan"), dtype=torch.float64)
    fisher = torch.zeros(len(tensors), len(types), dtype=torch.float64)
    bpw = torch.zeros(len(tensors), len(types), dtype=torch.float64)
    try:
        (cap,) = capture_block_inputs(source, [(ids, cfg.batch_size)], device, timer)
        hs: list[list[torch.Tensor]] = [list(cap.hiddens)]
        cap.hiddens = []
        with torch.no_grad():
            for b, block in enumerate(blocks):
                source.load(block, device, timer)
                with _phase(secs, "forward"):
                    hs.append([block_output(block(h, *cap.args(b, i)[0], **cap.args(b, i)[1]))
                               for i, h in enumerate(hs[b])])
                source.unload(block)
        adj = _head_adjoints(source, hs[-1], M, cfg, device, timer, secs)
        hs[-1] = []
        starts = [0]
        for h in hs[0]:
            starts.append(starts[-1] + h.shape[0])
        offsets: dict[int, int] = {}
        for j, t in enumerate(tensors):
            offsets.setdefault(t.block, j)
        for b in reversed(range(n_blocks)):
            block = blocks[b]
            source.load(block, device, timer)
            for p in block.parameters():
                p.requires_grad_(False)
            layers = [x for grp in adapter.linear_groups(block) for x in grp]
            first = offsets[b]
            with _phase(secs, "statistics"), torch.no_grad():
                stats = _block_stats(block, layers, hs[b], cap, b)
            with _phase(secs, "quantize"):
                deltas, losses, bpws = _quantize_candidates(layers, types, stats, b, n_blocks, adapter.blocks)
            del stats
            for jj in range(len(layers)):
                layer_loss[first + jj] = torch.tensor(losses[jj], dtype=torch.float64)
                bpw[first + jj] = torch.tensor(bpws[jj], dtype=torch.float64)
            fdiag = [torch.zeros_like(get_weight(m), dtype=torch.float32) for _, m in layers]
            new_adj: list[list[torch.Tensor]] = [[] for _ in range(M)]
            with _phase(secs, "backward"):
                for i, h in enumerate(hs[b]):
                    got = _backward_batch(block, layers, h, cap.args(b, i), [a[i] for a in adj])
                    for m_, (a_in, grads) in enumerate(got):
                        new_adj[m_].append(a_in)
                        for jj, (g, x) in enumerate(grads):
                            G = _per_sequence_grad(g, x)  # (B, out, in)
                            fdiag[jj] += (G * G).sum(0)
                            for k, dW in deltas[jj].items():
                                s[m_, starts[i]:starts[i + 1], first + jj, k] = (G * dW).sum((1, 2)).double().cpu()
                            del G
            for jj in range(len(layers)):
                for k, dW in deltas[jj].items():
                    fisher[first + jj, k] = 0.5 * float((fdiag[jj] * dW * dW).sum()) / M / (N * T)
            adj = new_adj
            hs[b] = []
            del deltas, fdiag
            source.unload(block)
            if device.type == "cpu":
                trim_heap()
            if on_block is not None:
                on_block(f"sensitivity: block {b} done ({time.perf_counter() - t_start:.0f}s)")
    finally:
        mdl.train(was_training)
        for p, flag in grad_flags:
            p.requires_grad_(flag)
    phase = {**{k: v for k, v in timer.seconds.items() if v}, **secs}
    return Sensitivity(tensors, types, model_type_of_source(source), n_blocks, N * T, s, layer_loss, fisher, bpw,
                       time.perf_counter() - t_start, phase, cfg)


@contextlib.contextmanager
def _phase(secs: dict[str, float], name: str):
    t0 = time.perf_counter()
    try:
        yield
    finally:
        secs[name] = secs.get(name, 0.0) + time.perf_counter() - t0


def _block_stats(block, layers, inputs, cap, b):
    """FP input statistics of every linear of ``block`` over the sensitivity windows."""
    stats: dict = {}

    def hook(mod, inp, out, name):
        stats[name] = stats_update(stats.get(name), inp[0].detach(), need_abs=False)

    handles = [m.register_forward_hook(lambda mod, inp, out, name=name: hook(mod, inp, out, name)) for name, m in layers]
    try:
        for i, h in enumerate(inputs):
            rest, kw = cap.args(b, i)
            block(h, *rest, **kw)
    finally:
        for hd in handles:
            hd.remove()
    return stats


def _backward_batch(block, layers, h, args, adjoints):
    """Rerun ``block`` on ``h`` with a graph; per draw, the adjoint of its input and each linear's (output
    gradient, input)."""
    xs: dict[str, torch.Tensor] = {}
    ys: dict[str, torch.Tensor] = {}

    def hook(mod, inp, out, name):
        xs[name], ys[name] = inp[0], out

    handles = [m.register_forward_hook(lambda mod, inp, out, name=name: hook(mod, inp, out, name)) for name, m in layers]
    try:
        with torch.enable_grad():
            hin = h.detach().requires_grad_(True)
            rest, kw = args
            out = block_output(block(hin, *rest, **kw))
            names = [name for name, _ in layers]
            got = []
            for m_, a in enumerate(adjoints):
                grads = torch.autograd.grad(out, [hin, *[ys[n] for n in names]], grad_outputs=a.to(out.dtype),
                                            retain_graph=m_ < len(adjoints) - 1, allow_unused=True)
                per = [(torch.zeros_like(ys[n]) if g is None else g.detach(), xs[n].detach())
                       for n, g in zip(names, grads[1:])]
                got.append((grads[0].detach(), per))
    finally:
        for hd in handles:
            hd.remove()
    return got


def _per_sequence_grad(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Σ over positions of gᵀ x per sequence: (B, T, out), (B, T, in) -> (B, out, in) in float32."""
    return torch.einsum("bto,bti->boi", g.float(), x.float())


def _head_adjoints(source: BlockSource, finals: list[torch.Tensor], draws: int, cfg: SensitivityConfig,
                   device: torch.device, timer: PhaseTimer, secs: dict[str, float]) -> list[list[torch.Tensor]]:
    """Per draw and batch: ∇_h Σ log p(ŷ) at the last hidden states h, ŷ drawn from the FP model's predictions."""
    norm, head = source.tail()
    source.load(norm, device, timer)
    source.load(head, device, timer)
    for p in list(norm.parameters()) + list(head.parameters()):
        p.requires_grad_(False)
    gen = torch.Generator().manual_seed(cfg.seed)
    out: list[list[torch.Tensor]] = [[] for _ in range(draws)]
    try:
        with _phase(secs, "head"), torch.enable_grad():
            vocab = head.weight.shape[0]
            for h in finals:
                B, T = h.shape[0], h.shape[1]
                step = max(1, min(B, cfg.logits_budget_mb * 2**20 // max(1, T * vocab * 4)))
                parts: list[list[torch.Tensor]] = [[] for _ in range(draws)]
                for a in range(0, B, step):
                    x = h[a:a + step].detach().requires_grad_(True)
                    logp = torch.log_softmax(head(norm(x)).float(), -1)
                    probs = logp.detach().exp().reshape(-1, vocab).cpu().double()
                    for m in range(draws):
                        y = torch.multinomial(probs, 1, generator=gen).to(logp.device)
                        loss = logp.reshape(-1, vocab).gather(1, y).sum()
                        (g,) = torch.autograd.grad(loss, x, retain_graph=m < draws - 1)
                        parts[m].append(g.detach())
                for m in range(draws):
                    out[m].append(torch.cat(parts[m]))
    finally:
        source.unload(norm)
        source.unload(head)
    return out


# ----------------------------------------------------------------------------- auto@ inside measure()


def tensor_list(sens_or_source) -> list[tuple[str, int, str, tuple[int, int]]]:
    ts = sens_or_source.tensors if isinstance(sens_or_source, Sensitivity) else model_tensors(sens_or_source)
    return [(t.name, t.block, t.path, t.shape) for t in ts]


def check_auto_fits(qc: QuantConfig, source: BlockSource) -> None:
    """One line, before any work, if an ``auto@`` quantizer cannot allocate on this model: a type a tensor cannot
    hold, or a budget outside what the types reach."""
    budget, types = parse_auto(qc.method)
    entries = tensor_list(source)
    check_types_fit(entries, types)
    check_plan_budget(budget, *budget_range(entries, len(source.blocks), types), types)


def check_plan_fits(qc: QuantConfig, source: BlockSource) -> None:
    """One line, before any work, if the plan of a ``plan:`` quantizer was made for another architecture or names
    tensors this model lacks (or lacks some of its linears); then every tensor must hold its type as it is."""
    plan = plan_of(qc)
    if plan is None:
        return
    label = qc.name
    mt = model_type_of_source(source)
    here = {name: (block, path, shape) for name, block, path, shape in tensor_list(source)}
    if plan.model_type != mt or plan.n_blocks != len(source.blocks):
        raise QuantdynError(f"{label} was made for a {plan.model_type} model of {plan.n_blocks} blocks; this checkpoint "
                            f"is {mt} with {len(source.blocks)} blocks: allocate a plan on it (quantdyn allocate)")
    names = {t.name for t in plan.tensors}
    extra = sorted(names - set(here))
    if extra:
        raise QuantdynError(f"{label} names tensor {extra[0]}, which this checkpoint lacks"
                            + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else "")
                            + ": it was made for another model; allocate a plan on this one")
    missing = sorted(set(here) - names)
    if missing:
        raise QuantdynError(f"{label} has no type for tensor {missing[0]} of this checkpoint"
                            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                            + "; allocate a plan on this checkpoint")
    for t in plan.tensors:
        if tuple(here[t.name][2]) != t.shape:
            raise QuantdynError(f"{label} was made for {t.name} of shape {list(t.shape)}; this checkpoint's is "
                                f"{list(here[t.name][2])}: allocate a plan on this checkpoint")
    for t in plan.tensors:
        check_types_fit([(t.name, t.block, t.path, t.shape)], (t.type,))


def check_quantizers_fit(variants, model) -> None:
    """``check_plan_fits`` / ``check_auto_fits`` for every plan and auto variant (a no-op without them)."""
    qcs = [v for v in (variants.values() if isinstance(variants, dict) else variants)
           if isinstance(v, QuantConfig) and (is_auto(v) or plan_of(v) is not None)]
    if not qcs:
        return
    source = block_source(model, torch.float32, torch.device("cpu"))
    for qc in qcs:
        if is_auto(qc):
            check_auto_fits(qc, source)
        else:
            check_plan_fits(qc, source)


def allocate_auto(model, autos: dict[str, QuantConfig], calib_ids, device: torch.device,
                  cfg: SensitivityConfig = SensitivityConfig(), checkpoint: str = "") -> dict[str, tuple[QuantConfig, dict]]:
    """For every ``auto@`` variant: measure this checkpoint's sensitivity to its types (once per set of types and
    calibration windows), allocate under its budget and return the plan as a quantizer with a summary for the
    rows ({label: (plan QuantConfig, summary)})."""
    source = block_source(model, torch.float32, device)  # gradients in float32 whatever the checkpoint stores
    out: dict[str, tuple[QuantConfig, dict]] = {}
    done: dict[tuple, Sensitivity] = {}
    for label, qc in autos.items():
        check_auto_fits(qc, source)
        ids = calib_ids.get(label) if isinstance(calib_ids, dict) else calib_ids
        if ids is None:
            raise QuantdynError(f"{qc.name} needs calibration windows: it measures each tensor's sensitivity on them "
                                "before allocating")
    for label, qc in autos.items():
        budget, types = parse_auto(qc.method)
        ids = calib_ids.get(label) if isinstance(calib_ids, dict) else calib_ids
        key = (types, id(ids))
        if key not in done:
            done[key] = measure_sensitivity(source, types, ids, device=device, cfg=cfg)
        sens = done[key]
        plan, alloc = sens.plan(budget, types, checkpoint)
        name = register_plan(plan)
        est, est_se = sens.plan_estimate(plan)
        out[label] = (QuantConfig(method=name), {
            "plan_label": name, "plan_digest": plan.digest, "plan_bits_per_weight": plan.bits_per_weight(),
            "plan_predicted_kl": alloc.error, "plan_predicted_kl_joint": est, "plan_predicted_kl_joint_se": est_se,
            "plan_allocator": alloc.method, "t_sensitivity": sens.seconds})
    return out
