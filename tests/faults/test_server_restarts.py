"""NATS or PostgreSQL restarting under running services: nothing is lost, work goes on.

Each test owns its server (started here, on its own port and data folder), so that it can stop
and start it without touching what other tests use.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import PubAck
from tests.helpers import Services, events_until, service_env

from gpulayer_contracts.subjects import JOB_WILDCARD_EVENTS, JOBS_SUBMIT, MSG_ID_HEADER
from gpulayer_runtime.nats import connect, ensure_streams
from gpulayer_runtime.pgserver import EmbeddedPostgres
from gpulayer_runtime.servers import EmbeddedNats

pytestmark = pytest.mark.e2e

SERVICES = ("gpulayer-placement", "gpulayer-executor", "gpulayer-probe")


async def submit(nc: Client, job_id: str, timeout: float = 30.0) -> dict[str, list[str]]:
    """Publish a `true` job (retrying while NATS comes back) and wait for its terminal event."""
    waiter = asyncio.create_task(events_until(nc, {job_id}, timeout))
    await asyncio.sleep(0)
    body = json.dumps({"job_id": job_id, "command": ["true"]}).encode()
    async with asyncio.timeout(timeout):
        while True:
            try:
                await nc.jetstream().publish(
                    JOBS_SUBMIT, body, headers={MSG_ID_HEADER: job_id}, timeout=2
                )
                break
            except Exception:  # not reconnected yet: the same message id makes a retry safe
                await asyncio.sleep(0.2)
    return await waiter


@pytest.fixture
async def own_nats(tmp_path: Path) -> AsyncIterator[EmbeddedNats]:
    server = EmbeddedNats(tmp_path / "nats").start()
    try:
        yield server
    finally:
        server.stop()


async def test_services_ride_out_a_nats_restart(
    own_nats: EmbeddedNats, database_url: str, tmp_path: Path
) -> None:
    nc = await connect(own_nats.url, "test-nats-restart")
    try:
        await ensure_streams(nc.jetstream())
        env = service_env(own_nats.url, database_url, tmp_path / "work", "nr-node")
        async with Services() as services:
            for name in SERVICES:
                await services.start(name, env, tmp_path / f"{name}.log")
            assert (await submit(nc, "before-restart"))["before-restart"][-1] == "succeeded"

            # A job that ends while NATS is down: its report waits for NATS, and arrives once.
            go = tmp_path / "go"
            running = asyncio.Event()
            through: list[str] = []

            async def on_event(msg: Msg) -> None:
                through.append(json.loads(msg.data)["type"])
                if through[-1] == "running":
                    running.set()

            job = {
                "job_id": "across",
                "command": ["sh", "-c", f'while [ ! -e "{go}" ]; do sleep 0.05; done'],
            }
            sub = await nc.subscribe("gpulayer.job.anonymous.across.events", cb=on_event)
            await nc.jetstream().publish(
                JOBS_SUBMIT, json.dumps(job).encode(), headers={MSG_ID_HEADER: "across"}
            )
            await asyncio.wait_for(running.wait(), 30)

            own_nats.stop()
            go.touch()
            own_nats.start()  # same port, same JetStream folder

            seen = await submit(nc, "after-restart")
            assert seen["after-restart"][-1] == "succeeded", seen
            assert seen["after-restart"].count("running") == 1
            # What the stream kept for the job that ended during the outage.
            stored = await nc.jetstream().pull_subscribe(
                "gpulayer.job.anonymous.across.events", stream="JOB_EVENTS"
            )
            kept: list[str] = []
            async with asyncio.timeout(30):
                while "succeeded" not in kept:
                    with contextlib.suppress(TimeoutError):
                        kept += [json.loads(m.data)["type"] for m in await stored.fetch(10, 1)]
            await stored.unsubscribe()
            await sub.unsubscribe()
            assert kept == ["accepted", "placed", "running", "succeeded"], kept
            for name, proc in services.procs.items():
                assert proc.returncode is None, f"{name} exited with {proc.returncode}"
    finally:
        await nc.close()


# The PostgreSQL restart happens under this load: submits per second, for this long, the
# restart this far in. 100 a second is above what a 2-core machine's stack finishes (the full
# loop bench: ~100 jobs/s with the machine to itself), so jobs are queued in every part when
# PostgreSQL goes; 200 only doubled the suite's CPU spent here.
PG_LOAD_RATE = 100
PG_LOAD_S = 6.0
PG_RESTART_AT_S = 2.0


async def test_services_ride_out_a_postgres_restart(
    nats_url: str, nc: Client, tmp_path: Path
) -> None:
    pg = EmbeddedPostgres(tmp_path / "pg", fast=True).start()
    try:
        database_url = await pg.service_database()
        await ensure_streams(nc.jetstream())
        env = service_env(nats_url, database_url, tmp_path / "work", "pr-node")
        async with Services() as services:
            for name in SERVICES:
                await services.start(name, env, tmp_path / f"{name}.log")
            assert (await submit(nc, "before-pg-restart"))["before-pg-restart"][-1] == "succeeded"

            # Steady submits at PG_LOAD_RATE while PostgreSQL stops and starts again: every
            # one of them ends once, as it should (its database writes retried or redelivered).
            jobs = await load_across_restart(nc, pg)
            seen = await stored_events(nc, set(jobs))
            ends = Counter(t for types in seen.values() for t in types if t in TERMINAL)
            assert ends == {"succeeded": len(jobs)}, ends
            assert all(types.count("running") == 1 for types in seen.values()), seen

            seen = await submit(nc, "after-pg-restart")
            assert seen["after-pg-restart"][-1] == "succeeded", seen
            for name, proc in services.procs.items():
                assert proc.returncode is None, f"{name} exited with {proc.returncode}"
            # Other replicas' allocation changes reach it again: it listens on a new connection.
            log = tmp_path / "gpulayer-placement.log"
            async with asyncio.timeout(20):  # a process outside this loop: poll its log
                while True:
                    if "listening for other replicas' changes again" in log.read_text():
                        break
                    await asyncio.sleep(0.1)
            # Placement's own records are whole again: the executor's report is applied once
            # placement consumes it, so poll the row until it says so.
            conn = await asyncpg.connect(database_url)
            try:
                async with asyncio.timeout(20):
                    sql = "SELECT state FROM jobs WHERE job_id = 'after-pg-restart'"
                    while (state := await conn.fetchval(sql)) != "succeeded":
                        assert state in ("placed", "running"), state
                        await asyncio.sleep(0.1)
            finally:
                await conn.close()
    finally:
        pg.stop()


TERMINAL = {"succeeded", "failed", "cancelled", "lost", "rejected"}


def restart_postgres(pg: EmbeddedPostgres) -> None:
    pg.stop()
    pg.start()


async def load_across_restart(nc: Client, pg: EmbeddedPostgres) -> list[str]:
    """Publish `true` jobs at PG_LOAD_RATE for PG_LOAD_S, restarting PostgreSQL (same port,
    same data) PG_RESTART_AT_S in; the job ids."""
    js = nc.jetstream()
    jobs: list[str] = []
    acks: list[asyncio.Future[PubAck]] = []
    restarted = False
    restart: asyncio.Task[None] | None = None
    t0 = time.monotonic()
    while (elapsed := time.monotonic() - t0) < PG_LOAD_S:
        if not restarted and elapsed >= PG_RESTART_AT_S:
            restarted = True
            # In a thread: the submits go on while PostgreSQL is down.
            restart = asyncio.create_task(asyncio.to_thread(restart_postgres, pg))
        while len(jobs) < int(elapsed * PG_LOAD_RATE) + 1:
            job_id = f"pg-load-{len(jobs):05d}"
            body = json.dumps({"job_id": job_id, "command": ["true"]}).encode()
            acks.append(await js.publish_async(JOBS_SUBMIT, body, headers={MSG_ID_HEADER: job_id}))
            jobs.append(job_id)
        await asyncio.sleep(0.005)
    assert restart is not None
    await restart
    await asyncio.gather(*acks)
    return jobs


async def stored_events(nc: Client, jobs: set[str]) -> dict[str, list[str]]:
    """Every stored event of ``jobs`` (an ordered consumer over the whole stream), until each
    has ended, and a second more: a duplicate end would come next."""
    seen: dict[str, list[str]] = {j: [] for j in jobs}
    done = asyncio.Event()

    async def cb(msg: Msg) -> None:
        event = json.loads(msg.data)
        if event["job_id"] in seen:
            seen[event["job_id"]].append(event["type"])
            if all(TERMINAL & set(t) for t in seen.values()):
                done.set()

    sub = await nc.jetstream().subscribe(JOB_WILDCARD_EVENTS, cb=cb, ordered_consumer=True)
    try:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), 120)
        await asyncio.sleep(1.0)
    finally:
        await sub.unsubscribe()
    return seen
