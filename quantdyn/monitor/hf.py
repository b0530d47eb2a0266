"""The PTQ monitor in the Hugging Face ``transformers.Trainer``.

    from quantdyn.monitor import PTQMonitor
    from quantdyn.monitor.hf import PTQMonitorCallback

    monitor = PTQMonitor(["rtn4", "gptq3"], eval_ids=val_ids, calib_ids=calib_ids, every=100, seq_len=512)
    trainer = Trainer(model=model, args=args, train_dataset=ds)
    PTQMonitorCallback(monitor).add_to(trainer)     # or Trainer(..., callbacks=[PTQMonitorCallback(monitor)])
    trainer.train()

At every multiple of ``monitor.every`` optimizer steps (``state.global_step``) the main process measures the
current weights (the same :class:`PTQMonitor` as everywhere: one block copy at a time, the model untouched)
and the metrics go

* to the Trainer's own logging at that very step (the callback asks for a log there), so whatever the run
  reports to (``report_to``: TensorBoard, W&B, MLflow, ..., and the console) shows them — the Trainer's
  integrations name them as they name the loss: ``train/ptq/rtn4/delta_ce`` beside ``train/loss``;
* to ``trainer.state.log_history`` (trainer_state.json) as ``ptq/rtn4/delta_ce``, ...;
* to the monitor's own loggers (quantdyn.train.loggers), under exactly the shared names.

The Trainer calls callbacks in order: for the integrations to see the metrics the callback must come before
them — :meth:`PTQMonitorCallback.add_to` puts it first; given in ``callbacks=[...]`` it comes after them
and the metrics reach log_history and the monitor's loggers only.

The monitor needs the whole weights on the main process: FSDP and DeepSpeed ZeRO-3 shard them (refused at
the start of training); DDP and ZeRO-1/2 are fine (the other processes wait at their next collective).
"""
from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from quantdyn.errors import QuantdynError
from quantdyn.monitor.ptq import PTQMonitor


class PTQMonitorCallback(TrainerCallback):
    """A ``transformers.TrainerCallback`` around a :class:`PTQMonitor` (module docstring)."""

    def __init__(self, monitor: PTQMonitor):
        if not isinstance(monitor, PTQMonitor):
            raise QuantdynError(f"PTQMonitorCallback takes a quantdyn.monitor.PTQMonitor, not a {type(monitor).__name__}")
        self.monitor = monitor
        self._pending: dict[str, float] = {}

    def add_to(self, trainer) -> "PTQMonitorCallback":
        """Put this callback first in ``trainer``'s callbacks, so the Trainer's reporting integrations see the
        metrics it adds to each log; returns itself."""
        callbacks = trainer.callback_handler.callbacks
        if self in callbacks:
            callbacks.remove(self)
        callbacks.insert(0, self)
        return self

    def on_train_begin(self, args, state, control, **kwargs):
        fsdp = getattr(args, "fsdp", None)
        ds = getattr(args, "hf_deepspeed_config", None)
        zero3 = ds is not None and getattr(ds, "is_zero3", lambda: False)()
        if fsdp or zero3:
            raise QuantdynError(
                f"PTQMonitorCallback measures the whole weights on the main process, but this run shards them "
                f"({'FSDP' if fsdp else 'DeepSpeed ZeRO-3'}); use DDP or ZeRO-1/2, or quantdyn's own trainer "
                "(dist.strategy=fsdp2 gathers the weights for the monitor)"
            )

    def on_step_end(self, args, state, control, model=None, lr_scheduler=None, optimizer=None, **kwargs):
        step = int(state.global_step)
        if not state.is_world_process_zero or model is None or not self.monitor.due(step):
            return control
        lr = _lr(lr_scheduler, optimizer)
        tokens = getattr(state, "num_input_tokens_seen", None) or None
        out = self.monitor.step(model, step, lr=lr, tokens=tokens)
        self._pending = {k: v for k, v in out.items() if k.startswith("ptq/")}
        control.should_log = True  # report them at this step
        return control

    def on_log(self, args, state, control, logs: dict[str, Any] | None = None, **kwargs):
        if not self._pending or logs is None:
            return control
        logs.update(self._pending)
        # the Trainer appended this log to its history before the callbacks saw it
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(self._pending)
        else:
            state.log_history.append({**self._pending, "step": state.global_step})
        self._pending = {}
        return control


def _lr(lr_scheduler, optimizer) -> float | None:
    """The LR the Trainer would log (its scheduler's last LR, else the optimizer's first group)."""
    if lr_scheduler is not None:
        try:
            return float(lr_scheduler.get_last_lr()[0])
        except (AttributeError, IndexError, TypeError):
            pass
    if optimizer is not None and getattr(optimizer, "param_groups", None):
        return float(optimizer.param_groups[0]["lr"])
    return None
