"""What the API says of a node beside its capabilities (``gpulayer nodes``): its executor's
state, its devices' health, and the cores, RAM and slots its jobs hold, as this replica's fleet
knows them. Pure: the fleet and the latest observations in, plain values out."""

from __future__ import annotations

from typing import Any

import msgspec

from gpulayer_contracts.health import NodeObservations
from gpulayer_matching import NodeView
from gpulayer_matching.resources import CPU, GB, MEMORY, SLOTS
from gpulayer_placement.fleet import Fleet


def executor_state(fleet: Fleet, node_id: str) -> str:
    """``up`` (heartbeats coming), ``down`` (they stopped) or ``unknown`` (none heard yet)."""
    view = fleet.get(node_id)
    if view is not None and view.executor_down:
        return "down"
    return "up" if node_id in fleet.executor_seen else "unknown"


def health(obs: NodeObservations | None, view: NodeView | None) -> dict[str, Any] | None:
    """The node's health, its devices' latest observations, and which devices get no new
    grants for their health (None before any observation arrived)."""
    if obs is None:
        return None
    return {
        "health": obs.health,
        "observed_at": obs.observed_at.isoformat(),
        "devices": msgspec.to_builtins(obs.devices),
        "held_back": {str(i): why for i, why in sorted(view.health.items())} if view else {},
        "notes": obs.notes,
    }


def resources(fleet: Fleet, view: NodeView) -> dict[str, Any]:
    """Cores, RAM (GB) and job slots: what the node offers jobs and what they hold, as this
    replica knows it; ``enforcement``: how its executor enforces job limits (None: not said)."""
    used = fleet.used(view.node_id)
    offer = fleet.offer(view.node_id)
    return {
        "cores": view.cpu_total / 1000 if view.cpu_total is not None else None,
        "cores_used": used[CPU] / 1000,
        "memory_gb": view.memory_total / GB if view.memory_total is not None else None,
        "memory_gb_used": used[MEMORY] / GB,
        "slots": view.slots_total,
        "slots_used": used[SLOTS],
        "gpu_memory_reserved_mib": {str(k): v for k, v in sorted(view.gpu_reserved.items())},
        "enforcement": offer.enforcement if offer is not None else None,
    }
