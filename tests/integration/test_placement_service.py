"""Placement against real NATS and PostgreSQL: ingest, dedupe, rejection, grants, status."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import asyncpg
import msgspec
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from tests.helpers import linux_node, running_placement, subscribed

from gpulayer_cli.client import ApiFailed, api
from gpulayer_contracts import (
    AcceleratorDevice,
    Cancelled,
    Grant,
    Heartbeat,
    JobStatus,
    encode,
)
from gpulayer_contracts.codec import event_decoder, grant_decoder
from gpulayer_contracts.subjects import (
    API_CANCEL,
    API_EXPLAIN,
    API_NODES,
    JOBS_SUBMIT,
    MSG_ID_HEADER,
    node_capabilities,
    node_grants,
    node_heartbeat,
    node_status,
)
from gpulayer_placement import outbox
from gpulayer_placement.service import PlacementService, Settings
from gpulayer_placement.store import create_pool
from gpulayer_runtime.nats import ensure_streams

pytestmark = pytest.mark.integration


@pytest.fixture
async def placement(nc: Client, database_url: str) -> AsyncIterator[PlacementService]:
    async with running_placement(nc, database_url) as svc:
        yield svc


class Events:
    """Collects job events from the JOB_EVENTS stream subjects."""

    def __init__(self) -> None:
        self.by_job: dict[str, list[object]] = {}
        self.changed = asyncio.Event()

    async def cb(self, msg: object) -> None:
        ev = event_decoder.decode(msg.data)  # type: ignore[attr-defined]
        self.by_job.setdefault(ev.job_id, []).append(ev)
        self.changed.set()

    def types(self, job_id: str) -> list[str]:
        return [type(e).__struct_config__.tag for e in self.by_job.get(job_id, [])]  # type: ignore[attr-defined]

    async def wait_for(self, job_id: str, tag: str, timeout: float = 10.0) -> None:
        async def _wait() -> None:
            while tag not in self.types(job_id):
                self.changed.clear()
                await self.changed.wait()

        await asyncio.wait_for(_wait(), timeout)


@pytest.fixture
async def events(nc: Client) -> Events:
    ev = Events()
    await nc.subscribe("gpulayer.job.*.*.events", cb=ev.cb)
    return ev


async def test_cpu_job_is_placed_and_granted(
    nc: Client, placement: PlacementService, events: Events
) -> None:
    js = nc.jetstream()
    grants: asyncio.Queue[Grant] = asyncio.Queue()

    async def on_grant(msg: object) -> None:
        await grants.put(grant_decoder.decode(msg.data))  # type: ignore[attr-defined]

    await nc.subscribe(node_grants("node-a"), cb=on_grant)
    await js.publish(node_capabilities("node-a"), encode(linux_node("node-a")))
    job = {"job_id": "cpu-1", "command": ["echo", "hi"]}
    await js.publish(JOBS_SUBMIT, json.dumps(job).encode(), headers={MSG_ID_HEADER: "cpu-1"})
    await events.wait_for("cpu-1", "placed")
    grant = await asyncio.wait_for(grants.get(), 5)
    assert grant.node_id == "node-a"
    assert grant.job.command == ["echo", "hi"]
    assert grant.visible_env["CUDA_VISIBLE_DEVICES"] == ""
    # The job may briefly wait if it arrives before the node's capabilities are absorbed.
    types = events.types("cpu-1")
    assert types[0] == "accepted"
    assert types.count("placed") == 1


async def test_same_job_id_twice_is_one_job(
    nc: Client, placement: PlacementService, events: Events, database_url: str
) -> None:
    js = nc.jetstream()
    await js.publish(node_capabilities("node-a"), encode(linux_node("node-a")))
    body = json.dumps({"job_id": "dup-1", "command": ["true"]}).encode()
    # Different message ids, so JetStream's own dedupe doesn't hide the second copy.
    await js.publish(JOBS_SUBMIT, body, headers={MSG_ID_HEADER: "a"})
    await js.publish(JOBS_SUBMIT, body, headers={MSG_ID_HEADER: "b"})
    await js.publish(JOBS_SUBMIT, json.dumps({"job_id": "after", "command": ["true"]}).encode())
    await events.wait_for("after", "placed")
    await events.wait_for("dup-1", "placed")
    assert events.types("dup-1").count("accepted") == 1
    assert events.types("dup-1").count("placed") == 1
    conn = await asyncpg.connect(database_url)
    try:
        assert await conn.fetchval("SELECT count(*) FROM jobs WHERE job_id = 'dup-1'") == 1
    finally:
        await conn.close()


async def test_garbage_is_rejected_and_next_job_runs(
    nc: Client, placement: PlacementService, events: Events
) -> None:
    js = nc.jetstream()
    await js.publish(node_capabilities("node-a"), encode(linux_node("node-a")))
    await js.publish(JOBS_SUBMIT, b"\x00 not json at all")
    await js.publish(JOBS_SUBMIT, b'{"job_id": "bad-1", "command": "echo hi"}')
    await js.publish(
        JOBS_SUBMIT, b'{"job_id": "bad-2", "command": ["x"], "requirements": {"gpu_cont": 1}}'
    )
    await js.publish(
        JOBS_SUBMIT, b'{"job_id": "bad-3", "command": ["x"], "env": {"LD_PRELOAD": "a.so"}}'
    )
    await js.publish(JOBS_SUBMIT, b'{"job_id": "good-1", "command": ["true"]}')
    await events.wait_for("good-1", "placed")
    await events.wait_for("bad-3", "rejected")
    bad1 = events.by_job["bad-1"][0]
    assert "$.command: Expected `array`, got `str`" in bad1.reasons[0]  # type: ignore[attr-defined]
    assert events.by_job["bad-2"][0].reasons == ["$.requirements.gpu_cont: unknown field"]  # type: ignore[attr-defined]
    assert "$.env.LD_PRELOAD" in events.by_job["bad-3"][0].reasons[0]  # type: ignore[attr-defined]


async def test_status_finishes_job_and_releases(
    nc: Client, placement: PlacementService, events: Events, database_url: str
) -> None:
    js = nc.jetstream()
    await js.publish(node_capabilities("node-a"), encode(linux_node("node-a")))
    await js.publish(JOBS_SUBMIT, b'{"job_id": "st-1", "command": ["true"]}')
    await events.wait_for("st-1", "placed")
    conn = await asyncpg.connect(database_url)
    try:
        grant_id = await conn.fetchval("SELECT grant_id FROM jobs WHERE job_id = 'st-1'")
        for state in ("running", "succeeded", "succeeded"):
            await js.publish(
                node_status("node-a"),
                encode(
                    JobStatus(
                        job_id="st-1", grant_id=grant_id, node_id="node-a", state=state, exit_code=0
                    )
                ),
            )

        async def finished() -> None:
            # The outcome is a database row, not an event this test can subscribe to.
            while (  # noqa: ASYNC110
                await conn.fetchval("SELECT state FROM jobs WHERE job_id = 'st-1'") != "succeeded"
            ):
                await asyncio.sleep(0.05)

        await asyncio.wait_for(finished(), 10)
    finally:
        await conn.close()


async def test_unsatisfiable_job_is_placed_when_a_fitting_node_joins(
    nc: Client, placement: PlacementService, events: Events
) -> None:
    js = nc.jetstream()
    await js.publish(node_capabilities("cpu-only"), encode(linux_node("cpu-only")))
    async with asyncio.timeout(10):
        # Absorbed into placement's memory: no event announces that, so look.
        while placement.fleet.get("cpu-only") is None:  # noqa: ASYNC110
            await asyncio.sleep(0.02)
    job = {
        "job_id": "needs-gpu",
        "command": ["true"],
        "requirements": {"accelerator": "cuda", "gpu_count": 1},
    }
    await js.publish(JOBS_SUBMIT, json.dumps(job).encode())
    await events.wait_for("needs-gpu", "pending")
    pending = [e for e in events.by_job["needs-gpu"] if type(e).__name__ == "Pending"][-1]
    assert pending.unsatisfiable  # type: ignore[attr-defined]
    assert "no cuda device" in pending.summary  # type: ignore[attr-defined]
    gpu = msgspec.structs.replace(
        linux_node("gpu-joins"),
        accelerators=[
            AcceleratorDevice(
                accelerator="cuda", index=0, memory_mib=81559, compute_capability="9.0",
                execution_supported=True,
            )
        ],
    )  # fmt: skip
    await js.publish(node_capabilities("gpu-joins"), encode(gpu))
    await events.wait_for("needs-gpu", "placed")
    placed = events.by_job["needs-gpu"][-1]
    assert placed.node_id == "gpu-joins"  # type: ignore[attr-defined]
    assert placed.devices == [0]  # type: ignore[attr-defined]


@pytest.mark.parametrize("submitted_ago_s", [0, 600])
async def test_grant_lost_between_commit_and_publish_is_resent(
    nc: Client, database_url: str, submitted_ago_s: int
) -> None:
    """Placement committed a placement and died before publishing: the grant and the job's
    `placed` event still go out, once the job has stayed `placed` for the resend delay. Its
    `accepted` goes out again only when the job is young enough for JetStream to drop the copy
    (placed where it was ingested); a job that waited long was announced long ago."""
    await ensure_streams(nc.jetstream())
    pool = await create_pool(database_url)
    svc = PlacementService(nc, pool, Settings(node_timeout_s=30, resend_after_s=0.3))
    await svc.start()  # migrates; then the "crashed" commit is written by hand
    grants: asyncio.Queue[Grant] = asyncio.Queue()
    placed = asyncio.Event()

    async def on_grant(msg: object) -> None:
        await grants.put(grant_decoder.decode(msg.data))  # type: ignore[attr-defined]

    types: list[str] = []

    async def on_event(msg: object) -> None:
        types.append(json.loads(msg.data)["type"])  # type: ignore[attr-defined]
        if types[-1] == "placed":
            placed.set()

    try:
        await nc.subscribe(node_grants("node-r"), cb=on_grant)
        await nc.subscribe("gpulayer.job.anonymous.orphan.events", cb=on_event)
        request = json.dumps({"job_id": "orphan", "command": ["true"]})
        async with pool.acquire() as conn:
            await conn.execute(
                "INSERT INTO jobs (job_id, request, state, node_id, grant_id, accelerator, devices,"
                " submitted_at) VALUES ('orphan', $1::jsonb, 'placed', 'node-r', 'orphan-1', 'cpu',"
                " '{}', now() - make_interval(secs => $2))",
                request,
                submitted_ago_s,
            )
        grant = await asyncio.wait_for(grants.get(), 10)
        assert grant.grant_id == "orphan-1"
        assert grant.job.command == ["true"]
        await asyncio.wait_for(placed.wait(), 10)
        # Once stored, the resend is not repeated: two more passes over the still-placed job
        # (each touches its row) send nothing more.
        async with pool.acquire() as conn:
            sql = "SELECT updated_at FROM jobs WHERE job_id = 'orphan'"
            seen = {await conn.fetchval(sql)}
            async with asyncio.timeout(10):
                while len(seen) < 3:
                    await asyncio.sleep(0.1)
                    seen.add(await conn.fetchval(sql))
        await nc.flush()
        assert grants.empty()
        assert types == (["accepted", "placed"] if submitted_ago_s == 0 else ["placed"])
    finally:
        await svc.close()
        await pool.close()


class _ResendSeen(logging.Handler):
    """Sets ``seen`` when the resend loop logs a re-sent grant of ``job_id``."""

    def __init__(self, job_id: str) -> None:
        super().__init__()
        self.job_id = job_id
        self.seen = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("re-sending grant") and self.job_id in record.args:  # type: ignore[operator]
            self.seen.set()


@pytest.mark.parametrize("order", ["node first", "job first"])
@pytest.mark.parametrize("failure", ["nothing stored", "stored but unacknowledged"])
async def test_job_announced_once_when_publishing_its_events_failed(
    nc: Client, database_url: str, failure: str, order: str
) -> None:
    """The job was committed but the publish of its `accepted` event (and grant) failed, or its
    ack was lost: the submit message is redelivered and the job is announced exactly once.

    With the node known first, the job is placed where it is ingested, so its grant was in the
    failed batch; with the job first, it waits and the scheduler's grant goes out on its own."""
    js = nc.jetstream()
    await ensure_streams(js)
    pool = await create_pool(database_url)
    svc = PlacementService(nc, pool, Settings(node_timeout_s=30, resend_after_s=0.5))
    real_publish = svc.publisher.publish
    failed = asyncio.Event()
    grant_in_failed_batch = False
    subject = "gpulayer.job.anonymous.flaky-1.events"

    async def flaky(items: list[tuple[str, bytes, dict[str, str]]]) -> bool:
        nonlocal grant_in_failed_batch
        if not failed.is_set() and any(s == subject for s, _, _ in items):
            failed.set()
            grant_in_failed_batch = any(s == node_grants("node-f") for s, _, _ in items)
            if failure == "stored but unacknowledged":
                await real_publish(items)
            return False
        return await real_publish(items)

    svc.publisher.publish = flaky  # type: ignore[method-assign]
    resend = _ResendSeen("flaky-1")
    service_log = logging.getLogger("gpulayer_placement.service")
    service_log.addHandler(resend)
    level = service_log.level
    service_log.setLevel(logging.INFO)
    await svc.start()
    grant_sends = 0
    granted = asyncio.Event()

    async def on_grant(msg: Msg) -> None:
        nonlocal grant_sends
        grant_sends += 1  # a core subscriber sees every publish, duplicates included
        granted.set()

    sub = await nc.subscribe(node_grants("node-f"), cb=on_grant)
    body = json.dumps({"job_id": "flaky-1", "command": ["true"]}).encode()

    async def stored(sql: str) -> None:
        async with pool.acquire() as conn, asyncio.timeout(10):
            while True:  # polled: the row is written by another consumer's transaction
                if await conn.fetchval(sql) is not None:
                    return
                await asyncio.sleep(0.02)

    try:
        if order == "node first":
            await js.publish(node_capabilities("node-f"), encode(linux_node("node-f")))
            await stored("SELECT 1 FROM nodes WHERE node_id = 'node-f'")
            await js.publish(JOBS_SUBMIT, body, headers={MSG_ID_HEADER: "flaky-1"})
        else:
            await js.publish(JOBS_SUBMIT, body, headers={MSG_ID_HEADER: "flaky-1"})
            await stored("SELECT 1 FROM jobs WHERE job_id = 'flaky-1'")
            await js.publish(node_capabilities("node-f"), encode(linux_node("node-f")))
        async with asyncio.timeout(20):
            # The resend loop ran for the still-placed job (it re-sends `placed` once)...
            await resend.seen.wait()
            await granted.wait()
            # ...and the submit message was redelivered and this time acknowledged.
            while True:
                info = await js.consumer_info("JOBS", "placement-jobs")
                if info.num_ack_pending == 0 and info.num_pending == 0:
                    break
                await asyncio.sleep(0.05)
        assert failed.is_set()
        # The resend is the only grant when the first one was never stored; otherwise it is
        # the second (the executor drops the duplicate by its grant id).
        lost_grant = failure == "nothing stored" and grant_in_failed_batch
        async with asyncio.timeout(10):
            while grant_sends < (1 if lost_grant else 2):
                await nc.flush()
        await nc.flush()
        assert grant_sends == (1 if lost_grant else 2)
        # What the stream kept (core subscribers would also see the dropped duplicates).
        psub = await js.pull_subscribe(subject, stream="JOB_EVENTS")
        stored_types = [json.loads(m.data)["type"] for m in await psub.fetch(10, timeout=2)]
        await psub.unsubscribe()
        # (A `pending` comes between them when the job came before the node's capabilities.)
        assert stored_types.count("accepted") == 1, stored_types
        assert stored_types.count("placed") == 1, stored_types
        assert stored_types[0] == "accepted", stored_types
        info = await js.stream_info("JOB_EVENTS", subjects_filter=subject)
        assert (info.state.subjects or {}).get(subject) == len(stored_types), info.state.subjects
    finally:
        service_log.removeHandler(resend)
        service_log.setLevel(level)
        await sub.unsubscribe()
        await svc.close()
        await pool.close()


async def test_a_waiting_job_cancelled_while_nats_fails_over_still_says_so(
    nc: Client, database_url: str
) -> None:
    """Cancelling a waiting job commits its end at once; its `cancelled` event, which no other
    path would send, is retried until stored (JetStream answering nothing during a failover
    lost it before: the fault run's job that never ended)."""
    js = nc.jetstream()
    await ensure_streams(js)
    pool = await create_pool(database_url)
    svc = PlacementService(nc, pool, Settings(node_timeout_s=30, resend_after_s=60))
    real_publish = svc.publisher.publish
    subject = "gpulayer.job.anonymous.wait-1.events"
    refused = 0

    async def failing_over(items: list[tuple[str, bytes, dict[str, str]]]) -> bool:
        nonlocal refused
        if refused < 3 and any(
            s == subject and json.loads(d)["type"] == "cancelled" for s, d, _ in items
        ):
            refused += 1
            return False
        return await real_publish(items)

    svc.publisher.publish = failing_over  # type: ignore[method-assign]
    await svc.start()
    try:
        body = json.dumps({"job_id": "wait-1", "command": ["true"]}).encode()
        await js.publish(JOBS_SUBMIT, body, headers={MSG_ID_HEADER: "wait-1"})
        async with pool.acquire() as conn, asyncio.timeout(10):
            while True:  # stored, waiting: no node at all
                if await conn.fetchval("SELECT state FROM jobs WHERE job_id = 'wait-1'"):
                    break
                await asyncio.sleep(0.02)
        reply = await api(nc, API_CANCEL, {"job_id": "wait-1"}, timeout=30)
        assert reply == {"job_id": "wait-1", "state": "cancelled"}
        assert refused == 3
        psub = await js.pull_subscribe(subject, stream="JOB_EVENTS")
        stored = [json.loads(m.data)["type"] for m in await psub.fetch(10, timeout=2)]
        await psub.unsubscribe()
        assert stored.count("cancelled") == 1, stored
    finally:
        await svc.close()
        await pool.close()


async def test_a_cancel_asked_again_says_what_a_stopped_replica_did_not(
    nc: Client, database_url: str
) -> None:
    """A replica committed a waiting job's cancel and stopped before its `cancelled` event was
    stored; the client, with no answer, asks another replica again. That one finds the job
    already cancelled and says so, and stores the event the first could not, once (the fault
    run's job that never ended)."""
    js = nc.jetstream()
    await ensure_streams(js)
    pool = await create_pool(database_url)
    svc = PlacementService(nc, pool, Settings(node_timeout_s=30, resend_after_s=60))
    await svc.start()
    subject = "gpulayer.job.anonymous.gone-1.events"
    try:
        body = json.dumps({"job_id": "gone-1", "command": ["true"]}).encode()
        await js.publish(JOBS_SUBMIT, body, headers={MSG_ID_HEADER: "gone-1"})
        async with pool.acquire() as conn:
            async with asyncio.timeout(10):
                while True:  # stored, waiting: no node at all
                    if await conn.fetchval("SELECT state FROM jobs WHERE job_id = 'gone-1'"):
                        break
                    await asyncio.sleep(0.02)
            # What the stopped replica committed (the cancel_pending query), nothing published.
            await conn.execute(
                "UPDATE jobs SET state = 'cancelled', reason = 'by alice', updated_at = now() "
                "WHERE job_id = 'gone-1'"
            )
        for _ in range(2):
            with pytest.raises(ApiFailed, match="already cancelled"):
                await api(nc, API_CANCEL, {"job_id": "gone-1"}, timeout=30)
        psub = await js.pull_subscribe(subject, stream="JOB_EVENTS")
        stored = [json.loads(m.data) for m in await psub.fetch(10, timeout=2)]
        await psub.unsubscribe()
        assert [e["type"] for e in stored].count("cancelled") == 1, stored
        assert [e["reason"] for e in stored if e["type"] == "cancelled"] == ["by alice"]
    finally:
        await svc.close()
        await pool.close()


async def test_jobs_a_cancel_cascades_to_are_announced_when_the_replica_that_cancelled_stops(
    nc: Client, database_url: str, events: Events
) -> None:
    """A replica cancels a waiting job and stops before it could publish anything: the jobs that
    waited for it (after), cancelled in the same transaction, were announced by it alone and
    lost. The next replica announces them from the outbox, each once, under its own id."""
    js = nc.jetstream()
    await ensure_streams(js)
    await subscribed(nc)
    settings = Settings(node_timeout_s=30, resend_after_s=60)
    pool = await create_pool(database_url)
    first = PlacementService(nc, pool, settings)
    await first.start()
    try:
        for job_id, after in (("root-1", []), ("mid-1", ["root-1"]), ("leaf-1", ["mid-1"])):
            body = {"job_id": job_id, "command": ["true"], "after": after}
            await js.publish(
                JOBS_SUBMIT, json.dumps(body).encode(), headers={MSG_ID_HEADER: job_id}
            )
            await events.wait_for(job_id, "accepted")  # a dependency must be stored first
        tried = asyncio.Event()

        async def stopped(items: object, timeout: float) -> None:
            tried.set()  # what it publishes from now on never arrives: it is gone
            await asyncio.Future()

        first.publisher.send_batch = stopped
        await nc.publish(API_CANCEL, encode({"job_id": "root-1"}))  # no reply wanted
        await asyncio.wait_for(tried.wait(), 10)  # committed, its publish under way
        async with pool.acquire() as db:
            rows = await db.fetch("SELECT job_id, state FROM jobs")
    finally:
        await first.close()
        await pool.close()
    assert {r["job_id"]: r["state"] for r in rows} == dict.fromkeys(
        ("root-1", "mid-1", "leaf-1"), "cancelled"
    )
    assert "cancelled" not in events.types("mid-1")

    pool = await create_pool(database_url)
    second = PlacementService(nc, pool, settings)
    await second.start()
    try:
        await events.wait_for("mid-1", "cancelled")
        await events.wait_for("leaf-1", "cancelled")
        async with pool.acquire() as conn, asyncio.timeout(10):
            while True:  # deleted in the transaction that published them, once that commits
                if not await conn.fetchval("SELECT count(*) FROM event_outbox"):
                    break
                await asyncio.sleep(0.02)
    finally:
        await second.close()
        await pool.close()
    for job_id, why in (("mid-1", "root-1 ended cancelled"), ("leaf-1", "mid-1 ended cancelled")):
        psub = await js.pull_subscribe(
            f"gpulayer.job.anonymous.{job_id}.events", stream="JOB_EVENTS"
        )
        stored = [(json.loads(m.data), m.headers) for m in await psub.fetch(10, timeout=2)]
        await psub.unsubscribe()
        ended = [
            (e["reason"], (h or {})[MSG_ID_HEADER]) for e, h in stored if e["type"] == "cancelled"
        ]
        assert ended == [(f"dependency {why} (after)", f"{job_id}:cancelled")], stored


async def test_a_commit_to_the_outbox_wakes_a_running_replica_at_once(
    nc: Client, database_url: str, events: Events
) -> None:
    """Another replica's commit NOTIFYs: this one publishes what it put in the outbox without
    waiting for its next look (set far off here)."""
    await ensure_streams(nc.jetstream())
    await subscribed(nc)
    pool = await create_pool(database_url)
    svc = PlacementService(nc, pool, Settings(node_timeout_s=30, resend_after_s=60))
    svc.outbox.period_s = 3600.0
    await svc.start()
    try:
        async with pool.acquire() as conn, conn.transaction():
            await outbox.record(conn, [Cancelled(job_id="told-1", reason="dependency x")])
        await events.wait_for("told-1", "cancelled")
    finally:
        await svc.close()
        await pool.close()


async def test_no_grants_to_a_node_whose_executor_stopped(
    nc: Client, database_url: str, events: Events
) -> None:
    """The probe still beats (the node is online), the executor doesn't: new jobs wait with the
    reason, and are placed once the executor beats again."""
    js = nc.jetstream()
    await ensure_streams(js)
    pool = await create_pool(database_url)
    svc = PlacementService(nc, pool, Settings(node_timeout_s=0.5, resend_after_s=60))
    await svc.start()
    executor_alive = asyncio.Event()
    executor_alive.set()

    async def beat() -> None:
        while True:
            now = datetime.now(UTC)
            probe = Heartbeat(node_id="node-e", sent_at=now)
            await nc.publish(node_heartbeat("node-e"), encode(probe))
            if executor_alive.is_set():
                executor = Heartbeat(node_id="node-e", sent_at=now, source="executor")
                await nc.publish(node_heartbeat("node-e"), encode(executor))
            await asyncio.sleep(0.05)

    async def executor_state(want: str) -> dict[str, Any]:
        async with asyncio.timeout(10):
            while True:
                nodes = await api(nc, API_NODES)
                (node,) = [n for n in nodes if n["node_id"] == "node-e"] or [None]
                if node is not None and node["executor"] == want:
                    return dict(node)
                await asyncio.sleep(0.05)

    beating = asyncio.create_task(beat())
    try:
        await js.publish(node_capabilities("node-e"), encode(linux_node("node-e")))
        await executor_state("up")
        first = json.dumps({"job_id": "exec-0", "command": ["true"]}).encode()
        await js.publish(JOBS_SUBMIT, first, headers={MSG_ID_HEADER: "exec-0"})
        await events.wait_for("exec-0", "placed")
        executor_alive.clear()
        node = await executor_state("down")
        assert node["online"]  # the probe's heartbeats keep the node itself online
        # A job placed before is not lost, and explain says what it waits for.
        explained = await api(nc, API_EXPLAIN, {"job_id": "exec-0"})
        assert explained["state"] == "placed"
        assert explained["note"] == (
            "node node-e has no running executor (its heartbeats stopped): the grant waits there "
            "until it is back"
        )
        body = json.dumps({"job_id": "exec-1", "command": ["true"]}).encode()
        await js.publish(JOBS_SUBMIT, body, headers={MSG_ID_HEADER: "exec-1"})
        await events.wait_for("exec-1", "pending")
        pending = events.by_job["exec-1"][-1]
        assert "1 has no running executor (its heartbeats stopped)" in pending.summary  # type: ignore[attr-defined]
        assert not pending.unsatisfiable  # type: ignore[attr-defined]
        assert "placed" not in events.types("exec-1")
        executor_alive.set()
        await events.wait_for("exec-1", "placed")
        assert (await executor_state("up"))["online"]
    finally:
        beating.cancel()
        await svc.close()
        await pool.close()


@pytest.mark.parametrize(("submitted_ago_s", "announced"), [(0, 1), (600, 0)])
async def test_a_redelivered_submit_re_announces_only_a_young_job(
    nc: Client, database_url: str, submitted_ago_s: int, announced: int
) -> None:
    """A known job whose submit message comes again (its first handling failed before the ack)
    gets its `accepted` said again only while JetStream would drop the copy: a job stored long
    ago was announced long ago, and a second `accepted` would stay in its history."""
    js = nc.jetstream()
    await ensure_streams(js)
    pool = await create_pool(database_url)
    svc = PlacementService(nc, pool, Settings(node_timeout_s=30, resend_after_s=60))
    real_publish_events = svc.publisher.publish_events
    calls = 0

    async def first_fails(events: list[Any]) -> bool:
        # Intake's own publish of the submit's handling (the scheduler publishes through
        # publish_outcome: counting every publish, a pass at start took the one failure, and
        # the submit was acked on its first handling, never redelivered; CI did so twice).
        nonlocal calls
        if not all(e.job_id == "known-1" for e in events):
            return await real_publish_events(events)
        calls += 1
        if calls == 1:
            # A failure of this batch's own (NATS itself answers): nak'ed, redelivered. A NATS
            # away (another task's last publish failed) would keep the message instead.
            svc.publisher.unavailable = False
            return False
        return await real_publish_events(events)

    await svc.start()
    async with pool.acquire() as conn:
        await conn.execute(
            "INSERT INTO jobs (job_id, request, state, submitted_at)"
            " VALUES ('known-1', $1::jsonb, 'pending', now() - make_interval(secs => $2))",
            json.dumps({"job_id": "known-1", "command": ["true"]}),
            submitted_ago_s,
        )
    svc.publisher.publish_events = first_fails  # type: ignore[method-assign]
    try:
        body = json.dumps({"job_id": "known-1", "command": ["true"]}).encode()
        await js.publish(JOBS_SUBMIT, body, headers={MSG_ID_HEADER: "known-1"})
        async with asyncio.timeout(20):  # handled twice: nak'ed, redelivered, acked
            while True:
                info = await js.consumer_info("JOBS", "placement-jobs")
                if calls >= 2 and info.num_ack_pending == 0 and info.num_pending == 0:
                    break
                await asyncio.sleep(0.05)
        subject = "gpulayer.job.anonymous.known-1.events"
        stored: list[str] = []
        if ((await js.stream_info("JOB_EVENTS", subjects_filter=subject)).state.subjects or {}).get(
            subject
        ):
            psub = await js.pull_subscribe(subject, stream="JOB_EVENTS")
            stored = [json.loads(m.data)["type"] for m in await psub.fetch(10, timeout=2)]
            await psub.unsubscribe()
        assert stored.count("accepted") == announced, stored
    finally:
        await svc.close()
        await pool.close()
