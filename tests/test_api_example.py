"""examples/api_quickstart.py, the public API end to end: what it returns is what the store and report hold."""
import importlib.util
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "api_quickstart.py"


@pytest.mark.e2e
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


def test_quantize_checkpoint_speaks_python_and_keeps_old_keywords(tmp_path):
    """The API's errors name its parameters, never CLI flags; the keywords before 0.2 still work, each with a
    DeprecationWarning naming the new spelling; the result is typed."""
    import quantdyn.api as qd
    from quantdyn.errors import QuantdynError

    missing = str(tmp_path / "missing")
    for kwargs, says in (({"quantizers": ["rtn3", "rtn4"], "out": tmp_path / "o"}, "out writes the model of one"),
                         ({"export": "gptq"}, "export and push_to_hub need out"),
                         ({"repeats": 0}, "repeats 0 must be >= 1"),
                         ({"quantizers": ["gptq4", "gptq4g128"]}, "given twice")):
        with pytest.raises(QuantdynError, match=says) as e:
            qd.quantize_checkpoint(missing, **kwargs)
        assert "--" not in str(e.value)
    with pytest.warns(DeprecationWarning, match="is now quantizers='gptq3-gptqmodel'"):
        with pytest.raises(QuantdynError, match="does not exist"):  # past the checks: the keywords were understood
            qd.quantize_checkpoint(missing, method="gptq", bits=3, preset="gptqmodel")
    with pytest.raises(QuantdynError, match="eval_tokens 10 is less than one window"):
        qd.quantize_checkpoint(missing, "rtn4", eval_tokens=10)
    with pytest.warns(DeprecationWarning, match=r"n_eval_tokens=...\) is now eval_tokens"):
        with pytest.raises(QuantdynError, match="less than one window"):
            qd.quantize_checkpoint(missing, "rtn4", n_eval_tokens=10)
    with pytest.raises(TypeError, match="frobnicate"):
        qd.quantize_checkpoint(missing, frobnicate=1)
    one = qd.QuantizeResult(({"quantizer": "rtn4", "delta_ce": 0.5},))
    assert one.row["delta_ce"] == 0.5 and one.metrics["rtn4"]["delta_ce"] == 0.5 and one.out is None
    with pytest.warns(DeprecationWarning, match=r"result.row\[key\]"):
        assert one["delta_ce"] == 0.5  # quantize_checkpoint returned the row itself before 0.2
    with pytest.raises(QuantdynError, match="read .rows"):
        qd.QuantizeResult(({"quantizer": "rtn3"}, {"quantizer": "rtn4"})).row


def test_measure_takes_labels_and_the_old_progress_keyword():
    import torch

    import quantdyn.api as qd
    from quantdyn.models.gpt import GPT, ModelConfig, resolve_model_config

    torch.manual_seed(0)
    model = GPT(resolve_model_config(ModelConfig(n_layer=1, d_model=32, n_head=2, max_seq_len=32), 64))
    windows = torch.randint(0, 64, (4, 17))
    lines = []
    m = qd.measure(model, ["rtn4", qd.parse_quantizer("rtn3g0")], windows, on_block=lines.append)
    assert sorted(m.metrics) == ["rtn3g0", "rtn4"] and len(lines) == 1 and lines[0].startswith("block 1/1")
    with pytest.warns(DeprecationWarning, match=r"measure\(progress=callable\) is now measure\(on_block=callable\)"):
        old = qd.measure(model, {"r": "rtn4"}, windows, progress=lines.append)
    # the same operations on the same windows (another variant in the pass changes nothing of this one's)
    assert old.metrics["r"]["delta_ce"] == pytest.approx(m.metrics["rtn4"]["delta_ce"], rel=1e-9, abs=1e-12)
    assert len(lines) == 2
