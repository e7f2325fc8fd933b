"""A Mac's containers: podman runs them in a Linux VM, its machine, and what GPU they reach
depends on the machine's provider.

``podman machine inspect`` names no provider as such; its configuration folder does: podman
keeps each machine's configuration in ``.../containers/podman/machine/<provider>``
(``ConfigDir`` in podman 5, the ``ConfigPath`` file inside it in podman 4).

- ``libkrun`` (krunkit): the machine's GPU is virtio-gpu with Venus, so containers get
  **vulkan** on the Mac's GPU, given an image with Mesa's Venus driver.
- ``applehv`` (vfkit) and ``qemu``: no GPU reaches the machine, so containers get none.

Metal never reaches a Linux container, whatever the provider.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import msgspec

__all__ = [
    "INSPECT_ARGV",
    "MachineInfo",
    "machine_container_apis",
    "parse_machine_inspect",
    "provider_from_path",
]

INSPECT_ARGV: Final = ("machine", "inspect")
# Providers podman names (its VMType strings); krunkit is libkrun's own name for its VMM.
GPU_PROVIDERS: Final = frozenset({"libkrun", "krunkit"})
NO_GPU_PROVIDERS: Final = frozenset({"applehv", "vfkit", "qemu"})
_KNOWN: Final = GPU_PROVIDERS | NO_GPU_PROVIDERS | {"wsl", "hyperv"}
_MAX_PROVIDER: Final = 32
_MAX_NAME: Final = 128  # podman's default is podman-machine-default; a name is the user's


class MachineInspectError(ValueError):
    """Output that is not ``podman machine inspect``'s JSON."""


@dataclass(frozen=True, slots=True)
class MachineInfo:
    name: str | None
    provider: str | None
    state: str | None


def provider_from_path(path: str, *, is_file: bool) -> str | None:
    """The provider folder in a machine's configuration path: the folder itself (``ConfigDir``)
    or the one holding the file (``ConfigPath``); None when it names no provider podman has."""
    parts = [p for p in path.replace("\\", "/").split("/") if p]
    if is_file:
        parts = parts[:-1]
    if len(parts) < 2 or parts[-2] != "machine":
        return None
    name = parts[-1].lower()
    return name if name in _KNOWN else None


def _text(doc: dict[str, Any], key: str) -> str | None:
    value = doc.get(key)
    return value if isinstance(value, str) and value.strip() else None


def _path(doc: dict[str, Any], key: str) -> str | None:
    entry = doc.get(key)
    value = entry.get("Path") if isinstance(entry, dict) else None
    return value if isinstance(value, str) else None


def parse_machine_inspect(stdout: str) -> MachineInfo:
    """The first machine ``podman machine inspect`` describes (a JSON list). Its provider from a
    ``VMType`` field where one is given, else from its configuration path. Raises
    MachineInspectError for anything that is not such a list."""
    try:
        doc = msgspec.json.decode(stdout.strip() or "null")
    except msgspec.DecodeError as err:
        raise MachineInspectError(f"not JSON: {err}") from None
    if not isinstance(doc, list) or not doc or not isinstance(doc[0], dict):
        raise MachineInspectError("not a list of machines")
    first: dict[str, Any] = doc[0]
    provider = _text(first, "VMType")
    if provider is not None:
        provider = provider.strip().lower()[:_MAX_PROVIDER]
    else:
        config_dir = _path(first, "ConfigDir")
        config_file = _path(first, "ConfigPath")
        if config_dir is not None:
            provider = provider_from_path(config_dir, is_file=False)
        elif config_file is not None:
            provider = provider_from_path(config_file, is_file=True)
    name = _text(first, "Name")
    return MachineInfo(name and name[:_MAX_NAME], provider, _text(first, "State"))


def machine_container_apis(info: MachineInfo) -> tuple[dict[str, str], str | None]:
    """The GPU APIs the machine's containers get, with evidence, and a note when none. Pure."""
    name = info.name or "the podman machine"
    provider = info.provider
    if provider in GPU_PROVIDERS:
        return {
            "vulkan": (
                f"podman machine {name}: provider {provider} (krunkit) gives containers the "
                "Mac's GPU through virtio-gpu Venus; the image needs Mesa's Venus Vulkan driver"
            )
        }, None
    if provider in NO_GPU_PROVIDERS:
        return {}, (
            f"no container GPU APIs: podman machine {name} runs on {provider}, which gives its "
            "containers no GPU (a libkrun machine does: podman machine init --provider libkrun)"
        )
    if provider is None:
        return {}, f"no container GPU APIs: podman machine {name}: provider unknown"
    return {}, f"no container GPU APIs: podman machine {name} runs on {provider}, not a Mac's"
