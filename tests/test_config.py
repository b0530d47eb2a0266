import pytest

import dataclasses

from quantdyn.config import apply_overrides, check_config_key, config_hash, from_dict, to_dict
from quantdyn.errors import QuantdynError
from quantdyn.registry import Registry
from quantdyn.train.config import RunConfig


def test_roundtrip_and_overrides():
    d = apply_overrides({"train": {"steps": 5}}, ["optim.lr=1e-3", "train.checkpoint_tokens=[10,20]", "name=x"])
    cfg = from_dict(RunConfig, d)
    assert cfg.optim.lr == 1e-3 and cfg.train.steps == 5 and cfg.train.checkpoint_tokens == (10, 20)
    assert from_dict(RunConfig, to_dict(cfg)) == cfg
    assert config_hash(cfg) == config_hash(from_dict(RunConfig, to_dict(cfg)))


def test_unknown_keys_did_you_mean():
    with pytest.raises(QuantdynError, match=r"unknown config key 'optim.lrr' \(did you mean 'lr'\?\)"):
        from_dict(RunConfig, {"optim": {"lrr": 1}})
    with pytest.raises(QuantdynError, match="did you mean 'schedule'"):
        from_dict(RunConfig, {"schedul": {}})
    with pytest.raises(QuantdynError, match="expected an integer"):
        from_dict(RunConfig, {"train": {"steps": "many"}})
    with pytest.raises(QuantdynError, match="key=value"):
        apply_overrides({}, ["optim.lr"])


def test_registry():
    r = Registry("thing")
    r.register("alpha")(1)
    with pytest.raises(ValueError):
        r.register("alpha")(2)
    with pytest.raises(QuantdynError, match="did you mean 'alpha'"):
        r.get("alpah")
    assert r.names() == ["alpha"] and "alpha" in r


# ------------------------------------------------------------------ composed configs (issue 39, step 3)
def test_a_sweeps_engine_settings_are_one_nested_config_and_old_files_still_load():
    from quantdyn.engine.measure import MeasureConfig
    from quantdyn.sweep.sweep import SweepConfig

    flat = from_dict(SweepConfig, {"batch_size": 3, "dtype": "float32", "detailed_metrics": False})
    nested = from_dict(SweepConfig, {"engine": {"batch_size": 3, "dtype": "float32", "detailed_metrics": False}})
    assert flat == nested and flat.engine == MeasureConfig(batch_size=3, dtype="float32", detailed_metrics=False)
    assert "batch_size" not in to_dict(flat) and to_dict(flat)["engine"]["batch_size"] == 3
    assert from_dict(SweepConfig, to_dict(flat)) == flat  # what is written reads back the same
    # the same setting twice with different values: one line naming both places
    with pytest.raises(QuantdynError, match=r"'batch_size' and 'engine.batch_size' are the same setting"):
        from_dict(SweepConfig, {"batch_size": 3, "engine": {"batch_size": 4}})
    assert from_dict(SweepConfig, {"batch_size": 4, "engine": {"batch_size": 4}}).engine.batch_size == 4
    # nested under a study's sweep section too, and a bad value still fails in MeasureConfig's own words
    with pytest.raises(QuantdynError, match="streams setting"):
        from_dict(SweepConfig, {"streams": "tape"})
    check_config_key(SweepConfig, "batch_size")
    check_config_key(SweepConfig, "engine.streams")
    with pytest.raises(QuantdynError, match="did you mean 'engine.batch_size'"):
        check_config_key(SweepConfig, "engine.batch_sise")


def test_the_walk_takes_the_measure_settings_under_their_own_names():
    from quantdyn.config import shared_fields
    from quantdyn.engine.measure import MeasureConfig
    from quantdyn.engine.walk import WalkConfig

    cfg = MeasureConfig(batch_size=5, calib_batch_size=3, quantize_threads=2, layer_diagnostics=True,
                        spill_dir="/x", streams="disk")
    shared = shared_fields(cfg, WalkConfig)
    assert shared == {"batch_size": 5, "calib_batch_size": 3, "quantize_threads": 2, "layer_diagnostics": True,
                      "spill_dir": "/x", "streams": "disk"}
    assert WalkConfig(**shared).batch_size == 5


def test_field_docs_are_read_from_the_source_without_importing_it():
    from quantdyn.config import field_docs
    from quantdyn.engine.measure import MeasureConfig

    by_path = field_docs("engine/measure.py:MeasureConfig")
    assert by_path == field_docs(MeasureConfig)
    assert set(by_path) == {f.name for f in dataclasses.fields(MeasureConfig)}
    assert by_path["max_memory"].startswith("Memory for weights and activation streams") and "\n" not in by_path["dtype"]
    with pytest.raises(QuantdynError, match="no config class Nope"):
        field_docs("engine/measure.py:Nope")
