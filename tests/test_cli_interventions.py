"""CLI wiring of the interventions: grid, average lawa/soup, interpolate."""
import json

import yaml
from conftest import tiny_run_dict

from quantdyn.config import from_dict
from quantdyn.results.store import ResultStore
from quantdyn.train.config import RunConfig
from quantdyn.train.trainer import train


def test_grid_dry_run_and_bad_key(tmp_path, kjv_small, cli):
    data_cfg, _ = kjv_small
    cfg = tmp_path / "base.yaml"
    cfg.write_text(yaml.safe_dump(tiny_run_dict(tmp_path, data_cfg)))
    r = cli("grid", str(cfg), "--vary", "optim.lr=1e-3,3e-3", "--vary", "optim.weight_decay=0.1,0.05",
              "--seeds", "2", "--dry-run")
    assert r.returncode == 0, r.stderr
    names = [l.split()[0] for l in r.stdout.splitlines() if l.startswith("t-")]
    assert len(names) == 8 and "t-lr1e-3-wd0.1-s3" in names
    assert not (tmp_path / "t-grid").exists()  # a dry run writes nothing
    r = cli("grid", str(cfg), "--vary", "optim.lrr=1e-3", "--dry-run")
    assert r.returncode == 2 and "did you mean 'optim.lr'" in r.stderr
    r = cli("grid", str(cfg), "--vary", "optim.lr=1e-3,3e-3", "--slurm", "--write-only", "--dir", str(tmp_path / "g"))
    assert r.returncode == 0 and "#SBATCH --array=0-1" in (tmp_path / "g" / "grid.sbatch").read_text()


def test_average_and_interpolate_cli(tmp_path, kjv_small, cli):
    data_cfg, _ = kjv_small
    d = tiny_run_dict(tmp_path, data_cfg, steps=8, checkpoint_every=4)
    run = train(from_dict(RunConfig, d), progress=False)
    r = cli("average", "lawa", str(run), "--window", "2", "--every", "4")
    assert r.returncode == 0, r.stderr
    assert (run / "averages" / "lawa-k2-p4-offline" / "step-0000008" / "model.safetensors").is_file()
    ck = run / "checkpoints"
    r = cli("average", "soup", str(ck / "step-0000004"), str(ck / "step-0000008"), "--out", str(tmp_path / "soup"))
    assert r.returncode == 0 and (tmp_path / "soup" / "model.safetensors").is_file()
    r = cli("interpolate", str(ck / "step-0000004"), str(ck / "step-0000008"), "--steps", "3", "--seq-len", "32", "--eval-windows", "8",
              "--store", str(tmp_path / "st"), "--json", "--out", str(tmp_path / "interp"))
    assert r.returncode == 0, r.stderr[-1500:]
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    assert [round(x["alpha"], 3) for x in rows] == [0.0, 0.5, 1.0]
    assert len(ResultStore(tmp_path / "st").rows()) == 3
