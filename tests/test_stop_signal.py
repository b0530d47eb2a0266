"""SIGUSR1 during training (train/stop_signal.py): the run checkpoints the step it is in, stops with
StoppedOnSignal, and a resume from that checkpoint ends with the weights of an uninterrupted run."""
import os
import signal

import pytest
import torch
from conftest import tiny_run_dict
from safetensors.torch import load_file

from quantdyn.config import from_dict
from quantdyn.runs import latest_resumable, list_checkpoints
from quantdyn.train.config import RunConfig
from quantdyn.train.stop_signal import StoppedOnSignal
from quantdyn.train.trainer import train


class SignalAt:
    """A step hook that sends this process SIGUSR1 after step ``at`` (as `kill -USR1 PID` or SLURM would)."""

    def __init__(self, at: int):
        self.at = at

    def due(self, step: int) -> bool:
        return step == self.at

    def step(self, model, step, lr=None, tokens=None) -> dict:
        os.kill(os.getpid(), signal.SIGUSR1)
        return {}


def test_sigusr1_checkpoints_the_step_and_the_resume_matches_an_uninterrupted_run(tmp_path, kjv_small):
    data_cfg, _ = kjv_small
    d = tiny_run_dict(tmp_path, data_cfg, steps=12, checkpoint_every=4)
    ref = train(from_dict(RunConfig, {**d, "name": "ref"}), progress=False)

    cfg = from_dict(RunConfig, {**d, "name": "stopped"})
    before = signal.getsignal(signal.SIGUSR1)
    with pytest.raises(StoppedOnSignal) as e:
        train(cfg, progress=False, hooks=[SignalAt(5)])
    assert e.value.step == 6 and e.value.exit_code == 138  # the signal came after step 5's check: step 6 stops
    assert signal.getsignal(signal.SIGUSR1) == before  # the trainer's handler is gone again
    run = tmp_path / "stopped"
    assert [c.step for c in list_checkpoints(run)] == [4, 6]  # the scheduled one and the signal's
    train(cfg, run, resume=latest_resumable(run), progress=False)
    assert [c.step for c in list_checkpoints(run)] == [4, 6, 8, 12]
    a = load_file(str(ref / "checkpoints" / "step-0000012" / "model.safetensors"))
    b = load_file(str(run / "checkpoints" / "step-0000012" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
