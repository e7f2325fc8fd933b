"""Placement's pool follows a Patroni leader through a multi-host URL
(``target_session_attrs=read-write``): its leader's PostgreSQL killed with SIGKILL, the
synchronous standby promoted, writes go on through the same pool with no restart and every
acknowledged write is on the new leader; a URL none of whose hosts takes writes waits, saying
what each host answered. Part of ``make faults-ha`` (it needs etcd and Patroni's venv)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest
from tests.faults import patroni_cluster
from tests.faults.patroni_cluster import PatroniCluster

from gpulayer_placement.store import DB_ERRORS, create_pool, create_pool_when_up
from gpulayer_runtime.database import replace_url

HA_ENV = "GPULAYER_HA_TESTS"
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        os.environ.get(HA_ENV) != "1",
        reason="the Patroni cluster's tests run in `make faults-ha` (etcd, Patroni's venv)",
    ),
]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[PatroniCluster]:
    why = patroni_cluster.unavailable()
    if why is not None:
        pytest.fail(f"make faults-ha needs {why}")
    with PatroniCluster(tmp_path / "ha") as running:
        yield running


async def test_the_pool_follows_the_promoted_standby(
    cluster: PatroniCluster, caplog: pytest.LogCaptureFixture
) -> None:
    url = await cluster.service_database()
    assert "target_session_attrs=read-write" in url
    pool = await create_pool(url)
    acked: list[int] = []
    errors: list[str] = []
    enough = asyncio.Event()
    want = 0
    try:
        await pool.execute("CREATE TABLE writes (i int PRIMARY KEY, at timestamptz DEFAULT now())")

        async def writer() -> None:
            i = 0
            while True:
                try:
                    await pool.execute("INSERT INTO writes (i) VALUES ($1)", i)
                except DB_ERRORS as err:
                    errors.append(f"{type(err).__name__}: {err}")
                    if isinstance(err, asyncpg.UniqueViolationError):
                        i += 1  # committed, its ack lost with the server: not counted
                    await asyncio.sleep(0.05)
                    continue
                acked.append(i)
                i += 1
                if len(acked) >= want:
                    enough.set()

        async def until_acked(n: int, what: str, limit_s: float) -> None:
            nonlocal want
            want = len(acked) + n
            enough.clear()
            try:
                await asyncio.wait_for(enough.wait(), limit_s)
            except TimeoutError:
                raise AssertionError(
                    f"{n} writes not acknowledged {what} within {limit_s} s; last errors: "
                    f"{errors[-5:]}"
                ) from None

        task = asyncio.create_task(writer())
        try:
            await until_acked(50, "before the kill", 30)
            old = cluster.leader()
            assert old is not None
            killed_at = time.monotonic()
            cluster.kill_postgres(old)
            await cluster.until_async(
                lambda c: c.leader() not in (None, old), "other leader after the kill", 60
            )
            await until_acked(50, "after the failover", 30)
            stall = max(0.0, time.monotonic() - killed_at)
            new = cluster.leader()
            # The old leader rejoins as a standby (Patroni, pg_rewind where its WAL went on).
            await cluster.until_async(
                lambda c: old in c.streaming(), f"{old} streaming again as a standby", 90
            )
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        print(f"failover {old} -> {new}: writes resumed {stall:.1f} s after the kill")
        async with pool.acquire() as conn:
            assert await conn.fetchval("SELECT NOT pg_is_in_recovery()")
            stored = {r["i"] for r in await conn.fetch("SELECT i FROM writes")}
        assert set(acked) <= stored, sorted(set(acked) - stored)[:20]
        assert errors, "the kill should have failed a statement or a connect"

        # A URL whose every host is a standby: the pool waits, logging what each answered,
        # and never connects (so never writes there).
        two_standbys = replace_url(url, hosts=f"127.0.0.1:{cluster.members[old].port},127.0.0.1:1")
        caplog.set_level(logging.WARNING, logger="gpulayer_placement.store")
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(create_pool_when_up(two_standbys, first_wait_s=0.1), 3)
        said = caplog.text
        assert "no PostgreSQL host takes writes" in said, said
        assert f"127.0.0.1:{cluster.members[old].port}: a standby (read-only)" in said, said
        assert "127.0.0.1:1: ConnectionRefusedError" in said, said
    finally:
        await pool.close()
