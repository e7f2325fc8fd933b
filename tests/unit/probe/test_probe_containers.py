"""The container runtime probe over podman's recorded answers (tests/fixtures/podman/, recorded
from podman 4.3.1 with runc 1.1.5 on Debian 12): version, OCI runtime, the self-test's verdict
and its cache, the limits it passes, the CDI devices it lists (issue 28)."""

from __future__ import annotations

import resource
import struct
from collections.abc import Sequence
from pathlib import Path

import pytest

from gpulayer_contracts.bounds import MAX_CDI_DEVICES
from gpulayer_detection.base import ProbeContext
from gpulayer_detection.containers import (
    INSTALL_HINT,
    SELFTEST_MARKER,
    ContainerRuntimeProbe,
    ContainerSettings,
    _cdi_names,
    is_static_elf,
    parse_podman_version,
    ulimit_args,
)
from gpulayer_detection.runner import Runner, RunResult

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
PODMAN = FIXTURES / "podman"
FAKE = str(PODMAN / "fake-podman")  # an executable that exists: the probe resolves it
LIMITS = ["--ulimit", "nofile=20000:20000", "--ulimit", "nproc=32768:32768"]


def recorded(scenario: str, name: str) -> RunResult:
    folder = PODMAN / scenario
    rc_file = folder / f"{name.split('.')[0]}.rc"
    rc = int(rc_file.read_text()) if rc_file.exists() else 0
    return RunResult(("podman",), rc, (folder / name).read_text())


def runner(scenario: str, calls: list[list[str]], run_result: RunResult | None = None) -> Runner:
    """Answers as podman did for ``scenario`` (as tests/fixtures/podman/fake-podman would)."""

    async def run(argv: Sequence[str], timeout: float) -> RunResult:
        assert timeout > 0
        calls.append(list(argv))
        args = list(argv[1:])
        if args == ["--version"]:
            return recorded(scenario, "version.txt")
        if args[:1] == ["version"]:
            return recorded(scenario, "version.json")
        if args[:1] == ["info"]:
            return recorded(scenario, "info.txt")
        if "run" in args:
            return run_result or recorded(scenario, "run.txt")
        if "rm" in args:
            return RunResult(tuple(argv), 0)
        raise AssertionError(f"unexpected {argv}")

    return run


def ctx(run: Runner, cdi_dirs: Sequence[str] = ()) -> ProbeContext:
    return ProbeContext(run=run, timeout=5, system="linux", machine="x86_64", cdi_dirs=cdi_dirs)


def probe(**settings: object) -> ContainerRuntimeProbe:
    base: dict[str, object] = {"podman": FAKE, "oci_runtime": "runc"}
    base.update(settings)
    return ContainerRuntimeProbe(ContainerSettings(**base), ulimits=lambda: list(LIMITS))  # type: ignore[arg-type]


def test_version_from_the_recorded_json_and_text() -> None:
    assert parse_podman_version((PODMAN / "works/version.json").read_text()) == "4.3.1"
    assert parse_podman_version((PODMAN / "works/version.txt").read_text()) == "4.3.1"
    assert parse_podman_version('{"Server": {"Version": "5.0.2"}}') == "5.0.2"
    for junk in ("", "{", "[1]", '{"Client": {"Version": 4}}', "Error: cannot connect"):
        assert parse_podman_version(junk) is None


def test_limits_stay_within_the_machines_hard_limits() -> None:
    # This machine's: nofile 20000, nproc 96365, pid_max 32768 (podman caps nproc there).
    assert ulimit_args(20000, 96365, 32768) == LIMITS
    inf = resource.RLIM_INFINITY
    assert ulimit_args(inf, inf, 4194304) == [
        "--ulimit",
        "nofile=1048576:1048576",
        "--ulimit",
        "nproc=4194304:4194304",
    ]
    assert ulimit_args(1024, inf, None) == ["--ulimit", "nofile=1024:1024"]


def _elf(tmp_path: Path, *, interp: bool) -> Path:
    """A 64-bit little-endian ELF header and two program headers (PT_LOAD, then PT_INTERP or
    PT_NOTE)."""
    phoff, phentsize = 64, 56
    header = bytearray(64)
    header[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", header, 32, phoff)
    struct.pack_into("<HH", header, 54, phentsize, 2)
    table = bytearray(2 * phentsize)
    struct.pack_into("<I", table, 0, 1)
    struct.pack_into("<I", table, phentsize, 3 if interp else 4)
    path = tmp_path / ("dynamic" if interp else "static")
    path.write_bytes(bytes(header + table))
    return path


def test_a_static_binary_is_told_from_a_dynamic_one(tmp_path: Path) -> None:
    assert is_static_elf(str(_elf(tmp_path, interp=False)))
    assert not is_static_elf(str(_elf(tmp_path, interp=True)))
    assert not is_static_elf(FAKE)  # a shell script
    assert not is_static_elf(str(tmp_path / "missing"))
    truncated = tmp_path / "truncated"
    truncated.write_bytes(_elf(tmp_path, interp=False).read_bytes()[:80])
    assert not is_static_elf(str(truncated))


async def test_a_working_podman_is_reported_with_its_runtime_and_cdi_devices() -> None:
    calls: list[list[str]] = []
    found = await probe().probe(ctx(runner("works", calls), [str(FIXTURES / "cdi")]))
    rt = found.container_runtime
    assert rt is not None
    assert (rt.name, rt.version, rt.oci_runtime, rt.works) == ("fake-podman", "4.3.1", "runc", True)
    assert rt.notes == []
    # Each name once, in the specs' order.
    assert rt.cdi_devices == [
        "nvidia.com/gpu=0",
        "nvidia.com/gpu=all",
        "nvidia.com/gpu=GPU-3f1e5a52-0c7b-9a0e-2d5c-1b7e6a4f0c11",
    ]
    (run,) = [c for c in calls if "run" in c]
    assert run[:3] == [FAKE, "--runtime", "runc"]
    assert "--rm" in run
    assert "--rootfs" in run
    assert run[7:9] == ["--network", "none"]
    assert all(a in run for a in LIMITS)  # never podman's defaults, which runc can't set here


async def test_the_rlimit_failure_is_a_note_naming_what_failed() -> None:
    found = await probe().probe(ctx(runner("rlimit", [])))
    rt = found.container_runtime
    assert rt is not None
    assert not rt.works
    (note,) = rt.notes
    assert note.startswith("self-test failed (podman run --rootfs with ")
    assert "exit 126" in note
    assert "error setting rlimit type 7" in note


async def test_an_oci_runtime_podman_cant_find_is_a_note(monkeypatch: pytest.MonkeyPatch) -> None:
    # No runc installed: podman's default (crun, recorded missing) is used and asked for.
    monkeypatch.setattr(ContainerRuntimeProbe, "_runc", staticmethod(lambda: None))
    calls: list[list[str]] = []
    found = await probe(oci_runtime=None).probe(ctx(runner("no-oci-runtime", calls)))
    rt = found.container_runtime
    assert rt is not None
    assert not rt.works
    assert rt.oci_runtime is None
    assert rt.notes[0].startswith("OCI runtime unknown: podman info: exit 125")
    assert 'default OCI runtime "crun" not found' in rt.notes[1]
    (run,) = [c for c in calls if "run" in c]
    assert "--runtime" not in run


async def test_a_self_test_that_hangs_is_bounded_and_its_container_removed() -> None:
    calls: list[list[str]] = []
    hung = RunResult(("podman",), None, error="podman timed out after 20s")
    found = await probe().probe(ctx(runner("works", calls, hung)))
    rt = found.container_runtime
    assert rt is not None
    assert not rt.works
    assert "timed out after 20s" in rt.notes[0]
    (run,) = [c for c in calls if "run" in c]
    name = run[run.index("--name") + 1]
    assert [FAKE, "rm", "--force", "--time", "0", name] in calls


async def test_output_without_the_marker_does_not_count() -> None:
    found = await probe().probe(ctx(runner("works", [], RunResult(("p",), 0, "hello\n"))))
    assert found.container_runtime is not None
    assert not found.container_runtime.works


async def test_no_podman_is_no_runtime_and_names_the_install() -> None:
    found = await probe(podman="/nonexistent/podman").probe(ctx(runner("works", [])))
    assert found.container_runtime is None
    (note,) = found.notes
    assert "/nonexistent/podman not found" in note
    assert INSTALL_HINT in note


async def test_told_not_to_look_is_no_runtime() -> None:
    calls: list[list[str]] = []
    found = await probe(podman=None).probe(ctx(runner("works", calls)))
    assert found.container_runtime is None
    assert calls == []
    assert "not looked for" in found.notes[0]


async def test_the_self_test_runs_once_while_podman_stays_the_same() -> None:
    p = probe()
    for _ in range(3):
        found = await p.probe(ctx(runner("works", [])))
        assert found.container_runtime is not None
        assert found.container_runtime.works
    assert p.selftests == 1
    # Another OCI runtime is another podman setup: tested again.
    p.settings = ContainerSettings(podman=FAKE, oci_runtime="crun")
    await p.probe(ctx(runner("works", [])))
    assert p.selftests == 2
    # A doctor request forgets the verdict.
    p.forget()
    await p.probe(ctx(runner("works", [])))
    assert p.selftests == 3


async def test_a_failed_self_test_is_tried_again_after_a_while() -> None:
    now = [0.0]
    p = probe(retest_failed_s=600.0)
    p.clock = lambda: now[0]
    await p.probe(ctx(runner("rlimit", [])))
    await p.probe(ctx(runner("rlimit", [])))
    assert p.selftests == 1
    now[0] = 601.0
    found = await p.probe(ctx(runner("works", [])))
    assert p.selftests == 2
    assert found.container_runtime is not None
    assert found.container_runtime.works


def test_cdi_names_are_bounded(tmp_path: Path) -> None:
    devices = "\n".join(f"  - name: '{i}'" for i in range(MAX_CDI_DEVICES + 10))
    (tmp_path / "big.yaml").write_text(f"kind: nvidia.com/gpu\ndevices:\n{devices}\n")
    (tmp_path / "long.yaml").write_text(f"kind: example.com/x\ndevices:\n  - name: '{'n' * 300}'\n")
    (tmp_path / "bad.yaml").write_text("{")
    names, notes = _cdi_names([str(tmp_path)])
    # One spec caps itself at MAX_CDI_DEVICES devices; the list as a whole holds no more.
    assert len(names) == MAX_CDI_DEVICES
    assert any("over 256 bytes left out" in n for n in notes)
    assert any(n.startswith("CDI: ") and "bad.yaml" in n for n in notes)


def test_the_marker_is_what_the_recording_printed() -> None:
    assert (PODMAN / "works/run.txt").read_text().strip() == SELFTEST_MARKER


def test_probe_settings_from_the_environment() -> None:
    from gpulayer_probe.__main__ import container_settings
    from gpulayer_runtime.settings import ConfigError

    assert container_settings({}) == ContainerSettings()
    told = container_settings(
        {
            "GPULAYER_PROBE_PODMAN": "/opt/podman/bin/podman",
            "GPULAYER_OCI_RUNTIME": "crun",
            "GPULAYER_PROBE_CONTAINER_TEST_S": "5",
        }
    )
    assert (told.podman, told.oci_runtime, told.test_timeout) == (
        "/opt/podman/bin/podman",
        "crun",
        5,
    )
    assert container_settings({"GPULAYER_PROBE_PODMAN": "None"}).podman is None
    for bad in ("0", "-1", "inf", "nan", "soon"):
        with pytest.raises(ConfigError, match="GPULAYER_PROBE_CONTAINER_TEST_S"):
            container_settings({"GPULAYER_PROBE_CONTAINER_TEST_S": bad})
