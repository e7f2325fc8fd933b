"""Job lifecycle with real NATS and PostgreSQL (issue 15, part B): a lost job retried then lost
for good, a service restarted after each crash and re-placed when its node goes offline, an
array of jobs, dependency chains, and a cancelled service staying stopped."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import pytest
from nats.aio.client import Client
from tests.helpers import running_placement, subscribed
from tests.unit.placement.placement_fakes import gpu_node

from gpulayer_cli.client import ApiDenied, ApiFailed, api
from gpulayer_contracts import Grant, Heartbeat, JobStatus, encode
from gpulayer_contracts.audit import audit_decoder, audit_subject
from gpulayer_contracts.codec import cancel_decoder, event_decoder, grant_decoder
from gpulayer_contracts.subjects import (
    API_CANCEL,
    API_JOB,
    API_NODE,
    JOBS_SUBMIT,
    MSG_ID_HEADER,
    NODE_WILDCARD_CONTROL,
    NODE_WILDCARD_GRANTS,
    node_capabilities,
    node_heartbeat,
    node_status,
)
from gpulayer_placement.service import PlacementService, Settings

pytestmark = pytest.mark.integration


class Cluster:
    """Placement with fake nodes: capabilities, probe and executor heartbeats while ``alive``,
    grants collected, statuses reported by hand."""

    def __init__(self, nc: Client, svc: PlacementService) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.svc = svc
        self.grants: asyncio.Queue[Grant] = asyncio.Queue()
        self.events: dict[str, list[Any]] = {}
        self.changed = asyncio.Event()
        self.alive: set[str] = set()
        self._beat: asyncio.Task[None] | None = None

    async def start(self) -> None:
        async def on_grant(msg: Any) -> None:
            await self.grants.put(grant_decoder.decode(msg.data))

        async def on_event(msg: Any) -> None:
            ev = event_decoder.decode(msg.data)
            self.events.setdefault(ev.job_id, []).append(ev)
            self.changed.set()

        await self.nc.subscribe(NODE_WILDCARD_GRANTS, cb=on_grant)
        await self.nc.subscribe("gpulayer.job.*.*.events", cb=on_event)
        await subscribed(self.nc)
        self._beat = asyncio.create_task(self._beating())

    async def _beating(self) -> None:
        while True:
            now = datetime.now(UTC)
            for node in list(self.alive):
                for source in ("probe", "executor"):
                    beat = Heartbeat(node_id=node, sent_at=now, source=source)
                    await self.nc.publish(node_heartbeat(node), encode(beat))
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        if self._beat is not None:
            self._beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._beat

    async def node(self, node_id: str, gpus: int = 1) -> None:
        self.alive.add(node_id)
        await self.js.publish(node_capabilities(node_id), encode(gpu_node(node_id, gpus)))

    async def submit(self, job_id: str, **fields: Any) -> None:
        body = {"job_id": job_id, "command": ["true"], **fields}
        await self.js.publish(
            JOBS_SUBMIT, json.dumps(body).encode(), headers={MSG_ID_HEADER: job_id}
        )

    async def grant(self, timeout: float = 10.0) -> Grant:
        try:
            return await asyncio.wait_for(self.grants.get(), timeout)
        except TimeoutError:
            raise AssertionError(f"no grant within {timeout:g}s: {await self.state()}") from None

    async def state(self) -> str:
        """Where things stand, for a failure message: the fleet, the scheduler's wake, the jobs."""
        svc = self.svc
        views = [(v.node_id, v.online, v.executor_down) for v in svc.fleet.views()]
        wake = svc.wake
        rows = await self.db("SELECT job_id, state, reason, blocked FROM jobs ORDER BY job_id")
        jobs = [(r["job_id"], r["state"], r["reason"], r["blocked"]) for r in rows]
        return (
            f"fleet {views}; wake epoch {wake.epoch} passing {wake.passing} capacity "
            f"{wake.capacity_changed} new {wake.new_jobs}; jobs {jobs}"
        )

    async def no_grant(self, within: float = 0.5) -> None:
        try:
            g = await asyncio.wait_for(self.grants.get(), within)
        except TimeoutError:
            return
        raise AssertionError(f"unexpected grant {g.grant_id} on {g.node_id}")

    async def until_state(self, job_id: str, want: str, timeout: float = 10.0) -> dict[str, Any]:
        """The job's record once placement has applied what makes it ``want``."""
        async with asyncio.timeout(timeout):
            while True:
                row = await self.row(job_id)
                if row["state"] == want:
                    return row
                await asyncio.sleep(0.05)

    async def report(self, grant: Grant, state: str, exit_code: int | None = None) -> None:
        status = JobStatus(
            job_id=grant.job.job_id,
            grant_id=grant.grant_id,
            node_id=grant.node_id,
            state=state,  # type: ignore[arg-type]
            exit_code=exit_code,
            reason=None if state != "lost" else "executor lost it",
        )
        await self.js.publish(node_status(grant.node_id), encode(status))

    def types(self, job_id: str) -> list[str]:
        return [type(e).__struct_config__.tag for e in self.events.get(job_id, [])]

    async def event(self, job_id: str, tag: str, count: int = 1, timeout: float = 10.0) -> Any:
        async def wait() -> Any:
            while self.types(job_id).count(tag) < count:
                self.changed.clear()
                await self.changed.wait()
            return [e for e in self.events[job_id] if type(e).__struct_config__.tag == tag][-1]

        try:
            return await asyncio.wait_for(wait(), timeout)
        except TimeoutError:
            raise AssertionError(f"{job_id}: {self.types(job_id)}") from None

    async def row(self, job_id: str) -> dict[str, Any]:
        return dict(await api(self.nc, API_JOB, {"job_id": job_id}))

    async def db(self, sql: str, *args: Any) -> list[Any]:
        async with self.svc.pool.acquire() as conn:
            return list(await conn.fetch(sql, *args))


@pytest.fixture
async def cluster(nc: Client, database_url: str) -> AsyncIterator[Cluster]:
    async with _cluster(nc, database_url) as c:
        yield c


@pytest.fixture
async def unreaped(nc: Client, database_url: str) -> AsyncIterator[Cluster]:
    """A cluster whose placement never reaps silent nodes."""
    async with _cluster(nc, database_url, reap=False) as c:
        yield c


def _no_reaping(svc: PlacementService) -> None:
    svc.liveness.reap = _never  # type: ignore[method-assign]


@contextlib.asynccontextmanager
async def _cluster(nc: Client, database_url: str, *, reap: bool = True) -> AsyncIterator[Cluster]:
    settings = Settings(node_timeout_s=1.0, resend_after_s=60)
    before = None if reap else _no_reaping
    async with running_placement(nc, database_url, settings, before_start=before) as svc:
        c = Cluster(nc, svc)
        await c.start()
        yield c
        await c.stop()


async def test_a_lost_job_is_retried_once_then_lost_for_good(cluster: Cluster) -> None:
    """retries = 1: lost by its executor, it is placed again under attempt 2 with a requeued
    event; lost again (its node goes silent), it stays lost and holds nothing."""
    await cluster.node("n1", gpus=1)
    await cluster.submit("r-1", retries=1, requirements={"gpu_count": 1})
    first = await cluster.grant()
    assert first.grant_id == "r-1-1"
    await cluster.report(first, "running")
    await cluster.report(first, "lost")
    requeued = await cluster.event("r-1", "requeued")
    assert requeued.ended == "lost"
    assert requeued.requeues == 1
    assert requeued.reason == "retry 1 of 1 after the job lost: executor lost it"
    second = await cluster.grant()
    assert (second.grant_id, second.node_id, second.devices) == ("r-1-2", "n1", [0])
    # A late report for the first attempt changes nothing.
    await cluster.report(first, "succeeded", 0)
    await cluster.report(second, "running")
    await cluster.event("r-1", "placed", count=2)

    cluster.alive.discard("n1")  # the node goes silent: its job is lost a second time
    await cluster.event("r-1", "lost")
    await cluster.until_state("r-1", "lost")
    row = await cluster.row("r-1")
    assert (row["attempt"], row["requeues"]) == (2, 1)
    assert cluster.types("r-1").count("requeued") == 1
    await cluster.no_grant()
    held = await cluster.db("SELECT * FROM allocations WHERE job_id = 'r-1'")
    assert held == []


async def test_a_failed_job_is_retried_only_with_retry_on_failure(cluster: Cluster) -> None:
    await cluster.node("n1", gpus=2)
    await cluster.submit("f-plain", retries=3)
    await cluster.submit("f-retry", retries=1, retry_on_failure=True)
    grants = {g.job.job_id: g for g in [await cluster.grant(), await cluster.grant()]}
    for g in grants.values():
        await cluster.report(g, "failed", 1)
    again = await cluster.grant()
    assert again.grant_id == "f-retry-2"
    await cluster.report(again, "failed", 1)
    await cluster.no_grant()
    await cluster.until_state("f-retry", "failed")
    assert (await cluster.row("f-plain"))["state"] == "failed"
    assert "requeued" not in cluster.types("f-plain")


async def test_a_service_is_restarted_twice_then_re_placed_when_its_node_goes_offline(
    cluster: Cluster,
) -> None:
    """A service killed twice is restarted twice on its node (after its backoff), then placed
    on the other node when its node stops beating; listed with its restarts and node."""
    await cluster.node("a", gpus=1)
    await cluster.submit(
        "svc",
        kind="service",
        restart={"policy": "always", "backoff_s": 0.2, "max_backoff_s": 0.3},
        requirements={"gpu_count": 1},
    )
    g1 = await cluster.grant()
    await cluster.node("b", gpus=1)  # joins after: the restarts still go back to "a"
    await cluster.report(g1, "running")
    await cluster.report(g1, "failed", -9)
    first = await cluster.event("svc", "requeued")
    assert first.reason.startswith("restart 1 of the service after it failed")
    assert first.not_before is not None
    g2 = await cluster.grant()
    assert (g2.grant_id, g2.node_id) == ("svc-2", "a")
    # Placed no sooner than its backoff.
    placed = (await cluster.event("svc", "placed", count=2)).at
    assert (placed - first.not_before).total_seconds() > -0.05
    await cluster.report(g2, "running")
    await cluster.report(g2, "succeeded", 0)  # policy always: even a clean exit restarts
    second = await cluster.event("svc", "requeued", count=2)
    assert second.requeues == 2
    g3 = await cluster.grant()
    assert (g3.grant_id, g3.node_id) == ("svc-3", "a")
    await cluster.report(g3, "running")
    await cluster.until_state("svc", "running")

    services = await api(cluster.nc, "gpulayer.api.services")
    (listed,) = [s for s in services if s["job_id"] == "svc"]
    assert (listed["restarts"], listed["node_id"]) == (2, "a")

    cluster.alive.discard("a")
    lost = await cluster.event("svc", "requeued", count=3)
    assert lost.ended == "lost"
    assert lost.not_before is None  # a lost node is no crash: re-placed at once
    g4 = await cluster.grant()
    assert (g4.grant_id, g4.node_id) == ("svc-4", "b")


async def test_a_cancelled_service_stays_stopped(cluster: Cluster) -> None:
    """The cancel is asked while it runs; the executor then reports its end as failed (killed):
    no restart."""
    await cluster.node("a")
    await cluster.submit("svc-c", kind="service", restart={"backoff_s": 0})
    g1 = await cluster.grant()
    await cluster.report(g1, "running")
    await cluster.event("svc-c", "placed")
    reply = await api(cluster.nc, API_CANCEL, {"job_id": "svc-c"})
    assert reply["state"] == "cancelling"
    await cluster.report(g1, "failed", -15)
    await cluster.no_grant()
    await cluster.until_state("svc-c", "failed")
    assert "requeued" not in cluster.types("svc-c")


async def test_a_service_waiting_out_its_backoff_can_be_cancelled(cluster: Cluster) -> None:
    await cluster.node("a")
    await cluster.submit("svc-w", kind="service", restart={"backoff_s": 60, "max_backoff_s": 60})
    g1 = await cluster.grant()
    await cluster.report(g1, "failed", 1)
    await cluster.event("svc-w", "requeued")
    reply = await api(cluster.nc, API_CANCEL, {"job_id": "svc-w"})
    assert reply["state"] == "cancelled"
    await cluster.event("svc-w", "cancelled")
    await cluster.no_grant()


async def test_an_array_of_20_is_20_jobs_each_with_its_index(cluster: Cluster) -> None:
    """One submit, 20 jobs <id>-<i> (each granted, each carrying its index for the executor's
    GPULAYER_ARRAY_INDEX); listed under the array's id; a resubmit adds nothing."""
    await cluster.node("big", gpus=0)
    await cluster.submit("arr", array={"count": 20})
    grants = [await cluster.grant() for _ in range(20)]
    by_id = {g.job.job_id: g for g in grants}
    assert sorted(by_id) == sorted(f"arr-{i}" for i in range(20))
    for job_id, g in by_id.items():
        assert g.job.array is not None
        assert (g.job.array.count, f"arr-{g.job.array.index}") == (20, job_id)
    rows = await cluster.db("SELECT array_id, count(*) AS n FROM jobs GROUP BY array_id")
    assert [(r["array_id"], r["n"]) for r in rows] == [("arr", 20)]
    await cluster.submit("arr", array={"count": 20})  # same id: deduplicated, no new jobs
    await cluster.no_grant()
    assert "accepted" in cluster.types("arr-19")


async def test_an_array_whose_ids_would_be_too_long_is_rejected(cluster: Cluster) -> None:
    await cluster.submit("a" * 126, array={"count": 100})
    rejected = await cluster.event("a" * 126, "rejected")
    assert rejected.reasons[0].startswith("$.array.count: the array's last job id")


async def test_a_dependency_chain_of_three_runs_in_order(cluster: Cluster) -> None:
    """c waits for b, b for a: each is granted only after the one before succeeded, and a
    job naming an unknown id is rejected at submit."""
    await cluster.node("n", gpus=0)
    await cluster.submit("a")
    await cluster.submit("b", after=["a"])
    await cluster.submit("c", after=["b", "a"])
    await cluster.submit("d", after=["nobody"])
    rejected = await cluster.event("d", "rejected")
    assert rejected.reasons == [
        "$.after[0]: no job 'nobody' (a dependency must be submitted first)"
    ]
    ga = await cluster.grant()
    assert ga.job.job_id == "a"
    await cluster.no_grant()
    row = await cluster.row("b")
    assert (row["state"], row["blocked"]) == ("pending", True)
    await cluster.report(ga, "succeeded", 0)
    gb = await cluster.grant()
    assert gb.job.job_id == "b"
    await cluster.no_grant()
    await cluster.report(gb, "succeeded", 0)
    gc = await cluster.grant()
    assert gc.job.job_id == "c"


async def test_a_failed_dependency_cancels_its_dependents(cluster: Cluster) -> None:
    """x fails: y (after x) is cancelled naming x, and z (after y) is cancelled naming y."""
    await cluster.node("n", gpus=0)
    await cluster.submit("x")
    await cluster.submit("y", after=["x"])
    await cluster.submit("z", after=["y"])
    gx = await cluster.grant()
    await cluster.event("z", "accepted")
    await cluster.report(gx, "failed", 3)
    y = await cluster.event("y", "cancelled")
    z = await cluster.event("z", "cancelled")
    assert y.reason == "dependency x ended failed (after)"
    assert z.reason == "dependency y ended cancelled (after)"
    await cluster.no_grant()
    # Naming a job that already ended badly is refused at submit.
    await cluster.submit("w", after=["x"])
    w = await cluster.event("w", "rejected")
    assert w.reasons == ["$.after[0]: job 'x' already ended failed"]


async def test_a_cycle_in_one_batch_is_rejected(cluster: Cluster) -> None:
    # Published before placement reads the stream, so they arrive in one batch.
    await cluster.svc.close()
    await cluster.submit("p", after=["q"])
    await cluster.submit("q", after=["p"])
    await cluster.submit("s", after=["q"])
    svc = PlacementService(cluster.nc, cluster.svc.pool, Settings(node_timeout_s=1.0))
    await svc.start()
    try:
        p = await cluster.event("p", "rejected")
        s = await cluster.event("s", "rejected")
    finally:
        await svc.close()
    assert p.reasons == ["$.after: a cycle of dependencies (p -> q -> p)"]
    assert s.reasons == ["$.after: job 'q' was rejected"]


@pytest.mark.parametrize("seed", [1, 2])
async def test_no_device_is_double_booked_across_retries_and_restarts(
    cluster: Cluster, seed: int
) -> None:
    """Property, over random outcomes: 24 one-GPU jobs with retries (lost or failed at random,
    some retry on failure) and 3 services with no backoff, on two nodes of 2 GPUs. Whatever
    ends each attempt, no grant is ever given a device an attempt still running holds, no
    grant id is given twice, and every job reaches a final state holding nothing."""
    rng = random.Random(seed)
    await cluster.node("p", gpus=2)
    await cluster.node("q", gpus=2)
    for i in range(24):
        retries = rng.choice([0, 1, 2])
        await cluster.submit(
            f"j{i}",
            retries=retries,
            retry_on_failure=retries > 0 and rng.random() < 0.5,
            requirements={"gpu_count": 1},
        )
    services = [f"s{i}" for i in range(3)]
    for s in services:
        await cluster.submit(
            s, kind="service", restart={"backoff_s": 0}, requirements={"gpu_count": 1}
        )
    held: dict[tuple[str, int], str] = {}  # (node, device) -> grant id of the running attempt
    seen: set[str] = set()
    restarts = dict.fromkeys(services, 0)
    violations: list[str] = []
    jobs_left = {f"j{i}" for i in range(24)}
    running_for_good: set[str] = set()
    while jobs_left or len(running_for_good) < len(services):
        try:
            g = await cluster.grant(timeout=15)
        except TimeoutError:
            rows = await cluster.db(
                "SELECT job_id, state, reason, attempt, requeues, node_id FROM jobs "
                "WHERE job_id = ANY($1::text[])",
                sorted(jobs_left),
            )
            raise AssertionError(f"no grant; {[dict(r) for r in rows]} {held}") from None
        if g.grant_id in seen:
            violations.append(f"grant {g.grant_id} given twice")
        seen.add(g.grant_id)
        for d in g.devices:
            other = held.get((g.node_id, d))
            if other is not None:
                violations.append(f"{g.grant_id} got {g.node_id}:{d}, held by {other}")
            held[(g.node_id, d)] = g.grant_id
        job_id = g.job.job_id
        if job_id in restarts:
            if restarts[job_id] >= 3:
                await cluster.report(g, "running")
                running_for_good.add(job_id)
                continue  # keeps running: cancelled below
            restarts[job_id] += 1
            outcome = rng.choice(["failed", "succeeded", "lost"])
        else:
            outcome = rng.choice(["succeeded", "failed", "lost", "lost"])
        for d in g.devices:
            del held[(g.node_id, d)]  # released before its end is reported
        await cluster.report(g, outcome, 0 if outcome == "succeeded" else 1)
        attempt = int(g.grant_id.rsplit("-", 1)[1])
        retries, on_failure = g.job.retries, g.job.retry_on_failure
        if job_id not in restarts and not (
            attempt <= retries and (outcome == "lost" or (outcome == "failed" and on_failure))
        ):
            jobs_left.discard(job_id)
    assert violations == []
    for s in services:
        await api(cluster.nc, API_CANCEL, {"job_id": s})
    await cluster.no_grant()
    rows = await cluster.db(
        "SELECT job_id, state FROM jobs WHERE job_id LIKE 'j%' AND state IN "
        "('pending', 'placed', 'running')"
    )
    assert rows == []
    left = await cluster.db("SELECT job_id FROM allocations WHERE job_id LIKE 'j%'")
    assert left == []


async def test_a_node_cut_off_keeps_its_lost_jobs_devices_fenced_until_its_executor_says(
    cluster: Cluster,
) -> None:
    """A node silent past the timeout: its job is lost (and retried elsewhere), but the device
    it held stays held when the node comes back, until the node's executor reports that grant's
    end; meanwhile the node's other device takes new work. docs/operations.md, "A node cut
    off"."""
    stops: asyncio.Queue[Any] = asyncio.Queue()

    async def on_control(msg: Any) -> None:
        await stops.put(cancel_decoder.decode(msg.data))

    await cluster.nc.subscribe(NODE_WILDCARD_CONTROL, cb=on_control)
    await cluster.node("cut", gpus=2)
    await cluster.submit("held", retries=1, requirements={"gpu_count": 1})
    first = await cluster.grant()
    assert (first.node_id, first.devices) == ("cut", [0])
    await cluster.report(first, "running")
    await cluster.until_state("held", "running")

    cluster.alive.discard("cut")  # cut off: its heartbeats stop
    lost = await cluster.event("held", "lost")
    assert lost.node_id == "cut"
    stop = await asyncio.wait_for(stops.get(), 10)
    assert (stop.job_id, stop.grant_id, stop.given_up) == ("held", first.grant_id, True)
    fenced = await cluster.db(
        "SELECT kind, resource, amount FROM fences WHERE grant_id = $1", first.grant_id
    )
    held = {(r["kind"], r["resource"]): r["amount"] for r in fenced}
    # Its device, and the cores and the executor slot it held there.
    assert held[("device", "exclusive")] == 0
    assert held[("reservation", "slots")] == 1
    assert held[("reservation", "cpu")] == 1000

    await cluster.node("cut", gpus=2)  # back: beats again
    # The retry, and a new job, go to the free device only: device 0 is fenced.
    retry = await cluster.grant()
    assert (retry.grant_id, retry.node_id, retry.devices) == ("held-2", "cut", [1])
    await cluster.submit("next", requirements={"gpu_count": 1})
    await cluster.event("next", "pending")
    await cluster.no_grant()
    view = cluster.svc.fleet.get("cut")
    assert view is not None
    assert view.exclusive == frozenset({0, 1})

    # The executor, back, stops the old grant and says so: the fence goes, the waiting job runs.
    await cluster.report(first, "cancelled")
    nxt = await cluster.grant()
    assert (nxt.job.job_id, nxt.node_id, nxt.devices) == ("next", "cut", [0])
    assert await cluster.db("SELECT * FROM fences") == []
    # The late report changed nothing of the job: it stays with its retry, one `lost` told.
    assert (await cluster.row("held"))["state"] == "placed"
    assert cluster.types("held").count("lost") == 1
    assert "cancelled" not in cluster.types("held")


async def test_a_node_that_never_comes_back_is_forgotten_by_an_admin_alone(
    cluster: Cluster,
) -> None:
    """`gpulayer node forget`: refused while the node heartbeats, for an unknown node and for a
    plain user; once it is silent, an admin's releases the fence of the job it lost, so the
    node, should it report again, takes new work on that device at once. Each request is in the
    audit trail. docs/operations.md, "Forgetting a node"."""
    audit: asyncio.Queue[Any] = asyncio.Queue()

    async def on_audit(msg: Any) -> None:
        for rec in audit_decoder.decode(msg.data):
            await audit.put(rec)

    await cluster.nc.subscribe(audit_subject("node-forget"), cb=on_audit)
    await subscribed(cluster.nc)
    await cluster.node("gone", gpus=1)
    await cluster.submit("held", requirements={"gpu_count": 1})
    first = await cluster.grant()
    await cluster.report(first, "running")
    await cluster.until_state("held", "running")

    with pytest.raises(ApiFailed, match=r"^node gone still heartbeats: seen \d+ s ago; "):
        await forget(cluster, "gone")
    with pytest.raises(ApiDenied, match=r"only admins may forget a node"):
        await forget(cluster, "gone", caller="alice")
    with pytest.raises(ApiFailed, match=r"no node 'nowhere'"):
        await forget(cluster, "nowhere")
    with pytest.raises(ApiFailed, match=r"is not a subject token"):
        await forget(cluster, "gone.*")
    with pytest.raises(ApiFailed, match=r"Invalid enum value .drain. - at `\$.op`"):
        await api(cluster.nc, API_NODE, {"op": "drain", "node_id": "gone"}, caller="admin")
    assert (await cluster.row("held"))["state"] == "running"  # nothing changed

    cluster.alive.discard("gone")  # never heard from again: lost, its device fenced
    await cluster.event("held", "lost")
    fenced = await cluster.db("SELECT DISTINCT grant_id FROM fences WHERE node_id = 'gone'")
    assert [r["grant_id"] for r in fenced] == [first.grant_id]
    done = await forget(cluster, "gone")
    assert (done["jobs_lost"], done["grants_released"]) == ([], [first.grant_id])
    assert done["devices_released"] == [0]
    assert done["summary"].endswith("no job lost; 1 grant(s) released (devices 0)")
    assert await cluster.db("SELECT * FROM fences") == []
    view = cluster.svc.fleet.get("gone")
    assert view is not None
    assert (view.online, view.exclusive) == (False, frozenset())
    again = await forget(cluster, "gone")  # nothing more to release, and it says so
    assert again["summary"].endswith("no job lost; nothing was held there")

    await cluster.node("gone", gpus=1)  # it reports after all: its device is free
    await cluster.submit("next", requirements={"gpu_count": 1})
    nxt = await cluster.grant()
    assert (nxt.job.job_id, nxt.node_id, nxt.devices) == ("next", "gone", [0])
    assert cluster.types("held").count("lost") == 1

    records = [await asyncio.wait_for(audit.get(), 10) for _ in range(7)]
    seen = [(r.identity, r.target, r.outcome) for r in records]
    assert seen == [
        ("admin", "gone", "failed"),
        ("alice", "gone", "denied"),
        ("admin", "nowhere", "failed"),
        ("admin", "gone.*", "failed"),
        ("admin", "gone", "failed"),
        ("admin", "gone", "ok"),
        ("admin", "gone", "ok"),
    ]
    assert records[5].detail == done["summary"]


async def test_forgetting_a_node_loses_the_jobs_it_still_has_as_a_reaping_would(
    unreaped: Cluster,
) -> None:
    """Silent past the timeout but not reaped yet (no reaper here): its running job is lost by
    the forget itself, with one `lost` event and its retry, and nothing stays fenced."""
    c = unreaped
    await c.node("quiet", gpus=1)
    await c.submit("busy", retries=1, requirements={"gpu_count": 1})
    first = await c.grant()
    await c.report(first, "running")
    await c.until_state("busy", "running")
    c.alive.discard("quiet")
    fleet, timeout = c.svc.fleet, c.svc.settings.node_timeout_s
    while True:  # a time, not an event: the timeout since its last beat (one in flight may land)
        heard = max(fleet.last_seen["quiet"], fleet.executor_seen["quiet"])
        left = timeout - (time.monotonic() - heard)
        if left < 0:
            break
        await asyncio.sleep(left + 0.05)
    done = await forget(c, "quiet")
    assert (done["jobs_lost"], done["grants_released"]) == (["busy"], [first.grant_id])
    lost = await c.event("busy", "lost")
    assert lost.reason == "node forgotten by admin"
    await c.event("busy", "requeued")
    assert (await c.row("busy"))["state"] == "pending"
    assert await c.db("SELECT * FROM fences") == []
    assert c.types("busy").count("lost") == 1


async def _never() -> None:
    """A reaper that never runs: the forget alone gives the node's jobs up."""


async def forget(cluster: Cluster, node: str, caller: str = "admin") -> dict[str, Any]:
    body = {"op": "forget", "node_id": node}
    return dict(await api(cluster.nc, API_NODE, body, caller=caller))
