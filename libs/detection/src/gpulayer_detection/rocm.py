"""AMD GPUs from ``rocm-smi``: presence only. gpulayer does not schedule ROCm yet, so every
device is reported with execution_supported=false (the support matrix says detection-only)."""

from __future__ import annotations

import json
import re

from gpulayer_contracts.capabilities import AcceleratorDevice
from gpulayer_detection.base import Finding, ProbeContext

ARGV = ["rocm-smi", "--showproductname", "--json"]
_CARD = re.compile(r"^card(?P<index>\d+)$")
_NAME_KEYS = ("Card Series", "Card series", "Device Name", "Card model", "Card Model")


class RocmSmiParseError(ValueError):
    pass


def parse_rocm_smi(stdout: str) -> list[AcceleratorDevice]:
    """Devices from ``rocm-smi --showproductname --json`` (``{"card0": {...}, ...}``)."""
    # rocm-smi may print warnings before the JSON document.
    start = stdout.find("{")
    if start < 0:
        raise RocmSmiParseError("no JSON object in rocm-smi output")
    try:
        data = json.loads(stdout[start:])
    except json.JSONDecodeError as err:
        raise RocmSmiParseError(f"rocm-smi output is not JSON: {err}") from None
    if not isinstance(data, dict):
        raise RocmSmiParseError("rocm-smi JSON is not an object")
    devices = []
    for key, info in data.items():
        m = _CARD.match(key)
        if not m or not isinstance(info, dict):
            continue
        name = next((str(info[k]) for k in _NAME_KEYS if info.get(k)), None)
        notes = ["detection only: gpulayer does not run jobs on ROCm devices yet"]
        notes.append("memory unknown: not queried")
        if name is None:
            notes.append("name unknown: rocm-smi reported no product name")
        devices.append(
            AcceleratorDevice(
                accelerator="rocm",
                index=int(m["index"]),
                vendor="AMD",  # the source is AMD's own tool
                name=name,
                execution_supported=False,
                notes=notes,
            )
        )
    return sorted(devices, key=lambda d: d.index)


class RocmProbe:
    name = "rocm"

    async def probe(self, ctx: ProbeContext) -> Finding:
        found = Finding(self.name)
        result = await ctx.run(ARGV, ctx.timeout)
        if not result.ok:
            found.note(f"no ROCm devices: {result.describe()}")
            found.evidence["rocm"] = f"not available: {result.describe()}"
            return found
        try:
            devices = parse_rocm_smi(result.stdout)
        except RocmSmiParseError as err:
            found.note(f"no ROCm devices: {err}")
            return found
        if not devices:
            found.note("no ROCm devices: rocm-smi listed none")
            return found
        found.accelerators = devices
        found.host_apis["rocm"] = f"rocm-smi lists {len(devices)} GPU(s) (detection only)"
        return found
