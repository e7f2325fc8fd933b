"""What the matcher reads and answers: a node's state (``NodeView``), a placement, or why not."""

from __future__ import annotations

import msgspec

from gpulayer_contracts.capabilities import WorkerCapabilities
from gpulayer_contracts.jobs import Accelerator, GpuUse

__all__ = ["Decision", "NoPlacement", "NodeView", "Placement"]


class NodeView(msgspec.Struct, frozen=True, kw_only=True):
    """What the matcher knows of one node at this moment."""

    node_id: str
    capabilities: WorkerCapabilities
    online: bool = True
    # The node's executor sent heartbeats and then stopped: grants would only queue there.
    # (A node whose executor was never heard from, e.g. one placement just started, counts
    # as having one.)
    executor_down: bool = False
    # Device indices held by an exclusive allocation, and those used by shared jobs.
    exclusive: frozenset[int] = frozenset()
    shared: frozenset[int] = frozenset()
    # Host resources jobs may hold (``resources``: cores in millicores, RAM in bytes, the
    # executor's job slots): what the node offers in all (its report less the executor's
    # reserve) and what is free now. None: the node hasn't said, and no limit is applied.
    cpu_total: int | None = None
    cpu_free: int | None = None
    memory_total: int | None = None
    memory_free: int | None = None
    slots_total: int | None = None
    slots_free: int | None = None
    # MiB of GPU memory shared jobs hold, per device index (only devices with any).
    gpu_reserved: dict[int, int] = {}
    # Devices that get no new grants for their health (unhealthy or degraded, from the probe's
    # observations; a sick GPU's MIG instances too), and why, per device index. Kept here, not
    # in the capabilities: health changes far more often, and the capability verdicts cached
    # per capabilities object stay valid.
    sick: frozenset[int] = frozenset()
    health: dict[int, str] = {}


class Placement(msgspec.Struct, frozen=True, kw_only=True):
    """Where the job goes. ``devices``: sorted indices it holds (none for ``use = "none"``)."""

    node_id: str
    accelerator: Accelerator
    devices: list[int]
    use: GpuUse


class NoPlacement(msgspec.Struct, frozen=True, kw_only=True):
    """Why a job can't be placed now. ``unsatisfiable``: no node in the fleet could ever run it,
    even with every device free and every node online.

    ``reasons`` has one entry per rule that ruled nodes out, in rule order; each node is counted
    under the first rule it fails, so the counts add up to ``total - can_run_now``.
    ``ruled_out`` has the same counts keyed by rule name (stable, usable as a metric label).
    """

    summary: str
    reasons: list[str]
    unsatisfiable: bool
    total: int = 0
    can_run_now: int = 0
    could_run: int = 0
    ruled_out: dict[str, int] = {}


Decision = Placement | NoPlacement
