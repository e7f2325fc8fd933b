"""The reservation kept for a waiting gang spans its N nodes (issue 14): a job holding devices
goes on any of them only when its timeout ends before the gang can start."""

from __future__ import annotations

import time

from gpulayer_contracts.jobs import JobRequest, Requirements
from gpulayer_placement.policy import Policy, Reservation


def small(timeout_s: float | None) -> JobRequest:
    return JobRequest(
        job_id="s", command=["x"], requirements=Requirements(gpu_count=1), timeout_s=timeout_s
    )


def test_every_node_kept_for_a_gang_refuses_what_would_outlast_it() -> None:
    p = Policy()
    until = time.time() + 100
    p.reservation = Reservation("g", "a", until, nodes=frozenset({"a", "b"}))
    assert p.reservation.kept() == {"a", "b"}
    for node in ("a", "b"):
        assert not p.may_backfill("s", small(None), node, 1)
        assert not p.may_backfill("s", small(1000), node, 1)
        assert p.may_backfill("s", small(10), node, 1)  # ends before the gang can start
        assert p.may_backfill("s", small(None), node, 0)  # holds no device
        assert p.may_backfill("g", small(None), node, 1)  # the gang itself
    assert p.may_backfill("s", small(None), "c", 1)  # not kept


def test_a_single_nodes_reservation_is_unchanged() -> None:
    p = Policy()
    p.reservation = Reservation("big", "a", time.time() + 100)
    assert p.reservation.kept() == {"a"}
    assert not p.may_backfill("s", small(None), "a", 1)
    assert p.may_backfill("s", small(None), "b", 1)
