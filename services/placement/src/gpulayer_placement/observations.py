"""Device observations: the probes' health verdicts into the fleet, warnings to running jobs.

Observations come on core NATS (``gpulayer.node.<node>.observations``, every few seconds from
every node) into a bounded queue; each batch keeps the latest message per node. Most carry no
change of health: those cost a decode, a bound check and a dict comparison. A change updates
the node's sick devices in the fleet (recovered devices wake the scheduler); a device that just
turned unhealthy gets each job holding it a ``warning`` event.
"""

from __future__ import annotations

import asyncio
import logging
import time

import asyncpg
import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg

from gpulayer_contracts import Warned
from gpulayer_contracts.bounds import node_id_errors, validate_observations
from gpulayer_contracts.codec import InvalidInput, decode_message, observations_decoder
from gpulayer_contracts.health import NodeObservations
from gpulayer_contracts.subjects import NODE_WILDCARD_OBSERVATIONS, node_from_subject
from gpulayer_placement.fleet import Fleet
from gpulayer_placement.publisher import Publisher
from gpulayer_placement.store import DB_ERRORS, Store
from gpulayer_placement.wake import Wake
from gpulayer_runtime.logs import job_context
from gpulayer_runtime.telemetry import DISABLED, Telemetry

log = logging.getLogger("gpulayer_placement.service")

# Messages waiting to be read: at 10,000 nodes every 5 s, 2,000 a second; far more than that
# waiting means this replica is behind, and older messages are worth less than new ones.
MAX_QUEUED = 50_000
BATCH = 5_000
# Seconds between the log lines saying how many observations came in (one when any did).
SUMMARY_S = 10.0


class Observations:
    def __init__(
        self,
        *,
        nc: Client,
        pool: asyncpg.Pool,
        fleet: Fleet,
        wake: Wake,
        publisher: Publisher,
        stop: asyncio.Event,
        telemetry: Telemetry = DISABLED,
    ) -> None:
        self.nc = nc
        self.pool = pool
        self.fleet = fleet
        self.wake = wake
        self.publisher = publisher
        self.stop = stop
        self.tel = telemetry
        self._queue: asyncio.Queue[Msg] = asyncio.Queue(MAX_QUEUED)
        # The latest valid observations per node, for `gpulayer nodes --devices` and metrics.
        self.latest: dict[str, NodeObservations] = {}
        self.ingested = 0  # messages applied (for the bench and tests)
        self.dropped = 0  # messages refused (bounds, decoding) or dropped (queue full)
        self._summary_at = time.monotonic()
        self._summary = (0, 0)

    async def subscribe(self) -> list[object]:
        return [await self.nc.subscribe(NODE_WILDCARD_OBSERVATIONS, cb=self._on_message)]

    async def _on_message(self, msg: Msg) -> None:
        try:
            self._queue.put_nowait(msg)
        except asyncio.QueueFull:
            self.dropped += 1

    async def run(self) -> None:
        """Batches of the latest message per node, applied in order of arrival."""
        while not self.stop.is_set():
            self._summarize()
            first = await self._queue.get()
            batch = {first.subject: first}
            while not self._queue.empty() and len(batch) < BATCH:
                msg = self._queue.get_nowait()
                batch[msg.subject] = msg
            try:
                await self.apply([self.read(m) for m in batch.values()])
            except Exception:
                # A bug met by one batch: logged, and the next messages are still read.
                log.exception("applying %d observation messages failed", len(batch))

    def _summarize(self) -> None:
        """At most one log line every SUMMARY_S with what came in since the last: an
        operator (and ``make bench``) sees whether placement keeps up with the fleet's probes."""
        now = time.monotonic()
        if now - self._summary_at < SUMMARY_S:
            return
        applied, dropped = self.ingested - self._summary[0], self.dropped - self._summary[1]
        if applied or dropped:
            log.info(
                "observations: %d applied, %d dropped in the last %.1fs",
                applied,
                dropped,
                now - self._summary_at,
            )
        self._summary_at, self._summary = now, (self.ingested, self.dropped)

    def read(self, msg: Msg) -> NodeObservations | None:
        """The message's observations, named by the subject's node; None (counted) when it
        doesn't decode or breaks a bound: one bad message never stops the consumer."""
        try:
            node = node_from_subject(msg.subject)
            if node_id_errors(node):
                raise InvalidInput(f"node id of subject {msg.subject[:200]!r} is not valid")
            obs = decode_message(observations_decoder, msg.data)
            if obs.node_id != node:
                obs = msgspec.structs.replace(obs, node_id=node)
            errors = validate_observations(obs)
            if errors:
                raise InvalidInput("; ".join(errors))
        except (InvalidInput, ValueError) as err:
            self.dropped += 1
            self.tel.count(
                "gpulayer.messages.rejected", 1, {"subject": "node.observations", "why": "invalid"}
            )
            log.debug("rejected observations on %s: %s", msg.subject[:200], err)
            return None
        return obs

    async def apply(self, batch: list[NodeObservations | None]) -> None:
        """Health into the fleet; warnings for jobs on devices that just turned unhealthy."""
        recovered = False
        warn: list[tuple[str, list[int]]] = []
        for obs in batch:
            if obs is None:
                continue
            self.ingested += 1
            self.latest[obs.node_id] = obs
            bad: dict[int, tuple[str, str]] = {
                d.index: (d.health, d.reason or d.health)
                for d in obs.devices
                if d.health != "healthy"
            }
            before = set(self.fleet.bad_devices(obs.node_id))
            changed, newly = self.fleet.set_health(obs.node_id, bad)
            if changed:
                log.info(
                    "health of node %s: %s",
                    obs.node_id,
                    ", ".join(f"GPU {i} {h}: {why}" for i, (h, why) in sorted(bad.items()))
                    or "every GPU healthy",
                    extra=job_context(node_id=obs.node_id),
                )
                recovered = recovered or bool(before - set(bad))
            if newly:
                warn.append((obs.node_id, newly))
        if recovered:
            self.wake.capacity()
        for node, devices in warn:
            await self._warn(node, devices)

    async def _warn(self, node: str, devices: list[int]) -> None:
        health = self.fleet.get(node)
        reasons = health.health if health is not None else {}
        try:
            async with self.pool.acquire() as conn:
                rows = await Store.fetch(conn, "jobs_on_devices", node, devices)
        except DB_ERRORS as err:
            log.warning("finding jobs on unhealthy devices of %s failed: %s", node, err)
            return
        events = [
            Warned(
                job_id=r["job_id"],
                owner=r["owner"] or "anonymous",
                node_id=node,
                devices=devices,
                reason="; ".join(f"GPU {i} {reasons.get(i, 'unhealthy')}" for i in devices),
            )
            for r in rows
        ]
        if events:
            await self.publisher.publish_events(list(events))
