"""Grant intake: this node's grants and cancels, from their durable JetStream consumers.

A grant is acked only once its ``received`` record is on disk (group commit), so a grant is
never lost between the ack and a crash; a redelivered grant finds its record and is acked and
ignored, never started twice. A cancel is recorded durably before its ack, so a grant for the
job that arrives later (the two streams are not ordered with each other) never starts; a
cancel of a grant placement gave up that never reached this node is acked only once placement
was told so (it holds what the grant would have used until then).

With a ``Verifier`` (the default outside tests of other parts), grants and cancels must carry
placement's signature for this node: anything unsigned, forged, tampered, for another node, or
issued too long ago is logged, counted (``gpulayer.executor.grants.refused`` by reason) and
acked, and nothing of it is recorded or reported: a forgery must leave no trace in the job's
history either. A grant id already recorded is a repeat (or a replay) and is ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections import Counter
from collections.abc import Awaitable, Callable

import msgspec
import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from gpulayer_contracts.codec import InvalidInput, cancel_decoder, decode_message, grant_decoder
from gpulayer_contracts.events import Grant
from gpulayer_contracts.subjects import node_control, node_grants
from gpulayer_executor import state as st
from gpulayer_executor.job_runner import JobRunner
from gpulayer_executor.reporter import Reporter
from gpulayer_executor.writer import DurableWriter
from gpulayer_runtime.logs import job_context
from gpulayer_runtime.pull import Fetcher, pulling
from gpulayer_runtime.signing import Kind, Refusal, Verifier
from gpulayer_runtime.telemetry import DISABLED, Telemetry

# The executor's lines keep the logger name they had before it was split into parts.
log = logging.getLogger("gpulayer_executor.service")

FETCH_BATCH = 64


class GrantIntake:
    """Consumes grants and cancels until ``stopping`` is set; hands new grants to the runner."""

    def __init__(
        self,
        js: JetStreamContext,
        node_id: str,
        store: st.StateStore,
        writer: DurableWriter,
        runner: JobRunner,
        reporter: Reporter,
        stopping: asyncio.Event,
        telemetry: Telemetry = DISABLED,
        *,
        fetch_timeout_s: float = 1.0,
        verifier: Verifier | None = None,
    ) -> None:
        self._js = js
        self._node_id = node_id
        self._store = store
        self._writer = writer
        self._runner = runner
        self._reporter = reporter
        self._stopping = stopping
        self._tel = telemetry
        self._fetch_timeout_s = fetch_timeout_s
        self._verifier = verifier
        # (message kind, reason) -> how many were refused: the metric's numbers, also kept here
        # for tests and for telemetry-less runs.
        self.refused: Counter[tuple[str, str]] = Counter()
        self._grants: JetStreamContext.PullSubscription | None = None
        self._control: JetStreamContext.PullSubscription | None = None

    async def subscribe(self) -> None:
        """Bind this node's durable consumers (created if new); nothing is fetched yet."""
        self._grants = await self._subscribe(
            node_grants(self._node_id), f"executor-{self._node_id}", "GRANTS"
        )
        self._control = await self._subscribe(
            node_control(self._node_id), f"executor-{self._node_id}-control", "CONTROL"
        )

    async def unsubscribe(self) -> None:
        for sub in (self._grants, self._control):
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()

    async def consume_grants(self) -> None:
        assert self._grants is not None, "subscribe() first"
        await self._consume(self._grants, self.on_grant)

    async def consume_cancels(self) -> None:
        assert self._control is not None, "subscribe() first"
        await self._consume(self._control, self.on_cancel)

    async def _subscribe(
        self, subject: str, durable: str, stream: str
    ) -> JetStreamContext.PullSubscription:
        config = ConsumerConfig(
            durable_name=durable,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            ack_wait=30.0,
        )
        return await self._js.pull_subscribe(subject, durable=durable, stream=stream, config=config)

    async def _consume(
        self, sub: JetStreamContext.PullSubscription, handle: Callable[[Msg], Awaitable[None]]
    ) -> None:
        """Batches of ``sub`` through a ``Puller`` (its pull request kept open), handled until
        ``stopping``; what it holds undelivered is then given back for the next start."""
        async with pulling(sub) as source:
            await self._consume_from(source, handle)

    async def _consume_from(
        self, source: Fetcher, handle: Callable[[Msg], Awaitable[None]]
    ) -> None:
        while not self._stopping.is_set():
            try:
                msgs = await source.fetch(FETCH_BATCH, timeout=self._fetch_timeout_s)
            except TimeoutError:  # nothing to fetch (nats' TimeoutError is one too)
                continue
            except (nats.errors.Error, OSError) as err:
                log.warning("fetch failed, retrying: %r", err)
                await asyncio.sleep(1.0)
                continue
            # A fetched batch is handled concurrently, and the grants' durable records are
            # written in one commit (DurableWriter).
            await asyncio.gather(*(self._handle_one(handle, msg) for msg in msgs))

    @staticmethod
    async def _handle_one(handle: Callable[[Msg], Awaitable[None]], msg: Msg) -> None:
        try:
            await handle(msg)
        except Exception:
            # Not acked: JetStream redelivers it after ack_wait, and the local record (if it got
            # that far) makes the retry harmless.
            log.exception("handling %s failed", msg.subject)

    def _refusal(self, grant: Grant) -> str | None:
        """Why this executor must not run the grant at all, or None. Checked before anything
        is recorded as received."""
        if grant.node_id != self._node_id:
            # Identity comes from the subject; a payload naming another node is a placement bug
            # or a forgery, and running it here would use devices placement gave to someone else.
            return (
                f"grant for node {grant.node_id!r} was delivered to node {self._node_id!r}; refused"
            )
        return None

    def _unverified(self, kind: Kind, node_id: str, grant_id: str, msg: Msg) -> Refusal | None:
        """Why the message can't be trusted to come from placement for this node, or None (or
        None always when signing is off)."""
        if self._verifier is None:
            return None
        if node_id != self._node_id:
            # Checked before the signature only to say why: placement signs a grant for the node
            # it names, so one naming another node fails the signature check too.
            return Refusal("wrong_node", f"{kind} names node {node_id[:64]!r}")
        return self._verifier.refusal(kind, self._node_id, grant_id, msg.data, msg.headers)

    async def _drop(self, msg: Msg, kind: Kind, job_id: str, grant_id: str, why: Refusal) -> None:
        """Log, count and ack an untrusted message; nothing is recorded or reported."""
        self.refused[(kind, why.reason)] += 1
        self._tel.count(
            "gpulayer.executor.grants.refused", 1, {"reason": why.reason, "message": kind}
        )
        log.error(
            "refused %s %s for job %s on %s: %s (%s)",
            kind,
            grant_id[:128],
            job_id[:128],
            msg.subject,
            why.detail,
            why.reason,
        )
        await msg.ack()

    async def on_grant(self, msg: Msg) -> None:
        try:
            grant = decode_message(grant_decoder, msg.data)
        except InvalidInput as err:
            log.error("malformed grant on %s dropped: %s", msg.subject, err)
            await msg.ack()
            return
        why = self._unverified("grant", grant.node_id, grant.grant_id, msg)
        if why is not None:
            await self._drop(msg, "grant", grant.job.job_id, grant.grant_id, why)
            return
        reason = self._refusal(grant)
        if reason is not None:
            await self._refuse(msg, grant, reason)
            return
        if self._tel.enabled and (msg.metadata.num_delivered or 0) > 1:
            self._tel.count("gpulayer.consumer.redeliveries", 1, {"consumer": "executor-grants"})
        rec = msgspec.structs.replace(
            st.received(grant), traceparent=(msg.headers or {}).get("traceparent")
        )
        if not await self._writer.create(rec):
            self.refused[("grant", "replayed")] += 1
            self._tel.count(
                "gpulayer.executor.grants.refused", 1, {"reason": "replayed", "message": "grant"}
            )
            log.warning(
                "grant %s for job %s delivered again; ignored",
                grant.grant_id,
                grant.job.job_id,
                extra=job_context(rec.job_id, self._node_id, rec.traceparent),
            )
            await msg.ack()
            return
        await msg.ack()
        log.debug("grant %s: job %s accepted", grant.grant_id, grant.job.job_id)
        self._runner.launch(rec)

    async def _refuse(self, msg: Msg, grant: Grant, reason: str) -> None:
        """Record the grant as failed (once), ack it, and report it failed."""
        log.error(
            "grant %s for job %s: %s",
            grant.grant_id,
            grant.job.job_id,
            reason,
            extra=job_context(grant.job.job_id, self._node_id),
        )
        rec = st.finished(st.received(grant), st.Outcome(state="failed", reason=reason))
        if await asyncio.to_thread(self._store.create, rec):
            await msg.ack()
            await self._reporter.report_finished(rec)
        else:
            await msg.ack()

    async def on_cancel(self, msg: Msg) -> None:
        try:
            cancel = decode_message(cancel_decoder, msg.data)
        except InvalidInput as err:
            log.error("malformed cancel on %s dropped: %s", msg.subject, err)
            await msg.ack()
            return
        why = self._unverified("cancel", self._node_id, cancel.grant_id, msg)
        if why is not None:
            await self._drop(msg, "cancel", cancel.job_id, cancel.grant_id, why)
            return
        given_up = cancel.given_up and bool(cancel.grant_id)
        if self._verifier is not None or given_up:
            # Placement signed it, and placement cancels only jobs it placed here: remembered
            # durably first, so a grant for this job arriving later (the two streams are not
            # ordered with each other) or still queued after a restart never starts. A grant
            # placement gave up is marked even unsigned: the mark stops that grant alone, and
            # its end is about to be reported as if it had come (below).
            await asyncio.to_thread(
                functools.partial(
                    self._store.mark_cancel,
                    cancel.job_id,
                    cancel.reason,
                    cancel.grant_id,
                    given_up=cancel.given_up,
                )
            )
        # Unsigned (signing off): it stops what runs now, but leaves no mark that would stop a
        # job submitted later under that id.
        # Only asks the jobs to stop (nothing runs before the next await): logged after.
        stopped = self._runner.cancel(
            cancel.job_id, cancel.reason, cancel.grant_id, given_up=cancel.given_up
        )
        log.info("cancel for job %s (%s): %d active grants", cancel.job_id, cancel.reason, stopped)
        # Acked only once placement was told: nothing else on this node would say it (no record
        # of the grant), so a crash or a report given up on first leaves the cancel in CONTROL,
        # redelivered and reported then (the same message id, so told once).
        told = not (given_up and not stopped) or await self._never_came(
            cancel.job_id, cancel.grant_id, cancel.reason
        )
        if told:
            await msg.ack()

    async def _never_came(self, job_id: str, grant_id: str, reason: str) -> bool:
        """A grant placement gave up (lost with this node) that this node has no record of:
        placement, which holds what the grant would have used fenced until this node reports
        its end, is told it ended here. The mark written before stops it should it still come
        (a grant placement could not publish before the loss is never resent). False when the
        report was not stored (the executor stopping)."""
        if await asyncio.to_thread(self._store.load, grant_id) is not None:
            return True  # received and ended already: its own end was (or will be) reported
        log.info("grant %s of job %s never reached this node: reported ended", grant_id, job_id)
        return await self._reporter.report_never_came(job_id, grant_id, reason)
