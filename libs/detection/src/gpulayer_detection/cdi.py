"""The devices a node's CDI specs name (Container Device Interface, the spec podman, containerd
and CRI-O read to hand a device to a container): ``nvidia.com/gpu=0`` and the device nodes it
brings. The probe reports them; the executor turns a granted device into its CDI name.

A spec is YAML or JSON (JSON is YAML), read with PyYAML's safe loader. A spec that can't be read
or has no ``kind`` is a note, never an exception: one bad file in ``/etc/cdi`` must not hide
the others.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import yaml

__all__ = [
    "CDI_DIRS",
    "MAX_CDI_SPEC_BYTES",
    "CdiDevice",
    "CdiError",
    "device_for",
    "parse_cdi_devices",
    "read_cdi_devices",
]

# Where podman and the NVIDIA Container Toolkit look (the CDI spec's own defaults).
CDI_DIRS: Final = ("/etc/cdi", "/var/run/cdi")
# A spec lists every device with its mounts and hooks; NVIDIA's for 8 GPUs is ~30 KiB. Larger is
# not a spec.
MAX_CDI_SPEC_BYTES: Final = 1 << 20
MAX_CDI_DEVICES: Final = 4096
# vendor.com/class, as the CDI spec has it; a device name is letters, digits, "_", "-", ".", ":".
_KIND = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")


class CdiError(ValueError):
    """A CDI spec that can't be used, naming the file and what is wrong."""


@dataclass(frozen=True, slots=True)
class CdiDevice:
    kind: str  # nvidia.com/gpu
    name: str  # 0, a UUID, or "all"
    device_nodes: tuple[str, ...]  # the device's own nodes (a spec's common ones not included)
    spec: str  # the file it came from

    @property
    def qualified(self) -> str:
        """What ``podman run --device`` takes: ``nvidia.com/gpu=0``."""
        return f"{self.kind}={self.name}"


def _node_paths(edits: Any) -> tuple[str, ...]:
    if not isinstance(edits, dict):
        return ()
    nodes = edits.get("deviceNodes")
    if not isinstance(nodes, list):
        return ()
    paths = (n.get("path") for n in nodes if isinstance(n, dict))
    return tuple(p for p in paths if isinstance(p, str) and p.startswith("/"))


def parse_cdi_devices(text: str, path: str = "<spec>") -> list[CdiDevice]:
    """The devices one spec names. Raises CdiError naming ``path`` and what is wrong."""
    if len(text) > MAX_CDI_SPEC_BYTES:
        raise CdiError(f"{path}: over {MAX_CDI_SPEC_BYTES} bytes, not read as a CDI spec")
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise CdiError(f"{path}: not YAML or JSON: {str(err).splitlines()[0]}") from err
    if not isinstance(doc, dict):
        raise CdiError(f"{path}: not a CDI spec (no mapping at the top)")
    kind = doc.get("kind")
    if not isinstance(kind, str) or not _KIND.match(kind):
        raise CdiError(f"{path}: kind {kind!r} is not vendor/class (e.g. nvidia.com/gpu)")
    entries = doc.get("devices")
    if not isinstance(entries, list):
        raise CdiError(f"{path}: no devices list")
    devices = []
    for entry in entries[:MAX_CDI_DEVICES]:
        name = entry.get("name") if isinstance(entry, dict) else None
        if isinstance(name, str) and _NAME.match(name):
            nodes = _node_paths(entry.get("containerEdits"))
            devices.append(CdiDevice(kind, name, nodes, path))
    return devices


def _spec_files(dirs: Iterable[str]) -> list[str]:
    files: list[str] = []
    for d in dirs:
        files += sorted(
            p for p in glob.glob(os.path.join(d, "*")) if p.endswith((".yaml", ".yml", ".json"))
        )
    return files


def read_cdi_devices(dirs: Iterable[str] = CDI_DIRS) -> tuple[list[CdiDevice], list[str]]:
    """Every device the specs in ``dirs`` name, and a note for each spec that can't be used."""
    devices: list[CdiDevice] = []
    notes: list[str] = []
    for path in _spec_files(dirs):
        text = None
        with contextlib.suppress(OSError), open(path, encoding="utf-8", errors="replace") as f:
            text = f.read(MAX_CDI_SPEC_BYTES + 1)
        if text is None:
            notes.append(f"{path}: cannot be read")
            continue
        try:
            devices += parse_cdi_devices(text, path)
        except CdiError as err:
            notes.append(str(err))
    return devices, notes


def device_for(
    devices: Sequence[CdiDevice], index: int, uuid: str | None = None, kind: str | None = None
) -> CdiDevice | None:
    """The CDI device for a granted device: by its UUID when the spec names it so, else by its
    index. ``kind`` narrows to one vendor's spec (``nvidia.com/gpu``)."""
    candidates = [d for d in devices if kind is None or d.kind == kind]
    if uuid:
        for d in candidates:
            if d.name == uuid:
                return d
    for d in candidates:
        if d.name == str(index):
            return d
    return None
