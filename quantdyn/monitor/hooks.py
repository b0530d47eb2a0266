"""The PTQ monitor of a quantdyn run config: what the commands that train pass to the trainer.

    from quantdyn.monitor import hooks_for
    train(cfg, run_dir, hooks=hooks_for(cfg))
    cooldown(run_dir, from_step, [200], hooks=hooks_for(load_run_config(run_dir)))

``cfg.monitor`` (every, quantizers, calib_samples, eval_windows) becomes one :class:`PTQMonitor` that the
trainer calls on the main process at every multiple of ``monitor.every``: evaluation windows of
``train.seq_len`` tokens from the start of the validation split and seeded calibration windows from the
calibration split of the run's own token cache — read when the monitor first measures, so building the hook
touches no data (under torchrun every process builds it before rank 0 has tokenized anything).
"""
from __future__ import annotations

from quantdyn.data.prepare import TokenData, prepare_data
from quantdyn.monitor.ptq import PTQMonitor
from quantdyn.train.config import RunConfig, data_config_of


def monitor_for(cfg: RunConfig, data: TokenData | None = None) -> PTQMonitor | None:
    """The PTQ monitor ``cfg.monitor`` describes (None when ``monitor.every`` is 0); its quantizer specs are
    checked now. ``data``: the run's token data if already open (else opened at the first measurement)."""
    mon = cfg.monitor
    if not mon.every and not mon.warning_every:
        return None
    opened: list[TokenData] = [data] if data is not None else []

    def source() -> TokenData:
        if not opened:  # the trainer prepared the cache before its first step: this only opens it
            opened.append(prepare_data(data_config_of(cfg), progress=False))
        return opened[0]

    T = cfg.train.seq_len
    return PTQMonitor(
        list(mon.quantizers),
        eval_ids=lambda: source().eval_windows(T, mon.eval_windows),
        calib_ids=lambda: source().calib_windows(mon.calib_samples, T, seed=0),
        every=mon.every,
        eval_windows=mon.eval_windows,
        calib_samples=mon.calib_samples,
        warning_every=mon.warning_every,
    )


def hooks_for(cfg: RunConfig, data: TokenData | None = None) -> list[PTQMonitor]:
    """The step hooks for ``quantdyn.train.trainer.train(cfg, ..., hooks=...)``: the PTQ monitor of
    ``cfg.monitor`` when ``monitor.every`` > 0, else none."""
    m = monitor_for(cfg, data)
    return [m] if m is not None else []
