"""The fleet's health: a sick GPU and its MIG instances are kept from new grants; recovery
gives them back; only devices that just turned unhealthy are reported for warnings."""

from __future__ import annotations

from datetime import UTC, datetime

from gpulayer_contracts.capabilities import AcceleratorDevice, WorkerCapabilities, mig_index
from gpulayer_placement.fleet import Fleet


def caps() -> WorkerCapabilities:
    gpu0 = AcceleratorDevice(accelerator="cuda", index=0, execution_supported=True)
    gpu1 = AcceleratorDevice(accelerator="cuda", index=1, mig_mode="Enabled")
    inst = AcceleratorDevice(
        accelerator="cuda", index=mig_index(1, 0), mig_parent=1, execution_supported=True
    )
    return WorkerCapabilities(
        node_id="n",
        agent_version="t",
        detected_at=datetime.now(UTC),
        accelerators=[gpu0, gpu1, inst],
    )


def test_health_changes_the_view_and_warns_once() -> None:
    fleet = Fleet()
    fleet.upsert(caps())
    changed, newly = fleet.set_health("n", {1: ("unhealthy", "GPU requires reset")})
    assert changed
    assert newly == [1, mig_index(1, 0)]
    view = fleet.get("n")
    assert view is not None
    assert view.sick == {1, mig_index(1, 0)}
    assert view.health[mig_index(1, 0)] == "unhealthy: GPU requires reset"
    # The same verdict again: nothing changes, nobody is warned twice.
    assert fleet.set_health("n", {1: ("unhealthy", "GPU requires reset")}) == (False, [])
    # Capabilities re-reported keep the health.
    fleet.upsert(caps())
    assert fleet.get("n").sick == {1, mig_index(1, 0)}  # type: ignore[union-attr]
    # Degraded is sick too, but no warning.
    changed, newly = fleet.set_health("n", {0: ("degraded", "clocks slowed")})
    assert changed
    assert newly == []
    assert fleet.get("n").sick == {0}  # type: ignore[union-attr]
    # Recovered.
    assert fleet.set_health("n", {}) == (True, [])
    assert fleet.get("n").sick == frozenset()  # type: ignore[union-attr]
