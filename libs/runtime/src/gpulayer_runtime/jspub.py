"""Pipelined JetStream publishes, their acks read on one inbox subscription.

``PipelinedPublisher.publish_many`` sends every message of a batch with a reply subject of its
own, then waits for all the acks at once: one round trip per batch, not per message, as
nats-py's ``publish_async`` does, at about half its CPU per message (the bench's
``jetstream_publish_*`` figures: 21.4 against 40.3 µs; placement publishes three messages per
job: the ``accepted`` and ``placed`` events and the grant). Where nats-py's cost was:

- each ack decoded with ``json.loads`` and built into a ``PubAck`` dataclass through
  ``dataclasses.fields``: here one msgspec decode into a small struct;
- a NUID plus ``secrets.token_hex`` per reply subject, a semaphore taken under ``wait_for`` and a
  done-callback per message: here a counter, and the batch's futures dropped together;
- a JetStream error reply (``{"error": ...}``) raised inside nats-py's reply handler
  (``APIError.from_error`` raises, it doesn't return), so the publish waited for its timeout:
  here the batch fails at once, with that error.

An ack that can't be read (never sent by a server: the inbox is this connection's own) fails its
message; one for no message waited for (late, after a timeout) is dropped.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.errors import APIError, NoStreamResponseError

# A message: subject, payload, headers.
Item = tuple[str, bytes, dict[str, str]]

_NO_RESPONDERS = "503"


class _ApiError(msgspec.Struct):
    code: int = 0
    err_code: int | None = None
    description: str | None = None


class _Ack(msgspec.Struct):
    """What a stream answers a publish: ``stream`` and ``seq`` (``duplicate`` when the message
    id was seen), or ``error``."""

    stream: str = ""
    seq: int = 0
    duplicate: bool = False
    error: _ApiError | None = None


_ack_decoder = msgspec.json.Decoder(_Ack)


class BadAck(nats.errors.Error):
    """A reply on the ack inbox that is not a stream's answer (a NATS error, as the others a
    publish raises)."""


class PipelinedPublisher:
    def __init__(self, nc: Client) -> None:
        self._nc = nc
        self._prefix = ""
        self._count = itertools.count(1)
        self._waiting: dict[str, asyncio.Future[None]] = {}

    async def start(self) -> None:
        """Subscribe to this connection's ack inbox (once)."""
        if self._prefix:
            return
        self._prefix = self._nc.new_inbox() + "."
        await self._nc.subscribe(self._prefix + "*", cb=self._on_ack)

    async def publish_many(self, items: Sequence[Item], timeout: float) -> None:
        """Send ``items`` to their streams and wait for every ack; raises the first failure
        (``NoStreamResponseError``, an ``APIError``, ``BadAck``) or ``TimeoutError``."""
        if not items:
            return
        await self.start()
        loop = asyncio.get_running_loop()
        tokens: list[str] = []
        futures: list[asyncio.Future[None]] = []
        try:
            for subject, data, headers in items:
                token = str(next(self._count))
                future: asyncio.Future[None] = loop.create_future()
                self._waiting[token] = future
                tokens.append(token)
                futures.append(future)
                await self._nc.publish(subject, data, reply=self._prefix + token, headers=headers)
            await asyncio.wait_for(asyncio.gather(*futures), timeout)
        finally:
            for token in tokens:
                self._waiting.pop(token, None)

    @property
    def waiting(self) -> int:
        """Messages sent whose acks are awaited now."""
        return len(self._waiting)

    async def _on_ack(self, msg: Msg) -> None:
        future = self._waiting.pop(msg.subject[len(self._prefix) :], None)
        if future is None or future.done():
            return
        if msg.headers and msg.headers.get("Status") == _NO_RESPONDERS:
            future.set_exception(NoStreamResponseError())
            return
        try:
            ack = _ack_decoder.decode(msg.data)
        except msgspec.DecodeError as err:
            future.set_exception(BadAck(f"not a stream's ack: {err}"))
            return
        if ack.error is not None:
            e = ack.error
            future.set_exception(
                APIError(code=e.code, err_code=e.err_code, description=e.description)
            )
            return
        future.set_result(None)
