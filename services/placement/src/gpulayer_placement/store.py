"""PostgreSQL edge of placement: migrations and named queries from ``queries.sql``."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any

import asyncpg
from asyncpg.connect_utils import SessionAttribute

from gpulayer_runtime.database import replace_url, url_hosts

# What a lost or restarting database raises, besides the server's own errors: the connection
# closed under a query (InterfaceError), the protocol left mid-operation (InternalClientError),
# a refused or reset socket (OSError), a query that timed out. Handlers catch these, retry or
# get their messages redelivered, and go on.
DB_ERRORS: tuple[type[BaseException], ...] = (
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
    OSError,
    TimeoutError,
)

# What PostgreSQL raises for the data of one statement, not for its own state: a value it
# can't hold (NUL in text, a number out of range), a broken constraint, nesting deeper than its
# stack. Retrying the same rows gives the same error, so handlers isolate the row instead.
DATA_ERRORS: tuple[type[BaseException], ...] = (
    asyncpg.DataError,
    asyncpg.IntegrityConstraintViolationError,
    asyncpg.ProgramLimitExceededError,
)

# Another replica got there first: a device already held (the allocations' exclusion
# constraint) or a node's cores, RAM, slots or shared GPU memory full (the reservations
# trigger raises check_violation), or a distributed job's rendezvous port on a node (the
# gang_ports unique index). Reload the fleet's holds and match again.
CONFLICTS: tuple[type[BaseException], ...] = (
    asyncpg.ExclusionViolationError,
    asyncpg.CheckViolationError,
    asyncpg.UniqueViolationError,
)

log = logging.getLogger(__name__)

_NAME = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)

# Any fixed number: every placement replica takes the same lock, so migrations run once.
_MIGRATION_LOCK = 0x67707531


def load_queries(text: str) -> dict[str, str]:
    """Split ``-- name: x`` sections into {name: sql}."""
    parts = _NAME.split(text)
    queries: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        sql = "\n".join(
            line for line in body.strip().splitlines() if not line.lstrip().startswith("--")
        )
        if name in queries:
            raise ValueError(f"query {name!r} defined twice")
        queries[name] = sql.strip().rstrip(";")
    return queries


QUERIES = load_queries(resources.files(__package__).joinpath("queries.sql").read_text())


def migrations() -> list[tuple[int, str, str]]:
    """(number, name, sql) of every numbered migration file, in order."""
    found = []
    for entry in resources.files(__package__).joinpath("migrations").iterdir():
        m = re.match(r"^(\d+)_(.+)\.sql$", entry.name)
        if m:
            found.append((int(m[1]), entry.name, entry.read_text()))
    return sorted(found)


async def migrate(conn: Any) -> list[str]:
    """Apply the migrations not yet recorded in ``schema_migrations``. Returns the applied names."""
    applied: list[str] = []
    await conn.execute("SELECT pg_advisory_lock($1)", _MIGRATION_LOCK)
    try:
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations ("
            " version int PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"
        )
        done = {r["version"] for r in await conn.fetch("SELECT version FROM schema_migrations")}
        for version, name, sql in migrations():
            if version in done:
                continue
            async with conn.transaction():
                await conn.execute(sql)
                await conn.execute(
                    "INSERT INTO schema_migrations (version, name) VALUES ($1, $2)", version, name
                )
            log.info("applied migration %s", name)
            applied.append(name)
    finally:
        await conn.execute("SELECT pg_advisory_unlock($1)", _MIGRATION_LOCK)
    return applied


async def _keep_session(conn: Any) -> None:
    """Placement keeps no session state on pooled connections (every statement runs in its own
    transaction), so the default RESET ALL round trip on each release buys nothing."""


async def create_pool(url: str, *, min_size: int = 2, max_size: int = 8) -> asyncpg.Pool:
    pool = await asyncpg.create_pool(
        url,
        min_size=min_size,
        max_size=max_size,
        reset=_keep_session,
        connect=HostsLog(url).connect,
    )
    assert pool is not None
    return pool


# What a server that isn't up yet answers: nothing listening, a name not resolved yet (compose's
# DNS before the container runs), a server still starting or shutting down, or, with several
# hosts and target_session_attrs=read-write, none of them accepting writes (each a standby, a
# failover under way). Anything else (a refused login, a missing database) is not fixed by
# waiting.
_NOT_UP_YET = (
    OSError,
    asyncio.TimeoutError,
    asyncpg.CannotConnectNowError,
    asyncpg.TargetServerAttributeNotMatched,
)


class _NowAndThen:
    """Yes at the first ask, then at most once every ``every_s``: a log line for a state that
    may last (a server away), said at once and then now and then."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self._last: float | None = None

    def due(self) -> bool:
        now = time.monotonic()
        if self._last is not None and now - self._last < self.every_s:
            return False
        self._last = now
        return True


class HostsLog:
    """asyncpg's connect for the pool, which says what each host answered when no connection
    could be made to a URL of several hosts (asyncpg raises only the last host's error): "no
    PostgreSQL host takes writes: h1:5432 refused ..., h2:5433 is a standby". Logged at most
    every ``log_every_s``; only a failed connect pays for it, never a query."""

    def __init__(self, url: str, log_every_s: float = 10.0) -> None:
        self.url = url
        self.hosts = url_hosts(url)
        self._log = _NowAndThen(log_every_s)

    async def connect(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await asyncpg.connect(*args, **kwargs)
        except _NOT_UP_YET as err:
            if len(self.hosts) > 1 and self._log.due():
                answers = await asyncio.gather(*(self.answer(h) for h in self.hosts))
                log.warning(
                    "no PostgreSQL host takes writes (%s): %s",
                    err or type(err).__name__,
                    "; ".join(f"{h}: {a}" for h, a in zip(self.hosts, answers, strict=True)),
                )
            raise

    async def answer(self, host: str, timeout_s: float = 3.0) -> str:
        """What ``host`` alone answers: "takes writes", "a standby (read-only)" or the error."""
        url = replace_url(self.url, hosts=host)
        try:
            conn = await asyncpg.connect(
                url, target_session_attrs=SessionAttribute.any, timeout=timeout_s
            )
        except Exception as err:  # what it answered is what we log
            return f"{type(err).__name__}: {err}"
        try:
            standby = await conn.fetchval("SELECT pg_is_in_recovery()", timeout=timeout_s)
            return "a standby (read-only)" if standby else "takes writes"
        except Exception as err:
            return f"{type(err).__name__}: {err}"
        finally:
            conn.terminate()


async def create_pool_when_up(
    url: str,
    *,
    connect: Callable[[str], Awaitable[asyncpg.Pool]] = create_pool,
    first_wait_s: float = 0.5,
    max_wait_s: float = 5.0,
    log_every_s: float = 10.0,
) -> asyncpg.Pool:
    """``connect(url)``, again while the server isn't up yet (``_NOT_UP_YET``), waiting
    ``first_wait_s`` doubling to ``max_wait_s`` in between, for as long as it takes: placement
    started beside its database (compose, a boot) waits for it as it waits for NATS, instead of
    exiting. A wait is logged at once and then every ``log_every_s``; any other error is
    raised."""
    wait = first_wait_s
    say = _NowAndThen(log_every_s)
    while True:
        try:
            return await connect(url)
        except _NOT_UP_YET as err:
            if say.due():
                log.warning("PostgreSQL not up yet (%s): trying again", err or type(err).__name__)
        await asyncio.sleep(wait)
        wait = min(wait * 2, max_wait_s)


class Store:
    """Calls queries by name. Each method takes the connection it runs on, so callers decide
    what shares a transaction."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool

    @staticmethod
    async def fetch(conn: Any, name: str, *args: Any) -> list[asyncpg.Record]:
        return list(await conn.fetch(QUERIES[name], *args))

    @staticmethod
    async def fetchrow(conn: Any, name: str, *args: Any) -> asyncpg.Record | None:
        row: asyncpg.Record | None = await conn.fetchrow(QUERIES[name], *args)
        return row

    @staticmethod
    async def execute(conn: Any, name: str, *args: Any) -> str:
        status: str = await conn.execute(QUERIES[name], *args)
        return status
