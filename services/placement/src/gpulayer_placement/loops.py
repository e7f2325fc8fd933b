"""The two loop shapes placement's parts run in: a pull consumer that hands each fetched batch
to a handler, and a periodic step. Both end when the service's stop event is set."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import FetchTimeoutError

from gpulayer_contracts.codec import best_effort_job_id
from gpulayer_placement.dead_letters import DeadLetters, last_delivery
from gpulayer_placement.store import DATA_ERRORS, DB_ERRORS
from gpulayer_runtime.pull import Fetcher, pulling

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
    sub: JetStreamContext.PullSubscription | Fetcher,
    batch_size: int,
    handle: Callable[[list[Msg]], Awaitable[None]],
    dead: DeadLetters | None = None,
    *,
    in_flight: int = 1,
) -> None:
    """Fetch batches and hand them to ``handle``, which acks what it handled and dead-letters
    what is poison by content. What it raises is dealt with here, so no message stops the loop:
    a database connection error naks the batch for redelivery; anything else is retried one
    message at a time, so only the message that fails is redelivered, and dead-lettered on its
    last delivery.

    ``in_flight``: how many batches may be handled at once. Above 1, after a full batch (a
    backlog) the next batch is fetched and begun while the last is still being handled, so
    ``handle`` must order whatever part of its work must not overlap (the intake matches one
    batch at a time, in fetch order, and announces the last while the next is stored). A short
    batch (the queue drained) is handled before the next fetch, as with 1: what arrives
    meanwhile then makes one larger batch, not several small ones. Every batch begun is handled
    to its end before this returns. A ``PullSubscription`` is read through a ``Puller`` (its
    pull request kept open; what it holds undelivered is given back when the loop ends)."""
    async with pulling(sub) as source:
        await _consume_from(stop, source, batch_size, handle, dead, in_flight)


async def _consume_from(
    stop: asyncio.Event,
    source: Fetcher,
    batch_size: int,
    handle: Callable[[list[Msg]], Awaitable[None]],
    dead: DeadLetters | None,
    in_flight: int,
) -> None:
    tasks: set[asyncio.Task[None]] = set()
    try:
        while not stop.is_set():
            if len(tasks) >= in_flight:
                done, tasks = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    if not t.cancelled() and t.exception() is not None:
                        log.error("handling a batch failed: %r", t.exception())
                continue
            try:
                msgs = await source.fetch(batch_size, timeout=1.0)
            except (FetchTimeoutError, TimeoutError):
                continue
            except (nats.errors.Error, OSError) as err:
                # A NATS cluster moving a stream's leader after a server went away answers
                # "service unavailable" for a moment, and a connection may be reconnecting.
                log.warning("fetch failed, retrying: %r", err)
                await asyncio.sleep(0.5)
                continue
            if in_flight <= 1 or len(msgs) < batch_size:
                await handle_batch(stop, msgs, handle, dead)
            else:
                tasks.add(asyncio.create_task(handle_batch(stop, msgs, handle, dead)))
    except asyncio.CancelledError:
        for t in tasks:
            t.cancel()
        raise
    finally:
        if tasks:
            # handle_batch raises nothing but cancellation: the batches end as they would have.
            await asyncio.gather(*tasks, return_exceptions=True)


T = TypeVar("T")

# What JetStream answers while it can't serve a request now (a server starting, a stream or
# consumer electing a leader, a machine too busy to answer in time), as opposed to a refusal.
NATS_UNAVAILABLE: tuple[type[BaseException], ...] = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.js.errors.ServiceUnavailableError,
)


async def until_nats_answers(
    stop: asyncio.Event, what: str, call: Callable[[], Awaitable[T]], limit_s: float = 120.0
) -> T:
    """``call()`` again, with backoff, while JetStream can't answer now (logged each time),
    for up to ``limit_s``; then its error. For start-up: a replica started beside a NATS
    cluster still electing its leaders must wait for it, not exit."""
    loop = asyncio.get_running_loop()
    deadline, delay = loop.time() + limit_s, 0.25
    while True:
        try:
            return await call()
        except NATS_UNAVAILABLE as err:
            if loop.time() + delay > deadline or stop.is_set():
                raise
            log.warning("%s: NATS did not answer (%r); trying again in %gs", what, err, delay)
        await asyncio.sleep(delay)
        delay = min(delay * 2, 5.0)


class Unpublished(Exception):
    """What a handler had to publish could not be stored now (a stream without a leader for a
    moment, after a NATS server went away): retried like a database that can't be reached, so
    that no message runs out of deliveries meanwhile."""


def transient(err: BaseException) -> bool:
    """A database or a stream that can't be reached now, as opposed to one that refused this
    data."""
    if isinstance(err, Unpublished):
        return True
    return isinstance(err, DB_ERRORS) and not isinstance(err, DATA_ERRORS)


async def handle_batch(
    stop: asyncio.Event,
    msgs: list[Msg],
    handle: Callable[[list[Msg]], Awaitable[None]],
    dead: DeadLetters | None,
) -> None:
    """``handle(msgs)``, with what it raises isolated to the message that raised it."""
    try:
        await handle(msgs)
        return
    except Exception as err:
        failure = err
    if transient(failure):
        await _retry_later(stop, msgs, handle, dead, failure)
        return
    pending = [m for m in msgs if not _settled(m)]
    if len(msgs) > 1:
        log.warning(
            "batch of %d failed (%r): handling its messages one at a time", len(msgs), failure
        )
        for m in pending:
            await handle_batch(stop, [m], handle, dead)
        return
    if not pending:
        return
    msg = pending[0]
    if (isinstance(failure, DATA_ERRORS) or last_delivery(msg)) and dead is not None:
        reason = f"could not be handled: {failure!r}"
        why = "unstorable" if isinstance(failure, DATA_ERRORS) else "failed"
        await dead.send(msg, reason, why, best_effort_job_id(msg.data))
        return
    log.warning("message on %s failed, will be redelivered: %r", msg.subject, failure)
    with contextlib.suppress(Exception):
        await msg.nak(delay=1.0)


async def _retry_later(
    stop: asyncio.Event,
    msgs: list[Msg],
    handle: Callable[[list[Msg]], Awaitable[None]],
    dead: DeadLetters | None,
    err: BaseException,
) -> None:
    """The database or a stream is unreachable.

    A database away: nak for redelivery (the handlers are idempotent; another replica may
    reach it). A message on its last delivery is not the one to blame: it is kept (in
    progress) and handled here again once the server answers, never dead-lettered or left
    undelivered. A stream that can't store now (``Unpublished``: the batch is stored, its
    announcements are not): every message is kept so. Naks would spend a delivery a second
    while NATS elects a leader, and a replica stopped while keeping a message on its last
    delivery would leave it never delivered again: its job stored, never announced (the fault
    run found two). Kept, a message outlives its replica: JetStream delivers it again after
    its ack wait, with deliveries to spare."""
    log.warning("batch of %d failed, will be redelivered: %s", len(msgs), err)
    keep_all = isinstance(err, Unpublished)
    held = [m for m in msgs if keep_all or last_delivery(m)]
    for m in msgs:
        if not keep_all and not last_delivery(m):
            with contextlib.suppress(Exception):
                await m.nak(delay=1.0)
    while held and not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)
        for m in held:
            with contextlib.suppress(Exception):
                await m.in_progress()
        try:
            await handle(held)
            return
        except Exception as again:
            if not transient(again):
                # The database answers, and something in these messages fails: isolate it.
                for m in held:
                    if not _settled(m):
                        await handle_batch(stop, [m], handle, dead)
                return
    # Stopping: another replica takes what this one kept, now rather than after the ack wait.
    for m in held:
        if not _settled(m) and not last_delivery(m):
            with contextlib.suppress(Exception):
                await m.nak()


def _settled(msg: Msg) -> bool:
    """Whether ``msg`` was already acked, nak'ed or dead-lettered: nats-py keeps that on the
    message and refuses a second ack."""
    return bool(getattr(msg, "_ackd", False))
