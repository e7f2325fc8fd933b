"""Replica sync alone: another replica's NOTIFY reloads the named nodes' holds and wakes the
scheduler; this replica's own NOTIFY is skipped; a reload never undoes an end applied while it
read."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from nats.aio.msg import Msg
from tests.unit.placement.placement_fakes import FakeConn, FakePool, gpu_node

from gpulayer_contracts import JobStatus, encode
from gpulayer_placement.fleet import Fleet
from gpulayer_placement.replica_sync import NOTIFY_CHANNEL, ReplicaSync
from gpulayer_placement.settings import Settings
from gpulayer_placement.status import ExecutorStatus
from gpulayer_placement.wake import Wake


def build(conn: FakeConn) -> tuple[ReplicaSync, Fleet, Wake]:
    fleet, wake = Fleet(), Wake()
    fleet.upsert(gpu_node("a", 2, cores=4))
    fleet.upsert(gpu_node("b", 2, cores=4))
    return ReplicaSync(cast(Any, FakePool(conn)), fleet, wake, asyncio.Event(), "me"), fleet, wake


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_another_replicas_change_reloads_the_named_nodes_and_wakes() -> None:
    holds: list[dict[str, Any]] = [
        {"kind": "device", "job_id": None, "node_id": "a", "resource": "exclusive", "amount": 1},
        {"kind": "reservation", "job_id": "j", "node_id": "a", "resource": "cpu", "amount": 1500},
        {"kind": "reservation", "job_id": "j", "node_id": "a", "resource": "slots", "amount": 1},
        {"kind": "capacity", "job_id": None, "node_id": "a", "resource": "slots", "amount": 4},
    ]
    conn = FakeConn({"load_holds": holds})
    sync, fleet, wake = build(conn)
    fleet.hold("b", [0], "exclusive")
    fleet.reserve("k", "b", [("cpu", 1000)])
    sync.on_notify(None, 1, NOTIFY_CHANNEL, "other|a")
    await settle()
    assert conn.calls == [("load_holds", (["a"],))]
    a, b = fleet.get("a"), fleet.get("b")
    assert a is not None
    assert b is not None
    assert a.exclusive == frozenset({1})
    # 4 cores reported; the recorded capacity gives the slots (no executor beat yet).
    assert (a.cpu_free, a.slots_total, a.slots_free) == (2500, 4, 3)
    assert b.exclusive == frozenset({0})  # not named: left as it was
    assert b.cpu_free == 3000
    assert wake.capacity_changed
    # The job that ended gives back what the database said it held.
    assert fleet.unreserve("j") == "a"
    a = fleet.get("a")
    assert a is not None
    assert (a.cpu_free, a.slots_free) == (4000, 4)


async def test_this_replicas_own_change_is_skipped() -> None:
    conn = FakeConn()
    sync, _, wake = build(conn)
    sync.on_notify(None, 1, NOTIFY_CHANNEL, "me|a,b")
    await settle()
    assert conn.calls == []
    assert not wake.capacity_changed


async def test_notify_tags_the_change_with_this_replica() -> None:
    conn = FakeConn()
    sync, _, _ = build(conn)
    await sync.notify(conn, ["a", "b"])
    assert conn.calls == [("SELECT gpulayer_notify_nodes($1, $2::text[])", ("me", ["a", "b"]))]


class SlowRead(FakeConn):
    """``load_holds`` answers what the database held when it was called, once ``go`` is set
    (a slow read); ``reading`` says it was called."""

    def __init__(self, rows: dict[str, list[dict[str, Any]]]) -> None:
        super().__init__(rows)
        self.go = asyncio.Event()
        self.reading = asyncio.Event()

    async def fetch(self, sql: str, *args: Any) -> list[dict[str, Any]]:
        out = await super().fetch(sql, *args)
        if self.calls[-1][0] == "load_holds":
            self.reading.set()
            await self.go.wait()
        return out


async def test_an_end_applied_during_a_reload_is_not_undone_by_it() -> None:
    """A reload reads the node's holds while job j1 still holds device 0; j1's end is
    committed and released here before the reload replaces the holds with what it read. The
    device must end up free: the end is applied after the reload (Fleet.reload_lock), not
    undone by it until some later reload."""
    held = [
        {"kind": "device", "job_id": None, "node_id": "a", "resource": "exclusive", "amount": 0}
    ]
    read = SlowRead({"load_holds": held})
    sync, fleet, _ = build(read)
    fleet.hold("a", [0], "exclusive")
    ended = [{"job_id": "j1", "state": "succeeded", "node_id": "a", "device_index": 0,
              "mode": "exclusive"}]  # fmt: skip
    status = ExecutorStatus(
        js=cast(Any, None),
        pool=cast(Any, FakePool(FakeConn({"apply_status": ended}))),
        fleet=fleet,
        wake=Wake(),
        forget=lambda _job: None,
        settings=Settings(),
        stop=asyncio.Event(),
        replica_id="me",
    )
    reload = asyncio.create_task(sync.reload(["a"]))
    await read.reading.wait()  # the reload has read: device 0 held
    report = JobStatus(job_id="j1", grant_id="j1-1", node_id="a", state="succeeded", exit_code=0)
    msg = Msg(cast(Any, None), subject="gpulayer.node.a.status", data=encode(report))
    msg.ack = _acked  # type: ignore[method-assign]
    end = asyncio.create_task(status.apply([msg]))
    await settle()
    read.go.set()
    await asyncio.gather(reload, end)
    view = fleet.get("a")
    assert view is not None
    assert view.exclusive == frozenset()


async def _acked() -> None:
    return None
