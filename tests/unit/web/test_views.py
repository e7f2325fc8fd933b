"""The pages' data from the API's: fleet rows and filters, devices, charts, jobs, owners."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from tests.unit.web.web_data import job, node

from gpulayer_contracts.health import DeviceObservation, NodeObservations
from gpulayer_web import views

NOW = datetime(2026, 12, 1, 10, 0, 30, tzinfo=UTC)


def test_fleet_row_has_every_column_the_issue_names() -> None:
    row = views.fleet_row(node(), NOW)
    assert row["platform"] == "linux-x86_64"
    assert row["host_apis"] == ["cuda", "vulkan"]
    assert row["container_apis"] == ["cuda"]
    assert row["container_gpu"] == "yes"
    assert row["container_runtime"] == "none"  # its probe reported none
    assert row["accelerators"] == ["4 x NVIDIA H100 80GB HBM3, 80 GiB"]
    # 4 usable, device 0 busy, device 2 held back for its health.
    assert row["gpus"] == "2/4"
    assert (row["cores"], row["ram"]) == ("8/64", "32/512")
    assert (row["health"], row["state"], row["last_seen"]) == ("degraded", "online", "30s ago")


def test_fleet_row_shows_the_container_runtime_and_cdi_devices() -> None:
    runtime = {"name": "podman", "version": "4.3.1", "oci_runtime": "runc", "works": True}
    cdi = ["nvidia.com/gpu=0", "nvidia.com/gpu=1", "nvidia.com/gpu=all"]
    row = views.fleet_row(
        node(capabilities={"container_runtime": {**runtime, "cdi_devices": cdi}}), NOW
    )
    assert (row["container_runtime"], row["container_gpu"]) == (
        "podman 4.3.1/runc",
        "yes (3 CDI devices)",
    )
    failed = views.fleet_row(node(capabilities={"container_runtime": {**runtime, "works": False}}))
    assert failed["container_runtime"] == "podman 4.3.1/runc (self-test failed)"


def test_node_page_lists_the_runtime_its_notes_and_cdi_devices() -> None:
    runtime = {"name": "podman", "version": "4.3.1", "works": False, "notes": ["self-test failed"]}
    cdi = [f"nvidia.com/gpu={i}" for i in range(70)]
    detail = views.container_detail(
        node(capabilities={"container_runtime": {**runtime, "cdi_devices": cdi}})
    )
    assert detail == {
        "runtime": "podman 4.3.1 (self-test failed)",
        "notes": ["self-test failed"],
        "cdi": cdi[:64],
        "cdi_more": 6,
    }
    assert views.container_detail(node()) == {
        "runtime": "none",
        "notes": [],
        "cdi": [],
        "cdi_more": 0,
    }


def test_fleet_rows_filter_by_platform_api_and_state() -> None:
    mac = node("mac-01", capabilities={"host": {"platform": "darwin-arm64"},
                                       "gpu_apis": {"host": ["metal"]}})  # fmt: skip
    down = node("gpu-02", online=False)
    nodes = [node(), mac, down]
    assert [r["node_id"] for r in views.fleet_rows(nodes, platform="darwin-arm64")] == ["mac-01"]
    assert [r["node_id"] for r in views.fleet_rows(nodes, api="metal")] == ["mac-01"]
    assert [r["node_id"] for r in views.fleet_rows(nodes, api="cuda")] == ["gpu-01", "gpu-02"]
    assert [r["node_id"] for r in views.fleet_rows(nodes, state="offline")] == ["gpu-02"]
    assert views.fleet_rows(nodes, platform="nope") == []
    assert views.fleet_filters([views.fleet_row(n) for n in nodes]) == {
        "platform": ["darwin-arm64", "linux-x86_64"],
        "api": ["cuda", "metal", "vulkan"],
        "state": ["offline", "online"],
    }
    assert views.fleet_row(mac)["accelerators"] == ["cpu only"]


def test_a_node_with_missing_facts_still_renders() -> None:
    row = views.fleet_row({"node_id": "bare", "online": True, "capabilities": {}})
    assert row["platform"] == "?"
    assert row["gpus"] == "0/0"
    assert row["health"] == "unknown"
    assert views.device_rows({"node_id": "bare"}) == []


def test_device_rows_say_which_device_is_unhealthy_and_why() -> None:
    rows = views.device_rows(node())
    assert [r["health"] for r in rows] == ["healthy", "healthy", "unhealthy", "healthy"]
    assert rows[2]["reason"] == "uncorrectable ECC errors: 3"
    assert [r["busy"] for r in rows] == [True, False, False, False]
    assert rows[0]["cc"] == "9.0"
    assert rows[0]["driver"] == "550.54.15"


def test_mig_instances_are_listed_under_their_gpu() -> None:
    n = node()
    n["capabilities"]["accelerators"] = [
        {"accelerator": "cuda", "index": 0, "name": "A100", "mig_mode": "Enabled"},
        {"accelerator": "cuda", "index": 1, "name": "MIG 1g.10gb", "mig_parent": 0,
         "mig_profile": "1g.10gb", "execution_supported": True},
    ]  # fmt: skip
    rows = views.device_rows(n)
    assert rows[0]["mig_instances"] == ["1g.10gb"]
    assert rows[1]["mig_parent"] == 0
    assert views.accelerators(n["capabilities"]["accelerators"]) == ["1 x A100, memory ?"]


def test_api_rows_keep_the_evidence() -> None:
    rows = {r["api"]: r for r in views.api_rows(node())}
    assert rows["cuda"] == {"api": "cuda", "host": "yes", "containers": "yes",
                            "evidence": "nvidia-smi: driver 550.54.15"}  # fmt: skip
    assert rows["vulkan"]["containers"] == "no"


def test_matrix_lists_each_platform_of_the_fleet_with_its_levels() -> None:
    m = views.matrix([node()])
    assert {"accelerator": "rocm", "independent": "detection-only",
            "distributed": "detection-only"} in m["levels"]  # fmt: skip
    (linux,) = m["platforms"]
    assert linux["platform"] == "linux-x86_64"
    assert [a["name"] for a in linux["accelerators"]] == ["cpu", "cuda"]


def wsl2_node() -> dict[str, Any]:
    """A WSL2 machine with an NVIDIA GPU, as its probe reports it (tests/wsl_roots.py)."""
    caps = node()["capabilities"] | {
        "host": {"platform": "linux-x86_64", "wsl2": True},
        "gpu_apis": {
            "host": ["cuda", "directml"],
            "containers": ["cuda", "directml"],
            "evidence": {"directml": "/dev/dxg (character device); /usr/lib/wsl/lib: ..."},
        },
    }
    return node("wsl-01", capabilities=caps)


def test_a_wsl2_node_and_directml_show_like_any_other() -> None:
    row = views.fleet_row(wsl2_node(), NOW)
    assert row["platform"] == "linux-x86_64 (WSL2)"
    assert (row["host_apis"], row["container_apis"]) == (["cuda", "directml"], ["cuda", "directml"])
    rows = views.fleet_rows([node(), wsl2_node()], api="directml")
    assert [r["node_id"] for r in rows] == ["wsl-01"]
    assert "directml" in views.fleet_filters(views.fleet_rows([wsl2_node()]))["api"]
    assert {r["api"]: r["host"] for r in views.api_rows(wsl2_node())}["directml"] == "yes"
    m = views.matrix([node(), wsl2_node()])
    assert {"api": "directml", "level": "detection-only"} in m["api_levels"]
    assert {"api": "vulkan", "level": "implemented"} in m["api_levels"]
    wsl = next(p for p in m["platforms"] if p["platform"] == "linux-x86_64 (WSL2)")
    assert {"name": "directml", "level": "detection-only"} in wsl["apis"]


def test_a_macs_runtime_names_its_podman_machine() -> None:
    runtime = {"name": "podman", "version": "5.6.1", "works": True, "machine_provider": "libkrun"}
    caps = {"host": {"platform": "darwin-arm64"}, "container_runtime": runtime,
            "gpu_apis": {"host": ["metal"], "containers": ["vulkan"]}}  # fmt: skip
    row = views.fleet_row(node("mac-01", capabilities=caps), NOW)
    assert row["container_runtime"] == "podman 5.6.1 (machine: libkrun)"
    assert (row["host_apis"], row["container_apis"]) == (["metal"], ["vulkan"])


def test_sparklines_draw_each_device_measure_on_its_full_scale() -> None:
    start = datetime(2026, 12, 1, 10, 0, tzinfo=UTC)
    samples = [
        NodeObservations(
            node_id="gpu-01",
            observed_at=start + timedelta(seconds=5 * i),
            devices=[DeviceObservation(index=0, utilization_pct=10 * i, temperature_c=40 + i)],
        )
        for i in range(5)
    ]
    lines = views.sparklines(samples, {0: 81559})
    assert list(lines) == [0]
    by_label = {c["label"]: c for c in lines[0]}
    assert set(by_label) == {"utilization", "temperature"}  # no memory samples: no line
    util = by_label["utilization"]
    assert util["last"] == "40%"
    points = [tuple(map(float, p.split(","))) for p in util["points"].split()]
    assert len(points) == 5
    assert points[0][0] == 0
    assert points[-1][0] == util["width"]
    # Full scale is 100 %: 40 % is 40 % of the way up, not the top.
    top, bottom = 1, util["height"] - 1
    assert points[-1][1] == pytest.approx(bottom - 0.4 * (bottom - top))
    assert points[0][1] == bottom
    assert by_label["temperature"]["last"] == "44 °C"
    assert views.sparklines([]) == {}


def test_jobs_waiting_come_first_and_filter() -> None:
    jobs = [
        job("done", "succeeded", node_id="gpu-01", devices=[0, 1]),
        job("wait", "pending", owner="bob", reason="0/1 nodes: no cuda"),
    ]
    rows = views.job_rows(jobs)
    assert [r["job_id"] for r in rows] == ["wait", "done"]
    assert rows[1]["devices"] == "0,1"
    assert views.job_row(job("n", name="<b>train</b>"))["name"] == "<b>train</b>"
    assert [r["job_id"] for r in views.job_rows(jobs, owner="bob")] == ["wait"]
    assert [r["job_id"] for r in views.job_rows(jobs, node="gpu-01")] == ["done"]
    assert views.job_rows(jobs, state="running") == []


def test_timeline_text() -> None:
    events: list[dict[str, Any]] = [
        {"type": "pending", "summary": "0/1 nodes", "reasons": ["0/1 nodes"]},
        {"type": "failed", "node_id": "vm", "reason": "exit code 3", "exit_code": 3},
        {"type": "rejected", "reasons": ["$.command: empty"]},
    ]
    got = views.timeline(events)
    assert [e["text"] for e in got] == [": 0/1 nodes", " on vm: exit code 3 (exit 3)", ""]
    assert got[0]["reasons"] == []
    assert got[2]["reasons"] == ["$.command: empty"]


def test_owners_rank_by_recent_usage_and_show_quotas() -> None:
    jobs = [
        job("a1", "running", owner="alice", owner_usage_gpu_s=3600.0),
        job("b1", "pending", owner="bob", owner_usage_gpu_s=10.0),
        job("b2", "succeeded", owner="bob", owner_usage_gpu_s=10.0),
    ]
    quotas = [
        {"owner": "alice", "resource": "gpu:cuda", "max": 8, "used": 1},
        {"owner": "default", "resource": "jobs", "max": 100, "used": 0},
        {"owner": "carol", "resource": "jobs", "max": 5, "used": 0},
    ]
    rows = {o["owner"]: o for o in views.owners(jobs, quotas)}
    assert [o["owner"] for o in views.owners(jobs, quotas)] == ["carol", "bob", "alice"]
    assert (rows["bob"]["waiting"], rows["bob"]["done"], rows["bob"]["standing"]) == (1, 1, 2)
    assert rows["alice"]["quotas"] == ["gpu:cuda: 1/8"]
    assert rows["bob"]["quotas"] == ["default: jobs: 0/100"]
    assert views.owners([], None) == []


def test_page_of_clamps() -> None:
    items = list(range(250))
    assert views.page_of(items, 3)[1:] == (3, 3)
    assert views.page_of(items, 3)[0] == list(range(200, 250))
    assert views.page_of(items, 99)[1] == 3
    assert views.page_of(items, -4)[1] == 1
    assert views.page_of([], 1) == ([], 1, 1)
