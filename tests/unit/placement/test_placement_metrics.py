"""The gauges' readings over a real Fleet."""

from __future__ import annotations

import msgspec
from tests.unit.placement.placement_fakes import cpu_node, gpu_node

from gpulayer_contracts import AcceleratorDevice, GpuApis
from gpulayer_placement.fleet import Fleet
from gpulayer_placement.metrics import (
    MAX_INFO_LABEL_CHARS,
    MAX_INFO_LIST_CHARS,
    device_counts,
    node_counts,
    node_info,
)


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


def _info(fleet: Fleet) -> dict[str, dict[str, str]]:
    rows = node_info(fleet)
    assert all(value == 1 for value, _ in rows)
    return {labels["node"]: labels for _, labels in rows}


def test_node_info_is_one_row_per_node_with_the_fleet_tables_columns() -> None:
    fleet = Fleet()
    h100 = gpu_node("g", 8)
    h100 = msgspec.structs.replace(
        h100,
        host=msgspec.structs.replace(h100.host, hostname="dgx-01"),
        gpu_apis=GpuApis(host=["vulkan", "cuda"], containers=["cuda"]),
    )
    fleet.upsert(h100)
    fleet.upsert(cpu_node("c"), online=False)
    rocm = msgspec.structs.replace(
        cpu_node("r"),
        accelerators=[AcceleratorDevice(accelerator="rocm", index=i) for i in range(2)],
    )
    fleet.upsert(rocm)
    fleet.executor_beat("r")
    fleet.set_executor_down("r")
    got = _info(fleet)
    assert got["g"] == {
        "node": "g",
        "hostname": "dgx-01",
        "platform": "linux-x86_64",
        "host_apis": "cuda, vulkan",
        "container_apis": "cuda",
        "containers_get_gpu": "yes",
        "state": "online",
        "accelerators": "8x cuda",
    }
    assert got["c"]["state"] == "offline"
    assert got["c"]["hostname"] == "unknown"
    assert (got["c"]["host_apis"], got["c"]["containers_get_gpu"]) == ("none", "no")
    assert got["c"]["accelerators"] == "cpu only"
    assert got["r"]["state"] == "executor down"
    assert got["r"]["accelerators"] == "2x rocm detection only"


def test_node_info_labels_are_bounded_and_a_dropped_node_has_no_row() -> None:
    fleet = Fleet()
    node = gpu_node("big", 1)
    node = msgspec.structs.replace(
        node,
        host=msgspec.structs.replace(node.host, hostname="h\x00" + "x" * 10_000),
        gpu_apis=GpuApis(host=[f"api{i}" for i in range(64)]),
    )
    fleet.upsert(node)
    fleet.upsert(cpu_node("other"))
    labels = _info(fleet)["big"]
    assert len(labels["hostname"]) == MAX_INFO_LABEL_CHARS
    assert labels["hostname"].startswith("h?x")
    assert labels["hostname"].isprintable()
    assert len(labels["host_apis"]) == MAX_INFO_LIST_CHARS
    assert all(len(v) <= MAX_INFO_LIST_CHARS for v in labels.values())
    fleet.remove("big", "refused report")
    assert set(_info(fleet)) == {"other"}
