"""Placement's status consumer holds a batch of ``running`` reports alone back for a moment
(``status.Hold``): a short job's end, right behind, then replaces it in one ``apply_status``.
Against a real nats-server (what is held comes back with the next batch, no later than the
hold, and is given back at once when the loop ends) and a real PostgreSQL (which statements
apply the reports)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from typing import Any, cast

import asyncpg
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig

from gpulayer_contracts import JobStatus, encode
from gpulayer_placement.fleet import Fleet
from gpulayer_placement.settings import Settings
from gpulayer_placement.status import ExecutorStatus, Hold
from gpulayer_placement.store import Store, create_pool, migrate
from gpulayer_placement.wake import Wake
from gpulayer_runtime.pull import Puller

pytestmark = pytest.mark.integration

_names = itertools.count()


async def _consumer(nc: Client) -> tuple[str, str]:
    """A new stream and durable pull consumer ``c`` (30 s ack wait) on node n1's status
    subject (each test has a server of its own); (stream, subject)."""
    stream, subject = f"HOLD{next(_names)}", "gpulayer.node.n1.status"
    js = nc.jetstream()
    await js.add_stream(name=stream, subjects=[subject])
    await js.add_consumer(
        stream, ConsumerConfig(durable_name="c", ack_policy=AckPolicy.EXPLICIT, ack_wait=30)
    )
    return stream, subject


async def test_a_kept_batch_comes_back_first_with_what_arrived_and_no_later_than_its_hold(
    nc: Client,
) -> None:
    stream, prefix = await _consumer(nc)
    js = nc.jetstream()
    puller = Puller(await js.pull_subscribe_bind("c", stream=stream))
    # Long enough that the second publish lands within it on a loaded machine; the last step
    # waits it out once.
    hold = Hold(puller, hold_s=2.0)
    try:
        await js.publish(prefix, b"first")
        first = await hold.fetch(16, timeout=5)
        assert [m.data for m in first] == [b"first"]
        assert hold.may_keep()
        hold.keep(first)
        await js.publish(prefix, b"second")
        again = await hold.fetch(16, timeout=5)
        assert [m.data for m in again][:1] == [b"first"]
        assert b"second" in [m.data for m in again]
        for m in again:
            await m.ack()
        # Nothing arrives: the kept batch comes back when its hold is up, not at the fetch's
        # own timeout (30 s, longer than this test waits).
        await js.publish(prefix, b"third")
        third = await hold.fetch(16, timeout=5)
        hold.keep(third)
        back = await asyncio.wait_for(hold.fetch(16, timeout=30), 10)
        assert [m.data for m in back] == [b"third"]
        assert not hold.may_keep()  # its hold is up: what came back is applied
        await back[0].ack()
        # A fetch with nothing kept is the source's own.
        with pytest.raises(TimeoutError):
            await hold.fetch(16, timeout=0.2)
        assert hold.may_keep()
    finally:
        await hold.close()
        await puller.close()


async def test_what_is_kept_when_the_loop_ends_is_redelivered_at_once(nc: Client) -> None:
    stream, prefix = await _consumer(nc)
    js = nc.jetstream()
    puller = Puller(await js.pull_subscribe_bind("c", stream=stream))
    async with Hold.over(puller, hold_s=1.0) as hold:
        await js.publish(prefix, b"kept")
        hold.keep(await hold.fetch(16, timeout=5))
    await puller.close()
    # Given back with a nak: delivered again well before the consumer's 30 s ack wait.
    other = Puller(await js.pull_subscribe_bind("c", stream=stream))
    try:
        again = await other.fetch(16, timeout=10)
        assert [m.data for m in again] == [b"kept"]
        assert again[0].metadata.num_delivered == 2
        await again[0].ack()
    finally:
        await other.close()


class Scripted:
    """A consume loop's source that hands out the given batches one fetch each (real
    messages, fetched from a real stream), then nothing: a fetch waits its timeout (or until
    the loop is stopped) and times out, as a quiet consumer's does (the Puller's, above)."""

    def __init__(self, batches: list[list[Msg]], stop: asyncio.Event) -> None:
        self.batches = batches
        self.stop = stop

    async def fetch(self, batch: int, timeout: float) -> list[Msg]:
        if self.batches:
            return self.batches.pop(0)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stop.wait(), timeout)
        raise TimeoutError


@pytest.fixture
async def pool(database_url: str) -> AsyncIterator[asyncpg.Pool]:
    conn = await asyncpg.connect(database_url)
    try:
        await migrate(conn)
        await conn.execute(
            "INSERT INTO jobs (job_id, request, state, grant_id, node_id)"
            " VALUES ('j1', '{}', 'placed', 'g1', 'n1')"
        )
    finally:
        await conn.close()
    p = await create_pool(database_url)
    yield p
    await p.close()


async def _reports(nc: Client, *states: str) -> list[Msg]:
    """``states`` of job j1 (grant g1) reported by node n1, as delivered by JetStream."""
    stream, prefix = await _consumer(nc)
    js = nc.jetstream()
    for state in states:
        status = JobStatus(
            job_id="j1",
            grant_id="g1",
            node_id="n1",
            state=state,  # type: ignore[arg-type]
            exit_code=0 if state == "succeeded" else None,
        )
        await js.publish(prefix, encode(status))
    sub = await js.pull_subscribe_bind("c", stream=stream)
    return [m for _ in states for m in await sub.fetch(1, timeout=5)]


async def _run(
    pool: asyncpg.Pool,
    batches: list[list[Msg]],
    hold_s: float,
    until: str,
    monkeypatch: pytest.MonkeyPatch,
) -> list[str]:
    """ExecutorStatus over ``batches`` until job j1 is in state ``until``; the statements it
    ran, by name."""
    ran: list[str] = []
    real = Store.fetch

    async def spy(conn: Any, name: str, *args: Any) -> Any:
        ran.append(name)
        return await real(conn, name, *args)

    monkeypatch.setattr(Store, "fetch", staticmethod(spy))
    stop = asyncio.Event()
    status = ExecutorStatus(
        js=cast(Any, None),  # no dead letters in these batches: the stream is never used
        pool=pool,
        fleet=Fleet(),
        wake=Wake(),
        forget=lambda _: None,
        settings=Settings(status_hold_s=hold_s),
        stop=stop,
        replica_id="r1",
    )
    applied = asyncio.Event()
    apply = status.apply

    async def applying(msgs: list[Msg], **kwargs: Any) -> None:
        await apply(msgs, **kwargs)
        applied.set()

    monkeypatch.setattr(status, "apply", applying)
    task = asyncio.create_task(status.run(Scripted(batches, stop)))
    try:
        async with asyncio.timeout(20):
            while True:
                applied.clear()
                if await _state(pool) == until:
                    break
                await applied.wait()
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
    return ran


async def _state(pool: asyncpg.Pool) -> str:
    return str(await pool.fetchval("SELECT state FROM jobs WHERE job_id = 'j1'"))


async def test_a_running_report_and_the_end_behind_it_are_applied_as_one(
    nc: Client, pool: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    running, end = await _reports(nc, "running", "succeeded")
    # The end is handed out at once: the hold only bounds it (a stalled loop can't outlast it).
    ran = await _run(pool, [[running], [end]], 10.0, "succeeded", monkeypatch)
    assert "apply_running" not in ran
    assert ran.count("apply_status") == 1
    assert await _state(pool) == "succeeded"
    assert running._ackd
    assert end._ackd


async def test_without_a_hold_each_batch_is_applied_as_it_comes(
    nc: Client, pool: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    running, end = await _reports(nc, "running", "succeeded")
    ran = await _run(pool, [[running], [end]], 0.0, "succeeded", monkeypatch)
    assert ran[:1] == ["apply_running"]
    assert await _state(pool) == "succeeded"


async def test_a_running_report_alone_is_applied_when_its_hold_is_up(
    nc: Client, pool: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Handed back with nothing behind it once its hold is up, it is applied."""
    (running,) = await _reports(nc, "running")
    ran = await _run(pool, [[running]], 0.5, "running", monkeypatch)
    assert ran == ["apply_running"]
    assert await _state(pool) == "running"
    assert running._ackd
