"""How a node's devices are, as opposed to what they are: live observations and health.

Published by the probe every few seconds on ``gpulayer.node.<node>.observations`` (core NATS, no
stream: only the latest matters, and a placement that starts waits one period for the next).
Kept apart from ``WorkerCapabilities`` so that the capabilities stay fixed while a GPU warms up
(the matcher caches its verdicts per capabilities object) and so that placement ingests a
small message per node.

``health`` is the probe's verdict with hysteresis already applied (``gpulayer_detection.health``):
placement applies it as it stands, so every replica agrees without keeping history.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from gpulayer_contracts._base import Wire
from gpulayer_contracts.capabilities import AcceleratorDevice, WorkerCapabilities

# healthy: new grants. degraded: still runs what it runs, gets no new grants (docs/health.md).
# unhealthy: no new grants, and its running job gets a warning event.
Health = Literal["healthy", "degraded", "unhealthy"]
# A node's summary: ``undetected`` where GPU device files exist but no GPU API answers (no
# driver loaded, nvidia-smi missing): never offered GPU work, and not an alert.
NodeHealth = Literal["healthy", "degraded", "unhealthy", "undetected"]
# What nvidia-smi said about the device itself: answered, "GPU is lost", "GPU requires reset".
DeviceState = Literal["ok", "lost", "reset_required"]

HEALTH_LEVELS: dict[str, int] = {"healthy": 0, "degraded": 1, "unhealthy": 2}


class DeviceObservation(Wire, frozen=True):
    """One device at one moment. None: not reported (``[N/A]``, ``[Not Supported]``)."""

    index: int
    uuid: str | None = None
    state: DeviceState = "ok"
    memory_used_mib: int | None = None
    memory_free_mib: int | None = None
    utilization_pct: int | None = None
    temperature_c: int | None = None
    power_w: float | None = None
    # nvidia-smi's clocks_throttle_reasons.active bitmask (NVML's nvmlClocksThrottleReasons).
    throttle_reasons: int | None = None
    # Uncorrected ECC errors since the driver loaded (volatile) and over the GPU's life.
    ecc_uncorrected_volatile: int | None = None
    ecc_uncorrected_aggregate: int | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_pending: bool | None = None
    health: Health = "healthy"
    reason: str | None = None


class NodeObservations(Wire, frozen=True):
    node_id: str
    observed_at: datetime
    devices: list[DeviceObservation] = []
    health: NodeHealth = "healthy"
    notes: list[str] = []


class DoctorReport(Wire, frozen=True):
    """The probe's reply on ``gpulayer.node.<node>.doctor``: it detected again just now.

    ``changes``: what differs from the detection before (drift). A probe older than this
    report replies with bare ``WorkerCapabilities``: decoded as a report, ``capabilities`` is
    None (its fields are not this struct's). ``error``: the probe did not detect (it is over
    its doctor rate limit, with the seconds to wait in ``retry_after_s``); nothing else is set.
    """

    node_id: str = ""
    capabilities: WorkerCapabilities | None = None
    changes: list[str] = []
    health: NodeHealth = "healthy"
    devices: list[DeviceObservation] = []
    notes: list[str] = []
    error: str | None = None
    retry_after_s: float | None = None


def worst(levels: list[str]) -> Health:
    """The worst of some device health levels (``healthy`` for none)."""
    top = max((HEALTH_LEVELS.get(level, 0) for level in levels), default=0)
    return ("healthy", "degraded", "unhealthy")[top]


def _label(d: AcceleratorDevice) -> str:
    what = f"MIG {d.mig_profile} of GPU {d.mig_parent}" if d.mig_parent is not None else "GPU"
    return f"{d.accelerator} device {d.index} ({what}{', ' + d.uuid if d.uuid else ''})"


def vanished(old: WorkerCapabilities, new: WorkerCapabilities) -> dict[int, str]:
    """Devices of ``old`` missing from ``new`` (by index, or now another device by uuid), with
    the reason a job holding one is lost for."""
    now = {d.index: d for d in new.accelerators}
    out = {}
    for d in old.accelerators:
        n = now.get(d.index)
        if n is None:
            out[d.index] = f"{_label(d)} vanished from node {new.node_id}"
        elif d.uuid is not None and n.uuid is not None and n.uuid != d.uuid:
            out[d.index] = f"{_label(d)} was replaced by {n.uuid} on node {new.node_id}"
    return out


def drift(old: WorkerCapabilities, new: WorkerCapabilities) -> list[str]:
    """What changed between two detections of one node that an operator should hear about:
    devices that vanished or appeared, a driver that changed, a device whose memory changed,
    the container runtime (gone, its self-test now failing or passing)."""
    changes = list(vanished(old, new).values())
    before = {d.index: d for d in old.accelerators}
    for d in new.accelerators:
        b = before.get(d.index)
        if b is None:
            changes.append(f"{_label(d)} appeared")
            continue
        if b.uuid != d.uuid and b.uuid is not None and d.uuid is not None:
            continue  # reported above as replaced
        if b.driver_version != d.driver_version:
            changes.append(
                f"{_label(d)}: driver {b.driver_version or 'unknown'} -> "
                f"{d.driver_version or 'unknown'}"
            )
        if b.memory_mib != d.memory_mib:
            changes.append(
                f"{_label(d)}: memory {b.memory_mib if b.memory_mib is not None else 'unknown'}"
                f" -> {d.memory_mib if d.memory_mib is not None else 'unknown'} MiB"
            )
        if b.execution_supported != d.execution_supported:
            changes.append(
                f"{_label(d)}: {'now usable' if d.execution_supported else 'no longer usable'}"
            )
    # A runtime found is no news (every probe start reports none until its self-test answers);
    # one lost, or whose self-test now fails or passes, is.
    was_rt, now_rt = old.container_runtime, new.container_runtime
    if was_rt is not None:
        now = now_rt.describe() if now_rt is not None else "none"
        if was_rt.describe() != now:
            changes.append(f"container runtime: {was_rt.describe()} -> {now}")
    return changes
