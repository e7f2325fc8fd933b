"""Executor status alone: reports folded per grant, identity from the subject, devices released
and finished jobs forgotten."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import nats.errors
import pytest
from nats.aio.msg import Msg
from tests.unit.placement.placement_fakes import FakeConn, FakePool, gpu_node

from gpulayer_contracts import JobStatus, encode
from gpulayer_placement.fleet import Fleet
from gpulayer_placement.settings import Settings
from gpulayer_placement.status import ExecutorStatus, Hold
from gpulayer_placement.wake import Wake


class AckedMsg(Msg):
    acked = False

    async def ack(self) -> None:
        self.acked = True


def report(subject_node: str, state: str, node_id: str | None = None) -> AckedMsg:
    status = JobStatus(
        job_id="j1",
        grant_id="j1-1",
        node_id=node_id or subject_node,
        state=state,  # type: ignore[arg-type]
        exit_code=0 if state == "succeeded" else None,
    )
    return AckedMsg(
        cast(Any, None), subject=f"gpulayer.node.{subject_node}.status", data=encode(status)
    )


def build(conn: FakeConn) -> tuple[ExecutorStatus, Fleet, Wake, list[str]]:
    fleet, wake = Fleet(), Wake()
    forgotten: list[str] = []
    status = ExecutorStatus(
        js=cast(Any, None),
        pool=cast(Any, FakePool(conn)),
        fleet=fleet,
        wake=wake,
        forget=forgotten.append,
        settings=Settings(),
        stop=asyncio.Event(),
        replica_id="replica-1",
    )
    return status, fleet, wake, forgotten


def test_running_never_replaces_a_final_state_of_the_same_batch() -> None:
    status, _, _, _ = build(FakeConn())
    rows = status.read([report("n1", "succeeded"), report("n1", "running")])
    assert rows == [("j1", "j1-1", "n1", "succeeded", 0, None)]


def test_the_subject_names_the_node_and_malformed_reports_are_skipped() -> None:
    status, _, _, _ = build(FakeConn())
    bad = AckedMsg(cast(Any, None), subject="gpulayer.node.n1.status", data=b"{not json")
    rows = status.read([bad, report("n1", "running", node_id="forged")])
    assert [r[2] for r in rows] == ["n1"]


async def test_a_finished_job_releases_its_devices_is_forgotten_and_wakes_the_scheduler() -> None:
    changed = [
        {
            "job_id": "j1",
            "state": "succeeded",
            "node_id": "g",
            "device_index": 0,
            "mode": "exclusive",
        }
    ]
    conn = FakeConn({"apply_status": changed})
    status, fleet, wake, forgotten = build(conn)
    fleet.upsert(gpu_node("g", 1))
    fleet.hold("g", [0], "exclusive")
    msgs = [report("g", "succeeded")]
    await status.apply(list(msgs))
    ((name, args),) = conn.calls
    assert name == "apply_status"
    assert args == (["j1"], ["j1-1"], ["g"], ["succeeded"], [0], [None], "replica-1")
    view = fleet.get("g")
    assert view is not None
    assert view.exclusive == frozenset()
    assert forgotten == ["j1"]
    assert wake.capacity_changed
    assert msgs[0].acked


async def test_a_running_report_changes_no_capacity() -> None:
    conn = FakeConn({"apply_running": [{"job_id": "j1", "grant_id": "j1-1"}]})
    status, _, wake, forgotten = build(conn)
    msgs = [report("g", "running")]
    await status.apply(list(msgs))
    # One statement outside a transaction: what apply_running applied goes nowhere else.
    assert conn.calls == [("apply_running", (["j1"], ["j1-1"], ["g"], [None], [None]))]
    assert forgotten == []
    assert not wake.capacity_changed
    assert msgs[0].acked


async def test_running_reports_apply_running_left_go_through_apply_status() -> None:
    # A rank of a distributed job (or a stale report): not applied by apply_running, so the
    # transaction that decides its gang sees it.
    changed = [
        {"job_id": "j1", "state": "running", "node_id": "g", "device_index": None, "mode": None}
    ]
    conn = FakeConn({"apply_running": [], "apply_status": changed})
    status, _, wake, forgotten = build(conn)
    await status.apply([report("g", "running")])
    assert conn.names() == ["apply_running", "apply_status"]
    assert conn.calls[1][1] == (["j1"], ["j1-1"], ["g"], ["running"], [None], [None], "replica-1")
    assert forgotten == []
    assert not wake.capacity_changed


async def test_a_batch_with_an_end_in_it_is_applied_whole_in_one_transaction() -> None:
    conn = FakeConn({"apply_status": []})
    status, _, _, _ = build(conn)
    other = AckedMsg(
        cast(Any, None),
        subject="gpulayer.node.g.status",
        data=encode(JobStatus(job_id="j2", grant_id="j2-1", node_id="g", state="running")),
    )
    await status.apply([other, report("g", "succeeded")])
    # (The end no job took is then looked for among the fences: release_fences.)
    assert conn.names()[0] == "apply_status"
    assert "apply_running" not in conn.names()
    assert conn.calls[0][1][3] == ["running", "succeeded"]


class _FailsOnce:
    """A consume loop's source whose first fetch fails (a connection reconnecting), then finds
    nothing."""

    def __init__(self) -> None:
        self.calls = 0

    async def fetch(self, batch: int, timeout: float) -> list[Msg]:
        self.calls += 1
        if self.calls == 1:
            raise nats.errors.ConnectionReconnectingError
        raise TimeoutError


async def test_what_a_hold_kept_stays_kept_when_a_fetch_fails() -> None:
    """Nothing kept is lost with a failed fetch: the next fetch hands it out (the consume loop
    logs the failure and fetches again)."""
    hold = Hold(_FailsOnce(), hold_s=5.0)
    kept = [report("n1", "running")]
    hold.keep(cast(list[Msg], kept))
    with pytest.raises(nats.errors.ConnectionReconnectingError):
        await hold.fetch(8, timeout=1.0)
    assert await hold.fetch(8, timeout=0.1) == kept
    assert hold.may_keep()  # its hold (5 s) is not up: kept again if nothing else came
