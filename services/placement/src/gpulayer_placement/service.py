"""The placement service: consumers, scheduler and side tasks around the pure matcher.

Loops (each a named task under one monitor):
- ``ingest``: job requests from the JOBS work queue, a batch at a time: decode once, validate,
  insert new ids in one statement (a known id is the same job) and, when no pass is due, match
  them in the same transaction; publish, then ack after commit.
- ``schedule``: waiting jobs oldest first when capacity may have changed, matched in memory,
  committed as one statement per batch (allocations + job rows), then grants and events
  published; a thorough pass every 30 s.
- ``capabilities`` / ``heartbeats``: node state into memory and PostgreSQL, batched.
- ``status``: executor reports: job rows updated, devices released, waiting jobs reconsidered.
- ``reaper``: nodes silent past the timeout go offline; their jobs are lost, devices released.
- ``resend``: grants of jobs still "placed" after a while are sent again (executors start a
  grant at most once), so a crash between commit and publish loses nothing.
- ``notify``: other replicas' allocation changes (PostgreSQL LISTEN).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import asyncpg
import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import FetchTimeoutError

from gpulayer_contracts import (
    Accepted,
    Grant,
    JobEvent,
    JobRequest,
    Lost,
    Pending,
    Placed,
    Rejected,
    encode,
    validate_job,
)
from gpulayer_contracts.codec import (
    InvalidInput,
    best_effort_job_id,
    capabilities_decoder,
    decode_job_json,
    heartbeat_decoder,
    job_request_decoder,
    status_decoder,
)
from gpulayer_contracts.subjects import (
    JOBS_SUBMIT,
    MSG_ID_HEADER,
    NODE_WILDCARD_CAPABILITIES,
    NODE_WILDCARD_HEARTBEAT,
    NODE_WILDCARD_STATUS,
    STREAMS,
    job_events,
    node_from_subject,
    node_grants,
)
from gpulayer_contracts.validation import requested_gpu_count, visibility_env
from gpulayer_matching import NoPlacement, Placement, match
from gpulayer_placement.fleet import Fleet
from gpulayer_placement.store import DB_ERRORS, Store, migrate
from gpulayer_runtime.logs import job_context
from gpulayer_runtime.telemetry import DISABLED, Telemetry, extract, inject

if TYPE_CHECKING:
    from opentelemetry.trace import Span

log = logging.getLogger(__name__)

NOTIFY_CHANNEL = "gpulayer_allocations"
# An event published again under its first message id is dropped by JetStream only within the
# stream's duplicate window; half of it leaves room for clock skew and slow passes.
_ANNOUNCE_AGAIN_WITHIN_S = next(s for s in STREAMS if s.name == "JOB_EVENTS").duplicate_window_s / 2
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


@dataclass(frozen=True, kw_only=True)
class Settings:
    node_timeout_s: float = 15.0
    resend_after_s: float = 30.0
    batch_size: int = 256
    page_size: int = 1000
    publish_timeout_s: float = 10.0
    thorough_pass_s: float = 30.0


@dataclass(frozen=True, slots=True)
class _Placed:
    job: JobRequest
    placement: Placement
    grant_id: str
    traceparent: str | None
    submitted: float  # epoch seconds the job entered the JOBS stream (or the table)
    match_ns: tuple[int, int]  # wall-clock start/end of matching, for the job's trace


@dataclass
class _Outcome:
    placements: list[_Placed] = field(default_factory=list)
    waiting: list[tuple[str, NoPlacement]] = field(default_factory=list)
    commit_ns: tuple[int, int] = (0, 0)


@dataclass
class _Wake:
    """What the scheduler should look at next."""

    new_jobs: list[str] = field(default_factory=list)
    capacity_changed: bool = False
    # A pass over every waiting job, without stopping early (periodic safety net).
    thorough: bool = False
    # Counts capacity changes, so work that ran beside one can tell it missed it.
    epoch: int = 0
    event: asyncio.Event = field(default_factory=asyncio.Event)

    def jobs(self, ids: list[str]) -> None:
        self.new_jobs.extend(ids)
        self.event.set()

    def capacity(self) -> None:
        self.capacity_changed = True
        self.epoch += 1
        self.event.set()


class PlacementService:
    def __init__(
        self,
        nc: Client,
        pool: asyncpg.Pool,
        settings: Settings | None = None,
        telemetry: Telemetry = DISABLED,
    ) -> None:
        self.nc = nc
        self.tel = telemetry
        # Tags this replica's allocation NOTIFYs, so it skips its own.
        self.replica_id = uuid.uuid4().hex[:12]
        self.js: JetStreamContext = nc.jetstream()
        self.pool = pool
        self.store = Store(pool)
        self.settings = settings or Settings()
        self.fleet = Fleet()
        self.stop = asyncio.Event()
        self.wake = _Wake()
        self._jobs: dict[str, JobRequest] = {}
        # JetStream publish time of jobs ingested here, for the submit-to-grant latency.
        self._submitted: dict[str, float] = {}
        self._gauges: dict[str, list[tuple[float, dict[str, Any]]]] = {}
        # Waiting jobs that need no device: a pass can't stop early while any is known.
        self._deviceless_waiting: set[str] = set()
        self._passing = False  # the scheduler task is in a pass
        self._resent: dict[str, str] = {}  # job id -> grant this replica re-sent (stored)
        # Jobs stored but whose accepted/rejected event failed to publish: said again first,
        # before any later event of theirs from this replica.
        self._unannounced: dict[str, JobEvent] = {}
        self._caps_queue: asyncio.Queue[Msg] = asyncio.Queue()
        self._heartbeats: dict[str, datetime] = {}
        self._notified: set[str] = set()
        self._listen_conn: Any = None
        self._relisten_task: asyncio.Task[None] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._subs: list[Any] = []
        self.placed_total = 0

    # --- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        async with self.pool.acquire() as conn:
            await migrate(conn)
            for row in await Store.fetch(conn, "load_nodes"):
                caps = capabilities_decoder.decode(row["capabilities"])
                self.fleet.upsert(caps, online=row["online"])
            rows = await Store.fetch(conn, "load_allocations")
            self.fleet.replace_holds((r["node_id"], r["device_index"], r["mode"]) for r in rows)
        await self._listen()
        self._subs.append(
            await self.js.subscribe(
                NODE_WILDCARD_CAPABILITIES,
                cb=self._on_capabilities,
                ordered_consumer=True,
                config=ConsumerConfig(deliver_policy=DeliverPolicy.LAST_PER_SUBJECT),
            )
        )
        self._subs.append(await self.nc.subscribe(NODE_WILDCARD_HEARTBEAT, cb=self._on_heartbeat))
        jobs = await self.js.pull_subscribe(
            JOBS_SUBMIT,
            durable="placement-jobs",
            config=ConsumerConfig(
                ack_policy=AckPolicy.EXPLICIT, ack_wait=30, max_ack_pending=20_000
            ),
        )
        status = await self.js.pull_subscribe(
            NODE_WILDCARD_STATUS,
            durable="placement-status",
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=30),
        )
        # Unsubscribed on close, or draining the connection would wait out its timeout.
        self._subs += [jobs, status]
        from gpulayer_placement.api import Api

        await Api(self).subscribe()
        self.wake.capacity()
        self._spawn("ingest", self._consume(jobs, self._ingest))
        self._spawn("status", self._consume(status, self._apply_status))
        self._spawn("schedule", self._schedule_loop())
        self._spawn("capabilities", self._capabilities_loop())
        self._spawn("heartbeats", self._heartbeat_loop())
        self._spawn("reaper", self._every(max(self.settings.node_timeout_s / 3, 0.2), self._reap))
        self._spawn("resend", self._every(max(self.settings.resend_after_s / 3, 0.5), self._resend))
        self._spawn("thorough", self._every(self.settings.thorough_pass_s, self._request_thorough))
        if self.tel.enabled:
            self._register_gauges()
            self._spawn("job-gauges", self._every(5.0, self._refresh_job_gauges))
        log.info("placement started with %d known nodes", len(self.fleet))

    def _spawn(self, name: str, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro, name=name)
        task.add_done_callback(self._task_done)
        self._tasks.append(task)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or self.stop.is_set():
            return
        err = task.exception()
        if err is not None:
            # A side task dying silently would leave the service half alive; stop it instead so
            # a supervisor restarts it.
            log.error("task %s crashed: %r; stopping", task.get_name(), err, exc_info=err)
            self.stop.set()

    async def close(self) -> None:
        self.stop.set()
        self.wake.event.set()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        if self._listen_conn is not None:
            conn, self._listen_conn = self._listen_conn, None
            with contextlib.suppress(Exception):
                await conn.remove_listener(NOTIFY_CHANNEL, self._on_notify)
            with contextlib.suppress(Exception):
                await self.pool.release(conn)
        if self._relisten_task is not None:
            self._relisten_task.cancel()

    async def _every(self, period: float, fn: Callable[[], Awaitable[None]]) -> None:
        while not self.stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), period)
            if self.stop.is_set():
                return
            try:
                await fn()
            except DB_ERRORS as err:
                log.warning("%s failed, will retry: %s", getattr(fn, "__name__", fn), err)

    async def _consume(
        self, sub: JetStreamContext.PullSubscription, handle: Callable[[list[Msg]], Awaitable[None]]
    ) -> None:
        while not self.stop.is_set():
            try:
                msgs = await sub.fetch(self.settings.batch_size, timeout=1.0)
            except (FetchTimeoutError, TimeoutError):
                continue
            try:
                await handle(msgs)
            except DB_ERRORS as err:
                # Not acked: JetStream redelivers after ack_wait; the handlers are idempotent.
                log.warning("batch of %d failed, will be redelivered: %s", len(msgs), err)
                for m in msgs:
                    with contextlib.suppress(Exception):
                        await m.nak(delay=1.0)

    # --- publishing ----------------------------------------------------------------------

    async def _publish(self, items: list[tuple[str, bytes, dict[str, str]]]) -> bool:
        """Pipelined JetStream publishes: every message is sent, then every ack awaited, instead
        of one round trip each. False (logged) when an ack didn't come: grants are re-sent by the
        ``resend`` loop; a lost event is only a gap in a job's history."""
        if not items:
            return True
        try:
            futures = [
                await self.js.publish_async(subj, data, headers=h) for subj, data, h in items
            ]
            await asyncio.wait_for(asyncio.gather(*futures), self.settings.publish_timeout_s)
        except Exception as err:
            log.warning("publishing %d messages failed: %r", len(items), err)
            return False
        return True

    @staticmethod
    def _event_item(
        event: JobEvent, msg_id: str | None = None
    ) -> tuple[str, bytes, dict[str, str]]:
        """``msg_id`` names an event that may be published again (a re-sent grant's ``placed``),
        so JetStream keeps one copy. A job is accepted or rejected once, so those events are
        named by the job; the others are unique by their time."""
        tag = type(event).__struct_config__.tag
        if msg_id is None:
            once = isinstance(event, Accepted | Rejected)
            msg_id = (
                f"{event.job_id}:{tag}" if once else f"{event.job_id}:{tag}:{event.at.timestamp()}"
            )
        headers = {MSG_ID_HEADER: msg_id}
        return job_events(event.job_id), encode(event), headers

    @staticmethod
    def _grant_item(
        grant: Grant, headers: dict[str, str] | None = None
    ) -> tuple[str, bytes, dict[str, str]]:
        h = {MSG_ID_HEADER: grant.grant_id}
        if headers:
            h.update(headers)
        return node_grants(grant.node_id), encode(grant), h

    def _placed_item(self, grant: Grant) -> tuple[str, bytes, dict[str, str]]:
        placed = Placed(
            job_id=grant.job.job_id,
            node_id=grant.node_id,
            accelerator=grant.accelerator,
            devices=grant.devices,
        )
        return self._event_item(placed, msg_id=f"{grant.grant_id}:placed")

    async def _publish_events(self, events: list[JobEvent]) -> bool:
        return await self._publish([self._event_item(e) for e in events])

    # --- ingest --------------------------------------------------------------------------

    async def _ingest(self, msgs: list[Msg]) -> None:
        rows: dict[str, tuple[str, str, str, str | None]] = {}
        accepted: dict[str, JobRequest] = {}
        warnings: dict[str, list[str]] = {}
        rejections: dict[str, list[str]] = {}
        origin: dict[str, Msg] = {}
        tel = self.tel.enabled
        for msg in msgs:
            traceparent = (msg.headers or {}).get("traceparent")
            if tel:
                meta = msg.metadata
                if meta.num_delivered and meta.num_delivered > 1:
                    self.tel.count(
                        "gpulayer.consumer.redeliveries", 1, {"consumer": "placement-jobs"}
                    )
            try:
                job = decode_job_json(msg.data)
            except InvalidInput as err:
                job_id = best_effort_job_id(msg.data)
                log.warning(
                    "rejected message on %s (job %s): %s",
                    msg.subject,
                    job_id,
                    err,
                    extra=job_context(job_id, traceparent=traceparent),
                )
                self.tel.count(
                    "gpulayer.messages.rejected", 1, {"subject": "jobs.submit", "why": "malformed"}
                )
                if job_id is not None and job_id not in rows:
                    origin[job_id] = msg
                    rejections[job_id] = [str(err)]
                    rows[job_id] = (
                        job_id,
                        msg.data.decode("utf-8", "replace"),
                        "rejected",
                        traceparent,
                    )
                continue
            if job.job_id in rows:
                continue  # the same id twice in one batch is one job
            origin[job.job_id] = msg
            result = validate_job(job)
            body = encode(job).decode()
            if result.errors:
                self.tel.count(
                    "gpulayer.messages.rejected", 1, {"subject": "jobs.submit", "why": "invalid"}
                )
                rejections[job.job_id] = result.errors
                rows[job.job_id] = (job.job_id, body, "rejected", traceparent)
            else:
                accepted[job.job_id] = job
                warnings[job.job_id] = result.warnings
                rows[job.job_id] = (job.job_id, body, "pending", traceparent)
                if tel:
                    self._submitted[job.job_id] = msg.metadata.timestamp.timestamp()
        new: set[str] = set()
        fresh: list[str] = []
        outcome: _Outcome | None = None
        epoch = 0
        if rows:
            ids, bodies, states, parents = zip(*rows.values(), strict=True)
            reasons = ["; ".join(rejections[i]) if i in rejections else None for i in ids]
            # A rejected body that isn't JSON is stored as a JSON string so the row still exists.
            bodies = tuple(
                b if s != "rejected" or _is_json(b) else encode(b).decode()
                for b, s in zip(bodies, states, strict=True)
            )
            try:
                async with self.pool.acquire() as conn, conn.transaction():
                    inserted = await Store.fetch(
                        conn, "insert_jobs", ids, bodies, states, reasons, parents
                    )
                    new = {r["job_id"] for r in inserted}
                    fresh = [j for j in accepted if j in new]
                    for job_id in fresh:
                        self._jobs[job_id] = accepted[job_id]
                    if fresh and self._scheduler_idle():
                        epoch = self.wake.epoch
                        outcome = await self._place_inline(conn, fresh)
            except BaseException:
                if outcome is not None:  # placed in memory, but nothing was committed
                    self._release(outcome)
                raise
        # Known jobs whose submit message came again after a failed publish or a crash before
        # the ack: their events may never have gone out, so they are said again under the same
        # message ids, if young enough for JetStream to drop a copy that did get out.
        again = await self._announce_again(
            [j for j in rows if j not in new and self._redelivered(origin[j])]
        )
        events: list[JobEvent] = []
        for job_id in rows:
            if job_id not in new and job_id not in again:
                log.info(
                    "job %s already known: not submitted again",
                    job_id,
                    extra=job_context(job_id, traceparent=rows[job_id][3]),
                )
                continue
            if job_id not in new:
                log.info(
                    "job %s redelivered: announcing it again",
                    job_id,
                    extra=job_context(job_id, traceparent=rows[job_id][3]),
                )
            if job_id in rejections:
                events.append(Rejected(job_id=job_id, reasons=rejections[job_id]))
            else:
                events.append(Accepted(job_id=job_id, warnings=warnings[job_id]))
        if outcome is not None:
            published = await self._publish_outcome(outcome, before=events)
        else:
            published = await self._publish_events(events)
        if published:
            for e in events:
                self._unannounced.pop(e.job_id, None)
            await asyncio.gather(*(m.ack() for m in msgs))
        else:
            # Stored, not announced: the redelivery announces it (grants: the resend loop), and
            # until then this replica puts the announcement before the job's next event.
            self._unannounced.update((e.job_id, e) for e in events)
            await asyncio.gather(*(m.nak(delay=1.0) for m in msgs), return_exceptions=True)
        if fresh and outcome is None:
            self.wake.jobs(fresh)
        elif outcome is not None and outcome.waiting and self.wake.epoch != epoch:
            # Capacity changed while these rows were locked by this transaction: a pass then
            # skipped them (SKIP LOCKED). Look again now that they are committed.
            self.wake.capacity()

    async def _announce_again(self, job_ids: list[str]) -> set[str]:
        if not job_ids:
            return set()
        async with self.pool.acquire() as conn:
            rows = await Store.fetch(conn, "job_ages", job_ids)
        return {r["job_id"] for r in rows if r["age_s"] < _ANNOUNCE_AGAIN_WITHIN_S}

    @staticmethod
    def _redelivered(msg: Msg) -> bool:
        try:
            return (msg.metadata.num_delivered or 1) > 1
        except Exception:  # not a JetStream message (no metadata): delivered once
            return False

    def _scheduler_idle(self) -> bool:
        """No pass running or due: new jobs can be matched where they are ingested without
        overtaking anything older (same rule as a pass over new jobs only)."""
        w = self.wake
        return not (self._passing or w.capacity_changed or w.thorough or w.new_jobs)

    async def _place_inline(self, conn: Any, job_ids: list[str]) -> _Outcome | None:
        """Match freshly inserted jobs in the ingest transaction: one commit per batch from
        submit to grant. None when another replica took a device first (the jobs then go to
        the scheduler as usual)."""
        outcome = _Outcome()
        try:
            async with conn.transaction():  # a savepoint: a conflict undoes only this part
                rows = await Store.fetch(conn, "take_jobs", job_ids)
                self._match_rows(rows, {}, outcome)
                t0 = time.time_ns()
                await self._persist(conn, outcome)
            outcome.commit_ns = (t0, time.time_ns())
        except asyncpg.ExclusionViolationError:
            self._release(outcome)
            log.info("allocation conflict with another replica; reloading allocations")
            await self._reload_allocations(None)
            return None
        except BaseException:
            self._release(outcome)
            raise
        return outcome

    def _release(self, outcome: _Outcome) -> None:
        """Give back in memory what an uncommitted outcome held."""
        for pl in outcome.placements:
            self.fleet.release(pl.placement.node_id, pl.placement.devices, _mode(pl.placement))
        outcome.placements.clear()

    # --- scheduling ----------------------------------------------------------------------

    async def _schedule_loop(self) -> None:
        while not self.stop.is_set():
            await self.wake.event.wait()
            self.wake.event.clear()
            if self.stop.is_set():
                return
            new, self.wake.new_jobs = self.wake.new_jobs, []
            full, self.wake.capacity_changed = self.wake.capacity_changed, False
            thorough, self.wake.thorough = self.wake.thorough, False
            self._passing = True
            try:
                if full or thorough:
                    await self._schedule_all(early_stop=not thorough)
                elif new:
                    for i in range(0, len(new), self.settings.batch_size):
                        await self._schedule_ids(new[i : i + self.settings.batch_size])
            except asyncpg.ExclusionViolationError:
                # Another replica took a device this one thought free: reload and go again.
                log.info("allocation conflict with another replica; reloading allocations")
                await self._reload_allocations(None)
                self.wake.capacity()
            except DB_ERRORS as err:
                log.warning("scheduling pass failed, retrying: %s", err)
                self.wake.jobs(new)
                if full or thorough:
                    self.wake.capacity()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), 0.5)
            finally:
                self._passing = False

    async def _schedule_all(self, *, early_stop: bool = True) -> None:
        """Every waiting job, oldest first, a page at a time.

        With ``early_stop``, paging ends once no device in the fleet is free and no waiting job
        that needs none is known: the jobs behind can't fit, and scanning them on every release
        would cost a page of rows each time. The periodic thorough pass never stops early."""
        after: tuple[datetime, str] = (_EPOCH, "")
        failed: dict[bytes, NoPlacement] = {}
        while not self.stop.is_set():
            page = await self._schedule_batch(
                "take_pending", (self.settings.page_size, *after), failed
            )
            if page is None:
                return
            after, taken = page
            if taken < self.settings.page_size:
                return  # a short page was the last one: no extra round trip to learn that
            if early_stop and not self._deviceless_waiting and not self.fleet.any_free_device():
                return

    async def _schedule_ids(self, ids: list[str]) -> None:
        await self._schedule_batch("take_jobs", (ids,), {})

    async def _schedule_batch(
        self, query: str, args: tuple[Any, ...], failed: dict[bytes, NoPlacement]
    ) -> tuple[tuple[datetime, str], int] | None:
        """Lock a batch of waiting jobs, match them, commit the outcome in one transaction, then
        publish grants and events. Returns the batch's last (submitted_at, job_id) and size."""
        outcome = _Outcome()
        try:
            async with self.pool.acquire() as conn, conn.transaction():
                rows = await Store.fetch(conn, query, *args)
                if not rows:
                    return None
                self._match_rows(rows, failed, outcome)
                t0 = time.time_ns()
                await self._persist(conn, outcome)
            outcome.commit_ns = (t0, time.time_ns())
        except BaseException:
            self._release(outcome)  # nothing was committed
            raise
        await self._publish_outcome(outcome)
        return (rows[-1]["submitted_at"], rows[-1]["job_id"]), len(rows)

    def _match_rows(
        self, rows: list[asyncpg.Record], failed: dict[bytes, NoPlacement], outcome: _Outcome
    ) -> None:
        """``failed`` remembers requirement sets that found no node in this pass: capacity only
        shrinks during a pass, so an equal job behind them can't fit either."""
        for row in rows:
            job_id = row["job_id"]
            job = self._jobs.get(job_id)
            if job is None:
                job = job_request_decoder.decode(row["request"])
                self._jobs[job_id] = job
            key = _requirement_key(job)
            tel = self.tel.enabled
            t0 = time.time_ns() if tel else 0
            decision = failed.get(key) or match(job, self.fleet.rotated())
            if tel:
                t1 = time.time_ns()
                self.tel.record("gpulayer.placement.decision.duration", (t1 - t0) / 1e9)
            else:
                t1 = 0
            if isinstance(decision, Placement):
                self._deviceless_waiting.discard(job_id)
                submitted = self._submitted.pop(job_id, None) or row["submitted_at"].timestamp()
                outcome.placements.append(
                    _Placed(
                        job=job,
                        placement=decision,
                        grant_id=f"{job_id}-{row['attempt'] + 1}",
                        traceparent=row["traceparent"],
                        submitted=submitted,
                        match_ns=(t0, t1),
                    )
                )
                # Held at once, so later jobs of this batch see the devices taken.
                self.fleet.hold(decision.node_id, decision.devices, _mode(decision))
            else:
                failed[key] = decision
                if requested_gpu_count(job) == 0:
                    self._deviceless_waiting.add(job_id)
                if decision.summary != row["reason"]:
                    outcome.waiting.append((job_id, decision))

    async def _persist(self, conn: Any, outcome: _Outcome) -> None:
        if outcome.placements:
            alloc: tuple[list[str], list[str], list[int], list[str]] = ([], [], [], [])
            for pl in outcome.placements:
                for d in pl.placement.devices:
                    alloc[0].append(pl.job.job_id)
                    alloc[1].append(pl.placement.node_id)
                    alloc[2].append(d)
                    alloc[3].append(_mode(pl.placement))
            ps = outcome.placements
            await Store.execute(
                conn,
                "place_jobs",
                [pl.job.job_id for pl in ps],
                [pl.placement.node_id for pl in ps],
                [pl.grant_id for pl in ps],
                [pl.placement.accelerator for pl in ps],
                ["{" + ",".join(map(str, pl.placement.devices)) + "}" for pl in ps],
                *alloc,
                self.replica_id,
            )
        if outcome.waiting:
            await Store.execute(
                conn,
                "mark_waiting",
                [j for j, _ in outcome.waiting],
                [d.summary for _, d in outcome.waiting],
                [d.unsatisfiable for _, d in outcome.waiting],
            )

    async def _publish_outcome(self, outcome: _Outcome, before: Sequence[JobEvent] = ()) -> bool:
        """Events of ``before`` (e.g. ``accepted``), then the outcome's events, then its grants,
        in one pipelined batch. False when some message was not stored."""
        grants = [
            _grant(
                pl.job,
                pl.placement.node_id,
                pl.grant_id,
                pl.placement.accelerator,
                pl.placement.devices,
            )
            for pl in outcome.placements
        ]
        waiting: list[JobEvent] = [
            Pending(job_id=j, summary=d.summary, reasons=d.reasons, unsatisfiable=d.unsatisfiable)
            for j, d in outcome.waiting
        ]
        # Events first: a user watching the job sees "placed" before the executor's "running".
        owed = [
            self._unannounced[j]
            for j in (
                *(pl.job.job_id for pl in outcome.placements),
                *(j for j, _ in outcome.waiting),
            )
            if j in self._unannounced
        ]
        items = [self._event_item(e) for e in (*owed, *before)]
        items += [self._placed_item(g) for g in grants]
        items += [self._event_item(e) for e in waiting]
        if not self.tel.enabled:
            # No spans here, but the submitter's context still travels on to the executor.
            items += [
                self._grant_item(g, {"traceparent": pl.traceparent} if pl.traceparent else None)
                for pl, g in zip(outcome.placements, grants, strict=True)
            ]
            published = await self._publish(items)
        else:
            spans = [
                self._job_span(pl, g, outcome.commit_ns)
                for pl, g in zip(outcome.placements, grants, strict=True)
            ]
            items += [
                self._grant_item(g, inject({}, span)) for g, span in zip(grants, spans, strict=True)
            ]
            sent_ns = time.time_ns()
            published = await self._publish(items)
            self._end_job_spans(spans, outcome, grants, sent_ns)
        self.placed_total += len(grants)
        if published:
            for e in owed:
                self._unannounced.pop(e.job_id, None)
        return published

    def _job_span(self, pl: _Placed, grant: Grant, commit_ns: tuple[int, int]) -> Span:
        """The job's placement span, under the submitter's trace when it sent one.

        The batch's steps happened before the span could be opened, so it and its children are
        recorded with their measured start and end times."""
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind

        tracer = self.tel.tracer
        attrs: dict[str, Any] = {
            "messaging.system": "nats",
            "messaging.destination.name": node_grants(grant.node_id),
            "gpulayer.job.id": grant.job.job_id,
            "gpulayer.node.id": grant.node_id,
            "gpulayer.accelerator": grant.accelerator,
            "gpulayer.devices": grant.devices,
        }
        parent = extract({"traceparent": pl.traceparent}) if pl.traceparent else None
        root = tracer.start_span(
            "placement place",
            context=parent,
            kind=SpanKind.CONSUMER,
            attributes=attrs,
            start_time=pl.match_ns[0],
        )
        ctx = trace.set_span_in_context(root)
        tracer.start_span("placement match", context=ctx, start_time=pl.match_ns[0]).end(
            end_time=pl.match_ns[1]
        )
        tracer.start_span("placement commit", context=ctx, start_time=commit_ns[0]).end(
            end_time=commit_ns[1]
        )
        return root

    def _end_job_spans(
        self, spans: list[Span], outcome: _Outcome, grants: list[Grant], sent_ns: int
    ) -> None:
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind

        acked_ns = time.time_ns()
        now = time.time()
        for root, pl, grant in zip(spans, outcome.placements, grants, strict=True):
            ctx = trace.set_span_in_context(root)
            self.tel.tracer.start_span(
                "placement publish grant", context=ctx, kind=SpanKind.PRODUCER, start_time=sent_ns
            ).end(end_time=acked_ns)
            root.end(end_time=acked_ns)
            self.tel.record(
                "gpulayer.placement.submit_to_grant.duration", max(now - pl.submitted, 0.0)
            )
            self.tel.count("gpulayer.placement.placed", 1, {"accelerator": grant.accelerator})

    # --- metrics -------------------------------------------------------------------------

    def _register_gauges(self) -> None:
        def nodes() -> list[tuple[float, dict[str, Any]]]:
            counts: dict[tuple[str, str, str], int] = {}
            for v in self.fleet.views():
                accs = {
                    d.accelerator for d in v.capabilities.accelerators if d.execution_supported
                } or {"cpu"}
                for acc in accs:
                    key = (
                        "online" if v.online else "offline",
                        acc,
                        v.capabilities.host.platform or "unknown",
                    )
                    counts[key] = counts.get(key, 0) + 1
            return [
                (n, {"state": k[0], "accelerator": k[1], "platform": k[2]})
                for k, n in counts.items()
            ]

        def devices() -> list[tuple[float, dict[str, Any]]]:
            counts: dict[tuple[str, str, str], int] = {}
            for v in self.fleet.views():
                for d in v.capabilities.accelerators:
                    if not d.execution_supported:
                        continue
                    state = "allocated" if d.index in v.exclusive or d.index in v.shared else "free"
                    key = (state, d.accelerator, v.node_id)
                    counts[key] = counts.get(key, 0) + 1
            return [
                (n, {"state": k[0], "accelerator": k[1], "node_id": k[2]})
                for k, n in counts.items()
            ]

        self.tel.gauge("gpulayer.nodes", nodes)
        self.tel.gauge("gpulayer.devices", devices)
        self.tel.gauge("gpulayer.jobs", lambda: self._gauges.get("jobs", []))
        self.tel.gauge("gpulayer.jobs.pending", lambda: self._gauges.get("pending", []))

    async def _refresh_job_gauges(self) -> None:
        async with self.pool.acquire() as conn:
            states = await Store.fetch(conn, "job_counts")
            pending = await Store.fetch(conn, "pending_counts")
        self._gauges["jobs"] = [(r["n"], {"state": r["state"]}) for r in states]
        self._gauges["pending"] = [
            (r["n"], {"reason": "unsatisfiable" if r["unsatisfiable"] else "waiting for capacity"})
            for r in pending
        ]

    # --- status --------------------------------------------------------------------------

    async def _apply_status(self, msgs: list[Msg]) -> None:
        latest: dict[tuple[str, str], tuple[str, str, str, str, int | None, str | None]] = {}
        for msg in msgs:
            if self.tel.enabled and (msg.metadata.num_delivered or 0) > 1:
                self.tel.count(
                    "gpulayer.consumer.redeliveries", 1, {"consumer": "placement-status"}
                )
            try:
                status = status_decoder.decode(msg.data)
                node = node_from_subject(msg.subject)
            except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as err:
                log.warning("rejected status message on %s: %s", msg.subject, err)
                self.tel.count(
                    "gpulayer.messages.rejected", 1, {"subject": "node.status", "why": "malformed"}
                )
                continue
            if status.node_id != node:
                log.warning(
                    "status for node %s arrived on %s; using the subject", status.node_id, node
                )
            key = (status.job_id, status.grant_id)
            # "running" never replaces a final state reported in the same batch.
            if key in latest and status.state == "running":
                continue
            latest[key] = (
                status.job_id,
                status.grant_id,
                node,  # identity from the subject: a node can only report its own jobs
                status.state,
                status.exit_code,
                status.reason,
            )
        if latest:
            rows = list(latest.values())
            async with self.pool.acquire() as conn:
                changed = await Store.fetch(
                    conn,
                    "apply_status",
                    *[list(col) for col in zip(*rows, strict=True)],
                    self.replica_id,
                )
            finished = sorted({r["job_id"] for r in changed if r["state"] != "running"})
            for r in changed:
                if r["device_index"] is not None:
                    self.fleet.release(r["node_id"], [r["device_index"]], r["mode"])
            for job_id in finished:
                self.forget(job_id)
            if finished:
                self.wake.capacity()
        await asyncio.gather(*(m.ack() for m in msgs))

    # --- nodes ---------------------------------------------------------------------------

    async def _on_capabilities(self, msg: Msg) -> None:
        await self._caps_queue.put(msg)

    async def _capabilities_loop(self) -> None:
        while not self.stop.is_set():
            first = await self._caps_queue.get()
            batch = [first]
            while not self._caps_queue.empty() and len(batch) < 2000:
                batch.append(self._caps_queue.get_nowait())
            latest: dict[str, Any] = {}
            for msg in batch:
                try:
                    node = node_from_subject(msg.subject)
                    caps = capabilities_decoder.decode(msg.data)
                except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as err:
                    log.warning("rejected capabilities on %s: %s", msg.subject, err)
                    continue
                if caps.node_id != node:
                    # Identity comes from the subject the node may publish on, never the payload.
                    caps = msgspec.structs.replace(caps, node_id=node)
                latest[node] = caps
            if not latest:
                continue
            caps_list = list(latest.values())
            try:
                async with self.pool.acquire() as conn:
                    await Store.execute(
                        conn,
                        "upsert_nodes",
                        [c.node_id for c in caps_list],
                        [encode(c).decode() for c in caps_list],
                        [c.host.platform for c in caps_list],
                        [c.agent_version for c in caps_list],
                        [c.detected_at for c in caps_list],
                    )
            except DB_ERRORS as err:
                log.warning("storing %d capability events failed: %s", len(caps_list), err)
            changed = [self.fleet.upsert(c) for c in caps_list]
            if any(changed):
                self.wake.capacity()

    async def _on_heartbeat(self, msg: Msg) -> None:
        try:
            node = node_from_subject(msg.subject)
        except ValueError:
            return
        if b"executor" in msg.data and self._executor_beat(msg.data):
            if self.fleet.executor_beat(node):
                log.info("the executor on node %s is back", node, extra=job_context(node_id=node))
                self.wake.capacity()
            return
        self._heartbeats[node] = datetime.now(UTC)
        if self.fleet.set_online(node, True):
            log.info("node %s is back online", node, extra=job_context(node_id=node))
            self.wake.capacity()

    def _executor_beat(self, data: bytes) -> bool:
        try:
            return heartbeat_decoder.decode(data).source == "executor"
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            self.tel.count(
                "gpulayer.messages.rejected", 1, {"subject": "node.heartbeat", "why": "malformed"}
            )
            log.debug("malformed heartbeat counted as the node's: %s", err)
            return False

    async def _heartbeat_loop(self) -> None:
        """Writes last-seen times once a second: one statement for all heartbeats."""
        while not self.stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), 1.0)
            if not self._heartbeats:
                continue
            beats, self._heartbeats = self._heartbeats, {}
            try:
                async with self.pool.acquire() as conn:
                    await Store.execute(conn, "touch_nodes", list(beats), list(beats.values()))
            except DB_ERRORS as err:
                log.warning("storing heartbeats failed: %s", err)

    async def _reap(self) -> None:
        for node in self.fleet.stale_executors(self.settings.node_timeout_s):
            # Nothing is lost: its grants wait in JetStream for the executor to come back. New
            # jobs go elsewhere meanwhile.
            self.fleet.set_executor_down(node)
            log.warning(
                "the executor on node %s stopped sending heartbeats for %gs; no new grants there",
                node,
                self.settings.node_timeout_s,
                extra=job_context(node_id=node),
            )
        stale = self.fleet.stale(self.settings.node_timeout_s)
        if not stale:
            return
        reason = f"node stopped sending heartbeats for {self.settings.node_timeout_s:g}s"
        async with self.pool.acquire() as conn, conn.transaction():
            await Store.fetch(conn, "set_offline", stale)
            lost = await Store.fetch(conn, "lose_node_jobs", stale, reason)
            if lost:
                await conn.execute(
                    "SELECT pg_notify($1, $2)",
                    NOTIFY_CHANNEL,
                    f"{self.replica_id}|{','.join(stale)}",
                )
        for node in stale:
            self.fleet.set_online(node, False)
            log.warning("node %s is offline: %s", node, reason, extra=job_context(node_id=node))
        await self._reload_allocations(stale)
        await self._publish_events(
            [Lost(job_id=r["job_id"], node_id=r["node_id"], reason=reason) for r in lost]
        )
        if lost:
            self.wake.capacity()

    def forget(self, job_id: str) -> None:
        """Drop what this replica keeps in memory about a job that has ended."""
        self._resent.pop(job_id, None)
        self._unannounced.pop(job_id, None)
        self._jobs.pop(job_id, None)
        self._submitted.pop(job_id, None)
        self._deviceless_waiting.discard(job_id)

    async def _request_thorough(self) -> None:
        self.wake.thorough = True
        self.wake.event.set()

    async def _resend(self) -> None:
        """Grants of jobs still ``placed`` after the resend delay go out once more, with the
        job's ``accepted`` and ``placed`` events: if placement died between commit and publish
        they never went out; copies that did are dropped by JetStream (same message ids) or
        recognised by the executor. Once one resend is stored, this replica doesn't repeat it:
        GRANTS keeps it until the executor takes it (a job may wait there for a free slot, or
        for its executor to come back), and repeating would only pile up copies."""
        async with self.pool.acquire() as conn:
            rows = await Store.fetch(conn, "stale_placed", self.settings.resend_after_s)
            if rows:
                await Store.execute(conn, "touch_jobs", [r["job_id"] for r in rows])
        for r in rows:
            if self._resent.get(r["job_id"]) == r["grant_id"]:
                continue
            job = job_request_decoder.decode(r["request"])
            log.info(
                "re-sending grant %s of job %s to %s",
                r["grant_id"],
                r["job_id"],
                r["node_id"],
                extra=job_context(r["job_id"], r["node_id"], r["traceparent"]),
            )
            grant = _grant(job, r["node_id"], r["grant_id"], r["accelerator"], list(r["devices"]))
            items = [
                self._placed_item(grant),
                self._grant_item(
                    grant, {"traceparent": r["traceparent"]} if r["traceparent"] else None
                ),
            ]
            if r["age_s"] < _ANNOUNCE_AGAIN_WITHIN_S:
                # Placed where it was ingested, so its "accepted" went out (or not) with this
                # grant; only a copy this young is sure to be dropped if it was stored before.
                accepted = Accepted(job_id=job.job_id, warnings=validate_job(job).warnings)
                items.insert(0, self._event_item(accepted))
            if await self._publish(items):
                self._resent[grant.job.job_id] = grant.grant_id

    # --- other replicas ------------------------------------------------------------------

    async def _listen(self) -> None:
        conn = await self.pool.acquire()
        try:
            await conn.add_listener(NOTIFY_CHANNEL, self._on_notify)
        except BaseException:
            await self.pool.release(conn)
            raise
        conn.add_termination_listener(self._on_listen_lost)
        self._listen_conn = conn

    def _on_listen_lost(self, conn: object) -> None:
        """The LISTEN connection died (a database restart): listen again on a new one."""
        if conn is not self._listen_conn or self.stop.is_set():
            return
        self._listen_conn = None
        log.warning("lost the connection listening for other replicas' changes; listening again")
        self._relisten_task = asyncio.get_running_loop().create_task(self._relisten(conn))

    async def _relisten(self, dead: Any) -> None:
        with contextlib.suppress(Exception):
            await self.pool.release(dead)
        delay = 0.2
        listening = False
        while not self.stop.is_set():
            try:
                if not listening:
                    await self._listen()
                    listening = True
                # What other replicas announced meanwhile was missed: reload and look again.
                await self._reload_allocations(None)
                log.info("listening for other replicas' changes again")
                await self._request_thorough()
                return
            except DB_ERRORS as err:
                log.warning("listening again failed, retrying: %s", err)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), delay)
                delay = min(delay * 2, 5.0)

    def _on_notify(self, conn: object, pid: int, channel: str, payload: object) -> None:
        replica, _, nodes = str(payload).partition("|")
        if replica == self.replica_id:
            return  # this replica's own change, already applied in memory
        self._notified.update(n for n in nodes.split(",") if n)
        asyncio.get_running_loop().create_task(self._apply_notified())

    async def _apply_notified(self) -> None:
        nodes, self._notified = sorted(self._notified), set()
        if nodes:
            await self._reload_allocations(nodes)
            self.wake.capacity()

    async def _reload_allocations(self, nodes: list[str] | None) -> None:
        async with self.pool.acquire() as conn:
            if nodes is None:
                rows = await Store.fetch(conn, "load_allocations")
            else:
                rows = await Store.fetch(conn, "load_node_allocations", nodes)
        self.fleet.replace_holds(
            ((r["node_id"], r["device_index"], r["mode"]) for r in rows), nodes
        )


def _is_json(text: str) -> bool:
    try:
        msgspec.json.decode(text)
    except msgspec.DecodeError:
        return False
    return True


def _mode(p: Placement) -> str:
    return "shared" if p.use == "shared" else "exclusive"


def _requirement_key(job: JobRequest) -> bytes:
    return encode((job.requirements, job.gpu, job.variants, job.distributed, job.sandbox))


def _grant(
    job: JobRequest, node_id: str, grant_id: str, accelerator: Any, devices: list[int]
) -> Grant:
    return Grant(
        grant_id=grant_id,
        job=job,
        node_id=node_id,
        accelerator=accelerator,
        devices=devices,
        visible_env=visibility_env(accelerator, devices, job.sandbox.devices.gpu == "compute"),
    )
