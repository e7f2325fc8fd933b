"""The executor service: consumes grants and cancels for one node, runs jobs, reports.

Shape (procrastinate's worker): a ``stop`` Event ends the service; named side tasks consume
grants, consume cancels and prune old state; each job lives in its own task, bounded by a
Semaphore of ``max_jobs`` slots and no global lock. On start, ``reconcile`` settles whatever a
previous run of the executor left behind before anything new is fetched.

Every state change is reported twice: a ``JobStatus`` on the node's status subject (placement
updates its records and releases devices) and the user-facing job event. Both carry a
``Nats-Msg-Id`` derived from the grant id and the state, so a repeated report is dropped by
JetStream within its duplicate window.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from gpulayer_contracts import Heartbeat, __version__
from gpulayer_contracts.codec import cancel_decoder, encode, grant_decoder
from gpulayer_contracts.events import (
    Cancelled,
    Failed,
    JobEvent,
    JobStatus,
    Lost,
    Running,
    Succeeded,
)
from gpulayer_contracts.subjects import (
    MSG_ID_HEADER,
    job_events,
    node_control,
    node_grants,
    node_heartbeat,
    node_status,
)
from gpulayer_executor import procs
from gpulayer_executor import state as st
from gpulayer_executor.env import EnvRefused, RunAs, device_env, job_environment
from gpulayer_executor.output import LogSink
from gpulayer_executor.runner import SpawnError, StopRequest, run_process
from gpulayer_runtime.logs import job_context
from gpulayer_runtime.telemetry import DISABLED, Telemetry, extract

log = logging.getLogger(__name__)

RESTARTED = "executor restarted"
STOPPED = "executor stopped"


class ExecutorConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Plain settings, filled in by ``__main__`` (or a test); nothing here reads the environment."""

    node_id: str
    workdir: Path
    base_env: dict[str, str]
    run_as: RunAs | None = None
    kill_grace_s: float = 5.0
    max_jobs: int = 64
    drain_s: float = 0.0
    max_line_bytes: int = 16 * 1024
    max_log_backlog_bytes: int = 1 << 20
    retain_s: float = 7 * 24 * 3600.0
    fetch_timeout_s: float = 1.0
    publish_timeout_s: float = 5.0
    # Beats on the node's heartbeat subject (source "executor"): placement stops granting to a
    # node whose executor went silent, instead of queueing grants nobody runs.
    heartbeat_s: float = 5.0


class _Job:
    """A grant this executor holds in memory: queued, starting or running."""

    def __init__(self, rec: st.GrantRecord) -> None:
        self.rec = rec
        # Wall-clock ns: spawn asked, process started (for the job's trace and duration metric).
        self.spawn_ns = 0
        self.started_ns = 0
        self.stop: asyncio.Future[StopRequest] = asyncio.get_running_loop().create_future()
        self.task: asyncio.Task[None] | None = None

    def request_stop(self, request: StopRequest) -> None:
        if not self.stop.done():
            self.stop.set_result(request)


def status_for(rec: st.GrantRecord, node_id: str) -> tuple[JobStatus, JobEvent]:
    """The status message and job event reporting the record's latest state. Pure."""
    job_id, grant_id = rec.job_id, rec.grant_id
    out = rec.outcome
    if out is None:
        proc = rec.process
        pid = proc.pid if proc else None
        at = proc.started_at if proc else rec.received_at
        return (
            JobStatus(
                job_id=job_id, grant_id=grant_id, node_id=node_id, state="running", pid=pid, at=at
            ),
            Running(job_id=job_id, node_id=node_id, pid=pid, at=at),
        )
    status = JobStatus(
        job_id=job_id,
        grant_id=grant_id,
        node_id=node_id,
        state=out.state,
        at=out.at,
        pid=rec.process.pid if rec.process else None,
        exit_code=out.exit_code,
        signal=out.signal,
        reason=out.reason,
    )
    event: JobEvent
    if out.state == "succeeded":
        event = Succeeded(job_id=job_id, node_id=node_id, exit_code=out.exit_code or 0, at=out.at)
    elif out.state == "failed":
        event = Failed(
            job_id=job_id,
            node_id=node_id,
            exit_code=out.exit_code,
            signal=out.signal,
            reason=out.reason,
            at=out.at,
        )
    elif out.state == "cancelled":
        event = Cancelled(job_id=job_id, node_id=node_id, reason=out.reason, at=out.at)
    else:
        event = Lost(job_id=job_id, node_id=node_id, reason=out.reason, at=out.at)
    return status, event


class _DurableWriter:
    """Group commit for the executor's records: one commit in flight at a time, and every
    write asked for meanwhile goes into the next one.

    Grants of a fetched batch are handled concurrently, and jobs start and end concurrently;
    their durable writes then share one fsync instead of queueing for one each. ``create`` and
    ``save`` return once their write is on disk. ``save_soon`` is for writes whose loss in a
    power failure is harmless (the pid of a running job, the "reported" flag): it returns at
    once and the write joins the next commit. Commits run in order, so a record's writes land
    in the order they were asked for."""

    def __init__(self, store: st.StateStore) -> None:
        self._store = store
        self._pending: list[tuple[bool, st.GrantRecord, asyncio.Future[bool] | None]] = []
        self._flusher: asyncio.Task[None] | None = None

    async def create(self, rec: st.GrantRecord) -> bool:
        """True when the record is new (the grant was not known)."""
        return await self._request(True, rec)

    async def save(self, rec: st.GrantRecord) -> None:
        await self._request(False, rec)

    def save_soon(self, rec: st.GrantRecord) -> None:
        self._pending.append((False, rec, None))
        self._wake()

    def _request(self, create: bool, rec: st.GrantRecord) -> asyncio.Future[bool]:
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._pending.append((create, rec, done))
        self._wake()
        return done

    def _wake(self) -> None:
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush_all())

    async def drain(self) -> None:
        """Until every write asked for so far is committed."""
        while self._flusher is not None and not self._flusher.done():
            await asyncio.shield(self._flusher)

    async def _flush_all(self) -> None:
        # Let the tasks made ready with this one ask for their writes first.
        await asyncio.sleep(0)
        while self._pending:
            batch, self._pending = self._pending, []
            creates = [rec for create, rec, _ in batch if create]
            saves = [rec for create, rec, _ in batch if not create]
            try:
                created = await asyncio.to_thread(self._store.write_many, creates, saves)
            except Exception as err:
                log.error("writing %d state records failed: %s", len(batch), err)
                for _, _, done in batch:
                    if done is not None and not done.done():
                        done.set_exception(err)
                continue
            first: set[str] = set()
            for create, rec, done in batch:
                new = create and rec.grant_id in created and rec.grant_id not in first
                if create:
                    first.add(rec.grant_id)
                if done is not None and not done.done():
                    done.set_result(new)


class Executor:
    def __init__(self, nc: Client, config: ExecutorConfig, telemetry: Telemetry = DISABLED) -> None:
        self.nc = nc
        self.tel = telemetry
        self.js: JetStreamContext = nc.jetstream()
        self.config = config
        self.node_id = config.node_id
        self.store = st.StateStore(config.workdir)
        self._durable = _DurableWriter(self.store)
        self._slots = asyncio.Semaphore(config.max_jobs)
        self._jobs: dict[str, _Job] = {}
        self._stopping = asyncio.Event()
        self._side_tasks: list[asyncio.Task[None]] = []
        self._subs: list[JetStreamContext.PullSubscription] = []
        self.ready = asyncio.Event()  # set once reconciled and consuming

    # --- lifecycle -------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set, then shut down (see docs/executor.md, "Stopping")."""
        self.store.root.chmod(0o711)
        self.store.jobs_dir.chmod(0o711)
        grants = await self._subscribe(
            node_grants(self.node_id), f"executor-{self.node_id}", "GRANTS"
        )
        control = await self._subscribe(
            node_control(self.node_id), f"executor-{self.node_id}-control", "CONTROL"
        )
        self._subs = [grants, control]
        await self.reconcile()
        self._side_tasks = [
            asyncio.create_task(self._consume(grants, self._on_grant), name="grants"),
            asyncio.create_task(self._consume(control, self._on_cancel), name="control"),
            asyncio.create_task(self._janitor(), name="janitor"),
            asyncio.create_task(self._heartbeat(), name="heartbeat"),
        ]
        log.info("executor for node %s serving (max_jobs=%s)", self.node_id, self.config.max_jobs)
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
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        running = [j.task for j in self._jobs.values() if j.task and j.rec.phase != "received"]
        if running and self.config.drain_s > 0:
            log.info("waiting up to %ss for %d running jobs", self.config.drain_s, len(running))
            await asyncio.wait(running, timeout=self.config.drain_s)
        for job in list(self._jobs.values()):
            job.request_stop(StopRequest(state="lost", reason=STOPPED))
        tasks = [j.task for j in self._jobs.values() if j.task]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        await self._durable.drain()
        self.store.close()
        log.info("executor for node %s stopped", self.node_id)

    async def _subscribe(
        self, subject: str, durable: str, stream: str
    ) -> JetStreamContext.PullSubscription:
        config = ConsumerConfig(
            durable_name=durable,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            ack_wait=30.0,
        )
        return await self.js.pull_subscribe(subject, durable=durable, stream=stream, config=config)

    async def _consume(
        self, sub: JetStreamContext.PullSubscription, handle: Callable[[Msg], Awaitable[None]]
    ) -> None:
        while not self._stopping.is_set():
            try:
                msgs = await sub.fetch(64, timeout=self.config.fetch_timeout_s)
            except TimeoutError:  # nothing to fetch (nats' TimeoutError is one too)
                continue
            except (nats.errors.Error, OSError) as err:
                log.warning("fetch failed, retrying: %r", err)
                await asyncio.sleep(1.0)
                continue
            # A fetched batch is handled concurrently, and the grants' durable records are
            # written in one commit (_DurableWriter).
            await asyncio.gather(*(self._handle_one(handle, msg) for msg in msgs))

    @staticmethod
    async def _handle_one(handle: Callable[[Msg], Awaitable[None]], msg: Msg) -> None:
        try:
            await handle(msg)
        except Exception:
            # Not acked: JetStream redelivers it after ack_wait, and the local record (if it got
            # that far) makes the retry harmless.
            log.exception("handling %s failed", msg.subject)

    async def _heartbeat(self) -> None:
        subject = node_heartbeat(self.node_id)
        while not self._stopping.is_set():
            beat = Heartbeat(
                node_id=self.node_id,
                sent_at=datetime.now(UTC),
                source="executor",
                agent_version=__version__,
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

    # --- grants and cancels -----------------------------------------------------------------

    async def _on_grant(self, msg: Msg) -> None:
        try:
            grant = grant_decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            log.error("malformed grant on %s dropped: %s", msg.subject, err)
            await msg.ack()
            return
        if grant.node_id != self.node_id:
            # Identity comes from the subject; a payload naming another node is a placement bug
            # or a forgery, and running it here would use devices placement gave to someone else.
            reason = (
                f"grant for node {grant.node_id!r} was delivered to node {self.node_id!r}; refused"
            )
            log.error(
                "grant %s for job %s: %s",
                grant.grant_id,
                grant.job.job_id,
                reason,
                extra=job_context(grant.job.job_id, self.node_id),
            )
            rec = st.finished(st.received(grant), st.Outcome(state="failed", reason=reason))
            if await asyncio.to_thread(self.store.create, rec):
                await msg.ack()
                await self._report_finished(rec)
            else:
                await msg.ack()
            return
        if self.tel.enabled and (msg.metadata.num_delivered or 0) > 1:
            self.tel.count("gpulayer.consumer.redeliveries", 1, {"consumer": "executor-grants"})
        rec = msgspec.structs.replace(
            st.received(grant), traceparent=(msg.headers or {}).get("traceparent")
        )
        if not await self._durable.create(rec):
            log.warning(
                "grant %s for job %s delivered again; ignored",
                grant.grant_id,
                grant.job.job_id,
                extra=self._ctx(rec),
            )
            await msg.ack()
            return
        await msg.ack()
        log.debug("grant %s: job %s accepted", grant.grant_id, grant.job.job_id)
        self._launch(rec)

    async def _on_cancel(self, msg: Msg) -> None:
        try:
            cancel = cancel_decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            log.error("malformed cancel on %s dropped: %s", msg.subject, err)
            await msg.ack()
            return
        # Remembered durably first: a grant for this job arriving later (the two streams are not
        # ordered with each other) or still queued after a restart is then never started.
        await asyncio.to_thread(self.store.mark_cancel, cancel.job_id, cancel.reason)
        await msg.ack()
        jobs = [j for j in self._jobs.values() if j.rec.job_id == cancel.job_id]
        log.info(
            "cancel for job %s (%s): %d active grants", cancel.job_id, cancel.reason, len(jobs)
        )
        for job in jobs:
            job.request_stop(StopRequest(state="cancelled", reason=cancel.reason))

    # --- one job's life ---------------------------------------------------------------------

    def _ctx(self, rec: st.GrantRecord) -> dict[str, str]:
        """Log ``extra`` naming the job, this node and the job's trace (JSON log lines)."""
        return job_context(rec.job_id, self.node_id, rec.traceparent)

    def _launch(self, rec: st.GrantRecord) -> None:
        job = _Job(rec)
        self._jobs[rec.grant_id] = job
        job.task = asyncio.create_task(self._job_life(job), name=f"job-{rec.job_id}-{rec.grant_id}")

    async def _save(self, job: _Job, rec: st.GrantRecord, *, durable: bool = True) -> None:
        if durable:
            await self._durable.save(rec)
        else:
            self._durable.save_soon(rec)
        job.rec = rec

    async def _job_life(self, job: _Job) -> None:
        try:
            outcome = await self._queued_then_run(job)
            if outcome is not None:
                await self._finish(job, outcome)
        except Exception:
            log.exception(
                "job %s (grant %s): executor error",
                job.rec.job_id,
                job.rec.grant_id,
                extra=self._ctx(job.rec),
            )
            if job.rec.phase != "finished":
                with contextlib.suppress(Exception):
                    await self._finish(job, st.Outcome(state="lost", reason="executor error"))
        finally:
            self._jobs.pop(job.rec.grant_id, None)

    async def _acquire_slot(self, job: _Job) -> bool:
        """Wait for a free slot, unless the job is stopped first."""
        acquire = asyncio.create_task(self._slots.acquire())
        either: set[asyncio.Future[Any]] = {acquire, job.stop}
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if not acquire.done():
            acquire.cancel()
        try:
            await acquire
        except asyncio.CancelledError:
            return False
        if job.stop.done():
            self._slots.release()
            return False
        return True

    async def _queued_then_run(self, job: _Job) -> st.Outcome | None:
        """The outcome to report, or None when the job stays queued for the next run."""
        mark = self.store.cancel_mark(job.rec.job_id)  # a stat, and a small read if marked
        if mark is not None:
            job.request_stop(StopRequest(state="cancelled", reason=mark.reason))
        if not await self._acquire_slot(job):
            request = job.stop.result()
            if request.state == "lost":
                # Executor stopping: the job never started, so it stays "received" on disk and
                # the next run starts it. Nothing is reported, nothing is lost.
                return None
            return st.Outcome(state="cancelled", reason=request.reason)
        try:
            return await self._run(job)
        finally:
            self._slots.release()

    async def _run(self, job: _Job) -> st.Outcome:
        grant = job.rec.grant
        try:
            env = job_environment(grant, self.config.base_env)
        except EnvRefused as err:
            log.warning("job %s refused: %s", grant.job.job_id, err, extra=self._ctx(job.rec))
            return st.Outcome(state="failed", reason=str(err))
        if grant.visible_env and grant.visible_env != device_env(grant):
            log.warning(
                "grant %s: placement's visible_env %s differs from the rule's %s; using the rule",
                grant.grant_id,
                grant.visible_env,
                device_env(grant),
            )
        cwd = self.store.job_dir(grant.grant_id)
        self._prepare_dir(cwd)  # mkdir and chmod: no disk flush, cheaper than a thread hand-off
        await self._save(job, st.starting(job.rec))
        sink = LogSink(
            self.js, grant.job.job_id, max_backlog_bytes=self.config.max_log_backlog_bytes
        )
        sink.start()

        async def on_started(info: st.ProcessInfo) -> None:
            job.started_ns = time.time_ns()
            await self._save(job, st.running(job.rec, info), durable=False)
            log.debug("job %s running as pid %s in %s", grant.job.job_id, info.pid, cwd)
            # Whether "running" got out is not recorded: after a restart a job that was running
            # is reported lost either way, and the terminal report supersedes it.
            await self._report(job.rec)

        job.spawn_ns = time.time_ns()
        try:
            return await run_process(
                grant.job.command,
                env=env,
                cwd=cwd,
                run_as=self.config.run_as,
                timeout_s=grant.job.timeout_s,
                kill_grace_s=self.config.kill_grace_s,
                stop=job.stop,
                sink=sink,
                max_line_bytes=self.config.max_line_bytes,
                on_started=on_started,
            )
        except SpawnError as err:
            log.warning("job %s: %s", grant.job.job_id, err, extra=self._ctx(job.rec))
            return st.Outcome(state="failed", reason=f"spawn: {err}")
        finally:
            await sink.close()
            if sink.dropped_total:
                log.warning(
                    "job %s: %d output lines dropped",
                    grant.job.job_id,
                    sink.dropped_total,
                    extra=self._ctx(job.rec),
                )

    def _prepare_dir(self, cwd: Path) -> None:
        cwd.mkdir(parents=True, exist_ok=True)
        if self.config.run_as is not None:
            os.chown(cwd, self.config.run_as.uid, self.config.run_as.gid)
        cwd.chmod(0o700)

    async def _finish(self, job: _Job, outcome: st.Outcome) -> None:
        await self._save(job, st.finished(job.rec, outcome))
        if self.tel.enabled:
            self._trace_job(job, outcome)
        log.info(
            "job %s (grant %s) %s%s",
            job.rec.job_id,
            job.rec.grant_id,
            outcome.state,
            f": {outcome.reason}" if outcome.reason else "",
            extra=self._ctx(job.rec),
        )
        await self._report_finished(job.rec)

    def _trace_job(self, job: _Job, outcome: st.Outcome) -> None:
        """The job's run as spans under the grant's trace (the submitter's), and its metrics.

        Recorded when the job ends, with the measured times: a span left open across an
        executor restart would never be exported anyway."""
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind, Status, StatusCode

        grant = job.rec.grant
        end = time.time_ns()
        begin = job.spawn_ns or end
        attrs: dict[str, Any] = {
            "messaging.system": "nats",
            "gpulayer.job.id": grant.job.job_id,
            "gpulayer.node.id": self.node_id,
            "gpulayer.accelerator": grant.accelerator,
            "gpulayer.devices": grant.devices,
            "gpulayer.outcome": outcome.state,
        }
        if outcome.exit_code is not None:
            attrs["process.exit.code"] = outcome.exit_code
        tracer = self.tel.tracer
        parent = extract({"traceparent": job.rec.traceparent}) if job.rec.traceparent else None
        root = tracer.start_span(
            "executor run",
            context=parent,
            kind=SpanKind.CONSUMER,
            attributes=attrs,
            start_time=begin,
        )
        ctx = trace.set_span_in_context(root)
        if job.started_ns:
            tracer.start_span("executor start", context=ctx, start_time=begin).end(
                end_time=job.started_ns
            )
            tracer.start_span("executor process", context=ctx, start_time=job.started_ns).end(
                end_time=end
            )
        if outcome.state != "succeeded":
            root.set_status(Status(StatusCode.ERROR, outcome.reason or outcome.state))
        root.end(end_time=end)
        labels = {"outcome": outcome.state, "accelerator": grant.accelerator}
        self.tel.count("gpulayer.executor.jobs", 1, labels)
        if job.started_ns:
            self.tel.record("gpulayer.executor.job.duration", (end - job.started_ns) / 1e9, labels)

    async def _report_finished(self, rec: st.GrantRecord) -> None:
        if await self._report(rec):
            self._durable.save_soon(st.reported(rec))

    # --- reporting --------------------------------------------------------------------------

    async def _report(self, rec: st.GrantRecord) -> bool:
        """Publish the record's state to placement and to the job's events. True when both
        were stored; False leaves the record unreported for the next start to retry."""
        status, event = status_for(rec, self.node_id)
        msg_id = f"{rec.grant_id}:{status.state}"
        # Independent streams: both in flight at once, one round trip instead of two.
        to_placement, to_user = await asyncio.gather(
            self._publish(node_status(self.node_id), encode(status), msg_id),
            self._publish(job_events(rec.job_id), encode(event), msg_id),
        )
        return to_placement and to_user

    async def _publish(self, subject: str, payload: bytes, msg_id: str) -> bool:
        delay = 0.2
        attempts = 0
        while True:
            attempts += 1
            try:
                await self.js.publish(
                    subject,
                    payload,
                    timeout=self.config.publish_timeout_s,
                    headers={MSG_ID_HEADER: msg_id},
                )
                return True
            except (nats.errors.Error, OSError) as err:
                # While serving, keep trying (NATS may be restarting); once stopping, a few
                # tries and the unreported record waits for the next start.
                if self._stopping.is_set() and attempts >= 3:
                    log.error("could not publish %s to %s: %s", msg_id, subject, err)
                    return False
                log.warning("publishing %s failed, retrying: %s", msg_id, err)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    # --- restart ----------------------------------------------------------------------------

    async def reconcile(self) -> None:
        """Settle every grant a previous run left unfinished or unreported.

        - finished but unreported: report it (Nats-Msg-Id makes a repeat harmless);
        - received (never spawned): queue it, unless its job was cancelled meanwhile;
        - starting or running: the process may still run, but we no longer hold its pipes or
          its exit status, so kill its group if it is still ours and report ``lost``. Never
          started again.
        """
        records = await asyncio.to_thread(self.store.unsettled)
        settle = []
        for rec in records:
            if rec.phase == "finished":
                if not rec.reported:
                    settle.append(self._report_finished(rec))
            elif rec.phase == "received":
                log.info("grant %s (job %s) was queued; starting it", rec.grant_id, rec.job_id)
                self._launch(rec)
            else:
                settle.append(self._settle_orphan(rec))
        if settle:
            await asyncio.gather(*settle)

    async def _settle_orphan(self, rec: st.GrantRecord) -> None:
        proc = rec.process
        if proc is not None and procs.owns_group(proc.pgid, proc.start_ticks, proc.boot_id):
            log.warning(
                "job %s (grant %s): killing orphaned group %s",
                rec.job_id,
                rec.grant_id,
                proc.pgid,
                extra=self._ctx(rec),
            )
            await procs.terminate_group(proc.pgid, self.config.kill_grace_s)
        elif proc is None:
            # Crashed between spawn and recording the pid: the job's environment names the grant,
            # so its processes can still be found (Linux) and their groups killed.
            pids = await asyncio.to_thread(procs.find_by_env, "GPULAYER_GRANT_ID", rec.grant_id)
            groups = {g for g in map(procs.pgid_of, pids) if g is not None and g > 1}
            for pgid in groups:
                log.warning(
                    "job %s: killing unrecorded group %s", rec.job_id, pgid, extra=self._ctx(rec)
                )
            await asyncio.gather(
                *(procs.terminate_group(g, self.config.kill_grace_s) for g in groups)
            )
        else:
            log.warning(
                "job %s (grant %s): process gone while the executor was down",
                rec.job_id,
                rec.grant_id,
                extra=self._ctx(rec),
            )
        job = _Job(rec)
        await self._finish(job, st.Outcome(state="lost", reason=RESTARTED))
