"""Host cores, RAM, executor job slots and shared GPU memory, with real NATS and PostgreSQL:
placement never grants past what a node offers, jobs that don't fit wait with the reason, and
PostgreSQL itself refuses a placement past a node's capacity whatever a replica believed."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from nats.aio.client import Client
from tests.helpers import finish, join_node, one_placement, start_replicas, subscribed
from tests.unit.placement.placement_fakes import gpu_node

from gpulayer_contracts import Grant, Pending
from gpulayer_contracts.codec import event_decoder, grant_decoder
from gpulayer_contracts.subjects import (
    JOBS_SUBMIT,
    MSG_ID_HEADER,
    NODE_WILDCARD_GRANTS,
)
from gpulayer_placement.replica_sync import NOTIFY_CHANNEL
from gpulayer_placement.service import PlacementService
from gpulayer_placement.store import migrate
from gpulayer_runtime.nats import ensure_streams

pytestmark = pytest.mark.integration

GB = 10**9


@pytest.fixture
async def one_replica(
    nats_url: str, database_url: str, nc: Client
) -> AsyncIterator[PlacementService]:
    async with one_placement(nats_url, database_url, nc) as svc:
        yield svc


def job(job_id: str, **requirements: Any) -> bytes:
    return json.dumps(
        {"job_id": job_id, "command": ["true"], "requirements": requirements}
    ).encode()


async def test_a_full_node_keeps_jobs_waiting_until_a_slot_frees_or_a_node_joins(
    nc: Client, one_replica: PlacementService
) -> None:
    """1 node, 4 cores, 2 slots; 6 jobs of 2 cores: never more than 2 granted at once there,
    the rest wait with the reason; a second node joining takes the waiting ones."""
    js = nc.jetstream()
    grants: asyncio.Queue[Grant] = asyncio.Queue()
    pending: dict[str, str] = {}

    async def on_grant(msg: Any) -> None:
        await grants.put(grant_decoder.decode(msg.data))

    slot_reason = "0/1 nodes can run this job: 1 has no free job slot"
    all_waiting = asyncio.Event()

    async def on_event(msg: Any) -> None:
        ev = event_decoder.decode(msg.data)
        if type(ev).__struct_config__.tag == "pending":
            assert isinstance(ev, Pending)
            pending[ev.job_id] = ev.summary
            if sum(slot_reason in s for s in pending.values()) == 4:
                all_waiting.set()

    await nc.subscribe(NODE_WILDCARD_GRANTS, cb=on_grant)
    await nc.subscribe("gpulayer.job.*.*.events", cb=on_event)
    await subscribed(nc)
    await join_node(nc, gpu_node("one", 0, cores=4, memory_bytes=64 * GB), slots=2)

    for i in range(6):
        await js.publish(JOBS_SUBMIT, job(f"c-{i}", cpu_cores=2), headers={MSG_ID_HEADER: f"c-{i}"})
    first = [await asyncio.wait_for(grants.get(), 10) for _ in range(2)]
    assert {g.node_id for g in first} == {"one"}
    # The other four wait, named by the rule that stops them (once the replica has absorbed
    # the executor's beat: before that, the node's 4 cores stop them, which is also right).
    try:
        await asyncio.wait_for(all_waiting.wait(), 10)
    except TimeoutError:
        raise AssertionError(pending) from None
    assert grants.empty()

    # One ends: exactly one more is granted there.
    await finish(js, first[0])
    third = await asyncio.wait_for(grants.get(), 10)
    assert third.node_id == "one"
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(grants.get(), 0.3)

    # A second node joins: it takes the waiting ones (it has room for 2 as well).
    await join_node(nc, gpu_node("two", 0, cores=4, memory_bytes=64 * GB), slots=2)
    joined = [await asyncio.wait_for(grants.get(), 10) for _ in range(2)]
    assert {g.node_id for g in joined} == {"two"}
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(grants.get(), 0.3)
    view = one_replica.fleet.get("one")
    assert view is not None
    assert (view.slots_free, view.cpu_free) == (0, 0)


async def test_three_replicas_never_overcommit_cores_memory_slots_or_gpu_memory(
    nats_url: str, database_url: str, nc: Client
) -> None:
    """Random CPU and shared-GPU jobs through three replicas: at no moment does any node hold
    more cores, RAM or slots than it offers, or any device more reserved GPU memory than it
    has (counted from the grants, released before each job's end is reported)."""
    js = nc.jetstream()
    await ensure_streams(js)
    replicas = await start_replicas(nats_url, database_url, 3)
    nodes = {f"h-{i}": (8, 32 * GB, 5) for i in range(3)}  # cores, RAM, slots
    device_mib = 81559
    try:
        for node, (cores, memory, slots) in nodes.items():
            await join_node(nc, gpu_node(node, 2, cores=cores, memory_bytes=memory), slots)
        rng = random.Random(13)
        total = 150
        bodies = []
        for i in range(total):
            if i % 3 == 0:
                req: dict[str, Any] = {"gpu_count": 1, "gpu_memory_gb": 30, "cpu_cores": 1}
                body = json.loads(job(f"x-{i}", **req))
                body["gpu"] = {"use": "shared"}
                bodies.append(json.dumps(body).encode())
            else:
                bodies.append(
                    job(
                        f"x-{i}",
                        cpu_cores=rng.choice([0.5, 1, 2, 3]),
                        memory_gb=rng.choice([1, 4, 9]),
                    )
                )
        used: dict[str, list[float]] = {n: [0.0, 0.0, 0.0] for n in nodes}
        gpu_used: dict[tuple[str, int], float] = {}
        violations: list[str] = []
        done = asyncio.Event()
        finished: set[str] = set()
        tasks: list[asyncio.Task[None]] = []

        # Placement announces every release on this channel (replica_sync): a listener of our
        # own learns when the last job's end has been applied.
        listener = await asyncpg.connect(database_url)
        released = asyncio.Event()
        await listener.add_listener(NOTIFY_CHANNEL, lambda *_: released.set())

        async def run(grant: Grant, cores: float, memory: float) -> None:
            await asyncio.sleep(rng.uniform(0, 0.02))
            u = used[grant.node_id]
            u[0] -= cores
            u[1] -= memory
            u[2] -= 1
            if grant.job.gpu is not None:
                for d in grant.devices:
                    gpu_used[(grant.node_id, d)] -= 30 * GB
            await finish(js, grant)
            finished.add(grant.job.job_id)
            if len(finished) == total:
                done.set()

        async def on_grant(msg: Any) -> None:
            grant = grant_decoder.decode(msg.data)
            req = grant.job.requirements
            cores, memory, slots = nodes[grant.node_id]
            u = used[grant.node_id]
            u[0] += req.cpu_cores
            u[1] += req.memory_gb * GB
            u[2] += 1
            if u[0] > cores or u[1] > memory or u[2] > slots:
                violations.append(f"{grant.node_id} holds {u} of {nodes[grant.node_id]}")
            if grant.job.gpu is not None:
                for d in grant.devices:
                    key = (grant.node_id, d)
                    gpu_used[key] = gpu_used.get(key, 0) + 30 * GB
                    if gpu_used[key] > device_mib * 2**20:
                        violations.append(f"{key} holds {gpu_used[key]} bytes of GPU memory")
            tasks.append(asyncio.create_task(run(grant, req.cpu_cores, req.memory_gb * GB)))

        await nc.subscribe(NODE_WILDCARD_GRANTS, cb=on_grant)
        await subscribed(nc)
        await asyncio.gather(
            *(
                js.publish(JOBS_SUBMIT, b, headers={MSG_ID_HEADER: f"x-{i}"})
                for i, b in enumerate(bodies)
            )
        )
        await asyncio.wait_for(done.wait(), 90)
        await asyncio.gather(*tasks)
        assert violations == []
        assert len(finished) == total
        placed = [svc.publisher.placed_total for svc, _ in replicas]
        assert sum(1 for n in placed if n > 0) >= 2, placed
        # Everything given back once placement has applied every end, in the database too.
        # Asked only now that every job has ended here: earlier, no job active can mean that
        # the ones stored so far ended before the rest were (a failure seen about once in ten
        # runs under load, the last job's end not applied yet).
        await asyncio.wait_for(_no_job_active(replicas[0][0].pool, released), 30)
        await listener.close()
        pool = replicas[0][0].pool
        async with pool.acquire() as db:
            rows = await db.fetch("SELECT node_id, resource, used FROM node_resources")
            # On failure, what still holds: reservations and allocations, with their jobs'
            # state and grant.
            held = await db.fetch(
                "SELECT 'reservation' AS kind, r.job_id, r.node_id, r.resource, j.state,"
                " j.grant_id, j.node_id AS job_node FROM reservations r"
                " LEFT JOIN jobs j USING (job_id)"
                " UNION ALL SELECT 'allocation', a.job_id, a.node_id, a.device_index::text,"
                " j.state, j.grant_id, j.node_id FROM allocations a LEFT JOIN jobs j USING (job_id)"
            )
        assert rows
        assert all(r["used"] == 0 for r in rows), (
            [dict(r) for r in rows if r["used"]],
            [dict(r) for r in held],
        )
    finally:
        for svc, conn in replicas:
            await svc.close()
            await svc.pool.close()
            await conn.drain()


async def _no_job_active(pool: asyncpg.Pool, released: asyncio.Event) -> None:
    """Return once no job is waiting, placed or running, asking again after each release
    placement announces (``released``, cleared before each look so that none is missed)."""
    while True:
        released.clear()
        async with pool.acquire() as db:
            active = await db.fetchval(
                "SELECT count(*) FROM jobs WHERE state IN ('pending', 'placed', 'running')"
            )
        if active == 0:
            return
        await released.wait()


async def test_the_database_refuses_reservations_past_a_nodes_capacity(database_url: str) -> None:
    """The last guard: whatever a replica believed, PostgreSQL refuses a statement that takes a
    node past its recorded capacity, keeps the last known capacity when a replica sends none,
    and gives back on delete (the job's end)."""
    conn = await asyncpg.connect(database_url)
    try:
        await migrate(conn)
        for i in range(4):
            await conn.execute(
                "INSERT INTO jobs (job_id, request, state) VALUES ($1, '{}', 'placed')", f"j{i}"
            )
        reserve = (
            "INSERT INTO reservations (job_id, node_id, resource, amount, capacity) "
            "VALUES ($1, 'n', 'slots', 1, $2)"
        )
        await conn.execute(reserve, "j0", 2)
        await conn.execute(reserve, "j1", None)  # capacity not known to this replica: 2 stays
        with pytest.raises(asyncpg.CheckViolationError, match="node n would hold 3 of its 2 slots"):
            await conn.execute(reserve, "j2", None)
        # Two at once in one statement, past the capacity: the whole statement fails.
        await conn.execute("DELETE FROM reservations WHERE job_id = 'j1'")
        with pytest.raises(asyncpg.CheckViolationError):
            await conn.execute(
                "INSERT INTO reservations (job_id, node_id, resource, amount, capacity) "
                "VALUES ('j2', 'n', 'slots', 1, 2), ('j3', 'n', 'slots', 1, 2)"
            )
        used = await conn.fetchval(
            "SELECT used FROM node_resources WHERE node_id = 'n' AND resource = 'slots'"
        )
        assert used == 1
        # A job's row going away (cascade) gives back what it held.
        await conn.execute("DELETE FROM jobs WHERE job_id = 'j0'")
        used = await conn.fetchval(
            "SELECT used FROM node_resources WHERE node_id = 'n' AND resource = 'slots'"
        )
        assert used == 0
    finally:
        await conn.close()


async def test_any_sequence_of_reserves_and_releases_keeps_usage_exact_and_within_capacity(
    database_url: str,
) -> None:
    """Two connections (replicas) reserve batches and release jobs in a random order, some with
    the capacity unknown to them: after each step ``used`` equals the sum of the reservations,
    never passes a capacity, and a refused batch changes nothing."""
    a, b = await asyncpg.connect(database_url), await asyncpg.connect(database_url)
    try:
        await migrate(a)
        rng = random.Random(2026)
        capacity = {
            ("n1", "slots"): 3,
            ("n1", "cpu"): 4000,
            ("n2", "slots"): 2,
            ("n2", "cpu"): 8000,
        }
        live: dict[str, list[tuple[str, str, int]]] = {}
        next_job = refused = 0
        for _ in range(300):
            conn = rng.choice((a, b))
            if live and rng.random() < 0.4:
                job = rng.choice(sorted(live))
                await conn.execute("DELETE FROM reservations WHERE job_id = $1", job)
                del live[job]
            else:
                batch = []
                for _ in range(rng.randint(1, 3)):
                    next_job += 1
                    job, node = f"j{next_job}", rng.choice(("n1", "n2"))
                    await conn.execute(
                        "INSERT INTO jobs (job_id, request, state) VALUES ($1, '{}', 'placed')",
                        job,
                    )
                    for resource, amount in (("slots", 1), ("cpu", rng.choice((500, 1000, 3000)))):
                        known = capacity[(node, resource)] if rng.random() < 0.8 else None
                        batch.append((job, node, resource, amount, known))
                try:
                    await conn.executemany(
                        "INSERT INTO reservations (job_id, node_id, resource, amount, capacity) "
                        "SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::bigint[], "
                        "$5::bigint[])",
                        [tuple(list(col) for col in zip(*batch, strict=True))],
                    )
                    for job, node, resource, amount, _ in batch:
                        live.setdefault(job, []).append((node, resource, amount))
                except asyncpg.CheckViolationError:
                    refused += 1  # the whole batch, none of its rows

            rows = await a.fetch("SELECT node_id, resource, capacity, used FROM node_resources")
            expected: dict[tuple[str, str], int] = {}
            for held in live.values():
                for node, resource, amount in held:
                    expected[(node, resource)] = expected.get((node, resource), 0) + amount
            for r in rows:
                key = (r["node_id"], r["resource"])
                assert r["used"] == expected.get(key, 0), (key, r["used"], expected.get(key))
                if r["capacity"] is not None:
                    assert r["used"] <= r["capacity"], dict(r)
                    assert r["capacity"] == capacity[key]
        # The sequence did fill nodes (some batches refused) and release them again.
        assert refused > 10
        assert next_job > 100
    finally:
        await a.close()
        await b.close()


async def test_a_release_takes_its_locks_in_the_order_a_placement_does(database_url: str) -> None:
    """A placement locks the node's resources (reservations), then its owner's usage (quota
    holds); a release must too, or the two deadlock and PostgreSQL fails one of them. Here the
    placement holds the node's row and waits for the release to have started: the release must
    then wait for the node's row without holding the owner's usage, so the placement's quota
    hold goes through and both commit."""
    setup, placing, releasing = [await asyncpg.connect(database_url) for _ in range(3)]
    try:
        await migrate(setup)
        for job, state in (("done", "placed"), ("next", "pending")):
            await setup.execute(
                "INSERT INTO jobs (job_id, request, state, owner) VALUES ($1, '{}', $2, 'o')",
                job,
                state,
            )
        await setup.execute(
            "INSERT INTO reservations (job_id, node_id, resource, amount) "
            "VALUES ('done', 'n', 'cpu', 1000)"
        )
        await setup.execute(
            "INSERT INTO owner_holds (job_id, owner, millicores) VALUES ('done', 'o', 1000)"
        )
        tx = placing.transaction()
        await tx.start()
        await placing.execute(
            "INSERT INTO reservations (job_id, node_id, resource, amount) "
            "VALUES ('next', 'n', 'cpu', 1000)"
        )  # holds node_resources (n, cpu) until commit
        release = asyncio.create_task(
            releasing.execute("DELETE FROM reservations WHERE job_id = 'done'")
        )
        # Wait until the release is blocked on a lock (it has taken whatever it takes first).
        # PostgreSQL says so only when asked: polled, there is no event to await.
        pid = releasing.get_server_pid()
        waiting = "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1"
        async with asyncio.timeout(10):
            for _ in itertools.count():
                if await setup.fetchval(waiting, pid):
                    break
                await asyncio.sleep(0.01)
        await placing.execute(
            "INSERT INTO owner_holds (job_id, owner, millicores) VALUES ('next', 'o', 1000)"
        )  # needs owner_usage (o, ...): deadlocks if the release holds it
        await tx.commit()
        await asyncio.wait_for(release, 10)
        rows = await setup.fetch("SELECT resource, used FROM owner_usage WHERE owner = 'o'")
        used = {r["resource"]: r["used"] for r in rows}
        assert used == {"cores": 1000, "jobs": 1}
        node = await setup.fetchval(
            "SELECT used FROM node_resources WHERE node_id = 'n' AND resource = 'cpu'"
        )
        assert node == 1000
    finally:
        for conn in (setup, placing, releasing):
            await conn.close()
