"""Executor status: reports from the STATUS work queue, a batch at a time.

Reports are folded per grant (a final state is never replaced by ``running`` from the same
batch), applied in one statement that also releases the devices of finished jobs, and acked.
A job that finished is forgotten and the scheduler is told capacity came back. A batch of
``running`` reports only is applied outside a transaction first (``apply_running``), after it
waited a moment for what comes behind it (``Hold``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import asyncpg
import msgspec
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig

from gpulayer_contracts.bounds import MAX_REASON_BYTES, clip_text, validate_job_status
from gpulayer_contracts.codec import (
    InvalidInput,
    best_effort_job_id,
    decode_message,
    status_decoder,
)
from gpulayer_contracts.events import JobEvent, JobStatus, Pending
from gpulayer_contracts.subjects import NODE_WILDCARD_STATUS, node_from_subject
from gpulayer_placement.dead_letters import MAX_DELIVER, DeadLetters
from gpulayer_placement.fleet import Fleet
from gpulayer_placement.lifecycle import Lifecycle
from gpulayer_placement.loops import consume
from gpulayer_placement.settings import Settings
from gpulayer_placement.store import Store
from gpulayer_placement.wake import Wake
from gpulayer_runtime.pull import Fetcher, Puller, pulling
from gpulayer_runtime.telemetry import DISABLED, Telemetry

# The name every placement part logs under since before the split: log queries filter on it.
log = logging.getLogger("gpulayer_placement.service")

# job id, grant id, node (from the subject), state, exit code, reason: one ``apply_status`` row
Report = tuple[str, str, str, str, int | None, str | None]
# A report that can't be applied: the message, why, the reason's class, the job id if readable.
Poison = tuple[Msg, str, str, str | None]


class ExecutorStatus:
    def __init__(
        self,
        *,
        js: JetStreamContext,
        pool: asyncpg.Pool,
        fleet: Fleet,
        wake: Wake,
        forget: Callable[[str], None],
        settings: Settings,
        stop: asyncio.Event,
        replica_id: str,
        telemetry: Telemetry = DISABLED,
        dead: DeadLetters | None = None,
        lifecycle: Lifecycle | None = None,
        events: Callable[[list[JobEvent]], Awaitable[bool]] | None = None,
    ) -> None:
        # Publishes the 'pending' of jobs requeued after preemption (queue policy).
        self.events = events
        self.js = js
        self.pool = pool
        self.fleet = fleet
        self.wake = wake
        self.forget = forget
        self.settings = settings
        self.stop = stop
        self.replica_id = replica_id
        self.tel = telemetry
        self.dead = dead if dead is not None else DeadLetters(js, telemetry)
        # Retries, restarts and dependencies of the jobs whose attempts end here.
        self.lifecycle = (
            lifecycle if lifecycle is not None else Lifecycle(publisher=None, wake=wake)
        )

    async def subscribe(self) -> JetStreamContext.PullSubscription:
        """The durable pull consumer on every node's status subject."""
        return await self.js.pull_subscribe(
            NODE_WILDCARD_STATUS,
            durable="placement-status",
            config=ConsumerConfig(
                ack_policy=AckPolicy.EXPLICIT, ack_wait=30, max_deliver=MAX_DELIVER
            ),
        )

    async def run(self, sub: JetStreamContext.PullSubscription | Fetcher) -> None:
        """Apply batches from ``sub`` until the service stops, a batch of ``running`` reports
        alone held back for ``settings.status_hold_s`` first (``Hold``)."""
        hold_s = self.settings.status_hold_s
        if hold_s <= 0:
            await consume(self.stop, sub, self.settings.batch_size, self.apply, self.dead)
            return
        async with pulling(sub) as source, Hold.over(source, hold_s) as hold:

            async def apply_or_hold(msgs: list[Msg]) -> None:
                poison: list[Poison] = []
                rows = self.read(msgs, poison)
                # Only well-formed ``running`` reports wait: nothing to dead-letter, no end.
                running = bool(rows) and not poison and all(r[3] == "running" for r in rows)
                if running and hold.may_keep():
                    hold.keep(msgs)
                    return
                await self.apply(msgs, read=(rows, poison))

            await consume(self.stop, hold, self.settings.batch_size, apply_or_hold, self.dead)

    def read(self, msgs: list[Msg], poison: list[Poison] | None = None) -> list[Report]:
        """The latest report per (job, grant) in ``msgs``. Malformed or out-of-range ones are
        logged, counted and added to ``poison`` (to be dead-lettered). The node is the one the
        subject names: a node can only report its own jobs."""
        latest: dict[tuple[str, str], Report] = {}
        for msg in msgs:
            try:
                status = self._decode(msg)
            except InvalidInput as err:
                log.warning("rejected status message on %s: %s", msg.subject, err)
                why = "invalid" if isinstance(err, _OutOfBounds) else "malformed"
                self.tel.count(
                    "gpulayer.messages.rejected", 1, {"subject": "node.status", "why": why}
                )
                if poison is not None:
                    poison.append((msg, str(err), why, best_effort_job_id(msg.data)))
                continue
            node = status.node_id
            key = (status.job_id, status.grant_id)
            # "running" never replaces a final state reported in the same batch.
            if key in latest and status.state == "running":
                continue
            latest[key] = (
                status.job_id,
                status.grant_id,
                node,
                status.state,
                status.exit_code,
                status.reason,
            )
        return list(latest.values())

    @staticmethod
    def _decode(msg: Msg) -> JobStatus:
        """The report, named by its subject's node, its reason clipped; InvalidInput when it
        is not one or breaks a bound (ids, exit code, pid)."""
        try:
            node = node_from_subject(msg.subject)
        except ValueError as err:
            raise InvalidInput(str(err)) from None
        status = decode_message(status_decoder, msg.data)
        if status.node_id != node:
            log.warning(
                "status for node %s arrived on %s; using the subject",
                clip_text(repr(status.node_id), 80),
                node,
            )
            status = msgspec.structs.replace(status, node_id=node)
        reason = status.reason
        if reason is not None and (len(reason) > MAX_REASON_BYTES // 4 or "\x00" in reason):
            # A long or NUL-holding reason is no reason to lose the job's end: it is clipped
            # (4 bytes a character at most) and its NULs written out.
            reason = clip_text(reason.replace("\x00", "\\x00"), MAX_REASON_BYTES // 4)
            status = msgspec.structs.replace(status, reason=reason)
        errors = validate_job_status(status)
        if errors:
            raise _OutOfBounds("; ".join(errors))
        return status

    async def apply(
        self, msgs: list[Msg], *, read: tuple[list[Report], list[Poison]] | None = None
    ) -> None:
        """Apply one batch of reports in one statement, release devices, then ack it.
        ``read``: what ``read`` made of ``msgs`` already (its reports and its poison)."""
        if read is None:
            poison: list[Poison] = []
            rows = self.read(msgs, poison)
        else:
            rows, poison = read
        if self.tel.enabled:  # here, not in ``read``: a batch held back is read twice
            redelivered = sum(1 for m in msgs if (m.metadata.num_delivered or 0) > 1)
            if redelivered:
                self.tel.count(
                    "gpulayer.consumer.redeliveries", redelivered, {"consumer": "placement-status"}
                )
        if rows and all(r[3] == "running" for r in rows):
            rows = await self._apply_running(rows)
        if rows:
            async with self.pool.acquire() as conn:
                tr = conn.transaction()
                await tr.start()
                try:
                    changed = await Store.fetch(
                        conn,
                        "apply_status",
                        *[list(col) for col in zip(*rows, strict=True)],
                        self.replica_id,
                    )
                    # One row per job (the LEFT JOIN repeats a job per device it released).
                    per_job = {r["job_id"]: r for r in changed}
                    settled = await self.lifecycle.settle(conn, per_job.values())
                except BaseException:
                    await tr.rollback()
                    raise
                # Committed and released here as one step against a reload of the holds
                # (Fleet.reload_lock). Only the commit waits in the lock, never a row lock: a
                # reload reads, and so never waits for this replica's transactions.
                async with self.fleet.reload_lock:
                    await tr.commit()
                    for r in changed:
                        if r["device_index"] is not None:
                            self.fleet.release(r["node_id"], [r["device_index"]], r["mode"])
                    finished = sorted({r["job_id"] for r in changed if r["state"] != "running"})
                    for job_id in [*finished, *settled.gangs.ended]:
                        self.fleet.unreserve(job_id)
                        self.forget(job_id)
            await self._unfence(rows, per_job)
            if finished:
                self.wake.capacity()
            await self.lifecycle.announce(settled)
            await self._requeued(changed)
        dead = {id(p[0]) for p in poison}
        await asyncio.gather(*(m.ack() for m in msgs if id(m) not in dead))
        for msg, reason, why, job_id in poison:
            await self.dead.send(msg, reason, why, job_id)

    async def _apply_running(self, rows: list[Report]) -> list[Report]:
        """A batch of ``running`` reports, most of them applied in one statement of its own,
        committed without waiting for the disk (``apply_running`` says why that is safe). A
        ``running`` changes nothing placement holds in memory. Returns the reports it left to
        ``apply_status``: ranks of a distributed job, and stale or repeated ones."""
        async with self.pool.acquire() as conn:
            done = await Store.fetch(
                conn,
                "apply_running",
                [r[0] for r in rows],
                [r[1] for r in rows],
                [r[2] for r in rows],
                [r[4] for r in rows],
                [r[5] for r in rows],
            )
        applied = {(d["job_id"], d["grant_id"]) for d in done}
        return [r for r in rows if (r[0], r[1]) not in applied]

    async def _unfence(self, rows: list[Report], applied: dict[str, asyncpg.Record]) -> None:
        """Ends reported of grants that changed no job: those of jobs lost with their node
        (cut off, not down) free what their grant held there. Rare, so the common batch pays
        nothing for it: only reports no job took are looked for among the fences."""
        ended = [(r[1], r[2]) for r in rows if r[3] != "running" and r[0] not in applied]
        if not ended:
            return
        async with self.pool.acquire() as conn:
            gone = await Store.fetch(
                conn,
                "release_fences",
                [grant for grant, _ in ended],
                [node for _, node in ended],
                self.replica_id,
            )
        for r in gone:
            if r["kind"] == "device":
                self.fleet.release(r["node_id"], [r["amount"]], r["resource"])
            else:
                self.fleet.unreserve(f"fence:{r['grant_id']}")
        if gone:
            for grant, node in sorted({(r["grant_id"], r["node_id"]) for r in gone}):
                log.info("grant %s on node %s ended: what it held there is free again", grant, node)
            self.wake.capacity()

    async def _requeued(self, changed: list[asyncpg.Record]) -> None:
        """Preempted jobs whose executor stopped them are waiting again: say so, with why."""
        requeued = [
            Pending(job_id=r["job_id"], summary=r["reason"] or "requeued", owner=r["owner"])
            for r in changed
            if r["state"] == "pending"
        ]
        if requeued and self.events is not None:
            log.info("requeued after preemption: %s", ", ".join(e.job_id for e in requeued))
            await self.events(list(requeued))


class Hold:
    """Between the status consumer and its handler: a batch of ``running`` reports alone
    (``keep``) is kept back, unacked, and handed out again at the front of the next batch,
    kept again while that is still ``running`` reports alone, for up to ``hold_s`` from the
    first keep. A short job's end comes right behind its ``running``: both are then read in one
    batch, where the end replaces the ``running`` (``ExecutorStatus.read``), one
    ``apply_status`` where each was a statement and a round trip of its own. A job's
    ``running`` reaches the database at most ``hold_s`` later; its user's ``running`` event is
    the executor's and is not held.

    What is kept when the loop ends is given back (``nak``): redelivered at once, to this
    replica's successor or another replica, rather than after the consumer's ack wait."""

    def __init__(self, source: Fetcher, hold_s: float) -> None:
        self.source = source
        self.hold_s = hold_s
        self.kept: list[Msg] = []
        # When the hold of the oldest message kept (or handed out again in the last batch) is
        # up; None while nothing is.
        self.until: float | None = None

    @classmethod
    @contextlib.asynccontextmanager
    async def over(cls, source: Fetcher, hold_s: float) -> AsyncIterator[Hold]:
        hold = cls(source, hold_s)
        try:
            yield hold
        finally:
            await hold.close()

    def may_keep(self) -> bool:
        """Whether the last batch may be kept: nothing in it was kept before, or the hold of
        what was is not up yet."""
        return self.until is None or asyncio.get_running_loop().time() < self.until

    def keep(self, msgs: list[Msg]) -> None:
        """Keep ``msgs`` (the last batch) until the next fetch."""
        if self.until is None:
            self.until = asyncio.get_running_loop().time() + self.hold_s
        self.kept.extend(msgs)

    async def fetch(self, batch: int, timeout: float) -> list[Msg]:
        """What ``source`` has (1 to ``batch`` messages) after what was kept, if anything was:
        then waiting for more only until the hold is up."""
        if not self.kept:
            self.until = None
            return await self.source.fetch(batch, timeout)
        assert self.until is not None
        kept, self.kept = self.kept, []
        more: list[Msg] = []
        wait = min(self.until - asyncio.get_running_loop().time(), timeout)
        try:
            if wait > 0:
                more = await self.source.fetch(max(batch - len(kept), 1), wait)
        except TimeoutError:  # nothing more came in time (nats' timeouts are TimeoutErrors)
            pass
        except BaseException:
            self.kept = kept + self.kept  # still ours: handed out at the next fetch, or given back
            raise
        return kept + more

    async def close(self) -> None:
        """Give back what is kept: through a ``Puller`` when that is the source (it naks them
        once its subscription's interest is gone), else nak-ed here."""
        kept, self.kept = self.kept, []
        if isinstance(self.source, Puller):
            self.source.give_back(kept)
            return
        for msg in kept:
            with contextlib.suppress(Exception):
                await msg.nak()


class _OutOfBounds(InvalidInput):
    """A report that decodes but breaks a hard bound."""
