"""Builders for the rule tests: devices, nodes and jobs with only what a rule reads set, and one
example per outcome (a job and one node that fails exactly that rule)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Any

import pytest

from gpulayer_contracts import matrix
from gpulayer_contracts.capabilities import (
    AcceleratorDevice,
    ContainerRuntime,
    GpuApis,
    HostInfo,
    WorkerCapabilities,
)
from gpulayer_contracts.jobs import Container, Distributed, GpuUsage, JobRequest, Requirements
from gpulayer_matching import NodeView

H100_MIB = 81559


def gpu(index: int = 0, **kw: Any) -> AcceleratorDevice:
    fields: dict[str, Any] = {
        "accelerator": "cuda",
        "memory_mib": H100_MIB,
        "memory_kind": "dedicated",
        "compute_capability": "9.0",
        "driver_version": "550.54.15",
        "execution_supported": True,
    }
    fields.update(kw)
    return AcceleratorDevice(index=index, **fields)


def caps(
    devices: Iterable[AcceleratorDevice] = (), *, platform: str | None = "linux-x86_64", **kw: Any
) -> WorkerCapabilities:
    return WorkerCapabilities(
        node_id="n1",
        agent_version="0.1.0",
        detected_at=datetime(2025, 1, 1, tzinfo=UTC),
        host=HostInfo(platform=platform),
        accelerators=list(devices),
        **kw,
    )


def node(
    devices: Iterable[AcceleratorDevice] = (), *, view: dict[str, Any] | None = None, **kw: Any
) -> NodeView:
    return NodeView(node_id="n1", capabilities=caps(devices, **kw), **(view or {}))


def job(
    *,
    gpu_section: GpuUsage | None = None,
    distributed: Distributed | None = None,
    container: Container | None = None,
    **req: Any,
) -> JobRequest:
    return JobRequest(
        job_id="j1",
        command=["true"],
        requirements=Requirements(**req),
        gpu=gpu_section,
        distributed=distributed,
        container=container,
    )


IMAGE = Container(image="localhost/train:1")
SELFTEST_FAILED = (
    "self-test failed (podman run --rootfs with a static busybox): exit 126: Error: runc: "
    "runc create failed: unable to start container process: error during container init: "
    "error setting rlimits for ready process: error setting rlimit type 7: operation not "
    "permitted: OCI permission denied"
)
TORCHRUN = Distributed(nodes=1, backend="nccl", launcher="torchrun")
SHARED = GpuUsage(use="shared")
EXCLUSIVE = GpuUsage(use="exclusive")
GB = 10**9

Example = Callable[[pytest.MonkeyPatch], tuple[JobRequest, NodeView]]


def _matrix(mp: pytest.MonkeyPatch) -> tuple[JobRequest, NodeView]:
    mp.setitem(matrix.SUPPORT_MATRIX["cpu"], "distributed", "unsupported")
    return job(distributed=TORCHRUN), node(distributed_backends=["nccl"], launchers=["torchrun"])


# Outcome name (as ruled_out keys it) -> a job and a node ruled out by it alone.
EXAMPLES: dict[str, Example] = {
    "os_unknown": lambda mp: (job(os="linux"), node(platform=None)),
    "os": lambda mp: (job(os="linux"), node(platform="darwin-arm64")),
    "no_container_runtime": lambda mp: (job(container=IMAGE), node()),
    "container_runtime_failed": lambda mp: (
        job(container=IMAGE),
        node(container_runtime=ContainerRuntime(name="podman", notes=[SELFTEST_FAILED])),
    ),
    "matrix": _matrix,
    "no_device": lambda mp: (job(gpu_count=1), node()),
    "not_usable": lambda mp: (job(gpu_count=1), node([gpu(execution_supported=False)])),
    "mig": lambda mp: (job(gpu_count=1), node([gpu(mig_parent=0, mig_profile="1g.10gb")])),
    "count": lambda mp: (job(gpu_count=2), node([gpu()])),
    "memory_kind_unknown": lambda mp: (
        job(gpu_count=1, gpu_memory_kind="unified"),
        node([gpu(memory_kind=None)]),
    ),
    "memory_kind": lambda mp: (job(gpu_count=1, gpu_memory_kind="unified"), node([gpu()])),
    "memory_unknown": lambda mp: (job(gpu_memory_gb=10), node([gpu(memory_mib=None)])),
    "memory": lambda mp: (job(gpu_memory_gb=100), node([gpu()])),
    "cc_unknown": lambda mp: (
        job(min_cuda_compute_capability="8.0"),
        node([gpu(compute_capability=None)]),
    ),
    "cc": lambda mp: (job(min_cuda_compute_capability="10.0"), node([gpu()])),
    "driver_unknown": lambda mp: (job(driver=">=550"), node([gpu(driver_version=None)])),
    "driver": lambda mp: (job(driver=">=560"), node([gpu()])),
    "apis": lambda mp: (job(gpu_section=GpuUsage(apis_any=["vulkan"])), node()),
    "apis_matrix": lambda mp: (
        job(gpu_section=GpuUsage(apis_any=["directml"])),
        node(gpu_apis=GpuApis(host=["directml"])),
    ),
    "python_unknown": lambda mp: (job(python=">=3.10"), node()),
    "python": lambda mp: (job(python=">=3.13"), node(workload_python_version="3.11.9")),
    "framework_unknown": lambda mp: (job(frameworks={"torch": ">=2"}), node()),
    "framework": lambda mp: (job(frameworks={"torch": ">=2"}), node(frameworks={"torch": "1.13"})),
    "framework_capability": lambda mp: (job(framework_capabilities=["torch.cuda"]), node()),
    "backend": lambda mp: (job(distributed=TORCHRUN), node(launchers=["torchrun"])),
    "launcher": lambda mp: (job(distributed=TORCHRUN), node(distributed_backends=["nccl"])),
    "cores": lambda mp: (job(cpu_cores=2), node(view={"cpu_total": 1000})),
    "host_memory": lambda mp: (job(memory_gb=2), node(view={"memory_total": GB})),
    "offline": lambda mp: (job(), node(view={"online": False})),
    "executor_down": lambda mp: (job(), node(view={"executor_down": True})),
    "no_slot": lambda mp: (job(), node(view={"slots_total": 4, "slots_free": 0})),
    "busy_cores": lambda mp: (
        job(cpu_cores=2),
        node(view={"cpu_total": 8000, "cpu_free": 500}),
    ),
    "busy_memory": lambda mp: (
        job(memory_gb=2),
        node(view={"memory_total": 8 * GB, "memory_free": GB}),
    ),
    "unhealthy": lambda mp: (
        job(gpu_count=1),
        node([gpu()], view={"sick": frozenset({0}), "health": {0: "XID 79"}}),
    ),
    "busy_exclusive": lambda mp: (job(gpu_count=1), node([gpu()], view={"shared": frozenset({0})})),
    "busy_shared": lambda mp: (
        job(gpu_count=1, gpu_section=SHARED),
        node([gpu()], view={"exclusive": frozenset({0})}),
    ),
    "busy_pool": lambda mp: (
        job(gpu_section=EXCLUSIVE),
        node([gpu(0), gpu(1)], view={"shared": frozenset({0})}),
    ),
    "busy_pool_shared": lambda mp: (
        job(gpu_section=SHARED),
        node([gpu()], view={"exclusive": frozenset({0})}),
    ),
    "busy_gpu_memory": lambda mp: (
        job(gpu_count=1, gpu_memory_gb=70, gpu_section=SHARED),
        node([gpu()], view={"gpu_reserved": {0: 40_000}}),
    ),
}
