"""The capability rules, one module at a time, called directly: node rules (platform, support
matrix, GPU APIs, Python, frameworks, framework capabilities, distributed) and device rules
(accelerator, MIG, count, memory kind, per-device memory, compute capability, driver)."""

from __future__ import annotations

from typing import Any

import pytest
from tests.unit.matching.rule_cases import TORCHRUN, caps, gpu, job

from gpulayer_contracts import matrix
from gpulayer_contracts.capabilities import AcceleratorDevice, GpuApis
from gpulayer_contracts.jobs import GpuUsage, JobRequest
from gpulayer_matching.facts import Device, Facts
from gpulayer_matching.plan import Plan, compile_plan
from gpulayer_matching.rules import (
    accelerator,
    compute_capability,
    device_count,
    device_memory,
    distributed,
    driver,
    framework_capabilities,
    frameworks,
    gpu_apis,
    memory_kind,
    mig,
    platform,
    python_version,
    support_matrix,
)
from gpulayer_matching.verdicts import Fail


def node_check(module: Any, j: JobRequest, facts: Facts, *, as_cpu: bool = False) -> Fail | None:
    plan = compile_plan(j)
    result: Fail | None = module.check(plan, facts, plan.gpu_for(facts.family), as_cpu)
    return result


def device_check(
    module: Any, j: JobRequest, devices: list[AcceleratorDevice], n: int = 1
) -> tuple[Device, ...] | Fail:
    plan: Plan = compile_plan(j)
    facts = Facts(caps(devices))
    devs = facts.usable.get("cuda", ())
    result: tuple[Device, ...] | Fail = module.check(plan, facts, "cuda", devs, n)
    return result


def failed(result: object) -> tuple[int, str, object]:
    assert isinstance(result, Fail), result
    return result.rank, result.rule, result.value


def indices(result: object) -> list[int]:
    assert isinstance(result, tuple), result
    return [d.index for d in result]


# --- node rules ---


def test_platform() -> None:
    assert node_check(platform, job(), Facts(caps(platform="darwin-arm64"))) is None
    assert node_check(platform, job(os="linux"), Facts(caps())) is None
    assert failed(node_check(platform, job(os="linux"), Facts(caps(platform="darwin-arm64")))) == (
        41,
        "os",
        "darwin",
    )
    assert failed(node_check(platform, job(os="linux"), Facts(caps(platform=None))))[1] == (
        "os_unknown"
    )


def test_support_matrix_only_for_cpu_work(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(matrix.SUPPORT_MATRIX["cpu"], "distributed", "unsupported")
    j = job(distributed=TORCHRUN)
    assert node_check(support_matrix, j, Facts(caps()), as_cpu=False) is None
    assert failed(node_check(support_matrix, j, Facts(caps()), as_cpu=True)) == (50, "matrix", None)
    # Independent cpu work stays allowed.
    assert node_check(support_matrix, job(), Facts(caps()), as_cpu=True) is None


def test_gpu_apis_on_the_host_or_in_containers() -> None:
    apis = GpuApis(host=["metal"], containers=["vulkan"])
    facts = Facts(caps(gpu_apis=apis))
    assert node_check(gpu_apis, job(gpu_section=GpuUsage(apis_any=["metal", "x"])), facts) is None
    in_container = GpuUsage(apis_any=["metal"], in_container=True)
    assert failed(node_check(gpu_apis, job(gpu_section=in_container), facts)) == (
        600,
        "apis",
        "metal in containers",
    )


def test_python_version() -> None:
    want = job(python=">=3.11")
    assert node_check(python_version, want, Facts(caps(workload_python_version="3.12.1"))) is None
    assert failed(
        node_check(python_version, want, Facts(caps(workload_python_version="3.10.4")))
    ) == (
        701,
        "python",
        "3.10.4",
    )
    garbage = Facts(caps(workload_python_version="not-a-version"))
    assert failed(node_check(python_version, want, garbage))[1] == "python_unknown"


def test_frameworks_rank_per_name_in_name_order() -> None:
    want = job(frameworks={"torch": ">=2", "Jax": ">=0.4"})
    facts = Facts(caps(frameworks={"jax": "0.4.30", "torch": "1.13"}))
    # jax (canonical name matched) passes; torch, second in name order, falls short.
    assert failed(node_check(frameworks, want, facts)) == (10_003, "framework:torch", "1.13")
    facts = Facts(caps(frameworks={"torch": "2.5"}))
    assert failed(node_check(frameworks, want, facts)) == (10_000, "framework_unknown:Jax", None)


def test_framework_capabilities_rank_in_the_jobs_order() -> None:
    want = job(framework_capabilities=["torch.cuda", "torch.distributed"])
    facts = Facts(caps(framework_capabilities=["torch.cuda"]))
    assert failed(node_check(framework_capabilities, want, facts)) == (
        20_001,
        "framework_capability:torch.distributed",
        None,
    )


def test_distributed_backend_before_launcher() -> None:
    want = job(distributed=TORCHRUN)
    assert failed(node_check(distributed, want, Facts(caps())))[1] == "backend"
    assert failed(node_check(distributed, want, Facts(caps(distributed_backends=["nccl"]))))[1] == (
        "launcher"
    )
    both = Facts(caps(distributed_backends=["nccl"], launchers=["torchrun"]))
    assert node_check(distributed, want, both) is None
    assert node_check(distributed, job(), Facts(caps())) is None


# --- device rules ---


def test_accelerator_none_or_unusable() -> None:
    assert failed(device_check(accelerator, job(gpu_count=1), []))[1] == "no_device"
    unusable = [gpu(execution_supported=False)]
    assert failed(device_check(accelerator, job(gpu_count=1), unusable))[1] == "not_usable"
    assert indices(device_check(accelerator, job(gpu_count=1), [gpu(0), gpu(1)])) == [0, 1]


def test_mig_instances_only_for_one_device_with_a_memory_figure() -> None:
    devices = [gpu(0), gpu(1, mig_parent=5, mig_profile="1g.10gb")]
    # Whole GPUs are left when there are enough of them.
    assert indices(device_check(mig, job(gpu_count=1), devices)) == [0]
    # Only instances would do: not for a job without a memory figure.
    assert failed(device_check(mig, job(gpu_count=2), devices, n=2)) == (210, "mig", "1g.10gb")
    # Too few devices even counting instances: the count rule says so, not this one.
    assert indices(device_check(mig, job(gpu_count=3), devices, n=3)) == [0]
    assert indices(device_check(mig, job(gpu_count=1, gpu_memory_gb=5), devices)) == [0, 1]


def test_device_count() -> None:
    assert failed(device_check(device_count, job(gpu_count=3), [gpu(0), gpu(1)], n=3)) == (
        200,
        "count",
        2,
    )
    assert indices(device_check(device_count, job(gpu_count=2), [gpu(0), gpu(1)], n=2)) == [0, 1]


def test_memory_kind_unknown_when_unknowns_could_cover() -> None:
    want = job(gpu_count=2, gpu_memory_kind="unified")
    unified = gpu(0, memory_kind="unified")
    assert failed(device_check(memory_kind, want, [unified, gpu(1, memory_kind=None)], n=2))[1] == (
        "memory_kind_unknown"
    )
    assert failed(device_check(memory_kind, want, [unified, gpu(1)], n=2))[1] == "memory_kind"
    mixed = [unified, gpu(1), gpu(2, memory_kind="unified")]
    assert indices(device_check(memory_kind, want, mixed, n=2)) == [0, 2]


def test_device_memory_nearest_miss_is_the_nth_best() -> None:
    want = job(gpu_count=2, gpu_memory_gb=40)
    devices = [gpu(0, memory_mib=50_000), gpu(1, memory_mib=30_000), gpu(2, memory_mib=20_000)]
    assert failed(device_check(device_memory, want, devices, n=2)) == (401, "memory", 30_000)
    unknown = [gpu(0, memory_mib=50_000), gpu(1, memory_mib=None)]
    assert failed(device_check(device_memory, want, unknown, n=2))[1] == "memory_unknown"
    assert indices(device_check(device_memory, job(gpu_memory_gb=40), devices)) == [0]


def test_compute_capability_nearest_miss() -> None:
    want = job(gpu_count=1, min_cuda_compute_capability="9.0")
    devices = [gpu(0, compute_capability="8.6"), gpu(1, compute_capability="8.0")]
    assert failed(device_check(compute_capability, want, devices)) == (501, "cc", (8, 6))
    garbage = [gpu(0, compute_capability="garbage")]
    assert failed(device_check(compute_capability, want, garbage))[1] == "cc_unknown"


def test_driver_shows_the_highest_short_version() -> None:
    want = job(gpu_count=1, driver=">=560")
    devices = [gpu(0, driver_version="535.1"), gpu(1, driver_version="550.2")]
    assert failed(device_check(driver, want, devices)) == (551, "driver", "550.2")
    assert failed(device_check(driver, want, [gpu(0, driver_version=None)]))[1] == "driver_unknown"
    assert indices(device_check(driver, want, [gpu(0, driver_version="565.57")])) == [0]
