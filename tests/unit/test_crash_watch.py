"""The suite fails a test in which a service task dies (tests/conftest.py, ``task_crashes``)."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace
from typing import Any, cast

from tests.conftest import CrashWatch

from gpulayer_placement.service import PlacementService


async def _boom() -> None:
    raise RuntimeError("boom")


async def test_a_placement_task_that_dies_is_seen(task_crashes: CrashWatch) -> None:
    nc = SimpleNamespace(jetstream=lambda: None, max_payload=1 << 20)
    svc = PlacementService(cast(Any, nc), cast(Any, None))
    svc._spawn("doomed", _boom())
    await asyncio.gather(*svc._tasks, return_exceptions=True)
    await asyncio.sleep(0)  # done callbacks run on the next loop turn
    assert svc.stop.is_set()
    assert task_crashes.crashes == ["task doomed crashed: RuntimeError('boom'); stopping"]
    task_crashes.expect()  # this one on purpose: the fixture would fail the test otherwise


def test_an_executor_side_task_that_dies_is_seen(task_crashes: CrashWatch) -> None:
    # The executor's own line (gpulayer_executor/service.py), as its run loop logs it.
    logging.getLogger("gpulayer_executor.service").error("side task %s died", "grants")
    assert task_crashes.crashes == ["side task grants died"]
    task_crashes.expect()


def test_the_watch_fails_what_it_did_not_expect(task_crashes: CrashWatch) -> None:
    watch = CrashWatch()
    logger = logging.getLogger("gpulayer_placement.service")
    logger.addHandler(watch)
    try:
        logger.error("task %s crashed: %r; stopping", "ingest", ValueError())
        logger.error("something else went wrong")
    finally:
        logger.removeHandler(watch)
    assert len(watch.crashes) == 1
    assert watch.expected == 0
    assert task_crashes.crashes == watch.crashes  # and the autouse one saw it too
    task_crashes.expect()
