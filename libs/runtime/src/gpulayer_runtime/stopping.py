"""A service told to stop while it still waits to start (for NATS, for its streams) stops then.

Each service sets its stop Event from SIGTERM before it connects, and its connection retries
forever (a NATS restart must not end a service). A wait that never looks at the Event made a
service that can't reach NATS (a server down, its certificate or credential refused, streams
placement has not declared yet) deaf to SIGTERM: ``systemctl stop`` or ``restart`` and
``podman stop`` then waited for the SIGKILL that comes 90 s later."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


class Stopped(Exception):
    """Told to stop while waiting for what the message names: a clean end (``run_service``
    logs it and exits 0)."""


async def or_stop(aw: Awaitable[T], stop: asyncio.Event, waiting_for: str) -> T:
    """``aw``'s result; once ``stop`` is set first, ``aw`` is cancelled and ``Stopped``
    (naming ``waiting_for``) raised."""
    task = asyncio.ensure_future(aw)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        stopped.cancel()
    if task.done():
        return task.result()
    task.cancel()
    # What the cancelled wait raises on its way out (its own clean-up's errors) is no news.
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise Stopped(waiting_for)
