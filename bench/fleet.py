"""Synthetic fleets and jobs, shaped like what real probes and users publish. Pure, no I/O."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, datetime

from gpulayer_contracts import (
    AcceleratorDevice,
    GpuApis,
    HostInfo,
    JobRequest,
    Requirements,
    Sandbox,
    SandboxDevices,
    WorkerCapabilities,
    __version__,
    encode,
)

GPUS_PER_CUDA_NODE = 8


@dataclass(frozen=True)
class FleetShape:
    """How many nodes of each kind. Mix: half 8-GPU CUDA nodes, 30% CPU, 20% Apple."""

    cuda: int
    cpu: int
    apple: int

    @classmethod
    def of(cls, n: int) -> FleetShape:
        cuda = n // 2
        cpu = (n * 3) // 10
        return cls(cuda=cuda, cpu=cpu, apple=n - cuda - cpu)

    @property
    def total(self) -> int:
        return self.cuda + self.cpu + self.apple

    @property
    def cuda_gpus(self) -> int:
        return self.cuda * GPUS_PER_CUDA_NODE


def cuda_device(i: int, node: str) -> AcceleratorDevice:
    return AcceleratorDevice(
        accelerator="cuda",
        index=i,
        vendor="NVIDIA",
        name="NVIDIA H100 80GB HBM3",
        uuid=f"GPU-{uuid.uuid5(uuid.NAMESPACE_URL, f'{node}/{i}')}",
        memory_mib=81559,
        memory_kind="dedicated",
        compute_capability="9.0",
        driver_version="550.54.15",
        cuda_driver_version="12.4",
        mig_mode="Disabled",
        execution_supported=True,
    )


def cuda_node(node: str, at: datetime, gpus: int = GPUS_PER_CUDA_NODE) -> WorkerCapabilities:
    return WorkerCapabilities(
        node_id=node,
        agent_version=__version__,
        detected_at=at,
        host=HostInfo(
            hostname=node,
            os="linux",
            os_release="6.5.0-35-generic",
            platform="linux-x86_64",
            arch="x86_64",
            cpu_cores=112,
            memory_bytes=2_000_000_000_000,
            disk_free_bytes=3_000_000_000_000,
            python_version="3.11.9",
        ),
        accelerators=[cuda_device(i, node) for i in range(gpus)],
        workload_python="/usr/bin/python3",
        workload_python_version="3.11.9",
        frameworks={"torch": "2.4.1", "numpy": "1.26.4", "transformers": "4.44.2"},
        framework_capabilities=["torch.cuda"],
        distributed_backends=["gloo", "nccl"],
        launchers=["torchrun"],
        gpu_apis=GpuApis(
            host=["cuda", "opencl", "vulkan"],
            evidence={
                "cuda": "nvidia-smi: driver 550.54.15, 8 devices",
                "opencl": "clinfo: NVIDIA CUDA platform, 8 GPU devices",
                "vulkan": "vulkaninfo: NVIDIA H100 80GB HBM3",
            },
        ),
        advertise_address="10.0.0.1",
    )


def cpu_node(node: str, at: datetime) -> WorkerCapabilities:
    return WorkerCapabilities(
        node_id=node,
        agent_version=__version__,
        detected_at=at,
        host=HostInfo(
            hostname=node,
            os="linux",
            os_release="6.5.0-35-generic",
            platform="linux-x86_64",
            arch="x86_64",
            cpu_cores=64,
            memory_bytes=256_000_000_000,
            disk_free_bytes=500_000_000_000,
            python_version="3.11.9",
        ),
        workload_python="/usr/bin/python3",
        workload_python_version="3.11.9",
        frameworks={"torch": "2.4.1+cpu", "numpy": "1.26.4"},
        distributed_backends=["gloo"],
        launchers=["torchrun"],
        notes=["nvidia-smi not found: no NVIDIA devices"],
    )


def apple_node(node: str, at: datetime) -> WorkerCapabilities:
    ram = 64 * 1024**3
    return WorkerCapabilities(
        node_id=node,
        agent_version=__version__,
        detected_at=at,
        host=HostInfo(
            hostname=node,
            os="darwin",
            os_release="23.5.0",
            platform="darwin-arm64",
            arch="arm64",
            cpu_cores=12,
            memory_bytes=ram,
            disk_free_bytes=400_000_000_000,
            python_version="3.11.9",
        ),
        accelerators=[
            AcceleratorDevice(
                accelerator="mps",
                index=0,
                vendor="Apple",
                name="Apple M3 Max",
                memory_mib=ram // (1024 * 1024),
                memory_kind="unified",
                execution_supported=True,
            )
        ],
        workload_python="/opt/homebrew/bin/python3",
        workload_python_version="3.11.9",
        frameworks={"torch": "2.4.1", "numpy": "1.26.4"},
        framework_capabilities=["torch.mps"],
        distributed_backends=["gloo"],
        gpu_apis=GpuApis(host=["metal"], evidence={"metal": "system_profiler: Apple M3 Max"}),
    )


def fleet(prefix: str, n: int, at: datetime | None = None) -> list[WorkerCapabilities]:
    """``n`` nodes, interleaved so that CUDA, CPU and Apple nodes alternate in publish order."""
    when = at or datetime.now(UTC)
    shape = FleetShape.of(n)
    out: list[WorkerCapabilities] = []
    for i in range(n):
        node = f"{prefix}-{i:05d}"
        k = i % 10
        if k < 5:
            out.append(cuda_node(node, when))
        elif k < 8:
            out.append(cpu_node(node, when))
        else:
            out.append(apple_node(node, when))
    assert len(out) == shape.total
    return out


def gpu_jobs_for(m: int, shape: FleetShape, share: float = 0.6) -> int:
    """How many of ``m`` jobs ask for one CUDA GPU: ``share`` of them, but never more than 90%
    of the fleet's GPUs, so a run measures placement and not exhausted capacity (devices are
    not released: no executor reports on simulated nodes)."""
    return min(int(m * share), int(shape.cuda_gpus * 0.9))


def cuda_job(job_id: str, command: list[str] | None = None) -> JobRequest:
    return JobRequest(
        job_id=job_id,
        command=command or ["python3", "train.py", "--epochs", "1"],
        requirements=Requirements(accelerator="cuda", gpu_count=1, gpu_memory_gb=40),
        sandbox=Sandbox(devices=SandboxDevices(gpu="compute")),
        timeout_s=3600,
    )


def cpu_job(job_id: str) -> JobRequest:
    return JobRequest(
        job_id=job_id,
        command=["python3", "preprocess.py", "--shard", job_id],
        requirements=Requirements(accelerator="cpu"),
        timeout_s=600,
    )


def never_fits_job(job_id: str) -> JobRequest:
    """Waits forever on this fleet (16 GPUs on one node; nodes have 8): a pending job."""
    return JobRequest(
        job_id=job_id,
        command=["python3", "train.py"],
        requirements=Requirements(accelerator="cuda", gpu_count=16),
        sandbox=Sandbox(devices=SandboxDevices(gpu="compute")),
    )


def job_mix(prefix: str, m: int, gpu_jobs: int) -> list[JobRequest]:
    """``m`` jobs, ``gpu_jobs`` of them one-GPU CUDA jobs spread evenly, the rest CPU jobs."""
    jobs: list[JobRequest] = []
    placed_gpu = 0
    for i in range(m):
        job_id = f"{prefix}-{i:06d}"
        # Bresenham-style spreading: GPU job i when the running share falls behind.
        if gpu_jobs and (placed_gpu * m) < (i + 1) * gpu_jobs and placed_gpu < gpu_jobs:
            jobs.append(cuda_job(job_id))
            placed_gpu += 1
        else:
            jobs.append(cpu_job(job_id))
    return jobs


def encoded(items: list[JobRequest]) -> list[tuple[str, bytes]]:
    return [(j.job_id, encode(j)) for j in items]
