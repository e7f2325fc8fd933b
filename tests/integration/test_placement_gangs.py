"""Distributed jobs (issue 14, placement side) with real NATS and PostgreSQL: a gang placed on
distinct nodes with its rendezvous in every grant, never partly held, two gangs that don't fit
together placed one after the other, one outcome per gang (a failing rank cancels the others,
all ranks succeeding end it once), cancel of the whole gang, a lost node failing its gang, and
a gang not starved by small jobs. Fake executors (this test) publish the ranks' statuses."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from nats.aio.client import Client
from tests.helpers import join_node, one_placement, subscribed
from tests.unit.placement.placement_fakes import gpu_node

from gpulayer_contracts import Grant, JobStatus, encode
from gpulayer_contracts.capabilities import HostInfo
from gpulayer_contracts.codec import event_decoder, grant_decoder
from gpulayer_contracts.events import CancelJob, JobEvent
from gpulayer_contracts.subjects import (
    API_CANCEL,
    API_EXPLAIN,
    API_JOB,
    API_JOBS,
    MSG_ID_HEADER,
    NODE_WILDCARD_CONTROL,
    NODE_WILDCARD_GRANTS,
    job_events,
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


def gang(job_id: str, nodes: int = 2, gpus: int = 1, **fields: Any) -> bytes:
    return json.dumps(
        {
            "job_id": job_id,
            "command": ["python", "train.py"],
            "requirements": {"accelerator": "cuda", "gpu_count": gpus},
            "distributed": {"nodes": nodes, "processes_per_node": 1, "backend": "gloo"},
            **fields,
        }
    ).encode()


def small(job_id: str) -> bytes:
    return json.dumps(
        {"job_id": job_id, "command": ["true"], "requirements": {"gpu_count": 1}}
    ).encode()


async def submit(nc: Client, job_id: str, body: bytes) -> None:
    await nc.jetstream().publish(jobs_submit("anonymous"), body, headers={MSG_ID_HEADER: job_id})


async def node(nc: Client, node_id: str, gpus: int = 1, addr: str | None = None) -> None:
    caps = gpu_node(node_id, gpus)
    caps = caps.__class__(
        **{
            **{f: getattr(caps, f) for f in caps.__struct_fields__},
            "host": HostInfo(platform="linux-x86_64", os="linux", advertise_address=addr),
            "distributed_backends": ["gloo", "nccl"],
        }
    )
    await join_node(nc, caps, slots=64)


async def queue(nc: Client, subject: str, decoder: Any) -> asyncio.Queue[Any]:
    q: asyncio.Queue[Any] = asyncio.Queue()

    async def cb(msg: Any) -> None:
        await q.put(decoder.decode(msg.data))

    await nc.subscribe(subject, cb=cb)
    await subscribed(nc)
    return q


async def report(nc: Client, g: Grant, state: str, exit_code: int | None = None) -> None:
    await nc.jetstream().publish(
        node_status(g.node_id),
        encode(
            JobStatus(
                job_id=g.job.job_id,
                grant_id=g.grant_id,
                node_id=g.node_id,
                state=state,  # type: ignore[arg-type]
                exit_code=exit_code,
            )
        ),
        headers={MSG_ID_HEADER: f"{g.grant_id}:{state}"},
    )


async def api(nc: Client, subject: str, **body: Any) -> Any:
    reply = json.loads((await nc.request(subject, json.dumps(body).encode(), timeout=10)).data)
    assert reply["ok"], reply
    return reply["data"]


async def state_of(svc: PlacementService, job_id: str, want: str) -> Any:
    async with asyncio.timeout(10):
        while True:
            async with svc.pool.acquire() as db:
                row = await db.fetchrow("SELECT * FROM jobs WHERE job_id = $1", job_id)
            if row is not None and row["state"] == want:
                return row
            await asyncio.sleep(0.05)


async def reason_of(svc: PlacementService, job_id: str) -> str:
    async with asyncio.timeout(10):
        while True:
            async with svc.pool.acquire() as db:
                reason = await db.fetchval("SELECT reason FROM jobs WHERE job_id = $1", job_id)
            if reason:
                return str(reason)
            await asyncio.sleep(0.05)


async def two_grants(grants: asyncio.Queue[Grant]) -> list[Grant]:
    got = [await asyncio.wait_for(grants.get(), 10) for _ in range(2)]
    return sorted(got, key=lambda g: g.gang.rank if g.gang else -1)


async def test_a_two_node_gang_is_placed_on_two_nodes_with_its_rendezvous_and_ends_once(
    nc: Client, placement: PlacementService
) -> None:
    grants = await queue(nc, NODE_WILDCARD_GRANTS, grant_decoder)
    events: asyncio.Queue[JobEvent] = await queue(nc, job_events("g1", "anonymous"), event_decoder)
    await node(nc, "a", addr=None)
    await node(nc, "b", addr="10.1.0.2")
    await submit(nc, "g1", gang("g1"))
    r0, r1 = await two_grants(grants)
    assert r0.gang is not None
    assert r1.gang is not None
    assert (r0.node_id, r1.node_id) == ("b", "a")  # rank 0 where an address is advertised
    assert (r0.job.job_id, r1.job.job_id) == ("g1-rank0", "g1-rank1")
    assert r0.gang.master_addr == r1.gang.master_addr == "10.1.0.2"
    assert r0.gang.master_port == r1.gang.master_port == 29500
    assert (r0.gang.nnodes, r0.gang.world_size, r1.gang.rank) == (2, 2, 1)
    assert r0.devices == r1.devices == [0]
    async with placement.pool.acquire() as db:
        port = await db.fetchrow("SELECT node_id, port FROM gang_ports WHERE gang_id = 'g1'")
    assert port is not None
    assert (port["node_id"], port["port"]) == ("b", 29500)
    # The ranks are no jobs of their own in the list; the job shows them.
    listed = [j["job_id"] for j in await api(nc, API_JOBS)]
    assert listed == ["g1"]
    shown = await api(nc, API_JOB, job_id="g1")
    assert [(r["rank"], r["node_id"], r["state"]) for r in shown["ranks"]] == [
        (0, "b", "placed"),
        (1, "a", "placed"),
    ]
    assert shown["rendezvous"] == "10.1.0.2:29500"
    explained = await api(nc, API_EXPLAIN, job_id="g1")
    assert explained["ranks"] == [
        {"rank": 0, "node_id": "b", "devices": [0]},
        {"rank": 1, "node_id": "a", "devices": [0]},
    ]

    for g in (r0, r1):
        await report(nc, g, "running")
    await state_of(placement, "g1", "running")
    for g in (r0, r1):
        await report(nc, g, "succeeded", 0)
        await report(nc, g, "succeeded", 0)  # a redelivered report changes nothing
    await state_of(placement, "g1", "succeeded")
    seen: list[str] = []
    async with asyncio.timeout(10):
        while "succeeded" not in seen:
            seen.append(str(type(await events.get()).__struct_config__.tag))
    await asyncio.sleep(0.3)  # a second end would be published right after the first
    while not events.empty():
        seen.append(str(type(events.get_nowait()).__struct_config__.tag))
    assert seen.count("succeeded") == 1, seen
    assert seen.count("placed") == 1, seen
    assert seen.index("placed") < seen.index("running") < seen.index("succeeded")
    async with placement.pool.acquire() as db:
        assert await db.fetchval("SELECT count(*) FROM gang_ports") == 0  # port given back


async def test_a_gang_that_fits_on_one_node_only_holds_nothing_and_says_why(
    nc: Client, placement: PlacementService
) -> None:
    await node(nc, "a", addr="10.1.0.1")
    await node(nc, "b", addr="10.1.0.2")
    grants = await queue(nc, NODE_WILDCARD_GRANTS, grant_decoder)
    await submit(nc, "busy", small("busy"))
    busy = await asyncio.wait_for(grants.get(), 10)
    await submit(nc, "g2", gang("g2"))
    reason = await reason_of(placement, "g2")
    assert reason.startswith("needs 2 nodes with 1 free cuda device: 1 found"), reason
    async with placement.pool.acquire() as db:
        held = await db.fetchval("SELECT count(*) FROM allocations WHERE job_id LIKE 'g2%'")
        ranks = await db.fetchval("SELECT count(*) FROM jobs WHERE gang_id = 'g2'")
    assert (held, ranks) == (0, 0)  # no partial hold
    explained = await api(nc, API_EXPLAIN, job_id="g2")
    assert explained["reasons"][0] == "needs 2 nodes with 1 free cuda device: 1 found"
    await report(nc, busy, "succeeded", 0)
    r0, r1 = await two_grants(grants)
    assert {r0.node_id, r1.node_id} == {"a", "b"}


async def test_two_gangs_that_fit_alone_but_not_together_run_one_after_the_other(
    nc: Client, placement: PlacementService
) -> None:
    for n in ("a", "b", "c"):
        await node(nc, n, addr=f"10.1.0.{ord(n)}")
    grants = await queue(nc, NODE_WILDCARD_GRANTS, grant_decoder)
    await submit(nc, "x", gang("x"))
    await submit(nc, "y", gang("y"))
    first = await two_grants(grants)
    gang_first = first[0].gang.job_id if first[0].gang else ""
    other = "y" if gang_first == "x" else "x"
    assert {g.gang.job_id for g in first if g.gang} == {gang_first}
    reason = await reason_of(placement, other)
    assert "1 found" in reason, reason
    async with placement.pool.acquire() as db:
        assert await db.fetchval(f"SELECT count(*) FROM jobs WHERE gang_id = '{other}'") == 0
    for g in first:
        await report(nc, g, "succeeded", 0)
    second = await two_grants(grants)
    assert {g.gang.job_id for g in second if g.gang} == {other}
    await state_of(placement, gang_first, "succeeded")


async def test_a_failing_rank_cancels_the_others_and_fails_the_gang_naming_it(
    nc: Client, placement: PlacementService
) -> None:
    grants = await queue(nc, NODE_WILDCARD_GRANTS, grant_decoder)
    cancels = await queue(nc, NODE_WILDCARD_CONTROL, msgspec_cancel())
    events: asyncio.Queue[JobEvent] = await queue(nc, job_events("g3", "anonymous"), event_decoder)
    await node(nc, "a", addr="10.1.0.1")
    await node(nc, "b", addr="10.1.0.2")
    await submit(nc, "g3", gang("g3"))
    r0, r1 = await two_grants(grants)
    for g in (r0, r1):
        await report(nc, g, "running")
    await report(nc, r1, "failed", 3)
    cancel: CancelJob = await asyncio.wait_for(cancels.get(), 10)
    assert (cancel.job_id, cancel.grant_id) == (r0.job.job_id, r0.grant_id)
    row = await state_of(placement, "g3", "failed")
    assert row["reason"] == f"rank 1 on {r1.node_id} exited with code 3"
    assert row["exit_code"] == 3
    await report(nc, r0, "cancelled")  # the gang's own cancel: no second end
    async with asyncio.timeout(10):
        while True:
            e = await events.get()
            if type(e).__struct_config__.tag == "failed":
                break
    assert (e.rank, e.node_id, e.exit_code) == (1, r1.node_id, 3)  # type: ignore[attr-defined]
    await asyncio.sleep(0.3)
    assert all(type(x).__struct_config__.tag != "failed" for x in drain(events))
    await state_of(placement, "g3-rank0", "cancelled")
    assert (await state_of(placement, "g3", "failed"))["reason"] == row["reason"]


async def test_cancelling_the_gang_cancels_every_rank(
    nc: Client, placement: PlacementService
) -> None:
    grants = await queue(nc, NODE_WILDCARD_GRANTS, grant_decoder)
    cancels = await queue(nc, NODE_WILDCARD_CONTROL, msgspec_cancel())
    await node(nc, "a", addr="10.1.0.1")
    await node(nc, "b", addr="10.1.0.2")
    await submit(nc, "g4", gang("g4"))
    ranks = await two_grants(grants)
    answer = await api(nc, API_CANCEL, job_id="g4")
    assert answer["state"] == "cancelling"
    assert answer["nodes"] == ["a", "b"]
    got = {(await asyncio.wait_for(cancels.get(), 10)).job_id for _ in ranks}
    assert got == {"g4-rank0", "g4-rank1"}
    await report(nc, ranks[0], "cancelled")
    await asyncio.sleep(0.2)
    assert (await state_of(placement, "g4", "placed"))["state"] == "placed"  # rank 1 still runs
    await report(nc, ranks[1], "cancelled")
    await state_of(placement, "g4", "cancelled")


async def test_a_gang_is_not_starved_by_small_jobs_submitted_after_it(
    nc: Client, placement: PlacementService
) -> None:
    """Two 1-GPU nodes busy with small jobs; a 2-node gang, then 1,000 more small jobs: as small
    jobs end, the nodes they free are kept for the gang, which is placed before any small job
    submitted after it."""
    await node(nc, "a", addr="10.1.0.1")
    await node(nc, "b", addr="10.1.0.2")
    grants = await queue(nc, NODE_WILDCARD_GRANTS, grant_decoder)
    await submit(nc, "s-a", small("s-a"))
    await submit(nc, "s-b", small("s-b"))
    running = [await asyncio.wait_for(grants.get(), 10) for _ in range(2)]
    await submit(nc, "gs", gang("gs"))
    await reason_of(placement, "gs")
    for i in range(1000):
        await submit(nc, f"late-{i}", small(f"late-{i}"))
    async with asyncio.timeout(20):  # every late job stored and waiting
        while True:
            async with placement.pool.acquire() as db:
                n = await db.fetchval(
                    "SELECT count(*) FROM jobs WHERE job_id LIKE 'late-%' AND reason IS NOT NULL"
                )
            if n == 1000:
                break
            await asyncio.sleep(0.05)
    # The small jobs running when the gang came end, one by one: the node each frees is kept
    # for the gang (no late job is granted there), and once both ended the gang goes first.
    await report(nc, running[0], "succeeded", 0)
    await pending_says(placement, "late-0", "kept for job gs")
    await report(nc, running[1], "succeeded", 0)
    first = [await asyncio.wait_for(grants.get(), 10) for _ in range(2)]
    assert sorted(g.job.job_id for g in first) == ["gs-rank0", "gs-rank1"]


async def pending_says(svc: PlacementService, job_id: str, text: str) -> None:
    async with asyncio.timeout(10):
        while True:
            async with svc.pool.acquire() as db:
                reason = await db.fetchval("SELECT reason FROM jobs WHERE job_id = $1", job_id)
            if reason and text in reason:
                return
            await asyncio.sleep(0.05)


def drain(q: asyncio.Queue[Any]) -> list[Any]:
    out = []
    while not q.empty():
        out.append(q.get_nowait())
    return out


def msgspec_cancel() -> Any:
    import msgspec

    return msgspec.json.Decoder(CancelJob)
