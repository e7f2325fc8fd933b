"""A JetStream pull consumer with its pull request kept open: no request per batch.

nats-py's ``PullSubscription.fetch`` asks the server for every batch: a ``no_wait`` request
first (answered ``404 No Messages`` when the consumer is empty), then a lingering one that
returns with the first message to arrive. A consumer fed a message at a time (placement's job
and status consumers, an executor's grants) pays two requests, a status message and the
wake-ups of three processes for each batch of one, and the fetch's own tasks and timers: in the
loop, about nine fetches per job between placement and the executor.

``Puller`` keeps a pull request outstanding instead, as the newer NATS clients' ``Consume``
does: one request for ``batch`` messages that the server fills as messages are stored, and a
new one when what is left of the requests falls to half a batch. ``fetch`` takes what has
arrived (at least one message, at most ``batch``) from the subscription's queue and tops the
requests up; between batches nothing is sent but the acks. Each request expires after
``expires_s`` (answered ``408`` with how many of it were left); after a reconnect (the server
forgets a connection's requests) the next ``fetch`` asks again, and any request the server no
longer holds counts as expired after ``expires_s``: a consumer never waits longer than that
for a request it will not get.

Messages delivered but not taken when the consumer stops (at most a batch and a half), and
those the consumer took and hands back unhandled (``give_back``), are ``nak``-ed by ``close``
once the subscription's interest is gone: redelivered at once to whoever consumes next, not
after ``ack_wait``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterable
from typing import Protocol

import msgspec
import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext

log = logging.getLogger(__name__)

_STATUS = "Status"
_PENDING = "Nats-Pending-Messages"
_HEARTBEAT = "100"
_NO_MESSAGES = "404"
_EXPIRED = "408"
_EXPECTED = ("Server Shutdown", "Leadership Change")


class Fetcher(Protocol):
    """What a consume loop takes batches from: ``PullSubscription`` or a ``Puller``.
    ``fetch`` returns 1 to ``batch`` messages, or raises ``TimeoutError`` after ``timeout``."""

    async def fetch(self, batch: int, timeout: float) -> list[Msg]: ...


class _Request(msgspec.Struct):
    batch: int
    expires: int


_encode = msgspec.json.Encoder().encode


class Puller:
    """Batches from a bound pull subscription with its requests kept open (module doc)."""

    def __init__(self, sub: JetStreamContext.PullSubscription, *, expires_s: float = 5.0) -> None:
        self._sub = sub
        self._queue: asyncio.Queue[Msg] = sub._sub._pending_queue
        self._expires_s = expires_s
        # Messages asked for and neither delivered nor expired, across open requests.
        self._pending = 0
        # When the last request sent expires: after it, none is open, whatever the server said.
        self._open_until = 0.0
        # After a refusal (409, 503): no new request before this.
        self._quiet_until = 0.0
        # The connection's reconnects when the last request was sent: a reconnect drops them.
        self._reconnects = -1
        # Taken and handed back unhandled (``give_back``): nak-ed at ``close``.
        self._returned: list[Msg] = []

    async def fetch(self, batch: int, timeout: float) -> list[Msg]:
        batch = max(batch, 1)  # a request for none would be refused by the server
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        msgs: list[Msg] = []
        while not msgs:
            await self._top_up(batch, loop.time())
            left = deadline - loop.time()
            if self._queue.empty():
                if left <= 0:
                    raise nats.errors.TimeoutError
                # Wake for the next request too, when it falls due first.
                wait = min(left, max(self._next_due(loop.time()), 0.001))
                try:
                    async with asyncio.timeout(wait):
                        first = await self._queue.get()
                except TimeoutError:
                    continue
                self._take(first, msgs)
            while len(msgs) < batch and not self._queue.empty():
                self._take(self._queue.get_nowait(), msgs)
        await self._top_up(batch, loop.time())
        return msgs

    def _next_due(self, now: float) -> float:
        """Seconds until a new request may be needed: open requests expire, or a pause ends."""
        if self._pending > 0:
            return self._open_until - now
        return self._quiet_until - now

    def _take(self, msg: Msg, into: list[Msg]) -> None:
        self._read(msg)
        headers = msg.headers
        status = headers.get(_STATUS) if headers else None
        if not headers or not status:
            self._pending = max(self._pending - 1, 0)
            into.append(msg)
            return
        if status in (_HEARTBEAT, _NO_MESSAGES):
            return
        if status == _EXPIRED:
            # A request expired: the server says how much of it was left (else: count all).
            left = headers.get(_PENDING, "")
            self._pending = max(self._pending - int(left), 0) if left.isdigit() else 0
            return
        # A request ended without saying what was left of it (409: the consumer deleted, a
        # leader changed, too many requests waiting; 503: no JetStream answered): count every
        # request as ended and wait a moment before asking again.
        description = headers.get("Description", "")
        # A server stopping or a stream's leader moving is expected in a restart: said once,
        # quietly. Anything else (the consumer deleted, too many requests) is worth a look.
        level = logging.INFO if description in _EXPECTED else logging.WARNING
        log.log(level, "pull request on %s ended: %s %s", self._sub._nms, status, description)
        self._pending = 0
        self._quiet_until = asyncio.get_running_loop().time() + 0.5

    def _read(self, msg: Msg) -> None:
        """Account a message taken from the queue as ``Subscription.next_msg`` does: its bytes
        no longer pending, and done (a drain of the connection waits for every one)."""
        self._sub._sub._pending_size -= len(msg.data)
        self._queue.task_done()

    async def _top_up(self, batch: int, now: float) -> None:
        reconnects = self._sub._nc.stats["reconnects"]
        if now >= self._open_until or reconnects != self._reconnects:
            # Every request sent has expired by now, or went with the last connection.
            self._pending = 0
            self._reconnects = reconnects
        if self._pending > batch // 2 or now < self._quiet_until:
            return
        request = _encode(_Request(batch=batch, expires=int(self._expires_s * 1e9)))
        await self._sub._nc.publish(self._sub._nms, request, self._sub._deliver)
        self._pending += batch
        # A little past the server's expiry, so its 408 is read before the count is dropped.
        self._open_until = now + self._expires_s + 0.5

    def give_back(self, msgs: Iterable[Msg]) -> None:
        """Messages taken from this puller that the consumer will not handle: ``nak``-ed by
        ``close``, with what it holds."""
        self._returned.extend(msgs)

    async def close(self) -> None:
        """End the subscription, then give back what was delivered and not taken and what
        ``give_back`` returned: ``nak``, redelivered at once to whoever asks next. The interest
        goes first: a message nak-ed while a request of this subscription is still open is
        redelivered to that request, into a queue nobody reads, and waits out ``ack_wait``."""
        await self._end_interest()
        msgs, self._returned = self._returned, []
        while not self._queue.empty():
            msg = self._queue.get_nowait()
            self._read(msg)
            if not (msg.headers and msg.headers.get(_STATUS)):
                msgs.append(msg)
        for msg in msgs:
            try:
                await msg.nak()
            except (nats.errors.Error, OSError) as err:
                log.warning("could not give back %s: %r", msg.subject, err)
                return

    async def _end_interest(self) -> None:
        """Unsubscribe at the server, then flush: what it sent before that is in the queue
        when the flush returns (nats-py's ``unsubscribe`` drops the queue's subscription at
        once, and with it whatever was still on the way). Then the subscription is closed."""
        inner, nc = self._sub._sub, self._sub._nc
        try:
            if nc.is_connected and nc._subs.get(inner._id) is inner:
                await nc._send_unsubscribe(inner._id)
                await nc.flush(2)
        except (nats.errors.Error, OSError, TimeoutError) as err:
            log.info("pull subscription on %s: no clean unsubscribe: %r", self._sub._nms, err)
        with contextlib.suppress(nats.errors.Error, ValueError):
            await self._sub.unsubscribe()


@contextlib.asynccontextmanager
async def pulling(sub: JetStreamContext.PullSubscription | Fetcher) -> AsyncIterator[Fetcher]:
    """What a consume loop reads: a ``PullSubscription`` through a ``Puller``, closed when the
    loop ends (the subscription ends with it, what it holds is given back); anything else with
    a ``fetch`` (a test's) as it is."""
    if not isinstance(sub, JetStreamContext.PullSubscription):
        yield sub
        return
    puller = Puller(sub)
    try:
        yield puller
    finally:
        await puller.close()
