"""Executor status: reports from the STATUS work queue, a batch at a time.

Reports are folded per grant (a final state is never replaced by ``running`` from the same
batch), applied in one statement that also releases the devices of finished jobs, and acked.
A job that finished is forgotten and the scheduler is told capacity came back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import asyncpg
import msgspec
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig

from gpulayer_contracts.codec import status_decoder
from gpulayer_contracts.subjects import NODE_WILDCARD_STATUS, node_from_subject
from gpulayer_placement.fleet import Fleet
from gpulayer_placement.loops import consume
from gpulayer_placement.settings import Settings
from gpulayer_placement.store import Store
from gpulayer_placement.wake import Wake
from gpulayer_runtime.telemetry import DISABLED, Telemetry

# The name every placement part logs under since before the split: log queries filter on it.
log = logging.getLogger("gpulayer_placement.service")

# job id, grant id, node (from the subject), state, exit code, reason: one ``apply_status`` row
Report = tuple[str, str, str, str, int | None, str | None]


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
    ) -> None:
        self.js = js
        self.pool = pool
        self.fleet = fleet
        self.wake = wake
        self.forget = forget
        self.settings = settings
        self.stop = stop
        self.replica_id = replica_id
        self.tel = telemetry

    async def subscribe(self) -> JetStreamContext.PullSubscription:
        """The durable pull consumer on every node's status subject."""
        return await self.js.pull_subscribe(
            NODE_WILDCARD_STATUS,
            durable="placement-status",
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=30),
        )

    async def run(self, sub: JetStreamContext.PullSubscription) -> None:
        """Apply batches from ``sub`` until the service stops."""
        await consume(self.stop, sub, self.settings.batch_size, self.apply)

    def read(self, msgs: list[Msg]) -> list[Report]:
        """The latest report per (job, grant) in ``msgs``; malformed ones are logged and
        skipped. The node is the one the subject names: a node can only report its own jobs."""
        latest: dict[tuple[str, str], Report] = {}
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
                node,
                status.state,
                status.exit_code,
                status.reason,
            )
        return list(latest.values())

    async def apply(self, msgs: list[Msg]) -> None:
        """Apply one batch of reports in one statement, release devices, then ack it."""
        rows = self.read(msgs)
        if rows:
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
