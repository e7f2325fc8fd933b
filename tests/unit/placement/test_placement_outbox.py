"""The outbox alone: events recorded under their own message id, published a batch per
transaction and deleted only once stored, and a drain woken by a commit's NOTIFY."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from tests.unit.placement.placement_fakes import FakeConn, FakeJetStream, FakePool

from gpulayer_contracts import Cancelled
from gpulayer_contracts.subjects import MSG_ID_HEADER
from gpulayer_placement import outbox
from gpulayer_placement.outbox import Outbox
from gpulayer_placement.publisher import Publisher
from gpulayer_placement.settings import Settings


class _OnceConn(FakeConn):
    """Answers ``take_outbox`` once, then with nothing (the rows it gave were deleted); says
    when it was asked (``looked``) and when rows were deleted (``deleted``)."""

    def __init__(self) -> None:
        super().__init__()
        self.looked = asyncio.Event()
        self.deleted = asyncio.Event()

    async def fetch(self, sql: str, *args: Any) -> list[dict[str, Any]]:
        rows = await super().fetch(sql, *args)
        if self.calls[-1][0] == "take_outbox":
            self.rows.pop("take_outbox", None)
            self.looked.set()
        return rows

    async def execute(self, sql: str, *args: Any) -> str:
        status = await super().execute(sql, *args)
        if self.calls[-1][0] == "delete_outbox":
            self.deleted.set()
        return status


def build(conn: FakeConn, js: FakeJetStream) -> Outbox:
    pool = cast(Any, FakePool(conn))
    publisher = Publisher(cast(Any, js), pool, Settings(publish_timeout_s=0.2))
    return Outbox(pool, publisher, asyncio.Event(), period_s=60)


def row(job_id: str) -> dict[str, Any]:
    subject, data, headers = Publisher.event_item(Cancelled(job_id=job_id, owner="alice"))
    return {"msg_id": headers[MSG_ID_HEADER], "subject": subject, "payload": data}


async def test_events_are_recorded_under_the_id_their_publish_will_carry() -> None:
    conn = FakeConn()
    await outbox.record(conn, [Cancelled(job_id="b", owner="alice", reason="dependency a")])
    await outbox.record(conn, [])  # nothing to record: no statement
    ((name, (ids, subjects, payloads)),) = conn.calls
    assert name == "record_outbox"
    assert (ids, subjects) == (["b:cancelled"], ["gpulayer.job.alice.b.events"])
    assert b'"dependency a"' in payloads[0]


async def test_a_drain_publishes_what_it_took_then_deletes_it() -> None:
    conn = FakeConn({"take_outbox": [row("b"), row("c")]})
    js = FakeJetStream(ack_after=1)
    box = build(conn, js)
    assert await box.drain() == 2
    assert [(s, h[MSG_ID_HEADER]) for s, _, h in js.sent] == [
        ("gpulayer.job.alice.b.events", "b:cancelled"),
        ("gpulayer.job.alice.c.events", "c:cancelled"),
    ]
    assert conn.calls[-1] == ("delete_outbox", (["b:cancelled", "c:cancelled"],))


async def test_events_nats_did_not_store_stay_in_the_outbox() -> None:
    conn = FakeConn({"take_outbox": [row("b")]})
    js = FakeJetStream(ack_after=99)  # no ack comes: the publish times out
    assert await build(conn, js).drain() == 0
    assert "delete_outbox" not in conn.names()


async def test_a_commits_notify_wakes_the_drain() -> None:
    conn = _OnceConn()
    box = build(conn, FakeJetStream(ack_after=1))
    task = asyncio.create_task(box.run())
    try:
        await asyncio.wait_for(conn.looked.wait(), 5)  # the look at start: nothing
        conn.rows["take_outbox"] = [row("b")]
        box.on_notify(None, 0, outbox.CHANNEL, "")
        await asyncio.wait_for(conn.deleted.wait(), 5)  # well before its 60 s period
    finally:
        task.cancel()
    assert ("delete_outbox", (["b:cancelled"],)) in conn.calls
    assert box.published == 1
