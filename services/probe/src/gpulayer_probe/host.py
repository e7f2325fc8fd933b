"""Host facts: OS, platform, CPU, memory, disk, Python."""

from __future__ import annotations

import platform
import shutil
import socket

import psutil

from gpulayer_contracts.capabilities import HostInfo

_ARCH = {"amd64": "x86_64", "x64": "x86_64", "aarch64": "arm64"}


def platform_tag(system: str, machine: str) -> str:
    """``linux-x86_64``, ``darwin-arm64``, ``windows-amd64``."""
    system = system.lower()
    machine = machine.lower()
    if system == "windows":
        return f"windows-{'amd64' if machine in ('amd64', 'x86_64', 'x64') else machine}"
    return f"{system}-{_ARCH.get(machine, machine)}"


def detect_host(disk_path: str = "/") -> HostInfo:
    system = platform.system()
    machine = platform.machine()
    return HostInfo(
        hostname=socket.gethostname(),
        os=system.lower(),
        os_release=platform.release(),
        platform=platform_tag(system, machine),
        arch=_ARCH.get(machine.lower(), machine.lower()),
        cpu_cores=psutil.cpu_count(logical=True),
        memory_bytes=int(psutil.virtual_memory().total),
        disk_free_bytes=int(shutil.disk_usage(disk_path).free),
        python_version=platform.python_version(),
    )
