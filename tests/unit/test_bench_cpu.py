"""The loop's CPU per job per part (bench/cpu.py): the arithmetic, and a reading of real
processes (this one and a child it starts and reaps)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from bench.cpu import PARTS, loop_cpu, per_job_us


def test_per_job_us_divides_each_part_and_totals() -> None:
    before = dict.fromkeys(PARTS, 1.0)
    after = {**before, "placement": 1.5, "postgres": 1.25}
    out = per_job_us(before, after, 1_000)
    assert out["placement"] == pytest.approx(500.0)
    assert out["postgres"] == pytest.approx(250.0)
    assert out["executor"] == 0.0
    assert out["total"] == pytest.approx(750.0)
    assert list(out) == [*PARTS, "total"]


def test_a_part_that_went_backwards_counts_zero() -> None:
    # A process that ended unreaped between the readings takes its time with it.
    out = per_job_us({"shims_and_jobs": 2.0}, {"shims_and_jobs": 1.0}, 10)
    assert out["shims_and_jobs"] == 0.0


def test_per_job_us_needs_a_job() -> None:
    with pytest.raises(ValueError, match="jobs = 0"):
        per_job_us({}, {}, 0)


def test_a_reaped_child_counts_in_its_parent() -> None:
    me = os.getpid()
    before = loop_cpu([me], me, me)
    # The child burns at least 0.2 s of CPU by its own clock and says how much it counted.
    burn = (
        "import time\nt = time.process_time()\n"
        "while time.process_time() - t < 0.2: pass\nprint(time.process_time())"
    )
    done = subprocess.run([sys.executable, "-c", burn], check=True, capture_output=True, text=True)
    child = float(done.stdout)
    after = loop_cpu([me], me, me)
    assert set(before) == set(PARTS)
    # The kernel counts in clock ticks (10 ms at 100 Hz), per field: the parent reads its
    # reaped children's user and system time, two fields, each rounded down, in each of two
    # readings, so up to four ticks of the child's time may not show.
    slack = 4 / os.sysconf("SC_CLK_TCK")
    # The child's CPU, reaped by this process, is in the tree of "placement" (this process)
    # and in the executor's reaped children ("shims and jobs"), not its own time.
    assert after["placement"] - before["placement"] >= child - slack
    assert after["shims_and_jobs"] - before["shims_and_jobs"] >= child - slack


def test_without_an_executor_its_parts_stay_zero() -> None:
    # Placement alone (the placement1k group): no executor to read.
    me = os.getpid()
    out = loop_cpu([me], None, me)
    assert out["executor"] == 0.0
    assert out["shims_and_jobs"] == 0.0
    # This process (read as placement and as nats-server here) has spent CPU by now.
    assert out["placement"] > 0.0
    assert out["nats"] > 0.0
