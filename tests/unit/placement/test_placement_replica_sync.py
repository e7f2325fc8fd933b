"""Replica sync alone: another replica's NOTIFY reloads the named nodes' holds and wakes the
scheduler; this replica's own NOTIFY is skipped."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from tests.unit.placement.placement_fakes import FakeConn, FakePool, gpu_node

from gpulayer_placement.fleet import Fleet
from gpulayer_placement.replica_sync import NOTIFY_CHANNEL, ReplicaSync
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
    assert conn.calls == [("SELECT pg_notify($1, $2)", (NOTIFY_CHANNEL, "me|a,b"))]
