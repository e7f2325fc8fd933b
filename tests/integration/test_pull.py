"""runtime.pull's Puller against a real nats-server: every message once and in order, one pull
request per half batch instead of one or two per fetch, requests renewed when they expire or
the server drops them, and what was delivered but not taken given back at close."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable

import nats.errors
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig
from tests.helpers import subscribed

from gpulayer_runtime.pull import Puller

pytestmark = pytest.mark.integration

_names = itertools.count()


async def _consumer(nc: Client) -> tuple[str, str]:
    """A new stream and durable pull consumer; (stream, subject prefix)."""
    n = next(_names)
    stream, prefix = f"PULL{n}", f"pull{n}"
    js = nc.jetstream()
    await js.add_stream(name=stream, subjects=[f"{prefix}.>"])
    await js.add_consumer(
        stream,
        ConsumerConfig(durable_name="c", ack_policy=AckPolicy.EXPLICIT, ack_wait=30),
    )
    return stream, prefix


@pytest.fixture
async def requests_of(nc: Client) -> AsyncIterator[Callable[[str], Awaitable[Subscription]]]:
    """Subscriptions seeing every pull request sent to a stream's consumer ``c`` from then on.
    Without a callback: after a ``flush`` one's ``pending_msgs`` counts every request sent
    before it (the connection reads them into its queue before the flush's answer). Let go
    before the connection is drained (a drain waits for a queue nobody reads)."""
    subs: list[Subscription] = []

    async def watch(stream: str) -> Subscription:
        sub = await nc.subscribe(f"$JS.API.CONSUMER.MSG.NEXT.{stream}.c")
        await subscribed(nc)  # on the server before the first request: every one counted
        subs.append(sub)
        return sub

    yield watch
    for sub in subs:
        await sub.unsubscribe()


async def _one_through(
    js: JetStreamContext, puller: Puller, prefix: str, data: bytes, timeout: float
) -> list[bytes]:
    """Publish ``data`` and fetch what comes."""
    await js.publish(f"{prefix}.x", data)
    return [m.data for m in await puller.fetch(8, timeout=timeout)]


async def test_messages_arrive_once_in_order_with_a_request_per_half_batch(
    nc: Client, requests_of: Callable[[str], Awaitable[Subscription]]
) -> None:
    stream, prefix = await _consumer(nc)
    requests = await requests_of(stream)
    js = nc.jetstream()
    sub = await js.pull_subscribe_bind("c", stream=stream)
    puller = Puller(sub)
    got: list[bytes] = []
    batches: list[int] = []
    for i in range(200):  # published one at a time, each taken before the next is stored
        await js.publish(f"{prefix}.x", b"%d" % i)
        msgs = await puller.fetch(16, timeout=5)
        batches.append(len(msgs))
        for msg in msgs:
            got.append(msg.data)
            await msg.ack()
    await nc.flush()
    assert got == [b"%d" % i for i in range(200)]
    assert max(batches) <= 16
    # A request of 16 whenever no more than 8 are left to come: one per 16 messages, about 13.
    # A fetch per message would have sent at least 200 (nats-py's: a no-wait one, then another).
    assert 12 <= requests.pending_msgs <= 16, requests.pending_msgs
    assert sub.pending_bytes == 0
    # Every message taken counts as done: a drain of the connection waits for that.
    await asyncio.wait_for(sub._sub._pending_queue.join(), 5)


async def test_a_backlog_comes_in_full_batches(nc: Client) -> None:
    stream, prefix = await _consumer(nc)
    js = nc.jetstream()
    for i in range(100):
        await js.publish(f"{prefix}.x", b"%d" % i)
    puller = Puller(await js.pull_subscribe_bind("c", stream=stream))
    got: list[bytes] = []
    while len(got) < 100:
        msgs = await puller.fetch(32, timeout=5)
        assert len(msgs) <= 32
        got += [m.data for m in msgs]
        await asyncio.gather(*(m.ack() for m in msgs))
    assert got == [b"%d" % i for i in range(100)]


async def test_an_empty_consumer_times_out_and_keeps_its_request_open(
    nc: Client, requests_of: Callable[[str], Awaitable[Subscription]]
) -> None:
    stream, prefix = await _consumer(nc)
    requests = await requests_of(stream)
    js = nc.jetstream()
    puller = Puller(await js.pull_subscribe_bind("c", stream=stream))
    with pytest.raises(TimeoutError):
        await puller.fetch(8, timeout=0.2)
    with pytest.raises(TimeoutError):
        await puller.fetch(8, timeout=0.2)
    await js.publish(f"{prefix}.x", b"late")
    msgs = await puller.fetch(8, timeout=5)
    assert [m.data for m in msgs] == [b"late"]
    await nc.flush()
    assert requests.pending_msgs == 1  # the first request, still open, took the late message


async def test_a_batch_of_none_asks_for_one(nc: Client) -> None:
    """The first request of a puller asked for 0 (or less) still asks for one message."""
    stream, prefix = await _consumer(nc)
    js = nc.jetstream()
    for batch in (0, -3):
        sub = await js.pull_subscribe_bind("c", stream=stream)
        await js.publish(f"{prefix}.x", b"%d" % batch)
        assert [m.data for m in await Puller(sub).fetch(batch, timeout=3)] == [b"%d" % batch]
        await sub.unsubscribe()


async def test_an_expired_request_is_renewed(
    nc: Client, requests_of: Callable[[str], Awaitable[Subscription]]
) -> None:
    stream, prefix = await _consumer(nc)
    requests = await requests_of(stream)
    js = nc.jetstream()
    puller = Puller(await js.pull_subscribe_bind("c", stream=stream), expires_s=0.3)
    with pytest.raises(TimeoutError):
        await puller.fetch(8, timeout=1.5)  # the server's 408 read, a new request sent
    await nc.flush()
    assert requests.pending_msgs >= 2
    assert await _one_through(js, puller, prefix, b"after", timeout=5) == [b"after"]


async def test_a_consumer_deleted_and_made_again_is_read_again(nc: Client) -> None:
    """The server ends the open request (409 Consumer Deleted); the puller asks again."""
    stream, prefix = await _consumer(nc)
    js = nc.jetstream()
    puller = Puller(await js.pull_subscribe_bind("c", stream=stream))
    with pytest.raises(TimeoutError):
        await puller.fetch(8, timeout=0.2)
    await js.delete_consumer(stream, "c")
    await js.add_consumer(
        stream, ConsumerConfig(durable_name="c", ack_policy=AckPolicy.EXPLICIT, ack_wait=30)
    )
    # Well before the request's own expiry (5 s): the 409 ended it, and the puller asked again.
    assert await _one_through(js, puller, prefix, b"again", timeout=3) == [b"again"]


async def test_close_gives_back_what_was_delivered_and_not_taken(nc: Client) -> None:
    stream, prefix = await _consumer(nc)
    js = nc.jetstream()
    for i in range(10):
        await js.publish(f"{prefix}.x", b"%d" % i)
    sub = await js.pull_subscribe_bind("c", stream=stream)
    puller = Puller(sub)
    first = await puller.fetch(3, timeout=5)
    await asyncio.gather(*(m.ack() for m in first))
    # The puller asked for more than it gave: wait for the next one the server delivers (put
    # back where it was read from; the order of what close gives back doesn't matter).
    queue = sub._sub._pending_queue
    queue.put_nowait(await asyncio.wait_for(queue.get(), 5))
    held = sub.pending_msgs
    await puller.close()
    with pytest.raises(nats.errors.BadSubscriptionError):  # closing it ended the subscription
        await sub.unsubscribe()
    # Another reader has them at once (ack_wait is 30 s): given back, not waiting to expire.
    other = await js.pull_subscribe_bind("c", stream=stream)
    rest: list[Msg] = []
    while len(rest) < 10 - len(first):
        rest += await other.fetch(10, timeout=5)
    assert sorted(m.data for m in first + rest) == sorted(b"%d" % i for i in range(10))
    # The ones the puller held come a second time; fetching them took well under ack_wait.
    assert sum(1 for m in rest if m.metadata.num_delivered == 2) == held >= 1


async def test_what_close_gives_back_goes_to_the_next_reader_while_a_request_was_open(
    nc: Client,
) -> None:
    """The puller's request asked for 16 and got one: 15 are still open when it closes. Its
    subscription's interest goes before the nak, so the message is not redelivered to that
    request (into a queue nobody reads, until the ack wait) but to the next reader."""
    stream, prefix = await _consumer(nc)
    js = nc.jetstream()
    await js.publish(f"{prefix}.x", b"taken")
    puller = Puller(await js.pull_subscribe_bind("c", stream=stream))
    taken = await puller.fetch(16, timeout=5)
    puller.give_back(taken)
    await puller.close()
    other = Puller(await js.pull_subscribe_bind("c", stream=stream))
    try:
        again = await other.fetch(16, timeout=10)  # ack_wait is 30 s
        assert [m.data for m in again] == [b"taken"]
        assert again[0].metadata.num_delivered == 2
        await again[0].ack()
    finally:
        await other.close()
