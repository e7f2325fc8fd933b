"""GPU APIs beyond the vendor tools: Vulkan, OpenCL, container APIs from CDI specs, and device
files this user can't open. (DirectML and WSL2: ``wsl.py``.)

Vulkan and OpenCL count only when their runtime reports a real GPU: llvmpipe, SwiftShader and
PoCL report CPU devices, and a CPU device is no GPU API. The device type the runtime reports
decides, never the device's name.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass

from gpulayer_detection.base import Finding, ProbeContext

VULKAN_ARGV = ["vulkaninfo", "--summary"]
CLINFO_ARGV = ["clinfo"]

_VK_TYPE = re.compile(r"^\s*deviceType\s*=\s*(?:VK_)?PHYSICAL_DEVICE_TYPE_(?P<type>\w+)", re.M)
_VK_GPU_TYPES = frozenset({"DISCRETE_GPU", "INTEGRATED_GPU", "VIRTUAL_GPU"})
_CL_TYPE = re.compile(r"^\s+Device Type\s+(?P<type>.+?)\s*$", re.M)
_CDI_KIND = re.compile(r"""^\s*["']?kind["']?\s*:\s*["']?(?P<kind>[\w.\-/]+)["']?""", re.M)
# A spec that passes WSL2's /dev/dxg and mounts /usr/lib/wsl whole (the D3D12 libraries and the
# driver store with the vendor's user-mode driver) gives containers DirectML.
_CDI_DXG = re.compile(r"""["']?path["']?\s*:\s*["']?/dev/dxg["']?\s*(?:[,}\]]|$)""", re.M)
_CDI_WSL_MOUNT = re.compile(
    r"""["']?hostPath["']?\s*:\s*["']?/usr/lib/wsl/?["']?\s*(?:[,}\]]|$)""", re.M
)


@dataclass(frozen=True, slots=True)
class RuntimeDevices:
    """Device types a Vulkan/OpenCL runtime reports."""

    gpus: int
    others: list[str]


def parse_vulkaninfo_summary(stdout: str) -> RuntimeDevices:
    """Device types from ``vulkaninfo --summary`` (``deviceType = PHYSICAL_DEVICE_TYPE_...``)."""
    types = [m["type"] for m in _VK_TYPE.finditer(stdout)]
    gpus = sum(t in _VK_GPU_TYPES for t in types)
    return RuntimeDevices(gpus, [t for t in types if t not in _VK_GPU_TYPES])


def parse_clinfo(stdout: str) -> RuntimeDevices:
    """Device types from plain ``clinfo`` (``Device Type  GPU``), per platform device.

    The "NULL platform behavior" section at the end repeats devices; it is not counted.
    """
    body = stdout.split("NULL platform behavior", 1)[0]
    types = [m["type"].strip() for m in _CL_TYPE.finditer(body)]
    # A device may report several types ("CPU, Accelerator" is not a GPU; "GPU" is).
    gpus = sum("GPU" in {p.strip() for p in t.split(",")} for t in types)
    return RuntimeDevices(gpus, [t for t in types if "GPU" not in t])


@dataclass(frozen=True, slots=True)
class CdiSpec:
    kind: str | None
    apis: dict[str, str]  # api -> why


def parse_cdi_spec(text: str) -> CdiSpec:
    """Container APIs an injected CDI spec provides (YAML or JSON, read as text).

    An NVIDIA spec (kind ``nvidia.com/gpu``) gives cuda; vulkan when it mounts the Vulkan ICD
    file; opencl when it mounts the NVIDIA OpenCL library. An AMD spec gives rocm. Any spec
    that passes ``/dev/dxg`` and mounts ``/usr/lib/wsl`` whole gives directml (nvidia-ctk's WSL
    spec mounts CUDA's files alone: cuda only). Metal never reaches a container.
    """
    m = _CDI_KIND.search(text)
    kind = m["kind"] if m else None
    apis: dict[str, str] = {}
    if kind is None:
        return CdiSpec(None, apis)
    if _CDI_DXG.search(text) and _CDI_WSL_MOUNT.search(text):
        apis["directml"] = f"CDI kind {kind} passes /dev/dxg and mounts /usr/lib/wsl"
    if kind == "nvidia.com/gpu" or kind.endswith(".nvidia.com/gpu"):
        apis["cuda"] = f"CDI kind {kind}"
        if "nvidia_icd.json" in text:
            apis["vulkan"] = f"CDI kind {kind} mounts the NVIDIA Vulkan ICD (nvidia_icd.json)"
        if "libnvidia-opencl" in text:
            apis["opencl"] = f"CDI kind {kind} mounts libnvidia-opencl"
    elif kind == "amd.com/gpu" or kind.endswith(".amd.com/gpu"):
        apis["rocm"] = f"CDI kind {kind}"
    return CdiSpec(kind, apis)


@dataclass(frozen=True, slots=True)
class DeviceFile:
    path: str
    accessible: bool
    group: str | None


def device_file_hint(files: Iterable[DeviceFile]) -> str | None:
    """Evidence text when GPU device files exist but this user can't open them."""
    blocked = [f for f in files if not f.accessible]
    if not blocked:
        return None
    groups = sorted({f.group for f in blocked if f.group})
    where = ", ".join(f.path for f in blocked)
    hint = f"add this user to the {' / '.join(groups)} group" if groups else "check permissions"
    return f"GPU device files exist but can't be opened by this user: {where} ({hint})"


def _group_name(gid: int) -> str | None:
    try:
        import grp

        return grp.getgrgid(gid).gr_name
    except (ImportError, KeyError):
        return None


def scan_device_files(dev_dir: str) -> list[DeviceFile]:
    patterns = ("nvidiactl", "nvidia[0-9]*", "dri/renderD*", "kfd")
    out = []
    for pattern in patterns:
        for path in sorted(glob.glob(os.path.join(dev_dir, pattern))):
            with contextlib.suppress(OSError):
                st = os.stat(path)
                if not stat.S_ISCHR(st.st_mode):
                    continue
                ok = os.access(path, os.R_OK | os.W_OK)
                out.append(DeviceFile(path, ok, _group_name(st.st_gid)))
    return out


def _read_cdi_specs(dirs: Iterable[str]) -> list[tuple[str, str]]:
    specs = []
    for d in dirs:
        for path in sorted(glob.glob(os.path.join(d, "*"))):
            if not path.endswith((".yaml", ".yml", ".json")):
                continue
            with contextlib.suppress(OSError), open(path, encoding="utf-8", errors="replace") as f:
                specs.append((path, f.read()))
    return specs


class GpuApisProbe:
    """Vulkan and OpenCL runtimes, DirectML, CDI container APIs, device-file permissions."""

    name = "gpu_apis"

    async def probe(self, ctx: ProbeContext) -> Finding:
        found = Finding(self.name)
        vulkan, opencl = await asyncio.gather(
            ctx.run(VULKAN_ARGV, ctx.timeout), ctx.run(CLINFO_ARGV, ctx.timeout)
        )
        self._runtime(
            found,
            "vulkan",
            "vulkaninfo",
            vulkan.ok,
            vulkan.describe(),
            parse_vulkaninfo_summary(vulkan.stdout) if vulkan.ok else None,
        )
        self._runtime(
            found,
            "opencl",
            "clinfo",
            opencl.ok,
            opencl.describe(),
            parse_clinfo(opencl.stdout) if opencl.ok else None,
        )
        for path, text in await asyncio.to_thread(_read_cdi_specs, ctx.cdi_dirs):
            spec = parse_cdi_spec(text)
            for api, why in spec.apis.items():
                found.container_apis.setdefault(api, f"{why} ({path})")
        if not found.container_apis and ctx.system == "linux":
            # A Mac's containers get GPUs from its podman machine (containers.py), not CDI.
            found.note(f"no container GPU APIs: no usable CDI spec in {', '.join(ctx.cdi_dirs)}")
        if ctx.system == "linux":
            hint = device_file_hint(await asyncio.to_thread(scan_device_files, ctx.dev_dir))
            if hint:
                found.evidence["device_files"] = hint
                found.note(hint)
        return found

    @staticmethod
    def _runtime(
        found: Finding, api: str, tool: str, ok: bool, why: str, devices: RuntimeDevices | None
    ) -> None:
        if devices is None:
            found.evidence[api] = f"not available: {why}"
            found.note(f"{api} not available: {why}")
        elif devices.gpus:
            found.host_apis[api] = f"{tool} reports {devices.gpus} GPU device(s)"
        else:
            other = ", ".join(devices.others) or "none"
            found.evidence[api] = f"not counted: {tool} reports no GPU device (devices: {other})"
            found.note(f"{api} not counted: {tool} reports no GPU device (devices: {other})")
