"""The outbox: job events recorded in PostgreSQL in the transaction of the change they announce,
published after its commit by whichever replica takes them first.

For changes nothing would announce again once their event was lost: the jobs cancelled because a
dependency ended without succeeding (``dependencies.release``). Announced by the replica that
committed alone, they were lost when it stopped between its commit and its publish. Each event
keeps the message id ``Publisher.event_item`` gives it (``<job>:cancelled``), so a publish
repeated by another replica (the first one stored, not yet deleted) is dropped by JetStream.

The commit NOTIFYs every replica (``CHANNEL``, LISTENed on replica sync's connection); each also
looks every ``PERIOD_S`` (a notification missed while that connection was down) and at start
(what a replica that stopped left).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import asyncpg

from gpulayer_contracts import JobEvent
from gpulayer_contracts.subjects import MSG_ID_HEADER
from gpulayer_placement.publisher import Item, Publisher
from gpulayer_placement.store import DB_ERRORS, Store

# The name every placement part logs under since before the split: log queries filter on it.
log = logging.getLogger("gpulayer_placement.service")

CHANNEL = "gpulayer_outbox"  # queries.sql's record_outbox notifies on it
PERIOD_S = 5.0
BATCH = 500


async def record(conn: Any, events: Sequence[JobEvent]) -> None:
    """Put ``events`` in the outbox, on ``conn``, in the caller's transaction: published once
    it commits, and never if it rolls back."""
    if not events:
        return
    items = [Publisher.event_item(e) for e in events]
    await Store.execute(
        conn,
        "record_outbox",
        [h[MSG_ID_HEADER] for _, _, h in items],
        [subject for subject, _, _ in items],
        [data for _, data, _ in items],
    )


class Outbox:
    """Publishes what the outbox holds, a batch per transaction, until it is empty; then waits
    for a NOTIFY or ``period_s``."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        publisher: Publisher,
        stop: asyncio.Event,
        *,
        period_s: float = PERIOD_S,
    ) -> None:
        self.pool = pool
        self.publisher = publisher
        self.stop = stop
        self.period_s = period_s
        self._wake = asyncio.Event()
        self.published = 0

    def on_notify(self, conn: object, pid: int, channel: str, payload: object) -> None:
        """A commit put events in the outbox (an asyncpg listener)."""
        self._wake.set()

    async def run(self) -> None:
        """Drain, then wait, until ``stop``. ``stop`` is looked at, not only the task's
        cancellation: Python 3.11's ``wait_for`` drops a cancellation that comes as its awaited
        result does (a publish's acks), and the loop would then wait out ``period_s``."""
        while not self.stop.is_set():
            self._wake.clear()
            try:
                while not self.stop.is_set() and await self.drain():
                    pass
            except DB_ERRORS as err:
                log.warning("publishing the outbox failed, will retry: %s", err)
            await self._idle()

    async def _idle(self) -> None:
        """Until a NOTIFY, ``stop``, or ``period_s``."""
        waits = [asyncio.ensure_future(self._wake.wait()), asyncio.ensure_future(self.stop.wait())]
        try:
            await asyncio.wait(waits, timeout=self.period_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    async def drain(self) -> int:
        """One batch published, then deleted, in one transaction; how many (0: none left, or
        NATS did not store them all, and they wait for the next try)."""
        async with self.pool.acquire() as conn, conn.transaction():
            rows = await Store.fetch(conn, "take_outbox", BATCH)
            if not rows:
                return 0
            items: list[Item] = [
                (r["subject"], bytes(r["payload"]), {MSG_ID_HEADER: r["msg_id"]}) for r in rows
            ]
            if not await self.publisher.publish(items):
                return 0
            await Store.execute(conn, "delete_outbox", [r["msg_id"] for r in rows])
        self.published += len(rows)
        return len(rows)
