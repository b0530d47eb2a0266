"""PTQMonitor: the post-training-quantization robustness of the weights a loop is training, every N steps.

    monitor = PTQMonitor(["rtn4", "gptq3"], eval_ids=val_ids, calib_ids=calib_ids, every=100,
                         loggers=[TensorBoardLogger("runs/x/tb")], seq_len=256)
    for step in range(1, steps + 1):
        ...                                   # forward, backward, optimizer.step()
        monitor.step(model, step, lr=sched.get_last_lr()[0])

At each due step the current weights are quantized with every quantizer and compared with themselves in
full precision by the streamed measurement engine (``quantdyn.engine.measure``): the model is walked block by
block, one extra copy of one block at a time, and left bit-for-bit as it was (its training/eval mode and the
torch RNG too, so a monitored run trains exactly like an unmonitored one). What comes back, and goes to the
loggers, is per quantizer ``ptq/<q>/delta_ce`` (± ``delta_ce_se``, paired over windows),
``rel_delta_ce``, ``kl`` (KL(FP‖Q) per token, ± ``kl_se``), ``top1_agree``, ``ce_q``, ``delta_ppl``, plus
``ptq/ce_fp`` and ``ptq/seconds`` (the measurement's wall time).

Adapters: quantdyn's own trainer calls the same object (``hooks_for``), ``quantdyn.monitor.hf`` wraps it
as a ``transformers.TrainerCallback`` and ``quantdyn.monitor.lightning`` as a Lightning ``Callback``.
"""
from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Union

import numpy as np
import torch
import torch.nn as nn

from quantdyn.data.prepare import long_ids, random_windows, token_windows
from quantdyn.engine.measure import MeasureConfig, measure
from quantdyn.errors import QuantdynError
from quantdyn.models.adapters import ADAPTERS
from quantdyn.models.gpt import GPT
from quantdyn.quantize.catalogue import QUANTIZERS, QuantConfig, parse_quantizer
from quantdyn.analysis.hessian import curvature_along, next_token_loss
from quantdyn.train.loggers import (PTQ_CE_FP, PTQ_METRICS, PTQ_SECONDS, TRAIN_LR, TRAIN_TOKENS, WARN_CURVATURE, WARN_SECONDS,
                                     MetricLogger, ptq_key)

Tokens = Union[torch.Tensor, np.ndarray, Sequence[int]]
TokenSource = Union[Tokens, Callable[[], Tokens]]

_RENAMED = {"eval_tokens": "eval_ids", "calib_tokens": "calib_ids", "n_eval_windows": "eval_windows",
            "n_calib_samples": "calib_samples"}
"""PTQMonitor's old keywords -> their names now (the sizes spelt as MonitorConfig and the sweep spell them)."""


# ------------------------------------------------------------------ the model inside the wrappers
def _is_causal_lm(m: nn.Module) -> bool:
    if isinstance(m, GPT):
        return True
    mt = getattr(getattr(m, "config", None), "model_type", None)
    return isinstance(mt, str) and mt in ADAPTERS


def _peel(m: nn.Module) -> nn.Module:
    """DistributedDataParallel / DataParallel (``.module``) and torch.compile (``._orig_mod``) wrappers off."""
    while True:
        inner = getattr(m, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            inner = getattr(m, "module", None)
            if not isinstance(inner, nn.Module) or not isinstance(
                m, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
                return m
        m = inner


def causal_lm_of(model: nn.Module) -> nn.Module:
    """The causal LM the monitor measures: ``model`` without its DDP / DataParallel / torch.compile wrappers,
    or, for a module that holds one (a LightningModule, a wrapper of your own), the first submodule that is
    quantdyn's GPT or a transformers causal LM of a family quantdyn knows (models/adapters.py)."""
    m = _peel(model)
    if _is_causal_lm(m):
        return m
    for sub in m.modules():
        sub = _peel(sub)
        if _is_causal_lm(sub):
            return sub
    raise QuantdynError(
        f"PTQMonitor found no causal LM in a {type(m).__name__}: pass quantdyn's GPT or a transformers causal LM "
        f"of a supported family ({', '.join(ADAPTERS.names())}), or the module that holds one"
    )


def _check_whole(model: nn.Module) -> None:
    for p in model.parameters():
        if type(p).__name__ == "DTensor" or (p.numel() == 0 and hasattr(p, "ds_numel")):
            raise QuantdynError(
                "PTQMonitor needs the whole weights on this process, but they are sharded (FSDP / DeepSpeed ZeRO-3); "
                "gather them first (quantdyn's trainer does so under dist.strategy=fsdp2)"
            )
        return


# ------------------------------------------------------------------ token windows
def _ids(tokens: Tokens, what: str) -> torch.Tensor | np.ndarray:
    """Token ids as a tensor or numpy array (a memory-mapped token file stays mapped: only the windows cut
    from it are read)."""
    if isinstance(tokens, (torch.Tensor, np.ndarray)):
        t = tokens
    else:
        try:
            t = np.asarray(tokens)
        except (TypeError, ValueError):
            raise QuantdynError(f"{what} must be token ids (a tensor, an array or a list of ints)") from None
    kind = str(t.dtype)
    if t.ndim not in (1, 2) or "float" in kind or "bool" in kind or "complex" in kind or kind == "object":
        raise QuantdynError(f"{what} must be integer token ids, 1-D (a token stream) or 2-D (windows); got shape "
                            f"{tuple(t.shape)} of {kind.replace('torch.', '')}")
    return t


def eval_windows_of(tokens: Tokens, seq_len: int | None, max_windows: int) -> torch.Tensor:
    """Evaluation windows [N, T+1]: 2-D ids as they are (at most ``max_windows`` rows); a 1-D token stream cut
    into consecutive windows of ``seq_len`` tokens (data.prepare.token_windows: T = seq_len - 1 predictions)."""
    t = _ids(tokens, "eval_ids")
    if t.ndim == 1:
        if not seq_len:
            raise QuantdynError("eval_ids is a 1-D token stream: give seq_len (tokens per window) to cut it")
        return token_windows(t, seq_len, max_windows, what="eval_ids", hint="give more tokens or a shorter seq_len")
    if t.shape[1] < 2:
        raise QuantdynError("eval_ids windows need at least 2 tokens each (inputs and next-token targets)")
    return long_ids(t[:max_windows])


def calib_windows_of(tokens: Tokens, seq_len: int | None, samples: int, seed: int) -> torch.Tensor:
    """Calibration sequences [N, L]: 2-D ids as they are; from a 1-D stream ``samples`` windows of
    ``seq_len`` tokens at seeded random offsets (data.prepare.random_windows)."""
    t = _ids(tokens, "calib_ids")
    if t.ndim == 2:
        return long_ids(t)
    if not seq_len:
        raise QuantdynError("calib_ids is a 1-D token stream: give seq_len (tokens per sequence) to cut it")
    return random_windows(t, samples, seq_len, seed, what="calib_ids")


# ------------------------------------------------------------------ the monitor
class PTQMonitor:
    """Measures how much post-training quantization would hurt the model a loop is training (module docstring).

    quantizers:   quantizer labels ("rtn4", "gptq3", "gptq4g128", "gptq4-gptqmodel"), QuantConfigs or dicts,
                  or {label: spec}; a spec that does not parse is an error here, before any training.
    eval_ids:     held-out token ids: windows [N, T+1] (inputs = all but the last token), or a 1-D token stream
                  cut into ``eval_windows`` consecutive windows of ``seq_len`` tokens (the one windowing of
                  quantdyn, data.prepare.token_windows: seq_len - 1 predictions per window); or a function
                  returning either, called at the first measurement (when the data is not ready yet).
    calib_ids:    calibration token ids for GPTQ / AWQ: sequences [N, L], or a 1-D stream from which
                  ``calib_samples`` sequences of ``seq_len`` tokens are drawn (seeded); or a function
                  returning either. None: calibration-free quantizers only (RTN).
    every:        measure at steps that are multiples of this.
    loggers:      where :meth:`step` logs (quantdyn.train.loggers: JsonlLogger, CSVLogger, TensorBoardLogger,
                  WandbLogger, PrintLogger or anything with ``log(metrics, step)``).
    device:       where the blocks are quantized and evaluated (None: where the model's weights are).
    measure_cfg:  the engine's batching and dtype (``quantdyn.engine.measure.MeasureConfig``); by default torch's
                  thread count is kept (``quantize_threads=0``).
    warning_every: the cheap early warning (0 = off): every this many steps, the loss's curvature along the
                  weights' update since the previous warning (``warn/curvature_along_update``: three forward passes
                  on ``warning_windows`` held-out windows, analysis/hessian.curvature_along), logged from the second
                  warning step on. It holds one copy of the weights between warnings. ``every=0`` with
                  ``warning_every`` > 0 logs the warning only.

    Old keywords, still accepted with a DeprecationWarning: ``eval_tokens`` and ``calib_tokens`` (now ``eval_ids``
    and ``calib_ids``, before 0.2, when a 1-D stream was cut into windows of seq_len + 1 tokens), and
    ``n_eval_windows`` and ``n_calib_samples`` (now ``eval_windows`` and ``calib_samples``, as MonitorConfig, the
    sweep's data section and the command line spell these sizes).
    """

    def __init__(
        self,
        quantizers: Sequence[str | QuantConfig | dict] | Mapping[str, str | QuantConfig | dict],
        eval_ids: TokenSource | None = None,
        calib_ids: TokenSource | None = None,
        every: int = 100,
        loggers: Sequence[MetricLogger] = (),
        device: str | torch.device | None = None,
        *,
        seq_len: int | None = None,
        eval_windows: int = 64,
        calib_samples: int = 16,
        seed: int = 0,
        measure_cfg: MeasureConfig | None = None,
        warning_every: int = 0,
        warning_windows: int = 4,
        **old: Any,
    ):
        for name, value in old.items():
            if name not in _RENAMED:
                raise TypeError(f"PTQMonitor() got an unexpected keyword argument '{name}'")
            new = _RENAMED[name]
            warnings.warn(f"PTQMonitor({name}=...) is now PTQMonitor({new}=...)", DeprecationWarning, stacklevel=2)
            if new == "eval_ids":
                eval_ids = value if eval_ids is None else eval_ids
            elif new == "calib_ids":
                calib_ids = value if calib_ids is None else calib_ids
            elif new == "eval_windows":
                eval_windows = value
            else:
                calib_samples = value
        if eval_ids is None:
            raise QuantdynError("PTQMonitor needs held-out token ids: pass eval_ids (windows or a token stream)")
        for name, v in (("every", every), ("warning_every", warning_every)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise QuantdynError(f"PTQMonitor {name}={v!r} must be a whole number of steps >= 0")
        if not every and not warning_every:
            raise QuantdynError("PTQMonitor every=0 and warning_every=0 measure nothing: give every >= 1 (or "
                                "warning_every >= 1 for the early warning alone)")
        if warning_windows < 1:
            raise QuantdynError("PTQMonitor warning_windows must be >= 1")
        if eval_windows < 1 or calib_samples < 1:
            raise QuantdynError("PTQMonitor eval_windows and calib_samples must be >= 1")
        if isinstance(quantizers, (str, QuantConfig)):
            quantizers = [quantizers]
        items = quantizers.items() if isinstance(quantizers, Mapping) else [(None, q) for q in quantizers]
        self.quantizers: dict[str, QuantConfig] = {}
        for label, spec in items:
            qc = parse_quantizer(spec)  # a spec that does not parse: one line with did-you-mean, now
            label = label if label is not None else spec if isinstance(spec, str) else qc.name
            if not label or "/" in label or any(c.isspace() for c in label):
                raise QuantdynError(f"monitor quantizer label {label!r} must be non-empty, without '/' or spaces")
            if label in self.quantizers:
                raise QuantdynError(f"monitor quantizer '{label}' is given twice; list each once")
            self.quantizers[label] = qc
        if not self.quantizers:
            raise QuantdynError("PTQMonitor needs at least one quantizer, e.g. quantizers=['rtn4']")
        if calib_ids is None:
            needs = [lb for lb, qc in self.quantizers.items() if QUANTIZERS.get(qc.method).needs_calibration]
            if needs:
                raise QuantdynError(f"monitor quantizer '{needs[0]}' needs calibration data: pass calib_ids "
                                    "(token ids of text like the training data)")
        self.every = every
        self.warning_every, self.warning_windows = warning_every, warning_windows
        self._last: list[torch.Tensor] | None = None  # the weights at the previous warning step
        self._last_step: int | None = None  # that step: a warning only follows the one warning_every steps before
        self.loggers = list(loggers)
        self.device = torch.device(device) if device is not None else None
        self.seq_len, self.n_eval, self.n_calib, self.seed = seq_len, eval_windows, calib_samples, seed
        self.measure_cfg = measure_cfg or MeasureConfig(quantize_threads=0)
        self._eval_src, self._calib_src = eval_ids, calib_ids
        self._eval: torch.Tensor | None = None
        self._calib: torch.Tensor | None = None
        if not callable(eval_ids):
            self._eval = eval_windows_of(eval_ids, seq_len, eval_windows)
        if calib_ids is not None and not callable(calib_ids):
            self._calib = calib_windows_of(calib_ids, seq_len, calib_samples, seed)
        self.history: list[dict[str, Any]] = []
        """Every measurement so far: {"step": ..., metrics}."""
        self.seconds = 0.0
        """Wall time spent measuring so far."""

    # -------------------------------------------------------------- windows
    def windows(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(evaluation windows [N, T+1], calibration sequences [N, L] or None), read on first use."""
        ev = self.eval_windows()
        if self._calib is None and self._calib_src is not None:
            self._calib = calib_windows_of(self._calib_src(), self.seq_len, self.n_calib, self.seed)
        return ev, self._calib

    def eval_windows(self) -> torch.Tensor:
        """The evaluation windows [N, T+1] alone, read on first use (the early warning needs no calibration)."""
        if self._eval is None:
            self._eval = eval_windows_of(self._eval_src(), self.seq_len, self.n_eval)
        return self._eval

    # -------------------------------------------------------------- measuring
    def due(self, step: int) -> bool:
        """Whether :meth:`step` measures at ``step`` (a multiple of ``every``)."""
        return step > 0 and any(n and step % n == 0 for n in (self.every, self.warning_every))

    @torch.no_grad()
    def warn(self, model: nn.Module) -> dict[str, float]:
        """The early warning now: the curvature along the update since the previous call ({} at the first call,
        which only keeps the weights). The model is left bit for bit as it was, with its mode and the RNG."""
        lm = causal_lm_of(model)
        _check_whole(lm)
        params = [p for p in lm.parameters()]
        last, self._last = self._last, [p.detach().clone() for p in params]
        if last is None:
            return {}
        d = [p.detach() - q for p, q in zip(params, last)]
        if not any(bool(x.any()) for x in d):
            return {}  # no update since the last warning (e.g. the LR is 0)
        ids = self.eval_windows()[: self.warning_windows]
        device = next(lm.parameters()).device
        t0 = time.perf_counter()
        training = lm.training
        lm.eval()
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
                    torch.autocast(device.type, enabled=False):
                r = curvature_along(lambda: next_token_loss(lm, ids.to(device)), params, d)
        finally:
            lm.train(training)
        seconds = time.perf_counter() - t0
        self.seconds += seconds
        return {WARN_CURVATURE: r["curvature"], WARN_SECONDS: seconds}

    @torch.no_grad()
    def measure(self, model: nn.Module) -> dict[str, float]:
        """Measure now (whatever the step): {ptq/<q>/<metric>: value, ptq/ce_fp, ptq/seconds}."""
        lm = causal_lm_of(model)
        _check_whole(lm)
        eval_windows, calib_ids = self.windows()
        device = self.device or next(lm.parameters()).device
        t0 = time.perf_counter()
        # the torch RNG is restored afterwards (a monitored run trains exactly like an unmonitored one) and an
        # autocast region of the caller does not change the measurement's dtype
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
                torch.autocast(device.type, enabled=False):
            m = measure(lm, self.quantizers, eval_windows, calib_ids, device=device, cfg=self.measure_cfg)
        seconds = time.perf_counter() - t0
        self.seconds += seconds
        out: dict[str, float] = {}
        for label, row in m.metrics.items():
            for k in PTQ_METRICS:
                if row.get(k) is not None:
                    out[ptq_key(label, k)] = float(row[k])
        out[PTQ_CE_FP] = m.ce_fp
        out[PTQ_SECONDS] = seconds
        return out

    def step(self, model: nn.Module, step: int, lr: float | None = None, tokens: int | None = None) -> dict[str, float]:
        """Measure if ``step`` is due (else return {}), log to the loggers and return what was logged
        (with train/lr and train/tokens when given)."""
        if not self.due(step):
            return {}
        out: dict[str, float] = {}
        if self.warning_every and step % self.warning_every == 0:
            if self._last_step is not None and step != self._last_step + self.warning_every:
                # not the next warning step of the same trajectory: one monitor reused for the next cooldown
                # branch (which starts earlier) or a resumed run; the update would span two trajectories
                self._last = None
            out.update(self.warn(model))
            self._last_step = int(step)
        if self.every and step % self.every == 0:
            out.update(self.measure(model))
        if not out:
            return {}
        if lr is not None:
            out[TRAIN_LR] = float(lr)
        if tokens is not None:
            out[TRAIN_TOKENS] = int(tokens)
        self.history.append({"step": int(step), **out})
        for lg in self.loggers:
            lg.log(out, int(step))
        return out

    def close(self) -> None:
        """Close the loggers (flush TensorBoard files, finish a W&B run this monitor started)."""
        for lg in self.loggers:
            lg.close()

    def __repr__(self) -> str:
        return f"PTQMonitor({list(self.quantizers)}, every={self.every}, warning_every={self.warning_every})"
