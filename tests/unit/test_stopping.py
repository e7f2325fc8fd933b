"""``or_stop``: a wait that ends when the service is told to stop."""

from __future__ import annotations

import asyncio

import pytest

from gpulayer_runtime.stopping import Stopped, or_stop


async def test_the_result_when_it_comes_first() -> None:
    assert await or_stop(asyncio.sleep(0, result=7), asyncio.Event(), "nothing") == 7


async def test_its_error_when_it_fails_first() -> None:
    async def fails() -> None:
        raise ValueError("refused")

    with pytest.raises(ValueError, match="refused"):
        await or_stop(fails(), asyncio.Event(), "nothing")


async def test_stop_cancels_the_wait_and_names_it() -> None:
    stop = asyncio.Event()
    cancelled = asyncio.Event()

    async def forever() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()

    asyncio.get_running_loop().call_later(0.01, stop.set)
    with pytest.raises(Stopped, match="NATS"):
        await asyncio.wait_for(or_stop(forever(), stop, "NATS"), 5)
    assert cancelled.is_set()


async def test_a_stop_set_before_still_lets_a_done_wait_win() -> None:
    stop = asyncio.Event()
    stop.set()
    done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    done.set_result(3)
    assert await or_stop(done, stop, "nothing") == 3
