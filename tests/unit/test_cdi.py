"""Reading the devices of a node's CDI specs: NVIDIA's generated spec (shape as written by
`nvidia-ctk cdi generate`), JSON, and the bad files a spec folder may hold."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpulayer_detection.cdi import (
    MAX_CDI_SPEC_BYTES,
    CdiError,
    device_for,
    parse_cdi_devices,
    read_cdi_devices,
)

NVIDIA_SPEC = """\
---
cdiVersion: 0.5.0
containerEdits:
  deviceNodes:
  - path: /dev/nvidia-modeset
  - path: /dev/nvidia-uvm
  - path: /dev/nvidiactl
devices:
- containerEdits:
    deviceNodes:
    - path: /dev/nvidia0
  name: "0"
- containerEdits:
    deviceNodes:
    - path: /dev/nvidia0
  name: GPU-4cf8db2d-06c0-7d70-1a51-e59b25b2c16c
- containerEdits:
    deviceNodes:
    - path: /dev/nvidia1
  name: "1"
- containerEdits:
    deviceNodes:
    - path: /dev/nvidia0
    - path: /dev/nvidia1
  name: all
kind: nvidia.com/gpu
"""


def test_an_nvidia_spec_names_each_device_with_its_own_nodes() -> None:
    devices = parse_cdi_devices(NVIDIA_SPEC, "/etc/cdi/nvidia.yaml")
    assert [d.qualified for d in devices] == [
        "nvidia.com/gpu=0",
        "nvidia.com/gpu=GPU-4cf8db2d-06c0-7d70-1a51-e59b25b2c16c",
        "nvidia.com/gpu=1",
        "nvidia.com/gpu=all",
    ]
    assert devices[2].device_nodes == ("/dev/nvidia1",)
    assert devices[0].spec == "/etc/cdi/nvidia.yaml"


def test_a_granted_device_is_found_by_uuid_first_then_by_index() -> None:
    devices = parse_cdi_devices(NVIDIA_SPEC)
    by_uuid = device_for(devices, 0, "GPU-4cf8db2d-06c0-7d70-1a51-e59b25b2c16c")
    assert by_uuid is not None
    assert by_uuid.name.startswith("GPU-")
    by_index = device_for(devices, 1, "GPU-not-in-the-spec")
    assert by_index is not None
    assert by_index.name == "1"
    assert device_for(devices, 7) is None
    assert device_for(devices, 0, kind="amd.com/gpu") is None


def test_json_is_read_as_well() -> None:
    spec = {"cdiVersion": "0.6.0", "kind": "amd.com/gpu", "devices": [{"name": "0"}]}
    assert [d.qualified for d in parse_cdi_devices(json.dumps(spec))] == ["amd.com/gpu=0"]


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("devices: [", "not YAML or JSON"),
        ("- a\n- b\n", "no mapping at the top"),
        ("kind: gpu\ndevices: []\n", "is not vendor/class"),
        ("kind: nvidia.com/gpu\n", "no devices list"),
        ("x" * (MAX_CDI_SPEC_BYTES + 1), "not read as a CDI spec"),
    ],
)
def test_a_spec_that_cant_be_used_is_an_error_naming_the_file(text: str, why: str) -> None:
    with pytest.raises(CdiError, match=why) as err:
        parse_cdi_devices(text, "/etc/cdi/x.yaml")
    assert str(err.value).startswith("/etc/cdi/x.yaml: ")


def test_odd_device_names_and_node_paths_are_left_out() -> None:
    spec = (
        "kind: nvidia.com/gpu\ndevices:\n- name: '-rm'\n- name: ok\n  containerEdits:\n"
        "    deviceNodes: [{path: relative}, {path: /dev/nvidia3}, 7]\n- 5\n"
    )
    devices = parse_cdi_devices(spec)
    assert [(d.name, d.device_nodes) for d in devices] == [("ok", ("/dev/nvidia3",))]


def test_one_bad_file_is_a_note_and_the_others_are_read(tmp_path: Path) -> None:
    (tmp_path / "a-bad.yaml").write_text("devices: [")
    (tmp_path / "b-nvidia.yaml").write_text(NVIDIA_SPEC)
    (tmp_path / "README").write_text("not a spec, not read")
    devices, notes = read_cdi_devices([str(tmp_path), str(tmp_path / "missing")])
    assert len(devices) == 4
    assert len(notes) == 1
    assert notes[0].startswith(f"{tmp_path / 'a-bad.yaml'}: not YAML")
