"""The scheduler's page of waiting jobs (``take_pending``), on a real PostgreSQL: which rows it
takes, in which order, and that a page costs what the page holds, not the whole queue, even
when the table's statistics were taken with no job waiting."""

from __future__ import annotations

import json

import asyncpg
import pytest

from gpulayer_placement import waiting
from gpulayer_placement.store import migrate

pytestmark = pytest.mark.integration

QUEUE = 5_000
PAGE = 10


async def _insert_queue(conn: asyncpg.Connection) -> None:
    request = json.dumps({"job_id": "x", "command": ["true"]})
    await conn.execute(
        "INSERT INTO jobs (job_id, request, state, owner, submitted_at)"
        " SELECT 'q' || lpad(g::text, 5, '0'), $1::jsonb, 'pending', 'alice',"
        "        '2026-01-01'::timestamptz + g * interval '1 second'"
        " FROM generate_series(1, $2) g",
        request,
        QUEUE,
    )


async def test_a_page_is_the_queue_head_in_order_without_what_may_not_run_yet(
    database_url: str,
) -> None:
    conn = await asyncpg.connect(database_url)
    other = await asyncpg.connect(database_url)
    third = await asyncpg.connect(database_url)
    try:
        await migrate(conn)
        await _insert_queue(conn)
        # Ahead of the queue: an urgent job, one blocked by a dependency, one in a restart's
        # backoff, one held by another replica's pass (locked), one already placed.
        await conn.execute(
            "INSERT INTO jobs (job_id, request, state, owner, priority, blocked, not_before,"
            " submitted_at) VALUES"
            " ('urgent', '{}', 'pending', 'bob', 5, false, NULL, '2026-02-01'),"
            " ('blocked', '{}', 'pending', 'bob', 9, true, NULL, '2025-01-01'),"
            " ('backoff', '{}', 'pending', 'bob', 9, false, now() + interval '1 hour',"
            "  '2025-01-01'),"
            " ('taken', '{}', 'pending', 'bob', 9, false, NULL, '2025-01-01'),"
            " ('placed', '{}', 'placed', 'bob', 9, false, NULL, '2025-01-01')"
        )
        async with other.transaction():
            await other.execute("SELECT 1 FROM jobs WHERE job_id = 'taken' FOR UPDATE")
            async with conn.transaction():
                page = await waiting.take_page(conn, PAGE, waiting.START)
                ids = [r["job_id"] for r in page]
                assert ids == ["urgent", *[f"q{i:05d}" for i in range(1, PAGE)]]
                # The page's rows are locked: another pass skips them.
                async with third.transaction():
                    again = await waiting.take_page(third, 3, waiting.START)
                    assert [r["job_id"] for r in again] == [f"q{i:05d}" for i in range(10, 13)]
                # The next page starts after the last one's last row.
                after = await waiting.take_page(conn, 2, waiting.last(page))
                assert [r["job_id"] for r in after] == ["q00010", "q00011"]
    finally:
        await third.close()
        await other.close()
        await conn.close()


async def test_a_page_reads_the_page_not_the_queue_behind_statistics_of_an_empty_table(
    database_url: str,
) -> None:
    # Left to the planner, statistics taken with no job waiting made it scan and sort every
    # waiting job for each page (47 ms against 1 ms a page with 20,000 waiting).
    conn = await asyncpg.connect(database_url)
    try:
        await migrate(conn)
        await conn.execute("ANALYZE jobs")  # what a quiet install's autovacuum leaves
        await _insert_queue(conn)
        heap_pages = await conn.fetchval(
            "SELECT pg_relation_size('jobs') / current_setting('block_size')::int"
        )
        explain = (
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)"
            " SELECT * FROM gpulayer_take_pending($1, $2, $3, $4)"
        )
        for _ in range(2):  # the second: planned already (the first reads the catalogs)
            async with conn.transaction():
                plan = await conn.fetchval(explain, PAGE, *waiting.START)
        top = json.loads(plan)[0]["Plan"]
        assert top["Actual Rows"] == PAGE
        touched = top["Shared Hit Blocks"] + top["Shared Read Blocks"]
        # The ordered walk touches a few index pages and the page's rows (a few heap pages,
        # each row locked); scanning the queue would touch every one of its heap pages.
        assert heap_pages > 40, heap_pages
        assert touched < heap_pages // 3, (touched, heap_pages)
        # The function's settings stay in the function.
        assert await conn.fetchval("SHOW enable_bitmapscan") == "on"
        assert await conn.fetchval("SHOW enable_sort") == "on"
    finally:
        await conn.close()
