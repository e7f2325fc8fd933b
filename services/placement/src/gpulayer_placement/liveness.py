"""Liveness: node state into memory and PostgreSQL.

Capabilities (last message per node from the NODES stream) and heartbeats (core NATS) are
batched into one statement each. A node silent past the timeout goes offline, its placed and
running jobs become ``lost`` and their devices are released; a node whose executor stops
beating gets no new grants until it is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import UTC, datetime
from typing import Any

import asyncpg
import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy

from gpulayer_contracts import CancelJob, Heartbeat, Lost, WorkerCapabilities, encode
from gpulayer_contracts.bounds import node_id_errors, validate_capabilities, validate_heartbeat
from gpulayer_contracts.codec import (
    InvalidInput,
    capabilities_decoder,
    decode_message,
    heartbeat_decoder,
)
from gpulayer_contracts.health import drift, vanished
from gpulayer_contracts.subjects import (
    NODE_WILDCARD_CAPABILITIES,
    NODE_WILDCARD_HEARTBEAT,
    end_msg_id,
    node_from_subject,
)
from gpulayer_placement.fleet import Fleet, Offer
from gpulayer_placement.lifecycle import Lifecycle, Settled
from gpulayer_placement.publisher import Publisher
from gpulayer_placement.replica_sync import ReplicaSync
from gpulayer_placement.settings import Settings
from gpulayer_placement.store import DB_ERRORS, Store
from gpulayer_placement.wake import Wake
from gpulayer_runtime.logs import job_context
from gpulayer_runtime.telemetry import DISABLED, Telemetry

# The name every placement part logs under since before the split: log queries filter on it.
log = logging.getLogger("gpulayer_placement.service")


class Liveness:
    def __init__(
        self,
        *,
        nc: Client,
        js: JetStreamContext,
        pool: asyncpg.Pool,
        fleet: Fleet,
        wake: Wake,
        sync: ReplicaSync,
        publisher: Publisher,
        settings: Settings,
        stop: asyncio.Event,
        telemetry: Telemetry = DISABLED,
        lifecycle: Lifecycle | None = None,
    ) -> None:
        self.nc = nc
        self.js = js
        self.pool = pool
        self.fleet = fleet
        self.wake = wake
        self.sync = sync
        self.publisher = publisher
        self.settings = settings
        self.stop = stop
        self.tel = telemetry
        # Lost jobs with retries left, and services, wait again; their dependents learn of it.
        self.lifecycle = (
            lifecycle if lifecycle is not None else Lifecycle(publisher=None, wake=wake)
        )
        self._caps_queue: asyncio.Queue[Msg] = asyncio.Queue()
        self._heartbeats: dict[str, datetime] = {}

    async def load_nodes(self, conn: Any) -> None:
        """Every known node into the fleet, on the caller's connection (at start)."""
        for row in await Store.fetch(conn, "load_nodes"):
            try:
                caps = decode_message(capabilities_decoder, row["capabilities"])
            except InvalidInput as err:
                # Stored by another version: the node's next report replaces it.
                log.warning("stored capabilities of node %s skipped: %s", row["node_id"], err)
                continue
            self.fleet.upsert(caps, online=row["online"])

    async def subscribe(self) -> list[Any]:
        """Capabilities (last per node, then every change) and heartbeats."""
        caps = await self.js.subscribe(
            NODE_WILDCARD_CAPABILITIES,
            cb=self._on_capabilities,
            ordered_consumer=True,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.LAST_PER_SUBJECT),
        )
        beats = await self.nc.subscribe(NODE_WILDCARD_HEARTBEAT, cb=self.on_heartbeat)
        return [caps, beats]

    # --- capabilities --------------------------------------------------------------------

    async def _on_capabilities(self, msg: Msg) -> None:
        await self._caps_queue.put(msg)

    async def run_capabilities(self) -> None:
        """Store what arrived since the last batch (up to 2,000 messages) and update the fleet."""
        while not self.stop.is_set():
            first = await self._caps_queue.get()
            batch = [first]
            while not self._caps_queue.empty() and len(batch) < 2000:
                batch.append(self._caps_queue.get_nowait())
            try:
                latest = self.read_capabilities(batch)
                if latest:
                    await self.store_capabilities(latest)
            except Exception:
                # A bug met by one batch: logged, and the next reports are still read.
                log.exception("handling %d capability reports failed", len(batch))

    def read_capabilities(self, batch: list[Msg]) -> list[WorkerCapabilities]:
        """The latest valid capabilities per node, named by the subject they came on. A report
        that doesn't decode or breaks a bound is dropped whole (the node keeps its last good
        one), logged, counted, and its errors kept in ``fleet.report_errors`` for the API."""
        latest: dict[str, WorkerCapabilities] = {}
        for msg in batch:
            try:
                node, caps = self._capabilities(msg)
            except InvalidInput as err:
                self._bad_report(msg, str(err))
                continue
            self.fleet.report_errors.pop(node, None)
            latest[node] = caps
        return list(latest.values())

    @staticmethod
    def _capabilities(msg: Msg) -> tuple[str, WorkerCapabilities]:
        try:
            node = node_from_subject(msg.subject)
        except ValueError as err:
            raise InvalidInput(str(err)) from None
        caps = decode_message(capabilities_decoder, msg.data)
        if caps.node_id != node:
            # Identity comes from the subject the node may publish on, never the payload.
            caps = msgspec.structs.replace(caps, node_id=node)
        errors = validate_capabilities(caps)
        if errors:
            raise InvalidInput("; ".join(errors))
        return node, caps

    def _bad_report(self, msg: Msg, why: str) -> None:
        log.warning("rejected capabilities on %s: %s", msg.subject, why)
        self.tel.count(
            "gpulayer.messages.rejected", 1, {"subject": "node.capabilities", "why": "invalid"}
        )
        try:
            node = node_from_subject(msg.subject)
        except ValueError:
            return
        if not node_id_errors(node):
            self.fleet.report_errors[node] = why

    async def store_capabilities(self, caps_list: list[WorkerCapabilities]) -> None:
        """One statement for the batch; the fleet is updated even if the database is down."""
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
        gone: list[tuple[str, dict[int, str]]] = []
        for c in caps_list:
            old = self.fleet.get(c.node_id)
            if old is not None and old.capabilities is not c:
                for change in drift(old.capabilities, c):
                    log.warning("drift on node %s: %s", c.node_id, change)
                    self.tel.count("gpulayer.node.drift", 1, {"node": c.node_id})
                if lost := vanished(old.capabilities, c):
                    gone.append((c.node_id, lost))
        changed = [self.fleet.upsert(c) for c in caps_list]
        for node, devices in gone:
            await self.lose_device_jobs(node, devices)
        if any(changed):
            self.wake.capacity()

    async def lose_device_jobs(self, node: str, devices: dict[int, str]) -> None:
        """Jobs holding a device that vanished from the node's detection are lost, with the
        device named; the executor is asked to stop them (what a lost GPU left running)."""
        reason = "; ".join(devices[i] for i in sorted(devices))
        try:
            async with self.pool.acquire() as conn, conn.transaction():
                lost = await Store.fetch(conn, "lose_device_jobs", node, sorted(devices), reason)
                if lost:
                    await self.sync.notify(conn, [node])
                # Retries, restarts and dependents, as for jobs lost with their node.
                settled = await self.lifecycle.settle(conn, lost)
        except DB_ERRORS as err:
            log.warning("losing the jobs on vanished devices of %s failed: %s", node, err)
            return
        if not lost:
            return
        await self.lifecycle.announce(settled)
        await self.sync.reload([node])
        for r in lost:
            log.warning(
                "job %s lost: %s", r["job_id"], reason, extra=job_context(r["job_id"], node)
            )
        events = [
            Lost(job_id=r["job_id"], node_id=node, reason=reason, owner=r["owner"]) for r in lost
        ]
        cancels = [
            self.publisher.cancel_item(
                node, CancelJob(job_id=r["job_id"], reason=reason, grant_id=r["grant_id"] or "")
            )
            for r in lost
        ]
        await self.publisher.publish([*(self.publisher.event_item(e) for e in events), *cancels])
        self.wake.capacity()

    # --- heartbeats ----------------------------------------------------------------------

    async def on_heartbeat(self, msg: Msg) -> None:
        """A probe's beat keeps its node online; an executor's says grants there will run."""
        try:
            node = node_from_subject(msg.subject)
        except ValueError:
            return
        if node_id_errors(node):
            self._bad_beat(f"node id of subject {msg.subject[:200]!r} is not valid")
            return
        beat = self._executor_beat(msg.data) if b"executor" in msg.data else None
        if beat is not None:
            back = self.fleet.executor_beat(node)
            if back:
                log.info("the executor on node %s is back", node, extra=job_context(node_id=node))
            if self.fleet.set_offer(node, Offer.of(beat)) or back:
                self.wake.capacity()
            return
        self._heartbeats[node] = datetime.now(UTC)
        if self.fleet.set_online(node, True):
            log.info("node %s is back online", node, extra=job_context(node_id=node))
            self.wake.capacity()

    def _executor_beat(self, data: bytes) -> Heartbeat | None:
        """An executor's beat, decoded and within bounds; None for anything else."""
        try:
            beat = decode_message(heartbeat_decoder, data)
        except InvalidInput as err:
            self._bad_beat(str(err))
            return None
        errors = validate_heartbeat(msgspec.structs.replace(beat, node_id="n"))
        if errors:
            self._bad_beat("; ".join(errors))
            return None
        return beat if beat.source == "executor" else None

    def _bad_beat(self, why: str) -> None:
        self.tel.count(
            "gpulayer.messages.rejected", 1, {"subject": "node.heartbeat", "why": "malformed"}
        )
        log.debug("malformed heartbeat counted as the node's: %s", why)

    async def run_heartbeats(self) -> None:
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

    # --- reaping -------------------------------------------------------------------------

    async def reap(self) -> None:
        """Executors silent past the timeout get no new grants; nodes silent past it go
        offline, and their jobs are lost."""
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
                await self.sync.notify(conn, stale)
            settled = await self.lifecycle.settle(conn, lost)
        for node in stale:
            self.fleet.set_online(node, False)
            log.warning("node %s is offline: %s", node, reason, extra=job_context(node_id=node))
        await self.sync.reload(stale)
        await self.announce_lost(lost, reason, settled)

    async def announce_lost(
        self, lost: list[asyncpg.Record], reason: str, settled: Settled
    ) -> None:
        """After the commit that gave up ``lost`` (lose_node_jobs rows) with their node: their
        ``lost`` events, what their ends settled, and a stop for each grant."""
        # The node may be cut off rather than down, its jobs still running: what they held
        # stays fenced until the executor reports each grant's end (release_fences), and each
        # is asked to stop (CONTROL keeps the stop until the executor is back). Each `lost` is
        # named as the executor names a grant's end: of the two (this, and the job's own end
        # reported late by a node that was only cut off) the first stored is the one kept.
        events = [
            self.publisher.event_item(
                Lost(job_id=r["job_id"], node_id=r["node_id"], reason=reason, owner=r["owner"]),
                msg_id=end_msg_id(r["grant_id"]) if r["grant_id"] else None,
            )
            for r in lost
        ]
        cancels = [
            self.publisher.cancel_item(
                r["node_id"],
                CancelJob(
                    job_id=r["job_id"],
                    reason=f"lost: {reason}",
                    grant_id=r["grant_id"],
                    given_up=True,
                ),
            )
            for r in lost
            if r["grant_id"]
        ]
        await self.publisher.publish(events)
        if lost:
            self.wake.capacity()
        await self.lifecycle.announce(settled)
        if cancels:
            await self.publisher.publish_committed(cancels, "stops of jobs lost with their node")
