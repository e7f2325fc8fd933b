"""The one protocol every probe implements, and the partial result each returns.

A probe looks at one source (a tool, a file, an interpreter) and returns a ``Finding``. It never
raises for what it finds on the machine: a missing tool or a broken driver is a note. The
registry merges findings into one ``WorkerCapabilities``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from gpulayer_contracts.capabilities import AcceleratorDevice, ContainerRuntime, HostInfo
from gpulayer_detection.runner import Runner

DEFAULT_CDI_DIRS: tuple[str, ...] = ("/etc/cdi", "/var/run/cdi")


@dataclass(frozen=True, slots=True)
class ProbeContext:
    """Everything a probe may use. Plain values: nothing here reads the environment."""

    run: Runner
    timeout: float
    system: str  # platform.system().lower(): linux / darwin / windows
    machine: str  # platform.machine().lower()
    python: str | None = None  # workload interpreter; None: frameworks are not probed
    cdi_dirs: Sequence[str] = DEFAULT_CDI_DIRS
    dev_dir: str = "/dev"
    advertise_address: str | None = None
    # Where the host's /proc, /sys, /dev and /usr/lib/wsl are read (GPULAYER_PROBE_HOST_ROOT):
    # "/" on the host itself, the host's mount point for a probe in a container. Tools still
    # come from PATH.
    host_root: str = "/"

    def host_path(self, path: str) -> str:
        """``path`` (absolute, as on the host) under ``host_root``."""
        return under_root(self.host_root, path)


def under_root(root: str, path: str) -> str:
    """``/proc/version`` under ``/host`` is ``/host/proc/version``; under ``/`` itself."""
    return os.path.join(root, path.lstrip("/"))


@dataclass(slots=True)
class Finding:
    """What one probe found. Empty fields mean "this source says nothing about it"."""

    source: str
    host: HostInfo | None = None
    advertise_address: str | None = None
    accelerators: list[AcceleratorDevice] = field(default_factory=list)
    # API name -> evidence, for APIs this source proves usable.
    host_apis: dict[str, str] = field(default_factory=dict)
    container_apis: dict[str, str] = field(default_factory=dict)
    # Evidence that proves no API (why vulkan does not count, device-file hints, ...).
    evidence: dict[str, str] = field(default_factory=dict)
    workload_python: str | None = None
    workload_python_version: str | None = None
    frameworks: dict[str, str] = field(default_factory=dict)
    framework_capabilities: list[str] = field(default_factory=list)
    distributed_backends: list[str] = field(default_factory=list)
    launchers: list[str] = field(default_factory=list)
    container_runtime: ContainerRuntime | None = None
    notes: list[str] = field(default_factory=list)

    def note(self, text: str) -> None:
        self.notes.append(f"{self.source}: {text}")


class Probe(Protocol):
    """One detection source."""

    name: str

    async def probe(self, ctx: ProbeContext) -> Finding: ...
