"""The container-start bench's clock reading (bench/container_start.py): busybox ``adjtimex``'s
output as recorded on this project's machine, microseconds or nanoseconds by its status."""

from __future__ import annotations

import pytest
from bench.container_start import clock_read

RECORDED = """\
    mode:         0
-o  offset:       0 us
-f  freq.adjust:  0 (65536 = 1ppm)
    maxerror:     16000000
    esterror:     16000000
    status:       64 (UNSYNC)
-p  timeconstant: 2
    precision:    1 us
    tolerance:    32768000
-t  tick:         10000 us
    time.tv_sec:  1796644840
    time.tv_usec: 397191
    return value: 5 (clock not synchronized)
"""


def test_clock_read_takes_seconds_and_microseconds() -> None:
    assert clock_read(RECORDED) == pytest.approx(1796644840.397191, abs=1e-7)


def test_clock_read_takes_nanoseconds_when_status_says_so() -> None:
    nano = RECORDED.replace("64 (UNSYNC)", "8256 (UNSYNC|NANO)").replace("397191", "397191000")
    assert clock_read(nano) == pytest.approx(1796644840.397191, abs=1e-7)


def test_clock_read_is_none_until_both_parts_arrived() -> None:
    head = RECORDED.split("    time.tv_usec")[0]
    assert clock_read(head) is None
    assert clock_read("") is None
