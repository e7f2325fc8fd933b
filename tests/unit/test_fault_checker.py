"""The fault run's checker: each count can be made to move by the case it is about."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from tests.faults.fault_checker import (
    Run,
    check,
    double_bookings,
    longest_stall,
    parse_marker,
    read_markers,
)

NODE_OF = {"/w/a": "a", "/w/b": "b"}


def run(job: str, node: str = "a", devices: tuple[str, ...] = ("0",), start: float = 0.0,
        end: float = 1.0) -> Run:  # fmt: skip
    return Run(job, node, devices, start, end)


def test_marker_lines_give_the_run() -> None:
    r = parse_marker("fr-1.4242", "/w/b/jobs/x|3|10.5\n12.25\n", NODE_OF)
    assert r == Run("fr-1", "b", ("3",), 10.5, 12.25)
    twice = parse_marker("fr-3.9", "/w/a/jobs/z|0|1\n\n4.5\n", NODE_OF)
    assert twice.end == 4.5
    killed = parse_marker("fr-2.7", "/w/a/jobs/y|0,1|3\n", NODE_OF)
    assert killed.end == math.inf
    assert killed.devices == ("0", "1")


def test_read_markers_reads_every_file(tmp_path: Path) -> None:
    (tmp_path / "j1.1").write_text("/w/a/j|0|1\n2\n")
    (tmp_path / "j2.2").write_text("/w/b/j|1|1\n")
    assert [r.job_id for r in read_markers(tmp_path, NODE_OF)] == ["j1", "j2"]


def test_overlap_on_one_device_is_double_booking_and_back_to_back_is_not() -> None:
    assert double_bookings([run("x", end=2.0), run("y", start=2.0, end=3.0)]) == []
    assert len(double_bookings([run("x", end=2.0), run("y", start=1.5, end=3.0)])) == 1
    # Same device index on two nodes, or two devices of one node: not the same device.
    assert double_bookings([run("x", end=5), run("y", node="b", end=5)]) == []
    assert double_bookings([run("x", end=5), run("y", devices=("1",), end=5)]) == []
    # A run that never said it ended holds its device for good.
    assert len(double_bookings([run("x", end=math.inf), run("y", start=100, end=101)])) == 1


def test_a_clean_run_counts_nothing_wrong() -> None:
    events = {"j1": ["accepted", "placed", "running", "succeeded"], "j2": ["accepted", "failed"]}
    c = check(
        {"j1", "j2"}, {"j1": "succeeded", "j2": "failed"}, events, [run("j1"), run("j2", start=1)]
    )
    assert (c.submitted, c.accepted, c.ended) == (2, 2, 2)
    assert (c.lost, c.duplicated, c.double_booked, c.wrong_outcome) == (0, 0, 0, 0), c.problems


def test_each_fault_is_counted() -> None:
    events = {
        "twice": ["accepted", "succeeded", "succeeded"],
        "ran2": ["accepted", "succeeded"],
        "lost": ["accepted", "lost"],
        "gone": ["accepted", "lost"],
        "wrong": ["accepted", "failed"],
        "open": ["accepted", "running"],
        "never": [],
    }
    expected = dict.fromkeys(events, "succeeded")
    runs = [
        run("ran2", devices=("5",)), run("ran2", devices=("6",)), run("gone", node="b"),
        run("twice", devices=("7",)),
    ]  # fmt: skip
    c = check(set(events), expected, events, runs, gone_nodes=frozenset({"b"}))
    assert c.submitted == 7
    assert c.accepted == 6
    assert c.ended == 5
    assert c.duplicated == 2  # two terminal events; two runs
    assert c.lost == 1
    assert c.lost_gone_node == 1
    assert c.wrong_outcome == 1
    assert any("open: never ended" in p for p in c.problems)


def test_a_job_without_its_accepted_event_is_named_with_what_did_arrive() -> None:
    events = {"j1": ["accepted", "succeeded"], "j2": ["placed", "running", "succeeded"]}
    c = check({"j1", "j2"}, {"j1": "succeeded", "j2": "succeeded"}, events, [])
    assert (c.submitted, c.accepted, c.ended) == (2, 1, 1)
    assert c.problems == ["j2: no accepted event (['placed', 'running', 'succeeded'])"]


def test_a_job_lost_on_a_cut_node_before_it_ran_counts_apart_by_its_lost_event() -> None:
    # Given up with its cut-off node while its grant waited there: it never ran (no marker),
    # and its lost event names the node.
    events = {"never": ["accepted", "placed", "lost"], "elsewhere": ["accepted", "lost"]}
    expected = dict.fromkeys(events, "succeeded")
    lost_on = {"never": "cut", "elsewhere": "a"}
    c = check(set(events), expected, events, [], frozenset({"cut"}), lost_on=lost_on)
    assert (c.lost_gone_node, c.lost) == (1, 1)
    assert c.problems == ["elsewhere: lost (['accepted', 'lost'])"]
    # Without the node of its lost event, a job with no run is lost like any other.
    c = check(set(events), expected, events, [], frozenset({"cut"}))
    assert (c.lost_gone_node, c.lost) == (0, 2)


def test_the_longest_stall_is_the_longest_time_without_a_grant_while_a_job_waited() -> None:
    assert longest_stall([], [1.0, 2.0]) == 0.0
    # Jobs placed at once: no stall but their own short waits.
    assert longest_stall([(0.0, 0.1), (1.0, 1.2)], [0.1, 1.2]) == pytest.approx(0.2)
    # A job waits from 10 to 25 while no grant comes (the database failing over); another
    # came at 12 and was granted at 25 too.
    waits = [(10.0, 25.0), (12.0, 25.0), (30.0, 30.1)]
    assert longest_stall(waits, [9.0, 25.0, 25.0, 30.1]) == pytest.approx(15.0)
    # A wait that ended without a grant (cancelled at 14) stalls only until its end.
    assert longest_stall([(10.0, 14.0)], [9.0, 20.0]) == pytest.approx(4.0)
