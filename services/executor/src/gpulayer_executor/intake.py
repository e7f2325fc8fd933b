"""Grant intake: this node's grants and cancels, from their durable JetStream consumers.

A grant is acked only once its ``received`` record is on disk (group commit), so a grant is
never lost between the ack and a crash; a redelivered grant finds its record and is acked and
ignored, never started twice. A cancel is recorded durably before its ack, so a grant for the
job that arrives later (the two streams are not ordered with each other) never starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
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
        while not self._stopping.is_set():
            try:
                msgs = await sub.fetch(FETCH_BATCH, timeout=self._fetch_timeout_s)
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

    async def on_grant(self, msg: Msg) -> None:
        try:
            grant = decode_message(grant_decoder, msg.data)
        except InvalidInput as err:
            log.error("malformed grant on %s dropped: %s", msg.subject, err)
            await msg.ack()
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
        # Remembered durably first: a grant for this job arriving later (the two streams are not
        # ordered with each other) or still queued after a restart is then never started.
        await asyncio.to_thread(self._store.mark_cancel, cancel.job_id, cancel.reason)
        await msg.ack()
        # Only asks the jobs to stop (nothing runs before the next await): logged after.
        stopped = self._runner.cancel(cancel.job_id, cancel.reason)
        log.info("cancel for job %s (%s): %d active grants", cancel.job_id, cancel.reason, stopped)
