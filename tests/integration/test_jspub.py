"""runtime.jspub's pipelined publisher against a real nats-server: every message stored and
acked, failures said at once (not at the timeout), nothing left waiting after a batch."""

from __future__ import annotations

import asyncio
import time
from typing import Any, cast

import nats.errors
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.errors import APIError, NoStreamResponseError

from gpulayer_contracts.subjects import MSG_ID_HEADER
from gpulayer_runtime.jspub import BadAck, PipelinedPublisher

pytestmark = pytest.mark.integration


async def test_a_batch_is_stored_whole_and_a_repeated_id_once(nc: Client) -> None:
    js = nc.jetstream()
    await js.add_stream(name="JSPUB", subjects=["jspub.>"])
    pub = PipelinedPublisher(nc)
    items = [(f"jspub.{i % 3}", b"m%d" % i, {MSG_ID_HEADER: f"id-{i}"}) for i in range(300)]
    await pub.publish_many(items, timeout=10)
    assert (await js.stream_info("JSPUB")).state.messages == 300
    await pub.publish_many(items[:10], timeout=10)  # the same ids again: acked as duplicates
    assert (await js.stream_info("JSPUB")).state.messages == 300
    assert pub.waiting == 0
    last = await js.get_last_msg("JSPUB", "jspub.2")
    assert last.data == b"m299"


async def test_a_subject_no_stream_holds_fails_at_once(nc: Client) -> None:
    pub = PipelinedPublisher(nc)
    started = time.monotonic()
    with pytest.raises(NoStreamResponseError):
        await pub.publish_many([("nowhere.at.all", b"x", {})], timeout=30)
    assert time.monotonic() - started < 10  # the server's 503, not the timeout
    assert pub.waiting == 0


async def test_a_streams_error_reply_fails_the_batch_at_once(nc: Client) -> None:
    """nats-py's publish_async raises such an error inside its reply handler, so the publish
    waited for its timeout; here the batch fails with the server's error."""
    js = nc.jetstream()
    await js.add_stream(name="JSPUB2", subjects=["jspub2.>"])
    pub = PipelinedPublisher(nc)
    started = time.monotonic()
    with pytest.raises(APIError) as caught:
        await pub.publish_many(
            [("jspub2.a", b"x", {"Nats-Expected-Stream": "ANOTHER"})], timeout=30
        )
    assert time.monotonic() - started < 10
    assert caught.value.code == 400
    assert pub.waiting == 0


async def test_no_ack_in_time_is_a_timeout_and_nothing_stays_waiting(nc: Client) -> None:
    # A plain subscriber takes the message and never answers: no stream, no 503 either.
    sub = await nc.subscribe("silent.subject")
    pub = PipelinedPublisher(nc)
    with pytest.raises(TimeoutError):
        await pub.publish_many([("silent.subject", b"x", {})], timeout=0.5)
    assert pub.waiting == 0
    await sub.unsubscribe()


async def test_a_reply_that_is_no_ack_fails_its_message_and_a_late_one_is_dropped(
    nc: Client,
) -> None:
    pub = PipelinedPublisher(nc)
    await pub.start()
    loop = asyncio.get_running_loop()
    future: asyncio.Future[None] = loop.create_future()
    pub._waiting["7"] = future
    reply = cast(Any, Msg)(cast(Any, nc), subject=pub._prefix + "7", data=b"<html>")
    await pub._on_ack(reply)
    with pytest.raises(BadAck) as caught:
        await future
    # A NATS error like the others a publish raises: the executor's reporter retries on those.
    assert isinstance(caught.value, nats.errors.Error)
    late = cast(Any, Msg)(cast(Any, nc), subject=pub._prefix + "8", data=b'{"seq": 1}')
    await pub._on_ack(late)  # no message waits for it: dropped, nothing raised
    assert pub.waiting == 0
