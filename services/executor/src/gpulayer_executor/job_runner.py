"""One job's life, from a recorded grant to its reported end: a slot, the spawn, the wait, the
finish. Each job lives in its own task; ``max_jobs`` slots bound how many run at once, with no
lock around a job's life (placement's grants bound what runs on the node).

Durable order per job: ``starting`` is on disk before the spawn, ``finished`` before the final
report; ``running`` (the pid) and ``reported`` join the next commit without being waited for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import msgspec
from nats.aio.client import Client
from nats.js import JetStreamContext

from gpulayer_contracts.events import Grant
from gpulayer_contracts.jobenv import EnvRefused, grant_device_env, grant_environment
from gpulayer_executor import state as st
from gpulayer_executor.cgroups import Hierarchy
from gpulayer_executor.config import ExecutorConfig
from gpulayer_executor.container import ContainerError
from gpulayer_executor.container_jobs import RanImages, launch_argv, remove_lost
from gpulayer_executor.env import RunAs, account_env
from gpulayer_executor.folders import clear_scratch, prepare_job_dir, scratch_dir
from gpulayer_executor.gang import LaunchRefused
from gpulayer_executor.limits import JobLimits, NvidiaNodes, job_limits
from gpulayer_executor.output import LogSink
from gpulayer_executor.reporter import Reporter
from gpulayer_executor.runner import OnStarted, SpawnError, StopRequest, run_process
from gpulayer_executor.shim_client import Detached, Follower
from gpulayer_executor.torchrun import RootCause
from gpulayer_executor.users import run_as_for
from gpulayer_executor.writer import DurableWriter
from gpulayer_runtime.logs import job_context
from gpulayer_runtime.telemetry import DISABLED, Telemetry, extract

# The executor's lines keep the logger name they had before it was split into parts.
log = logging.getLogger("gpulayer_executor.service")


class Launch(Protocol):
    """Runs a job's process to its end (``runner.run_process``). The seam where another way of
    launching plugs in (a supervisor shim, a cgroup per job) without touching a job's life. A
    container job also gets ``container=`` (``container.ContainerRun``): only the shim's
    launcher runs one."""

    def __call__(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: Path,
        run_as: RunAs | None,
        timeout_s: float | None,
        kill_grace_s: float,
        stop: asyncio.Future[StopRequest],
        sink: LogSink,
        max_line_bytes: int,
        on_started: OnStarted,
        hierarchy: Hierarchy | None,
        limits: JobLimits | None,
    ) -> Awaitable[st.Outcome]: ...


class Job:
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


class JobRunner:
    """Holds the jobs of this executor, each in its own task, and the slots they run in."""

    def __init__(
        self,
        nc: Client,
        js: JetStreamContext,
        config: ExecutorConfig,
        store: st.StateStore,
        writer: DurableWriter,
        reporter: Reporter,
        telemetry: Telemetry = DISABLED,
        *,
        launch: Launch = run_process,
        hierarchy: Hierarchy | None = None,
    ) -> None:
        self._nc = nc
        self._js = js
        self._config = config
        self._node_id = config.node_id
        self._store = store
        self._writer = writer
        self._reporter = reporter
        self._tel = telemetry
        self._launch_process = launch
        # Where each job's cgroup is made (None: none); its limits only where it enforces.
        self._hierarchy = hierarchy
        self._devices = NvidiaNodes(config.device_dir)
        self._ran = RanImages()
        self._slots = asyncio.Semaphore(config.max_jobs)
        self._jobs: dict[str, Job] = {}
        # Grants placement gave up (lost with their node) being stopped: their end is told to
        # placement alone (Outcome.told).
        self._told: set[str] = set()

    @property
    def hierarchy(self) -> Hierarchy | None:
        """Where job cgroups are made (None: nowhere)."""
        return self._hierarchy

    @property
    def jobs(self) -> Mapping[str, Job]:
        """The jobs held now (queued, starting or running), by grant id."""
        return self._jobs

    def _ctx(self, rec: st.GrantRecord) -> dict[str, str]:
        """Log ``extra`` naming the job, this node and the job's trace (JSON log lines)."""
        return job_context(rec.job_id, self._node_id, rec.traceparent)

    def launch(self, rec: st.GrantRecord) -> None:
        """Take a recorded grant (``received``, on disk) into its own task."""
        job = Job(rec)
        self._jobs[rec.grant_id] = job
        job.task = asyncio.create_task(self._job_life(job), name=f"job-{rec.job_id}-{rec.grant_id}")

    def cancel(
        self, job_id: str, reason: str, grant_id: str = "", *, given_up: bool = False
    ) -> int:
        """Stop every grant of the job held here, or only ``grant_id`` when given (queued ones
        never start); how many. ``given_up``: placement ended the job already (its end is then
        reported to placement alone)."""
        jobs = [
            j
            for j in self._jobs.values()
            if j.rec.job_id == job_id and grant_id in ("", j.rec.grant_id)
        ]
        if given_up:
            self._told.update(j.rec.grant_id for j in jobs)
        for job in jobs:
            job.request_stop(StopRequest(state="cancelled", reason=reason))
        return len(jobs)

    async def shutdown(self, drain_s: float, reason: str) -> None:
        """Let running jobs finish for up to ``drain_s``, then stop every job held (reported
        ``lost`` with ``reason``; a queued one stays ``received`` for the next start)."""
        running = [j.task for j in self._jobs.values() if j.task and j.rec.phase != "received"]
        if running and drain_s > 0:
            log.info("waiting up to %ss for %d running jobs", drain_s, len(running))
            await asyncio.wait(running, timeout=drain_s)
        for job in list(self._jobs.values()):
            job.request_stop(StopRequest(state="lost", reason=reason))
        tasks = [j.task for j in self._jobs.values() if j.task]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def end(self, rec: st.GrantRecord, outcome: st.Outcome) -> None:
        """Finish a record no task of this run holds (one a previous run left) and report it."""
        await self._finish(Job(rec), outcome)

    async def _save(self, job: Job, rec: st.GrantRecord, *, durable: bool = True) -> None:
        if durable:
            await self._writer.save(rec)
        else:
            self._writer.save_soon(rec)
        job.rec = rec

    async def _job_life(self, job: Job) -> None:
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

    async def _acquire_slot(self, job: Job) -> bool:
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

    async def _queued_then_run(self, job: Job) -> st.Outcome | None:
        """The outcome to report, or None when the job stays queued for the next run."""
        # A stat, and a small read if marked.
        mark = self._store.cancel_mark(job.rec.job_id, job.rec.grant_id)
        if mark is not None:
            if mark.given_up:
                self._told.add(job.rec.grant_id)
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

    def _environment(
        self, job: Job, run_as: RunAs | None, cwd: Path
    ) -> dict[str, str] | st.Outcome:
        """The job's environment, or the outcome of a job refused for it."""
        grant = job.rec.grant
        base = dict(self._config.base_env)
        if self._config.job_tmpdir:
            base["TMPDIR"] = str(scratch_dir(cwd))
        if run_as is not None:
            base.update(account_env(run_as, cwd))
        try:
            env = grant_environment(grant, base)
        except EnvRefused as err:
            log.warning("job %s refused: %s", grant.job.job_id, err, extra=self._ctx(job.rec))
            return st.Outcome(state="failed", reason=str(err))
        if grant.visible_env and grant.visible_env != grant_device_env(grant):
            log.warning(
                "grant %s: placement's visible_env %s differs from the rule's %s; using the rule",
                grant.grant_id,
                grant.visible_env,
                grant_device_env(grant),
            )
        return env

    def _account(self, grant: Grant) -> RunAs | None:
        """The job's account: its owner's in the map; else, with owner uids on, the owner's own
        uid (no passwd entry needed: HOME is the job's folder); else the job user."""
        config = self._config
        if config.owner_uids is None or grant.owner in config.user_map:
            return run_as_for(grant, config.run_as, config.user_map)
        uid = self._store.owner_uid(grant.owner, *config.owner_uids)
        return RunAs(name=f"gpulayer-{grant.owner}", uid=uid, gid=uid, home="")

    async def _run(self, job: Job) -> st.Outcome | None:
        grant = job.rec.grant
        try:
            run_as = self._account(grant)
        except ValueError as err:
            return st.Outcome(state="failed", reason=f"no account for the job: {err}")
        cwd = self._store.job_dir(grant.grant_id)
        env = self._environment(job, run_as, cwd)
        if isinstance(env, st.Outcome):
            return env
        launch = self._argv(job, run_as, cwd, env)
        if isinstance(launch, st.Outcome):
            return launch
        argv, extra = launch
        prepare_job_dir(cwd, run_as)  # no disk flush: cheaper than a thread hand-off
        await self._save(job, st.starting(job.rec))
        sink = self._sink(grant)
        on_started = self._on_started(job)
        job.spawn_ns = time.time_ns()
        try:
            outcome = await self._launch_process(
                argv,
                env=env,
                cwd=cwd,
                run_as=run_as,
                timeout_s=grant.job.timeout_s,
                kill_grace_s=self._config.kill_grace_s,
                stop=job.stop,
                sink=sink,
                max_line_bytes=self._config.max_line_bytes,
                on_started=on_started,
                hierarchy=self._hierarchy,
                limits=self._limits(grant) if not extra else None,
                **extra,
            )
            self._ran.record(grant, outcome)
            return _explained(outcome, sink)
        except SpawnError as err:
            log.warning("job %s: %s", grant.job.job_id, err, extra=self._ctx(job.rec))
            return st.Outcome(state="failed", reason=f"spawn: {err}")
        except Detached:
            log.info(
                "job %s left running under its shim", grant.job.job_id, extra=self._ctx(job.rec)
            )
            return None
        finally:
            await self._close_sink(job, sink)

    def _argv(
        self, job: Job, run_as: RunAs | None, cwd: Path, env: dict[str, str]
    ) -> tuple[list[str], dict[str, Any]] | st.Outcome:
        """What to start and the launch's extra arguments; or the outcome of a job refused."""
        try:
            grant, ran = job.rec.grant, self._ran
            return launch_argv(self._config, self._store.run_dir, grant, run_as, cwd, env, ran)
        except (LaunchRefused, ContainerError) as err:
            log.warning("job %s refused: %s", job.rec.job_id, err, extra=self._ctx(job.rec))
            return st.Outcome(state="failed", reason=str(err))

    def _sink(self, grant: Grant) -> LogSink:
        sink = LogSink(
            self._nc,
            self._js,
            grant.job.job_id,
            owner=grant.owner,
            max_backlog_bytes=self._config.max_log_backlog_bytes,
        )
        # Every job: torchrun is as often the job's own command as the launcher of a rank.
        sink.watch = RootCause()
        sink.start()
        return sink

    async def _close_sink(self, job: Job, sink: LogSink) -> None:
        await sink.close()
        if sink.dropped_total:
            log.warning(
                "job %s: %d output lines dropped",
                job.rec.job_id,
                sink.dropped_total,
                extra=self._ctx(job.rec),
            )

    def _on_started(self, job: Job) -> OnStarted:
        async def on_started(info: st.ProcessInfo, ended: bool) -> None:
            job.started_ns = time.time_ns()
            await self._save(job, st.running(job.rec, info), durable=False)
            log.debug("job %s running as pid %s", job.rec.job_id, info.pid)
            # Whether "running" got out is not recorded: the report of a job's end supersedes
            # it, and a repeat is dropped by its Nats-Msg-Id. A job that has ended already
            # (most short ones, at the first look) tells its user it ran; placement hears of
            # it with the end, reported next (it takes an end of a job still placed), one
            # message fewer. A rank's "running" always goes: its gang is decided from them.
            tell_placement = not ended or job.rec.grant.gang is not None
            await self._reporter.report(job.rec, to_placement=tell_placement)

        return on_started

    def adopt(self, rec: st.GrantRecord, run: Path) -> None:
        """Re-attach to a job a previous run of the executor started through a shim that still
        runs (or that ended meanwhile, its ``exit.json`` written): follow it to its end."""
        job = Job(rec)
        self._jobs[rec.grant_id] = job
        job.task = asyncio.create_task(
            self._adopted_life(job, run), name=f"job-{rec.job_id}-{rec.grant_id}"
        )

    async def _adopted_life(self, job: Job, run: Path) -> None:
        try:
            mark = self._store.cancel_mark(job.rec.job_id, job.rec.grant_id)
            if mark is not None:  # cancelled while the executor was down
                if mark.given_up:
                    self._told.add(job.rec.grant_id)
                job.request_stop(StopRequest(state="cancelled", reason=mark.reason))
            # A slot, as when it started (not waiting on a stop: the job runs already).
            await self._slots.acquire()
            try:
                outcome = await self._follow(job, run)
            finally:
                self._slots.release()
            if outcome is not None:
                await self._finish(job, outcome)
        except Exception:
            log.exception("job %s: executor error following it", job.rec.job_id)
            if job.rec.phase != "finished":
                with contextlib.suppress(Exception):
                    await self._finish(job, st.Outcome(state="lost", reason="executor error"))
        finally:
            self._jobs.pop(job.rec.grant_id, None)

    async def _follow(self, job: Job, run: Path) -> st.Outcome | None:
        sink = self._sink(job.rec.grant)
        on_started = self._on_started(job) if job.rec.phase == "starting" else None
        try:
            follower = Follower(run, job.rec.grant_id, sink, None, self.hierarchy)
            return _explained(await follower.follow(job.stop, on_started, None), sink)
        except Detached:
            return None
        finally:
            await self._close_sink(job, sink)

    def _limits(self, grant: Grant) -> JobLimits | None:
        """The job's limits, where its cgroup can enforce them (the device folder is read only
        when it changed, and only when the devices controller is in force)."""
        hier = self._hierarchy
        if hier is None or not hier.controllers:
            return None
        nodes = self._devices.nodes() if "devices" in hier.controllers else ()
        return job_limits(grant, pids_max=self._config.job_pids_max, nodes=nodes)

    async def _finish(self, job: Job, outcome: st.Outcome) -> None:
        if self._told and job.rec.grant_id in self._told:
            self._told.discard(job.rec.grant_id)
            outcome = msgspec.structs.replace(outcome, told=True)
        await self._save(job, st.finished(job.rec, outcome))
        if outcome.state == "lost" and job.rec.grant.job.container is not None:
            await asyncio.to_thread(remove_lost, self._config, job.rec.grant)
        if self._tel.enabled:
            trace_job(self._tel, self._node_id, job, outcome)
        log.info(
            "job %s (grant %s) %s%s",
            job.rec.job_id,
            job.rec.grant_id,
            outcome.state,
            f": {outcome.reason}" if outcome.reason else "",
            extra=self._ctx(job.rec),
        )
        # Before the end is reported: once it is, the job's TMPDIR is gone from its folder (what
        # it held may still be being removed from the trash, behind the report).
        clear_scratch(self._store.job_dir(job.rec.grant_id), self._store.trash_dir)
        await self._reporter.report_finished(job.rec)


def trace_job(tel: Telemetry, node_id: str, job: Job, outcome: st.Outcome) -> None:
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
        "gpulayer.node.id": node_id,
        "gpulayer.accelerator": grant.accelerator,
        "gpulayer.devices": grant.devices,
        "gpulayer.outcome": outcome.state,
    }
    if outcome.exit_code is not None:
        attrs["process.exit.code"] = outcome.exit_code
    tracer = tel.tracer
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
    tel.count("gpulayer.executor.jobs", 1, labels)
    if job.started_ns:
        tel.record("gpulayer.executor.job.duration", (end - job.started_ns) / 1e9, labels)


def _explained(outcome: st.Outcome | None, sink: LogSink) -> st.Outcome | None:
    """A job that failed with torchrun's exit code (1 whatever its worker's): its reason also
    names the worker that failed first and how, from torchrun's summary on its stderr."""
    root = sink.watch
    if outcome is None or outcome.exit_code is None or not isinstance(root, RootCause):
        return outcome
    why = root.summary()
    if outcome.state != "failed" or why is None:
        return outcome
    reason = f"{outcome.reason}; {why}" if outcome.reason else why
    return msgspec.structs.replace(outcome, reason=reason)
