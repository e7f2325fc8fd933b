"""The matcher's health and MIG rules: sick devices get no new grants and explain says why;
MIG instances go only to jobs that ask for one device and state their memory."""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec

from gpulayer_contracts.capabilities import AcceleratorDevice, HostInfo, WorkerCapabilities
from gpulayer_contracts.capabilities import mig_index as mi
from gpulayer_contracts.jobs import JobRequest, Requirements
from gpulayer_matching import NodeView, Placement, explain, match


def gpu(index: int, mib: int = 81920, **kw: object) -> AcceleratorDevice:
    return AcceleratorDevice(
        accelerator="cuda",
        index=index,
        memory_mib=mib,
        memory_kind="dedicated",
        compute_capability="8.0",
        driver_version="535.216.01",
        execution_supported=True,
        **kw,  # type: ignore[arg-type]
    )


def node(node_id: str, devices: list[AcceleratorDevice], **kw: object) -> NodeView:
    caps = WorkerCapabilities(
        node_id=node_id,
        agent_version="t",
        detected_at=datetime.now(UTC),
        host=HostInfo(platform="linux-x86_64"),
        accelerators=devices,
    )
    return NodeView(node_id=node_id, capabilities=caps, **kw)  # type: ignore[arg-type]


def job(n: int = 1, gb: float | None = None) -> JobRequest:
    return JobRequest(
        job_id="j",
        command=["true"],
        requirements=Requirements(accelerator="cuda", gpu_count=n, gpu_memory_gb=gb),
    )


def test_a_sick_device_gets_no_grant_and_explain_names_it() -> None:
    view = node("g", [gpu(i) for i in range(4)])
    sick = msgspec.structs.replace(
        view, sick=frozenset({0}), health={0: "unhealthy: 2 uncorrected ECC errors"}
    )
    placed = match(job(), [sick])
    assert isinstance(placed, Placement)
    assert placed.devices == [1]
    # All four wanted, one sick: not now, and the reason names the device and why.
    why = match(job(4), [sick])
    assert not isinstance(why, Placement)
    assert why.ruled_out == {"unhealthy": 1}
    assert why.unsatisfiable is False  # it recovers: not "never"
    assert "g GPU 0: unhealthy: 2 uncorrected ECC errors" in why.reasons[0]
    # Recovered: used again.
    assert isinstance(match(job(4), [view]), Placement)


def test_explain_counts_the_sick_node_once_with_every_reason() -> None:
    view = node(
        "g",
        [gpu(0), gpu(1)],
        sick=frozenset({0, 1}),
        health={0: "degraded: clocks slowed", 1: "unhealthy: GPU is lost"},
    )
    why = explain(job(), [view])
    assert why.ruled_out == {"unhealthy": 1}
    assert "degraded: clocks slowed" in why.reasons[0]
    assert "GPU is lost" in why.reasons[0]


def mig_node() -> NodeView:
    parent = msgspec.structs.replace(gpu(0), mig_mode="Enabled", execution_supported=False)
    instances = [
        gpu(mi(0, d), 9728, mig_parent=0, mig_profile="1g.10gb", uuid=f"MIG-{d}") for d in range(7)
    ]
    return node("mig", [parent, *instances])


def test_a_10gb_job_lands_on_a_1g10gb_instance() -> None:
    placed = match(job(1, 10), [mig_node()])
    assert isinstance(placed, Placement)
    assert placed.devices == [mi(0, 0)]


def test_whole_gpu_jobs_never_land_on_a_mig_gpu() -> None:
    for shape in (job(1), job(2, 10)):
        why = match(shape, [mig_node()])
        assert not isinstance(why, Placement)
        assert why.ruled_out == {"mig": 1}
        assert "only MIG instances (seen: 1g.10gb)" in why.reasons[0]


def test_a_job_larger_than_an_instance_waits_with_the_memory_reason() -> None:
    why = match(job(1, 20), [mig_node()])
    assert not isinstance(why, Placement)
    assert why.ruled_out == {"memory": 1}
    assert "9728 MiB" in why.reasons[0]


def test_a_sick_parent_takes_its_instances_out() -> None:
    view = msgspec.structs.replace(
        mig_node(),
        sick=frozenset(mi(0, d) for d in range(7)),
        health={mi(0, d): "unhealthy: GPU requires reset" for d in range(7)},
    )
    why = match(job(1, 10), [view])
    assert not isinstance(why, Placement)
    assert why.ruled_out == {"unhealthy": 1}
