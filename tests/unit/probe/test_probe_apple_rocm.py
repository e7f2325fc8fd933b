"""Apple (system_profiler) and ROCm (rocm-smi) parsing, on recorded output."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from gpulayer_detection.apple import AppleProbe, SystemProfilerParseError, parse_system_profiler
from gpulayer_detection.base import ProbeContext
from gpulayer_detection.rocm import RocmSmiParseError, parse_rocm_smi
from gpulayer_detection.runner import RunResult

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
GIB = 1024**3


def test_apple_silicon_is_mps_with_unified_system_ram() -> None:
    (gpu,) = parse_system_profiler((FIXTURES / "system_profiler/m2-pro.json").read_text(), 32 * GIB)
    assert gpu.accelerator == "mps"
    assert gpu.name == "Apple M2 Pro"
    assert gpu.vendor == "Apple"
    assert gpu.memory_kind == "unified"
    assert gpu.memory_mib == 32 * 1024  # system RAM, not VRAM
    assert gpu.execution_supported is True
    assert any("not VRAM" in n for n in gpu.notes)


def test_apple_unknown_ram_is_none_and_named() -> None:
    (gpu,) = parse_system_profiler((FIXTURES / "system_profiler/m2-pro.json").read_text(), None)
    assert gpu.memory_mib is None
    assert gpu.memory_kind == "unified"
    assert any("memory unknown" in n for n in gpu.notes)


def test_intel_mac_discrete_gpu_has_its_own_vram() -> None:
    igpu, amd = parse_system_profiler(
        (FIXTURES / "system_profiler/intel-mac-amd.json").read_text(), 16 * GIB
    )
    assert amd.name == "AMD Radeon Pro 5500M"
    assert (amd.memory_kind, amd.memory_mib) == ("dedicated", 4096)
    assert igpu.memory_kind == "unified"
    assert [igpu.index, amd.index] == [0, 1]


def test_system_profiler_garbage() -> None:
    with pytest.raises(SystemProfilerParseError):
        parse_system_profiler("<plist>", 1)


async def test_apple_probe_on_mac_with_recorded_output() -> None:
    async def run(argv: Sequence[str], timeout: float) -> RunResult:
        if argv[0] == "sysctl":
            return RunResult(tuple(argv), 0, f"{16 * GIB}\n")
        return RunResult(tuple(argv), 0, (FIXTURES / "system_profiler/m2-pro.json").read_text())

    ctx = ProbeContext(run=run, timeout=5, system="darwin", machine="arm64")
    found = await AppleProbe().probe(ctx)
    assert [d.memory_mib for d in found.accelerators] == [16 * 1024]
    assert "metal" in found.host_apis


async def test_apple_probe_on_linux_runs_nothing() -> None:
    async def run(argv: Sequence[str], timeout: float) -> RunResult:
        raise AssertionError("no command may run on a non-macOS host")

    found = await AppleProbe().probe(
        ProbeContext(run=run, timeout=5, system="linux", machine="x86_64")
    )
    assert found.accelerators == []
    assert "metal" in found.evidence
    assert found.notes == ["apple: no Metal GPU: not a macOS host (linux)"]


def test_rocm_devices_are_detection_only() -> None:
    devices = parse_rocm_smi((FIXTURES / "rocm-smi/mi210-2x.json").read_text())
    assert [(d.index, d.name, d.accelerator) for d in devices] == [
        (0, "AMD Instinct MI210", "rocm"),
        (1, "AMD Instinct MI210", "rocm"),
    ]
    assert not any(d.execution_supported for d in devices)
    assert all(d.memory_mib is None for d in devices)


def test_rocm_warning_before_json_and_garbage() -> None:
    text = (
        "WARNING: AMD GPU device(s) is/are in a low-power state.\n"
        + (FIXTURES / "rocm-smi/mi210-2x.json").read_text()
    )
    assert len(parse_rocm_smi(text)) == 2
    with pytest.raises(RocmSmiParseError):
        parse_rocm_smi("ERROR: No AMD GPUs specified")
