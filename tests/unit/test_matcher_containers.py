"""Container jobs in the matcher (issue 28): a job that names an image goes only to a node whose
container runtime passed its self-test, and its GPU APIs are the node's container APIs."""

from __future__ import annotations

from typing import Any

import msgspec
from tests.unit.matching.rule_cases import IMAGE, SELFTEST_FAILED, caps, gpu, job

from gpulayer_contracts.capabilities import ContainerRuntime, GpuApis, HostInfo
from gpulayer_contracts.jobs import Distributed, GpuUsage
from gpulayer_matching import NodeView, NoPlacement, Placement, explain, match, would_fit_when_idle
from gpulayer_matching.gang import GangPlacement, match_gang

WORKS = ContainerRuntime(name="podman", version="4.3.1", oci_runtime="runc", works=True)
FAILED = ContainerRuntime(
    name="podman", version="4.3.1", oci_runtime="runc", notes=[SELFTEST_FAILED]
)


def node(node_id: str, runtime: ContainerRuntime | None, devices: Any = (), **kw: Any) -> NodeView:
    capabilities = msgspec.structs.replace(
        caps(devices), node_id=node_id, container_runtime=runtime, **kw
    )
    return NodeView(node_id=node_id, capabilities=capabilities)


def test_a_container_job_goes_only_where_a_runtime_works() -> None:
    fleet = [node("a-none", None), node("b-failed", FAILED), node("c-works", WORKS)]
    placed = match(job(container=IMAGE), fleet)
    assert isinstance(placed, Placement)
    assert placed.node_id == "c-works"
    why = explain(job(container=IMAGE), fleet)
    assert why.summary == (
        "1/3 nodes can run this job now; ruled out: 1 has no container runtime, 1 has a "
        "container runtime that failed its self-test: " + why.reasons[1].split(": ", 1)[1]
    )
    assert "rlimit type 7" in why.reasons[1]


def test_no_runtime_in_the_fleet_is_unsatisfiable_and_says_so() -> None:
    fleet = [node(f"n{i}", None) for i in range(3)]
    why = explain(job(container=IMAGE), fleet)
    assert isinstance(match(job(container=IMAGE), fleet), NoPlacement)
    assert why.unsatisfiable
    assert why.summary == "0/3 nodes can run this job: 3 have no container runtime"
    assert why.ruled_out == {"no_container_runtime": 3}
    assert not would_fit_when_idle(job(container=IMAGE), fleet[0])


def test_a_failed_self_test_is_unsatisfiable_too_with_its_note() -> None:
    fleet = [node("n0", FAILED), node("n1", None)]
    why = explain(job(container=IMAGE), fleet)
    assert why.unsatisfiable
    assert why.reasons[0] == "1 has no container runtime"
    assert why.reasons[1].startswith("1 has a container runtime that failed its self-test: ")


def test_a_job_without_an_image_ignores_the_runtime() -> None:
    view = node("n0", None)
    assert isinstance(match(job(), [view]), Placement)
    # The same node object next, for a container job: its cached verdict is not reused.
    assert isinstance(match(job(container=IMAGE), [view]), NoPlacement)
    assert isinstance(match(job(), [view]), Placement)


def test_a_container_jobs_apis_are_the_nodes_container_apis() -> None:
    cuda_runner = GpuUsage(use="shared", apis_any=["cuda"])
    host_only = node(
        "host-cuda", WORKS, devices=[gpu()], gpu_apis=GpuApis(host=["cuda"], containers=[])
    )
    in_containers = node(
        "ctr-cuda", WORKS, devices=[gpu()], gpu_apis=GpuApis(host=[], containers=["cuda"])
    )
    container_job = job(container=IMAGE, gpu_section=cuda_runner)
    why = explain(container_job, [host_only])
    assert why.reasons == ["1 has none of the GPU APIs cuda in containers"]
    placed = match(container_job, [host_only, in_containers])
    assert isinstance(placed, Placement)
    assert placed.node_id == "ctr-cuda"
    # The same job without an image looks at the host's APIs.
    bare = match(job(gpu_section=cuda_runner), [host_only, in_containers])
    assert isinstance(bare, Placement)
    assert bare.node_id == "host-cuda"


def test_a_gpu_container_job_gets_its_devices_where_the_runtime_works() -> None:
    fleet = [node("n0", None, devices=[gpu(0)]), node("n1", WORKS, devices=[gpu(0), gpu(1)])]
    placed = match(job(container=IMAGE, gpu_count=2), fleet)
    assert isinstance(placed, Placement)
    assert (placed.node_id, sorted(placed.devices)) == ("n1", [0, 1])
    why = explain(job(container=IMAGE, gpu_count=2), fleet[:1])
    # The runtime is the first thing a container job needs: named before the device count.
    assert why.reasons == ["1 has no container runtime"]


def test_a_distributed_container_job_gets_only_nodes_with_a_runtime() -> None:
    dist = Distributed(nodes=2, backend="gloo", launcher="torchrun")
    extra = {
        "distributed_backends": ["gloo"],
        "launchers": ["torchrun"],
        "host": HostInfo(platform="linux-x86_64", advertise_address="10.0.0.1"),
    }
    fleet = [node("a", None, **extra), node("b", WORKS, **extra), node("c", WORKS, **extra)]
    gang = match_gang(job(container=IMAGE, distributed=dist), fleet)
    assert isinstance(gang, GangPlacement)
    assert sorted(p.node_id for p in gang.ranks) == ["b", "c"]
    short = match_gang(job(container=IMAGE, distributed=dist), fleet[:2])
    assert isinstance(short, NoPlacement)
    assert "1 has no container runtime" in short.summary
