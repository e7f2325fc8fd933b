"""bench/quiet.py: a run starts once what the run before removed is written back and 5 s old
(the ext4 allocator steps over recent deletions), and ``make bench-ab`` tells its runs so."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
from bench import quiet
from bench.ab import _clean_env


class _Clock:
    """A monotonic clock that moves only when something sleeps or syncs."""

    def __init__(self, sync_s: float) -> None:
        self.now = 100.0
        self.sync_s = sync_s
        self.calls: list[tuple[str, float]] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.calls.append(("sleep", s))
        self.now += s

    def sync(self) -> None:
        self.calls.append(("sync", self.now))
        self.now += self.sync_s


@pytest.mark.parametrize(("sync_s", "slept"), [(0.0, 6.0), (2.5, 3.5), (7.0, None)])
def test_settle_writes_back_then_waits_out_the_rest(
    monkeypatch: pytest.MonkeyPatch, sync_s: float, slept: float | None
) -> None:
    clock = _Clock(sync_s)
    monkeypatch.setattr(
        quiet, "time", SimpleNamespace(monotonic=clock.monotonic, sleep=clock.sleep)
    )
    monkeypatch.setattr(os, "sync", clock.sync)
    took = quiet.settle(6.0)
    want = [("sync", 100.0)] + ([("sleep", slept)] if slept is not None else [])
    assert clock.calls == want
    assert took == max(6.0, sync_s)


def test_bench_ab_runs_are_told_they_were_settled() -> None:
    assert _clean_env()[quiet.SETTLED_ENV] == "1"
