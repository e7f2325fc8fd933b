"""What a job holds of its node besides whole devices: host cores, host RAM, one of the executor's
job slots, and GPU memory on each shared device it gets. Pure; shared by the matcher (what fits)
and the placement service (what it records in PostgreSQL, where a trigger enforces capacity).

Amounts are integers, so that sums are exact in memory and in the database: cores in thousandths
(millicores), RAM in bytes, GPU memory in MiB (the unit devices report).
"""

from __future__ import annotations

import math
from typing import Final

from gpulayer_contracts.jobs import JobRequest

__all__ = [
    "CPU",
    "GPU_MEMORY",
    "MEMORY",
    "SLOTS",
    "gpu_memory_resource",
    "job_memory_bytes",
    "job_millicores",
    "need_mib",
    "reservations",
]

# Resource names as stored in ``reservations.resource`` and ``node_resources.resource``.
CPU: Final = "cpu"  # millicores
MEMORY: Final = "memory"  # bytes
SLOTS: Final = "slots"  # jobs
GPU_MEMORY: Final = "gpu_memory:"  # + device index; MiB

MIB: Final = 1 << 20
GB: Final = 10**9


def job_millicores(job: JobRequest) -> int:
    """``requirements.cpu_cores`` in thousandths of a core, rounded up (at least 1)."""
    return max(1, math.ceil(job.requirements.cpu_cores * 1000))


def job_memory_bytes(job: JobRequest) -> int:
    """``requirements.memory_gb`` in bytes, rounded up (at least 1): the executor's limit."""
    return max(1, math.ceil(job.requirements.memory_gb * GB))


def need_mib(gb: float) -> int:
    """Smallest whole MiB count holding ``gb`` * 10^9 bytes: a device fits when
    ``memory_mib * 2**20 >= gb * 10**9``, decided once here instead of per device."""
    need_bytes = gb * GB
    mib = math.ceil(need_bytes / MIB)
    while mib > 0 and (mib - 1) * MIB >= need_bytes:
        mib -= 1
    while mib * MIB < need_bytes:
        mib += 1
    return mib


def gpu_memory_resource(device: int) -> str:
    return f"{GPU_MEMORY}{device}"


def reservations(job: JobRequest, devices: list[int], use: str) -> list[tuple[str, int]]:
    """(resource, amount) a job placed on ``devices`` with ``use`` holds until it ends: its
    cores, its RAM, a job slot, and, when it shares devices and names ``gpu_memory_gb``, that
    much GPU memory on each of them (an exclusive job holds its devices whole instead)."""
    held = [(CPU, job_millicores(job)), (MEMORY, job_memory_bytes(job)), (SLOTS, 1)]
    gb = job.requirements.gpu_memory_gb
    if use == "shared" and gb is not None:
        mib = need_mib(gb)
        held += [(gpu_memory_resource(d), mib) for d in devices]
    return held
