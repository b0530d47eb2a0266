"""Progress off a terminal is plain lines (no carriage returns), periodic, with a final line."""
import io

from quantdyn.progress import Progress, duration, progress


class _Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_off_a_terminal_lines_are_periodic_and_plain(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr("quantdyn.progress.time.perf_counter", clock)
    out = io.StringIO()
    with Progress("sweep shard 0/2", total=10, unit="ckpt", stream=out, every_s=30) as p:
        for _ in range(10):
            clock.t += 10  # one checkpoint per 10 s: a line every third one
            p.update()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert lines[0] == "sweep shard 0/2: 3/10 ckpt (30%), 0.1 ckpt/s, elapsed 30.0s, eta 1m10s"
    assert len(lines) == 4  # at 30, 60, 90 s and the end
    assert lines[-1] == "sweep shard 0/2: 10/10 ckpt (100%), 0.1 ckpt/s, took 1m40s"


def test_disabled_is_silent_and_tty_uses_a_bar():
    out = io.StringIO()
    assert list(progress(range(5), "x", enabled=False, stream=out)) == list(range(5))
    assert out.getvalue() == ""
    bar = io.StringIO()
    assert list(progress(range(3), "x", stream=bar, tty=True)) == [0, 1, 2]
    assert "\r" in bar.getvalue() and "3/3" in bar.getvalue()


def test_scaled_units_and_unknown_totals():
    out = io.StringIO()
    with Progress("tokenizing", unit="tok", unit_scale=True, stream=out, every_s=0) as p:
        p.update(2_500_000)
    first, last = out.getvalue().splitlines()
    assert first.startswith("tokenizing: 2.50M tok, ") and last.startswith("tokenizing: 2.50M tok, ")
    assert "eta" not in first and "took" in last
    assert duration(3725) == "1h02m" and duration(65) == "1m05s" and duration(1.25) == "1.2s"
