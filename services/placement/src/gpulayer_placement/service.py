"""The placement service: its parts, wired here and run as named tasks under one monitor.

Parts (each in a file named for it, each taking its collaborators in its constructor):
- ``intake``: job requests from the JOBS work queue: decode, validate, insert, inline placement
  when the scheduler is idle, announce, ack.
- ``scheduler``: waiting jobs matched against the in-memory fleet when ``wake`` says capacity
  may have changed; outcomes persisted, one statement per batch. ``waiting`` says which jobs a
  batch takes and in which order.
- ``publisher``: events, grants and job spans, pipelined; the resend of stale grants.
- ``outbox``: events recorded in a change's transaction (jobs a dependency's end cancelled),
  published after its commit by any replica.
- ``status``: executor reports: job rows updated, devices released, waiting jobs reconsidered.
- ``liveness``: capabilities and heartbeats into memory and PostgreSQL; silent nodes reaped;
  jobs on devices that vanished from a node's detection lost. ``forget``: a node that never
  comes back released for good, at an admin's word.
- ``observations``: the probes' device health into the fleet; warnings to jobs on devices
  that turned unhealthy.
- ``replica_sync``: other replicas' allocation changes (PostgreSQL LISTEN), allocation reloads.
- ``lifecycle`` (with ``dependencies``): when an attempt ends, a retry or a service's restart
  (back to waiting), or the end for good, which releases or cancels the jobs waiting for it.
- ``api``: request/reply for the CLI. ``metrics``: gauges, when telemetry is on.

Tasks: ``ingest``, ``status``, ``schedule``, ``capabilities``, ``heartbeats``,
``observations``, ``reaper``,
``resend``, ``outbox``, ``thorough``, ``audit`` (and ``job-gauges``). One that dies stops the service, so that a
supervisor restarts it rather than leave it half alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Coroutine
from typing import Any

import asyncpg
from nats.aio.client import Client

from gpulayer_contracts.bounds import max_job_bytes
from gpulayer_contracts.capabilities import AcceleratorDevice
from gpulayer_placement.api import Api
from gpulayer_placement.audit import Auditor
from gpulayer_placement.dead_letters import DeadLetters
from gpulayer_placement.fleet import Fleet
from gpulayer_placement.forget import NodeForget
from gpulayer_placement.intake import Intake
from gpulayer_placement.lifecycle import Lifecycle
from gpulayer_placement.limits import api_limit
from gpulayer_placement.liveness import Liveness
from gpulayer_placement.loops import every, until_nats_answers
from gpulayer_placement.metrics import Gauges
from gpulayer_placement.observations import Observations
from gpulayer_placement.outbox import CHANNEL as OUTBOX_CHANNEL
from gpulayer_placement.outbox import Outbox
from gpulayer_placement.policy import Policy, load_active, load_policy
from gpulayer_placement.publisher import Publisher
from gpulayer_placement.replica_sync import ReplicaSync
from gpulayer_placement.scheduler import Scheduler
from gpulayer_placement.settings import Settings
from gpulayer_placement.status import ExecutorStatus
from gpulayer_placement.store import migrate
from gpulayer_placement.wake import Wake
from gpulayer_runtime.jspub import PipelinedPublisher
from gpulayer_runtime.settings import ConfigError
from gpulayer_runtime.signing import Signer
from gpulayer_runtime.telemetry import DISABLED, Telemetry

__all__ = ["PlacementService", "Settings"]

log = logging.getLogger(__name__)


class PlacementService:
    def __init__(
        self,
        nc: Client,
        pool: asyncpg.Pool,
        settings: Settings | None = None,
        telemetry: Telemetry = DISABLED,
        signer: Signer | None = None,
    ) -> None:
        self.nc = nc
        self.pool = pool
        self.settings = settings or Settings()
        self.tel = telemetry
        self.js = nc.jetstream()
        # Tags this replica's allocation changes, so it skips its own NOTIFYs.
        self.replica_id = uuid.uuid4().hex[:12]
        self.fleet = Fleet()
        self.stop = asyncio.Event()
        self.wake = Wake()
        self.signer = signer
        self._wire(telemetry)
        self._tasks: list[asyncio.Task[None]] = []
        # Unsubscribed on close, or draining the connection would wait out its timeout.
        self._subs: list[Any] = []

    def _wire(self, telemetry: Telemetry) -> None:
        """Build the parts, each given the collaborators it calls."""
        nc, js, pool, s = self.nc, self.js, self.pool, self.settings
        fleet, stop, wake = self.fleet, self.stop, self.wake
        # The server's limit, from its INFO (NATS' default before a connection says otherwise).
        max_payload = nc.max_payload or (1 << 20)
        self.dead = DeadLetters(js, telemetry, max_payload)
        # Queue policy (priority, quotas, fair share, reservation, preemption): its active jobs
        # are loaded with the fleet's holds.
        self.policy = policy = Policy()

        async def on_load(conn: Any, nodes: list[str] | None) -> None:
            await load_active(policy, conn, nodes)

        self.sync = ReplicaSync(pool, fleet, wake, stop, self.replica_id, on_load=on_load)
        self.publisher = Publisher(js, pool, s, telemetry, self.signer)
        self.publisher.send_batch = PipelinedPublisher(nc).publish_many
        self.outbox = Outbox(pool, self.publisher, stop)
        self.sync.also[OUTBOX_CHANNEL] = self.outbox.on_notify
        self.auditor = Auditor(js, s.admins, publish_timeout_s=s.publish_timeout_s)
        self.scheduler = Scheduler(
            pool=pool,
            fleet=fleet,
            wake=wake,
            publisher=self.publisher,
            sync=self.sync,
            settings=s,
            stop=stop,
            telemetry=telemetry,
            policy=policy,
        )
        self.intake = Intake(
            js=js,
            pool=pool,
            scheduler=self.scheduler,
            publisher=self.publisher,
            wake=wake,
            settings=s,
            stop=stop,
            telemetry=telemetry,
            dead=self.dead,
            max_payload=max_payload,
            auditor=self.auditor,
        )
        self.lifecycle = Lifecycle(
            publisher=self.publisher, wake=wake, prefer=self.scheduler.prefer
        )
        self._wire_reports(telemetry)
        self._wire_api(telemetry, max_payload)

    def _wire_reports(self, telemetry: Telemetry) -> None:
        """The parts that take what nodes report, and forget a node that never will again."""
        nc, js, pool, s = self.nc, self.js, self.pool, self.settings
        fleet, stop, wake = self.fleet, self.stop, self.wake
        self.status = ExecutorStatus(
            js=js,
            pool=pool,
            fleet=fleet,
            wake=wake,
            forget=self.forget,
            settings=s,
            stop=stop,
            replica_id=self.replica_id,
            telemetry=telemetry,
            dead=self.dead,
            lifecycle=self.lifecycle,
            events=self.publisher.publish_events,
        )
        self.liveness = Liveness(
            nc=nc,
            js=js,
            pool=pool,
            fleet=fleet,
            wake=wake,
            sync=self.sync,
            publisher=self.publisher,
            settings=s,
            stop=stop,
            telemetry=telemetry,
            lifecycle=self.lifecycle,
        )
        self.node_forget = NodeForget(
            pool=pool, fleet=fleet, sync=self.sync, liveness=self.liveness, settings=s
        )

    def _wire_api(self, telemetry: Telemetry, max_payload: int) -> None:
        """What the CLI asks, and the device observations it is answered with."""
        nc, js, pool, s = self.nc, self.js, self.pool, self.settings
        fleet, stop, wake = self.fleet, self.stop, self.wake
        self.api = Api(
            nc=nc,
            js=js,
            pool=pool,
            fleet=fleet,
            publisher=self.publisher,
            forget=self.forget,
            admins=s.admins,
            profiles=s.profiles,
            policy=self.policy,
            limit=api_limit(s.api_rate, s.api_burst, s.admins),
            auditor=self.auditor,
            forget_node=self.node_forget.forget,
        )
        self.observations = Observations(
            nc=nc,
            pool=pool,
            fleet=fleet,
            wake=wake,
            publisher=self.publisher,
            stop=stop,
            telemetry=telemetry,
        )
        self.api.observations = self.observations.latest
        self.publisher.devices_of = self._devices_of
        self.publisher.max_payload = self.api.max_payload = max_payload
        self.gauges = Gauges(pool, fleet, telemetry, self.observations.latest)

    def _devices_of(self, node_id: str) -> list[AcceleratorDevice] | None:
        view = self.fleet.get(node_id)
        return None if view is None else view.capabilities.accelerators

    def forget(self, job_id: str) -> None:
        """Drop what this replica keeps in memory about a job that has ended."""
        self.publisher.forget(job_id)
        self.scheduler.forget(job_id)
        self.policy.remove(job_id)

    async def start(self) -> None:
        """Check the server's max_payload, migrate, load the fleet, subscribe, and start every
        task. Raises ConfigError when the server's max_payload is too small for any job."""
        try:
            max_job_bytes(self.dead.max_payload)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        async with self.pool.acquire() as conn:
            await migrate(conn)
            await self.liveness.load_nodes(conn)
            await self.sync.load_allocations(conn)
            await load_policy(self.policy, conn)
        await self.sync.listen()
        # Consumers are made or looked up through JetStream's API, which may not answer for a
        # while after the servers start (leaders elected) or under load: waited for.
        stop = self.stop
        self._subs += await until_nats_answers(stop, "capabilities", self.liveness.subscribe)
        self._subs += await self.observations.subscribe()
        jobs = await until_nats_answers(stop, "the submits' consumer", self.intake.subscribe)
        status = await until_nats_answers(stop, "the reports' consumer", self.status.subscribe)
        self._subs += [jobs, status]
        self._subs += await self.api.subscribe()
        self._subs.append(await self.dead.watch_advisories(self.nc))
        self.wake.capacity()
        s = self.settings
        self._spawn("ingest", self.intake.run(jobs))
        self._spawn("status", self.status.run(status))
        self._spawn("schedule", self.scheduler.run())
        self._spawn("capabilities", self.liveness.run_capabilities())
        self._spawn("heartbeats", self.liveness.run_heartbeats())
        self._spawn("observations", self.observations.run())
        self._spawn("reaper", every(stop, max(s.node_timeout_s / 3, 0.2), self.liveness.reap))
        self._spawn("resend", every(stop, max(s.resend_after_s / 3, 0.5), self.publisher.resend))
        self._spawn("outbox", self.outbox.run())
        self._spawn("thorough", every(stop, s.thorough_pass_s, self.wake.request_thorough))
        self._spawn("audit", self.auditor.run(stop))
        if self.tel.enabled:
            self.gauges.register()
            self._spawn("job-gauges", every(stop, 5.0, self.gauges.refresh_job_gauges))
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
        """Stop every task, unsubscribe, stop listening."""
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
        with contextlib.suppress(Exception):  # what the audit task had not sent yet
            await asyncio.wait_for(self.auditor.flush(), 2.0)
        self.lifecycle.close()
        await self.sync.close()
