"""What happens when a job's attempt ends: a retry, a service's restart, or the end for good.

Called by the parts that end attempts (executor status, the reaping of silent nodes) inside the
transaction that ended them, so a crash never leaves a job ended that should wait again:

- A job with ``retries`` left goes back to ``pending`` when ``lost``, and when ``failed`` with
  ``retry_on_failure``.
- A service goes back to ``pending`` when its process ends (``always``: whatever the exit;
  ``on-failure``: not after exit code 0), not before its backoff (``backoff_s`` doubled per
  restart so far, capped at ``max_backoff_s``); when lost with its node, at once. Only
  ``gpulayer cancel`` (``stop_requested``, or the executor's ``cancelled``) stops it.

A requeued job is placed again through the scheduler like any waiting job: that keeps one rule
for exactly-once (the next placement is attempt + 1, a new grant id, and an executor starts a
grant id at most once), releases its devices and reservations with the attempt's end, and lets a
service whose node is gone land anywhere that fits; one that still fits where it ran goes back
there (the scheduler offers its last node first). Jobs that ended for good release their
dependents (``dependencies.release``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import msgspec

from gpulayer_contracts import JobEvent, Requeued, Restart
from gpulayer_contracts.subjects import ANONYMOUS
from gpulayer_placement import dependencies, gang_status
from gpulayer_placement.publisher import Publisher
from gpulayer_placement.store import Store
from gpulayer_placement.wake import Wake

log = logging.getLogger("gpulayer_placement.service")

# An apply_status or lose_node_jobs row (an asyncpg Record, a dict in unit tests).
Row = Mapping[str, Any] | asyncpg.Record

# 2**60 times any backoff is past every cap: the doubling stops there.
_MAX_DOUBLINGS = 60


class Policy(msgspec.Struct, frozen=True):
    """The ``lifecycle`` column of apply_status / lose_node_jobs: the request's lifecycle fields
    and the job's row."""

    kind: str = "job"
    retries: int | None = 0
    retry_on_failure: bool | None = False
    restart: Restart | None = None
    requeues: int = 0
    stop_requested: bool = False


_policy = msgspec.json.Decoder(Policy)


@dataclass(frozen=True)
class Requeue:
    job_id: str
    reason: str
    not_before: datetime | None
    event: Requeued


def backoff_s(restart: Restart, restarts_so_far: int) -> float:
    """The wait before a service's next restart: ``backoff_s`` doubled per restart so far,
    at most ``max_backoff_s``."""
    return float(
        min(restart.max_backoff_s, restart.backoff_s * 2 ** min(restarts_so_far, _MAX_DOUBLINGS))
    )


def plan(row: Row, now: datetime) -> Requeue | None:
    """Pure: whether the job of ``row`` (job_id, node_id, state, owner, reason, lifecycle),
    whose attempt just ended, waits again, and why; None when its end is final."""
    state, text = str(row.get("state")), row.get("lifecycle")
    if text is None or state in ("running", "cancelled"):
        return None
    policy = _policy.decode(text)
    if policy.stop_requested:
        return None
    count = policy.requeues + 1
    ended = f"{state}: {row['reason']}" if row.get("reason") else state
    not_before = None
    if policy.kind == "service":
        restart = policy.restart or Restart()
        if state == "succeeded" and restart.policy == "on-failure":
            return None
        reason = f"restart {count} of the service after it {ended}"
        if state != "lost":  # a lost node is no crash loop: re-placed at once
            wait = backoff_s(restart, policy.requeues)
            not_before = now + timedelta(seconds=wait) if wait > 0 else None
            reason += f"; not before {wait:g}s" if wait > 0 else ""
    else:
        retries = policy.retries or 0
        retried = state == "lost" or (state == "failed" and policy.retry_on_failure)
        if not retried or policy.requeues >= retries:
            return None
        reason = f"retry {count} of {retries} after the job {ended}"
    event = Requeued(
        job_id=row["job_id"],
        owner=row.get("owner") or ANONYMOUS,
        node_id=row.get("node_id"),
        ended=state,
        reason=reason,
        requeues=count,
        not_before=not_before,
    )
    return Requeue(row["job_id"], reason, not_before, event)


@dataclass
class Settled:
    """What ``settle`` did in the caller's transaction, to announce once it commits."""

    requeued: list[Requeue] = field(default_factory=list)
    # Released dependents; those it cancelled are announced from the outbox.
    unblocked: list[str] = field(default_factory=list)
    # Distributed jobs whose ranks decided their state (gang_status).
    gangs: gang_status.GangSettled = field(default_factory=gang_status.GangSettled)

    def events(self) -> list[JobEvent]:
        return [r.event for r in self.requeued]


class Lifecycle:
    """Requeues and dependency releases after attempts end; announces them after commit."""

    def __init__(
        self, *, publisher: Publisher | None, wake: Wake, prefer: dict[str, str] | None = None
    ) -> None:
        self.publisher = publisher
        self.wake = wake
        # The scheduler's: a restarted service's last node, offered to it first.
        self.prefer = prefer if prefer is not None else {}
        self._timers: set[asyncio.TimerHandle] = set()

    async def settle(self, conn: Any, rows: Iterable[Row]) -> Settled:
        """For the ended attempts in ``rows`` (one per job; ``running`` ones are skipped): requeue
        what waits again, release the dependents of what ended for good. On ``conn``, in the
        caller's transaction."""
        out = Settled()
        rows = list(rows)
        out.gangs = await gang_status.settle(conn, rows)
        # ``pending``: a preempted job its executor stopped, already waiting again (queue
        # policy requeues it in apply_status): not an end, for retries or for its dependents.
        ended = {r["job_id"]: r for r in rows if r.get("state") not in ("running", "pending")}
        now = datetime.now(UTC)
        plans = [p for r in ended.values() if (p := plan(r, now)) is not None]
        if plans:
            done = await Store.fetch(
                conn,
                "requeue_jobs",
                [p.job_id for p in plans],
                [p.reason for p in plans],
                [p.not_before for p in plans],
            )
            requeued = {r["job_id"] for r in done}
            out.requeued = [p for p in plans if p.job_id in requeued]
        again = {p.job_id for p in out.requeued}
        final = [
            (j, r["state"]) for j, r in ended.items() if j not in again and r.get("has_dependents")
        ]
        if final:
            out.unblocked = await dependencies.release(conn, final)
        return out

    async def announce(self, settled: Settled) -> None:
        """After commit: the events, the scheduler woken for what may be placed now, and a
        timer for each restart's backoff."""
        if settled.unblocked or settled.gangs.unblocked:
            self.wake.jobs([*settled.unblocked, *settled.gangs.unblocked])
        if settled.requeued:
            self.wake.capacity()
        loop = asyncio.get_running_loop()
        now = datetime.now(UTC)
        for r in settled.requeued:
            log.info("job %s waits again: %s", r.job_id, r.reason)
            if r.event.ended != "lost" and r.event.node_id is not None:
                self.prefer[r.job_id] = r.event.node_id
            if r.not_before is not None:
                delay = max((r.not_before - now).total_seconds(), 0.0) + 0.05
                self._timers.add(loop.call_later(delay, self._backoff_over))
        events = settled.events()
        if events and self.publisher is not None:
            await self.publisher.publish_events(events)
        await self._announce_gangs(settled.gangs)

    async def _announce_gangs(self, gangs: gang_status.GangSettled) -> None:
        """A distributed job's state change, once (named by job and state), and the signed
        cancels of the ranks still running when it ended."""
        if self.publisher is None or not (gangs.events or gangs.cancels):
            return
        pub = self.publisher
        items = [
            pub.event_item(e, f"{e.job_id}:{type(e).__struct_config__.tag}") for e in gangs.events
        ]
        items += [pub.cancel_item(node, cancel) for node, cancel in gangs.cancels]
        for e in gangs.events:
            log.info("distributed job %s: %s", e.job_id, type(e).__struct_config__.tag)
        if not await pub.publish(items):
            log.warning("distributed jobs' events or rank cancels not all sent")

    def _backoff_over(self) -> None:
        now = asyncio.get_running_loop().time()
        self._timers = {t for t in self._timers if t.when() > now}
        self.wake.capacity()

    def close(self) -> None:
        for timer in self._timers:
            timer.cancel()
        self._timers.clear()
