"""Run grids (quantdyn/launch/grid.py): expansion, naming, manifest, launch scripts, local runs."""
import json
import os
import shutil
import subprocess

import pytest
import yaml
from conftest import tiny_run_dict

from quantdyn.config import from_dict, load_yaml
from quantdyn.errors import QuantdynError
from quantdyn.launch.grid import (
    expand_grid,
    format_grid,
    read_grid,
    run_grid,
    slurm_script,
    write_grid,
    write_launch_scripts,
)
from quantdyn.launch.slurm import SlurmConfig
from quantdyn.runs import checkpoint_dir, list_checkpoints
from quantdyn.train.config import RunConfig

VARY = ["optim.lr=1e-4,1e-3,3e-3", "optim.weight_decay=0.1,0.05"]


def test_expansion_and_names():
    base = {"name": "tiny", "seed": 5, "train": {"steps": 10}}
    runs = expand_grid(base, VARY, seeds=2)
    names = [n for n, _ in runs]
    assert names[:4] == ["tiny-lr1e-4-wd0.1-s5", "tiny-lr1e-4-wd0.1-s6", "tiny-lr1e-4-wd0.05-s5", "tiny-lr1e-4-wd0.05-s6"]
    assert len(names) == 12 == len(set(names)) and names[-1] == "tiny-lr3e-3-wd0.05-s6"
    assert expand_grid(base, VARY, seeds=2) == runs  # deterministic
    _, d = runs[-1]
    cfg = from_dict(RunConfig, d)
    assert (cfg.name, cfg.seed, cfg.optim.lr, cfg.optim.weight_decay, cfg.train.steps) == (names[-1], 6, 3e-3, 0.05, 10)
    assert d["optim"]["lr"] == 3e-3 and isinstance(d["optim"]["lr"], float)  # typed, not the YAML-1.1 string
    assert base == {"name": "tiny", "seed": 5, "train": {"steps": 10}}  # the base is not mutated
    # no --seeds: base seed, no suffix; unaliased keys use their last component; values are sanitised
    one = expand_grid(base, ["train.log_every=5", "data.source=/x/a b.txt"], seeds=0, grid_dir="G")
    assert [n for n, _ in one] == ["tiny-log_every5-datax_a_b.txt"]
    assert one[0][1]["out_dir"] == os.path.join("G", "runs") and one[0][1]["seed"] == 5


def test_unknown_vary_key_fails_with_did_you_mean(tmp_path):
    with pytest.raises(QuantdynError, match=r"unknown config key 'optim.lrr' \(did you mean 'optim.lr'\?\)"):
        write_grid({"name": "g"}, ["optim.lrr=1e-3,3e-3"], 0, tmp_path / "grid")
    assert not (tmp_path / "grid").exists()  # nothing written before validation
    with pytest.raises(QuantdynError, match=r"did you mean 'optim.weight_decay'"):
        expand_grid({}, ["weight_decay=0.1"])
    with pytest.raises(QuantdynError, match="expected a number"):
        expand_grid({}, ["optim.lr=fast,slow"])
    with pytest.raises(QuantdynError, match="not both"):
        expand_grid({}, ["seed=1,2"], seeds=2)
    with pytest.raises(QuantdynError, match="given twice"):
        expand_grid({}, ["optim.lr=1", "optim.lr=2"])


def test_manifest_configs_and_dry_run_table(tmp_path):
    g = tmp_path / "grid"
    m = write_grid({"name": "tiny", "out_dir": "elsewhere"}, VARY, 1, g)
    assert read_grid(g) == json.loads(json.dumps(m))
    assert m["base"] == {"name": "tiny", "out_dir": "elsewhere"} and m["seeds"] == 1
    assert [v["key"] for v in m["vary"]] == ["optim.lr", "optim.weight_decay"]
    assert [v["alias"] for v in m["vary"]] == ["lr", "wd"] and m["vary"][0]["values"] == ["1e-4", "1e-3", "3e-3"]
    assert len(m["runs"]) == 6
    r = m["runs"][1]
    assert r["name"] == "tiny-lr1e-4-wd0.05-s0" and r["overrides"] == {"optim.lr": 1e-4, "optim.weight_decay": 0.05}
    assert r["dir"] == str(g / "runs" / r["name"]) and r["config"] == str(g / "configs" / f"{r['name']}.yaml")
    cfg = from_dict(RunConfig, load_yaml(r["config"]))
    assert (cfg.name, cfg.out_dir, cfg.optim.lr) == (r["name"], str(g / "runs"), 1e-4)
    assert sorted(p.stem for p in (g / "configs").iterdir()) == sorted(x["name"] for x in m["runs"])
    table = format_grid(m)
    assert all(x["name"] in table for x in m["runs"]) and "6 runs" in table
    assert write_grid({"name": "tiny", "out_dir": "elsewhere"}, VARY, 1, g)["created"] == m["created"]  # same grid: ok
    with pytest.raises(QuantdynError, match="already holds a different grid"):
        write_grid({"name": "tiny"}, ["optim.lr=1e-2"], 0, g)


def test_slurm_script_and_command_list(tmp_path):
    g = tmp_path / "grid"
    m = write_grid({"name": "tiny", "train": {"steps": 40}}, VARY[:1], 0, g)
    sbatch, cmds = write_launch_scripts(g, SlurmConfig(nproc_per_node=4, time="02:00:00", setup=("module load cuda",)),
                                        python="/opt/venv/bin/python")
    text = sbatch.read_text()
    assert text.startswith("#!/bin/bash") and "#SBATCH --array=0-2" in text
    assert "#SBATCH --gpus-per-node=4" in text and "#SBATCH --time=02:00:00" in text
    assert "#SBATCH --requeue" in text and "#SBATCH --signal=B:USR1@120" in text and "#SBATCH --open-mode=append" in text
    assert f"#SBATCH --output={g.resolve()}/logs/" in text and (g / "logs").is_dir()
    assert "/opt/venv/bin/python -m torch.distributed.run" in text and "--nproc_per_node=4" in text
    assert '--rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT"' in text and "--resume" in text
    assert all(r["name"] in text for r in m["runs"]) and text.count("step-0000040") == 3
    if shutil.which("bash"):
        assert subprocess.run(["bash", "-n", str(sbatch)]).returncode == 0
    lines = cmds.read_text().splitlines()
    assert lines == [
        f"torchrun --standalone --nproc_per_node 4 -m quantdyn.cli train {(g / 'configs' / (r['name'] + '.yaml')).resolve()} --quiet"
        for r in m["runs"]
    ]
    # runs on the CPU ask for no GPUs; --signal none: no warning and nothing to trap
    m = write_grid({"name": "cpu", "train": {"steps": 40, "device": "cpu"}}, VARY[:1], 0, tmp_path / "cpu")
    text = slurm_script(m, SlurmConfig(nproc_per_node=2, signal="none"))
    assert "#SBATCH --gpus-per-node" not in text and "--signal" not in text and "trap stop_and_requeue" not in text


def _fake_slurm_commands(tmp_path) -> dict:
    """srun, scancel and scontrol that print what they were asked (srun also the task's command line)."""
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir()
    for name in ("srun", "scancel", "scontrol"):
        (bin_dir / name).write_text(f'#!/bin/bash\necho "{name.upper()} $*"\n')
        (bin_dir / name).chmod(0o755)
    return dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_ARRAY_JOB_ID="77")


@pytest.mark.skipif(not shutil.which("bash"), reason="needs bash")
def test_slurm_task_picks_its_run_and_resumes(tmp_path):
    """Run the array script with stand-ins for srun & co.: task i launches run i, fresh or resumed, as a job step."""
    g = tmp_path / "grid"
    m = write_grid({"name": "t", "train": {"steps": 8}}, ["optim.lr=1e-3,2e-3"], 0, g)
    script = g / "task.sh"
    script.write_text(slurm_script(m, python="PY"))
    env = _fake_slurm_commands(tmp_path)

    def task(i):
        r = subprocess.run(["bash", str(script)], capture_output=True, text=True,
                           env=dict(env, SLURM_ARRAY_TASK_ID=str(i), SLURM_CPUS_PER_TASK="3"))
        assert r.returncode == 0, r.stderr
        return r.stdout.strip().splitlines()[-1]

    run1 = m["runs"][1]
    step = "SRUN --ntasks=1 --kill-on-bad-exit=1 --cpus-per-task=3 PY -m quantdyn.cli train"
    assert task(1) == f"{step} {g.resolve()}/configs/{run1['name']}.yaml"
    ck = checkpoint_dir(g / "runs" / run1["name"], 4)
    ck.mkdir(parents=True)
    (ck / "training_state.pt").write_bytes(b"")
    assert task(1) == f"{step} --resume {g.resolve()}/runs/{run1['name']}"
    final = checkpoint_dir(g / "runs" / run1["name"], 8)
    final.mkdir(parents=True)
    (final / "model.safetensors").write_bytes(b"")
    assert task(1) == f"quantdyn: run {run1['name']} already finished"


def test_run_grid_locally_skips_and_resumes(tmp_path, kjv_small):
    data_cfg, _ = kjv_small
    base = tiny_run_dict(tmp_path, data_cfg, steps=4, checkpoint_every=2)
    base["name"] = "g"
    g = tmp_path / "grid"
    m = write_grid(base, ["optim.lr=1e-3,3e-3"], 0, g)
    first = run_grid(g, progress=False)
    assert [r["status"] for r in first] == ["trained", "trained"]
    for r in m["runs"]:
        assert [c.step for c in list_checkpoints(r["dir"])] == [2, 4]
        assert yaml.safe_load((g / "runs" / r["name"] / "config.yaml").read_text())["name"] == r["name"]
    # an interrupted run (last checkpoint lost) is resumed; a finished one is skipped
    shutil.rmtree(checkpoint_dir(m["runs"][0]["dir"], 4))
    again = run_grid(g, progress=False)
    assert [r["status"] for r in again] == ["resumed", "skipped"]
    assert [c.step for c in list_checkpoints(m["runs"][0]["dir"])] == [2, 4]
    with pytest.raises(QuantdynError, match="did you mean"):
        run_grid(g, only=["g-lr1e-4"], progress=False)


# ------------------------------------------------------------------ SLURM: script options (the real cluster: test_slurm.py)
def test_cli_slurm_script_has_every_resource(tmp_path):
    """`grid --slurm` with partition, time, account, GPUs/CPUs per task and an array throttle."""
    import sys

    g = tmp_path / "grid"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"name": "t", "train": {"steps": 40}}))
    r = subprocess.run(
        [sys.executable, "-m", "quantdyn.cli", "grid", str(cfg), "--vary", "optim.lr=1e-4,1e-3,3e-3", "--dir", str(g),
         "--slurm", "--write-only", "--partition", "gpu", "--time", "1-02:00:00", "--account", "proj42", "--qos", "high",
         "--nproc-per-node", "4", "--gpus-per-node", "4", "--cpus-per-task", "32", "--mem-gb", "200",
         "--max-parallel", "2", "--constraint", "h100", "--sbatch=--exclusive", "--setup", "module load cuda/12",
         "--signal", "USR2@300"],
        capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    text = (g / "grid.sbatch").read_text()
    for line in ["#SBATCH --array=0-2%2", "#SBATCH --partition=gpu", "#SBATCH --time=1-02:00:00",
                 "#SBATCH --account=proj42", "#SBATCH --qos=high", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --cpus-per-task=32", "#SBATCH --mem=200G", "#SBATCH --constraint=h100",
                 "#SBATCH --exclusive", "#SBATCH --signal=B:USR2@300", "trap stop_and_requeue USR2",
                 "module load cuda/12", "--nproc_per_node=4 "]:
        assert line in text, line
    assert f"sbatch {g / 'grid.sbatch'}" in r.stdout
    assert subprocess.run(["bash", "-n", str(g / "grid.sbatch")]).returncode == 0
    for flag, value, message in (("--time", "soon", "not a SLURM time"), ("--signal", "TERM@60", "USR1 or USR2")):
        bad = subprocess.run([sys.executable, "-m", "quantdyn.cli", "grid", str(cfg), "--vary", "optim.lr=1e-4",
                              "--dir", str(tmp_path / "g2"), "--slurm", "--write-only", flag, value],
                             capture_output=True, text=True)
        assert bad.returncode == 2 and message in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
        assert not (tmp_path / "g2").exists()  # refused before anything was written


def test_slurm_without_sbatch_is_one_line_and_writes_nothing(tmp_path, cli, monkeypatch):
    """`--slurm` where sbatch is not on PATH: one line, exit 2, nothing written; --write-only needs no SLURM."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"name": "t", "train": {"steps": 40}}))
    ck = tmp_path / "ck"
    ck.mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    for args, written in ((["grid", cfg, "--vary", "optim.lr=1e-3", "--dir", tmp_path / "g"], tmp_path / "g"),
                          (["sweep", "--checkpoint", ck, "--store", tmp_path / "s"], tmp_path / "s")):
        r = cli(*args, "--slurm")
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "sbatch, which is not on PATH" in r.stderr and "--write-only" in r.stderr
        assert not written.exists()
        r = cli(*args, "--submit")  # the old spelling: the same, with a note once it has run
        assert r.returncode == 2 and "sbatch, which is not on PATH" in r.stderr
        r = cli(*args, "--write-only")
        assert r.returncode == 2 and "--write-only goes with --slurm" in r.stderr and not written.exists()
        r = cli(*args, "--slurm", "--write-only")
        assert r.returncode == 0 and "submit with: sbatch " in r.stdout, r.stderr


def test_slurm_config_and_time_limits():
    from quantdyn.launch.slurm import SlurmConfig, parse_signal, parse_slurm_time, sweep_script

    assert [parse_slurm_time(t) for t in ["90", "30:30", "04:00:00", "1-00", "1-02:30", "2-00:00:01"]] == \
        [90, 31, 240, 1440, 1590, 2881]
    for bad in ["", "0", "4h", "1-", "a:b"]:
        with pytest.raises(QuantdynError):
            parse_slurm_time(bad)
    with pytest.raises(QuantdynError, match="exceeds --gpus-per-node"):
        SlurmConfig(nproc_per_node=8, gpus_per_node=4)
    with pytest.raises(QuantdynError, match="characters"):
        SlurmConfig(partition="gpu; rm -rf /")
    with pytest.raises(QuantdynError, match="sets --shard itself"):
        sweep_script(["spec.yaml", "--shard", "0/2"], 2, SlurmConfig(), ".", "logs")
    with pytest.raises(QuantdynError, match="--shards 0 must be >= 1"):
        sweep_script(["spec.yaml"], 0, SlurmConfig(), ".", "logs")
    assert [parse_signal(t) for t in ["USR1@120", "sigusr2@5", "none", ""]] == [("USR1", 120), ("USR2", 5), None, None]
    for bad in ["TERM@60", "USR1", "USR1@0", "USR1@-5", "KILL@10"]:
        with pytest.raises(QuantdynError, match="SIG@SECONDS"):
            parse_signal(bad)
    with pytest.raises(QuantdynError, match="not shorter than --time 2"):
        SlurmConfig(time="2", signal="USR1@120")  # warned at once, requeued for ever
    assert SlurmConfig(time="2", signal="USR1@90").signal == "USR1@90"


def test_sweep_array_script_runs_each_shard(tmp_path):
    from quantdyn.launch.slurm import SlurmConfig, sweep_script

    text = sweep_script(["spec.yaml", "--store", "shared store"], 4,
                        SlurmConfig(partition="cpu", time="02:00:00", cpus_per_task=8, max_parallel=3), tmp_path,
                        tmp_path / "logs", quantdyn="QD")
    assert "#SBATCH --array=0-3%3" in text and "#SBATCH --cpus-per-task=8" in text
    assert "--gpus-per-node=" not in text.split("set -euo")[0]  # a sweep asks for GPUs only when told
    assert "scancel --signal=TERM" in text  # a warned sweep task ends its sweep with SIGTERM, then requeues
    script = tmp_path / "s.sh"
    script.write_text(text)
    env = _fake_slurm_commands(tmp_path)
    outs = [subprocess.run(["bash", str(script)], capture_output=True, text=True,
                           env=dict(env, SLURM_ARRAY_TASK_ID=str(i))).stdout.strip().splitlines()[-1] for i in range(4)]
    assert outs == [f"SRUN --ntasks=1 --kill-on-bad-exit=1 QD sweep spec.yaml --store shared store --shard {i}/4"
                    for i in range(4)]
