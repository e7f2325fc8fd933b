"""What one job may use, as cgroup limits: computed from its grant and the executor's settings.

Pure, except ``NvidiaNodes``, which reads the device folder (and reads it again only when the
folder changed). The cgroup files these values go to are in ``cgroups``.
"""

from __future__ import annotations

import math
import os
import re
import stat
import time
from decimal import Decimal
from pathlib import Path

import msgspec

from gpulayer_contracts.events import Grant

# The CFS period a job's quota is a share of (the kernel's default period).
CPU_PERIOD_US = 100_000
# The kernel refuses a quota below 1 ms.
MIN_CPU_QUOTA_US = 1_000
# The highest pids.max the kernel takes (PID_MAX_LIMIT on 64-bit).
MAX_PIDS = 1 << 22

_NVIDIA = re.compile(r"nvidia(\d{1,6})")
_SETTLED_NS = 1_000_000_000


class DeviceNode(msgspec.Struct, frozen=True):
    """``/dev/nvidia<index>``, a character device, by its real major:minor."""

    index: int
    major: int
    minor: int


class JobLimits(msgspec.Struct, frozen=True, kw_only=True):
    """One job's limits; None: not limited. ``deny``: character devices (major, minor) the
    job may not open; everything else stays allowed (Slurm's ConstrainDevices does the same)."""

    memory_gb: float | None = None  # as the job asked, for the "out of memory" reason
    memory_bytes: int | None = None
    cpu_quota_us: int | None = None
    pids_max: int | None = None
    deny: tuple[tuple[int, int], ...] = ()


def memory_bytes(gb: float) -> int | None:
    """``memory_gb`` (GB = 10^9 bytes) in bytes, rounded up; None for a value no limit fits
    (placement's bounds refuse those before a grant exists). Decimal, not float: 0.2 GB is
    200000000 bytes, where ``0.2 * 1e9`` would round up to 200000001."""
    if not math.isfinite(gb) or gb <= 0:
        return None
    return max(1, math.ceil(Decimal(repr(gb)) * 10**9))


def cpu_quota_us(cores: float) -> int | None:
    """``cpu_cores`` as a CFS quota of a ``CPU_PERIOD_US`` period (2 cores: 200 ms each 100 ms),
    at least the kernel's 1 ms; None for a value no quota fits."""
    if not math.isfinite(cores) or cores <= 0:
        return None
    return max(MIN_CPU_QUOTA_US, math.ceil(Decimal(repr(cores)) * CPU_PERIOD_US))


def allowed_nvidia(grant: Grant) -> frozenset[int]:
    """The ``/dev/nvidia<N>`` a job may open: its granted CUDA devices when its sandbox grants
    GPU compute, as the visibility variables say (``jobenv.grant_device_env``); none otherwise."""
    if grant.accelerator != "cuda" or grant.job.sandbox.devices.gpu != "compute":
        return frozenset()
    return frozenset(grant.devices)


def job_limits(grant: Grant, *, pids_max: int, nodes: tuple[DeviceNode, ...]) -> JobLimits:
    """The limits of ``grant``'s job: its memory_gb and cpu_cores, ``pids_max`` processes (0:
    no limit), and every ``nodes`` device it was not granted denied."""
    req = grant.job.requirements
    allowed = allowed_nvidia(grant)
    return JobLimits(
        memory_gb=req.memory_gb,
        memory_bytes=memory_bytes(req.memory_gb),
        cpu_quota_us=cpu_quota_us(req.cpu_cores),
        pids_max=min(pids_max, MAX_PIDS) if pids_max > 0 else None,
        deny=tuple((n.major, n.minor) for n in nodes if n.index not in allowed),
    )


def device_writes(limits: JobLimits) -> list[tuple[str, str, str]]:
    """(controller, file, value) for the v1 devices controller, written before the job starts:
    one ``devices.deny`` line per device."""
    return [("devices", "devices.deny", f"c {ma}:{mi} rwm") for ma, mi in limits.deny]


def resource_writes(
    limits: JobLimits, version: str, controllers: frozenset[str], *, memsw: bool = False
) -> list[tuple[str, str, str]]:
    """(controller, file, value) for memory, CPU and pids, for the controllers a hierarchy
    enforces. ``version`` "v1" or "v2"; ``memsw``: v1's memory.memsw.limit_in_bytes exists
    (swap accounting), and gets the same limit so swap doesn't extend it."""
    out: list[tuple[str, str, str]] = []
    if limits.memory_bytes is not None and "memory" in controllers:
        value = str(limits.memory_bytes)
        if version == "v1":
            # memsw may never be below the memory limit: the memory limit goes first.
            out.append(("memory", "memory.limit_in_bytes", value))
            if memsw:
                out.append(("memory", "memory.memsw.limit_in_bytes", value))
        else:
            out += [("memory", "memory.max", value), ("memory", "memory.swap.max", "0")]
    if limits.cpu_quota_us is not None and "cpu" in controllers:
        if version == "v1":
            out.append(("cpu", "cpu.cfs_period_us", str(CPU_PERIOD_US)))
            out.append(("cpu", "cpu.cfs_quota_us", str(limits.cpu_quota_us)))
        else:
            out.append(("cpu", "cpu.max", f"{limits.cpu_quota_us} {CPU_PERIOD_US}"))
    if limits.pids_max is not None and "pids" in controllers:
        out.append(("pids", "pids.max", str(limits.pids_max)))
    return out


def counter(text: str, name: str) -> int | None:
    """The counter ``name`` in a cgroup file of ``name value`` lines (v1 ``memory.oom_control``,
    v2 ``memory.events``); None when the file has none (v1 ``oom_kill`` came in Linux 4.13)."""
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == name and value.strip().isdigit():
            return int(value)
    return None


def oom_reason(limits: JobLimits, cause: str) -> str:
    """The reason of a job the kernel's OOM killer ended: ``cause`` "limit" (it passed its
    memory_gb) or "node" (the whole node ran out of memory while the job was under it)."""
    asked = f"memory_gb = {limits.memory_gb:g} ({limits.memory_bytes} bytes)"
    if cause == "limit":
        return f"out of memory: the job passed its {asked}"
    return f"out of memory: the node ran out of memory (the job was within its {asked})"


def scan_nvidia(entries: list[tuple[str, int, int]]) -> tuple[DeviceNode, ...]:
    """``nvidia<N>`` character devices among (name, st_mode, st_rdev), sorted by N; the control
    nodes (nvidiactl, nvidia-uvm, nvidia-modeset, ...) are not among them and stay allowed."""
    nodes = [
        DeviceNode(int(m.group(1)), os.major(rdev), os.minor(rdev))
        for name, mode, rdev in entries
        if (m := _NVIDIA.fullmatch(name)) and stat.S_ISCHR(mode)
    ]
    return tuple(sorted(nodes, key=lambda n: n.index))


class NvidiaNodes:
    """The ``nvidia<N>`` device nodes of a folder (``GPULAYER_EXECUTOR_DEVICE_DIR``), read
    again only when the folder's mtime changed: one stat per job, and a node the driver creates
    later (nvidia-modprobe makes them on first use) is still seen before the next job."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._mtime: int | None = None
        self._nodes: tuple[DeviceNode, ...] = ()

    def nodes(self) -> tuple[DeviceNode, ...]:
        try:
            mtime = os.stat(self.folder).st_mtime_ns
        except OSError:
            return ()
        if mtime != self._mtime:
            self._nodes = scan_nvidia(self._entries())
            # Timestamps are coarse (a clock tick): a node made in the same tick as this scan
            # leaves the mtime as it is. A folder changed within the last second is read again.
            self._mtime = mtime if time.time_ns() - mtime > _SETTLED_NS else None
        return self._nodes

    def _entries(self) -> list[tuple[str, int, int]]:
        out = []
        try:
            with os.scandir(self.folder) as it:
                for entry in it:
                    if not entry.name.startswith("nvidia"):
                        continue
                    try:
                        st = entry.stat()  # follows a symlink to the real node
                    except OSError:
                        continue
                    out.append((entry.name, st.st_mode, st.st_rdev))
        except OSError:
            return []
        return out
