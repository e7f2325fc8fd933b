"""The matcher: a pure function from a job and node states to a placement or the reasons why not.

No I/O. The placement service fetches node views, calls :func:`match`, persists and publishes.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from gpulayer_contracts.capabilities import WorkerCapabilities
from gpulayer_contracts.jobs import Accelerator, GpuUse, JobRequest


class NodeView(msgspec.Struct, frozen=True, kw_only=True):
    """What the matcher knows of one node at this moment."""

    node_id: str
    capabilities: WorkerCapabilities
    online: bool = True
    # Device indices held by an exclusive allocation, and those used by shared jobs.
    exclusive: frozenset[int] = frozenset()
    shared: frozenset[int] = frozenset()


class Placement(msgspec.Struct, frozen=True, kw_only=True):
    node_id: str
    accelerator: Accelerator
    devices: list[int]
    use: GpuUse


class NoPlacement(msgspec.Struct, frozen=True, kw_only=True):
    """Why a job can't be placed now. ``unsatisfiable``: no node in the fleet could ever run it,
    even with every device free and every node online."""

    summary: str
    reasons: list[str]
    unsatisfiable: bool


Decision = Placement | NoPlacement


def match(job: JobRequest, nodes: Sequence[NodeView]) -> Decision:
    """First node, in the order given, that satisfies every requirement of ``job``."""
    for node in nodes:
        if node.online and job.requirements.accelerator in (None, "cpu") and job.requirements.gpu_count == 0:
            return Placement(node_id=node.node_id, accelerator="cpu", devices=[], use="none")
    online = sum(1 for n in nodes if n.online)
    return NoPlacement(
        summary=f"0/{len(nodes)} nodes can run this job ({online} online)",
        reasons=["only cpu jobs are placed yet"],
        unsatisfiable=not nodes,
    )
