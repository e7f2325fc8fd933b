"""nvidia-smi parsing and the NVIDIA probe, on recorded output (no subprocess)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from gpulayer_detection.base import ProbeContext
from gpulayer_detection.nvidia import (
    QUERY_FIELDS,
    NvidiaProbe,
    NvidiaSmiParseError,
    describe_failure,
    parse_cuda_version,
    parse_nvidia_smi,
)
from gpulayer_detection.runner import Runner, RunResult

RECORDINGS = Path(__file__).resolve().parents[2] / "fixtures" / "nvidia-smi"


def recording(scenario: str, name: str) -> str:
    return (RECORDINGS / scenario / name).read_text()


# (scenario, [(name, memory_mib, compute_capability, execution_supported, mig_mode)], driver, cuda)
EXPECTED = [
    (
        "h100-dgx-8x",
        [("NVIDIA H100 80GB HBM3", 81559, "9.0", True, "Disabled")] * 8,
        "535.129.03",
        "12.2",
    ),
    # Captured on a real H200 (the others are rebuilt from public reports).
    ("h200-1x", [("NVIDIA H200", 143771, "9.0", True, "Disabled")], "580.159.04", "13.0"),
    (
        "a100-sxm4-80gb-mig",
        [
            ("NVIDIA A100-SXM4-80GB", 81920, "8.0", True, "Disabled"),
            ("NVIDIA A100-SXM4-80GB", 81920, "8.0", False, "Enabled"),
        ],
        "535.216.01",
        "12.2",
    ),
    (
        "a100-pcie-40gb",
        [("NVIDIA A100-PCIE-40GB", 40960, "8.0", True, "Disabled")],
        "525.85.12",
        "12.0",
    ),
    ("rtx-4090", [("NVIDIA GeForce RTX 4090", 24564, "8.9", True, None)], "550.54.15", "12.4"),
    (
        "mixed-4090-3090-a6000",
        [
            ("NVIDIA GeForce RTX 4090", 24564, "8.9", True, None),
            ("NVIDIA GeForce RTX 3090", 24576, "8.6", True, None),
            ("NVIDIA RTX A6000", 49140, "8.6", True, None),
        ],
        "550.54.15",
        "12.4",
    ),
]


@pytest.mark.parametrize(("scenario", "devices", "driver", "cuda"), EXPECTED)
def test_each_device_stands_on_its_own(
    scenario: str, devices: list[tuple[str, int, str, bool, str | None]], driver: str, cuda: str
) -> None:
    assert parse_cuda_version(recording(scenario, "smi.txt")) == cuda
    parsed = parse_nvidia_smi(recording(scenario, "query.txt"), cuda_driver_version=cuda)
    got = [
        (d.name, d.memory_mib, d.compute_capability, d.execution_supported, d.mig_mode)
        for d in parsed
    ]
    assert got == devices
    assert [d.index for d in parsed] == list(range(len(devices)))
    for d in parsed:
        assert d.accelerator == "cuda"
        assert d.driver_version == driver
        assert d.cuda_driver_version == cuda  # a separate fact from the driver version
        assert d.memory_kind == "dedicated"
        assert d.uuid is not None
        assert d.uuid.startswith("GPU-")
    assert len({d.uuid for d in parsed}) == len(parsed)


def test_mig_enabled_gpu_is_not_offered_whole_and_says_why() -> None:
    parsed = parse_nvidia_smi(recording("a100-sxm4-80gb-mig", "query.txt"))
    assert parsed[0].notes == []
    assert parsed[1].execution_supported is False
    assert any("MIG is enabled" in n for n in parsed[1].notes)


def test_unknown_values_are_none_and_named() -> None:
    a, b = parse_nvidia_smi(recording("unknown-values", "query.txt"), cuda_driver_version="12.2")
    assert a.memory_mib is None
    assert a.memory_kind is None
    assert a.compute_capability is None
    assert any("memory unknown" in n and "[N/A]" in n for n in a.notes)
    assert any("compute capability unknown" in n and "[Not Supported]" in n for n in a.notes)
    assert a.execution_supported is True  # unknown memory is not a broken driver
    assert b.uuid is None
    assert any("uuid unknown" in n for n in b.notes)
    assert b.compute_capability == "6.1"
    assert b.execution_supported is False
    assert any("Prohibited" in n for n in b.notes)


def test_old_driver_without_compute_cap_field() -> None:
    fields = [f for f in QUERY_FIELDS if f != "compute_cap"]
    (t4,) = parse_nvidia_smi(recording("t4-driver-470", "query-without-compute_cap.txt"), fields)
    assert t4.name == "Tesla T4"
    assert t4.memory_mib == 15109
    assert t4.compute_capability is None
    assert any("no compute_cap field" in n for n in t4.notes)
    assert parse_cuda_version(recording("t4-driver-470", "smi.txt")) == "11.4"


def test_noheader_output_maps_columns_in_query_order() -> None:
    text = recording("rtx-4090", "query.txt").splitlines()[1] + "\n"
    (d,) = parse_nvidia_smi(text)
    assert (d.name, d.memory_mib, d.compute_capability) == ("NVIDIA GeForce RTX 4090", 24564, "8.9")


@pytest.mark.parametrize("scenario", ["driver-failure", "no-devices"])
def test_failure_messages_are_not_a_device_table(scenario: str) -> None:
    with pytest.raises(NvidiaSmiParseError):
        parse_nvidia_smi(recording(scenario, "query.txt"))


def test_cuda_version_absent() -> None:
    assert parse_cuda_version(recording("driver-failure", "smi.txt")) is None


def fake_runner(scenario: str, calls: list[Sequence[str]] | None = None) -> Runner:
    """A runner answering like the fake-nvidia-smi script, from memory."""
    folder = RECORDINGS / scenario

    async def run(argv: Sequence[str], timeout: float) -> RunResult:
        assert timeout > 0
        if calls is not None:
            calls.append(list(argv))
        if argv[0] != "nvidia-smi":
            return RunResult(tuple(argv), None, error=f"{argv[0]} not found on PATH")
        joined = " ".join(argv)
        if "--query-gpu=" in joined:
            name = "query" if "compute_cap" in joined else "query-without-compute_cap"
        else:
            name = "smi"
        rc_file = folder / f"{name}.rc"
        rc = int(rc_file.read_text()) if rc_file.exists() else 0
        return RunResult(tuple(argv), rc, (folder / f"{name}.txt").read_text())

    return run


def ctx_for(scenario: str, calls: list[Sequence[str]] | None = None) -> ProbeContext:
    return ProbeContext(
        run=fake_runner(scenario, calls), timeout=5, system="linux", machine="x86_64"
    )


async def test_probe_multi_gpu_reports_cuda_with_evidence() -> None:
    found = await NvidiaProbe().probe(ctx_for("mixed-4090-3090-a6000"))
    assert [d.name for d in found.accelerators] == [
        "NVIDIA GeForce RTX 4090",
        "NVIDIA GeForce RTX 3090",
        "NVIDIA RTX A6000",
    ]
    assert "cuda" in found.host_apis
    assert "3 GPU(s)" in found.host_apis["cuda"]
    assert "550.54.15" in found.host_apis["cuda"]
    assert "CUDA 12.4" in found.host_apis["cuda"]
    assert found.notes == []


async def test_probe_old_driver_retries_without_compute_cap() -> None:
    calls: list[Sequence[str]] = []
    found = await NvidiaProbe().probe(ctx_for("t4-driver-470", calls))
    queries = [c for c in calls if any(a.startswith("--query-gpu=") for a in c)]
    assert len(queries) == 2
    assert "compute_cap" not in queries[1][1]
    (t4,) = found.accelerators
    assert t4.compute_capability is None
    assert t4.execution_supported is True
    assert t4.cuda_driver_version == "11.4"
    assert t4.driver_version == "470.182.03"
    assert any("compute capability unknown" in n for n in found.notes)


@pytest.mark.parametrize(
    ("scenario", "says"),
    [
        ("driver-failure", "couldn't communicate with the NVIDIA driver"),
        ("no-devices", "No devices were found"),
    ],
)
async def test_probe_driver_failure_is_a_note(scenario: str, says: str) -> None:
    found = await NvidiaProbe().probe(ctx_for(scenario))
    assert found.accelerators == []
    assert "cuda" not in found.host_apis
    assert len(found.notes) == 1
    assert says in found.notes[0]
    assert found.notes[0].startswith("nvidia: no NVIDIA devices")


def test_describe_failure_timeout() -> None:
    r = RunResult(("nvidia-smi",), None, error="nvidia-smi timed out after 2s")
    assert describe_failure(r) == "nvidia-smi timed out after 2s"
