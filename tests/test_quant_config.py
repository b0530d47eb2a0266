"""Quantizer configs: validation at construction, one canonical label per config, pinned config hashes."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quantdyn.config import config_hash, from_dict
from quantdyn.errors import QuantdynError
from quantdyn.quantize import PRESETS, QuantConfig, parse_quantizer

# Sweep rows are keyed by config_hash(QuantConfig): these values were computed before the canonical labels
# and the stricter validation were introduced, and must never change (a change would re-run every sweep).
PINNED = {
    "gptq4": "11036172a747",
    "gptq4g128": "11036172a747",
    "rtn3g64": "81048b687c26",
    "rtn4g0": "1bd52dedb7e1",
    "awq4-sym": "6032a480bc08",
    "gptq4-gptqmodel": "4f2fec8172b3",
    "gptq3g64-gptqmodel-v5": "e8bc9fb642ff",
    "gptq2-act-mse-static-seq-head": "9210a5456044",
    "rtn2": "7f40438c1748",
}


@pytest.mark.parametrize("spec", sorted(PINNED))
def test_config_hashes_are_pinned(spec):
    assert config_hash(parse_quantizer(spec)) == PINNED[spec]


def test_pinned_hashes_of_dicts_and_python_values():
    assert config_hash(QuantConfig(group_size=None)) == "04cbc928c2e2" == config_hash(QuantConfig(group_size=0))
    d = {"method": "gptq", "bits": 3, "damp_percent": 0.1, "block_size": 64}
    assert config_hash(parse_quantizer(d)) == "3e934b351813"
    # numpy scalars and ints for float fields are stored as plain int/float: equal configs hash equally
    c = QuantConfig(bits=np.int64(3), damp_percent=0.1, damp_auto_increment=0, block_size=np.int32(64))
    assert type(c.bits) is int and type(c.damp_auto_increment) is float
    assert config_hash(c) == config_hash(parse_quantizer(d))


@pytest.mark.parametrize("spellings, canonical", [
    (["gptq4", "gptq4g128", "GPTQ4", " gptq4 ", "gptq4-reference", "gptq4-asym", {"method": "gptq"}], "gptq4"),
    (["rtn3g64", "rtn3g64-reference"], "rtn3g64"),
    (["awq4g0-sym", "awq4g0-asym-sym"], "awq4g0-sym"),
    (["gptq4-gptqmodel", "gptq4g128-gptqmodel", {"preset": "gptqmodel", "bits": 4}], "gptq4-gptqmodel"),
    (["gptq3g64-gptqmodel-v5"], "gptq3g64-gptqmodel-v5"),
    (["gptq2-act-mse-static-seq-head", "gptq2-head-seq-static-mse-act"], "gptq2-mse-act-static-seq-head"),
    (["gptq3-damp0.1-block64", {"method": "gptq", "bits": 3, "damp_percent": 0.1, "block_size": 64}],
     "gptq3-damp0.1-block64"),
])
def test_every_spelling_has_one_canonical_label(spellings, canonical):
    cfgs = [parse_quantizer(s) for s in spellings]
    assert all(c == cfgs[0] for c in cfgs)
    assert {c.name for c in cfgs} == {canonical}
    assert parse_quantizer(canonical) == cfgs[0]


def test_labels_tell_apart_configs_that_share_method_bits_and_group():
    names = {parse_quantizer(s).name for s in ["gptq4", "gptq4-gptqmodel", "gptq4-gptqmodel-v5", "gptq4-sym",
                                                "gptq4-act", "gptq4-damp0.05"]}
    assert len(names) == 6  # before, all six were 'gptq4g128'


@pytest.mark.parametrize("bad, msg", [
    (dict(group_size=-1), "group_size=-1 is not a group size; write 0"),
    (dict(group_size=-7), r"0 \(one group per output row\) or a positive"),
    (dict(group_size=2.5), "group_size"),
    (dict(group_size=True), "group_size"),
    (dict(bits=1), "from 2 to 8"),
    (dict(bits=9), "from 2 to 8"),
    (dict(bits=4.0), "from 2 to 8"),
    (dict(damp_percent=0.0), r"damp_percent=0.0 must lie in \(0, 1\)"),
    (dict(damp_percent=1.0), r"\(0, 1\)"),
    (dict(damp_percent=float("nan")), r"\(0, 1\)"),
    (dict(damp_percent=True), r"\(0, 1\)"),
    (dict(damp_auto_increment=-0.01), r"\[0, 1\)"),
    (dict(damp_auto_increment=1.5), r"\[0, 1\)"),
    (dict(block_size=0), "block_size=0 must be an integer >= 1"),
    (dict(block_size=1.5), "block_size"),
    (dict(awq_grid=0), "awq_grid=0 must be an integer >= 1"),
    (dict(sym="yes"), "sym='yes' must be true or false"),
    (dict(act_order=True, act_group_aware=True), "exclude each other"),
    (dict(group_size=0, static_groups=True), "needs group_size > 0"),
])
def test_every_field_is_checked_when_the_config_is_built(bad, msg):
    with pytest.raises(QuantdynError, match=msg):
        QuantConfig(**bad)


@pytest.mark.parametrize("spec, msg", [
    ("gptq4-block6.5", "needs an integer"),
    ("gptq4-damp0", r"\(0, 1\)"),
    ("gptq4-dmap0.1", "unknown quantizer option 'dmap0.1'"),
    ("gptq4g-1", "cannot read"),
    ({"method": "rtn", "group_size": -1}, "write 0"),
    ({"method": "rtn", "group_size": "x"}, "group_size"),
])
def test_spec_errors_are_one_line(spec, msg):
    with pytest.raises(QuantdynError, match=msg) as e:
        parse_quantizer(spec)
    assert "\n" not in str(e.value)


@st.composite
def configs(draw):
    """Any valid QuantConfig (invalid combinations are drawn and then repaired, not filtered out)."""
    group = draw(st.sampled_from([0, 1, 32, 64, 100, 128, 256]))
    order = draw(st.sampled_from(["none", "act", "gar"]))
    return QuantConfig(
        method=draw(st.sampled_from(["rtn", "gptq", "awq"])), bits=draw(st.integers(2, 8)), group_size=group,
        sym=draw(st.booleans()), mse=draw(st.booleans()),
        damp_percent=draw(st.sampled_from([0.01, 0.05, 0.1, 1e-5, 0.3333333333333333, 0.999])),
        damp_auto_increment=draw(st.sampled_from([0.0, 0.01, 0.0025])),
        act_order=order == "act", act_group_aware=order == "gar" and group > 0,
        static_groups=draw(st.booleans()) and group > 0, true_sequential=draw(st.booleans()),
        block_size=draw(st.sampled_from([1, 64, 128, 333])), awq_grid=draw(st.sampled_from([1, 20, 7])),
        awq_clip=draw(st.booleans()), quantize_head=draw(st.booleans()),
    )


@settings(max_examples=300, deadline=None, database=None, derandomize=True)
@given(configs())
def test_the_label_parses_back_to_the_same_config(cfg):
    name = cfg.name
    assert parse_quantizer(name) == cfg
    assert config_hash(parse_quantizer(name)) == config_hash(cfg)
    assert name == name.strip().lower() and " " not in name


@settings(max_examples=100, deadline=None, database=None, derandomize=True)
@given(st.sampled_from(sorted(PRESETS)), st.integers(2, 8), st.sampled_from([0, 64, 128]))
def test_presets_round_trip(preset, bits, group):
    fields = {**PRESETS[preset], "bits": bits, "group_size": group}
    if not group and (fields.get("act_group_aware") or fields.get("static_groups")):
        return
    cfg = from_dict(QuantConfig, fields)
    assert parse_quantizer(cfg.name) == cfg


def test_no_field_was_added():
    # a new QuantConfig field changes every config hash (rows are keyed by it); the pinned hashes catch that,
    # this says why. The rotation fields are the exception that proves it: marked OMIT_DEFAULT, they stay out of
    # the hash while unset, so every unrotated config keeps its pinned hash
    assert [f.name for f in dataclasses.fields(QuantConfig)] == [
        "method", "bits", "group_size", "sym", "mse", "damp_percent", "damp_auto_increment", "act_order",
        "act_group_aware", "static_groups", "true_sequential", "block_size", "awq_grid", "awq_clip", "quantize_head",
        "hadamard", "r1", "rotation_seed"]
    added = [f for f in dataclasses.fields(QuantConfig) if f.name in ("hadamard", "r1", "rotation_seed")]
    assert all(f.metadata.get("omit_default") for f in added)
