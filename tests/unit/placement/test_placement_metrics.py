"""The gauges' readings over a real Fleet."""

from __future__ import annotations

from tests.unit.placement.placement_fakes import cpu_node, gpu_node

from gpulayer_placement.fleet import Fleet
from gpulayer_placement.metrics import device_counts, node_counts


def test_nodes_are_counted_by_state_usable_accelerator_and_platform() -> None:
    fleet = Fleet()
    fleet.upsert(gpu_node("g", 2))
    fleet.upsert(cpu_node("c"), online=False)
    got = {(k["state"], k["accelerator"], k["platform"]): n for n, k in node_counts(fleet)}
    assert got == {("online", "cuda", "linux-x86_64"): 1, ("offline", "cpu", "linux-x86_64"): 1}


def test_devices_are_free_or_allocated_per_node() -> None:
    fleet = Fleet()
    fleet.upsert(gpu_node("g", 3))
    fleet.hold("g", [0], "exclusive")
    fleet.hold("g", [1], "shared")
    got = {(k["state"], k["node_id"]): n for n, k in device_counts(fleet)}
    assert got == {("allocated", "g"): 2, ("free", "g"): 1}
