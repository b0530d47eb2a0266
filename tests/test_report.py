"""Report helpers on synthetic rows: the Figure-6 colour key and averaging vs decay."""
from quantdyn.report import figures


def _row(run, branch, kind, step, q, dce, ce=4.0, **kw):
    return {"key": f"{run}{branch}{step}{q}", "kind": "ptq", "run": run, "branch": branch, "ckpt_kind": kind,
            "step": step, "tokens": step * 10, "quantizer": q, "bits": int(q[-1]), "delta_ce": dce,
            "delta_ce_se": 0.001, "ce_fp": ce, "ce_q": ce + dce, "checkpoint": f"/x/{run}/{branch}/{step}", **kw}


def test_varied_key_picks_the_setting_that_differs():
    rows = [_row("a", "main", "checkpoint", 10, "rtn3", 0.01, peak_lr=1e-3, weight_decay=0.1),
            _row("b", "main", "checkpoint", 10, "rtn3", 0.02, peak_lr=3e-3, weight_decay=0.1)]
    assert figures.varied_key(rows) == "peak_lr"
    rows[1]["peak_lr"] = 1e-3
    rows[1]["weight_decay"] = 0.05
    assert figures.varied_key(rows) == "weight_decay"
    rows[1]["weight_decay"] = 0.1
    assert figures.varied_key(rows) == "run"


def test_averaging_vs_decay_table(tmp_path):
    rows = [_row("a", "main", "checkpoint", 10, "rtn3", 0.01), _row("a", "main", "checkpoint", 20, "rtn3", 0.03),
            _row("a", "lawa-k3-p10", "lawa", 10, "rtn3", 0.02), _row("a", "lawa-k3-p10", "lawa", 20, "rtn3", 0.015)]
    table = figures.averaging_vs_decay(rows, tmp_path / "f.png")
    assert [(t["checkpoint"], t["delta_ce"]) for t in table] == [("decayed @20", 0.03), ("lawa-k3-p10 @20", 0.015)]
    assert (tmp_path / "f.png").is_file()
    assert figures.averaging_vs_decay(rows[:2], tmp_path / "g.png") == []  # no averages, no figure
