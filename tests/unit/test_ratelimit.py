"""Token buckets per key (gpulayer_runtime.ratelimit), on a clock stepped by hand."""

from __future__ import annotations

import math

import pytest

from gpulayer_runtime.ratelimit import Buckets


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_burst_then_rate() -> None:
    clock = Clock()
    b = Buckets(rate=2.0, burst=3, clock=clock)
    assert [b.take("alice") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert b.take("alice") == pytest.approx(0.5)  # one token comes every 1/rate s
    clock.now += 0.25
    assert b.take("alice") == pytest.approx(0.25)  # a refusal takes nothing
    clock.now += 0.25
    assert b.take("alice") == 0.0
    assert b.take("alice") == pytest.approx(0.5)


def test_owners_do_not_share_a_bucket() -> None:
    b = Buckets(rate=1.0, burst=1, clock=Clock())
    assert b.take("alice") == 0.0
    assert b.take("alice") > 0
    assert b.take("bob") == 0.0


def test_refill_stops_at_burst() -> None:
    clock = Clock()
    b = Buckets(rate=10.0, burst=2, clock=clock)
    b.take("alice")
    clock.now += 3600
    assert [b.take("alice") for _ in range(3)][:2] == [0.0, 0.0]
    assert b.take("alice") > 0


def test_idle_buckets_are_dropped() -> None:
    clock = Clock()
    b = Buckets(rate=1.0, burst=5, clock=clock)
    for i in range(100):
        b.take(f"owner-{i}")
    assert len(b) == 100
    clock.now += 5.0  # every bucket is full again: the same as none
    b.take("late")
    assert len(b) == 1


def test_thousands_of_owners_stay_bounded() -> None:
    clock = Clock()
    b = Buckets(rate=1.0, burst=5, clock=clock, max_keys=1000)
    for i in range(50_000):
        assert b.take(f"owner-{i}") == 0.0
    assert len(b) == 1000


def test_recently_used_bucket_outlives_older_ones() -> None:
    b = Buckets(rate=1.0, burst=1, clock=Clock(), max_keys=2)
    b.take("flooder")
    b.take("a")
    b.take("flooder")  # refused, but used last: "a" is the one dropped
    b.take("b")
    assert b.take("flooder") > 0


@pytest.mark.parametrize(
    ("rate", "burst"), [(0, 1), (-1, 1), (math.nan, 1), (math.inf, 1), (1, 0), (1, math.nan)]
)
def test_bad_settings_are_refused(rate: float, burst: float) -> None:
    with pytest.raises(ValueError, match="expected"):
        Buckets(rate, burst)


def test_huge_or_nul_key_is_just_a_key() -> None:
    b = Buckets(rate=1.0, burst=1, clock=Clock())
    assert b.take("x" * 100_000 + "\x00") == 0.0
    assert b.take("x" * 100_000 + "\x00") > 0
