"""The PTQ monitor in Lightning (extra ``quantdyn[lightning]``).

    from quantdyn.monitor import PTQMonitor
    from quantdyn.monitor.lightning import PTQMonitorCallback

    monitor = PTQMonitor(["rtn4", "gptq3"], eval_ids=val_ids, calib_ids=calib_ids, every=100, seq_len=512)
    trainer = L.Trainer(max_steps=10_000, callbacks=[PTQMonitorCallback(monitor)], logger=TensorBoardLogger("tb"))
    trainer.fit(lit_module, loader)

After every multiple of ``monitor.every`` optimizer steps (``trainer.global_step``; micro-batches of gradient
accumulation do not count) the global-zero process measures the causal LM inside the LightningModule — the
first submodule that is quantdyn's GPT or a transformers causal LM, or what ``model(pl_module)`` returns —
and logs ``ptq/<quantizer>/delta_ce``, ... with the step to every logger of the Trainer (TensorBoard, W&B,
CSV, ...; under exactly the shared names) and to the monitor's own loggers.

Lightning ships as ``lightning`` (``lightning.pytorch``) and as ``pytorch_lightning``; their ``Callback``
classes are distinct, so this module builds on ``lightning.pytorch`` when it is installed (the extra installs
it) and on ``pytorch_lightning`` otherwise: use the Trainer of the same package.
"""
from __future__ import annotations

from typing import Callable

import torch.nn as nn

from quantdyn.errors import QuantdynError
from quantdyn.monitor.ptq import PTQMonitor

try:  # optional dependency: this module is the only one that imports Lightning
    from lightning.pytorch import Callback

    FLAVOR = "lightning.pytorch"
except ImportError:
    try:
        from pytorch_lightning import Callback

        FLAVOR = "pytorch_lightning"
    except ImportError:
        raise QuantdynError(
            "quantdyn.monitor.lightning needs Lightning, which is not installed; "
            "install it with pip install 'quantdyn[lightning]'"
        ) from None


class PTQMonitorCallback(Callback):
    """A Lightning ``Callback`` around a :class:`PTQMonitor` (module docstring).

    model: the causal LM to measure, from the LightningModule (default: found inside it).
    to_trainer_loggers: also log to the Trainer's loggers (``trainer.loggers``)."""

    def __init__(self, monitor: PTQMonitor, model: Callable[[nn.Module], nn.Module] | None = None,
                 to_trainer_loggers: bool = True):
        if not isinstance(monitor, PTQMonitor):
            raise QuantdynError(f"PTQMonitorCallback takes a quantdyn.monitor.PTQMonitor, not a {type(monitor).__name__}")
        self.monitor, self.model, self.to_trainer_loggers = monitor, model, to_trainer_loggers
        self._last = -1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = int(trainer.global_step)
        if step == self._last or not trainer.is_global_zero or not self.monitor.due(step):
            return
        self._last = step  # with gradient accumulation several batches end at the same optimizer step
        lm = self.model(pl_module) if self.model is not None else pl_module
        opt = trainer.optimizers[0] if trainer.optimizers else None
        lr = float(opt.param_groups[0]["lr"]) if opt is not None else None
        out = self.monitor.step(lm, step, lr=lr)
        if self.to_trainer_loggers:
            for lg in trainer.loggers:
                lg.log_metrics(out, step=step)
