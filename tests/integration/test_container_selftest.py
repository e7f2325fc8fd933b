"""The container runtime probe against real podman (issue 28): its self-test starts a container
here without pulling anything, leaves none behind, and a runtime that can't start one is a note.
Skipped, naming the install, where podman is absent. The fake podman on PATH stands in for it in
the one test of the whole detection."""

from __future__ import annotations

import resource
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from gpulayer_detection.base import ProbeContext
from gpulayer_detection.containers import INSTALL_HINT, ContainerRuntimeProbe, ContainerSettings
from gpulayer_detection.registry import detect_capabilities, make_context
from gpulayer_detection.runner import RunResult, run_command

FAKE = Path(__file__).resolve().parents[1] / "fixtures" / "podman" / "fake-podman"
real_podman = pytest.mark.skipif(
    shutil.which("podman") is None, reason=f"podman is not installed ({INSTALL_HINT})"
)


def _ctx(names: list[str] | None = None) -> ProbeContext:
    """Real commands; the self-test containers' names noted in ``names``."""

    async def run(argv: Sequence[str], timeout: float) -> RunResult:
        if names is not None and "--name" in argv:
            names.append(argv[list(argv).index("--name") + 1])
        return await run_command(argv, timeout)

    return make_context(run=run, timeout=10.0, cdi_dirs=())


def _podman_version() -> str:
    out = subprocess.run(["podman", "--version"], capture_output=True, text=True, check=True)
    return out.stdout.split()[-1]


def _leftovers(names: list[str]) -> list[str]:
    """Which of ``names`` podman still has (other tests' self-tests may run meanwhile)."""
    assert names
    out = subprocess.run(
        ["podman", "ps", "-a", "--format", "{{.Names}}"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    return [n for n in out.split() if n in names]


@real_podman
async def test_the_self_test_starts_a_container_and_leaves_none(tmp_path: Path) -> None:
    names: list[str] = []
    probe = ContainerRuntimeProbe(ContainerSettings(tmp_dir=str(tmp_path)))
    found = await probe.probe(_ctx(names))
    rt = found.container_runtime
    assert rt is not None, found.notes
    assert rt.works, rt.notes
    assert _podman_version() == rt.version
    if shutil.which("runc", path="/usr/sbin:/usr/bin:/sbin:/bin"):
        assert rt.oci_runtime == "runc"
    assert _leftovers(names) == []
    assert not any(tmp_path.iterdir())  # noqa: ASYNC240 - its root filesystem is gone too


@real_podman
async def test_without_a_static_busybox_the_hosts_folders_are_bound(tmp_path: Path) -> None:
    settings = ContainerSettings(busybox=str(tmp_path / "none"), tmp_dir=str(tmp_path))
    found = await ContainerRuntimeProbe(settings).probe(_ctx())
    assert found.container_runtime is not None
    assert found.container_runtime.works, found.container_runtime.notes


@real_podman
@pytest.mark.skipif(
    resource.getrlimit(resource.RLIMIT_NOFILE)[1] >= 1048576,
    reason="this machine allows podman's default open-files limit",
)
async def test_podmans_own_limits_fail_here_and_the_note_says_so(tmp_path: Path) -> None:
    # What the limits read at run time avoid: runc can't raise open files past the hard limit.
    names: list[str] = []
    probe = ContainerRuntimeProbe(ContainerSettings(tmp_dir=str(tmp_path)), ulimits=list)
    found = await probe.probe(_ctx(names))
    rt = found.container_runtime
    assert rt is not None
    assert not rt.works
    assert "rlimit" in rt.notes[-1]
    assert rt.notes[-1].startswith("self-test failed")
    assert _leftovers(names) == []


async def test_detection_reports_the_fake_podman_on_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shutil.copy(FAKE, bin_dir / "podman")
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("FAKE_PODMAN_DIR", str(FAKE.parent / "rlimit"))
    caps = await detect_capabilities(
        "n1",
        include_torch=False,
        include_frameworks=False,
        timeout=5.0,
        containers=ContainerSettings(oci_runtime="runc"),
    )
    rt = caps.container_runtime
    assert rt is not None
    assert (rt.name, rt.version, rt.works) == ("podman", "4.3.1", False)
    assert "rlimit type 7" in rt.notes[-1]


async def test_one_shot_probe_without_podman_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    caps = await detect_capabilities(
        "n1", include_torch=False, include_frameworks=False, timeout=5.0
    )
    assert caps.container_runtime is None
    assert any("podman not found on PATH" in n and INSTALL_HINT in n for n in caps.notes)


@pytest.mark.parametrize(
    ("podman", "recording", "code", "said"),
    [
        (str(FAKE), "works", 0, "yes: "),
        (str(FAKE), "rlimit", 1, "1 has a container runtime that failed its self-test: "),
        ("none", "works", 1, "0/1 nodes can run this job: 1 has no container runtime"),
    ],
)
def test_gpulayer_check_looks_for_the_runtime_a_container_job_needs(
    podman: str,
    recording: str,
    code: int,
    said: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import io
    import json

    from rich.console import Console

    from gpulayer_cli.check import run_check

    monkeypatch.setenv("GPULAYER_PROBE_PODMAN", podman)
    monkeypatch.setenv("GPULAYER_OCI_RUNTIME", "runc")
    monkeypatch.setenv("FAKE_PODMAN_DIR", str(FAKE.parent / recording))
    job = tmp_path / "job.json"
    job.write_text(
        json.dumps({"job_id": "c", "command": ["true"], "container": {"image": "localhost/a:1"}})
    )
    out = io.StringIO()
    console = Console(file=out, width=400)
    assert run_check(str(job), python=None, as_json=False, console=console) == code
    assert said in out.getvalue()


async def test_a_hanging_podman_is_cut_off_and_its_container_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    scenario = tmp_path / "hangs"
    shutil.copytree(FAKE.parent / "works", scenario)
    (scenario / "hang").touch()
    (scenario / "calls").touch()
    monkeypatch.setenv("FAKE_PODMAN_DIR", str(scenario))
    settings = ContainerSettings(podman=str(FAKE), oci_runtime="runc", test_timeout=1.0)
    found = await ContainerRuntimeProbe(settings).probe(_ctx())
    rt = found.container_runtime
    assert rt is not None
    assert not rt.works
    assert "timed out after 1s" in rt.notes[-1]
    calls = (scenario / "calls").read_text().splitlines()
    (run,) = [c for c in calls if " run " in f" {c} "]
    name = run.split("--name ", 1)[1].split()[0]
    assert f"rm --force --time 0 {name}" in calls
