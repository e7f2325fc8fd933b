"""The fault run's look at placement's holds in PostgreSQL, in one snapshot at a time.

What a node is counted as using (``node_resources.used``) and what an owner is
(``owner_usage.used``) are kept by triggers, and their release clamps at zero
(``greatest(used - amount, 0)``): an under-count would be hidden there, and an over-count would
keep capacity from every later job. So the run looks at both against the holds they sum (the
reservations, the owner holds), and at holds kept by a job no longer placed or running, while
the faults happen (every second, through PostgreSQL's restart) and once all jobs have ended.
"""

from __future__ import annotations

import asyncio
import contextlib
from types import TracebackType

import asyncpg

# Each row: one problem, said in words. Every hold is counted once per (node | owner, resource);
# FULL JOINs so a count with no holds and holds with no count both show.
DRIFT = """
SELECT format('node %s, %s: counted %s, its reservations sum to %s',
              coalesce(n.node_id, r.node_id), coalesce(n.resource, r.resource),
              coalesce(n.used, 0), coalesce(r.amount, 0))
FROM node_resources n
FULL JOIN (SELECT node_id, resource, sum(amount) AS amount FROM reservations GROUP BY 1, 2) r
    ON r.node_id = n.node_id AND r.resource = n.resource
WHERE coalesce(n.used, 0) <> coalesce(r.amount, 0)
UNION ALL
SELECT format('owner %s, %s: counted %s, their holds sum to %s',
              coalesce(u.owner, h.owner), coalesce(u.resource, h.resource),
              coalesce(u.used, 0), coalesce(h.amount, 0))
FROM owner_usage u
FULL JOIN (
    SELECT owner, resource, sum(amount) AS amount FROM (
        SELECT owner, 'jobs' AS resource, 1::bigint AS amount FROM owner_holds
        UNION ALL SELECT owner, 'cores', millicores FROM owner_holds
        UNION ALL SELECT owner, 'gpus:' || accelerator, gpus FROM owner_holds
            WHERE gpus > 0 AND accelerator IS NOT NULL
    ) each GROUP BY 1, 2
) h ON h.owner = u.owner AND h.resource = u.resource
WHERE coalesce(u.used, 0) <> coalesce(h.amount, 0)
UNION ALL
SELECT format('job %s (%s) still holds %s', j.job_id, j.state, held.what)
FROM (
    SELECT job_id, 'device ' || device_index || ' on ' || node_id AS what FROM allocations
    UNION ALL SELECT job_id, resource || ' on ' || node_id FROM reservations
    UNION ALL SELECT job_id, 'its owner''s quota' FROM owner_holds
) held
JOIN jobs j USING (job_id)
WHERE j.state NOT IN ('placed', 'running')
ORDER BY 1
"""


async def drift(conn: asyncpg.Connection) -> tuple[list[str], int]:
    """The problems in one consistent snapshot of the holds (none: an empty list), and how many
    devices were held in it."""
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        problems = [str(row[0]) for row in await conn.fetch(DRIFT)]
        return problems, await conn.fetchval("SELECT count(*) FROM allocations")


class HoldsWatch:
    """Looks at the holds every ``every_s`` while entered; a look that fails (PostgreSQL
    restarting) is passed over and the connection made again. ``problems``: each found, once,
    in the order found; ``looks``: how many looks succeeded; ``most_held``: the most devices
    held in one look (the looks saw the run's holds, not only its quiet ends)."""

    def __init__(self, db: str, every_s: float = 1.0) -> None:
        self.db = db
        self.every_s = every_s
        self.problems: list[str] = []
        self.looks = 0
        self.most_held = 0
        self._task: asyncio.Task[None] | None = None

    async def look(self, conn: asyncpg.Connection) -> None:
        problems, held = await drift(conn)
        self.problems += [p for p in problems if p not in self.problems]
        self.most_held = max(self.most_held, held)
        self.looks += 1

    async def _watch(self) -> None:
        conn: asyncpg.Connection | None = None
        try:
            while True:
                try:
                    if conn is None or conn.is_closed():
                        conn = await asyncpg.connect(self.db, timeout=5)
                    await self.look(conn)
                except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError):
                    if conn is not None:  # PostgreSQL restarting: look again on a new connection
                        conn.terminate()
                    conn = None
                await asyncio.sleep(self.every_s)  # a sample: there is no event to wait for
        finally:
            if conn is not None:
                with contextlib.suppress(Exception):
                    await conn.close(timeout=2)

    async def __aenter__(self) -> HoldsWatch:
        self._task = asyncio.create_task(self._watch())
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
