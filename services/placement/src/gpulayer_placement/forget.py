"""Forgetting a node that never comes back (``gpulayer node forget``, admins only).

A node silent past the timeout is reaped (``liveness``): its jobs are ``lost``, and what they
held there stays fenced until its executor reports each grant's end, since the node may be cut
off rather than down. A node that never comes back never reports, and would keep its fences for
good. Forgetting it is an admin saying it won't: in one transaction the node goes offline, the
jobs it still has are lost as a reaping loses them (retries, restarts and dependents applied),
and every fence of the node is released; then what a reaping announces goes out (each job's
``lost``, and a stop for each grant, kept in CONTROL should the node come back after all).

Refused while the node is heard from within ``GPULAYER_NODE_TIMEOUT_S``: its probe's heartbeats
(``nodes.last_seen``, which every replica writes, and this replica's own) or its executor's
(this replica's memory).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import asyncpg

from gpulayer_placement.fleet import Fleet
from gpulayer_placement.liveness import Liveness
from gpulayer_placement.replica_sync import ReplicaSync
from gpulayer_placement.settings import Settings
from gpulayer_placement.store import Store
from gpulayer_runtime.logs import job_context

# The name every placement part logs under since before the split: log queries filter on it.
log = logging.getLogger("gpulayer_placement.service")


class NodeRefused(ValueError):
    """The node is unknown or still heard from: nothing was changed (the API's reply says so)."""


class NodeForget:
    def __init__(
        self,
        *,
        pool: asyncpg.Pool,
        fleet: Fleet,
        sync: ReplicaSync,
        liveness: Liveness,
        settings: Settings,
    ) -> None:
        self.pool = pool
        self.fleet = fleet
        self.sync = sync
        self.liveness = liveness
        self.timeout_s = settings.node_timeout_s

    async def forget(self, node_id: str, who: str) -> dict[str, Any]:
        """Release all ``node_id`` holds, asked by ``who``; what was released, in words too
        (``summary``). ``NodeRefused`` when it is unknown or still heard from."""
        reason = f"node forgotten by {who}"
        async with self.pool.acquire() as conn, conn.transaction():
            silent_s = await self._silent_s(conn, node_id)
            await Store.fetch(conn, "set_offline", [node_id])
            lost = await Store.fetch(conn, "lose_node_jobs", [node_id], reason)
            settled = await self.liveness.lifecycle.settle(conn, lost)
            fences = await Store.fetch(conn, "forget_fences", node_id)
            if lost or fences:
                await self.sync.notify(conn, [node_id])
        self.fleet.set_online(node_id, False)
        await self.sync.reload([node_id])
        await self.liveness.announce_lost(lost, reason, settled)
        out = released(node_id, silent_s, [r["job_id"] for r in lost], fences)
        log.warning("%s", out["summary"], extra=job_context(node_id=node_id))
        return out

    async def _silent_s(self, conn: Any, node_id: str) -> float:
        """Seconds the node has been silent, its row locked against its heartbeats until the
        caller's transaction ends; ``NodeRefused`` if it is unknown or heard from lately."""
        row = await Store.fetchrow(conn, "lock_node", node_id)
        if row is None:
            raise NodeRefused(f"no node {node_id!r} (gpulayer nodes lists them)")
        # The stored time lags this replica's by up to a second (heartbeats are written once a
        # second); another replica's, or this one's before it started, only PostgreSQL has.
        silent_s = min(float(row["silent_s"]), self._ago(self.fleet.last_seen, node_id))
        executor_s = self._ago(self.fleet.executor_seen, node_id)
        for what, ago in (("", silent_s), ("'s executor", executor_s)):
            if ago < self.timeout_s:
                raise NodeRefused(
                    f"node {node_id}{what} still heartbeats: seen {ago:.0f} s ago; a node is "
                    f"forgotten only after {self.timeout_s:g} s of silence "
                    "(GPULAYER_NODE_TIMEOUT_S)"
                )
        return silent_s

    @staticmethod
    def _ago(seen: dict[str, float], node_id: str) -> float:
        """Seconds since ``seen`` (monotonic times by node) has the node; inf: never."""
        at = seen.get(node_id)
        return math.inf if at is None else time.monotonic() - at


def released(
    node_id: str,
    silent_s: float,
    lost: list[str],
    fences: Sequence[Mapping[str, Any] | asyncpg.Record],
) -> dict[str, Any]:
    """Pure: the reply for a forgotten node, from the jobs it lost and the fence rows deleted."""
    grants = sorted({f["grant_id"] for f in fences})
    devices = sorted({f["amount"] for f in fences if f["kind"] == "device"})
    held = (
        f"{len(grants)} grant(s) released (devices {', '.join(map(str, devices)) or 'none'})"
        if grants
        else "nothing was held there"
    )
    jobs = f"{len(lost)} job(s) lost ({', '.join(sorted(lost))})" if lost else "no job lost"
    return {
        "node_id": node_id,
        "silent_s": round(silent_s, 1),
        "jobs_lost": sorted(lost),
        "grants_released": grants,
        "devices_released": devices,
        "summary": f"node {node_id} forgotten after {silent_s:.0f} s of silence: {jobs}; {held}",
    }
