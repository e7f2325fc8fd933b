"""The fault run's check of placement's holds (tests/faults/holds.py), on a real PostgreSQL: it
finds nothing in a consistent state, and names each kind of drift it exists to find."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest
from tests.faults.holds import HoldsWatch, drift

from gpulayer_placement.store import migrate

pytestmark = pytest.mark.integration


async def test_the_holds_check_names_each_count_that_is_not_what_its_jobs_hold(
    database_url: str,
) -> None:
    conn = await asyncpg.connect(database_url)
    try:
        await migrate(conn)
        await conn.execute(
            "INSERT INTO jobs (job_id, request, state, node_id, owner)"
            " VALUES ('p', '{}', 'placed', 'n', 'ada')"
        )
        await conn.execute(
            "INSERT INTO allocations (job_id, node_id, device_index, mode)"
            " VALUES ('p', 'n', 0, 'exclusive')"
        )
        await conn.execute(
            "INSERT INTO reservations (job_id, node_id, resource, amount, capacity)"
            " VALUES ('p', 'n', 'slots', 1, 4)"
        )
        await conn.execute(
            "INSERT INTO owner_holds (job_id, owner, accelerator, gpus, millicores)"
            " VALUES ('p', 'ada', 'cuda', 1, 500)"
        )
        assert await drift(conn) == ([], 1)  # the triggers kept every count; one device held

        await conn.execute("UPDATE node_resources SET used = 2")
        await conn.execute("UPDATE owner_usage SET used = 0 WHERE resource = 'cores'")
        assert (await drift(conn))[0] == [
            "node n, slots: counted 2, its reservations sum to 1",
            "owner ada, cores: counted 0, their holds sum to 500",
        ]

        await conn.execute("UPDATE node_resources SET used = 1")
        await conn.execute("UPDATE owner_usage SET used = 500 WHERE resource = 'cores'")
        await conn.execute("UPDATE jobs SET state = 'succeeded'")  # ended, its holds kept
        assert (await drift(conn))[0] == [
            "job p (succeeded) still holds device 0 on n",
            "job p (succeeded) still holds its owner's quota",
            "job p (succeeded) still holds slots on n",
        ]

        # The watch keeps each problem once, however many looks find it.
        watch = HoldsWatch(database_url)
        await watch.look(conn)
        await watch.look(conn)
        assert (watch.looks, watch.most_held) == (2, 1)
        assert len(watch.problems) == 3
    finally:
        await conn.close()


async def test_a_watch_that_died_says_why_when_it_is_left(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure the watch doesn't pass over (not PostgreSQL away) ends it; leaving the block
    raises it rather than passing with the looks it made before."""

    async def broken(self: HoldsWatch, conn: asyncpg.Connection) -> None:
        raise ValueError("the check itself is broken")

    async def watch_until_it_ends() -> None:
        async with HoldsWatch(database_url, every_s=0.01) as watch:
            assert watch._task is not None
            await asyncio.wait([watch._task])  # it ends by itself

    monkeypatch.setattr(HoldsWatch, "look", broken)
    with pytest.raises(ValueError, match="the check itself is broken"):
        await watch_until_it_ends()
