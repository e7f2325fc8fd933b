"""Host facts: OS, platform, CPU, memory, disk, Python, advertise address, WSL2."""

from __future__ import annotations

import contextlib
import ipaddress
import platform
import shutil
import socket

import msgspec
import psutil

from gpulayer_contracts.capabilities import HostInfo
from gpulayer_detection.base import Finding, ProbeContext
from gpulayer_detection.wsl import kernel_is_wsl2

_ARCH = {"amd64": "x86_64", "x64": "x86_64", "aarch64": "arm64"}

# A documentation address (RFC 5737): connecting a UDP socket to it sends nothing, but makes the
# kernel pick the interface that carries the default route.
_ROUTE_PROBE = ("192.0.2.1", 9)
LOOPBACK = "127.0.0.1"


def platform_tag(system: str, machine: str) -> str:
    """``linux-x86_64``, ``darwin-arm64``, ``windows-amd64``."""
    system = system.lower()
    machine = machine.lower()
    if system == "windows":
        return f"windows-{'amd64' if machine in ('amd64', 'x86_64', 'x64') else machine}"
    return f"{system}-{_ARCH.get(machine, machine)}"


def detect_host(disk_path: str = "/") -> HostInfo:
    """Host facts that need no subprocess. A fact that can't be read is None. ``disk_path``:
    where free disk is measured (the host root)."""
    system = platform.system()
    machine = platform.machine()
    cores: int | None = None
    memory: int | None = None
    disk: int | None = None
    with contextlib.suppress(Exception):
        cores = psutil.cpu_count(logical=True)
    with contextlib.suppress(Exception):
        memory = int(psutil.virtual_memory().total)
    with contextlib.suppress(OSError):
        disk = int(shutil.disk_usage(disk_path).free)
    return HostInfo(
        hostname=socket.gethostname(),
        os=system.lower(),
        os_release=platform.release(),
        platform=platform_tag(system, machine),
        arch=_ARCH.get(machine.lower(), machine.lower()),
        cpu_cores=cores,
        memory_bytes=memory,
        disk_free_bytes=disk,
        python_version=platform.python_version(),
    )


def usable_address(candidate: str | None) -> str | None:
    """``candidate`` if other machines could reach it (not loopback, link-local or unspecified)."""
    if not candidate:
        return None
    try:
        addr = ipaddress.ip_address(candidate)
    except ValueError:
        return None
    if addr.is_loopback or addr.is_link_local or addr.is_unspecified or addr.is_multicast:
        return None
    return candidate


def route_address() -> str | None:
    """The local address of the default route, or None where there is none (offline)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(_ROUTE_PROBE)
            return str(s.getsockname()[0])
    except OSError:
        return None


class HostProbe:
    name = "host"

    async def probe(self, ctx: ProbeContext) -> Finding:
        found = Finding(self.name, host=detect_host(ctx.host_root))
        host = found.host
        assert host is not None
        if ctx.system == "linux" and kernel_is_wsl2(ctx.host_root):
            host = msgspec.structs.replace(host, wsl2=True)
        for fact in ("cpu_cores", "memory_bytes", "disk_free_bytes"):
            if getattr(host, fact) is None:
                found.note(f"{fact} could not be read; unknown")
        found.advertise_address = ctx.advertise_address or usable_address(route_address())
        if found.advertise_address is None:
            # Rank 0 of a distributed job here still needs an address for its rendezvous: the
            # loopback one serves ranks on this machine only.
            found.advertise_address = LOOPBACK
            found.note(
                "advertise address 127.0.0.1: no default route with a non-loopback address; "
                "other nodes can't reach ranks here (set GPULAYER_ADVERTISE_ADDRESS)"
            )
        found.host = msgspec.structs.replace(host, advertise_address=found.advertise_address)
        return found
