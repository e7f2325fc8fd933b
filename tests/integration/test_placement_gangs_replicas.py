"""Distributed jobs across placement replicas and failures (issue 14, placement side), with real
NATS and PostgreSQL: two replicas placing gangs and single jobs never double-book a device and
never hold part of a gang; a node going silent loses its rank and the gang, naming it; a rank's
re-sent grant still carries its rendezvous."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import pytest
from nats.aio.client import Client
from tests.helpers import role_creds
from tests.integration.test_placement_gangs import (
    api,
    gang,
    msgspec_cancel,
    node,
    queue,
    report,
    small,
    state_of,
    submit,
    two_grants,
)

from gpulayer_contracts import Grant, Heartbeat, encode
from gpulayer_contracts.codec import grant_decoder
from gpulayer_contracts.subjects import (
    API_JOB,
    NODE_WILDCARD_CONTROL,
    NODE_WILDCARD_GRANTS,
    node_heartbeat,
)
from gpulayer_placement.service import PlacementService, Settings
from gpulayer_placement.store import create_pool
from gpulayer_runtime.nats import connect, ensure_streams

pytestmark = pytest.mark.integration


async def start(
    nats_url: str, database_url: str, n: int, **settings: Any
) -> list[tuple[PlacementService, Client]]:
    started = []
    for i in range(n):
        conn = await connect(nats_url, f"placement-{i}", creds=role_creds("placement"))
        pool = await create_pool(database_url, min_size=1, max_size=4)
        base: dict[str, Any] = {"node_timeout_s": 30, "resend_after_s": 60, "batch_size": 16}
        svc = PlacementService(conn, pool, Settings(**{**base, **settings}))
        await svc.start()
        started.append((svc, conn))
    return started


async def stop(started: list[tuple[PlacementService, Client]]) -> None:
    for svc, conn in started:
        await svc.close()
        await svc.pool.close()
        await conn.drain()


@pytest.fixture
async def two(
    nats_url: str, database_url: str, nc: Client
) -> AsyncIterator[list[PlacementService]]:
    await ensure_streams(nc.jetstream())
    started = await start(nats_url, database_url, 2)
    yield [s for s, _ in started]
    await stop(started)


async def test_two_replicas_with_gangs_in_the_mix_never_double_book_or_half_place(
    nc: Client, two: list[PlacementService]
) -> None:
    """6 nodes of 2 GPUs; 12 two-node gangs and 24 single jobs submitted at once to two
    replicas; a fake executor ends each grant after a random while. Every device is held by one
    grant at a time, every gang's ranks arrive together on distinct nodes, and every job and
    gang ends succeeded once."""
    for i in range(6):
        await node(nc, f"n{i}", gpus=2, addr=f"10.2.0.{i}")
    grants = await queue(nc, NODE_WILDCARD_GRANTS, grant_decoder)
    gangs = [f"gang{i}" for i in range(12)]
    singles = [f"one{i}" for i in range(24)]
    order = gangs + singles
    random.Random(14).shuffle(order)
    for job_id in order:
        await submit(nc, job_id, gang(job_id) if job_id in gangs else small(job_id))
    held: dict[tuple[str, int], str] = {}
    ranks: dict[str, list[Grant]] = {}
    done: set[str] = set()
    rng = random.Random(7)

    async def finish(g: Grant) -> None:
        await asyncio.sleep(rng.uniform(0.0, 0.05))
        for d in g.devices:
            del held[(g.node_id, d)]
        await report(nc, g, "running")
        await report(nc, g, "succeeded", 0)

    tasks = []
    async with asyncio.timeout(60):
        while len(done) < len(order):
            g = await grants.get()
            for d in g.devices:
                assert (g.node_id, d) not in held, f"{g.job.job_id} and {held[(g.node_id, d)]}"
                held[(g.node_id, d)] = g.job.job_id
            if g.gang is None:
                done.add(g.job.job_id)
                tasks.append(asyncio.create_task(finish(g)))
                continue
            got = ranks.setdefault(g.gang.job_id, [])
            got.append(g)
            if len(got) == 2:
                assert len({r.node_id for r in got}) == 2
                assert {r.gang.rank for r in got if r.gang} == {0, 1}
                done.add(g.gang.job_id)
                tasks.extend(asyncio.create_task(finish(r)) for r in got)
        await asyncio.gather(*tasks)
    svc = two[0]
    # Every end stored (the singles' too: their devices are released with it) before counting.
    for job_id in order:
        await state_of(svc, job_id, "succeeded")
    async with svc.pool.acquire() as db:
        assert await db.fetchval("SELECT count(*) FROM allocations") == 0
        assert await db.fetchval("SELECT count(*) FROM gang_ports") == 0
        assert await db.fetchval("SELECT count(*) FROM jobs WHERE gang_id IS NOT NULL") == 24


async def test_a_node_going_silent_loses_its_rank_and_the_gang_naming_it(
    nats_url: str, database_url: str, nc: Client
) -> None:
    await ensure_streams(nc.jetstream())
    started = await start(nats_url, database_url, 1, node_timeout_s=1.0)
    svc = started[0][0]
    try:
        grants = await queue(nc, NODE_WILDCARD_GRANTS, grant_decoder)
        cancels = await queue(nc, NODE_WILDCARD_CONTROL, msgspec_cancel())
        await node(nc, "a", addr="10.3.0.1")
        await node(nc, "b", addr="10.3.0.2")
        silent: set[str] = set()
        beating = True

        async def beat() -> None:  # the nodes beat until the test silences one
            while beating:
                for n in {"a", "b"} - silent:
                    hb = Heartbeat(node_id=n, sent_at=datetime.now(UTC))
                    await nc.publish(node_heartbeat(n), encode(hb))
                await asyncio.sleep(0.2)

        beater = asyncio.create_task(beat())
        await submit(nc, "gl", gang("gl"))
        r0, r1 = await two_grants(grants)
        for g in (r0, r1):
            await report(nc, g, "running")
        await state_of(svc, "gl", "running")
        silent.add(r1.node_id)
        row = await state_of(svc, "gl", "lost")
        assert row["reason"].startswith(
            f"rank 1 on {r1.node_id} was lost: node stopped sending heartbeats"
        )
        # The other rank is stopped; the lost one too, given up, for when its node is back.
        stopped = {}
        for _ in range(2):
            cancel = await asyncio.wait_for(cancels.get(), 10)
            stopped[cancel.job_id] = cancel.given_up
        assert stopped == {"gl-rank0": False, "gl-rank1": True}
        assert (await state_of(svc, "gl-rank1", "lost"))["node_id"] == r1.node_id
        beating = False
        await beater
    finally:
        await stop(started)


async def test_a_ranks_resent_grant_still_carries_its_rendezvous(
    nats_url: str, database_url: str, nc: Client
) -> None:
    await ensure_streams(nc.jetstream())
    started = await start(nats_url, database_url, 1, resend_after_s=0.5)
    try:
        grants = await queue(nc, NODE_WILDCARD_GRANTS, grant_decoder)
        await node(nc, "a", addr="10.4.0.1")
        await node(nc, "b", addr="10.4.0.2")
        await submit(nc, "gr", gang("gr"))
        first = await two_grants(grants)
        again = await two_grants(grants)  # nobody reported running: both re-sent
        assert [g.grant_id for g in again] == [g.grant_id for g in first]
        assert [g.gang for g in again] == [g.gang for g in first]
        shown = await api(nc, API_JOB, job_id="gr")
        assert shown["state"] == "placed"
    finally:
        await stop(started)
