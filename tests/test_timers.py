import types

import pytest

from mlatune.measure import timers


def test_summary_quantiles():
    t = timers.summarize([5.0, 1.0, 3.0, 2.0, 4.0], "wall")
    assert (t.median_us, t.p20_us, t.p80_us, t.reps) == (3.0, 1.8, 4.2, 5)


@pytest.fixture
def clock(monkeypatch):
    """bench's clock, moved only by the timed calls (``clock.spend(us)``): a test of the
    stopping rules does not hang on how loaded the machine is (a slept 500 us call ran 3x
    long once under two test workers on two cores)."""
    now = [0.0]

    def spend(us: float) -> None:
        now[0] += us * 1e-6

    monkeypatch.setattr(timers, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    return types.SimpleNamespace(spend=spend)


def test_repetitions_stop_once_the_median_settles(clock):
    calls = []

    def steady():
        calls.append(1)
        clock.spend(500)

    t = timers.measure(steady, "cpu", timers.Budget(warmup=1, min_reps=10, max_reps=500,
                                                  max_seconds=5, settle=0.5))
    # Steady within the 50% asked: it stops at the first look, after min_reps.
    assert t.timer == "wall" and t.reps == 10 and t.median_us >= 500
    assert len(calls) == t.reps + 1


def test_time_budget_caps_repetitions(clock):
    t = timers.measure(lambda: clock.spend(20_000), "cpu",
                      timers.Budget(warmup=0, min_reps=3, max_reps=1000, max_seconds=0.1,
                                   settle=0))
    assert 3 <= t.reps < 20


def test_a_plain_loser_stops_after_race_reps(clock):
    slow = timers.Budget(warmup=0, min_reps=10, max_reps=50, max_seconds=5, settle=0,
                        race_reps=4, race_ratio=1.5)

    def call() -> None:
        clock.spend(2_000)

    # 2 ms per call against a best of 500 us: 4x slower, so it stops at race_reps.
    raced = timers.measure(call, "cpu", slow, best_us=500.0)
    assert raced.reps == 4 and raced.median_us > 1500 and raced.raced
    # Within the ratio of the best (or with no best yet, or racing off) it runs on.
    close = timers.measure(call, "cpu", slow, best_us=1900.0)
    assert close.reps > 4 and not close.raced
    assert timers.measure(call, "cpu", slow).reps > 4
    off = timers.Budget(**{**slow.__dict__, "race_ratio": 0.0})
    assert timers.measure(call, "cpu", off, best_us=500.0).reps > 4


def test_host_time_queues_little_device_work_when_told_its_length():
    calls = []

    def launch():
        calls.append(1)

    timers.host_us(launch, "cpu")
    assert len(calls) == 21  # a first call keeps anything lazy out, then 20 timed
    calls.clear()
    # A 100 ms launch: 20 queued would keep the device busy for 2 s; 2 calls, no warm call.
    assert timers.host_us(launch, "cpu", device_us=100_000.0, warm=True) >= 0
    assert len(calls) == 2
    calls.clear()
    timers.host_us(launch, "cpu", device_us=1_000.0, warm=True)  # 10 ms of device work
    assert len(calls) == 10
