"""Liveness alone, over a real Fleet: which nodes the reaper takes offline, what it writes and
tells, and what heartbeats do."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from typing import Any, cast

from nats.aio.msg import Msg
from tests.unit.placement.placement_fakes import FakeConn, FakeJetStream, FakePool, gpu_node

from gpulayer_contracts import Heartbeat, encode
from gpulayer_contracts.codec import cancel_decoder
from gpulayer_contracts.subjects import MSG_ID_HEADER, node_control
from gpulayer_placement.fleet import Fleet
from gpulayer_placement.lifecycle import Lifecycle
from gpulayer_placement.liveness import Liveness
from gpulayer_placement.publisher import Publisher
from gpulayer_placement.replica_sync import ReplicaSync
from gpulayer_placement.settings import Settings
from gpulayer_placement.wake import Wake


def build(conn: FakeConn) -> tuple[Liveness, Fleet, Wake, FakeJetStream]:
    fleet, wake, stop = Fleet(), Wake(), asyncio.Event()
    pool = cast(Any, FakePool(conn))
    js = FakeJetStream(ack_after=1)
    settings = Settings(node_timeout_s=10)
    liveness = Liveness(
        nc=cast(Any, None),
        js=cast(Any, js),
        pool=pool,
        fleet=fleet,
        wake=wake,
        sync=ReplicaSync(pool, fleet, wake, stop, "replica-1"),
        publisher=Publisher(cast(Any, js), pool, settings),
        settings=settings,
        stop=stop,
    )
    return liveness, fleet, wake, js


def beat(node: str, source: str | None = None) -> Msg:
    hb = Heartbeat(node_id=node, sent_at=datetime.now(UTC), source=source or "probe")
    return Msg(cast(Any, None), subject=f"gpulayer.node.{node}.heartbeat", data=encode(hb))


async def test_reaper_takes_only_silent_nodes_offline_and_loses_their_jobs() -> None:
    lost = [{"job_id": "victim", "node_id": "silent", "grant_id": "victim-1", "owner": "alice"}]
    # What the job held moved to a fence (lose_node_jobs): the database still holds device 0.
    fence = {"kind": "device", "job_id": None, "node_id": "silent", "resource": "exclusive"}
    conn = FakeConn({"lose_node_jobs": lost, "load_holds": [{**fence, "amount": 0}]})
    liveness, fleet, wake, js = build(conn)
    fleet.upsert(gpu_node("silent", 1))
    fleet.upsert(gpu_node("beating", 1))
    fleet.hold("silent", [0], "exclusive")
    fleet.last_seen["silent"] = time.monotonic() - 60
    await liveness.reap()
    assert conn.names()[:3] == [
        "set_offline",
        "lose_node_jobs",
        "SELECT gpulayer_notify_nodes($1, $2::text[])",
    ]
    assert conn.calls[0][1] == (["silent"],)
    assert conn.calls[2][1] == ("replica-1", ["silent"])
    # Its holds come from the database again, for that node only: the fenced device stays held.
    assert conn.calls[3] == ("load_holds", (["silent"],))
    silent, beating = fleet.get("silent"), fleet.get("beating")
    assert silent is not None
    assert beating is not None
    assert not silent.online
    assert silent.exclusive == frozenset({0})
    assert beating.online
    (event, cancel) = js.sent
    # The job's outcome, named as the executor names a grant's end: one of the two is kept.
    assert event[0] == "gpulayer.job.alice.victim.events"
    assert b'"lost"' in event[1]
    assert event[2][MSG_ID_HEADER] == "victim-1:end"
    # The node is asked to stop it (when it is back), placement having given it up.
    assert cancel[0] == node_control("silent")
    stop = cancel_decoder.decode(cancel[1])
    assert (stop.job_id, stop.grant_id, stop.given_up) == ("victim", "victim-1", True)
    # Named apart from a user's cancel of the same grant, which CONTROL would otherwise take
    # for a repeat and drop (the fault run left a fence so).
    assert cancel[2][MSG_ID_HEADER] == "cancel:victim-1:given-up"
    assert wake.capacity_changed


async def test_reaper_touches_nothing_when_every_node_beats() -> None:
    conn = FakeConn()
    liveness, fleet, wake, _ = build(conn)
    fleet.upsert(gpu_node("a", 1))
    await liveness.reap()
    assert conn.calls == []
    assert not wake.capacity_changed


async def test_a_silent_executor_stops_grants_but_loses_nothing() -> None:
    conn = FakeConn()
    liveness, fleet, wake, _ = build(conn)
    fleet.upsert(gpu_node("a", 1))
    await liveness.on_heartbeat(beat("a", "executor"))
    fleet.executor_seen["a"] = time.monotonic() - 60
    await liveness.reap()
    view = fleet.get("a")
    assert view is not None
    assert view.executor_down
    assert view.online
    assert conn.calls == []
    wake.take()
    await liveness.on_heartbeat(beat("a", "executor"))
    view = fleet.get("a")
    assert view is not None
    assert not view.executor_down
    assert wake.capacity_changed  # its executor is back: waiting jobs may fit there now


async def test_a_probe_heartbeat_brings_an_offline_node_back() -> None:
    liveness, fleet, wake, _ = build(FakeConn())
    fleet.upsert(gpu_node("a", 1), online=False)
    await liveness.on_heartbeat(beat("a"))
    view = fleet.get("a")
    assert view is not None
    assert view.online
    assert wake.capacity_changed


async def test_a_job_lost_with_its_vanished_device_releases_its_dependents() -> None:
    """A job lost because its device vanished is an end like any other: the jobs waiting for it
    (``after``) are cancelled naming it, their events put in the outbox, in the same
    transaction."""
    lost = [
        {
            "job_id": "trainer",
            "node_id": "g",
            "owner": "alice",
            "grant_id": "trainer-1",
            "state": "lost",
            "reason": "cuda device 0 (GPU) vanished from node g",
            "lifecycle": None,
            "has_dependents": True,
        }
    ]
    dependent = {"job_id": "eval", "owner": "alice", "reason": "dependency trainer ended lost"}
    conn = FakeConn({"lose_device_jobs": lost, "load_holds": [], "cancel_dependents": [dependent]})
    original = conn.fetch

    async def once(sql: str, *args: Any) -> list[dict[str, Any]]:
        rows = await original(sql, *args)
        if conn.calls[-1][0] == "cancel_dependents":
            conn.rows.pop("cancel_dependents", None)  # one level of dependents
        return rows

    conn.fetch = once  # type: ignore[method-assign]
    liveness, fleet, wake, js = build(conn)
    # As the service wires it: lifecycle announces through the publisher.
    liveness.lifecycle = Lifecycle(publisher=liveness.publisher, wake=wake)
    fleet.upsert(gpu_node("g", 1))
    await liveness.lose_device_jobs("g", {0: "cuda device 0 (GPU) vanished from node g"})
    names = conn.names()
    assert names[0] == "lose_device_jobs"
    assert ("cancel_dependents", (["trainer"], ["lost"])) in conn.calls
    (recorded,) = [args for name, args in conn.calls if name == "record_outbox"]
    assert recorded[:2] == (["eval:cancelled"], ["gpulayer.job.alice.eval.events"])
    sent = [subject for subject, _, _ in js.sent]
    assert "gpulayer.job.alice.trainer.events" in sent
