"""Migrations 0025 and 0026 on a real PostgreSQL: the owners with a waiting job, each owner's
first waiting jobs (a pass over the queue takes them before its pages: fair share over the
whole queue), and the replicas' allocation notices split under PostgreSQL's payload limit."""

from __future__ import annotations

import asyncio
import json

import asyncpg
import pytest

from gpulayer_placement import waiting
from gpulayer_placement.replica_sync import NOTIFY_CHANNEL
from gpulayer_placement.store import migrate

pytestmark = pytest.mark.integration


async def _queue(conn: asyncpg.Connection) -> None:
    """alice: 2,000 jobs waiting, oldest first; bob: one, newer than all of them; carol: one
    urgent and one not; dave: one blocked by a dependency; erin: one placed."""
    request = json.dumps({"job_id": "x", "command": ["true"]})
    await conn.execute(
        "INSERT INTO jobs (job_id, request, state, owner, submitted_at)"
        " SELECT 'a' || lpad(g::text, 5, '0'), $1::jsonb, 'pending', 'alice',"
        "        '2026-01-01'::timestamptz + g * interval '1 second'"
        " FROM generate_series(1, 2000) g",
        request,
    )
    await conn.execute(
        "INSERT INTO jobs (job_id, request, state, owner, priority, blocked, submitted_at) VALUES"
        " ('b1', '{}', 'pending', 'bob', 0, false, '2026-03-01'),"
        " ('c-hi', '{}', 'pending', 'carol', 5, false, '2026-03-02'),"
        " ('c-lo', '{}', 'pending', 'carol', 0, false, '2026-02-01'),"
        " ('d1', '{}', 'pending', 'dave', 0, true, '2025-01-01'),"
        " ('e1', '{}', 'placed', 'erin', 0, false, '2025-01-01')"
    )


async def test_each_owners_first_jobs_in_matching_order_locked(database_url: str) -> None:
    conn = await asyncpg.connect(database_url)
    other = await asyncpg.connect(database_url)
    try:
        await migrate(conn)
        await _queue(conn)
        # Every owner with a row waiting (dave's blocked one too: it takes nothing), no other.
        assert await waiting.waiting_owners(conn, 100) == ["alice", "bob", "carol", "dave"]
        assert await waiting.waiting_owners(conn, 2) == ["alice", "bob"]
        owners = ["bob", "carol", "alice", "dave"]
        async with conn.transaction():
            rows = await waiting.take_heads(conn, owners, 2)
            # Highest priority first, then oldest; bob's one job though 2,000 of alice's are
            # older; dave's blocked job not at all.
            assert [r["job_id"] for r in rows] == ["c-hi", "a00001", "a00002", "c-lo", "b1"]
            # Locked: another replica's pass takes the next ones.
            async with other.transaction():
                again = await waiting.take_heads(other, owners, 2)
                assert [r["job_id"] for r in again] == ["a00003", "a00004"]
        # Below a priority that a job left behind may have, nothing is taken: alice's next
        # urgent job may be behind her first.
        await conn.execute("UPDATE jobs SET priority = 7 WHERE job_id IN ('a00001', 'a00002')")
        async with conn.transaction():
            rows = await waiting.take_heads(conn, owners, 1)
            assert [r["job_id"] for r in rows] == ["a00001"]
    finally:
        await other.close()
        await conn.close()


async def test_allocation_notices_are_split_under_postgres_payload_limit(database_url: str) -> None:
    """A batch that changed 200 nodes of 128-byte names (25 KB of names): PostgreSQL refuses a
    payload of 8,000 bytes or more, which once failed every scheduling pass of a large fleet."""
    conn = await asyncpg.connect(database_url)
    listener = await asyncpg.connect(database_url)
    payloads: asyncio.Queue[str] = asyncio.Queue()
    try:
        await migrate(conn)
        await listener.add_listener(NOTIFY_CHANNEL, lambda *a: payloads.put_nowait(a[3]))
        nodes = [f"n{i:03d}-" + "x" * 123 for i in range(200)]
        sent = await conn.fetchval("SELECT gpulayer_notify_nodes('r1', $1::text[])", nodes)
        got: list[str] = []
        for _ in range(sent):
            payload = await asyncio.wait_for(payloads.get(), 10)
            assert len(payload.encode()) < 8000
            replica, _, names = payload.partition("|")
            assert replica == "r1"
            got += names.split(",")
        assert sent >= 4
        assert got == nodes
        # None changed: nothing is sent.
        assert await conn.fetchval("SELECT gpulayer_notify_nodes('r1', '{}'::text[])") == 0
    finally:
        await listener.close()
        await conn.close()
