"""The container runtime probe against real podman (issue 28): its self-test starts a container
here without pulling anything, leaves none behind, and a runtime that can't start one is a note.
Skipped, naming the install, where podman is absent. The fake podman on PATH stands in for it in
the one test of the whole detection."""

from __future__ import annotations

import asyncio
import resource
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from tests.helpers import subscribed

from gpulayer_contracts.codec import capabilities_decoder, doctor_decoder
from gpulayer_contracts.subjects import node_capabilities, node_doctor
from gpulayer_detection.base import ProbeContext
from gpulayer_detection.containers import INSTALL_HINT, ContainerRuntimeProbe, ContainerSettings
from gpulayer_detection.registry import detect_capabilities, make_context
from gpulayer_detection.runner import RunResult, run_command
from gpulayer_probe.service import ProbeService, ProbeSettings
from gpulayer_runtime.nats import ensure_streams

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


async def _probe_service(nc: Any, settings: ProbeSettings) -> tuple[ProbeService, Any]:
    await ensure_streams(nc.jetstream())
    return ProbeService(nc, "ctr-probe", settings), asyncio.Event()


async def _inbox(nc: Any) -> asyncio.Queue[bytes]:
    """The capabilities the test's probe publishes, in order."""
    inbox: asyncio.Queue[bytes] = asyncio.Queue()

    async def cb(msg: Any) -> None:
        await inbox.put(msg.data)

    await nc.subscribe(node_capabilities("ctr-probe"), cb=cb)
    await subscribed(nc)
    return inbox


async def test_the_service_publishes_without_waiting_for_a_hanging_podman(
    nc: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    scenario = tmp_path / "hangs"
    shutil.copytree(FAKE.parent / "works", scenario)
    (scenario / "hang").touch()
    monkeypatch.setenv("FAKE_PODMAN_DIR", str(scenario))
    inbox = await _inbox(nc)
    settings = ProbeSettings(
        python=sys.executable,
        refresh_s=3600,
        timeout=5,
        observe_s=0,
        containers=ContainerSettings(podman=str(FAKE), oci_runtime="runc", test_timeout=600),
    )
    service, stop = await _probe_service(nc, settings)
    task = asyncio.create_task(service.run(stop))
    try:
        # Published while the self-test still hangs: the runtime is pending, nothing else waits.
        first = capabilities_decoder.decode(await asyncio.wait_for(inbox.get(), 30))
        assert first.container_runtime is None
        assert any("containers: detection pending" in n for n in first.notes)
        assert first.host.platform is not None
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)


async def test_the_service_reports_the_runtime_and_tests_it_once(
    nc: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_PODMAN_DIR", str(FAKE.parent / "works"))
    inbox = await _inbox(nc)
    settings = ProbeSettings(
        python=sys.executable,
        refresh_s=0.2,
        timeout=5,
        observe_s=0,
        containers=ContainerSettings(podman=str(FAKE), oci_runtime="runc"),
    )
    service, stop = await _probe_service(nc, settings)
    task = asyncio.create_task(service.run(stop))
    try:
        async with asyncio.timeout(30):
            while True:
                caps = capabilities_decoder.decode(await inbox.get())
                if caps.container_runtime is not None:
                    break
        assert caps.container_runtime.works
        assert not any("detection pending" in n for n in caps.notes)
        await asyncio.wait_for(service.wait_for_detections(service.detections + 5), 30)
        # Refreshed five times more: the runtime looked at each time, its self-test run once,
        # and nothing changed, so nothing was published again.
        assert service.containers.selftests == 1
        assert inbox.empty()
        # A doctor request (an admin fixed something) runs the self-test again, and says so.
        reply = await nc.request(node_doctor("ctr-probe"), b"", timeout=30)
        report = doctor_decoder.decode(reply.data)
        assert report.capabilities is not None
        assert report.capabilities.container_runtime == caps.container_runtime
        assert service.containers.selftests == 2
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)
