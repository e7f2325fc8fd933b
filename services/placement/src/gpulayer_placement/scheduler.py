"""Scheduler: waiting jobs matched against the in-memory fleet, outcomes persisted.

A pass runs when ``Wake`` says so: over new jobs only, or over every waiting job oldest first
when capacity may have changed (stopping early once nothing can fit), and a thorough pass on a
timer. A pass over the queue begins with each waiting owner's first jobs when there are several
owners, so that fair share holds over the whole queue rather than its first page. Each batch
locks its rows (``waiting``), matches them in memory, commits allocations and job rows in one
statement, then hands the outcome to the publisher. Intake calls ``place_inline`` to do the
same inside its own transaction when the scheduler is idle.

It keeps the decoded requests of waiting jobs, so a job is decoded once per replica; a job's
request is dropped once it is placed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import asyncpg

from gpulayer_contracts import JobRequest, encode
from gpulayer_contracts.bounds import clip_text
from gpulayer_contracts.codec import job_request_decoder
from gpulayer_contracts.subjects import ANONYMOUS
from gpulayer_contracts.validation import requested_gpu_count
from gpulayer_matching import NodeView, NoPlacement, Placement, match
from gpulayer_matching.gang import is_gang
from gpulayer_matching.resources import job_millicores, reservations
from gpulayer_placement import queue_pass, waiting
from gpulayer_placement.fleet import Fleet
from gpulayer_placement.gangs import Gangs
from gpulayer_placement.outcome import Outcome, PlacedJob, mode
from gpulayer_placement.persist import persist
from gpulayer_placement.policy import Policy, load_policy
from gpulayer_placement.preemption import Active
from gpulayer_placement.publisher import Publisher
from gpulayer_placement.queue_gate import Gate
from gpulayer_placement.queue_pass import WaitingOwners
from gpulayer_placement.replica_sync import ReplicaSync
from gpulayer_placement.settings import Settings
from gpulayer_placement.store import CONFLICTS, DB_ERRORS
from gpulayer_placement.wake import Wake
from gpulayer_runtime.telemetry import DISABLED, Telemetry

# The name every placement part logs under since before the split: log queries filter on it.
log = logging.getLogger("gpulayer_placement.service")

Take = Callable[[Any], Awaitable[list[asyncpg.Record]]]


class Scheduler:
    def __init__(
        self,
        *,
        pool: asyncpg.Pool,
        fleet: Fleet,
        wake: Wake,
        publisher: Publisher,
        sync: ReplicaSync,
        settings: Settings,
        stop: asyncio.Event,
        telemetry: Telemetry = DISABLED,
        policy: Policy | None = None,
    ) -> None:
        self.pool = pool
        self.policy = policy if policy is not None else Policy()
        self.gate = Gate(fleet=fleet, policy=self.policy, publisher=publisher)
        self.gangs = Gangs(fleet=fleet, policy=self.policy, ports=settings.rendezvous_ports)
        self._may_reserve = False
        self.fleet = fleet
        self.wake = wake
        self.publisher = publisher
        self.sync = sync
        self.settings = settings
        self.stop = stop
        self.tel = telemetry
        self._jobs: dict[str, JobRequest] = {}
        # JetStream publish time of jobs ingested here, for the submit-to-grant latency.
        self._submitted: dict[str, float] = {}
        # Waiting jobs that need no device: a pass can't stop early while any is known.
        self._deviceless_waiting: set[str] = set()
        # Lifecycle: a restarting service's last node, offered first so that it goes back there
        # when it still fits (filled by lifecycle.Lifecycle, used once).
        self.prefer: dict[str, str] = {}
        self.owners = WaitingOwners()  # with two or more, a pass takes their first jobs first

    def remember(self, jobs: Mapping[str, JobRequest], submitted: Mapping[str, float]) -> None:
        """Requests already decoded by intake, and when they entered the JOBS stream."""
        self._jobs.update(jobs)
        self._submitted.update(submitted)

    def forget(self, job_id: str) -> None:
        """Drop what the scheduler keeps about a job that has ended."""
        self._jobs.pop(job_id, None)
        self._submitted.pop(job_id, None)
        self._deviceless_waiting.discard(job_id)
        self.prefer.pop(job_id, None)

    async def run(self) -> None:
        """Wait to be woken, then run the pass asked for; retry what failed."""
        while not self.stop.is_set():
            await self.wake.event.wait()
            self.wake.event.clear()
            if self.stop.is_set():
                return
            new, full, thorough = self.wake.take()
            epoch = self.wake.epoch
            self.wake.begin_pass()
            try:
                if full or thorough:
                    await self._schedule_all(early_stop=not thorough)
                elif new:
                    for i in range(0, len(new), self.settings.batch_size):
                        await self._schedule_ids(new[i : i + self.settings.batch_size], epoch)
            except CONFLICTS as err:
                # Another replica took a device (or the cores, RAM, slot) this one thought free:
                # reload and go again.
                log.info("allocation conflict with another replica (%s); reloading", err)
                await self.sync.reload(None)
                self.wake.capacity()
            except DB_ERRORS as err:
                log.warning("scheduling pass failed, retrying: %s", err)
                self.wake.jobs(new)
                if full or thorough:
                    self.wake.capacity()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), 0.5)
            finally:
                self.wake.passing = False

    async def _schedule_all(self, *, early_stop: bool = True) -> None:
        """Every waiting job, oldest first, a page at a time (``queue_pass.walk``).

        With ``early_stop``, paging ends once no device in the fleet is free and no waiting job
        that needs none is known: the jobs behind can't fit, and scanning them on every release
        would cost a page of rows each time. The periodic thorough pass never stops early."""
        if self.policy.stale():
            async with self.pool.acquire() as conn:
                await load_policy(self.policy, conn)
        self._may_reserve = self.policy.new_pass()
        try:
            await queue_pass.walk(self, early_stop=early_stop)
        finally:
            self._may_reserve = False

    def full(self) -> bool:
        """Whether no waiting job can fit: no node with room, or no free device while no
        waiting job that needs none is known."""
        return not self.fleet.any_room() or (
            not self._deviceless_waiting and not self.fleet.any_free_device()
        )

    async def _schedule_ids(self, ids: list[str], epoch: int) -> None:
        take = functools.partial(waiting.take_new, ids=ids, wake=self.wake, epoch=epoch)
        await self.schedule_batch(take, {})

    async def schedule_batch(
        self, take: Take, failed: dict[bytes, NoPlacement], *, skim: bool = False
    ) -> tuple[waiting.Cursor, int] | None:
        """Lock a batch of waiting jobs, match them, commit the outcome in one transaction, then
        publish grants and events. Returns the batch's last (submitted_at, job_id) and size.
        ``skim``: see ``match_rows``."""
        outcome = Outcome()
        try:
            async with self.pool.acquire() as conn, conn.transaction():
                rows = await take(conn)
                if not rows:
                    return None
                requests, held = await waiting.requests_for(conn, rows, self._jobs)
                self._jobs.update(held)  # what an end applied meanwhile forgot
                self.match_rows(rows, failed, outcome, skim=skim, requests=requests)
                t0 = time.time_ns()
                await self.persist(conn, outcome)
            outcome.commit_ns = (t0, time.time_ns())
        except BaseException:
            self.release(outcome)  # nothing was committed
            raise
        await self.publisher.publish_outcome(outcome)
        await self.gate.send_cancels(outcome)
        return waiting.last(rows), len(rows)

    async def place_inline(self, conn: Any, job_ids: list[str]) -> Outcome | None:
        """Match freshly inserted jobs in the ingest transaction: one commit per batch from
        submit to grant. None when another replica took a device first, or when the scheduler
        stopped being idle while the rows were taken (the jobs then go to the scheduler as
        usual)."""
        outcome = Outcome()
        epoch, passes = self.wake.epoch, self.wake.passes  # the caller found it idle
        try:
            async with conn.transaction():  # a savepoint: a conflict undoes only this part
                rows = await waiting.take_ids(conn, job_ids)
                if not self.wake.idle() or (epoch, passes) != (self.wake.epoch, self.wake.passes):
                    return None  # a node joined or a pass began: it matches older jobs first
                self.match_rows(rows, {}, outcome)
                t0 = time.time_ns()
                await self.persist(conn, outcome)
            outcome.commit_ns = (t0, time.time_ns())
        except CONFLICTS as err:
            self.release(outcome)
            log.info("allocation conflict with another replica (%s); reloading", err)
            await self.sync.reload(None)
            return None
        except BaseException:
            self.release(outcome)
            raise
        return outcome

    def release(self, outcome: Outcome) -> None:
        """Give back in memory what an uncommitted outcome held."""
        for pl in outcome.placements:
            self._jobs[pl.job.job_id] = pl.job
            self.fleet.release(pl.placement.node_id, pl.placement.devices, mode(pl.placement))
            self.fleet.unreserve(pl.job.job_id)
            self.policy.remove(pl.job.job_id, ended=False)
        for job_id, _, _ in outcome.preempt:
            self.policy.preempting.pop(job_id, None)
        outcome.placements.clear()
        outcome.preempt.clear()
        outcome.gangs.clear()

    def match_rows(
        self,
        rows: list[asyncpg.Record],
        failed: dict[bytes, NoPlacement],
        outcome: Outcome,
        *,
        skim: bool = False,
        requests: Mapping[str, str] | None = None,
    ) -> None:
        """Match locked rows, in order, against the fleet into ``outcome``; each placement holds
        its devices at once. ``failed`` remembers requirement sets that found no node in this
        pass: capacity only shrinks during a pass, so an equal job behind them can't fit
        either. With ``skim``, once the fleet is full, see ``_only_waits``. ``requests``: see
        ``waiting.request_text``."""
        full = False
        checked = -1  # placements in the outcome when ``full`` was last checked
        for row in self.policy.order(rows):
            job_id = row["job_id"]
            if full and self._only_waits(row):
                continue
            owner = row.get("owner") or ANONYMOUS
            try:
                job = self._jobs.get(job_id)
                if job is None:
                    job = job_request_decoder.decode(waiting.request_text(row, requests))
                    self._jobs[job_id] = job
                key = _requirement_key(job)
            except Exception as err:  # a stored row this version can't read
                outcome.owners[job_id] = owner
                self._isolate_job(job_id, err, outcome)
                continue
            if is_gang(job):
                self._gang(row, job, owner, outcome, failed, key)
                continue
            tel = self.tel.enabled
            t0 = time.time_ns() if tel else 0
            decision = failed.get(key) or self._match(job_id, job, outcome)
            if decision is None:  # failed: its event goes to the owner's subject
                outcome.owners[job_id] = owner
                continue
            if tel:
                t1 = time.time_ns()
                self.tel.record("gpulayer.placement.decision.duration", (t1 - t0) / 1e9)
            else:
                t1 = 0
            gated = isinstance(decision, Placement)
            if isinstance(decision, Placement):
                decision = self.gate.admit(job_id, job, decision, owner, row.get("priority") or 0)
            if isinstance(decision, Placement):
                self._placed(row, job, decision, owner, (t0, t1), outcome)
                continue
            if skim and not full and checked != len(outcome.placements):
                # capacity shrinks only by this pass's placements: checked once after each
                checked = len(outcome.placements)
                full = not self.fleet.any_room() or not self.fleet.any_free_device()
            if not gated:
                # Capacity only shrinks in a pass; a quota or reservation stops this job, not
                # its equals.
                failed[key] = decision
            self._waits(row, job, owner, decision, outcome)

    def _waits(
        self, row: asyncpg.Record, job: JobRequest, owner: str, why: NoPlacement, outcome: Outcome
    ) -> None:
        """A job that stays waiting: the queue gate's word (reservation, preemption), and its
        reason written when it changed."""
        job_id = row["job_id"]
        self.owners.seen(owner)
        if requested_gpu_count(job) == 0:
            self._deviceless_waiting.add(job_id)
        why = self.gate.blocked(row, job, why, outcome, reserve=self._may_reserve)
        if why.summary != row["reason"]:
            outcome.waiting.append((job_id, why))
            outcome.owners[job_id] = owner

    def _only_waits(self, row: asyncpg.Record) -> bool:
        """Whether, with the fleet full (no free device, or no node with room), this waiting
        job can only be told again that it waits: it needs devices for itself alone (no shared
        use, no per-platform variant, no gang), already has a reason, and neither takes the
        pass's reservation nor may preempt. A pass after a release (``skim``) passes such jobs
        over without the queue gate: after a few devices are freed in front of a long queue,
        most of a page is such jobs (issue 19: a quarter of placement's CPU). Their stored
        reasons are refreshed by the next thorough pass. A job not decoded yet is never passed
        over."""
        job = self._jobs.get(row["job_id"])
        if job is None or row["reason"] is None or job.variants or is_gang(job):
            return False
        if requested_gpu_count(job) == 0 or (job.gpu is not None and job.gpu.use == "shared"):
            return False
        if self._may_reserve and self.policy.reservation is None:
            return False
        return not self.policy.may_preempt(row["job_id"], row.get("priority") or 0)

    def _gang(
        self,
        row: asyncpg.Record,
        job: JobRequest,
        owner: str,
        outcome: Outcome,
        failed: dict[bytes, NoPlacement],
        key: bytes,
    ) -> None:
        """A distributed job: placed whole (all its ranks) or waiting, with why (gangs.py)."""
        job_id = row["job_id"]
        try:
            why = self.gangs.match_row(
                row,
                job,
                owner,
                outcome,
                self._placed,
                reserve=self._may_reserve,
                failed=failed,
                key=key,
            )
        except Exception as err:
            outcome.owners[job_id] = owner
            self._isolate_job(job_id, err, outcome)
            return
        if why is None:  # placed: its ranks' rows take it from here
            self.forget(job_id)
            return
        if requested_gpu_count(job) == 0:
            self._deviceless_waiting.add(job_id)
        if why.summary != row["reason"]:
            outcome.waiting.append((job_id, why))
            outcome.owners[job_id] = owner

    def _placed(
        self,
        row: asyncpg.Record,
        job: JobRequest,
        decision: Placement,
        owner: str,
        match_ns: tuple[int, int],
        outcome: Outcome,
    ) -> None:
        """Add a placement to the outcome, its devices and reservations held at once, so that
        later jobs of this batch see them taken."""
        job_id = row["job_id"]
        self._deviceless_waiting.discard(job_id)
        # The outcome carries the request from here (``release`` puts it back if the outcome is
        # not committed): a million running jobs' requests were 1.4 GB of placement's memory,
        # and one that waits again (requeued, restarted) is read again with its page.
        self._jobs.pop(job_id, None)
        submitted = self._submitted.pop(job_id, None) or row["submitted_at"].timestamp()
        held = reservations(job, decision.devices, decision.use)
        outcome.placements.append(
            PlacedJob(
                job=job,
                placement=decision,
                grant_id=f"{job_id}-{row['attempt'] + 1}",
                traceparent=row["traceparent"],
                submitted=submitted,
                match_ns=match_ns,
                owner=owner,
                held=held,
            )
        )
        self.fleet.hold(
            decision.node_id, decision.devices, mode(decision), job_id=job_id, items=held
        )
        started = time.time()
        self.policy.add(
            Active(
                job_id=job_id,
                node_id=decision.node_id,
                owner=owner,
                accelerator=decision.accelerator,
                devices=tuple(decision.devices),
                shared=decision.use == "shared",
                priority=row.get("priority") or 0,
                preemptible=job.preemptible,
                started=started,
                ends_at=started + job.timeout_s if job.timeout_s is not None else math.inf,
                millicores=job_millicores(job),
            )
        )
        self.policy.clear_reservation(job_id)

    def _match(
        self, job_id: str, job: JobRequest, outcome: Outcome
    ) -> Placement | NoPlacement | None:
        """``match`` for one job; when it raises, the nodes that make it raise on their own are
        taken out of the fleet and the job is matched again; a job that still makes it raise is
        failed (None). Either way the pass goes on with the other jobs."""
        try:
            return match(job, _nodes_for(self.fleet, self.prefer, job_id))
        except Exception as err:
            first = err
        bad: list[tuple[str, Exception]] = []
        for view in list(self.fleet.views()):
            try:
                match(job, [view])
            except Exception as node_err:
                bad.append((view.node_id, node_err))
        for node_id, why in bad:
            log.error(
                "node %s makes matching fail (%r): left out until it reports again", node_id, why
            )
            self.fleet.remove(node_id, f"its capabilities make matching fail: {why!r}")
        if bad:
            try:
                return match(job, self.fleet.rotated())
            except Exception as again:
                first = again
        self._isolate_job(job_id, first, outcome)
        return None

    def _isolate_job(self, job_id: str, err: BaseException, outcome: Outcome) -> None:
        log.error("job %s can't be matched: %r; failed", job_id, err, exc_info=err)
        self.forget(job_id)
        outcome.failed.append((job_id, clip_text(f"placement could not match this job: {err!r}")))

    async def persist(self, conn: Any, outcome: Outcome) -> None:
        """Allocations and job rows of ``outcome`` in one statement each, on ``conn``."""
        await persist(
            conn, outcome, gangs=self.gangs, fleet=self.fleet, replica_id=self.sync.replica_id
        )


def _nodes_for(fleet: Fleet, prefer: dict[str, str], job_id: str) -> Sequence[NodeView]:
    """The fleet in matching order; a restarting service's last node (``prefer``) first."""
    nodes = fleet.rotated()
    node_id = prefer.pop(job_id, None) if prefer else None
    view = fleet.get(node_id) if node_id is not None else None
    return nodes if view is None else [view, *nodes]


def _requirement_key(job: JobRequest) -> bytes:
    return encode((job.requirements, job.gpu, job.variants, job.distributed, job.sandbox))
