"""Dead letters and the consumer loop alone: what one message raises stays with that message."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import asyncpg
from nats.aio.msg import Msg

from gpulayer_contracts.subjects import (
    DLQ_MSG_ID_HEADER,
    DLQ_REASON_HEADER,
    DLQ_SIZE_HEADER,
    DLQ_TRUNCATED_HEADER,
    MSG_ID_HEADER,
)
from gpulayer_placement.dead_letters import DLQ_HEADER_RESERVE, DeadLetters
from gpulayer_placement.loops import handle_batch


class FakeMsg(Msg):
    def __init__(self, data: bytes, headers: dict[str, str] | None = None) -> None:
        super().__init__(
            cast(Any, None), subject="gpulayer.jobs.submit", data=data, headers=headers
        )
        self.settled = ""

    async def ack(self) -> None:
        self._ackd, self.settled = True, "ack"

    async def nak(self, delay: float | None = None) -> None:
        self._ackd, self.settled = True, "nak"


class FakeDead(DeadLetters):
    def __init__(self) -> None:
        super().__init__(cast(Any, None))
        self.letters: list[tuple[bytes, str, str]] = []

    async def send(self, msg: Msg, reason: str, why: str, job_id: str | None = None) -> bool:
        self.letters.append((msg.data, reason, why))
        await msg.ack()
        return True


async def test_a_message_that_makes_its_batch_fail_is_retried_alone_and_the_rest_acked() -> None:
    msgs = [FakeMsg(b"a"), FakeMsg(b"poison"), FakeMsg(b"c")]

    async def handle(batch: list[Msg]) -> None:
        if any(m.data == b"poison" for m in batch):
            raise ValueError("bug met by one message")
        for m in batch:
            await m.ack()

    await handle_batch(asyncio.Event(), cast(list[Msg], msgs), handle, FakeDead())
    # Not its last delivery: redelivered, not dead-lettered yet.
    assert [m.settled for m in msgs] == ["ack", "nak", "ack"]


async def test_data_postgresql_refuses_is_dead_lettered_at_once() -> None:
    msgs = [FakeMsg(b"ok"), FakeMsg(b"nul")]
    dead = FakeDead()

    async def handle(batch: list[Msg]) -> None:
        if any(m.data == b"nul" for m in batch):
            raise asyncpg.UntranslatableCharacterError("unsupported Unicode escape sequence")
        for m in batch:
            await m.ack()

    await handle_batch(asyncio.Event(), cast(list[Msg], msgs), handle, dead)
    assert [m.settled for m in msgs] == ["ack", "ack"]
    assert [(d[0], d[2]) for d in dead.letters] == [(b"nul", "unstorable")]
    assert "unsupported Unicode escape" in dead.letters[0][1]


async def test_a_lost_database_naks_the_whole_batch_for_redelivery() -> None:
    msgs = [FakeMsg(b"a"), FakeMsg(b"b")]
    dead = FakeDead()

    async def handle(batch: list[Msg]) -> None:
        raise ConnectionResetError("database went away")

    await handle_batch(asyncio.Event(), cast(list[Msg], msgs), handle, dead)
    assert [m.settled for m in msgs] == ["nak", "nak"]
    assert dead.letters == []


def test_a_dead_letter_keeps_the_headers_and_fits_max_payload() -> None:
    dead = DeadLetters(cast(Any, None), max_payload=128 * 1024)
    msg = FakeMsg(b"x" * 200_000, {MSG_ID_HEADER: "job-1", "traceparent": "00-abc"})
    headers, body = dead._entry(msg, "JOBS", 7, 5, "line one\nline\x00two", "failed", None)
    assert headers[DLQ_MSG_ID_HEADER] == "job-1"
    assert headers[MSG_ID_HEADER] == "JOBS:7"
    assert headers["traceparent"] == "00-abc"
    assert headers[DLQ_REASON_HEADER] == "line one line two"  # one printable line
    assert headers[DLQ_SIZE_HEADER] == headers[DLQ_TRUNCATED_HEADER] == "200000"
    assert len(body) == 128 * 1024 - DLQ_HEADER_RESERVE
