"""Gauges: nodes by state, accelerator and platform, devices by state, and one info series per
node (read from the fleet when the exporter asks), per device health, temperature, utilization,
memory in use, power and ECC errors (from the latest observations), and job counts by state
(refreshed from PostgreSQL every few seconds). Registered only when telemetry is on."""

from __future__ import annotations

from typing import Any

import asyncpg

from gpulayer_contracts import AcceleratorDevice
from gpulayer_contracts.bounds import clip_text
from gpulayer_contracts.health import NodeObservations
from gpulayer_matching import NodeView
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


# Label values of gpulayer.node.info come from what nodes report about themselves: cut, so that a
# node can't make a series (or the dashboard's table) arbitrarily large. The node id is already
# bounded (a subject token of at most 128 bytes) and is kept whole: it names the series.
MAX_INFO_LABEL_CHARS = 64
MAX_INFO_LIST_CHARS = 128


def _label(text: str | None, max_chars: int = MAX_INFO_LABEL_CHARS) -> str:
    if not text:
        return "unknown"
    printable = "".join(c if c.isprintable() else "?" for c in text)
    return clip_text(printable, max_chars)


def _listing(items: list[str]) -> str:
    return _label(", ".join(sorted(set(items))), MAX_INFO_LIST_CHARS) if items else "none"


def accelerator_summary(devices: list[AcceleratorDevice]) -> str:
    """``8x cuda``; devices the node can't run work on are marked: ``2x rocm detection only``;
    ``cpu only`` when there are none."""
    counts: dict[tuple[str, bool], int] = {}
    for d in devices:
        key = (d.accelerator, d.execution_supported)
        counts[key] = counts.get(key, 0) + 1
    parts = [
        f"{n}x {acc}" + ("" if usable else " detection only")
        for (acc, usable), n in sorted(counts.items(), key=lambda kv: (not kv[0][1], kv[0][0]))
    ]
    return _label(", ".join(parts), MAX_INFO_LIST_CHARS) if parts else "cpu only"


def node_state(view: NodeView) -> str:
    if not view.online:
        return "offline"
    return "executor down" if view.executor_down else "online"


def node_info(fleet: Fleet) -> Observations:
    """One series of value 1 per node in the fleet, its facts as labels: the fleet table.
    A node whose facts change gets a new series and the old one stops (an observable gauge
    exports only what its callback returns); a node that leaves the fleet stops too."""
    out: Observations = []
    for v in fleet.views():
        caps = v.capabilities
        out.append(
            (
                1,
                {
                    "node": v.node_id,
                    "hostname": _label(caps.host.hostname),
                    "platform": _label(caps.host.platform),
                    "host_apis": _listing(caps.gpu_apis.host),
                    "container_apis": _listing(caps.gpu_apis.containers),
                    "containers_get_gpu": "yes" if caps.gpu_apis.containers else "no",
                    "state": node_state(v),
                    "accelerators": accelerator_summary(caps.accelerators),
                },
            )
        )
    return out


_HEALTH_VALUE = {"healthy": 0, "degraded": 1, "unhealthy": 2}
# (metric, DeviceObservation field) of the per-device gauges.
DEVICE_GAUGES = (
    ("gpulayer.device.temperature", "temperature_c"),
    ("gpulayer.device.utilization", "utilization_pct"),
    ("gpulayer.device.memory.used", "memory_used_mib"),
    ("gpulayer.device.power", "power_w"),
    ("gpulayer.device.ecc.uncorrected", "ecc_uncorrected_volatile"),
)


def device_health(latest: dict[str, NodeObservations]) -> Observations:
    """One series per observed device: its health as a number, the reason as a label."""
    return [
        (
            _HEALTH_VALUE.get(d.health, 0),
            {"node_id": node, "device": str(d.index), "health": d.health},
        )
        for node, obs in latest.items()
        for d in obs.devices
    ]


def device_values(latest: dict[str, NodeObservations], field: str) -> Observations:
    """One series per observed device that reports ``field`` (a DeviceObservation field)."""
    out: Observations = []
    for node, obs in latest.items():
        for d in obs.devices:
            value = getattr(d, field)
            if value is not None:
                out.append((value, {"node_id": node, "device": str(d.index)}))
    return out


class Gauges:
    def __init__(
        self,
        pool: asyncpg.Pool,
        fleet: Fleet,
        telemetry: Telemetry = DISABLED,
        observations: dict[str, NodeObservations] | None = None,
    ) -> None:
        self.pool = pool
        self.fleet = fleet
        self.tel = telemetry
        self.observations = observations if observations is not None else {}
        self._jobs: Observations = []
        self._pending: Observations = []

    def register(self) -> None:
        """Hand the gauges' callbacks to the meter."""
        self.tel.gauge("gpulayer.nodes", lambda: node_counts(self.fleet))
        self.tel.gauge("gpulayer.devices", lambda: device_counts(self.fleet))
        self.tel.gauge("gpulayer.node.info", lambda: node_info(self.fleet))
        self.tel.gauge("gpulayer.jobs", lambda: self._jobs)
        self.tel.gauge("gpulayer.jobs.pending", lambda: self._pending)
        self.tel.gauge("gpulayer.device.health", lambda: device_health(self.observations))
        for name, field in DEVICE_GAUGES:
            self.tel.gauge(name, lambda f=field: device_values(self.observations, f))  # type: ignore[misc]

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
