"""Which waiting jobs a scheduling batch takes, and the order it matches them in: highest
priority first, then oldest (the queue policy then orders each batch by fair share), locked
``FOR UPDATE SKIP LOCKED`` so that replicas split them. The scheduler (and intake's
inline placement) take waiting jobs from here and nowhere else."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import asyncpg

from gpulayer_placement.store import Store

# (-priority, submitted_at, job_id) of the last job a page held
Cursor = tuple[int, datetime, str]
START: Cursor = (-(2**31), datetime(1970, 1, 1, tzinfo=UTC), "")


async def take_page(conn: Any, size: int, after: Cursor) -> list[asyncpg.Record]:
    """Up to ``size`` waiting jobs after ``after``, locked, in matching order."""
    return await Store.fetch(conn, "take_pending", size, *after)


async def take_ids(conn: Any, ids: list[str]) -> list[asyncpg.Record]:
    """The waiting jobs among ``ids``, locked, in matching order."""
    return await Store.fetch(conn, "take_jobs", ids)


def last(rows: list[asyncpg.Record]) -> Cursor:
    """Where the page after ``rows`` starts."""
    last = rows[-1]
    return -(last.get("priority") or 0), last["submitted_at"], last["job_id"]
