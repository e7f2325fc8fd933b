"""Gauges: nodes by state, accelerator and platform and devices by state (read from the fleet
when the exporter asks), and job counts by state (refreshed from PostgreSQL every few seconds).
Registered only when telemetry is on."""

from __future__ import annotations

from typing import Any

import asyncpg

from gpulayer_placement.fleet import Fleet
from gpulayer_placement.store import Store
from gpulayer_runtime.telemetry import DISABLED, Telemetry

Observations = list[tuple[float, dict[str, Any]]]


def node_counts(fleet: Fleet) -> Observations:
    """Nodes per (online/offline, usable accelerator or ``cpu``, platform)."""
    counts: dict[tuple[str, str, str], int] = {}
    for v in fleet.views():
        accs = {d.accelerator for d in v.capabilities.accelerators if d.execution_supported} or {
            "cpu"
        }
        for acc in accs:
            key = (
                "online" if v.online else "offline",
                acc,
                v.capabilities.host.platform or "unknown",
            )
            counts[key] = counts.get(key, 0) + 1
    return [(n, {"state": k[0], "accelerator": k[1], "platform": k[2]}) for k, n in counts.items()]


def device_counts(fleet: Fleet) -> Observations:
    """Usable devices per (allocated/free, accelerator, node)."""
    counts: dict[tuple[str, str, str], int] = {}
    for v in fleet.views():
        for d in v.capabilities.accelerators:
            if not d.execution_supported:
                continue
            state = "allocated" if d.index in v.exclusive or d.index in v.shared else "free"
            key = (state, d.accelerator, v.node_id)
            counts[key] = counts.get(key, 0) + 1
    return [(n, {"state": k[0], "accelerator": k[1], "node_id": k[2]}) for k, n in counts.items()]


class Gauges:
    def __init__(self, pool: asyncpg.Pool, fleet: Fleet, telemetry: Telemetry = DISABLED) -> None:
        self.pool = pool
        self.fleet = fleet
        self.tel = telemetry
        self._jobs: Observations = []
        self._pending: Observations = []

    def register(self) -> None:
        """Hand the gauges' callbacks to the meter."""
        self.tel.gauge("gpulayer.nodes", lambda: node_counts(self.fleet))
        self.tel.gauge("gpulayer.devices", lambda: device_counts(self.fleet))
        self.tel.gauge("gpulayer.jobs", lambda: self._jobs)
        self.tel.gauge("gpulayer.jobs.pending", lambda: self._pending)

    async def refresh_job_gauges(self) -> None:
        """Job counts by state and waiting reason, from PostgreSQL."""
        async with self.pool.acquire() as conn:
            states = await Store.fetch(conn, "job_counts")
            pending = await Store.fetch(conn, "pending_counts")
        self._jobs = [(r["n"], {"state": r["state"]}) for r in states]
        self._pending = [
            (r["n"], {"reason": "unsatisfiable" if r["unsatisfiable"] else "waiting for capacity"})
            for r in pending
        ]
