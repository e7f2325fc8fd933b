"""Shared fixtures: real NATS and PostgreSQL, no Docker needed.

- Default: a session-wide embedded PostgreSQL (fresh database per test) and a fresh embedded
  nats-server per test that needs one (a few tens of milliseconds; no stream state leaks).
- ``GPULAYER_NATS_URL`` / ``GPULAYER_DATABASE_URL``: use existing servers instead (streams are
  deleted before each test; each test still gets its own database).
- ``GPULAYER_TEST_BACKEND=containers``: testcontainers starts both, where Docker exists.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import pytest
from nats.aio.client import Client

from gpulayer_runtime.nats import connect
from gpulayer_runtime.servers import EmbeddedNats, EmbeddedPostgres

REPO_ROOT = Path(__file__).resolve().parent.parent
FIXTURES = REPO_ROOT / "tests" / "fixtures"


class CrashWatch(logging.Handler):
    """Sees placement's "task ... crashed" and the executor's "side task ... died": a service
    task that dies is a bug, and fails the test it happens in.

    Attached to the services' own loggers (not the root), so neither caplog nor a test's logging
    setup takes it away; a test that makes a task die on purpose says so with ``expect()``."""

    LOGGERS = ("gpulayer_placement.service", "gpulayer_executor.service")
    FORMATS = ("task %s crashed", "side task %s died")

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.crashes: list[str] = []
        self.expected = 0

    def emit(self, record: logging.LogRecord) -> None:
        if str(record.msg).startswith(self.FORMATS):
            self.crashes.append(record.getMessage())

    def expect(self, n: int = 1) -> None:
        """This test makes ``n`` tasks die on purpose."""
        self.expected += n


@pytest.fixture(autouse=True)
def task_crashes() -> Iterator[CrashWatch]:
    watch = CrashWatch()
    loggers = [logging.getLogger(name) for name in CrashWatch.LOGGERS]
    for logger in loggers:
        logger.addHandler(watch)
    try:
        yield watch
    finally:
        for logger in loggers:
            logger.removeHandler(watch)
    if len(watch.crashes) != watch.expected:
        pytest.fail(
            f"{len(watch.crashes)} service task(s) died, {watch.expected} expected: "
            + "; ".join(watch.crashes)
        )


def _backend() -> str:
    return os.environ.get("GPULAYER_TEST_BACKEND", "embedded")


@pytest.fixture(scope="session")
def postgres_admin_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a PostgreSQL server whose ``postgres`` database may create databases."""
    if url := os.environ.get("GPULAYER_DATABASE_URL"):
        yield url
        return
    if _backend() == "containers":
        from testcontainers.postgres import PostgresContainer

        with PostgresContainer("postgres:17", driver=None) as pg:
            yield pg.get_connection_url()
        return
    with EmbeddedPostgres(tmp_path_factory.mktemp("pg"), fast=True) as pg:
        yield pg.url


@pytest.fixture
async def database_url(postgres_admin_url: str) -> AsyncIterator[str]:
    """A fresh, empty database for this test."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(postgres_admin_url)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    base, _, _ = postgres_admin_url.rpartition("/")
    yield f"{base}/{name}"
    admin = await asyncpg.connect(postgres_admin_url)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


@pytest.fixture(scope="session")
def _nats_container() -> Iterator[str | None]:
    if _backend() != "containers" or os.environ.get("GPULAYER_NATS_URL"):
        yield None
        return
    from testcontainers.core.container import DockerContainer

    with DockerContainer("nats:2.10").with_command("-js").with_exposed_ports(4222) as c:
        yield f"nats://{c.get_container_host_ip()}:{c.get_exposed_port(4222)}"


@pytest.fixture
async def nats_url(tmp_path: Path, _nats_container: str | None) -> AsyncIterator[str]:
    """A NATS server with JetStream and no gpulayer streams in it yet."""
    existing = os.environ.get("GPULAYER_NATS_URL") or _nats_container
    if existing:
        nc = await connect(existing, "test-cleanup")
        js = nc.jetstream()
        for info in await js.streams_info():
            if info.config.name:
                await js.delete_stream(info.config.name)
        await nc.close()
        yield existing
        return
    server = EmbeddedNats(tmp_path / "nats").start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[Client]:
    client = await connect(nats_url, "test")
    yield client
    await client.drain()
