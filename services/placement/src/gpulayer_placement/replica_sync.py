"""Replica sync: what other placement replicas changed reaches this one's fleet.

Replicas announce allocation changes with ``pg_notify`` on one channel (payload
``<replica>|<node>,...``); this part LISTENs on a connection of its own, reloads the named
nodes' allocations from PostgreSQL and wakes the scheduler. It owns every allocation reload,
including those after a conflict with another replica, and listens again when the database
connection is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg

from gpulayer_placement.fleet import Fleet
from gpulayer_placement.store import DB_ERRORS, Store
from gpulayer_placement.wake import Wake

# The name every placement part logs under since before the split: log queries filter on it.
log = logging.getLogger("gpulayer_placement.service")

NOTIFY_CHANNEL = "gpulayer_allocations"


class ReplicaSync:
    def __init__(
        self,
        pool: asyncpg.Pool,
        fleet: Fleet,
        wake: Wake,
        stop: asyncio.Event,
        replica_id: str,
        on_load: Callable[[Any, list[str] | None], Awaitable[None]] | None = None,
    ) -> None:
        self.pool = pool
        # Also run on every allocation load (the queue policy's active jobs), same connection.
        self.on_load = on_load
        self.fleet = fleet
        self.wake = wake
        self.stop = stop
        # Tags this replica's NOTIFYs, so it skips its own.
        self.replica_id = replica_id
        self._notified: set[str] = set()
        # Other channels LISTENed on the same connection (channel -> asyncpg listener): the
        # outbox's.
        self.also: dict[str, Callable[[Any, int, str, object], None]] = {}
        self._listen_conn: Any = None
        self._relisten_task: asyncio.Task[None] | None = None

    async def listen(self) -> None:
        """LISTEN for other replicas' changes on a connection held until ``close``."""
        conn = await self.pool.acquire()
        try:
            await conn.add_listener(NOTIFY_CHANNEL, self.on_notify)
            for channel, listener in self.also.items():
                await conn.add_listener(channel, listener)
        except BaseException:
            await self.pool.release(conn)
            raise
        conn.add_termination_listener(self._on_listen_lost)
        self._listen_conn = conn

    async def close(self) -> None:
        """Stop listening and give the connection back."""
        if self._listen_conn is not None:
            conn, self._listen_conn = self._listen_conn, None
            with contextlib.suppress(Exception):
                await conn.remove_listener(NOTIFY_CHANNEL, self.on_notify)
                for channel, listener in self.also.items():
                    await conn.remove_listener(channel, listener)
            with contextlib.suppress(Exception):
                await self.pool.release(conn)
        if self._relisten_task is not None:
            self._relisten_task.cancel()

    async def notify(self, conn: Any, nodes: list[str]) -> None:
        """Tell the other replicas, within the caller's transaction, that ``nodes``' allocations
        changed."""
        await conn.execute("SELECT gpulayer_notify_nodes($1, $2::text[])", self.replica_id, nodes)

    async def load_allocations(self, conn: Any, nodes: list[str] | None = None) -> None:
        """Replace the fleet's holds (devices, reservations, recorded capacities) on ``nodes``
        (None: every node) with the database's, read in one statement on ``conn``; not between
        an executor status batch's commit and its release here (``Fleet.reload_lock``)."""
        async with self.fleet.reload_lock:
            await self._load_allocations(conn, nodes)

    async def _load_allocations(self, conn: Any, nodes: list[str] | None) -> None:
        rows = await Store.fetch(conn, "load_holds", nodes)
        devices, held, capacities = [], [], []
        for r in rows:
            kind = r["kind"]
            if kind == "device":
                devices.append((r["node_id"], r["amount"], r["resource"]))
            elif kind == "reservation":
                held.append((r["job_id"], r["node_id"], r["resource"], r["amount"]))
            else:
                capacities.append((r["node_id"], r["resource"], r["amount"]))
        self.fleet.replace_holds(devices, nodes, reservations=held, capacities=capacities)
        if self.on_load is not None:
            await self.on_load(conn, nodes)

    async def reload(self, nodes: list[str] | None) -> None:
        """Replace the fleet's holds on ``nodes`` (None: every node) with the database's."""
        async with self.pool.acquire() as conn:
            await self.load_allocations(conn, nodes)

    def _on_listen_lost(self, conn: object) -> None:
        """The LISTEN connection died (a database restart): listen again on a new one."""
        if conn is not self._listen_conn or self.stop.is_set():
            return
        self._listen_conn = None
        log.warning("lost the connection listening for other replicas' changes; listening again")
        self._relisten_task = asyncio.get_running_loop().create_task(self._relisten(conn))

    async def _relisten(self, dead: Any) -> None:
        with contextlib.suppress(Exception):
            await self.pool.release(dead)
        delay = 0.2
        listening = False
        while not self.stop.is_set():
            try:
                if not listening:
                    await self.listen()
                    listening = True
                # What other replicas announced meanwhile was missed: reload and look again.
                await self.reload(None)
                log.info("listening for other replicas' changes again")
                await self.wake.request_thorough()
                return
            except DB_ERRORS as err:
                log.warning("listening again failed, retrying: %s", err)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), delay)
                delay = min(delay * 2, 5.0)

    def on_notify(self, conn: object, pid: int, channel: str, payload: object) -> None:
        """A NOTIFY (asyncpg listener): reload the nodes another replica changed."""
        replica, _, nodes = str(payload).partition("|")
        if replica == self.replica_id:
            return  # this replica's own change, already applied in memory
        self._notified.update(n for n in nodes.split(",") if n)
        asyncio.get_running_loop().create_task(self._apply_notified())

    async def _apply_notified(self) -> None:
        nodes, self._notified = sorted(self._notified), set()
        if nodes:
            await self.reload(nodes)
            self.wake.capacity()
