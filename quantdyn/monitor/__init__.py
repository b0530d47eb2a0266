"""Watch a model's post-training-quantization robustness while it trains, in any training loop.

* :class:`PTQMonitor` — every N steps, Δ CE / relative Δ CE / KL / top-1 agreement of chosen quantizers on
  the current weights, measured by the streamed engine (``quantdyn.engine.measure``) without changing them;
  ``.step(model, step, lr)`` from any loop.
* :func:`hooks_for` — the monitor of a quantdyn run config, as step hooks for ``quantdyn.train.trainer.train``.
* ``quantdyn.monitor.hf.PTQMonitorCallback`` — a ``transformers.TrainerCallback``.
* ``quantdyn.monitor.lightning.PTQMonitorCallback`` — a Lightning ``Callback`` (extra ``quantdyn[lightning]``).

Loggers (metrics.jsonl, CSV, TensorBoard, W&B) are in ``quantdyn.train.loggers``.

Layer: above ``measure`` (which it calls) and ``train`` (whose step-hook protocol it implements and whose
loggers it uses); below ``study``, ``experiments`` and ``cli``, which build monitors for the runs they start.
The trainer itself never imports this package.
"""
from quantdyn.monitor.hooks import hooks_for, monitor_for
from quantdyn.monitor.ptq import PTQMonitor, causal_lm_of

__all__ = ["PTQMonitor", "causal_lm_of", "hooks_for", "monitor_for"]
