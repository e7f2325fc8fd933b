"""The web service's one copy of the fleet: placement's API asked once per interval for every
viewer together (woken early by job events, never faster than ``min_gap_s``), a job's details
asked at most once per interval however many pages show it, and the devices' observations kept
for the node charts. Pages read only from here, so N viewers cost placement nothing more than one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from gpulayer_contracts.health import NodeObservations
from gpulayer_contracts.subjects import API_EXPLAIN, API_JOB, API_JOBS, API_NODES, API_QUOTA

log = logging.getLogger(__name__)

# Items asked per request: a node's capabilities are a few kB, a job's row a few hundred bytes.
NODES_PAGE = 100
JOBS_PAGE = 1000

# (API subject, request body) -> the reply's data; raises on no answer or a refusal.
Ask = Callable[[str, dict[str, Any]], Awaitable[Any]]
# (job id, owner) -> the job's stored events as plain dicts (``type``, ``at``, ...).
History = Callable[[str, str], Awaitable[list[dict[str, Any]]]]


class Snapshot:
    """What the last refresh read, and when; ``error``: why the last refresh failed (the data is
    then the last good one)."""

    __slots__ = ("at", "error", "jobs", "nodes", "quotas", "version")

    def __init__(self) -> None:
        self.nodes: list[dict[str, Any]] = []
        self.jobs: list[dict[str, Any]] = []
        self.quotas: list[dict[str, Any]] | None = None
        self.at: datetime | None = None
        self.error: str | None = None
        self.version = 0


class JobDetail:
    """A job's record (env values already dropped), its explanation and its events."""

    __slots__ = ("error", "events", "explain", "record")

    def __init__(
        self,
        record: dict[str, Any] | None,
        explain: dict[str, Any] | None,
        events: list[dict[str, Any]],
        error: str | None = None,
    ) -> None:
        self.record = record
        self.explain = explain
        self.events = events
        self.error = error


def without_env_values(record: dict[str, Any]) -> dict[str, Any]:
    """The record with its request's env reduced to the names: the page never shows a value,
    whoever the API took the caller for (with auth off it is the anonymous, all-seeing one)."""
    request = record.get("request")
    if isinstance(request, dict) and "env" in request:
        env = request["env"]
        names = sorted(str(k) for k in env) if isinstance(env, dict) else []
        record = {**record, "request": {**request, "env": names}}
    return record


class FleetCache:
    def __init__(
        self,
        ask: Ask,
        history: History,
        *,
        interval_s: float = 2.0,
        jobs_limit: int = 1000,
        min_gap_s: float = 0.25,
        history_s: float = 600.0,
        max_details: int = 256,
    ) -> None:
        self.ask = ask
        self.history = history
        self.interval_s = interval_s
        self.jobs_limit = jobs_limit
        self.min_gap_s = min_gap_s
        self.history_s = history_s
        self.max_details = max_details
        self.snapshot = Snapshot()
        self.asks = 0  # API requests made so far (what viewers cost placement)
        self._wake = asyncio.Event()
        self._fresh = asyncio.Event()
        self._details: OrderedDict[str, tuple[float, asyncio.Task[JobDetail]]] = OrderedDict()
        self._observed: dict[str, deque[NodeObservations]] = {}

    async def _ask(self, subject: str, body: dict[str, Any]) -> Any:
        self.asks += 1
        return await self.ask(subject, body)

    async def refresh(self) -> None:
        """Read nodes, recent and waiting jobs, and quotas once; keep the last good data when
        placement doesn't answer, saying why."""
        snap = self.snapshot
        try:
            nodes = await self._pages(API_NODES, {}, NODES_PAGE, None)
            recent = await self._pages(API_JOBS, {}, JOBS_PAGE, self.jobs_limit)
            waiting = await self._pages(API_JOBS, {"state": "pending"}, JOBS_PAGE, self.jobs_limit)
            try:
                quotas = await self._ask(API_QUOTA, {"op": "list"})
            except Exception as err:  # an older placement refuses non-admins: no quotas shown
                log.debug("quotas not read: %s", err)
                quotas = None
        except Exception as err:
            snap.error = f"placement did not answer: {err}"
            snap.version += 1
            return
        seen = {j["job_id"] for j in recent}
        jobs = recent + [j for j in waiting if j["job_id"] not in seen]
        jobs.sort(key=lambda j: str(j.get("submitted_at") or ""), reverse=True)
        snap.nodes, snap.jobs, snap.quotas = list(nodes), jobs, quotas
        snap.at, snap.error = datetime.now(UTC), None
        snap.version += 1
        self._fresh.set()

    async def _pages(
        self, subject: str, body: dict[str, Any], page: int, most: int | None
    ) -> list[dict[str, Any]]:
        """Every item, a page per request: one reply holds ~1 MB, and placement cuts a longer
        list, so a page may come back shorter than asked and only an empty one ends the list.
        Items seen already are skipped (new jobs shift the pages between two requests); a page
        of nothing new ends it too (a placement that pages nothing answers the same list)."""
        key = "node_id" if subject == API_NODES else "job_id"
        items: list[dict[str, Any]] = []
        seen: set[Any] = set()
        offset = 0
        while most is None or len(items) < most:
            size = page if most is None else min(page, most - len(items))
            got = await self._ask(subject, {**body, "offset": offset, "limit": size})
            fresh = [i for i in got or [] if i.get(key) not in seen]
            if not fresh:
                break
            offset += len(got)
            seen.update(i.get(key) for i in fresh)
            items.extend(fresh)
        return items[:most]

    def wake(self) -> None:
        """Something changed (a job event): refresh soon rather than at the next interval."""
        self._wake.set()

    async def wait_fresh(self) -> None:
        """Until one refresh has succeeded (tests and the first page)."""
        await self._fresh.wait()

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            started = time.monotonic()
            self._wake.clear()
            await self.refresh()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(_first(self._wake, stop), self.interval_s)
            # Many events at once (an array of jobs ending) still make one refresh per gap.
            gap = self.min_gap_s - (time.monotonic() - started)
            if gap > 0 and not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), gap)

    def observe(self, obs: NodeObservations) -> None:
        """Keep a node's observations of the last ``history_s`` seconds (the node chart)."""
        ring = self._observed.setdefault(obs.node_id, deque(maxlen=720))
        ring.append(obs)
        horizon = obs.observed_at.timestamp() - self.history_s
        while ring and ring[0].observed_at.timestamp() < horizon:
            ring.popleft()

    def observations(self, node_id: str) -> list[NodeObservations]:
        return list(self._observed.get(node_id, ()))

    async def job(self, job_id: str) -> JobDetail:
        """A job's details, read at most once per interval for all viewers (one request in
        flight is shared)."""
        now = time.monotonic()
        entry = self._details.get(job_id)
        if entry is None or (now - entry[0] > self.interval_s and entry[1].done()):
            entry = (now, asyncio.ensure_future(self._read_job(job_id)))
            self._details[job_id] = entry
        self._details.move_to_end(job_id)
        while len(self._details) > self.max_details:
            _, (_, old) = self._details.popitem(last=False)
            if not old.done():
                old.cancel()
        return await asyncio.shield(entry[1])

    async def _read_job(self, job_id: str) -> JobDetail:
        try:
            record = without_env_values(await self._ask(API_JOB, {"job_id": job_id}))
        except Exception as err:
            return JobDetail(None, None, [], error=str(err))
        explain: dict[str, Any] | None = None
        if record.get("state") not in ("succeeded", "failed", "cancelled", "lost"):
            try:
                explain = await self._ask(API_EXPLAIN, {"job_id": job_id})
            except Exception as err:
                log.debug("explain %s: %s", job_id, err)
        try:
            events = await self.history(job_id, str(record.get("owner") or "anonymous"))
        except Exception as err:
            return JobDetail(record, explain, [], error=f"events not read: {err}")
        return JobDetail(record, explain, events)


async def _first(*events: asyncio.Event) -> None:
    """Until any of ``events`` is set."""
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
