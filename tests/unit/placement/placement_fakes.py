"""Fakes for building one placement part alone in a unit test: a pool whose connection
records the named queries it ran, and a JetStream that records what was published.
Integration tests use the real servers instead."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any, cast

from gpulayer_contracts import AcceleratorDevice, HostInfo, WorkerCapabilities, __version__
from gpulayer_placement.fleet import Fleet
from gpulayer_placement.publisher import Publisher
from gpulayer_placement.replica_sync import ReplicaSync
from gpulayer_placement.scheduler import Scheduler
from gpulayer_placement.settings import Settings
from gpulayer_placement.store import QUERIES
from gpulayer_placement.wake import Wake

_NAMES = {sql: name for name, sql in QUERIES.items()}


class FakeTransaction:
    """asyncpg's ``Transaction``: used as ``async with``, or started and committed by hand."""

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def start(self) -> None:
        return None

    async def commit(self) -> None:
        return None

    async def rollback(self) -> None:
        return None


class FakeConn:
    """Records ``(query name, args)``; ``fetch`` answers from ``rows`` by query name."""

    def __init__(self, rows: dict[str, list[dict[str, Any]]] | None = None) -> None:
        self.rows = rows or {}
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def _record(self, sql: str, args: tuple[Any, ...]) -> str:
        name = _NAMES.get(sql, sql)
        self.calls.append((name, args))
        return name

    async def fetch(self, sql: str, *args: Any) -> list[dict[str, Any]]:
        return self.rows.get(self._record(sql, args), [])

    async def execute(self, sql: str, *args: Any) -> str:
        self._record(sql, args)
        return "OK"

    def transaction(self, **options: Any) -> FakeTransaction:
        return FakeTransaction()

    def names(self) -> list[str]:
        return [n for n, _ in self.calls]


class FakePool:
    def __init__(self, conn: FakeConn | None = None) -> None:
        self.conn = conn or FakeConn()

    @asynccontextmanager
    async def acquire(self) -> AsyncIterator[FakeConn]:
        yield self.conn


class FakeJetStream:
    """Acks every publish only once ``ack_after`` messages were sent (all of them by default),
    so a publisher that waited for each ack before sending the next would never finish."""

    def __init__(self, ack_after: int | None = None) -> None:
        self.sent: list[tuple[str, bytes, dict[str, str]]] = []
        self.ack_after = ack_after
        self._waiting: list[asyncio.Future[None]] = []

    async def publish_async(
        self, subject: str, payload: bytes, headers: dict[str, str] | None = None
    ) -> asyncio.Future[None]:
        self.sent.append((subject, payload, dict(headers or {})))
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(fut)
        if self.ack_after is not None and len(self.sent) >= self.ack_after:
            for f in self._waiting:
                if not f.done():  # a publisher that gave up cancelled its wait
                    f.set_result(None)
            self._waiting.clear()
        return fut


def fake_scheduler(
    node: WorkerCapabilities, conn: FakeConn | None = None
) -> tuple[Scheduler, FakeJetStream]:
    """A scheduler over a real Fleet holding ``node``, on a FakePool and a FakeJetStream."""
    fleet, wake, stop = Fleet(), Wake(), asyncio.Event()
    fleet.upsert(node)
    pool = cast(Any, FakePool(conn))
    js = FakeJetStream(ack_after=1)
    settings = Settings()
    publisher = Publisher(cast(Any, js), pool, settings)
    sync = ReplicaSync(pool, fleet, wake, stop, "replica-1")
    scheduler = Scheduler(
        pool=pool,
        fleet=fleet,
        wake=wake,
        publisher=publisher,
        sync=sync,
        settings=settings,
        stop=stop,
    )
    return scheduler, js


def cpu_node(node_id: str) -> WorkerCapabilities:
    return WorkerCapabilities(
        node_id=node_id,
        agent_version="0",
        detected_at=datetime.now(UTC),
        host=HostInfo(platform="linux-x86_64", os="linux", cpu_cores=2),
    )


def gpu_node(
    node_id: str, n: int, *, cores: int | None = None, memory_bytes: int | None = None
) -> WorkerCapabilities:
    """A node with ``n`` H100s (as recorded from a real one), every device usable; host cores
    and RAM unreported unless given."""
    return WorkerCapabilities(
        node_id=node_id,
        agent_version=__version__,
        detected_at=datetime.now(UTC),
        host=HostInfo(
            platform="linux-x86_64", os="linux", cpu_cores=cores, memory_bytes=memory_bytes
        ),
        accelerators=[
            AcceleratorDevice(
                accelerator="cuda",
                index=i,
                vendor="NVIDIA",
                name="NVIDIA H100 80GB HBM3",
                memory_mib=81559,
                memory_kind="dedicated",
                compute_capability="9.0",
                execution_supported=True,
            )
            for i in range(n)
        ],
    )
