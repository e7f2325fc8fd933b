"""The gang row's state from its ranks' (issue 14): gang_status.decide, pure."""

from __future__ import annotations

from typing import Any

import pytest

from gpulayer_contracts import Cancelled, Failed, Lost, Running, Succeeded
from gpulayer_placement.gang_status import decide


def gang(state: str = "placed", stop: bool = False) -> dict[str, Any]:
    return {"job_id": "g", "state": state, "owner": "alice", "stop_requested": stop}


def rank(r: int, state: str, exit_code: int | None = None, reason: str | None = None) -> Any:
    return {
        "job_id": f"g-rank{r}",
        "rank": r,
        "state": state,
        "node_id": f"n{r}",
        "grant_id": f"g-rank{r}-1",
        "exit_code": exit_code,
        "reason": reason,
    }


def test_running_once_every_rank_runs() -> None:
    assert decide(gang(), [rank(0, "running"), rank(1, "placed")]) is None
    v = decide(gang(), [rank(0, "running"), rank(1, "succeeded", 0)])
    assert v is not None
    assert v.state == "running"
    assert isinstance(v.event, Running)
    assert v.event.node_id == "n0"
    assert decide(gang("running"), [rank(0, "running"), rank(1, "running")]) is None


def test_succeeded_when_every_rank_succeeded() -> None:
    v = decide(gang("running"), [rank(0, "succeeded", 0), rank(1, "succeeded", 0)])
    assert v is not None
    assert v.state == "succeeded"
    assert v.exit_code == 0
    assert isinstance(v.event, Succeeded)
    assert v.cancel == []


def test_a_failed_rank_fails_the_gang_naming_it_and_cancels_the_rest() -> None:
    v = decide(gang("running"), [rank(0, "running"), rank(1, "failed", 3), rank(2, "placed")])
    assert v is not None
    assert v.state == "failed"
    assert v.exit_code == 3
    assert v.reason == "rank 1 on n1 exited with code 3"
    assert isinstance(v.event, Failed)
    assert (v.event.rank, v.event.node_id) == (1, "n1")
    assert [r["job_id"] for r in v.cancel] == ["g-rank0", "g-rank2"]


def test_a_lost_rank_loses_the_gang() -> None:
    v = decide(gang("running"), [rank(0, "running"), rank(1, "lost", reason="node silent")])
    assert v is not None
    assert v.state == "lost"
    assert v.reason == "rank 1 on n1 was lost: node silent"
    assert isinstance(v.event, Lost)
    assert v.event.rank == 1


@pytest.mark.parametrize(
    ("ranks", "want"),
    [
        # A failure is the cause over a cancel it led to, whatever the ranks' order.
        ([rank(0, "cancelled"), rank(1, "failed", 1)], "rank 1 on n1 exited with code 1"),
        (
            [rank(0, "failed", None, "timed out"), rank(1, "running")],
            "rank 0 on n0 failed: timed out",
        ),
        (
            [rank(0, "running"), rank(1, "cancelled", reason="by bob")],
            "rank 1 on n1 was cancelled: by bob",
        ),
        # The executor's reason starts with the exit code, said once; what follows is kept:
        # the worker that failed under torchrun, or any other reason.
        (
            [rank(0, "running"), rank(1, "failed", 1, "exit code 1")],
            "rank 1 on n1 exited with code 1",
        ),
        (
            [
                rank(0, "running"),
                rank(
                    1,
                    "failed",
                    1,
                    "exit code 1; torchrun: its worker of global rank 3 (local 1) exited with code 3",
                ),
            ],
            "rank 1 on n1 exited with code 1 (torchrun: its worker of global rank 3 (local 1) exited with code 3)",
        ),
        (
            [rank(0, "running"), rank(1, "failed", 1, "exit code 10")],
            "rank 1 on n1 exited with code 1 (exit code 10)",
        ),
        (
            [rank(0, "running"), rank(1, "failed", 137, "out of memory: 2 GB limit")],
            "rank 1 on n1 exited with code 137 (out of memory: 2 GB limit)",
        ),
    ],
)
def test_the_cause_named(ranks: list[Any], want: str) -> None:
    v = decide(gang("running"), ranks)
    assert v is not None
    assert v.state == "failed"
    assert v.reason == want


def test_an_ended_gang_changes_no_more() -> None:
    for state in ("failed", "succeeded", "cancelled", "lost", "pending"):
        assert decide(gang(state), [rank(0, "failed", 2), rank(1, "succeeded", 0)]) is None


def test_a_cancelled_gang_ends_cancelled_once_every_rank_ended() -> None:
    stop = gang("running", stop=True)
    assert decide(stop, [rank(0, "cancelled"), rank(1, "running")]) is None
    v = decide(stop, [rank(0, "cancelled"), rank(1, "cancelled")])
    assert v is not None
    assert v.state == "cancelled"
    assert isinstance(v.event, Cancelled)
