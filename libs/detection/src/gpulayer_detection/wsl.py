"""WSL2: whether the probe runs in it, and DirectML through its GPU paravirtualization.

Microsoft's layout (the DirectX blog post "DirectX ❤ Linux", WSL's GPU compute docs):

- ``/dev/dxg``: the character device of ``dxgkrnl``, through which Linux reaches the GPU driver
  on Windows;
- ``/usr/lib/wsl/lib``: the D3D12 and DXCore libraries (``libd3d12.so``, ``libd3d12core.so``,
  ``libdxcore.so``) and, where the NVIDIA driver provides them, its WSL libraries
  (``libcuda.so*``, ``libnvidia-ml.so.1``, ``nvidia-smi``);
- ``/usr/lib/wsl/drivers``: the driver store, one folder per driver package
  (``<inf>.inf_amd64_<hash>``) holding the vendor's Linux user-mode driver (NVIDIA's
  ``libnvwgf2umx.so``, AMD's ``amdxc64.so``, Intel's ``libigd12umd64.so``).

DirectML counts on the host when all three hold: ``/dev/dxg`` is a character device, both
libraries are there, and a driver package holds a shared library (a hardware adapter's driver).
Without a vendor driver there is only the software adapter (Microsoft Basic Render Driver), which
is no GPU. Containers get what the executor passes a container job granted a GPU here:
``--device /dev/dxg`` and ``/usr/lib/wsl`` read-only, so directml where the host has it, and
cuda where ``libcuda`` is in ``/usr/lib/wsl/lib``.

Everything is read under the host root (``ProbeContext.host_root``); a damaged or partial layout
is a note, never an exception.
"""

from __future__ import annotations

import asyncio
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from gpulayer_contracts.bounds import MAX_NOTE_BYTES
from gpulayer_detection.base import Finding, ProbeContext, under_root

__all__ = [
    "DRIVERS_DIR",
    "DXG",
    "LIB_DIR",
    "WSL_DIR",
    "DirectmlVerdict",
    "DriverPackage",
    "WslLayout",
    "WslProbe",
    "is_wsl1",
    "is_wsl2",
    "judge",
    "kernel_is_wsl2",
    "read_kernel",
    "read_layout",
]

WSL_DIR: Final = "/usr/lib/wsl"
LIB_DIR: Final = "/usr/lib/wsl/lib"
DRIVERS_DIR: Final = "/usr/lib/wsl/drivers"
DXG: Final = "/dev/dxg"
D3D12_LIBS: Final = ("libd3d12.so", "libdxcore.so")
# User-mode drivers by the file their vendor ships; any other shared library in a package still
# counts as a driver, its vendor unnamed.
KNOWN_UMDS: Final = {"libnvwgf2umx.so": "NVIDIA", "amdxc64.so": "AMD", "libigd12umd64.so": "Intel"}
KERNEL_FILES: Final = ("/proc/sys/kernel/osrelease", "/proc/version")
_WSL2_MARK: Final = "microsoft-standard-wsl2"
_PACKAGE = re.compile(r"^.+\.inf_(?:amd64|arm64)_[0-9a-f]+$", re.I)
# Bounds on what is read: a driver store is a few folders; a damaged one must not be walked whole.
MAX_PACKAGES: Final = 64
MAX_LIBRARIES: Final = 32
_MAX_ENTRIES: Final = 4096
_SHOWN: Final = 3


def fit(text: str, most: int = MAX_NOTE_BYTES) -> str:
    """``text`` as a report may carry it: at most ``most`` UTF-8 bytes, a file name's
    undecodable bytes (surrogates) replaced. A driver store's folder names are the host's."""
    data = text.encode("utf-8", "replace")
    if len(data) <= most:
        return data.decode("utf-8", "replace")
    return data[: most - 3].decode("utf-8", "ignore") + "..."


def is_wsl2(*texts: str) -> bool:
    """Does the kernel release or ``/proc/version`` name ``microsoft-standard-WSL2``?"""
    return any(_WSL2_MARK in t.lower() for t in texts)


def is_wsl1(*texts: str) -> bool:
    """WSL1's kernel (``4.4.0-19041-Microsoft``): no GPU reaches it."""
    return not is_wsl2(*texts) and any("microsoft" in t.lower() for t in texts)


def _read_text(path: str, most: int = 4096) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(most)
    except OSError:
        return ""


def read_kernel(root: str) -> tuple[str, ...]:
    """The kernel release and ``/proc/version`` under ``root`` ("" for what can't be read)."""
    return tuple(_read_text(under_root(root, p)).strip() for p in KERNEL_FILES)


def kernel_is_wsl2(root: str) -> bool:
    return is_wsl2(*read_kernel(root))


@dataclass(frozen=True, slots=True)
class DriverPackage:
    """One driver store folder and the shared libraries in it (relative paths)."""

    name: str
    libraries: tuple[str, ...]

    @property
    def vendor(self) -> str | None:
        for lib in self.libraries:
            vendor = KNOWN_UMDS.get(os.path.basename(lib))
            if vendor is not None:
                return vendor
        return None

    def describe(self) -> str:
        umd = next((x for x in self.libraries if os.path.basename(x) in KNOWN_UMDS), None)
        if umd is not None:
            return f"{self.name} ({self.vendor}: {os.path.basename(umd)})"
        return f"{self.name} ({len(self.libraries)} librar{'y' if len(self.libraries) == 1 else 'ies'})"


@dataclass(frozen=True, slots=True)
class WslLayout:
    """What the WSL paths under a root hold. ``dxg``: ``device``, ``missing``, or what the path
    is instead (``a regular file``)."""

    dxg: str = "missing"
    lib_dir: bool = False
    libs: tuple[str, ...] = ()
    store: bool = False
    packages: tuple[DriverPackage, ...] = ()

    @property
    def hardware(self) -> tuple[DriverPackage, ...]:
        return tuple(p for p in self.packages if p.libraries)

    @property
    def present(self) -> bool:
        return self.dxg != "missing" or self.lib_dir or self.store


def _kind(mode: int) -> str:
    if stat.S_ISCHR(mode):
        return "device"
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISREG(mode):
        return "a regular file"
    if stat.S_ISBLK(mode):
        return "a block device"
    return "not a file kind a device has"


def dxg_kind(path: str) -> str:
    """``device`` for a character device (links followed), ``missing``, or what it is."""
    try:
        return _kind(os.stat(path).st_mode)
    except FileNotFoundError:
        return "missing" if not os.path.islink(path) else "a dangling link"
    except OSError as err:
        return f"unreadable ({err.strerror or err})"


def _libraries(folder: str) -> tuple[str, ...]:
    """Shared libraries in a driver package, to two levels (AMD's sit in a subfolder)."""
    found: list[str] = []
    seen = 0
    for top, dirs, files in os.walk(folder):
        depth = os.path.relpath(top, folder).count(os.sep) + (top != folder)
        if depth >= 1:
            dirs[:] = []  # AMD's B0<nnnnnn>/amdxc64.so is as deep as drivers go
        dirs.sort()
        for name in sorted(files):
            seen += 1
            if seen > _MAX_ENTRIES or len(found) >= MAX_LIBRARIES:
                return tuple(found)
            if name.endswith(".so") or ".so." in name:
                found.append(os.path.relpath(os.path.join(top, name), folder))
    return tuple(found)


def _packages(store: str) -> tuple[DriverPackage, ...]:
    try:
        names = sorted(os.listdir(store))[:_MAX_ENTRIES]
    except OSError:
        return ()
    out = []
    for name in names:
        path = os.path.join(store, name)
        if _PACKAGE.match(name) and os.path.isdir(path):
            out.append(DriverPackage(name, _libraries(path)))
            if len(out) >= MAX_PACKAGES:
                break
    return tuple(out)


def read_layout(root: str, kind_of: Callable[[str], str] = dxg_kind) -> WslLayout:
    """The WSL layout under ``root``. Never raises: what can't be read is absent.
    ``kind_of``: how ``/dev/dxg`` is judged (tests hand one in where mknod needs root)."""
    lib = under_root(root, LIB_DIR)
    store = under_root(root, DRIVERS_DIR)
    try:
        libs = tuple(sorted(os.listdir(lib))[:_MAX_ENTRIES])
        lib_dir = True
    except OSError:
        libs, lib_dir = (), False
    return WslLayout(
        dxg=kind_of(under_root(root, DXG)),
        lib_dir=lib_dir,
        libs=libs,
        store=os.path.isdir(store),
        packages=_packages(store),
    )


@dataclass(slots=True)
class DirectmlVerdict:
    """``host``: directml's evidence when it counts; ``evidence``: why not, otherwise."""

    host: str | None = None
    evidence: str = ""
    containers: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _shown(items: list[str]) -> str:
    more = len(items) - _SHOWN
    return ", ".join(items[:_SHOWN]) + (f" and {more} more" if more > 0 else "")


def _problems(layout: WslLayout) -> list[str]:
    problems = []
    if layout.dxg == "missing":
        problems.append(
            f"no {DXG}: the GPU is not shared with this Linux (WSL 2 and a Windows GPU driver "
            "with WSL support give it)"
        )
    elif layout.dxg != "device":
        problems.append(f"{DXG} is {layout.dxg}, not a character device")
    missing = [lib for lib in D3D12_LIBS if lib not in layout.libs]
    if missing:
        where = LIB_DIR if layout.lib_dir else f"{LIB_DIR} (missing)"
        problems.append(f"{where} lacks {', '.join(missing)}")
    if not layout.hardware:
        if layout.packages:
            empty = _shown([p.name for p in layout.packages])
            why = f"the driver store's {empty} hold no driver library"
        elif layout.store:
            why = f"the driver store {DRIVERS_DIR} is empty"
        else:
            why = f"no driver store ({DRIVERS_DIR})"
        problems.append(
            f"only the software adapter (Microsoft Basic Render Driver): {why}, "
            "so no hardware adapter's user-mode driver"
        )
    return problems


def judge(layout: WslLayout, wsl2: bool) -> DirectmlVerdict:
    """directml on the host and in containers from the layout. Pure."""
    verdict = DirectmlVerdict()
    if layout.dxg == "device" and any(lib.startswith("libcuda.so") for lib in layout.libs):
        verdict.containers["cuda"] = (
            f"libcuda in {LIB_DIR} (the NVIDIA driver's WSL library): a container job granted "
            f"a GPU gets {DXG} and {WSL_DIR} read-only"
        )
    if not wsl2 and not layout.present:
        verdict.evidence = (
            f"not available: no {DXG} (DirectML reaches Linux only through WSL2's GPU "
            "paravirtualization)"
        )
        return verdict
    problems = _problems(layout)
    if problems:
        verdict.evidence = f"not counted: {'; '.join(problems)}"
        verdict.notes.append(f"directml not counted: {'; '.join(problems)}")
        return verdict
    drivers = _shown([p.describe() for p in layout.hardware])
    verdict.host = (
        f"{DXG} (character device); {LIB_DIR}: {', '.join(D3D12_LIBS)}; driver store: {drivers}"
    )
    verdict.containers["directml"] = (
        f"{DXG} and {WSL_DIR} as on the host: a container job granted a GPU gets "
        f"--device {DXG} and {WSL_DIR} read-only"
    )
    return verdict


class WslProbe:
    """WSL2 and DirectML: the layout of ``/dev/dxg`` and ``/usr/lib/wsl`` under the host root."""

    name = "wsl"

    def __init__(self, kind_of: Callable[[str], str] = dxg_kind) -> None:
        self._kind_of = kind_of

    async def probe(self, ctx: ProbeContext) -> Finding:
        found = Finding(self.name)
        if ctx.system == "windows":
            found.evidence["directml"] = (
                "unknown: a native Windows probe is not implemented (run the probe in WSL2)"
            )
            found.note("directml unknown: a native Windows probe is not implemented")
            return found
        if ctx.system != "linux":
            found.evidence["directml"] = "not available: DirectML exists on Windows and WSL2 only"
            return found
        kernel = await asyncio.to_thread(read_kernel, ctx.host_root)
        layout = await asyncio.to_thread(read_layout, ctx.host_root, self._kind_of)
        wsl2 = is_wsl2(*kernel)
        if is_wsl1(*kernel):
            found.note(f"WSL1 (kernel {kernel[0] or '?'}): no GPU reaches it; WSL 2 shares it")
        verdict = judge(layout, wsl2)
        if verdict.host is not None:
            found.host_apis["directml"] = fit(verdict.host)
        else:
            found.evidence["directml"] = fit(verdict.evidence)
        found.container_apis.update({k: fit(v) for k, v in verdict.containers.items()})
        found.notes.extend(fit(f"{self.name}: {n}") for n in verdict.notes)
        return found
