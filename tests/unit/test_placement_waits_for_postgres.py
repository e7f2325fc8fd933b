"""Placement started before its database waits for it (``create_pool_when_up``): a server not
up yet is tried again, with a growing pause and a log line, and a refusal that waiting can't fix
is raised at once."""

from __future__ import annotations

import asyncio
import logging

import asyncpg
import pytest

from gpulayer_placement.store import create_pool_when_up


class Attempts:
    """Stands in for ``create_pool``: raises each of ``errors`` in turn, then returns a pool."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors = list(errors)
        self.urls: list[str] = []
        self.pool = object()
        self.third = asyncio.Event()

    async def __call__(self, url: str) -> asyncpg.Pool:
        self.urls.append(url)
        if len(self.urls) == 3:
            self.third.set()
        if self.errors:
            raise self.errors.pop(0)
        return self.pool  # type: ignore[return-value]


async def test_a_server_not_up_yet_is_tried_again_until_it_answers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    attempts = Attempts(
        ConnectionRefusedError(111, "Connection refused"),
        OSError(-2, "Name or service not known"),
        asyncpg.CannotConnectNowError("the database system is starting up"),
        TimeoutError(),
        # A multi-host URL (target_session_attrs=read-write) whose every host is a standby.
        asyncpg.TargetServerAttributeNotMatched("None of the hosts match"),
    )
    with caplog.at_level(logging.WARNING, logger="gpulayer_placement.store"):
        pool = await create_pool_when_up(
            "postgresql://db/gpulayer", connect=attempts, first_wait_s=0.001, log_every_s=3600
        )
    assert pool is attempts.pool
    assert attempts.urls == ["postgresql://db/gpulayer"] * 6
    # Logged once at the first failure, not at every try.
    (record,) = caplog.records
    assert "PostgreSQL not up yet" in record.getMessage()
    assert "Connection refused" in record.getMessage()


@pytest.mark.parametrize(
    "error",
    [
        asyncpg.InvalidPasswordError("password authentication failed for user gpulayer"),
        asyncpg.InvalidCatalogNameError('database "gpulayer" does not exist'),
    ],
)
async def test_a_refusal_waiting_cannot_fix_is_raised_at_once(error: Exception) -> None:
    attempts = Attempts(error)
    with pytest.raises(type(error)):
        await create_pool_when_up("postgresql://db/gpulayer", connect=attempts, first_wait_s=0.001)
    assert len(attempts.urls) == 1


async def test_the_wait_ends_when_placement_is_told_to_stop() -> None:
    """It waits for as long as it takes; a stop (SIGTERM) cancels it."""
    attempts = Attempts(*[ConnectionRefusedError(111, "Connection refused")] * 1000)
    task = asyncio.create_task(
        create_pool_when_up("postgresql://db/gpulayer", connect=attempts, first_wait_s=0.001)
    )
    await attempts.third.wait()  # still trying after two failures
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
