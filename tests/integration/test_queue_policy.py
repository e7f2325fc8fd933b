"""Queue policy with real NATS and PostgreSQL: priority order, quota wait and release, fair
share between two owners, a large job not starved by a stream of small ones, preemption that
requeues its victim. A fake executor (this test) runs each grant for a while and reports."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import nats.errors
import pytest
from nats.aio.client import Client
from tests.helpers import finish, join_node, one_placement, subscribed
from tests.unit.placement.placement_fakes import gpu_node

from gpulayer_contracts import Grant, JobStatus, Pending, encode
from gpulayer_contracts.codec import event_decoder, grant_decoder
from gpulayer_contracts.events import CancelJob
from gpulayer_contracts.subjects import (
    API_QUOTA,
    MSG_ID_HEADER,
    NODE_WILDCARD_CONTROL,
    NODE_WILDCARD_GRANTS,
    jobs_submit,
    node_status,
)
from gpulayer_placement.service import PlacementService

pytestmark = pytest.mark.integration


@pytest.fixture
async def placement(
    nats_url: str, database_url: str, nc: Client
) -> AsyncIterator[PlacementService]:
    async with one_placement(nats_url, database_url, nc) as svc:
        yield svc


def job(job_id: str, gpus: int = 1, **fields: Any) -> bytes:
    return json.dumps(
        {"job_id": job_id, "command": ["true"], "requirements": {"gpu_count": gpus}, **fields}
    ).encode()


async def submit(nc: Client, job_id: str, owner: str = "anonymous", **kw: Any) -> None:
    await nc.jetstream().publish(
        jobs_submit(owner), job(job_id, **kw), headers={MSG_ID_HEADER: job_id}
    )


async def node(nc: Client, node_id: str, gpus: int) -> None:
    await join_node(nc, gpu_node(node_id, gpus), slots=64)


async def grants_queue(nc: Client) -> asyncio.Queue[Grant]:
    q: asyncio.Queue[Grant] = asyncio.Queue()

    async def on_grant(msg: Any) -> None:
        await q.put(grant_decoder.decode(msg.data))

    await nc.subscribe(NODE_WILDCARD_GRANTS, cb=on_grant)
    await subscribed(nc)
    return q


async def quota(nc: Client, **body: Any) -> Any:
    reply = await nc.request(API_QUOTA, json.dumps(body).encode(), timeout=10)
    answer = json.loads(reply.data)
    assert answer["ok"], answer
    return answer["data"]


async def pending_reason(svc: PlacementService, job_id: str, want: Callable[[str], bool]) -> str:
    """The job's stored reason once ``want`` accepts it (the scheduler wrote it)."""
    async with asyncio.timeout(10):
        while True:
            async with svc.pool.acquire() as db:
                row = await db.fetchrow("SELECT state, reason FROM jobs WHERE job_id = $1", job_id)
            if row is not None and row["reason"] and want(row["reason"]):
                return str(row["reason"])
            await asyncio.sleep(0.05)


async def test_higher_priority_is_placed_first(nc: Client, placement: PlacementService) -> None:
    grants = await grants_queue(nc)
    await node(nc, "p1", 1)
    await submit(nc, "busy")
    busy = await asyncio.wait_for(grants.get(), 10)
    await submit(nc, "low-old", priority=0)
    await submit(nc, "low-new", priority=-3)
    await submit(nc, "high", priority=5)
    await pending_reason(placement, "high", lambda r: "0/1 nodes" in r)
    order = []
    current = busy
    for _ in range(3):
        await finish(nc.jetstream(), current)
        current = await asyncio.wait_for(grants.get(), 10)
        order.append(current.job.job_id)
    assert order == ["high", "low-old", "low-new"]


async def test_a_job_over_its_owners_quota_waits_with_the_reason_until_one_ends(
    nc: Client, placement: PlacementService
) -> None:
    grants = await grants_queue(nc)
    await node(nc, "q1", 4)
    # The node known before the jobs come: the test is about the quota, and a job that came
    # first to an empty fleet was once overtaken by the next two (see the repeat run's note).
    async with asyncio.timeout(10):
        while not (placement.fleet.any_room() and placement.fleet.any_free_device()):  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    rows = await quota(nc, op="set", owner="alice", gpus={"cuda": 2}, jobs=10)
    assert {(r["owner"], r["resource"], r["max"]) for r in rows} == {
        ("alice", "gpus:cuda", 2),
        ("alice", "jobs", 10),
    }
    await submit(nc, "a1", "alice")
    await submit(nc, "a2", "alice")
    await submit(nc, "a3", "alice")
    first = [await asyncio.wait_for(grants.get(), 10) for _ in range(2)]
    reason = await pending_reason(placement, "a3", lambda r: r.startswith("owner"))
    assert reason == "owner alice holds 2/2 cuda GPUs"
    # Another owner is not held by alice's quota (the node has 2 more GPUs).
    await submit(nc, "b1", "bob")
    assert (await asyncio.wait_for(grants.get(), 10)).job.job_id == "b1"
    listed = await quota(nc, op="list")
    assert {"owner": "alice", "resource": "gpus:cuda", "max": 2, "used": 2} in listed
    await finish(nc.jetstream(), first[0])
    assert (await asyncio.wait_for(grants.get(), 10)).job.job_id == "a3"


async def test_postgres_refuses_a_placement_past_a_quota(placement: PlacementService) -> None:
    """Whatever a replica believed: the owner_holds trigger is the last guard."""
    import asyncpg

    async with placement.pool.acquire() as db:
        await db.execute("INSERT INTO quotas VALUES ('*', 'jobs', 1)")
        await db.execute(
            "INSERT INTO jobs (job_id, request, state, owner) VALUES "
            "('x1', '{}', 'placed', 'carol'), ('x2', '{}', 'placed', 'carol')"
        )
        await db.execute("INSERT INTO owner_holds (job_id, owner) VALUES ('x1', 'carol')")
        with pytest.raises(asyncpg.CheckViolationError, match="owner carol would hold 2/1 jobs"):
            await db.execute("INSERT INTO owner_holds (job_id, owner) VALUES ('x2', 'carol')")
        used = await db.fetchval(
            "SELECT used FROM owner_usage WHERE owner = 'carol' AND resource = 'jobs'"
        )
        assert used == 1


class FakeExecutor:
    """Runs each grant for ``run_s`` then reports it succeeded; records (start, end) per job."""

    def __init__(self, nc: Client, run_s: float) -> None:
        self.nc, self.run_s = nc, run_s
        self.runs: dict[str, tuple[float, float, int]] = {}
        self.granted: list[tuple[float, Grant]] = []
        self.tasks: list[asyncio.Task[None]] = []
        self.on_grant: Callable[[Grant], None] | None = None
        self.changed = asyncio.Event()  # set on every grant and every end

    async def until(self, done: Callable[[], bool]) -> None:
        while not done():
            self.changed.clear()
            await self.changed.wait()

    async def start(self) -> None:
        async def cb(msg: Any) -> None:
            grant = grant_decoder.decode(msg.data)
            self.granted.append((time.monotonic(), grant))
            self.changed.set()
            if self.on_grant is not None:
                self.on_grant(grant)
            self.tasks.append(asyncio.create_task(self._run(grant)))

        await self.nc.subscribe(NODE_WILDCARD_GRANTS, cb=cb)
        await subscribed(self.nc)

    async def _run(self, grant: Grant) -> None:
        t0 = time.monotonic()
        await asyncio.sleep(self.run_s)
        t1 = time.monotonic()
        try:
            await finish(self.nc.jetstream(), grant)
        except nats.errors.ConnectionClosedError:
            # The test ended and closed the connection: no one reads this report. (Left
            # unretrieved, its traceback was formatted by the garbage collector in the middle
            # of another module's ast.parse, which CPython 3.11.7 then failed: gh-106905.)
            return
        # Counted once its end is published: a test that waits for N runs then closes the
        # connection leaves no report in flight.
        self.runs[grant.job.job_id] = (t0, t1, len(grant.devices))
        self.changed.set()


class _OrderTrace:
    """Records what fair share saw at each pass over both owners' jobs: time, each owner's
    usage and GPUs held, and whether the shares had just been read again from PostgreSQL."""

    def __init__(self, placement: PlacementService) -> None:
        self.policy = policy = placement.policy
        self.lines: list[str] = []
        self.usage: list[dict[str, float]] = []  # each owner's usage at each such pass
        self.t0 = time.monotonic()
        self._loaded = policy.loaded_at
        order = policy.order

        def traced(rows: Any) -> Any:
            owners = sorted({r.get("owner") for r in rows})
            if len(owners) > 1:
                self._note(owners)
            return order(rows)

        policy.order = traced  # type: ignore[method-assign]

    def _note(self, owners: list[str]) -> None:
        p = self.policy
        reloaded = "R " if p.loaded_at != self._loaded else ""
        self._loaded = p.loaded_at
        self.usage.append({o: p.usage(o) for o in owners})
        each = " ".join(f"{o}={p.usage(o):.2f}/{p.gpus_held(o)}" for o in owners)
        self.lines.append(f"{time.monotonic() - self.t0:.2f} {reloaded}{each}")

    def __repr__(self) -> str:
        return "\n".join(self.lines[-60:])


async def test_two_owners_get_equal_gpu_seconds(nc: Client, placement: PlacementService) -> None:
    """alice submits 100 one-GPU jobs, then bob 100, onto 4 GPUs: while both have jobs
    waiting, each gets within 25% of the same GPU-seconds, as placement measures them (from a
    job's placement to its end applied; oldest first would run all of alice's first)."""
    ex = FakeExecutor(nc, run_s=0.05)
    seen = _OrderTrace(placement)
    await ex.start()
    for i in range(100):
        await submit(nc, f"a-{i:03}", "alice")
    for i in range(100):
        await submit(nc, f"b-{i:03}", "bob")
    # Every job stored before the GPUs appear, so both owners wait from the first grant on. With
    # the node there first, alice's jobs ran while bob's were still being submitted (under the
    # suite's load that took long enough to give alice 100 grants to bob's 65 in the window).
    async with asyncio.timeout(60):
        while True:
            async with placement.pool.acquire() as db:
                stored = await db.fetchval("SELECT count(*) FROM jobs")
            if stored == 200:
                break
            await asyncio.sleep(0.05)
    await node(nc, "f1", 4)
    async with asyncio.timeout(120):
        await ex.until(lambda: len(ex.runs) == 200)
    # The window: until the last job of either owner was granted (then only one owner waits).
    # Every run is the same 50 ms of GPU, so each owner's GPU-seconds in it are its grants
    # times that. (Timing each run here by wall clock measured the machine's load as much as
    # the policy: 50 ms sleeps stretch unevenly while the suite runs in parallel, and the check
    # failed once with every job run.)
    last = {o: max(t for t, g in ex.granted if g.owner == o) for o in ("alice", "bob")}
    end = min(last.values())
    granted = {o: sum(1 for t, g in ex.granted if g.owner == o and t <= end) for o in last}
    # On failure, what the order saw: each owner's usage and GPUs held at each pass that had
    # both waiting, and the grants' owners in order.
    order = "".join(g.owner[0] for _, g in sorted(ex.granted, key=lambda x: x[0]))
    # GPU-seconds as fair share counts them (placement to end applied, running ones so far), at
    # the last pass that had both owners waiting, the window's end: within a quarter of their
    # mean, and two rounds of the 4 GPUs for the passes that fill them. Oldest first would leave
    # bob at 0 while alice's usage grew to her 100 runs. Not at every pass: under the suite's
    # load a job's measured time stretches with its reports' latency, and early on (a mean under
    # 1 GPU-s) one owner was ahead by 0.8 GPU-s before the following passes evened it out. Nor
    # by grants alone: they went 100 to 74, and 100 to 63, with the usage even at the end.
    assert len(seen.usage) >= 10, seen
    at_end = seen.usage[-1]
    per_grant = sum(at_end.values()) / sum(granted.values())
    mean = (at_end["alice"] + at_end["bob"]) / 2
    assert abs(at_end["alice"] - at_end["bob"]) <= 0.25 * mean + 8 * per_grant, (
        granted,
        order,
        seen,
    )
    # And from outside: each owner got a third of the window's grants at least (none for bob
    # with oldest first).
    assert min(granted.values()) >= sum(granted.values()) / 3, (granted, order, seen)
    assert all(t1 - t0 >= 0.05 for t0, t1, _ in ex.runs.values())  # each ran its 50 ms


async def test_fair_share_holds_past_the_first_page_of_the_queue(
    nc: Client, placement: PlacementService
) -> None:
    """alice has three pages of jobs waiting, all older than bob's one job: the GPU that frees
    goes to bob (no recent use), not to alice's oldest. A pass that read the queue a page at a
    time, fair share within each page, gave it to alice until her queue was drained."""
    sched = placement.scheduler
    sched.settings = dataclasses.replace(sched.settings, page_size=10)
    grants = await grants_queue(nc)
    await node(nc, "h1", 1)
    await submit(nc, "a-busy", "alice")
    busy = await asyncio.wait_for(grants.get(), 10)
    for i in range(30):
        await submit(nc, f"a-{i:03}", "alice")
    await submit(nc, "b-1", "bob")
    await pending_reason(placement, "b-1", lambda r: "0/1 nodes" in r)
    await finish(nc.jetstream(), busy)
    assert (await asyncio.wait_for(grants.get(), 10)).job.job_id == "b-1"


async def test_a_large_job_is_not_starved_by_a_stream_of_small_ones(
    nc: Client, placement: PlacementService
) -> None:
    """8 GPUs busy with 1-GPU jobs (timeout 1 s, each running 0.2 s) and a new one submitted
    for every grant: the 8-GPU job submitted meanwhile gets a reservation, and small jobs
    behind it take the node only until the reservation stands (at most one node's worth)."""
    ex = FakeExecutor(nc, run_s=0.2)
    submitted: dict[str, float] = {}
    counter = iter(range(10_000))

    def more(grant: Grant) -> None:
        if grant.job.job_id != "big" and len(submitted) < 200:
            name = f"s-{next(counter):04}"
            submitted[name] = time.monotonic()
            asyncio.get_running_loop().create_task(submit(nc, name, timeout_s=1.0))

    ex.on_grant = more
    await ex.start()
    await node(nc, "s1", 8)
    for _ in range(12):
        name = f"s-{next(counter):04}"
        submitted[name] = time.monotonic()
        await submit(nc, name, timeout_s=1.0)
    async with asyncio.timeout(10):
        await ex.until(lambda: len(ex.granted) >= 8)
    big_at = time.monotonic()
    await submit(nc, "big", gpus=8, timeout_s=5.0)
    async with asyncio.timeout(30):
        await ex.until(lambda: any(g.job.job_id == "big" for _, g in ex.granted))
    big_granted = next(t for t, g in ex.granted if g.job.job_id == "big")
    overtook = [
        g.job.job_id
        for t, g in ex.granted
        if g.job.job_id != "big" and submitted[g.job.job_id] > big_at and t < big_granted
    ]
    assert len(overtook) <= 8, overtook
    assert len(submitted) < 200, "the stream ran out before the large job was placed"
    print(f"large job placed {big_granted - big_at:.2f}s after submit; overtaken by {overtook}")


async def test_preemption_requeues_the_victim_and_places_the_higher_priority_job(
    nc: Client, placement: PlacementService
) -> None:
    grants = await grants_queue(nc)
    cancels: asyncio.Queue[CancelJob] = asyncio.Queue()
    requeued = asyncio.Event()

    async def on_cancel(msg: Any) -> None:
        await cancels.put(msgspec_decode_cancel(msg.data))

    async def on_event(msg: Any) -> None:
        ev = event_decoder.decode(msg.data)
        if isinstance(ev, Pending) and ev.summary.startswith("requeued: preempted for job urgent"):
            requeued.set()

    await nc.subscribe(NODE_WILDCARD_CONTROL, cb=on_cancel)
    await nc.subscribe("gpulayer.job.*.victim.events", cb=on_event)
    await node(nc, "v1", 2)
    await submit(nc, "keeper", priority=0)  # not preemptible: never chosen
    await submit(nc, "victim", priority=1, preemptible=True)
    got = {(await asyncio.wait_for(grants.get(), 10)).job.job_id for _ in range(2)}
    assert got == {"keeper", "victim"}
    await submit(nc, "equal", priority=1)  # equal priority: preempts nothing
    await pending_reason(placement, "equal", lambda r: "0/1 nodes" in r)
    assert cancels.empty()
    await submit(nc, "urgent", priority=10)
    cancel = await asyncio.wait_for(cancels.get(), 10)
    assert (cancel.job_id, cancel.grant_id) == ("victim", "victim-1")
    assert "preempted for job urgent" in cancel.reason
    # The executor stops it and reports 'cancelled': it is requeued, the urgent job placed.
    await nc.jetstream().publish(
        node_status("v1"),
        encode(JobStatus(job_id="victim", grant_id="victim-1", node_id="v1", state="cancelled")),
    )
    placed = await asyncio.wait_for(grants.get(), 10)
    assert placed.job.job_id == "urgent"
    async with placement.pool.acquire() as db:
        row = await db.fetchrow("SELECT state, reason, attempt FROM jobs WHERE job_id = 'victim'")
    assert row is not None
    assert (row["state"], row["attempt"]) == ("pending", 1)
    assert row["reason"].startswith("requeued: preempted for job urgent") or "0/1" in row["reason"]
    await asyncio.wait_for(requeued.wait(), 10)
    # When the urgent job ends, the victim (older than 'equal', higher priority) runs again
    # under its next grant id.
    await finish(nc.jetstream(), placed)
    again = await asyncio.wait_for(grants.get(), 10)
    assert (again.job.job_id, again.grant_id) == ("victim", "victim-2")


def msgspec_decode_cancel(data: bytes) -> CancelJob:
    import msgspec

    return msgspec.json.decode(data, type=CancelJob)
