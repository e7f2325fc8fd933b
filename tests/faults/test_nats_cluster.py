"""A three-server NATS cluster with R3 streams (and auth, as the other tests: each service with
its own role's credential): one server killed for good under load, and no job is lost or run
twice; the services reconnect to the other two without a restart. And every stream takes writes
again soon after a server dies: at once where its leader lives on, after its group's election
where the leader was on the dead server (``tests/faults/write_gaps.py`` says how long and why)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

import nats.errors
import nats.js.errors
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from tests.faults.write_gaps import (
    ELECTION_LIMIT_S,
    NO_ELECTION_LIMIT_S,
    Gap,
    WriteProbe,
    close,
    placements,
    targets,
)
from tests.helpers import Services, service_env

from gpulayer_contracts.subjects import JOB_WILDCARD_EVENTS, JOBS_SUBMIT, MSG_ID_HEADER, STREAMS
from gpulayer_runtime.nats import connect, ensure_streams
from gpulayer_runtime.servers import EmbeddedNats, EmbeddedNatsCluster

pytestmark = pytest.mark.e2e

SERVICES = ("gpulayer-placement", "gpulayer-executor", "gpulayer-probe")
TERMINAL = {"succeeded", "failed", "cancelled", "lost", "rejected"}
JOBS = 150


async def declare_streams(js: JetStreamContext) -> None:
    """R3 streams, once the cluster has elected its JetStream leader (a few seconds)."""
    async with asyncio.timeout(60):
        while True:
            try:
                await ensure_streams(js, replicas=3)
                return
            except Exception:  # no meta leader yet: JetStream says "temporarily unavailable"
                await asyncio.sleep(0.25)


async def submit(js: JetStreamContext, job_id: str) -> None:
    """Publish a `true` job, retrying while the client moves to another server (the job id is
    the Nats-Msg-Id, so a retry of a publish that did arrive is dropped by the stream)."""
    body = json.dumps({"job_id": job_id, "command": ["true"]}).encode()
    async with asyncio.timeout(60):
        while True:
            try:
                await js.publish(JOBS_SUBMIT, body, headers={MSG_ID_HEADER: job_id}, timeout=2)
                return
            except Exception:
                await asyncio.sleep(0.1)


async def events_by_job(js: JetStreamContext, jobs: set[str]) -> dict[str, list[str]]:
    """Every job's stored events, read until each job has a terminal one (an ordered consumer
    resumes by itself after the server it read from is gone)."""
    seen: dict[str, list[str]] = {j: [] for j in jobs}
    done = asyncio.Event()

    async def cb(msg: object) -> None:
        event = json.loads(msg.data)  # type: ignore[attr-defined]
        if event["job_id"] in seen:
            seen[event["job_id"]].append(event["type"])
        if all(TERMINAL & set(types) for types in seen.values()):
            done.set()

    async with asyncio.timeout(60):  # JetStream may answer slowly just after losing a server
        while True:
            try:
                sub = await js.subscribe(JOB_WILDCARD_EVENTS, cb=cb, ordered_consumer=True)
                break
            except (nats.errors.TimeoutError, nats.js.errors.ServiceUnavailableError):
                await asyncio.sleep(0.5)
    try:
        await asyncio.wait_for(done.wait(), 120)
        # Anything stored after the terminal events (a duplicate) would arrive next: look a
        # little longer for one. (A duplicate never "happens": nothing to await instead.)
        await asyncio.sleep(1.0)
    finally:
        await sub.unsubscribe()
    return seen


async def test_one_server_of_three_killed_for_good_under_load(
    nats_cluster: EmbeddedNatsCluster, nats_creds: str | None, database_url: str, tmp_path: Path
) -> None:
    cluster = nats_cluster
    nc: Client = await connect(cluster.url, "test-cluster", creds=nats_creds)
    try:
        js = nc.jetstream()
        await declare_streams(js)
        env = service_env(
            cluster.url, database_url, tmp_path / "work", "cl-node", GPULAYER_STREAM_REPLICAS="3"
        )
        async with Services() as services:
            for name in SERVICES:
                await services.start(name, env, tmp_path / f"{name}.log")
            # The stack is up (the probe's node is known) before the load starts.
            await submit(js, "cl-warm")
            assert (await events_by_job(js, {"cl-warm"}))["cl-warm"][-1] == "succeeded"
            jobs = [f"cl-{i:04d}" for i in range(JOBS)]
            for i, job in enumerate(jobs):
                if i == JOBS // 3:
                    cluster.servers[0].kill()  # for good: never started again
                await submit(js, job)
                await asyncio.sleep(0.02)  # a steady stream of submits, about 40/s
            seen = await events_by_job(js, set(jobs))
            # Nobody restarted a service: each rode out the loss of its server.
            assert all(p.returncode is None for p in services.procs.values())
        ends = Counter(t for types in seen.values() for t in types if t in TERMINAL)
        assert ends == {"succeeded": JOBS}, ends
        assert all(types.count("running") == 1 for types in seen.values()), seen
        assert all(types.count("succeeded") == 1 for types in seen.values()), seen
    finally:
        await nc.close()


def server_name(server: EmbeddedNats) -> str:
    assert server.cluster is not None
    return server.cluster.server_name


async def write_gaps_when(
    cluster: EmbeddedNatsCluster, creds: str | None, stop: str
) -> tuple[str, dict[str, str], dict[str, Gap]]:
    """Writes to every stream (R3, checked) from a client connected to the JOB_EVENTS leader,
    while that server goes away (``stop``: "kill", SIGKILL, or "stop", SIGTERM); the server,
    each stream's leader before, and each stream's write gap (printed)."""
    names = [s.name for s in STREAMS]
    nc = await connect(cluster.url, "test-gaps-setup", creds=creds)
    try:
        await declare_streams(nc.jetstream())
        groups = await placements(nc.jetstream(), names)
    finally:
        await close(nc)
    assert {(g.replicas, g.peers) for g in groups.values()} == {(3, 3)}, groups
    leaders = {name: g.leader for name, g in groups.items()}
    victim = next(s for s in cluster.servers if server_name(s) == leaders["JOB_EVENTS"])
    name = server_name(victim)
    # Connected to the server that goes: the client's reconnect is part of each gap.
    urls = ",".join(s.url for s in sorted(cluster.servers, key=lambda s: s is not victim))
    nc = await connect(urls, "test-gaps", creds=creds, dont_randomize=True)
    try:
        assert nc.connected_url is not None
        assert nc.connected_url.port == victim.port
        async with WriteProbe(nc.jetstream(), targets(names)) as probe:
            await probe.until_started()
            probe.mark()
            await asyncio.to_thread(victim.kill if stop == "kill" else victim.stop)
            await probe.until_written(ELECTION_LIMIT_S + 5)
    finally:
        await close(nc)
    gaps = probe.gaps()
    for stream, gap in sorted(gaps.items()):
        led = " (its leader)" if leaders[stream] == name else ""
        print(f"{stop} {name}{led}: write gap of {gap.line()}")
    return name, leaders, gaps


async def test_every_stream_takes_writes_soon_after_a_server_is_killed(
    nats_cluster: EmbeddedNatsCluster, nats_creds: str | None
) -> None:
    """SIGKILL of the server leading JOB_EVENTS (and the one the writing client is on): a stream
    led elsewhere goes on at once; one it led waits for its group's election, 4 to 9 s in
    nats-server (``write_gaps.ELECTION_LIMIT_S``)."""
    name, leaders, gaps = await write_gaps_when(nats_cluster, nats_creds, "kill")
    assert set(gaps) == set(leaders)
    for stream, gap in gaps.items():
        limit = ELECTION_LIMIT_S if leaders[stream] == name else NO_ELECTION_LIMIT_S
        assert gap.seconds <= limit, (stream, leaders[stream], gap)


async def test_every_stream_takes_writes_at_once_when_a_server_stops(
    nats_cluster: EmbeddedNatsCluster, nats_creds: str | None
) -> None:
    """A clean stop (SIGTERM) of the server leading JOB_EVENTS: it hands each group it leads to
    another server before it goes, so no stream waits for an election."""
    _, leaders, gaps = await write_gaps_when(nats_cluster, nats_creds, "stop")
    assert set(gaps) == set(leaders)
    for stream, gap in gaps.items():
        assert gap.seconds <= NO_ELECTION_LIMIT_S, (stream, leaders[stream], gap)
