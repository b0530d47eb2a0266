import pytest

from quantdyn.config import apply_overrides, config_hash, from_dict, to_dict
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
