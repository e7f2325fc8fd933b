"""The NVIDIA driver and OS requirements, explanations that name a job's profile, and
``profile_fit`` (what ``gpulayer profiles`` shows) on a simulated fleet."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
import pytest

from gpulayer_contracts import AcceleratorDevice, HostInfo, JobRequest, WorkerCapabilities
from gpulayer_contracts.profiles import Profiles, expand_profile, load_profiles
from gpulayer_matching import NodeView, Placement, explain, match, profile_fit

SHIPPED = Path(__file__).resolve().parents[2] / "examples" / "profiles.toml"
TORCH = "torch-2.5-cu124@1"


def cuda(index: int, driver: str | None, cc: str = "9.0") -> AcceleratorDevice:
    return AcceleratorDevice(
        accelerator="cuda",
        index=index,
        memory_mib=81559,
        memory_kind="dedicated",
        compute_capability=cc,
        driver_version=driver,
        execution_supported=True,
    )


def node(
    node_id: str,
    drivers: list[str | None] = (),  # type: ignore[assignment]
    *,
    platform: str | None = "linux-x86_64",
    torch: str | None = "2.5.1+cu124",
    python: str = "3.11.9",
    online: bool = True,
    cc: str = "9.0",
    **view: Any,
) -> NodeView:
    caps = WorkerCapabilities(
        node_id=node_id,
        agent_version="0",
        detected_at=datetime(2025, 1, 1, tzinfo=UTC),
        host=HostInfo(platform=platform),
        accelerators=[cuda(i, d, cc) for i, d in enumerate(drivers)],
        workload_python_version=python,
        frameworks={"torch": torch} if torch else {},
        framework_capabilities=["torch.cuda"] if drivers else [],
    )
    return NodeView(node_id=node_id, capabilities=caps, online=online, **view)


def job(**fields: Any) -> JobRequest:
    return msgspec.convert({"job_id": "j", "command": ["true"], **fields}, JobRequest)


@pytest.fixture(scope="module")
def profiles() -> Profiles:
    return load_profiles(SHIPPED)


def test_driver_is_a_per_device_requirement() -> None:
    mixed = node("mixed", ["535.129.03", "550.54.15", "570.86.10"])
    decision = match(job(requirements={"driver": ">=550", "gpu_count": 2}), [mixed])
    assert isinstance(decision, Placement)
    assert decision.devices == [1, 2]
    why = explain(job(requirements={"driver": ">=550", "gpu_count": 3}), [mixed])
    assert why.reasons == ["1 has NVIDIA driver not matching >=550 (seen: 535.129.03)"]
    # A driver asks for CUDA, and an unknown driver is never enough.
    why = explain(job(requirements={"driver": ">=550"}), [node("n", [None]), node("cpu")])
    assert why.ruled_out == {"driver_unknown": 1, "no_device": 1}
    assert why.reasons == ["1 has no cuda device", "1 has unknown NVIDIA driver version"]
    # Not PEP 440 ("R550"): unknown as well.
    assert explain(job(requirements={"driver": ">=550"}), [node("x", ["R550"])]).ruled_out == {
        "driver_unknown": 1
    }


def test_os_is_a_node_requirement_checked_first() -> None:
    fleet = [node("mac", platform="darwin-arm64"), node("??", platform=None), node("lin")]
    decision = match(job(requirements={"os": "linux"}), fleet)
    assert isinstance(decision, Placement)
    assert decision.node_id == "lin"
    why = explain(job(requirements={"os": "linux", "accelerator": "cuda"}), fleet)
    assert why.reasons == [
        "1 has unknown operating system",
        "1 has an operating system other than linux (seen: darwin)",
        "1 has no cuda device",
    ]


def test_explanations_name_the_profile_for_what_it_supplied(profiles: Profiles) -> None:
    by_profile, errors = expand_profile(job(profile=TORCH, requirements={"gpu_count": 2}), profiles)
    assert errors == []
    fleet = [
        node("old-driver", ["535.129.03", "535.129.03"]),
        node("mac", platform="darwin-arm64"),
        node("torch-2.4", ["550.54.15", "550.54.15"], torch="2.4.1"),
        node("one-gpu", ["550.54.15"]),
        node("offline", ["550.54.15", "550.54.15"], online=False),
    ]
    why = explain(by_profile, fleet)
    assert why.reasons == [
        f"1 has an operating system other than linux (seen: darwin) (profile {TORCH})",
        # gpu_count is the job's own: no profile named.
        "1 has < 2 usable cuda devices (best: one-gpu 1)",
        f"1 has NVIDIA driver not matching >=550 (seen: 535.129.03) (profile {TORCH})",
        f"1 has torch not matching ==2.5.* (seen: 2.4.1) (profile {TORCH})",
        "1 is offline",
    ]
    assert not isinstance(match(by_profile, fleet), Placement)
    fitting = node("fits", ["550.54.15", "560.35.03"])
    decision = match(by_profile, [*fleet, fitting])
    assert isinstance(decision, Placement)
    assert decision.node_id == "fits"


def test_profile_fit_counts_nodes_satisfying_each_profile_now(profiles: Profiles) -> None:
    fleet = [
        # Busy and short of free cores: still satisfies the profile (occupancy is not its concern).
        node("busy", ["550.54.15"], exclusive=frozenset({0}), cpu_total=1000, cpu_free=0),
        node("old-driver", ["535.129.03"]),
        node("mac", platform="darwin-arm64", python="3.12.1"),
        node("py39", python="3.9.18"),
        node("offline", ["550.54.15"], online=False),
    ]
    entries = {e["profile"]: e for e in profile_fit(profiles, fleet)}
    assert list(entries) == [
        "python-linux@1",
        "torch-2.5-cu124@1",
        "torch-2.5-cu124@2",
    ]
    torch = entries[TORCH]
    assert (torch["nodes"], torch["satisfy"]) == (5, 1)
    assert torch["requirements"]["driver"] == ">=550"
    assert torch["reasons"] == [
        f"1 has an operating system other than linux (seen: darwin) (profile {TORCH})",
        f"1 has no cuda device (profile {TORCH})",
        f"1 has NVIDIA driver not matching >=550 (seen: 535.129.03) (profile {TORCH})",
        "1 is offline",
    ]
    py = entries["python-linux@1"]
    assert (py["satisfy"], py["ruled_out"]) == (2, {"os": 1, "python": 1, "offline": 1})
    assert profile_fit(Profiles(), fleet) == []
