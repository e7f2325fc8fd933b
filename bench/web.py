"""The fleet page at scale (issue 29): gpulayer-web's pages answered over HTTP (uvicorn, in this
process) from a cache holding 1,000 nodes shaped like real probes' reports and 10,000 jobs,
and what 50 viewers at once cost placement: API requests per refresh, counted."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import statistics
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec
import uvicorn

from bench.fleet import fleet
from bench.harness import BenchError, Scenario, load_fleet
from bench.report import Figure
from gpulayer_runtime.nats import connect
from gpulayer_web.app import build_app
from gpulayer_web.cache import FleetCache
from gpulayer_web.reader import NatsReader

NODES = 1_000
JOBS = 10_000
VIEWERS = 50
REQUESTS = 30


def api_nodes(n: int) -> list[dict[str, Any]]:
    """What placement's ``nodes`` answers for a synthetic fleet of ``n``."""
    now = datetime.now(UTC).isoformat()
    return [
        {
            "node_id": caps.node_id,
            "online": True,
            "last_seen": now,
            "executor": "up",
            "active_jobs": 0,
            "busy_devices": [0, 1],
            "resources": {
                "cores": 64.0,
                "cores_used": 8.0,
                "memory_gb": 512.0,
                "memory_gb_used": 64.0,
            },
            "capabilities": msgspec.to_builtins(caps),
            "health": None,
        }
        for caps in fleet("web", n)
    ]


def api_jobs(n: int) -> list[dict[str, Any]]:
    start = datetime.now(UTC)
    states = ("succeeded", "succeeded", "running", "pending", "failed")
    return [
        {
            "job_id": f"job-{i:05d}",
            "name": f"train run {i}",
            "state": states[i % len(states)],
            "owner": f"user{i % 40}",
            "priority": i % 3,
            "submitted_at": (start - timedelta(seconds=i)).isoformat(),
            "node_id": f"web-{i % NODES:05d}" if i % 5 != 3 else None,
            "devices": [i % 8],
            "reason": "0/1000 nodes can run this job: 1000 have < 9 usable cuda devices"
            if i % 5 == 3
            else None,
            "owner_usage_gpu_s": float(i % 40) * 100,
        }
        for i in range(n)
    ]


class CountingPlacement:
    def __init__(self) -> None:
        self.nodes, self.jobs, self.asked = api_nodes(NODES), api_jobs(JOBS), 0

    async def ask(self, subject: str, body: dict[str, Any]) -> Any:
        self.asked += 1
        if subject.endswith(".quota"):
            return []
        items = self.nodes if subject.endswith(".nodes") else self.jobs
        if body.get("state"):
            items = [j for j in items if j.get("state") == body["state"]]
        start = body.get("offset", 0)
        return items[start : start + body.get("limit", len(items))]

    async def history(self, job_id: str, owner: str) -> list[dict[str, Any]]:
        return []


@contextlib.asynccontextmanager
async def _serving(cache: FleetCache) -> AsyncIterator[int]:
    # Bound here, before serving: a request sent before uvicorn accepts waits in the backlog.
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    app = build_app(cache, allowed_hosts=["127.0.0.1"])
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        yield int(sock.getsockname()[1])
    finally:
        server.should_exit = True
        await task
        sock.close()


async def _get(port: int, path: str) -> tuple[float, int]:
    """Milliseconds to the whole answer of one GET, and its size."""
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
    await writer.drain()
    body = await reader.read()
    writer.close()
    await writer.wait_closed()
    assert body.startswith(b"HTTP/1.1 200"), body[:200]
    return (time.perf_counter() - t0) * 1000, len(body)


async def web_figures() -> list[Figure]:
    placement = CountingPlacement()
    cache = FleetCache(placement.ask, placement.history, jobs_limit=JOBS)
    t0 = time.perf_counter()
    await cache.refresh()
    refresh_ms = (time.perf_counter() - t0) * 1000
    asks_per_refresh = placement.asked
    figures = [Figure("web_cache_refresh_1k_nodes_10k_jobs", refresh_ms, "ms",
                      note="paged API answers parsed in process, no NATS")]  # fmt: skip
    async with _serving(cache) as port:
        for name, path in (
            ("web_fleet_page_1k_nodes", "/"),
            ("web_fleet_page_1k_nodes_filtered", "/?platform=linux-x86_64&api=cuda"),
            ("web_jobs_page_10k_jobs", "/jobs"),
            ("web_jobs_page_10k_jobs_last_page", "/jobs?page=100"),
            ("web_owners_page_10k_jobs", "/owners"),
        ):
            await _get(port, path)  # warm
            times = [(await _get(port, path))[0] for _ in range(REQUESTS)]
            times.sort()
            figures.append(Figure(f"{name}_p50", statistics.median(times), "ms"))
            figures.append(Figure(f"{name}_p99", times[int(len(times) * 0.99) - 1], "ms"))
        before = placement.asked
        # 50 viewers refreshing their fleet page at once, then one refresh of the cache.
        await asyncio.gather(*(_get(port, "/") for _ in range(VIEWERS)))
        by_viewers = placement.asked - before
        await cache.refresh()
    figures += [
        Figure(
            "web_placement_requests_per_refresh",
            asks_per_refresh,
            "requests",
            note=f"{NODES} nodes, {JOBS} jobs, pages of 100 nodes / 1000 jobs",
        ),
        Figure("web_placement_requests_from_50_viewers", by_viewers, "requests"),
    ]
    return figures


async def refresh_through_placement(s: Scenario, n: int = NODES, rounds: int = 5) -> Figure:
    """One refresh of the cache through NATS against the real placement holding ``n`` nodes,
    asked as a viewer (median of ``rounds``): what one interval costs, for every viewer."""
    await load_fleet(s, fleet("webapi", n), timeout=max(30.0, n / 200))
    creds = s.auth.mint("viewer", "bench-web") if s.auth is not None else None
    nc = await connect(s.nats.url, "bench-web", creds=str(creds) if creds else None)
    try:
        reader = NatsReader(nc, "bench-web" if creds else "anonymous", timeout=30.0)
        cache = FleetCache(reader.ask, reader.events, jobs_limit=JOBS)
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            await cache.refresh()
            times.append((time.perf_counter() - t0) * 1000)
            if cache.snapshot.error:
                raise BenchError(cache.snapshot.error)
        got = len(cache.snapshot.nodes)
    finally:
        await nc.close()
    if got != n:
        raise BenchError(f"the cache read {got} of {n} nodes")
    return Figure(
        "web_refresh_through_placement_1k_nodes",
        statistics.median(times),
        "ms",
        note=f"{n} nodes read in pages of 100 through NATS as a viewer; runs {times}",
    )
