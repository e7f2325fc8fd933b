"""Apple GPUs: a Metal GPU is accelerator ``mps``, whether or not a framework is installed.

``system_profiler`` is asked rather than PyTorch so that the answer does not depend on what the
workload interpreter has installed. An Apple Silicon GPU has no memory of its own: it shares
system RAM, so its memory is reported as ``unified`` system RAM and never as VRAM.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from gpulayer_contracts.capabilities import AcceleratorDevice
from gpulayer_contracts.jobs import MemoryKind
from gpulayer_detection.base import Finding, ProbeContext

PROFILER_ARGV = ["system_profiler", "-json", "SPDisplaysDataType"]
MEMSIZE_ARGV = ["sysctl", "-n", "hw.memsize"]
_METAL_KEYS = ("spdisplays_mtlgpufamilysupport", "spdisplays_metal", "spdisplays_metalfamily")
_VRAM = re.compile(r"^(?P<n>\d+)\s*(?P<unit>MB|GB)$")


class SystemProfilerParseError(ValueError):
    pass


def _vendor(raw: Any) -> str | None:
    # "sppci_vendor_Apple" -> "Apple"; "Intel" -> "Intel"
    if not isinstance(raw, str) or not raw:
        return None
    return raw.removeprefix("sppci_vendor_").split(" (", 1)[0] or None


def _vram_mib(raw: Any) -> int | None:
    m = _VRAM.match(raw.strip()) if isinstance(raw, str) else None
    if not m:
        return None
    return int(m["n"]) * (1024 if m["unit"] == "GB" else 1)


def parse_system_profiler(stdout: str, memory_bytes: int | None) -> list[AcceleratorDevice]:
    """Metal GPUs from ``system_profiler -json SPDisplaysDataType``.

    A GPU without dedicated VRAM (no ``spdisplays_vram``) shares system RAM: its memory is
    ``memory_bytes`` (the host's RAM) with memory_kind ``unified``.
    """
    try:
        data = json.loads(stdout)
    except json.JSONDecodeError as err:
        raise SystemProfilerParseError(f"system_profiler output is not JSON: {err}") from None
    items = data.get("SPDisplaysDataType") if isinstance(data, dict) else None
    if not isinstance(items, list):
        raise SystemProfilerParseError("no SPDisplaysDataType list in system_profiler output")
    devices: list[AcceleratorDevice] = []
    for item in items:
        if not isinstance(item, dict):
            continue
        name = item.get("sppci_model") or item.get("_name")
        metal = next((item[k] for k in _METAL_KEYS if item.get(k)), None)
        notes: list[str] = []
        if metal is None:
            continue  # not a Metal device: nothing MPS could run on
        vram = _vram_mib(item.get("spdisplays_vram"))
        memory_mib: int | None = vram
        kind: MemoryKind = "dedicated"
        if vram is None:
            # No VRAM of its own: the GPU shares system RAM.
            kind = "unified"
            memory_mib = None if memory_bytes is None else memory_bytes // (1024 * 1024)
            notes.append(
                "unified memory: shares system RAM with the CPU; not VRAM"
                if memory_mib is not None
                else "memory unknown: system RAM could not be read"
            )
        devices.append(
            AcceleratorDevice(
                accelerator="mps",
                index=len(devices),
                vendor=_vendor(item.get("spdisplays_vendor")),
                name=str(name) if name else None,
                memory_mib=memory_mib,
                memory_kind=kind,
                execution_supported=True,
                notes=[*notes, f"Metal support: {str(metal).removeprefix('spdisplays_')}"],
            )
        )
    return devices


class AppleProbe:
    name = "apple"

    async def probe(self, ctx: ProbeContext) -> Finding:
        found = Finding(self.name)
        if ctx.system != "darwin":
            found.note(f"no Metal GPU: not a macOS host ({ctx.system})")
            found.evidence["metal"] = f"not available: Metal exists only on macOS, not {ctx.system}"
            return found
        profiler, memsize = await asyncio.gather(
            ctx.run(PROFILER_ARGV, ctx.timeout), ctx.run(MEMSIZE_ARGV, ctx.timeout)
        )
        memory_bytes = None
        if memsize.ok and memsize.stdout.strip().isdigit():
            memory_bytes = int(memsize.stdout.strip())
        if not profiler.ok:
            found.note(f"no Metal GPU: system_profiler gave {profiler.describe()}")
            return found
        try:
            devices = parse_system_profiler(profiler.stdout, memory_bytes)
        except SystemProfilerParseError as err:
            found.note(f"no Metal GPU: {err}")
            return found
        if not devices:
            found.note("no Metal GPU: system_profiler lists no GPU with Metal support")
            return found
        found.accelerators = devices
        found.host_apis["metal"] = "system_profiler: " + ", ".join(
            f"{d.name or 'GPU'} (Metal)" for d in devices
        )
        return found
