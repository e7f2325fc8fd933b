"""Several placement replicas over one fleet: no device is ever double-booked, no job is lost,
and a waiting job is placed promptly when a device is released."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client
from tests.helpers import start_replicas, subscribed
from tests.unit.placement.placement_fakes import gpu_node

from gpulayer_contracts import (
    JobStatus,
    encode,
)
from gpulayer_contracts.codec import grant_decoder
from gpulayer_contracts.subjects import (
    JOBS_SUBMIT,
    MSG_ID_HEADER,
    NODE_WILDCARD_GRANTS,
    node_capabilities,
    node_heartbeat,
    node_status,
)
from gpulayer_placement.service import PlacementService, Settings
from gpulayer_placement.store import create_pool
from gpulayer_runtime.nats import ensure_streams

pytestmark = pytest.mark.integration


def gpu_job(job_id: str) -> bytes:
    return json.dumps(
        {
            "job_id": job_id,
            "command": ["true"],
            "requirements": {"accelerator": "cuda", "gpu_count": 1},
            "sandbox": {"devices": {"gpu": "compute"}},
        }
    ).encode()


@pytest.fixture
async def replicas(
    nats_url: str, database_url: str, nc: Client
) -> AsyncIterator[list[PlacementService]]:
    await ensure_streams(nc.jetstream())
    started = await start_replicas(nats_url, database_url, 3, batch_size=64)
    yield [s for s, _ in started]
    for svc, conn in started:
        await svc.close()
        await svc.pool.close()
        await conn.drain()


async def test_three_replicas_never_double_book(
    nc: Client, replicas: list[PlacementService]
) -> None:
    js = nc.jetstream()
    nodes = {f"gpu-{i}": 4 for i in range(4)}  # 16 devices for 500 one-GPU jobs
    for node, n in nodes.items():
        await js.publish(node_capabilities(node), encode(gpu_node(node, n)))
    total = 500
    held: dict[tuple[str, int], str] = {}
    violations: list[str] = []
    granted: dict[str, int] = {}
    all_done = asyncio.Event()
    finished: set[str] = set()
    rng = random.Random(7)

    async def run_job(grant_job: str, grant_id: str, node: str, device: int) -> None:
        # Play the executor: running, a short random run, then succeeded.
        await js.publish(
            node_status(node),
            encode(JobStatus(job_id=grant_job, grant_id=grant_id, node_id=node, state="running")),
        )
        await asyncio.sleep(rng.uniform(0, 0.01))
        # Released in this test's books before the report, so a re-grant after it is legal.
        del held[(node, device)]
        await js.publish(
            node_status(node),
            encode(
                JobStatus(
                    job_id=grant_job,
                    grant_id=grant_id,
                    node_id=node,
                    state="succeeded",
                    exit_code=0,
                )
            ),
        )
        finished.add(grant_job)
        if len(finished) == total:
            all_done.set()

    tasks: list[asyncio.Task[None]] = []

    async def on_grant(msg: object) -> None:
        grant = grant_decoder.decode(msg.data)  # type: ignore[attr-defined]
        granted[grant.job.job_id] = granted.get(grant.job.job_id, 0) + 1
        assert len(grant.devices) == 1
        key = (grant.node_id, grant.devices[0])
        if key in held:
            violations.append(f"{key} granted to {grant.job.job_id} while {held[key]} holds it")
        held[key] = grant.job.job_id
        tasks.append(
            asyncio.create_task(
                run_job(grant.job.job_id, grant.grant_id, grant.node_id, grant.devices[0])
            )
        )

    await nc.subscribe(NODE_WILDCARD_GRANTS, cb=on_grant)
    await subscribed(nc)
    await asyncio.gather(
        *(
            js.publish(JOBS_SUBMIT, gpu_job(f"r-{i}"), headers={MSG_ID_HEADER: f"r-{i}"})
            for i in range(total)
        )
    )
    await asyncio.wait_for(all_done.wait(), 90)
    await asyncio.gather(*tasks)
    assert violations == []
    assert len(granted) == total
    assert all(n == 1 for n in granted.values()), {j: n for j, n in granted.items() if n != 1}
    # More than one replica did the work.
    placed = [r.publisher.placed_total for r in replicas]
    assert sum(1 for n in placed if n > 0) >= 2, placed


async def test_waiting_job_is_placed_promptly_after_release(
    nc: Client, replicas: list[PlacementService]
) -> None:
    js = nc.jetstream()
    await js.publish(node_capabilities("solo"), encode(gpu_node("solo", 1)))
    grants: asyncio.Queue[tuple[str, str, float]] = asyncio.Queue()

    async def on_grant(msg: object) -> None:
        g = grant_decoder.decode(msg.data)  # type: ignore[attr-defined]
        await grants.put((g.job.job_id, g.grant_id, time.monotonic()))

    await nc.subscribe(NODE_WILDCARD_GRANTS, cb=on_grant)
    await subscribed(nc)
    await js.publish(JOBS_SUBMIT, gpu_job("first"))
    first, first_grant, _ = await asyncio.wait_for(grants.get(), 10)
    assert first == "first"
    await js.publish(JOBS_SUBMIT, gpu_job("second"))
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(grants.get(), 0.5)  # the only device is taken: it waits
    released_at = time.monotonic()
    await js.publish(
        node_status("solo"),
        encode(
            JobStatus(
                job_id="first", grant_id=first_grant, node_id="solo", state="succeeded", exit_code=0
            )
        ),
    )
    second, _, placed_at = await asyncio.wait_for(grants.get(), 5)
    assert second == "second"
    assert placed_at - released_at < 1.0


async def test_silent_node_goes_offline_and_its_jobs_are_lost(
    nats_url: str, database_url: str, nc: Client
) -> None:
    await ensure_streams(nc.jetstream())
    pool = await create_pool(database_url)
    svc = PlacementService(nc, pool, Settings(node_timeout_s=0.6, resend_after_s=60))
    await svc.start()
    lost: asyncio.Queue[dict[str, object]] = asyncio.Queue()

    async def on_event(msg: object) -> None:
        ev = json.loads(msg.data)  # type: ignore[attr-defined]
        if ev["type"] == "lost":
            await lost.put(ev)

    try:
        js = nc.jetstream()
        await nc.subscribe("gpulayer.job.*.*.events", cb=on_event)
        placed = asyncio.Event()

        async def on_grant(msg: object) -> None:
            placed.set()

        await nc.subscribe(NODE_WILDCARD_GRANTS, cb=on_grant)
        await js.publish(node_capabilities("flaky"), encode(gpu_node("flaky", 1)))
        await js.publish(JOBS_SUBMIT, gpu_job("victim"))
        await asyncio.wait_for(placed.wait(), 10)  # on flaky, the only node so far
        await js.publish(node_capabilities("steady"), encode(gpu_node("steady", 1)))

        async def beat() -> None:
            while True:
                await nc.publish(node_heartbeat("steady"), b"{}")
                await asyncio.sleep(0.1)

        beating = asyncio.create_task(beat())
        ev = await asyncio.wait_for(lost.get(), 10)
        beating.cancel()
        assert ev["job_id"] == "victim"
        assert ev["node_id"] == "flaky"
        assert "heartbeats" in str(ev["reason"])
        view = svc.fleet.get("flaky")
        assert view is not None
        assert not view.online
        # Its device stays fenced (the node may only be cut off, the job still running there)
        # until the node's executor reports the grant's end; then it is free.
        assert view.exclusive == frozenset({0})
        steady = svc.fleet.get("steady")
        assert steady is not None
        assert steady.online
        ended = JobStatus(job_id="victim", grant_id="victim-1", node_id="flaky", state="cancelled")
        await js.publish(node_status("flaky"), encode(ended))
        async with asyncio.timeout(10):  # nothing to await on: the fleet is plain state
            while True:
                view = svc.fleet.get("flaky")
                if view is not None and not view.exclusive:
                    break
                await asyncio.sleep(0.05)
    finally:
        await svc.close()
        await pool.close()
