import math

import pytest

from quantdyn.errors import QuantdynError
from quantdyn.train.schedules import ScheduleConfig, is_decaying, lr_at


def test_wsd_linear_shape():
    c = ScheduleConfig(name="wsd", warmup=10, decay=0.2, decay_shape="linear", lr_end=0.0)
    lrs = [lr_at(s, 1.0, c, 100) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(l == 1.0 for l in lrs[10:80])
    assert lrs[80] == pytest.approx(1 - 1 / 20) and lrs[89] == pytest.approx(0.5)
    assert lrs[99] == pytest.approx(0.0)
    assert all(a >= b for a, b in zip(lrs[80:], lrs[81:]))
    assert not is_decaying(79, c, 100) and is_decaying(80, c, 100)


@pytest.mark.parametrize("shape,mid", [("cosine", 0.5), ("1-sqrt", 1 - math.sqrt(0.5)), ("linear", 0.5)])
def test_wsd_decay_shapes_and_lr_end(shape, mid):
    c = ScheduleConfig(name="wsd", warmup=0, decay=10, decay_shape=shape, lr_end=0.1)
    assert lr_at(4, 2.0, c, 20) == 2.0
    assert lr_at(14, 2.0, c, 20) == pytest.approx(0.1 + 1.9 * mid)
    assert lr_at(19, 2.0, c, 20) == pytest.approx(0.1)


def test_explicit_decay_start_for_branches():
    c = ScheduleConfig(name="wsd", warmup=5, decay=50, decay_start=200)
    assert lr_at(199, 1.0, c, 250) == 1.0
    assert lr_at(249, 1.0, c, 250) == pytest.approx(0.0)


def test_cosine_linear_constant():
    assert lr_at(50, 1.0, ScheduleConfig(name="cosine", warmup=0), 101) == pytest.approx(0.5)
    assert lr_at(50, 1.0, ScheduleConfig(name="linear", warmup=0), 101) == pytest.approx(0.5)
    assert lr_at(99, 1.0, ScheduleConfig(name="constant", warmup=0.01), 100) == 1.0


def test_bad_schedule():
    with pytest.raises(QuantdynError, match="did you mean 'wsd'"):
        lr_at(0, 1.0, ScheduleConfig(name="wds"), 10)
    with pytest.raises(QuantdynError, match="decay_shape"):
        ScheduleConfig(decay_shape="sqrt")
