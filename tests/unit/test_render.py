"""The CLI's tables: identifiers survive narrow terminals; times read as ages."""

from __future__ import annotations

import io
import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from rich.console import Console

from gpulayer_cli.render import ago, device_groups, jobs_table, nodes_table

NOW = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)


def _text(table: object, width: int = 80) -> str:
    out = io.StringIO()
    Console(width=width, file=out).print(table)
    text = out.getvalue()
    assert max(len(line) for line in text.splitlines()) <= width
    return text


def test_job_and_node_ids_are_never_cut_at_80_columns() -> None:
    job_id = "nightly-resnet50-train-2026-11-29-shard-17"
    jobs = [
        {
            "job_id": job_id,
            "state": "pending",
            "node_id": None,
            "devices": [2, 5],
            "exit_code": None,
            "submitted_at": (NOW - timedelta(minutes=3)).isoformat(),
            "reason": "0/12 nodes can run this job: 7 have no cuda device, 5 are offline",
        }
    ]
    text = _text(jobs_table(jobs))
    assert job_id in text
    assert "2,5" in text
    node = "gpu-node-h100-rack7-slot03.example"
    nodes = [
        {
            "node_id": node,
            "online": True,
            "last_seen": NOW.isoformat(),
            "capabilities": {"host": {"platform": "linux-x86_64"}, "accelerators": []},
        }
    ]
    text = _text(nodes_table(nodes))
    assert node in text
    assert "linux-x86_64" in text


def test_nodes_show_cores_ram_and_slots_in_use_and_the_enforcement() -> None:
    nodes = [
        {
            "node_id": "n1",
            "online": True,
            "last_seen": NOW.isoformat(),
            "capabilities": {"host": {"platform": "linux-x86_64"}, "accelerators": []},
            "resources": {
                "cores": 64.0,
                "cores_used": 12.5,
                "memory_gb": 250.0,
                "memory_gb_used": 0.0,
                "slots": None,
                "slots_used": 3,
                "enforcement": "cgroup v1: memory cpu pids devices",
            },
        }
    ]
    text = " ".join(_text(nodes_table(nodes), width=400).split())
    assert "│ 12.5/64 │ 0/250 │ 3/? │ cgroup v1: memory cpu pids devices │" in text


def test_ago_reads_as_the_largest_whole_unit() -> None:
    assert ago((NOW - timedelta(seconds=12)).isoformat(), NOW) == "12s ago"
    assert ago((NOW - timedelta(minutes=5, seconds=59)).isoformat(), NOW) == "5m ago"
    assert ago((NOW - timedelta(hours=3)).isoformat(), NOW) == "3h ago"
    assert ago((NOW - timedelta(days=2, hours=1)).isoformat(), NOW) == "2d ago"
    # A clock slightly ahead on the server is not "-1s ago"; naive timestamps are UTC.
    assert ago((NOW + timedelta(seconds=2)).isoformat(), NOW) == "0s ago"
    assert ago("2026-11-29T11:59:00", NOW) == "1m ago"
    assert ago(None, NOW) == "-"


def test_a_long_reason_is_cut_at_a_word_with_an_ellipsis() -> None:
    reason = "spawn: could not start 'no-such-binary': [Errno 2] No such file or directory " * 4
    jobs = [{"job_id": "j", "state": "failed", "submitted_at": NOW.isoformat(), "reason": reason}]
    text = " ".join(_text(jobs_table(jobs), width=400).split())
    cut = " ".join(reason[:160].split()[:-1])  # the last, partial word goes
    assert f"{cut} … │" in text
    assert len(cut) <= 160


def test_identical_devices_read_as_one_line_with_their_index_ranges() -> None:
    def dev(i: int, name: str, mib: int, cc: str) -> dict[str, object]:
        return {
            "accelerator": "cuda",
            "index": i,
            "name": name,
            "memory_mib": mib,
            "memory_kind": "dedicated",
            "compute_capability": cc,
            "execution_supported": True,
        }

    devices = [dev(i, "NVIDIA H100 80GB HBM3", 81559, "9.0") for i in (0, 1, 2, 3, 6, 7)]
    devices.insert(4, dev(4, "NVIDIA A100-SXM4-40GB", 40960, "8.0"))
    devices.append({"accelerator": "rocm", "index": 0, "name": "AMD Instinct MI300X"})
    assert device_groups(devices) == [
        "cuda:0-3,6-7 NVIDIA H100 80GB HBM3, 85.5 GB, cc 9.0",  # GB of 10^9: 81559 MiB
        "cuda:4 NVIDIA A100-SXM4-40GB, 42.9 GB, cc 8.0",
        "rocm:0 AMD Instinct MI300X, memory unknown, detection only",
    ]
    apple = {"accelerator": "mps", "index": 0, "name": "Apple M2 Max", "memory_mib": 65536}
    apple |= {"memory_kind": "unified", "execution_supported": True}
    assert device_groups([apple]) == ["mps:0 Apple M2 Max, 68.7 GB unified"]


def test_nodes_devices_shows_each_devices_health_and_why() -> None:
    # `gpulayer nodes --devices` over the recorded double-bit ECC error (tests/fixtures/README).
    from pathlib import Path

    import msgspec

    from gpulayer_cli.doctor import render_node_devices
    from gpulayer_detection.health import Tracker
    from gpulayer_detection.observe import parse_observations

    recording = Path(__file__).resolve().parents[1] / "fixtures" / "nvidia-smi"
    observed = parse_observations((recording / "ecc-dbe-rtx-pro-6000" / "observe.txt").read_text())
    devices = Tracker().update(observed.devices)
    reason = "2 uncorrected ECC errors since the driver loaded"
    nodes: list[dict[str, Any]] = [
        {
            "node_id": "gpu-node-a",
            "health": {
                "health": "unhealthy",
                "observed_at": NOW.isoformat(),
                "devices": msgspec.to_builtins(devices),
                "held_back": {"1": f"unhealthy: {reason}"},
                "notes": [],
            },
        },
        {"node_id": "quiet-node", "health": None},
    ]
    out = io.StringIO()
    render_node_devices(Console(width=160, file=out), nodes)
    text = out.getvalue()
    assert "gpu-node-a: unhealthy (observed 2026-11-29T12:00:00)" in text
    rows = [
        [cell.strip() for cell in line.split("│")[1:-1]]
        for line in text.splitlines()
        if line.startswith("│ ") and line[2].isdigit()
    ]
    # GPU, health, util, memory used, temp, power, ECC uncorr. (volatile/aggregate), why
    assert rows == [
        ["0", "healthy", "0%", "0 MiB", "27C", "34 W", "0/0", ""],
        ["1", "unhealthy", "0%", "0 MiB", "27C", "35 W", "2/2", reason],
    ]
    assert "quiet-node: no observations yet" in text


def test_nodes_show_their_container_runtime() -> None:
    def node(node_id: str, runtime: dict[str, Any] | None) -> dict[str, Any]:
        caps: dict[str, Any] = {"host": {"platform": "linux-x86_64"}}
        if runtime is not None:
            caps["container_runtime"] = runtime
        return {
            "node_id": node_id,
            "online": True,
            "last_seen": NOW.isoformat(),
            "capabilities": caps,
        }

    works = {"name": "podman", "version": "4.3.1", "oci_runtime": "runc", "works": True}
    nodes = [
        node("a", works | {"cdi_devices": ["nvidia.com/gpu=0", "nvidia.com/gpu=all"]}),
        node("b", works | {"works": False, "notes": ["self-test failed: exit 126"]}),
        node("c", None),
    ]
    text = " ".join(_text(nodes_table(nodes), width=400).split())
    assert "│ podman 4.3.1/runc, 2 CDI devices │" in text
    assert "│ podman 4.3.1/runc (self-test failed) │" in text
    assert "│ - │ - │ none │" in text


def test_doctor_shows_the_runtime_and_why_its_self_test_failed() -> None:
    from gpulayer_cli.doctor import render_report
    from gpulayer_contracts.capabilities import ContainerRuntime, WorkerCapabilities
    from gpulayer_contracts.health import DoctorReport

    runtime = ContainerRuntime(name="podman", version="4.3.1", notes=["self-test failed: exit 126"])
    caps = WorkerCapabilities(
        node_id="n1", agent_version="0.1.0", detected_at=NOW, container_runtime=runtime
    )
    out = io.StringIO()
    render_report(Console(width=200, file=out), DoctorReport(node_id="n1", capabilities=caps))
    assert "containers: podman 4.3.1 (self-test failed)" in out.getvalue()
    assert "container note: self-test failed: exit 126" in out.getvalue()


def test_nodes_show_wsl2_directml_and_a_macs_podman_machine() -> None:
    def node(node_id: str, caps: dict[str, Any]) -> dict[str, Any]:
        return {
            "node_id": node_id,
            "online": True,
            "last_seen": NOW.isoformat(),
            "capabilities": caps,
        }

    wsl = {
        "host": {"platform": "linux-x86_64", "wsl2": True},
        "gpu_apis": {"host": ["cuda", "directml"], "containers": ["cuda", "directml"]},
    }
    mac = {
        "host": {"platform": "darwin-arm64"},
        "gpu_apis": {"host": ["metal"], "containers": ["vulkan"]},
        "container_runtime": {"name": "podman", "version": "5.6.1", "works": True,
                              "machine_provider": "libkrun"},
    }  # fmt: skip
    text = " ".join(
        _text(nodes_table([node("wsl-01", wsl), node("mac-01", mac)]), width=400).split()
    )
    assert "│ wsl-01 │ linux-x86_64 (WSL2) │ cpu only │ cuda, directml │ cuda, directml │" in text
    assert "│ metal │ vulkan │ podman 5.6.1 (machine: libkrun) │" in text


def test_gpulayer_matrix_shows_the_gpu_api_levels(capsys: pytest.CaptureFixture[str]) -> None:
    from gpulayer_cli.main import main
    from gpulayer_contracts.matrix import API_SUPPORT

    assert main(["matrix", "--apis", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown == API_SUPPORT
    # No WSL2 machine has run it: directml is detected, never scheduled.
    assert shown["directml"] == "detection-only"
    assert main(["matrix"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["│", "directml", "│", "detection-only", "│"] in rows
    assert ["│", "rocm", "│", "detection-only", "│", "detection-only", "│"] in rows
