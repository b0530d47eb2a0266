import json

import pytest
from conftest import tiny_run_dict

from quantdyn.config import from_dict
from quantdyn.results.store import ResultStore
from quantdyn.sweep.sweep import SweepConfig, run_sweep
from quantdyn.train.config import RunConfig
from quantdyn.train.trainer import train


@pytest.mark.e2e
def test_sweep_with_analysis_and_predictor_report(tmp_path, kjv_small):
    data_cfg, _ = kjv_small
    d = tiny_run_dict(tmp_path, data_cfg, steps=16, checkpoint_every=4)
    d["name"] = "an"
    run = train(from_dict(RunConfig, d), progress=False)
    store = tmp_path / "store"
    cfg = from_dict(SweepConfig, {
        "trajectory": {"run": str(run)}, "quantizers": ["rtn2"], "store": str(store),
        "analysis": ["hessian", "outliers", "propagation", "curvature"],
        "analysis_budget": {"windows": 4, "hessian_probes": 6, "hessian_eig_iters": 10},
        "data": {"calib_samples": 4, "calib_seq_len": 32, "eval_windows": 8, "eval_seq_len": 32},
    })
    out = run_sweep(cfg, progress=False)
    assert out["written"] == 4 * (2 + 4)
    rows = ResultStore(store).rows()
    an = {(r["step"], r["analysis"]): r for r in rows if r["kind"] == "analysis"}
    assert len(an) == 16
    assert an[(4, "curvature")]["curvature_along_update"] is None  # the run's first checkpoint
    assert an[(16, "curvature")]["curvature_from"].endswith("step-0000012") and an[(16, "curvature")]["update_norm"] > 0
    h = an[(16, "hessian")]
    assert h["hessian_trace"] > 0 and h["hessian_trace_se"] > 0 and h["hessian_top_eig"] > 0
    assert an[(16, "outliers")]["weight_mmr_max"] >= an[(16, "outliers")]["weight_mmr_mean"] >= 1
    assert an[(16, "propagation")]["prop_R_final__rtn2"] > 0
    from quantdyn.results.schema import undocumented

    for r in rows:  # every field the sweep wrote is described in the row schema, under its kind
        assert undocumented(r) == [], r["kind"]
    assert run_sweep(cfg, progress=False)["written"] == 0  # idempotent, analysis included
    from quantdyn.report.html import write_page
    from quantdyn.report.predictors import predictor_rows

    corr = predictor_rows(rows, n_boot=50)
    metrics = {c["metric"] for c in corr}
    assert {"hessian_trace", "prop_R_final", "weight_mmr_mean", "curvature_along_update"} <= metrics
    assert not {"curvature_from", "update_norm"} & metrics
    page = write_page(store, tmp_path / "rep")
    assert (tmp_path / "rep" / "predictors.png").is_file() and "predict" in page.read_text()


def test_analyze_cli_json_and_bad_metric(tmp_path, kjv_small, cli):
    data_cfg, _ = kjv_small
    d = tiny_run_dict(tmp_path, data_cfg, steps=4, checkpoint_every=4)
    run = train(from_dict(RunConfig, d), progress=False)
    ck = str(run / "checkpoints" / "step-0000004")
    exe = ["analyze", ck, "--store", str(tmp_path / "st"), "--quiet"]
    r = cli(*exe, "--metrics", "outliers,propagation", "--quantizers", "rtn3", "--windows", "2", "--seq-len", "32",
            "--json")
    assert r.returncode == 0, r.stderr[-1500:]
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    assert sorted(x["analysis"] for x in rows) == ["outliers", "propagation"]
    assert all(x["checkpoint"] == ck for x in rows)
    r = cli(*exe, "--metrics", "hesian")
    assert r.returncode == 2 and "did you mean 'hessian'" in r.stderr
