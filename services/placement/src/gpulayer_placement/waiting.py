"""Which waiting jobs a scheduling batch takes, and the order it matches them in: highest
priority first, then oldest (the queue policy then orders each batch by fair share), locked
``FOR UPDATE SKIP LOCKED`` so that replicas split them. A pass over the queue takes each
waiting owner's first jobs before its pages (``take_heads``), so that fair share holds over
the whole queue. The scheduler (and intake's inline placement) take waiting jobs from here and
nowhere else."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, TypeVar

import asyncpg

from gpulayer_placement.store import Store
from gpulayer_placement.wake import Wake

T = TypeVar("T")

# (-priority, submitted_at, job_id) of the last job a page held
Cursor = tuple[int, datetime, str]
START: Cursor = (-(2**31), datetime(1970, 1, 1, tzinfo=UTC), "")


async def take_page(conn: Any, size: int, after: Cursor) -> list[asyncpg.Record]:
    """Up to ``size`` waiting jobs after ``after``, locked, in matching order."""
    return await Store.fetch(conn, "take_pending", size, *after)


async def waiting_owners(conn: Any, most: int) -> list[str]:
    """The owners with a waiting job, at most ``most``."""
    return [r["owner"] for r in await Store.fetch(conn, "waiting_owners", most)]


async def take_heads(conn: Any, owners: list[str], per_owner: int) -> list[asyncpg.Record]:
    """Each of ``owners``' first ``per_owner`` waiting jobs, locked, in matching order, less any
    that a job left behind could outrank (``heads_cut``)."""
    return heads_cut(await Store.fetch(conn, "take_heads", owners, per_owner), per_owner)


def heads_cut(rows: Sequence[Any], per_owner: int) -> list[Any]:
    """``rows`` (each owner's first jobs, highest priority first) without those of a priority
    below a job left behind: an owner with ``per_owner`` rows taken may have more waiting, at
    most at the priority of its last one taken. Matching a lower job first could take the
    device that one needed."""
    taken: dict[str, int] = {}
    lowest: dict[str, int] = {}
    for r in rows:
        owner = r["owner"]
        taken[owner] = taken.get(owner, 0) + 1
        lowest[owner] = r["priority"] or 0  # rows come highest priority first
    behind = [lowest[o] for o, n in taken.items() if n >= per_owner]
    if not behind:
        return list(rows)
    floor = max(behind)
    return [r for r in rows if (r["priority"] or 0) >= floor]


async def take_ids(conn: Any, ids: list[str]) -> list[asyncpg.Record]:
    """The waiting jobs among ``ids``, locked, in matching order."""
    return await Store.fetch(conn, "take_jobs", ids)


async def take_new(conn: Any, ids: list[str], wake: Wake, epoch: int) -> list[asyncpg.Record]:
    """``take_ids`` for a pass over new jobs only (begun at capacity ``epoch``): none when
    capacity changed while they were taken (a node joined). The full pass that change queued
    matches them in order with the older waiting jobs, which matching them now would overtake."""
    rows = await take_ids(conn, ids)
    return rows if wake.epoch == epoch else []


async def requests_for(
    conn: Any, rows: Sequence[asyncpg.Record], known: Mapping[str, T]
) -> tuple[dict[str, str], dict[str, T]]:
    """The stored requests of a page's jobs that ``known`` (the scheduler's decoded ones)
    lacks: a page carries none (``take_pending``). One query, only when needed: after a start,
    or for jobs another replica took in. With them, what ``known`` held of the page's other
    jobs before the query: an end applied while it is awaited may forget one of them (a
    retried or restarted job, ended and already waiting again in this page), which the caller
    puts back (a job's request never changes; the page's rows are locked pending)."""
    if not rows or rows[0].get("request") is not None:  # take_ids: the rows carry theirs
        return {}, {}
    unknown = [job_id for r in rows if (job_id := r["job_id"]) not in known]
    if not unknown:
        return {}, {}  # nothing awaited: nothing can be forgotten meanwhile
    held = {job_id: known[job_id] for r in rows if (job_id := r["job_id"]) in known}
    texts = await Store.fetch(conn, "job_requests", unknown)
    return {r["job_id"]: r["request"] for r in texts}, held


def request_text(row: Any, requests: Mapping[str, str] | None) -> str:
    """A row's stored request: its own column (``take_ids``), else from ``requests_for``."""
    text: str | None = row.get("request") or (requests or {}).get(row["job_id"])
    if text is None:
        raise ValueError("its stored request is gone")
    return text


def last(rows: list[asyncpg.Record]) -> Cursor:
    """Where the page after ``rows`` starts."""
    last = rows[-1]
    return -(last.get("priority") or 0), last["submitted_at"], last["job_id"]
