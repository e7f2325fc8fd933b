"""The pull consumer's loop (``loops.consume``): batches in flight at once, and every batch
begun handled to its end before the loop returns."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from nats.aio.msg import Msg
from nats.js.errors import FetchTimeoutError

from gpulayer_placement.loops import consume


class Batches:
    """A pull subscription that hands out ``n`` batches of one message, then stops the loop
    (fetches after that time out, as an empty stream's do)."""

    def __init__(self, n: int, stop: asyncio.Event) -> None:
        self.left, self.stop = n, stop
        self.fetched = 0

    async def fetch(self, batch: int, timeout: float) -> list[Msg]:
        if not self.left:
            self.stop.set()
            raise FetchTimeoutError
        self.left -= 1
        self.fetched += 1
        return [Msg(cast(Any, None), subject="s", data=str(self.fetched).encode())]


async def _run(in_flight: int, batch_size: int = 1) -> tuple[list[str], int]:
    """Four batches of one message, fetched ``batch_size`` at most; each handler yields to the
    loop for a while. Returns what happened in order and the most handlers running at once."""
    stop = asyncio.Event()
    sub = Batches(4, stop)
    log: list[str] = []
    running = most = 0

    async def handle(msgs: list[Msg]) -> None:
        nonlocal running, most
        n = int(msgs[0].data)
        running += 1
        most = max(most, running)
        log.append(f"begin {n}")
        for _ in range(10):  # room for the loop to fetch the next batch meanwhile
            await asyncio.sleep(0)
        log.append(f"end {n}")
        running -= 1

    await asyncio.wait_for(
        consume(stop, cast(Any, sub), batch_size, handle, in_flight=in_flight), 5
    )
    return log, most


async def test_one_batch_at_a_time_by_default() -> None:
    log, most = await _run(1)
    assert most == 1
    assert log == [f"{w} {n}" for n in range(1, 5) for w in ("begin", "end")]


async def test_two_in_flight_overlap_and_all_end_before_the_loop_returns() -> None:
    log, most = await _run(2)
    assert most == 2  # the next batch was begun while the last was handled
    assert log.index("begin 2") < log.index("end 1")
    assert sorted(e for e in log if e.startswith("end")) == [f"end {n}" for n in range(1, 5)]
    # Never more than two: the third waits for one of the first two to end.
    assert log.index("begin 3") > min(log.index("end 1"), log.index("end 2"))


async def test_short_batches_are_handled_one_at_a_time_even_with_room_in_flight() -> None:
    # Batches of one where up to 8 could come: the queue is drained each time, so the next
    # fetch waits for the last batch (what arrives meanwhile makes one larger batch).
    log, most = await _run(2, batch_size=8)
    assert most == 1
    assert log == [f"{w} {n}" for n in range(1, 5) for w in ("begin", "end")]


async def test_cancelling_the_loop_cancels_the_batches_in_flight() -> None:
    stop = asyncio.Event()
    sub = Batches(2, stop)
    begun = asyncio.Event()
    cancelled: list[int] = []

    async def handle(msgs: list[Msg]) -> None:
        begun.set()
        try:
            await asyncio.Event().wait()  # a handler still waiting when the service stops
        except asyncio.CancelledError:
            cancelled.append(int(msgs[0].data))
            raise

    loop = asyncio.create_task(consume(stop, cast(Any, sub), 1, handle, in_flight=2))
    await begun.wait()
    loop.cancel()
    done, _ = await asyncio.wait([loop], timeout=5)
    assert loop in done
    assert loop.cancelled()
    assert cancelled  # the handler got the cancel, not left running
