"""Placement's pool follows a Patroni leader through a multi-host URL
(``target_session_attrs=read-write``): its leader's PostgreSQL killed with SIGKILL, the
synchronous standby promoted, writes go on through the same pool with no restart and every
acknowledged write is on the new leader; a URL none of whose hosts takes writes waits, saying
what each host answered. Part of ``make faults-ha`` (it needs etcd and Patroni's venv)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest
from tests.faults import patroni_cluster
from tests.faults.patroni_cluster import PatroniCluster

from gpulayer_placement.store import DB_ERRORS, create_pool, create_pool_when_up
from gpulayer_runtime.database import replace_url

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(300),
    patroni_cluster.only_in_make_faults_ha("the Patroni cluster's tests (etcd, Patroni's venv)"),
]


@pytest.fixture
def cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[PatroniCluster]:
    why = patroni_cluster.unavailable()
    if why is not None:
        pytest.fail(f"make faults-ha needs {why}")
    failsafe = getattr(request, "param", True)
    with PatroniCluster(tmp_path / "ha", failsafe=failsafe) as running:
        yield running


class Writer:
    """Inserts through placement's pool, one after another, each error counted and the insert
    tried again: what was acknowledged (committed) and what failed."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool
        self.acked: list[int] = []
        self.acked_at: list[float] = []
        self.errors: list[str] = []
        self._enough = asyncio.Event()
        self._want = 0
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Writer:
        await self.pool.execute("CREATE TABLE IF NOT EXISTS writes (i int PRIMARY KEY)")
        self._task = asyncio.create_task(self._write())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _write(self) -> None:
        i = 0
        while True:
            try:
                await self.pool.execute("INSERT INTO writes (i) VALUES ($1)", i)
            except DB_ERRORS as err:
                self.errors.append(f"{type(err).__name__}: {err}")
                if isinstance(err, asyncpg.UniqueViolationError):
                    i += 1  # committed, its ack lost with the server: not counted
                await asyncio.sleep(0.05)  # a pause between tries, as placement's handlers
                continue
            self.acked.append(i)
            self.acked_at.append(time.monotonic())
            i += 1
            if len(self.acked) >= self._want:
                self._enough.set()

    async def until_acked(self, n: int, what: str, limit_s: float) -> float:
        """Until ``n`` more writes were acknowledged; the seconds it took."""
        self._want = len(self.acked) + n
        self._enough.clear()
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(self._enough.wait(), limit_s)
        except TimeoutError:
            raise AssertionError(
                f"{n} writes not acknowledged {what} within {limit_s} s; last errors: "
                f"{self.errors[-5:]}"
            ) from None
        return time.monotonic() - t0

    async def all_stored(self) -> None:
        """Every acknowledged write is on the leader the pool reaches."""
        async with self.pool.acquire() as conn:
            assert await conn.fetchval("SELECT NOT pg_is_in_recovery()")
            stored = {r["i"] for r in await conn.fetch("SELECT i FROM writes")}
        assert set(self.acked) <= stored, sorted(set(self.acked) - stored)[:20]


async def test_the_pool_follows_the_promoted_standby(
    cluster: PatroniCluster, caplog: pytest.LogCaptureFixture
) -> None:
    url = await cluster.service_database()
    assert "target_session_attrs=read-write" in url
    pool = await create_pool(url)
    try:
        async with Writer(pool) as writer:
            await writer.until_acked(50, "before the kill", 30)
            old = cluster.leader()
            assert old is not None
            killed_at = time.monotonic()
            cluster.kill_postgres(old)
            await cluster.until_async(
                lambda c: c.leader() not in (None, old), "other leader after the kill", 60
            )
            await writer.until_acked(50, "after the failover", 30)
            stall = max(0.0, time.monotonic() - killed_at)
            new = cluster.leader()
            # The old leader rejoins as a standby (Patroni, pg_rewind where its WAL went on).
            await cluster.until_async(
                lambda c: old in c.streaming(), f"{old} streaming again as a standby", 90
            )
        print(f"failover {old} -> {new}: writes resumed {stall:.1f} s after the kill")
        await writer.all_stored()
        assert writer.errors, "the kill should have failed a statement or a connect"

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


@pytest.mark.parametrize("cluster", [True, False], indirect=True, ids=["failsafe", "no-failsafe"])
async def test_etcd_lost_while_postgresql_is_fine(
    cluster: PatroniCluster, caplog: pytest.LogCaptureFixture
) -> None:
    """etcd killed for longer than the ttl. failsafe_mode on (what docs/operations.md
    recommends): the leader, which still reaches every member over Patroni's API, stays
    primary and writes go on. Off: Patroni demotes it, no host takes writes, placement's pool
    waits saying what each host answered; etcd back, a leader again and writes go on. No
    acknowledged write lost either way."""
    url = await cluster.service_database()
    pool = await create_pool(url)
    caplog.set_level(logging.WARNING, logger="gpulayer_placement.store")
    said_standby = asyncio.Event()

    class Said(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            text = record.getMessage()
            if "no PostgreSQL host takes writes" in text and "a standby (read-only)" in text:
                said_standby.set()

    handler = Said()
    logging.getLogger("gpulayer_placement.store").addHandler(handler)
    try:
        async with Writer(pool) as writer:
            await writer.until_acked(50, "before etcd is killed", 30)
            leader = cluster.leader()
            assert leader is not None
            assert cluster.role(leader) == "primary", cluster.role(leader)
            await asyncio.to_thread(cluster.stop_etcd)
            if cluster.failsafe:
                # Past the ttl the leader key would have expired: writes still go on.
                await asyncio.sleep(patroni_cluster.TTL_S + 5)  # the time is the test
                await writer.until_acked(50, "with etcd gone, in failsafe mode", 10)
                demoted = False
            else:
                assert leader is not None
                await cluster.until_async(
                    lambda c: c.role(leader) not in (None, "primary", "master"),
                    f"{leader} demoted with etcd gone",
                    patroni_cluster.TTL_S + 30,
                )
                demoted = True
                # Placement's pool, failing to connect, says every host is a standby.
                await asyncio.wait_for(said_standby.wait(), 30)
            etcd_back = time.monotonic()
            await asyncio.to_thread(cluster.start_etcd)  # the writes go on meanwhile
            await cluster.until_async(lambda c: c.leader() is not None, "a leader", 60)
            await writer.until_acked(50, "with etcd back", 60)
        gap = max(b - a for a, b in itertools.pairwise(writer.acked_at))
        resumed = next(t for t in writer.acked_at if t >= etcd_back) - etcd_back
        print(
            f"etcd lost ({'failsafe' if cluster.failsafe else 'no failsafe'}): leader {leader} "
            f"demoted: {demoted}; longest time without a write {gap:.1f} s; the first write "
            f"{resumed:.1f} s after etcd was back; errors: {len(writer.errors)}"
        )
        await writer.all_stored()
        if not cluster.failsafe:
            assert "a standby (read-only)" in caplog.text, caplog.text
    finally:
        logging.getLogger("gpulayer_placement.store").removeHandler(handler)
        await pool.close()
