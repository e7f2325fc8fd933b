"""The two loop shapes placement's parts run in: a pull consumer that hands each fetched batch
to a handler, and a periodic step. Both end when the service's stop event is set."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import FetchTimeoutError

from gpulayer_placement.store import DB_ERRORS

# The name every placement part logs under since before the split: log queries filter on it.
log = logging.getLogger("gpulayer_placement.service")


async def every(stop: asyncio.Event, period: float, fn: Callable[[], Awaitable[None]]) -> None:
    """Run ``fn`` every ``period`` seconds; a database error is logged and retried next time."""
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), period)
        if stop.is_set():
            return
        try:
            await fn()
        except DB_ERRORS as err:
            log.warning("%s failed, will retry: %s", getattr(fn, "__name__", fn), err)


async def consume(
    stop: asyncio.Event,
    sub: JetStreamContext.PullSubscription,
    batch_size: int,
    handle: Callable[[list[Msg]], Awaitable[None]],
) -> None:
    """Fetch batches and hand them to ``handle``; a batch whose handling hit a database error is
    nak'ed for redelivery."""
    while not stop.is_set():
        try:
            msgs = await sub.fetch(batch_size, timeout=1.0)
        except (FetchTimeoutError, TimeoutError):
            continue
        try:
            await handle(msgs)
        except DB_ERRORS as err:
            # Not acked: JetStream redelivers after ack_wait; the handlers are idempotent.
            log.warning("batch of %d failed, will be redelivered: %s", len(msgs), err)
            for m in msgs:
                with contextlib.suppress(Exception):
                    await m.nak(delay=1.0)
