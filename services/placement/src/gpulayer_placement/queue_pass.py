"""A pass over the waiting queue (the scheduler's full and thorough passes): each waiting
owner's first jobs when two or more owners wait, then the queue's pages, highest priority and
oldest first. A pass after a release reads a small first page (RELEASE_FIRST_PAGE) and stops
once nothing can fit; a thorough pass reads at most THOROUGH_MAX_PAGES pages.

The queue's pages are oldest first, and the queue policy orders each batch by fair share: one
owner's long queue would keep every other owner's jobs off the first page, whatever their fair
share. Each waiting owner's first jobs, least recent use first, come before the pages, so fair
share holds over the whole queue (``waiting.take_heads``).
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import asyncpg

from gpulayer_matching import NoPlacement
from gpulayer_placement import waiting
from gpulayer_placement.policy import Policy
from gpulayer_placement.settings import Settings
from gpulayer_placement.wake import Wake

# How often the owners with a waiting job are read again, seconds: an owner that stopped
# waiting is dropped then; one that starts is added as soon as a pass leaves its job waiting.
OWNERS_READ_S = 5.0
# Each waiting owner's first jobs a pass takes before the queue's pages, at most.
HEADS_PER_OWNER = 8
# The pages a thorough pass reads at most (100,000 jobs at the default page size). Past them, a
# waiting job's stored reason is refreshed once it comes nearer the head; a pass after a release
# still goes as deep as a free device's fit takes it. A queue of 900,000 jobs is 900 pages,
# read every 30 s, and a release's pass waits behind the pass in progress (c1m, issue 49).
THOROUGH_MAX_PAGES = 100
# The first page of a pass after a release, at most (later pages are full): the few devices a
# release frees mostly go to the queue's first jobs, and a full page of 1,000 rows locked and
# passed over for them was most of such a pass's cost (docs/performance.md, "The first page
# after a release"). A pass whose first page fits nothing goes on to full pages, in the same
# order: one round trip more.
RELEASE_FIRST_PAGE = 64


class Scheduling(Protocol):
    """What a pass needs of the scheduler (``scheduler.Scheduler``)."""

    settings: Settings
    wake: Wake
    stop: asyncio.Event
    pool: asyncpg.Pool
    policy: Policy
    owners: WaitingOwners

    def full(self) -> bool: ...

    def schedule_batch(
        self,
        take: Callable[[Any], Awaitable[list[asyncpg.Record]]],
        failed: dict[bytes, NoPlacement],
        *,
        skim: bool = False,
    ) -> Awaitable[tuple[waiting.Cursor, int] | None]: ...


class WaitingOwners:
    """The owners with a waiting job: as last read (every OWNERS_READ_S), plus any a pass has
    seen waiting since."""

    def __init__(self) -> None:
        self.owners: set[str] = set()
        self.read_at = -math.inf

    def seen(self, owner: str) -> None:
        self.owners.add(owner)

    async def heads(
        self, pool: asyncpg.Pool, policy: Policy, page_size: int
    ) -> functools.partial[Any] | None:
        """The take of each waiting owner's first jobs, least recent use first and a page's
        worth shared among them; None with fewer than two owners waiting."""
        if time.monotonic() - self.read_at > OWNERS_READ_S:
            async with pool.acquire() as conn:
                owners = await waiting.waiting_owners(conn, page_size)
            self.owners, self.read_at = set(owners), time.monotonic()
        if len(self.owners) < 2:
            return None
        ordered = sorted(self.owners, key=lambda o: (policy.usage(o), policy.gpus_held(o), o))
        ordered = ordered[:page_size]
        per_owner = max(1, min(HEADS_PER_OWNER, page_size // len(ordered)))
        return functools.partial(waiting.take_heads, owners=ordered, per_owner=per_owner)


async def walk(s: Scheduling, *, early_stop: bool) -> None:
    """Each waiting owner's first jobs, then pages of waiting jobs, oldest first. When capacity
    grew between pages (a release), ``failed`` is stale, and skipping equal jobs to the queue's
    end reads it for nothing: an early-stop pass starts again from the head, once (at every
    change, it could never get past the first page under steady releases)."""
    after = waiting.START
    failed: dict[bytes, NoPlacement] = {}
    page_size = s.settings.page_size
    first = min(page_size, RELEASE_FIRST_PAGE) if early_stop else page_size
    size = first
    epoch, restarted = s.wake.epoch, False
    heads = await s.owners.heads(s.pool, s.policy, page_size)
    if heads is not None:
        took = await s.schedule_batch(heads, failed, skim=early_stop) is not None
        if took and early_stop and s.full():
            return
    pages = 0
    while not s.stop.is_set():
        take = functools.partial(waiting.take_page, size=size, after=after)
        page = await s.schedule_batch(take, failed, skim=early_stop)
        if page is None:
            return
        after, taken = page
        if taken < size:
            return  # a short page was the last one: no extra round trip to learn that
        size = page_size
        pages += 1
        if not early_stop and pages >= THOROUGH_MAX_PAGES:
            return
        if early_stop and s.full():
            return
        if early_stop and not restarted and s.wake.epoch != epoch:
            after, failed, restarted, size = waiting.START, {}, True, first
