"""The executor service: consumes grants and cancels for one node, runs jobs, reports.

A service of parts wired here (procrastinate's worker): ``GrantIntake`` consumes grants and
cancels, ``JobRunner`` holds each job's life in its own task, bounded by ``max_jobs`` slots,
``Reporter`` publishes every state change (a ``JobStatus`` for placement and the user's job
event, both with ``Nats-Msg-Id`` = ``<grant id>:<state>``), ``Reconciler`` settles at start
whatever a previous run left behind before anything new is fetched, and ``DurableWriter``
group-commits the grant records of ``StateStore``. This module only builds them, runs the
named side tasks (grants, control, janitor, heartbeat) and shuts down in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import UTC, datetime

import nats.errors
from nats.aio.client import Client
from nats.js import JetStreamContext

from gpulayer_contracts import Heartbeat, __version__
from gpulayer_contracts.codec import encode
from gpulayer_contracts.subjects import node_heartbeat
from gpulayer_executor import cgroup_spare, cgroups, container
from gpulayer_executor import state as st
from gpulayer_executor.config import ExecutorConfig
from gpulayer_executor.folders import empty_trash
from gpulayer_executor.intake import GrantIntake
from gpulayer_executor.job_runner import JobRunner
from gpulayer_executor.reconcile import Reconciler
from gpulayer_executor.reporter import Reporter
from gpulayer_executor.runner import run_process
from gpulayer_executor.shim_client import ShimLauncher
from gpulayer_executor.shim_pool import ForkServer
from gpulayer_executor.writer import DurableWriter
from gpulayer_runtime.signing import Verifier, parse_public_keys
from gpulayer_runtime.telemetry import DISABLED, Telemetry

__all__ = ["STOPPED", "Executor", "ExecutorConfig"]

log = logging.getLogger(__name__)

STOPPED = "executor stopped"


def _verifier(config: ExecutorConfig) -> Verifier | None:
    """The signature check of grants and cancels; a config requiring signatures without a key
    is an error here, never an executor that silently refuses everything."""
    if not config.require_signatures:
        log.warning("grant signing is OFF: any NATS client can make this node run a command")
        return None
    keys = parse_public_keys(",".join(config.placement_public_keys))
    return Verifier(keys, max_age_s=config.grant_max_age_s)


class Executor:
    def __init__(self, nc: Client, config: ExecutorConfig, telemetry: Telemetry = DISABLED) -> None:
        self.nc = nc
        self.tel = telemetry
        self.js: JetStreamContext = nc.jetstream()
        self.config = config
        self.node_id = config.node_id
        self.store = st.StateStore(config.workdir)
        # Set once shutting down: consumers stop fetching, and the reporter stops retrying
        # a failed publish forever (the record waits for the next start instead).
        self._stopping = asyncio.Event()
        self.writer = DurableWriter(self.store)
        self.reporter = Reporter(
            self.js,
            self.node_id,
            self.writer,
            self._stopping,
            publish_timeout_s=config.publish_timeout_s,
        )
        # Decided once per process (cgroups.hierarchy is cached): said in every heartbeat.
        self.hierarchy = cgroups.hierarchy(config.enforce)
        self.enforcement = cgroups.enforcement(self.hierarchy)
        # Jobs started through shims outlive this process (docs/executor.md, "Shims").
        self.fork_server = ForkServer() if config.shim else None
        self.run_root = self.store.run_dir if config.shim else None
        launcher = ShimLauncher(self.store.run_dir, self.fork_server) if self.fork_server else None
        self.runner = JobRunner(
            nc,
            self.js,
            config,
            self.store,
            self.writer,
            self.reporter,
            telemetry,
            launch=launcher or run_process,
            hierarchy=self.hierarchy,
        )
        self.reconciler = Reconciler(
            self.store,
            self.runner,
            self.reporter,
            node_id=self.node_id,
            kill_grace_s=config.kill_grace_s,
            run_root=self.run_root,
        )
        self.intake = GrantIntake(
            self.js,
            self.node_id,
            self.store,
            self.writer,
            self.runner,
            self.reporter,
            self._stopping,
            telemetry,
            fetch_timeout_s=config.fetch_timeout_s,
            verifier=_verifier(config),
        )
        self._side_tasks: list[asyncio.Task[None]] = []
        self._sweep: asyncio.Task[None] | None = None
        self._trash_removal: asyncio.Future[None] | None = None
        self.ready = asyncio.Event()  # set once reconciled and consuming

    async def _sweep_containers(self) -> None:
        """Remove the containers an earlier run of this executor left whose job is not held
        now (its shim gone, or killed before it could remove them): nothing of an ended job
        stays on the node. Other executors' containers carry another label and are left."""
        podman = self.config.podman
        assert podman is not None
        try:
            await self._remove_leftovers(podman)
        except Exception:
            log.exception("looking for leftover containers failed")

    async def _remove_leftovers(self, podman: str) -> None:
        found = await asyncio.to_thread(container.leftovers, podman, self.config.workdir)
        for name, grant_id in found.items():
            if grant_id in self.runner.jobs:
                continue
            log.info("removing container %s (grant %s): no job of it runs", name, grant_id)
            error = await asyncio.to_thread(container.remove, podman, name)
            if error is not None:
                log.warning("container %s not removed: %s", name, error)

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set, then shut down (see docs/executor.md, "Stopping")."""
        if self.fork_server is not None:
            self.fork_server.start()
        # Leftovers of a removal an earlier run did not finish go in a thread meanwhile.
        self._trash_removal = empty_trash(self.store.trash_dir)
        await self.intake.subscribe()
        await self.reconciler.reconcile()
        if swept := cgroup_spare.sweep(self.hierarchy):
            log.info("removed %d spare cgroups of shims that are gone", swept)
        if self.config.podman is not None:
            # Once, beside serving: it ends, where a side task ending stops the executor.
            self._sweep = asyncio.create_task(self._sweep_containers(), name="containers")
        self._side_tasks = [
            asyncio.create_task(self.intake.consume_grants(), name="grants"),
            asyncio.create_task(self.intake.consume_cancels(), name="control"),
            asyncio.create_task(self._janitor(), name="janitor"),
            asyncio.create_task(self._heartbeat(), name="heartbeat"),
        ]
        log.info(
            "executor for node %s serving (max_jobs=%s, enforcement: %s)",
            self.node_id,
            self.config.max_jobs,
            self.enforcement,
        )
        self.ready.set()
        stop_wait = asyncio.create_task(stop.wait(), name="stop")
        try:
            await asyncio.wait([stop_wait, *self._side_tasks], return_when=asyncio.FIRST_COMPLETED)
            for task in self._side_tasks:
                if task.done() and not task.cancelled() and task.exception() is not None:
                    log.error("side task %s died", task.get_name(), exc_info=task.exception())
        finally:
            stop_wait.cancel()
            await self._shutdown()

    async def _shutdown(self) -> None:
        self._stopping.set()
        # The consumers notice the flag after their current fetch; cancelling a fetch midway
        # could leave a delivered grant half-handled (it would only be redelivered, but why).
        consumers = [t for t in self._side_tasks if t.get_name() != "janitor"]
        if consumers:
            await asyncio.wait(consumers, timeout=self.config.fetch_timeout_s + 5.0)
        for task in self._side_tasks:
            task.cancel()
        await asyncio.gather(*self._side_tasks, return_exceptions=True)
        if self._sweep is not None:
            await asyncio.gather(self._sweep, return_exceptions=True)
        await self.intake.unsubscribe()
        await self.runner.shutdown(self.config.drain_s, STOPPED)
        await self.writer.drain()
        if self.fork_server is not None:
            await self.fork_server.close()
        self.store.close()
        log.info("executor for node %s stopped", self.node_id)

    async def _heartbeat(self) -> None:
        subject = node_heartbeat(self.node_id)
        while not self._stopping.is_set():
            beat = Heartbeat(
                node_id=self.node_id,
                sent_at=datetime.now(UTC),
                source="executor",
                agent_version=__version__,
                slots=self.config.max_jobs,
                reserved_cores=self.config.reserved_cores,
                reserved_memory_gb=self.config.reserved_memory_gb,
                enforcement=self.enforcement,
            )
            try:
                await self.nc.publish(subject, encode(beat))
            except (nats.errors.Error, OSError) as err:
                log.warning("heartbeat failed: %s", err)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.config.heartbeat_s)

    async def _janitor(self) -> None:
        while True:
            pruned = await asyncio.to_thread(self.store.prune, self.config.retain_s)
            if pruned:
                log.info("pruned %d old grant records", pruned)
            await asyncio.sleep(3600)
