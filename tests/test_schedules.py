import math

import pytest

from quantdyn.errors import QuantdynError
from quantdyn.schedules import (
    Phase,
    PhaseSchedule,
    ScheduleConfig,
    describe_schedule,
    floor_start,
    is_decaying,
    lr_at,
    phases_of,
    schedule_curve,
    schedule_decaying,
    schedule_lr,
    schedule_state,
)


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


# -- one definition of a schedule: ScheduleConfig and phases ------------------------------------------------------


@pytest.mark.parametrize("cfg,total", [
    (ScheduleConfig(name="wsd", warmup=10, decay=0.2), 100),
    (ScheduleConfig(name="wsd", warmup=5, decay=50, decay_start=200, decay_shape="1-sqrt", lr_end=0.1), 250),
    (ScheduleConfig(name="wsd", warmup=0, decay=10, decay_shape="cosine", lr_end=0.05), 20),
    (ScheduleConfig(name="wsd", warmup=3, decay=0), 30),
    (ScheduleConfig(name="cosine", warmup=0.1, lr_end=0.1), 57),
    (ScheduleConfig(name="linear", warmup=0), 40),
    (ScheduleConfig(name="constant", warmup=7), 40),
])
def test_phases_of_equals_the_trainer_schedule(cfg, total):
    """Presets and the trainer share one schedule definition: the phase form of a ScheduleConfig gives the
    trainer's LR and decaying flag at every step."""
    peak = 2.0
    sched = phases_of(cfg, peak, total)
    for step in range(total):
        want = lr_at(step, peak, cfg, total)
        assert schedule_lr(step, sched) == pytest.approx(want, rel=1e-12, abs=1e-15), step
        assert schedule_decaying(step, sched) == is_decaying(step, cfg, total), step


def test_decaying_means_past_warmup_and_below_peak():
    c = ScheduleConfig(name="cosine", warmup=10)
    assert not is_decaying(9, c, 100) and not is_decaying(10, c, 100)  # step 10: still at the peak
    assert is_decaying(11, c, 100) and is_decaying(99, c, 100)  # the last step, at lr_end, is decayed
    assert not any(is_decaying(s, ScheduleConfig(name="constant", warmup=10), 100) for s in range(100))
    # a floor that holds the LR is a constant LR, not a decay (Pythia's cosine-floor); a warmup never decays,
    # even below the peak
    s = PhaseSchedule((Phase("warmup", "linear", 0, 10, 0.0, 1.0), Phase("cos", "cosine", 10, 110, 1.0, 0.0, floor=0.2)))
    assert not schedule_decaying(5, s) and not schedule_decaying(10, s) and schedule_decaying(11, s)
    assert schedule_state(105, s) == (0.2, "cos-floor", False)
    assert schedule_decaying(floor_start(s.phases[1]) - 1e-6, s) and not schedule_decaying(floor_start(s.phases[1]), s)


def test_schedule_name_is_validated_on_construction():
    with pytest.raises(QuantdynError, match=r"unknown schedule 'cosin' \(did you mean 'cosine'\?\)"):
        ScheduleConfig(name="cosin")


def test_gpt_neox_cosine_with_min_lr_clamp():
    """Pythia's schedule (GPT-NeoX AnnealingLR): lr = peak*step/1430 in warmup, then
    max(peak/2 (1 + cos(pi (step-1430)/143000)), min_lr) -- hand-computed."""
    peak, mn = 6e-4, 6e-5
    s = PhaseSchedule((Phase("warmup", "linear", 0, 1430, 0.0, peak),
                       Phase("cosine", "cosine", 1430, 144430, peak, 0.0, floor=mn)))
    assert schedule_lr(715, s) == pytest.approx(peak * 715 / 1430, rel=1e-12)
    assert schedule_lr(72000, s) == pytest.approx(peak / 2 * (1 + math.cos(math.pi * 70570 / 143000)), rel=1e-12)
    cross = 1430 + 143000 * math.acos(2 * mn / peak - 1) / math.pi  # where the cosine meets min_lr (~115,140)
    assert schedule_state(cross - 50, s)[1] == "cosine" and schedule_state(cross + 50, s)[1] == "cosine-floor"
    assert schedule_lr(143000, s) == mn
    assert floor_start(s.phases[1]) == pytest.approx(cross, abs=1e-6)
    assert schedule_state(143000, s) == (mn, "cosine-floor", False)  # step143000: held at min_lr, not decaying
    assert describe_schedule(s) == ("warmup 0 -> 6e-4 over 0-1.43k; cosine 6e-4 -> 6e-5 over 1.43k-115.1k, then 6e-5 "
                                    "(floor) [steps]")


def test_phase_validation_and_description():
    with pytest.raises(QuantdynError, match="did you mean 'cosine'"):
        Phase("x", "cosin", 0, 1, 1.0, 0.0)
    with pytest.raises(QuantdynError, match="end .* must lie after start"):
        Phase("x", "linear", 5, 5, 1.0, 0.0)
    with pytest.raises(QuantdynError, match="constant phase"):
        Phase("x", "constant", 0, 0, 1.0, 0.5)
    with pytest.raises(QuantdynError, match="in order of start"):
        PhaseSchedule((Phase("a", "constant", 5, 5, 1.0, 1.0), Phase("b", "constant", 0, 0, 1.0, 1.0)))
    with pytest.raises(QuantdynError, match="did you mean 'tokens'"):
        PhaseSchedule((Phase("a", "constant", 0, 0, 1.0, 1.0),), unit="token")
    s = PhaseSchedule((Phase("warmup", "linear", 0, 8.388608e9, 0.0, 3e-4),
                       Phase("cosine", "cosine", 8.388608e9, 5e12, 3e-4, 3e-5)), unit="tokens")
    assert describe_schedule(s) == "warmup 0 -> 3e-4 over 0-8.389B; cosine 3e-4 -> 3e-5 over 8.389B-5T [tok]"
    xs = [x for x, _ in schedule_curve(s, 0, 4e12, n=50)]
    assert 8.388608e9 in xs and xs == sorted(xs) and len(xs) == 51
