"""A Mac's containers: the podman machine's provider from ``podman machine inspect``
(tests/fixtures/podman/machine-inspect/, rebuilt in the output format podman's documentation
shows) and the GPU APIs it gives containers: vulkan with libkrun/krunkit, none with applehv or
qemu (a note says which), metal never."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from gpulayer_contracts.bounds import validate_capabilities
from gpulayer_detection.base import Finding, ProbeContext
from gpulayer_detection.containers import ContainerRuntimeProbe, ContainerSettings
from gpulayer_detection.podman_machine import (
    MachineInfo,
    MachineInspectError,
    machine_container_apis,
    parse_machine_inspect,
    provider_from_path,
)
from gpulayer_detection.registry import build_capabilities
from gpulayer_detection.runner import Runner, RunResult

PODMAN = Path(__file__).resolve().parents[2] / "fixtures" / "podman"
INSPECT = PODMAN / "machine-inspect"
FAKE = str(PODMAN / "fake-podman")
LIMITS = ["--ulimit", "nofile=20000:20000"]


@pytest.mark.parametrize(
    ("recording", "provider"),
    [("applehv.json", "applehv"), ("libkrun.json", "libkrun"), ("qemu-podman4.json", "qemu")],
)
def test_the_provider_is_read_from_the_recorded_inspect(recording: str, provider: str) -> None:
    info = parse_machine_inspect((INSPECT / recording).read_text())
    assert info == MachineInfo("podman-machine-default", provider, "running")


def test_a_vmtype_field_wins_and_paths_name_only_known_providers() -> None:
    assert parse_machine_inspect('[{"Name": "m", "VMType": "LibKrun"}]').provider == "libkrun"
    assert provider_from_path("/Users/a/.config/containers/podman/machine/libkrun", is_file=False)
    assert provider_from_path("/Users/a/.config/somewhere/else", is_file=False) is None
    assert provider_from_path("/x/machine/qemu/m.json", is_file=True) == "qemu"
    assert provider_from_path("/x/machine/unknownvm", is_file=False) is None
    assert parse_machine_inspect('[{"Name": "m"}]').provider is None


@pytest.mark.parametrize("junk", ["", "Error: VM does not exist", "{}", "[]", "[1]", "[{"])
def test_anything_else_is_an_error_with_a_reason(junk: str) -> None:
    with pytest.raises(MachineInspectError):
        parse_machine_inspect(junk)


@pytest.mark.parametrize(
    ("provider", "apis", "note"),
    [
        ("libkrun", ["vulkan"], None),
        ("krunkit", ["vulkan"], None),
        ("applehv", [], "runs on applehv, which gives its containers no GPU"),
        ("qemu", [], "runs on qemu, which gives its containers no GPU"),
        (None, [], "provider unknown"),
    ],
)
def test_only_libkrun_gives_containers_a_gpu_and_never_metal(
    provider: str | None, apis: list[str], note: str | None
) -> None:
    given, said = machine_container_apis(MachineInfo("podman-machine-default", provider, None))
    assert sorted(given) == apis
    assert "metal" not in given
    if note is None:
        assert said is None
        assert "Venus" in given["vulkan"]
    else:
        assert said is not None
        assert note in said


def mac_podman(inspect: str, calls: list[list[str]]) -> Runner:
    """podman 5 on a Mac whose ``machine inspect`` answers with the recording ``inspect``
    (JSON on stdout; an error on stderr with its exit status)."""

    async def run(argv: Sequence[str], timeout: float) -> RunResult:
        calls.append(list(argv))
        args = list(argv[1:])
        if args[:1] == ["version"]:
            return RunResult(tuple(argv), 0, '{"Client": {"Version": "5.6.1"}}')
        if args[:2] == ["machine", "inspect"]:
            text = (INSPECT / inspect).read_text()
            rc_file = INSPECT / f"{Path(inspect).stem}.rc"
            if rc_file.exists():
                return RunResult(tuple(argv), int(rc_file.read_text()), "", text)
            return RunResult(tuple(argv), 0, text)
        if "run" in args:
            return RunResult(tuple(argv), 0, "gpulayer-selftest-ok\n")
        raise AssertionError(f"unexpected {argv}")

    return run


async def probe_mac(inspect: str, calls: list[list[str]], system: str = "darwin") -> Finding:
    probe = ContainerRuntimeProbe(
        ContainerSettings(podman=FAKE, oci_runtime="krun"), ulimits=lambda: list(LIMITS)
    )
    run = mac_podman(inspect, calls)
    return await probe.probe(ProbeContext(run=run, timeout=5, system=system, machine="arm64"))


async def test_a_libkrun_machine_gives_containers_vulkan() -> None:
    calls: list[list[str]] = []
    found = await probe_mac("libkrun.json", calls)
    assert found.container_runtime is not None
    assert found.container_runtime.machine_provider == "libkrun"
    assert sorted(found.container_apis) == ["vulkan"]
    assert [FAKE, "machine", "inspect"] in calls
    caps = build_capabilities("mac", [found])
    assert caps.gpu_apis.containers == ["vulkan"]
    assert caps.container_runtime is not None
    assert caps.container_runtime.describe() == "fake-podman 5.6.1/krun (machine: libkrun)"


async def test_an_applehv_machine_gives_none_and_says_which() -> None:
    found = await probe_mac("applehv.json", [])
    assert found.container_runtime is not None
    assert found.container_runtime.machine_provider == "applehv"
    assert found.container_apis == {}
    assert any("runs on applehv" in n for n in found.notes)


async def test_no_machine_is_a_note() -> None:
    found = await probe_mac("no-machine.txt", [])
    assert found.container_runtime is not None
    assert found.container_runtime.machine_provider is None
    assert found.notes == [
        "containers: podman machine unknown: podman machine inspect: exit 125: "
        "Error: podman-machine-default: VM does not exist"
    ]


async def test_on_linux_no_machine_is_asked_for() -> None:
    calls: list[list[str]] = []
    found = await probe_mac("libkrun.json", calls, system="linux")
    assert found.container_apis == {}
    assert not any(c[1:3] == ["machine", "inspect"] for c in calls)


async def test_a_huge_machine_name_keeps_the_report_within_bounds(tmp_path: Path) -> None:
    doc = json.loads((INSPECT / "applehv.json").read_text())
    doc[0]["Name"] = "m\x00" + "x" * 5000
    (tmp_path / "huge.json").write_text(json.dumps(doc))
    probe = ContainerRuntimeProbe(
        ContainerSettings(podman=FAKE, oci_runtime="krun"), ulimits=lambda: list(LIMITS)
    )
    run = mac_podman(str(tmp_path / "huge.json"), [])
    found = await probe.probe(ProbeContext(run=run, timeout=5, system="darwin", machine="arm64"))
    assert any("runs on applehv" in n for n in found.notes)
    assert validate_capabilities(build_capabilities("mac", [found])) == []
