"""Vulkan / OpenCL / CDI / device-file evidence: a CPU device is no GPU API."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest
import yaml

from gpulayer_detection.base import ProbeContext
from gpulayer_detection.gpu_apis import (
    DeviceFile,
    GpuApisProbe,
    device_file_hint,
    parse_cdi_spec,
    parse_clinfo,
    parse_vulkaninfo_summary,
)
from gpulayer_detection.runner import Runner, RunResult

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


def read(rel: str) -> str:
    return (FIXTURES / rel).read_text()


@pytest.mark.parametrize(
    ("recording", "gpus", "others"),
    [
        ("vulkaninfo/nvidia-and-llvmpipe.txt", 1, ["CPU"]),
        ("vulkaninfo/llvmpipe-only.txt", 0, ["CPU"]),
    ],
)
def test_vulkan_counts_gpu_devices_by_type(recording: str, gpus: int, others: list[str]) -> None:
    devices = parse_vulkaninfo_summary(read(recording))
    assert devices.gpus == gpus
    assert devices.others == others


@pytest.mark.parametrize(
    ("recording", "gpus", "others"),
    [
        ("clinfo/nvidia-gpu.txt", 1, []),
        ("clinfo/pocl-cpu-only.txt", 0, ["CPU"]),
        ("clinfo/no-platforms.txt", 0, []),
    ],
)
def test_opencl_counts_gpu_devices_by_type(recording: str, gpus: int, others: list[str]) -> None:
    devices = parse_clinfo(read(recording))
    assert devices.gpus == gpus
    assert devices.others == others


def test_cdi_nvidia_spec_with_graphics_libraries() -> None:
    spec = parse_cdi_spec(read("cdi/nvidia-graphics.yaml"))
    assert spec.kind == "nvidia.com/gpu"
    assert sorted(spec.apis) == ["cuda", "opencl", "vulkan"]
    assert "metal" not in spec.apis


def test_cdi_compute_only_spec_gives_only_cuda() -> None:
    spec = parse_cdi_spec(read("cdi/nvidia-compute-only.json"))
    assert spec.kind == "nvidia.com/gpu"
    assert sorted(spec.apis) == ["cuda"]


def test_cdi_nvidia_wsl_spec_gives_cuda_not_directml() -> None:
    """nvidia-ctk's WSL spec passes /dev/dxg but mounts CUDA's files alone: no D3D12 runtime
    and no user-mode driver, so no DirectML."""
    spec = parse_cdi_spec(read("cdi/wsl/nvidia-wsl.yaml"))
    assert sorted(spec.apis) == ["cuda"]


def test_cdi_spec_passing_dxg_and_the_wsl_folder_gives_directml() -> None:
    spec = parse_cdi_spec(read("cdi/wsl/dxg.yaml"))
    assert spec.apis == {
        "directml": "CDI kind microsoft.com/dxg passes /dev/dxg and mounts /usr/lib/wsl"
    }
    as_json = json.dumps(yaml.safe_load(read("cdi/wsl/dxg.yaml")), indent=2)
    assert sorted(parse_cdi_spec(as_json).apis) == ["directml"]
    # /dev/dxg with only some of /usr/lib/wsl mounted: not the whole folder, no DirectML.
    partial = read("cdi/wsl/dxg.yaml").replace(
        "hostPath: /usr/lib/wsl", "hostPath: /usr/lib/wsl/lib"
    )
    assert parse_cdi_spec(partial).apis == {}


def test_cdi_unknown_kind_gives_nothing() -> None:
    assert parse_cdi_spec("cdiVersion: 0.5.0\nkind: vendor.example/fpga\n").apis == {}
    assert parse_cdi_spec("not a spec").kind is None


def test_device_file_hint_names_files_and_group() -> None:
    assert device_file_hint([DeviceFile("/dev/dri/renderD128", True, "render")]) is None
    hint = device_file_hint(
        [
            DeviceFile("/dev/dri/renderD128", False, "render"),
            DeviceFile("/dev/nvidia0", True, "root"),
        ]
    )
    assert hint is not None
    assert "/dev/dri/renderD128" in hint
    assert "/dev/nvidia0" not in hint
    assert "render group" in hint


def runner_for(outputs: dict[str, str]) -> Runner:
    async def run(argv: Sequence[str], timeout: float) -> RunResult:
        if argv[0] in outputs:
            return RunResult(tuple(argv), 0, outputs[argv[0]])
        return RunResult(tuple(argv), None, error=f"{argv[0]} not found on PATH")

    return run


async def test_probe_host_and_container_apis(tmp_path: Path) -> None:
    cdi = tmp_path / "cdi"
    cdi.mkdir()
    (cdi / "nvidia.yaml").write_text(read("cdi/nvidia-graphics.yaml"))
    (cdi / "notes.txt").write_text("kind: nvidia.com/gpu\n")  # not a spec file: ignored
    ctx = ProbeContext(
        run=runner_for(
            {
                "vulkaninfo": read("vulkaninfo/nvidia-and-llvmpipe.txt"),
                "clinfo": read("clinfo/pocl-cpu-only.txt"),
            }
        ),
        timeout=5,
        system="linux",
        machine="x86_64",
        cdi_dirs=(str(cdi), str(tmp_path / "absent")),
        dev_dir=str(tmp_path / "dev"),
    )
    found = await GpuApisProbe().probe(ctx)
    assert sorted(found.host_apis) == ["vulkan"]
    assert "opencl" not in found.host_apis
    assert "no GPU device" in found.evidence["opencl"]
    assert "CPU" in found.evidence["opencl"]
    assert sorted(found.container_apis) == ["cuda", "opencl", "vulkan"]
    assert str(cdi / "nvidia.yaml") in found.container_apis["cuda"]
    assert "directml" not in found.evidence  # the WSL2 source's (test_probe_wsl.py)


async def test_probe_without_tools_or_specs_says_so(tmp_path: Path) -> None:
    ctx = ProbeContext(
        run=runner_for({}),
        timeout=5,
        system="linux",
        machine="x86_64",
        cdi_dirs=(str(tmp_path),),
        dev_dir=str(tmp_path),
    )
    found = await GpuApisProbe().probe(ctx)
    assert found.host_apis == {}
    assert found.container_apis == {}
    assert "vulkaninfo not found on PATH" in found.evidence["vulkan"]
    assert any("no container GPU APIs" in n for n in found.notes)
