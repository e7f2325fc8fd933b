"""runtime.nats.let_go, a service's last word to NATS: a drain when connected, and a clean
close, not nats-py's ConnectionReconnectingError, when the server went away first (a stack
stopped all at once, or NATS restarting as a service stops)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import nats.errors
import pytest
from nats.aio.msg import Msg

from gpulayer_runtime.nats import connect, let_go
from gpulayer_runtime.servers import EmbeddedNats

pytestmark = pytest.mark.integration


async def test_a_connection_is_drained_while_its_server_serves(tmp_path: Path) -> None:
    with EmbeddedNats(tmp_path / "nats") as server:
        nc = await connect(server.url, "let-go")
        got: list[bytes] = []

        async def note(msg: Msg) -> None:
            got.append(msg.data)

        sub = await nc.subscribe("let.go", cb=note)
        await nc.publish("let.go", b"last")
        await nc.flush()
        await let_go(nc)
        assert nc.is_closed
        assert got == [b"last"]  # drained: the subscription's message was handled
        assert sub.pending_msgs == 0


async def test_a_connection_whose_server_stopped_first_is_closed_without_an_error(
    tmp_path: Path,
) -> None:
    disconnected = asyncio.Event()

    async def on_disconnect() -> None:
        disconnected.set()

    with EmbeddedNats(tmp_path / "nats") as server:
        nc = await connect(server.url, "let-go", disconnected_cb=on_disconnect)
    # Stopped with the block: the connection is left reconnecting to nothing.
    await asyncio.wait_for(disconnected.wait(), 10)
    with pytest.raises(nats.errors.ConnectionReconnectingError):
        await nc.drain()  # what a service's exit met before
    await asyncio.wait_for(let_go(nc), 10)
    assert nc.is_closed
    await let_go(nc)  # a second time: nothing to do
