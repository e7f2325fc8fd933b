"""Intake: job requests from the JOBS work queue, a batch at a time, two while a backlog lasts.

Each batch is decoded once and validated, folded by job id (``submits.read_batch``), and its
new ids inserted in one statement (a known id is the same job). When the scheduler is idle the
new jobs are matched in that same transaction; otherwise the scheduler is woken for them. Then
``accepted`` / ``rejected`` (and any placement) go out pipelined, and the batch is acked after
commit, or nak'ed when the announcements were not stored. With two batches in flight, the
later one's insert overlaps the earlier one's matching and commit, and its matching the earlier
one's announcements; batches are matched in the order fetched.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import asyncpg
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig

from gpulayer_contracts import Accepted, JobEvent, Rejected
from gpulayer_contracts.bounds import clip_text
from gpulayer_contracts.subjects import ANONYMOUS, JOBS_SUBMIT_ALL
from gpulayer_placement import dependencies
from gpulayer_placement.audit import Auditor
from gpulayer_placement.dead_letters import MAX_DELIVER, DeadLetters
from gpulayer_placement.limits import submit_limit
from gpulayer_placement.loops import Unpublished, consume
from gpulayer_placement.outcome import Outcome
from gpulayer_placement.publisher import ANNOUNCE_AGAIN_WITHIN_S, Publisher
from gpulayer_placement.scheduler import Scheduler
from gpulayer_placement.settings import Settings
from gpulayer_placement.store import DATA_ERRORS, Store
from gpulayer_placement.submits import Batch, read_batch, stored_text
from gpulayer_placement.wake import Wake
from gpulayer_runtime.logs import job_context
from gpulayer_runtime.telemetry import DISABLED, Telemetry

# The name every placement part logs under since before the split: log queries filter on it.
log = logging.getLogger("gpulayer_placement.service")

# Batches handled at once while a backlog lasts (``loops.consume``: after a full batch): the
# next one is fetched, decoded and inserted while the last one is matched and committed, and
# matched (in fetch order) while the last one's announcements wait for their acks. The stages
# wait on NATS and PostgreSQL in turn; one batch at a time left the 2-core bench machine half
# idle with 5,000 jobs queued.
BATCHES_IN_FLIGHT = 2


@dataclass
class Stored:
    """What the insert found: ids that were new, the accepted ones among them, and what was
    placed inline. ``epoch``: the wake's capacity count when the transaction began; ``locked``:
    it locked waiting rows other than its own (the dependencies it checked, FOR SHARE), which a
    pass running beside it skipped (SKIP LOCKED)."""

    new: set[str] = field(default_factory=set)
    fresh: list[str] = field(default_factory=list)
    outcome: Outcome | None = None
    epoch: int = 0
    locked: bool = False
    # The scheduler's pass count, and whether one was running, when the transaction began.
    passes: int = 0
    passing: bool = False
    announced: bool = False  # its accepted/rejected events were stored


class Intake:
    def __init__(
        self,
        *,
        js: JetStreamContext,
        pool: asyncpg.Pool,
        scheduler: Scheduler,
        publisher: Publisher,
        wake: Wake,
        settings: Settings,
        stop: asyncio.Event,
        telemetry: Telemetry = DISABLED,
        dead: DeadLetters | None = None,
        max_payload: int = 1 << 20,
        auditor: Auditor | None = None,
    ) -> None:
        self.auditor = auditor
        self.js = js
        self.pool = pool
        self.scheduler = scheduler
        self.publisher = publisher
        self.wake = wake
        self.settings = settings
        self.stop = stop
        self.tel = telemetry
        # Its telemetry given once (bench/strip_telemetry rewrites each ``self.tel`` use).
        self.limit = submit_limit(settings.submit_rate, settings.submit_burst, settings.admins)
        self._read = functools.partial(read_batch, telemetry=telemetry, limit=self.limit.check)
        self.dead = dead if dead is not None else DeadLetters(js, telemetry, max_payload)
        # The server's, from its INFO: a job whose grant would not fit it is refused.
        self.max_payload = max_payload
        # Jobs a batch stored (committed) before it failed: not announced by it. The same
        # messages come back on their first delivery still (handle_batch retries a failed
        # batch one message at a time) and must announce them, not take them for known jobs
        # submitted again (the fault run found such a job with no ``accepted`` event).
        self._unannounced: set[str] = set()
        # Set when the batch fetched last has committed (or failed): the next one may check
        # dependencies on it and match. Its insert may overlap that batch's matching.
        self._turn = asyncio.Event()
        self._turn.set()
        # Batches whose new jobs are stored but not yet handed to the scheduler (that waits
        # for their announcements): a later batch must not place its jobs inline before them.
        self._unwoken = 0

    async def subscribe(self) -> JetStreamContext.PullSubscription:
        """The durable pull consumer on the JOBS work queue, every owner's submit subject."""
        config = ConsumerConfig(
            name="placement-jobs",
            durable_name="placement-jobs",
            filter_subject=JOBS_SUBMIT_ALL,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=30,
            max_ack_pending=20_000,
            max_deliver=MAX_DELIVER,
        )
        # Created or updated: a consumer made by an earlier version filtered on the bare
        # subject only, and had no delivery limit.
        await self.js.add_consumer("JOBS", config)
        return await self.js.pull_subscribe_bind("placement-jobs", stream="JOBS")

    async def run(self, sub: JetStreamContext.PullSubscription) -> None:
        """Ingest batches from ``sub`` until the service stops."""
        await consume(
            self.stop,
            sub,
            self.settings.batch_size,
            self.ingest,
            self.dead,
            in_flight=BATCHES_IN_FLIGHT,
        )

    async def ingest(self, msgs: list[Msg]) -> None:
        """Store, announce and (when the scheduler is idle) place one batch, then ack it. With
        two batches in flight, the later one's insert overlaps the earlier one's matching and
        commit, and its matching and commit the earlier one's announcements; its dependencies
        are checked and its jobs matched only once the earlier one has committed."""
        batch = self.read(msgs)
        before, mine = self._turn, asyncio.Event()
        self._turn = mine
        unwoken = False
        try:
            stored = await self._store(batch, before)
            unwoken = bool(stored.fresh) and stored.outcome is None
            self._unwoken += unwoken
        finally:
            mine.set()
        try:
            await self._announce_and_ack(msgs, batch, stored)
        except BaseException:
            if not stored.announced:
                self._unannounced.update(stored.new)
            raise
        finally:
            self._unwoken -= unwoken

    async def _announce_and_ack(self, msgs: list[Msg], batch: Batch, stored: Stored) -> None:
        events = await self._announcements(batch, stored.new)
        outcome = stored.outcome
        if outcome is not None:
            published = await self.publisher.publish_outcome(outcome, before=events)
            unavailable = self.publisher.unavailable  # read before another task publishes
            await self.scheduler.gate.send_cancels(outcome)  # preemptions it chose (queue policy)
        else:
            published = await self.publisher.publish_events(events)
            unavailable = self.publisher.unavailable
        dead = {id(d[0]) for d in batch.dead}
        settled = [m for m in msgs if id(m) not in dead]
        if batch.limited:
            await self._refuse_limited(batch)
        if published:
            self._audit(events, stored.new)
            self.publisher.settle(events)
            self._unannounced.difference_update(e.job_id for e in events)
            stored.announced = True
            await asyncio.gather(*(m.ack() for m in settled))
        else:
            # Stored, not announced: the redelivery announces it (grants: the resend loop), and
            # until then this replica puts the announcement before the job's next event.
            self.publisher.owe(events)
            if unavailable:
                # NATS can't store them now (a stream electing a leader can take seconds):
                # retried as for a database away, so no message runs out of deliveries (the
                # fault run lost an accepted event so once, its message past the limit).
                raise Unpublished(f"{len(events)} announcements not stored")
            await asyncio.gather(*(m.nak(delay=1.0) for m in settled), return_exceptions=True)
        for msg, reason, why, job_id in batch.dead:
            await self.dead.send(msg, reason, why, job_id)
        if stored.fresh and outcome is None:
            self.wake.jobs(stored.fresh)
        beside = stored.passing or self.wake.passing or self.wake.passes != stored.passes
        if (
            self.wake.epoch != stored.epoch and (stored.locked or (outcome and outcome.waiting))
        ) or (beside and stored.locked):
            # Capacity changed while this transaction held waiting rows (its own new ones, which
            # it matched before the change, or the dependencies it checked), or a pass ran while
            # it held dependencies locked: that pass skipped them (SKIP LOCKED; a pass woken by
            # a node joining ran while the next submit's transaction held its dependency, which
            # kept "no nodes in the fleet" until the thorough pass). Look again now that they
            # are free. A pass beside it never skips its own new rows (not visible to it yet):
            # most batches ask for nothing more.
            self.wake.capacity()

    def read(self, msgs: list[Msg]) -> Batch:
        """Decode and validate each message once; the same job id twice is one job."""
        return self._read(msgs, self.settings.profiles, self.max_payload)

    async def _store(self, b: Batch, before: asyncio.Event) -> Stored:
        """Insert the batch's rows in one statement and, when the scheduler is idle, place the
        new jobs in the same transaction, once the batch ``before`` has committed. Rows
        PostgreSQL refuses (their data, not its state) are found by inserting one at a time, so
        only they are rejected."""
        if not b.rows:
            await before.wait()  # nothing to store, but the next batch keeps the order
            return Stored()
        try:
            return await self._store_batch(b, before)
        except DATA_ERRORS as err:
            log.warning("inserting a batch of %d jobs failed (%s): one at a time", len(b.rows), err)
        await before.wait()
        return await self._store_rows(b)

    async def _store_batch(self, b: Batch, before: asyncio.Event) -> Stored:
        stored = Stored()
        try:
            async with self.pool.acquire() as conn, conn.transaction():
                stored.epoch = self.wake.epoch
                stored.passes, stored.passing = self.wake.passes, self.wake.passing
                # Dependencies first: unknown, foreign or failed ones and cycles reject the job.
                # A job may wait for one the batch before submitted: that one must be stored.
                stored.locked = any(job.after for job in b.accepted.values())
                if stored.locked:
                    await before.wait()
                checked = await dependencies.check(conn, b.accepted, b.owners)
                _reject_for_dependencies(b, checked)
                ids, bodies, states, parents = zip(*b.rows.values(), strict=True)
                reasons = ["; ".join(b.rejections[i]) if i in b.rejections else None for i in ids]
                owners = [b.owners.get(i, ANONYMOUS) for i in ids]
                inserted = await Store.fetch(
                    conn, "insert_jobs", ids, bodies, states, reasons, parents, owners,
                    *_queue_places(b, ids),
                )  # fmt: skip
                stored.new = {r["job_id"] for r in inserted}
                await dependencies.record(conn, checked, stored.new)
                # Matched in the order fetched, against what the batch before placed.
                await before.wait()
                stored.fresh = [j for j in b.accepted if j in stored.new]
                self.scheduler.remember({j: b.accepted[j] for j in stored.fresh}, b.submitted)
                if stored.fresh and self.wake.idle() and not self._unwoken:
                    stored.outcome = await self.scheduler.place_inline(conn, stored.fresh)
        except BaseException:
            if stored.outcome is not None:  # placed in memory, but nothing was committed
                self.scheduler.release(stored.outcome)
            raise
        return stored

    async def _store_rows(self, b: Batch) -> Stored:
        """Each row in its own statement (no inline placement: the scheduler takes the new
        jobs). A refused row is stored as rejected, naming PostgreSQL's error, with its body as
        printable text; one refused even so goes to the DLQ."""
        stored = Stored()
        try:
            for job_id, (_, body, state, parent) in list(b.rows.items()):
                await self._store_row(b, stored, job_id, body, state, parent)
        except BaseException:
            self._unannounced.update(stored.new)  # each row was its own commit
            raise
        stored.fresh = [j for j in b.accepted if j in stored.new]
        self.scheduler.remember({j: b.accepted[j] for j in stored.fresh}, b.submitted)
        return stored

    async def _store_row(
        self, b: Batch, stored: Stored, job_id: str, body: str, state: str, parent: str | None
    ) -> None:
        reason = "; ".join(b.rejections[job_id]) if job_id in b.rejections else None
        try:
            stored.new |= await self._insert_one(b, job_id, body, state, reason, parent)
            return
        except DATA_ERRORS as err:
            why = clip_text(f"$: could not be stored: {err}".replace("\x00", "\\x00"))
        b.accepted.pop(job_id, None)
        b.rejections[job_id] = [why]
        text = stored_text(body)
        b.rows[job_id] = (job_id, text, "rejected", parent)
        try:
            stored.new |= await self._insert_one(b, job_id, text, "rejected", why, parent)
        except DATA_ERRORS as err:
            msg = b.origin.pop(job_id)
            del b.rows[job_id], b.rejections[job_id]
            b.dead.append((msg, f"could not be stored: {err}", "unstorable", job_id))

    async def _insert_one(
        self, b: Batch, job_id: str, body: str, state: str, reason: str | None, parent: str | None
    ) -> set[str]:
        owner = b.owners.get(job_id, ANONYMOUS)
        job = b.accepted.get(job_id) if state == "pending" else None
        async with self.pool.acquire() as conn, conn.transaction():
            checked = dependencies.Checked()
            if job is not None and job.after:
                checked = await dependencies.check(conn, {job_id: job}, b.owners)
                if checked.rejections:
                    _reject_for_dependencies(b, checked)
                    state, reason = "rejected", "; ".join(b.rejections[job_id])
            rows = await Store.fetch(
                conn, "insert_jobs", [job_id], [body], [state], [reason], [parent], [owner],
                *_queue_places(b, [job_id]),
            )  # fmt: skip
            new = {r["job_id"] for r in rows}
            await dependencies.record(conn, checked, new)
        return new

    async def _announcements(self, b: Batch, new: set[str]) -> list[JobEvent]:
        """``accepted`` / ``rejected`` for new jobs and for known ones said again."""
        # Known jobs whose submit message came again after a failed publish or a crash before
        # the ack: their events may never have gone out, so they are said again under the same
        # message ids, if young enough for JetStream to drop a copy that did get out.
        again = await self._announce_again(
            [
                j
                for j in b.rows
                if j not in new and (_redelivered(b.origin[j]) or j in self._unannounced)
            ]
        )
        events: list[JobEvent] = []
        for job_id in b.rows:
            if job_id not in new and job_id not in again:
                log.info(
                    "job %s already known: not submitted again",
                    job_id,
                    extra=job_context(job_id, traceparent=b.rows[job_id][3]),
                )
                continue
            if job_id not in new:
                log.info(
                    "job %s redelivered: announcing it again",
                    job_id,
                    extra=job_context(job_id, traceparent=b.rows[job_id][3]),
                )
            owner = b.owners.get(job_id, ANONYMOUS)
            if job_id in b.rejections:
                events.append(
                    Rejected(
                        job_id=job_id,
                        reasons=b.rejections[job_id],
                        owner=owner,
                        profile=b.profiles.get(job_id),
                    )
                )
            else:
                events.append(
                    Accepted(
                        job_id=job_id,
                        warnings=b.warnings[job_id],
                        owner=owner,
                        profile=b.profiles.get(job_id),
                    )
                )
        return events

    def _audit(self, events: list[JobEvent], new: set[str]) -> None:
        """Who submitted each new job, and whether it was accepted (queued: never waited for)."""
        if self.auditor is None:
            return
        for e in events:
            if e.job_id in new:
                rejected = isinstance(e, Rejected)
                why = e.reasons[0] if isinstance(e, Rejected) and e.reasons else ""
                self.auditor.record(
                    e.owner, "submit", e.job_id, "rejected" if rejected else "accepted", why
                )

    async def _refuse_limited(self, b: Batch) -> None:
        """``rejected`` events, naming the limit, for submits over their owner's rate; not for
        a job already known (a copy sent again changes nothing). Best effort: the submit is
        refused whether or not its event was stored."""
        limited = {j: v for j, v in b.limited.items() if j not in b.rows}
        if not limited:
            return
        async with self.pool.acquire() as conn:
            known = {r["job_id"] for r in await Store.fetch(conn, "job_ages", list(limited))}
        events = [
            Rejected(job_id=j, reasons=[why], owner=owner)
            for j, (owner, why) in limited.items()
            if j not in known
        ]
        # Its own message id: the same job id may come back after the wait and be accepted.
        items = [self.publisher.event_item(e, f"{e.job_id}:limited") for e in events]
        if not await self.publisher.publish(items):
            log.warning("%d rate-limit rejections not stored", len(items))

    async def _announce_again(self, job_ids: list[str]) -> set[str]:
        if not job_ids:
            return set()
        async with self.pool.acquire() as conn:
            rows = await Store.fetch(conn, "job_ages", job_ids)
        return {r["job_id"] for r in rows if r["age_s"] < ANNOUNCE_AGAIN_WITHIN_S}


def _queue_places(b: Batch, ids: Sequence[str]) -> tuple[list[int], list[bool]]:
    """``insert_jobs``' priorities and preemptible flags: a waiting job's own (the scheduler's
    order reads them); a rejected one's don't matter (stored as 0 and false)."""
    jobs = [b.accepted.get(i) for i in ids]
    return (
        [j.priority if j is not None else 0 for j in jobs],
        [j.preemptible if j is not None else False for j in jobs],
    )


def _reject_for_dependencies(b: Batch, checked: dependencies.Checked) -> None:
    """Jobs whose dependencies can't be waited for become rejections of the batch."""
    for job_id, errors in checked.rejections.items():
        b.accepted.pop(job_id, None)
        b.warnings.pop(job_id, None)
        b.rejections[job_id] = errors
        _, body, _, parent = b.rows[job_id]
        b.rows[job_id] = (job_id, body, "rejected", parent)


def _redelivered(msg: Msg) -> bool:
    try:
        return (msg.metadata.num_delivered or 1) > 1
    except Exception:  # not a JetStream message (no metadata): delivered once
        return False
