"""configs/studies/cooldown_gpu.yaml, the study of a GPU window, on a CPU: the same file at scale cpu-tiny on a tree
of source files, stopped by SIGTERM as `timeout -s TERM 540` stops it at the end of a 10-minute device command,
then resumed by the same command to its findings."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from quantdyn.results.store import ResultStore
from quantdyn.studies.spec import load_study_spec

ROOT = Path(__file__).resolve().parent.parent
STUDY = ROOT / "configs" / "studies" / "cooldown_gpu.yaml"


def test_gpu_study_file_is_the_sized_recipe():
    """The numbers the sizing comment in the file is computed from."""
    s = load_study_spec(STUDY)
    t = s.run.train
    assert s.run.model.preset == "pythia-70m" and s.run.data.tokenizer == "gpt2"
    assert s.run.data.source.startswith("files:py,md,rst:")
    assert (t.steps, t.batch_size, t.seq_len, t.checkpoint_every, t.compile) == (2400, 32, 1024, 600, False)
    assert s.cooldowns.from_steps == (2400,) and s.cooldowns.decay_steps == 600 and s.cooldowns.control
    assert list(s.seeds) == [0, 1] and s.finding_families == ("decay",)
    steps_per_seed = t.steps + 2 * s.cooldowns.decay_steps
    assert steps_per_seed * t.batch_size * t.seq_len == 3600 * 32768  # 118 M tokens per seed


def test_the_gpu_league_file_is_the_sized_recipe():
    """configs/studies/interventions_gpu.yaml: the numbers its sizing comment is computed from, and the league's
    own checks (one branch point per seed, formats with a training path) pass before any work."""
    s = load_study_spec(ROOT / "configs" / "studies" / "interventions_gpu.yaml")
    t, cd = s.run.train, s.cooldowns
    assert s.run.model.preset == "pythia-70m" and s.run.data.tokenizer == "gpt2"
    assert s.run.data.source == load_study_spec(STUDY).run.data.source  # the corpus of the first GPU study
    assert (t.steps, t.batch_size, t.seq_len, t.checkpoint_every) == (1200, 32, 1024, 400)
    assert cd.from_steps == (1200,) and cd.decay_steps == 300 and cd.control
    assert set(cd.interventions) == {"qat.format=rtn4", "qat.format=nvfp4", "optim.sam_rho=0.05"}
    assert cd.nodecay == ("ema-0.99",) and list(s.seeds) == [0, 1]
    assert s.finding_families == ("decay", "interventions") and s.run.monitor.warning_every == 50
    step_equivalents = t.steps + cd.decay_steps * (1 + 1 + 1.07 + 1.13 + 2 + 1)
    assert round(step_equivalents) == 3360  # the comment's figure; ~67 ms per step on the H100 of 2026-11-24


@pytest.mark.e2e
def test_gpu_study_stops_on_sigterm_and_the_same_command_resumes_it(tmp_path):
    # the file at cpu-tiny, shortened further: 16 main steps (a checkpoint every 8), 4-step branches, and a BPE of
    # 512 tokens instead of GPT-2's 50,304 (whose output layer would dominate a CPU step; tests/test_files_source.py
    # prepares this source with gpt2)
    cmd = [sys.executable, "-m", "quantdyn.cli", "study", str(STUDY), "scale=cpu-tiny",
           f"run.data.source=files:py:{ROOT / 'quantdyn'}", "run.data.tokenizer=bpe:512", "seeds=[0]",
           "sweep.quantizers=[rtn3,gptq3]",
           "run.train.steps=16", "run.train.checkpoint_every=8", "run.train.eval_every=8", "run.schedule.warmup=2",
           "cooldowns.from_steps=[16]", "cooldowns.decay_steps=4"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = tmp_path / "runs" / "studies" / "cooldown_gpu-cpu-tiny" / "cd70m-s0"
    first = run / "checkpoints" / "step-0000008" / "model.safetensors"
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    while not first.is_file() and proc.poll() is None and time.monotonic() - t0 < 600:
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    proc.send_signal(signal.SIGTERM)  # what `timeout -s TERM` sends at the end of a device command
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("interrupted; rerun the same command"), err[-3000:]
    assert not (tmp_path / "report" / "cooldown_gpu-cpu-tiny" / "study.json").is_file()
    # on a loaded machine the signal can land after the main run's last 8 steps (then a later stage is what was
    # stopped, and the main run has nothing to resume): the resume line is asked for only when it had
    main_done = (run / "checkpoints" / "step-0000016" / "model.safetensors").is_file()

    again = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)
    assert again.returncode == 0, again.stderr[-3000:]
    assert main_done or "resuming at step" in again.stdout, again.stdout[-3000:]
    rows = [r for r in ResultStore(tmp_path / "runs" / "studies" / "cooldown_gpu-cpu-tiny" / "results").rows()
            if r["kind"] == "ptq"]
    # main run steps 8, 16 + the cooldown and the control ends (20), 2 quantizers each
    assert len(rows) == 8 and {r["quantizer"] for r in rows} == {"rtn3", "gptq3"}
    state = yaml.safe_load((tmp_path / "report" / "cooldown_gpu-cpu-tiny" / "study.json").read_text())
    assert state["findings"] and "Answer (z = effect" in again.stdout
    # a third run finds everything done: it trains and measures nothing
    third = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert third.returncode == 0 and "[1/4] training" not in third.stdout, third.stdout[-2000:]
