"""Outcome publisher: job events, grants and the job's placement span, sent to JetStream as one
pipelined batch; the resend of grants still ``placed`` after a while; and the announcements
(``accepted`` / ``rejected``) this replica still owes because their publish failed.

It owns every message id and header placement puts on events and grants.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import asyncpg
import msgspec
from nats.js import JetStreamContext

from gpulayer_contracts import (
    Accepted,
    CancelJob,
    Cancelled,
    Failed,
    Grant,
    JobEvent,
    Pending,
    Placed,
    Rejected,
    encode,
    validate_job,
)
from gpulayer_contracts.bounds import MAX_EVENT_BYTES, bound_event
from gpulayer_contracts.capabilities import AcceleratorDevice
from gpulayer_contracts.codec import job_request_decoder
from gpulayer_contracts.events import GangRank
from gpulayer_contracts.subjects import (
    ANONYMOUS,
    MSG_ID_HEADER,
    STREAMS,
    job_events,
    node_control,
    node_grants,
)
from gpulayer_placement.outcome import Outcome, PlacedJob, gang_placed, make_grant
from gpulayer_placement.settings import Settings
from gpulayer_placement.store import Store
from gpulayer_runtime.logs import job_context
from gpulayer_runtime.signing import MAX_BATCH, Signer
from gpulayer_runtime.telemetry import DISABLED, Telemetry, extract, inject

if TYPE_CHECKING:
    from opentelemetry.trace import Span

# The name every placement part logs under since before the split: log queries filter on it.
log = logging.getLogger("gpulayer_placement.service")

# An event published again under its first message id is dropped by JetStream only within the
# stream's duplicate window; half of it leaves room for clock skew and slow passes.
ANNOUNCE_AGAIN_WITHIN_S = next(s for s in STREAMS if s.name == "JOB_EVENTS").duplicate_window_s / 2
# How long messages of a committed change that nothing would send again (a cancel, a waiting
# job's end) are retried: through a NATS server's failover (leader elections take seconds).
RETRY_COMMITTED_S = 15.0

Item = tuple[str, bytes, dict[str, str]]  # subject, payload, headers

gang_rank_decoder = msgspec.json.Decoder(GangRank)


class Publisher:
    def __init__(
        self,
        js: JetStreamContext,
        pool: asyncpg.Pool,
        settings: Settings,
        telemetry: Telemetry = DISABLED,
        signer: Signer | None = None,
    ) -> None:
        self.js = js
        self.pool = pool
        self.settings = settings
        self.tel = telemetry
        # Signs every grant and cancel (executors refuse unsigned ones); None only when signing
        # was explicitly turned off.
        self.signer = signer
        self.placed_total = 0
        # The server's max_payload (set from its INFO when wired): a message over it would make
        # the server close this connection, so none is sent.
        self.max_payload = 1 << 20
        self._resent: dict[str, str] = {}  # job id -> grant this replica re-sent (stored)
        # Jobs stored but whose accepted/rejected event failed to publish: said again first,
        # before any later event of theirs from this replica.
        self._unannounced: dict[str, JobEvent] = {}
        # The last publish failed for want of NATS (not for a message too big to send).
        self.unavailable = False
        # How a batch is sent and its acks awaited: service.py sets runtime.jspub's pipelined
        # publisher; nats-py's publish_async by default (what the unit tests' fake answers).
        self.send_batch: Callable[[Sequence[Item], float], Awaitable[None]] = self._send_js
        # A node's devices as last reported (service.py wires the fleet's): a grant of a MIG
        # instance names its parent GPU and the instance's UUID.
        self.devices_of: Callable[[str], list[AcceleratorDevice] | None] = lambda _node: None

    def forget(self, job_id: str) -> None:
        """Drop what the publisher remembers about a job that has ended."""
        self._resent.pop(job_id, None)
        self._unannounced.pop(job_id, None)

    def owe(self, events: Iterable[JobEvent]) -> None:
        """These announcements were not stored: put each before its job's next event."""
        self._unannounced.update((e.job_id, e) for e in events)

    def settle(self, events: Iterable[JobEvent]) -> None:
        """These announcements were stored: nothing is owed for their jobs any more."""
        for e in events:
            self._unannounced.pop(e.job_id, None)

    # --- messages ------------------------------------------------------------------------

    async def publish(self, items: list[Item]) -> bool:
        """Pipelined JetStream publishes: every message is sent, then every ack awaited, instead
        of one round trip each. False (logged) when an ack didn't come: grants are re-sent by the
        ``resend`` loop; a lost event is only a gap in a job's history."""
        if not items:
            return True
        too_big = [it for it in items if not self._fits(it)]
        for subject, data, _ in too_big:
            log.error("not publishing %d bytes on %s: over max_payload", len(data), subject)
        if too_big:
            items = [it for it in items if self._fits(it)]
        try:
            await self.send_batch(items, self.settings.publish_timeout_s)
        except Exception as err:
            log.warning("publishing %d messages failed: %r", len(items), err)
            self.unavailable = True
            return False
        self.unavailable = False
        return not too_big

    async def _send_js(self, items: Sequence[Item], timeout: float) -> None:
        futures = [await self.js.publish_async(subj, data, headers=h) for subj, data, h in items]
        await asyncio.wait_for(asyncio.gather(*futures), timeout)

    async def publish_committed(self, items: list[Item], what: str) -> bool:
        """``items`` of a change already committed that nothing else would send again (a cancel,
        the end of a job that never ran): retried with backoff for RETRY_COMMITTED_S, each time
        under the same message ids, so a copy already stored is dropped. False, logged, when
        they still were not stored."""
        deadline = time.monotonic() + RETRY_COMMITTED_S
        delay = 0.1
        while not await self.publish(items):
            if time.monotonic() + delay > deadline:
                log.error("%s: not stored after %.0f s of retries", what, RETRY_COMMITTED_S)
                return False
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)
        return True

    def _fits(self, item: Item) -> bool:
        subject, data, headers = item
        size = len(data) + len(subject) + sum(len(k) + len(v) + 4 for k, v in headers.items())
        return size + 64 <= self.max_payload

    @staticmethod
    def event_item(event: JobEvent, msg_id: str | None = None) -> Item:
        """``msg_id`` names an event that may be published again (a re-sent grant's ``placed``),
        so JetStream keeps one copy. A job is accepted or rejected once, and placement cancels
        it once (waiting, by its dependency, or its gang): those events are named by the job;
        the others are unique by their time."""
        tag = type(event).__struct_config__.tag
        if msg_id is None:
            once = isinstance(event, Accepted | Rejected | Cancelled)
            msg_id = (
                f"{event.job_id}:{tag}" if once else f"{event.job_id}:{tag}:{event.at.timestamp()}"
            )
        headers = {MSG_ID_HEADER: msg_id}
        data = encode(event)
        if len(data) > MAX_EVENT_BYTES:  # one encode on the common path: clip only when needed
            data = encode(bound_event(event))
        return job_events(event.job_id, event.owner), data, headers

    @staticmethod
    def grant_item(
        grant: Grant, headers: dict[str, str] | None = None, signer: Signer | None = None
    ) -> Item:
        """A grant on its node's subject, named by its grant id (plus any trace headers), signed
        by ``signer`` over the exact bytes sent."""
        h = {MSG_ID_HEADER: grant.grant_id}
        if headers:
            h.update(headers)
        data = encode(grant)
        if signer is not None:
            h.update(signer.headers("grant", grant.node_id, grant.grant_id, data))
        return node_grants(grant.node_id), data, h

    def grant_items(self, grants: Sequence[Grant], headers: Sequence[dict[str, str]]) -> list[Item]:
        """Grants with their headers (e.g. trace context), signed as one batch: one signature
        for all of them, each still verifiable alone (``gpulayer_runtime.signing``)."""
        items = [self.grant_item(g, h or None) for g, h in zip(grants, headers, strict=True)]
        if self.signer is None:
            return items
        to_sign = [(g.node_id, g.grant_id, it[1]) for g, it in zip(grants, items, strict=True)]
        for start in range(0, len(items), MAX_BATCH):
            signed = self.signer.sign_batch("grant", to_sign[start : start + MAX_BATCH])
            for (_, _, h), sig in zip(items[start : start + MAX_BATCH], signed, strict=True):
                h.update(sig)
        return items

    def cancel_item(self, node_id: str, cancel: CancelJob) -> Item:
        """A cancel for the executor of ``node_id``, signed and bound to the cancelled grant;
        named ``cancel:<grant id>`` so a repeat is dropped. A grant given up with its node is
        named apart: a user's cancel of it shortly before must not make CONTROL drop it (the
        node, back, must answer it for the grant's fence to be lifted)."""
        data = encode(cancel)
        name = f"cancel:{cancel.grant_id}" + (":given-up" if cancel.given_up else "")
        h = {MSG_ID_HEADER: name}
        if self.signer is not None:
            h.update(self.signer.headers("cancel", node_id, cancel.grant_id, data))
        return node_control(node_id), data, h

    @staticmethod
    def placed_item(grant: Grant) -> Item:
        """The job's ``placed`` event, named by the grant so a re-sent one is dropped."""
        placed = Placed(
            job_id=grant.job.job_id,
            node_id=grant.node_id,
            accelerator=grant.accelerator,
            devices=grant.devices,
            owner=grant.owner,
            profile=grant.job.profile,
        )
        return Publisher.event_item(placed, msg_id=f"{grant.grant_id}:placed")

    async def publish_events(self, events: list[JobEvent]) -> bool:
        """Job events, pipelined. False when some event was not stored."""
        return await self.publish([self.event_item(e) for e in events])

    async def publish_outcome(self, outcome: Outcome, before: Sequence[JobEvent] = ()) -> bool:
        """Events of ``before`` (e.g. ``accepted``), then the outcome's events, then its grants,
        in one pipelined batch. False when some message was not stored."""
        grants = [
            make_grant(
                pl.job,
                pl.placement.node_id,
                pl.grant_id,
                pl.placement.accelerator,
                pl.placement.devices,
                pl.owner,
                self.devices_of(pl.placement.node_id),
                pl.gang,
            )
            for pl in outcome.placements
        ]
        waiting = _waiting_events(outcome)
        # Events first: a user watching the job sees "placed" before the executor's "running".
        owed = [
            self._unannounced[j]
            for j in (
                *(pl.job.job_id for pl in outcome.placements),
                *(j for j, _ in outcome.waiting),
            )
            if j in self._unannounced
        ]
        items = [self.event_item(e) for e in (*owed, *before)]
        items += [self.placed_item(g) for g in grants]
        # A distributed job's own "placed", once: named by the job (every rank placed at once).
        items += [self.event_item(e, f"{e.job_id}:placed") for e in gang_placed(outcome)]
        items += [self.event_item(e) for e in waiting]
        if not self.tel.enabled:
            # No spans here, but the submitter's context still travels on to the executor.
            items += self.grant_items(
                grants,
                [
                    {"traceparent": pl.traceparent} if pl.traceparent else {}
                    for pl in outcome.placements
                ],
            )
            published = await self.publish(items)
        else:
            spans = [
                self._job_span(pl, g, outcome.commit_ns)
                for pl, g in zip(outcome.placements, grants, strict=True)
            ]
            items += self.grant_items(grants, [inject({}, span) for span in spans])
            sent_ns = time.time_ns()
            published = await self.publish(items)
            self._end_job_spans(spans, outcome, grants, sent_ns)
        self.placed_total += len(grants)
        if published:
            self.settle(owed)
        return published

    # --- the job's trace -----------------------------------------------------------------

    def _job_span(self, pl: PlacedJob, grant: Grant, commit_ns: tuple[int, int]) -> Span:
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
        self, spans: list[Span], outcome: Outcome, grants: list[Grant], sent_ns: int
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

    # --- resend --------------------------------------------------------------------------

    async def resend(self) -> None:
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
        unsendable: list[tuple[Any, str]] = []
        for r in rows:
            if self._resent.get(r["job_id"]) == r["grant_id"]:
                continue
            try:
                items = self._resend_items(r)
            except Exception as err:
                # A stored job that no longer makes a grant (one from before a bound): failed,
                # or every start would try again.
                unsendable.append((r, f"its grant can't be sent: {err}"))
                continue
            if await self.publish(items):
                self._resent[r["job_id"]] = r["grant_id"]
        if unsendable:
            await self._fail_unsendable(unsendable)

    def _resend_items(self, r: Any) -> list[Item]:
        job = job_request_decoder.decode(r["request"])
        log.info(
            "re-sending grant %s of job %s to %s",
            r["grant_id"],
            r["job_id"],
            r["node_id"],
            extra=job_context(r["job_id"], r["node_id"], r["traceparent"]),
        )
        owner = r.get("owner") or ANONYMOUS
        gang = r.get("gang")
        grant = make_grant(
            job,
            r["node_id"],
            r["grant_id"],
            r["accelerator"],
            list(r["devices"]),
            owner,
            self.devices_of(r["node_id"]),
            # A rank of a distributed job: its rendezvous, as first sent.
            gang_rank_decoder.decode(gang) if gang else None,
        )
        items = [
            self.placed_item(grant),
            # Signed anew: a resent grant carries a fresh issued-at, so a grant that waited for
            # its executor is not refused as expired once re-sent.
            self.grant_item(
                grant,
                {"traceparent": r["traceparent"]} if r["traceparent"] else None,
                self.signer,
            ),
        ]
        if not self._fits(items[1]):
            raise ValueError(
                f"the grant is {len(items[1][1])} bytes, over the server's max_payload of "
                f"{self.max_payload} bytes"
            )
        if r["age_s"] < ANNOUNCE_AGAIN_WITHIN_S:
            # Placed where it was ingested, so its "accepted" went out (or not) with this
            # grant; only a copy this young is sure to be dropped if it was stored before.
            warnings = validate_job(job).warnings
            accepted = Accepted(
                job_id=job.job_id, warnings=warnings, owner=owner, profile=job.profile
            )
            items.insert(0, self.event_item(accepted))
        return items

    async def _fail_unsendable(self, failed: list[tuple[Any, str]]) -> None:
        """Placed jobs whose grant can't be sent: failed, devices released, ``failed`` event.
        The release is announced under a tag no replica has, so this one reloads the node's
        allocations too (the publisher holds no fleet)."""
        for r, reason in failed:
            log.error("job %s: %s; failed", r["job_id"], reason, extra=job_context(r["job_id"]))
        async with self.pool.acquire() as conn:
            await Store.fetch(
                conn,
                "apply_status",
                [r["job_id"] for r, _ in failed],
                [r["grant_id"] for r, _ in failed],
                [r["node_id"] for r, _ in failed],
                ["failed"] * len(failed),
                [None] * len(failed),
                [reason for _, reason in failed],
                "resend",
            )
        for r, _ in failed:
            self.forget(r["job_id"])
        await self.publish_events(
            [
                Failed(
                    job_id=r["job_id"],
                    node_id=r["node_id"],
                    reason=why,
                    owner=r.get("owner") or ANONYMOUS,
                )
                for r, why in failed
            ]
        )


def _waiting_events(outcome: Outcome) -> list[JobEvent]:
    """``pending`` for the jobs still waiting and ``failed`` for those that can't be matched,
    each on its owner's subject."""
    owner = outcome.owners.get
    events: list[JobEvent] = [
        Pending(
            job_id=j,
            summary=d.summary,
            reasons=d.reasons,
            unsatisfiable=d.unsatisfiable,
            owner=owner(j, ANONYMOUS),
        )
        for j, d in outcome.waiting
    ]
    events += [Failed(job_id=j, reason=why, owner=owner(j, ANONYMOUS)) for j, why in outcome.failed]
    return events
