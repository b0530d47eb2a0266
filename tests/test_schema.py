"""results/schema.py: the field table covers what the writers write, keys and calibration identity are the
ones stored rows already carry, the row kinds are constants readers match on, the one rule for reading a stored
number — and old rows read without an error (rel_delta_ce and the combined SE: tests/test_stats.py)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from quantdyn.errors import QuantdynError
from quantdyn.results import schema, stats
from quantdyn.results.schema import describe, number, undocumented


# ------------------------------------------------------------------ the field table
def test_every_kind_lists_documented_fields_and_no_name_means_two_things():
    names = [f.name for g in schema.GROUPS for f in g]
    assert len(names) == len(set(names)) == len(schema.FIELDS)
    assert set(schema.ROW_KINDS) == {"ptq", "fp", "qat", "analysis", "accuracy", "interpolation", "scaling",
                                     "sensitivity", "ship", "decision"}
    for kind in schema.ROW_KINDS.values():
        assert {"key", "kind"} <= set(kind.fields) and kind.meaning and kind.written_by and kind.key
        for name in kind.fields:
            assert describe(name).meaning
    assert all(f.meaning.strip() and f.type.strip() for f in schema.FIELDS.values())


def test_row_kinds_are_constants_that_readers_match_on():
    """Every kind is a RowKind constant in ROW_KINDS (registration order is the table's); matching reads
    ``kind`` alone; and no module under quantdyn/ compares a row's kind with a string (it asks the constant)."""
    import re
    from pathlib import Path

    assert [k.name for k in schema.ROW_KINDS.values()] == ["ptq", "fp", "qat", "analysis", "accuracy",
                                                           "interpolation", "scaling", "sensitivity", "ship",
                                                           "decision"]
    assert schema.ROW_KINDS.get("ptq") is schema.PTQ and schema.PTQ.name == "ptq"
    rows = [{"kind": "ptq", "delta_ce": 0.1}, {"kind": "fp"}, {"delta_ce": 0.2}, {"kind": "ptq"}]
    assert schema.PTQ.select(rows) == [rows[0], rows[3]] and schema.FP.present(rows)
    assert not schema.SCALING.present(rows) and not schema.PTQ.matches(rows[2])
    with pytest.raises(QuantdynError, match="did you mean 'ptq'"):
        schema.ROW_KINDS.get("ptqq")
    with pytest.raises(ValueError, match="registered twice"):
        schema.ROW_KINDS.add("ptq", schema.PTQ)
    string_test = re.compile(r"""(\.get\(["']kind["']\)|\[["']kind["']\])\s*(==|!=|in\b|not in\b)""")
    root = Path(schema.__file__).parents[1]
    found = [f"{p.relative_to(root)}:{n}" for p in sorted(root.rglob("*.py")) if p != Path(schema.__file__)
             for n, line in enumerate(p.read_text().splitlines(), 1) if string_test.search(line)]
    assert found == [], f"compare through the RowKind constants of results/schema.py: {found}"


def test_varying_fields_match_their_patterns_and_unknown_names_are_refused():
    assert describe("prop_R_final__gptq3g64").name == "prop_R_final__<quantizer>"
    assert describe("act_mmr_token_max").name == "act_<metric>_<mean|max>"
    assert describe("beta_lo").name.endswith("_lo")
    assert undocumented({"weight_mmr_median": 1, "x_lo": 2, "delta_ce": 0.1}) == ["weight_mmr_median", "x_lo"]
    assert undocumented({"kind": "fp", "ce_fp": 4.0, "delta_ce": 0.1, "hessian_trace": 1.0}) == ["delta_ce", "hessian_trace"]
    assert undocumented({"kind": "analysis", "act_kurtosis_max": 3.0, "prop_B_sum__rtn2": 0.1}) == []
    with pytest.raises(QuantdynError, match="did you mean 'delta_ce'"):
        describe("delta_cee")


def test_ptq_and_fp_fields_of_a_measurement_are_all_documented():
    """Every field ptq_fields and floor_fields write, for one quantization and for R = 3 repeats, from a real
    measurement with the noise floor and every detailed measure."""
    from quantdyn.engine.measure import MeasureConfig, measure
    from quantdyn.engine.rows import floor_fields, ptq_fields
    from quantdyn.models.gpt import GPT, ModelConfig, resolve_model_config
    from quantdyn.quantize.catalogue import parse_quantizer

    torch.manual_seed(0)
    model = GPT(resolve_model_config(ModelConfig(preset="tiny-2x64", vocab_size=64))).eval()
    ev = torch.randint(0, 64, (6, 17), generator=torch.Generator().manual_seed(1))
    cal = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(2))
    labels = ["gptq3", "gptq3#r1", "gptq3#r2"]
    m = measure(model, dict.fromkeys(labels, "gptq3"), ev, cal, noise_floor=True, cfg=MeasureConfig(batch_size=4))
    qc = parse_quantizer("gptq3")
    fp_row = {"key": "f", "kind": "fp", "ce_fp": m.ce_fp, **floor_fields(m.noise_floor)}
    assert undocumented(fp_row) == [] and fp_row["floor_kl"] > 0 and "floor_ce_fp" not in fp_row
    for R in (1, 3):
        row = {"key": "k", "kind": "ptq", **ptq_fields("gptq3", qc, m, MeasureConfig(), 2, R)}
        assert undocumented(row) == []
        assert isinstance(row["within_noise_floor"], bool) and row["delta_ce_floor_z"] is not None
    assert row["delta_ce_total_se"] == pytest.approx(stats.combined_se(row["delta_ce_se"], row["delta_ce_run_sd"], 3))
    assert row["ppl_ratio"] == pytest.approx(math.exp(row["delta_ce"]))
    assert len(row["block_rel_fro"]) == 2 and row["quant_repeats"] == 3


# ------------------------------------------------------------------ keys
def test_keys_and_calibration_identity_are_those_stored_rows_carry():
    # literal values: a change here would make every stored row unreachable by reruns
    assert schema.row_key("abc123", "ptq:deadbeef:0123456789ab", "e0") == "96da8b3e91862d9934a7c192"
    assert schema.calib_hash("d4t4", 128, 2048, 0) == "95a2fbde708f"
    assert schema.row_key("a", "fp", "e") != schema.row_key("a", "fp", "f")


# ------------------------------------------------------------------ reading numbers and derived quantities
def test_number_reads_finite_reals_only():
    assert number(3) == 3.0 and number(0.5) == 0.5 and number(np.float32(0.25)) == 0.25 and number(np.int64(2)) == 2
    for v in (None, True, False, "0.5", float("nan"), float("inf"), -math.inf, [1.0], {"a": 1}):
        assert number(v) is None
