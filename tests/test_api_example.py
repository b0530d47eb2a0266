"""examples/api_quickstart.py, the public API end to end: what it returns is what the store and report hold."""
import importlib.util
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "api_quickstart.py"


@pytest.mark.slow
def test_api_quickstart_example(tmp_path):
    from quantdyn.results.store import ResultStore

    spec = importlib.util.spec_from_file_location("api_quickstart", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = mod.main(["--steps", "16", "--out", str(tmp_path)])
    assert [b.name for b in out["branches"]] == ["cooldown-s8-d4-linear", "control-s8-d4"]
    res = out["result"]
    assert [r["quantizer"] for r in res.rows] == ["gptq3g32", "rtn4"] and res.out is None
    assert all(m["delta_ce_total_se"] > 0 for m in res.metrics.values())
    rows = ResultStore(tmp_path / "results").rows()
    df = out["rows"]
    assert sorted(df["key"]) == sorted(r["key"] for r in rows)
    ptq = df[df["kind"] == "ptq"]
    # main: 4 checkpoints, each branch 1, two quantizers each
    assert len(ptq) == 2 * (4 + 2) and set(ptq["quantizer"]) == {"rtn3", "gptq3"}
    assert set(ptq["branch"]) == {"main", "cooldown-s8-d4-linear", "control-s8-d4"}
    assert out["report"].is_file() and "quickstart" in out["report"].read_text()
