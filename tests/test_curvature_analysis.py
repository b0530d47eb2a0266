"""Issue 48.5 as a first-class analysis: `quantdyn analyze --metrics curvature` / ``sweep.analysis: [curvature]``
(sweep/analysis_rows.py curvature_row) measures the held-out loss's curvature along the update from each checkpoint's
predecessor (runs.previous_checkpoint), and the ``early_warning`` finding family correlates it with Δ CE."""
from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import tiny_run_dict

from quantdyn.analysis.hessian import curvature_along, next_token_loss
from quantdyn.config import from_dict
from quantdyn.models.hf_io import load_causal_lm
from quantdyn.runs import RunDir, previous_checkpoint
from quantdyn.train.branches import cooldown
from quantdyn.train.config import RunConfig
from quantdyn.train.trainer import train


@pytest.fixture
def run_with_branch(tmp_path, kjv_small):
    """A constant-LR run with checkpoints at steps 4 and 8, and a 4-step linear cooldown from step 4 (its one
    checkpoint at step 8)."""
    data_cfg, _ = kjv_small
    d = {**tiny_run_dict(tmp_path, data_cfg, steps=8, checkpoint_every=4), "name": "cv",
         "schedule": {"name": "constant", "warmup": 2}}
    run = train(from_dict(RunConfig, d), progress=False)
    cooldown(run, from_step=4, decay_steps=[4], shape="linear", control=False, progress=False)
    return run


def _direct(ckpt, prev, ids) -> tuple[float, float, float]:
    """curvature_along on (w_ckpt - w_prev) itself: (curvature, |w_ckpt - w_prev|, its float32 rounding bound)."""
    model = load_causal_lm(ckpt).eval()
    params = list(model.parameters())
    d = [p.detach() - q.detach() for p, q in zip(params, load_causal_lm(prev).parameters())]
    with torch.no_grad():
        r = curvature_along(lambda: next_token_loss(model, ids), params, d)
    # the three float32 losses each carry ~eps |L|: the second difference over h^2 is known to 4 eps |L| / h^2
    bound = 4 * torch.finfo(torch.float32).eps * abs(r["loss"]) / r["h"] ** 2
    return r["curvature"], math.sqrt(sum(float(x.double().pow(2).sum()) for x in d)), bound


def test_predecessors_from_the_run_layout(run_with_branch):
    run = run_with_branch
    main4, main8 = RunDir(run).checkpoint(4), RunDir(run).checkpoint(8)
    cool8 = RunDir(run).branch("cooldown-s4-d4-linear").checkpoint(8)
    assert previous_checkpoint(main8) == (main8.parent / "step-0000004", "")
    assert previous_checkpoint(cool8) == (run / "checkpoints" / "step-0000004", "")  # the branch point
    prev, why = previous_checkpoint(main4)
    assert prev is None and "first checkpoint" in why
    prev, why = previous_checkpoint(run)  # not a checkpoint in a run's checkpoints/
    assert prev is None and "average or a loose directory" in why


def test_analyze_curvature_equals_curvature_along_the_update(run_with_branch, kjv_small, cli, tmp_path):
    """`quantdyn analyze RUN --metrics curvature`: main step 8 along w_8 - w_4, the cooldown's step 8 along
    w_cool8 - w_4 (its branch point), main step 4 (the run's first checkpoint) None with the reason; each equals
    curvature_along on that difference over the sweep's first 2 held-out windows."""
    run = run_with_branch
    store = tmp_path / "st"
    r = cli("analyze", run, "--metrics", "curvature", "--store", store, "--windows", "2", "--seq-len", "32",
            "--quiet", "--json")
    assert r.returncode == 0, r.stderr[-1500:]
    rows = {(x["branch"], x["step"]): x for x in json.loads(r.stdout.strip().splitlines()[-1])}
    assert set(rows) == {("main", 4), ("main", 8), ("cooldown-s4-d4-linear", 8)}
    assert all(x["analysis"] == "curvature" and x["git_sha"] is not None and x["checkpoint_hash"]
               for x in rows.values())
    first = rows[("main", 4)]
    assert first["curvature_along_update"] is None and first["curvature_from"] is None
    assert "first checkpoint" in first["curvature_note"]
    ids = kjv_small[1].eval_windows(32, 8)[:2]
    main4 = RunDir(run).checkpoint(4)
    for key, ckpt in ((("main", 8), RunDir(run).checkpoint(8)),
                      (("cooldown-s4-d4-linear", 8), RunDir(run).branch("cooldown-s4-d4-linear").checkpoint(8))):
        row = rows[key]
        k, norm, bound = _direct(ckpt, main4, ids)
        assert row["curvature_from"] == str(main4) and row["curvature_from_step"] == 4, key
        assert row["curvature_windows"] == 2 and row["curvature_note"] is None
        assert abs(row["curvature_along_update"] - k) <= bound, (key, row["curvature_along_update"], k, bound)
        assert row["update_norm"] == pytest.approx(norm, rel=1e-9)
    # the two updates differ (the cooldown's LR decays): a predecessor mix-up would show here
    assert rows[("main", 8)]["update_norm"] != pytest.approx(rows[("cooldown-s4-d4-linear", 8)]["update_norm"],
                                                             rel=1e-3)
    from quantdyn.results.schema import undocumented

    assert all(undocumented(x) == [] for x in rows.values())
    again = cli("analyze", run, "--metrics", "curvature", "--store", store, "--windows", "2", "--seq-len", "32",
                "--quiet")
    assert again.returncode == 0 and "analysis rows" in again.stdout


def test_an_unknown_metric_is_one_line(tmp_path, cli):
    r = cli("analyze", tmp_path, "--metrics", "curvatur", "--store", tmp_path / "st")
    assert r.returncode == 2 and "did you mean 'curvature'" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
