"""The statements that apply executors' reports, on a real PostgreSQL."""

from __future__ import annotations

import asyncpg
import pytest

from gpulayer_placement.store import Store, migrate

pytestmark = pytest.mark.integration


async def test_running_reports_of_single_jobs_commit_without_waiting_for_the_disk(
    database_url: str,
) -> None:
    """``apply_running`` marks placed single jobs running, leaves ranks of a distributed job,
    stale grants and repeated reports to ``apply_status``, and turns synchronous commit off for
    its own transaction only: a pooled connection keeps no session state."""
    conn = await asyncpg.connect(database_url)
    try:
        await migrate(conn)
        rows = [
            ("single", "g-single", "placed", None),
            ("gang", "g-gang", "placed", None),
            ("rank", "g-rank", "placed", "gang"),
            ("again", "g-again", "running", None),
            ("stale", "g-new", "placed", None),
        ]
        for job_id, grant_id, state, gang_id in rows:
            await conn.execute(
                "INSERT INTO jobs (job_id, request, state, grant_id, node_id, gang_id)"
                " VALUES ($1, '{}', $2, $3, 'n', $4)",
                job_id,
                state,
                grant_id,
                gang_id,
            )
        reports = [("single", "g-single"), ("rank", "g-rank"), ("again", "g-again")]
        reports += [("stale", "g-old"), ("unknown", "g-x")]
        # The test server runs with it off (fast tests); a production server has it on.
        await conn.execute("SET synchronous_commit = on")
        async with conn.transaction():
            done = await Store.fetch(
                conn,
                "apply_running",
                [j for j, _ in reports],
                [g for _, g in reports],
                ["n"] * len(reports),
                [None] * len(reports),
                [None] * len(reports),
            )
            assert await conn.fetchval("SHOW synchronous_commit") == "off"
        assert await conn.fetchval("SHOW synchronous_commit") == "on"
        assert [(r["job_id"], r["grant_id"]) for r in done] == [("single", "g-single")]
        states = {
            r["job_id"]: r["state"] for r in await conn.fetch("SELECT job_id, state FROM jobs")
        }
        assert states == {
            "single": "running",
            "gang": "placed",
            "rank": "placed",
            "again": "running",
            "stale": "placed",
        }
        # A report for another node never applies, whatever its ids.
        await conn.execute("UPDATE jobs SET state = 'placed' WHERE job_id = 'single'")
        forged = await Store.fetch(
            conn, "apply_running", ["single"], ["g-single"], ["other"], [None], [None]
        )
        assert forged == []
    finally:
        await conn.close()
