"""Intake: job requests from the JOBS work queue, a batch at a time.

Each batch is decoded once and validated, folded by job id, and its new ids inserted in one
statement (a known id is the same job). When the scheduler is idle the new jobs are matched in
that same transaction; otherwise the scheduler is woken for them. Then ``accepted`` /
``rejected`` (and any placement) go out pipelined, and the batch is acked after commit, or
nak'ed when the announcements were not stored.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import asyncpg
import msgspec
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig

from gpulayer_contracts import (
    Accepted,
    ArraySpec,
    JobEvent,
    JobRequest,
    Rejected,
    encode,
    validate_job,
)
from gpulayer_contracts.bounds import (
    array_size_error,
    bound_messages,
    clip_text,
    job_size_error,
)
from gpulayer_contracts.codec import InvalidInput, best_effort_job_id, decode_job_json
from gpulayer_contracts.profiles import expand_profile
from gpulayer_contracts.subjects import ANONYMOUS, JOBS_SUBMIT_ALL, owner_from_submit
from gpulayer_placement import dependencies
from gpulayer_placement.dead_letters import MAX_DELIVER, DeadLetters
from gpulayer_placement.loops import Unpublished, consume
from gpulayer_placement.outcome import Outcome
from gpulayer_placement.publisher import ANNOUNCE_AGAIN_WITHIN_S, Publisher
from gpulayer_placement.scheduler import Scheduler
from gpulayer_placement.settings import Settings
from gpulayer_placement.store import DATA_ERRORS, Store
from gpulayer_placement.wake import Wake
from gpulayer_runtime.logs import job_context
from gpulayer_runtime.telemetry import DISABLED, Telemetry

# The name every placement part logs under since before the split: log queries filter on it.
log = logging.getLogger("gpulayer_placement.service")

Row = tuple[str, str, str, str | None]  # job id, request body, state, traceparent


@dataclass
class Batch:
    """One fetch of submit messages, folded by job id (the first message of an id wins)."""

    rows: dict[str, Row] = field(default_factory=dict)
    accepted: dict[str, JobRequest] = field(default_factory=dict)
    warnings: dict[str, list[str]] = field(default_factory=dict)
    rejections: dict[str, list[str]] = field(default_factory=dict)
    origin: dict[str, Msg] = field(default_factory=dict)
    submitted: dict[str, float] = field(default_factory=dict)  # stream time, with telemetry on
    # Messages that are no job and name none (or can't be stored at all): message, reason,
    # reason class, job id if one was read. Dead-lettered, never acked with the batch.
    dead: list[tuple[Msg, str, str, str | None]] = field(default_factory=list)
    # From the submit subject, which only the owner's credential may publish on.
    owners: dict[str, str] = field(default_factory=dict)
    # The runtime profile each job named (its events name it too).
    profiles: dict[str, str | None] = field(default_factory=dict)


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
    ) -> None:
        self.js = js
        self.pool = pool
        self.scheduler = scheduler
        self.publisher = publisher
        self.wake = wake
        self.settings = settings
        self.stop = stop
        self.tel = telemetry
        self.dead = dead if dead is not None else DeadLetters(js, telemetry, max_payload)
        # The server's, from its INFO: a job whose grant would not fit it is refused.
        self.max_payload = max_payload
        # Jobs a batch stored (committed) before it failed: not announced by it. The same
        # messages come back on their first delivery still (handle_batch retries a failed
        # batch one message at a time) and must announce them, not take them for known jobs
        # submitted again (the fault run found such a job with no ``accepted`` event).
        self._unannounced: set[str] = set()

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
        await consume(self.stop, sub, self.settings.batch_size, self.ingest, self.dead)

    async def ingest(self, msgs: list[Msg]) -> None:
        """Store, announce and (when the scheduler is idle) place one batch, then ack it."""
        batch = self.read(msgs)
        stored = await self._store(batch)
        try:
            await self._announce_and_ack(msgs, batch, stored)
        except BaseException:
            if not stored.announced:
                self._unannounced.update(stored.new)
            raise

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
        if published:
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
        if (self.wake.epoch != stored.epoch or beside) and (
            stored.locked or (outcome is not None and outcome.waiting)
        ):
            # Capacity changed, or a pass ran, while this transaction held waiting rows (its
            # own new ones, or the dependencies it checked): a pass then skipped them (SKIP
            # LOCKED). Look again now that they are free. (A pass woken by a node joining ran
            # while the next submit's transaction held its dependency locked: that job kept
            # "no nodes in the fleet" until the thorough pass.)
            self.wake.capacity()

    def read(self, msgs: list[Msg]) -> Batch:
        """Decode and validate each message once; the same job id twice is one job."""
        b = Batch()
        for msg in msgs:
            try:
                self._read_one(b, msg)
            except Exception as err:
                # A bug met by one message: that message goes to the DLQ, the batch goes on.
                log.exception("reading message on %s failed", msg.subject)
                b.dead.append(
                    (msg, f"internal error: {err!r}", "internal", best_effort_job_id(msg.data))
                )
        return b

    def _read_one(self, b: Batch, msg: Msg) -> None:
        tel = self.tel.enabled
        traceparent = (msg.headers or {}).get("traceparent")
        if tel:
            meta = msg.metadata
            if meta.num_delivered and meta.num_delivered > 1:
                self.tel.count("gpulayer.consumer.redeliveries", 1, {"consumer": "placement-jobs"})
        try:
            job = decode_job_json(msg.data)
        except InvalidInput as err:
            self._malformed(b, msg, err, traceparent)
            return
        if job.job_id in b.rows:
            return  # the same id twice in one batch is one job
        b.origin[job.job_id] = msg
        b.owners[job.job_id] = _owner(msg)
        b.profiles[job.job_id] = job.profile
        # The profile's requirements join the job's own here, once: what is stored, matched and
        # granted is the expanded job, so a later change of the profiles file can't change it.
        expanded, errors = expand_profile(job, self.settings.profiles)
        result = validate_job(expanded)
        errors = bound_messages([*errors, *result.errors])
        if not errors:
            job = expanded
        try:
            encoded = encode(job)
        except UnicodeEncodeError:  # a lone surrogate: validate_job names it
            body = _stored_text(msg.data.decode("utf-8", "replace"))
        else:
            body = encoded.decode()
            too_big = job_size_error(len(encoded), self.max_payload)
            if too_big is not None:
                errors = bound_messages([too_big, *errors])
        if errors:
            self.tel.count(
                "gpulayer.messages.rejected", 1, {"subject": "jobs.submit", "why": "invalid"}
            )
            b.rejections[job.job_id] = errors
            b.rows[job.job_id] = (job.job_id, _storable(body), "rejected", traceparent)
        elif job.array is not None:
            self._expand(b, job, result.warnings, traceparent, msg)
        else:
            b.accepted[job.job_id] = job
            b.warnings[job.job_id] = result.warnings
            b.rows[job.job_id] = (job.job_id, body, "pending", traceparent)
            if tel:
                b.submitted[job.job_id] = msg.metadata.timestamp.timestamp()

    def _expand(
        self, b: Batch, job: JobRequest, warnings: list[str], traceparent: str | None, msg: Msg
    ) -> None:
        """An array: ``count`` jobs ``<id>-<i>``, each carrying its index (the executor sets
        ``GPULAYER_ARRAY_INDEX`` from it), stored and placed as jobs of their own. Refused whole
        (under the array's id) when its last job's grant would not fit the server or all its
        jobs together pass MAX_ARRAY_BYTES."""
        assert job.array is not None
        n, owner = job.array.count, b.owners[job.job_id]

        def element(i: int) -> JobRequest:
            spec = ArraySpec(count=n, index=i)
            return msgspec.structs.replace(job, job_id=f"{job.job_id}-{i}", array=spec)

        size = len(encode(element(n - 1)))  # the longest id and index
        error = job_size_error(size, self.max_payload) or array_size_error(n, size)
        if error is not None:
            b.rejections[job.job_id] = [error]
            b.rows[job.job_id] = (job.job_id, encode(job).decode(), "rejected", traceparent)
            return
        del b.origin[job.job_id], b.owners[job.job_id]  # the array's id names no job
        stamp = msg.metadata.timestamp.timestamp() if self.tel.enabled else None
        for i in range(n):
            one = element(i)
            if one.job_id in b.rows:
                continue  # the same id twice in one batch is one job
            b.origin[one.job_id], b.owners[one.job_id] = msg, owner
            b.accepted[one.job_id] = one
            b.warnings[one.job_id] = warnings
            b.rows[one.job_id] = (one.job_id, encode(one).decode(), "pending", traceparent)
            if stamp is not None:
                b.submitted[one.job_id] = stamp

    def _malformed(self, b: Batch, msg: Msg, err: InvalidInput, traceparent: str | None) -> None:
        """A message that doesn't decode is rejected under the job id read from it; one that
        names no job goes to the DLQ with the reason."""
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
        if job_id is None:
            b.dead.append(
                (msg, f"not a job request, and no job id could be read: {err}", "malformed", None)
            )
        elif job_id not in b.rows:
            b.origin[job_id] = msg
            b.owners[job_id] = _owner(msg)
            b.rejections[job_id] = [str(err)]
            text = _stored_text(msg.data.decode("utf-8", "replace"))
            b.rows[job_id] = (job_id, text, "rejected", traceparent)

    async def _store(self, b: Batch) -> Stored:
        """Insert the batch's rows in one statement and, when the scheduler is idle, place the
        new jobs in the same transaction. Rows PostgreSQL refuses (their data, not its state)
        are found by inserting one at a time, so only they are rejected."""
        if not b.rows:
            return Stored()
        try:
            return await self._store_batch(b)
        except DATA_ERRORS as err:
            log.warning("inserting a batch of %d jobs failed (%s): one at a time", len(b.rows), err)
        return await self._store_rows(b)

    async def _store_batch(self, b: Batch) -> Stored:
        stored = Stored()
        try:
            async with self.pool.acquire() as conn, conn.transaction():
                stored.epoch = self.wake.epoch
                stored.passes, stored.passing = self.wake.passes, self.wake.passing
                # Dependencies first: unknown, foreign or failed ones and cycles reject the job.
                stored.locked = any(job.after for job in b.accepted.values())
                checked = await dependencies.check(conn, b.accepted, b.owners)
                _reject_for_dependencies(b, checked)
                ids, bodies, states, parents = zip(*b.rows.values(), strict=True)
                reasons = ["; ".join(b.rejections[i]) if i in b.rejections else None for i in ids]
                owners = [b.owners.get(i, ANONYMOUS) for i in ids]
                inserted = await Store.fetch(
                    conn, "insert_jobs", ids, bodies, states, reasons, parents, owners
                )
                stored.new = {r["job_id"] for r in inserted}
                await dependencies.record(conn, checked, stored.new)
                stored.fresh = [j for j in b.accepted if j in stored.new]
                self.scheduler.remember({j: b.accepted[j] for j in stored.fresh}, b.submitted)
                if stored.fresh and self.wake.idle():
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
        text = _stored_text(body)
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
                conn, "insert_jobs", [job_id], [body], [state], [reason], [parent], [owner]
            )
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

    async def _announce_again(self, job_ids: list[str]) -> set[str]:
        if not job_ids:
            return set()
        async with self.pool.acquire() as conn:
            rows = await Store.fetch(conn, "job_ages", job_ids)
        return {r["job_id"] for r in rows if r["age_s"] < ANNOUNCE_AGAIN_WITHIN_S}


def _reject_for_dependencies(b: Batch, checked: dependencies.Checked) -> None:
    """Jobs whose dependencies can't be waited for become rejections of the batch."""
    for job_id, errors in checked.rejections.items():
        b.accepted.pop(job_id, None)
        b.warnings.pop(job_id, None)
        b.rejections[job_id] = errors
        _, body, _, parent = b.rows[job_id]
        b.rows[job_id] = (job_id, body, "rejected", parent)


def _owner(msg: Msg) -> str:
    """The job's owner, from the subject it was submitted on (never from the payload)."""
    try:
        return owner_from_submit(msg.subject)
    except ValueError:  # not a submit subject: the stream holds none, so nobody's in particular
        return ANONYMOUS


def _redelivered(msg: Msg) -> bool:
    try:
        return (msg.metadata.num_delivered or 1) > 1
    except Exception:  # not a JetStream message (no metadata): delivered once
        return False


def _stored_text(text: str) -> str:
    """Text that is no storable job, as a JSON string (the row keeps what was sent): NUL, which
    PostgreSQL refuses in text and jsonb, is written as ``\\x00``."""
    return encode(text.replace("\x00", "\\x00")).decode()


def _storable(body: str) -> str:
    """A rejected job's encoded body as it can be stored: jsonb refuses ``\\u0000``."""
    return _stored_text(body) if "\\u0000" in body else body
