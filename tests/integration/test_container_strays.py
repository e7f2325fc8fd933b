"""What ``podman rm`` can't see is killed too: a container's ``conmon`` and ``runc init`` left by a
``podman run`` killed after the runtime made the container and before podman recorded it (seen
after the e2e step that SIGKILLs a container job's shim). Here the record-less state is stood
in for by a removal that leaves the real processes alone: a container made and initialised by
real podman (``podman create`` + ``podman init``: its conmon and a ``runc init`` waiting to
start), removed through ``container.remove`` with a runner that does nothing."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import psutil
import pytest
from bench.containers import BUSYBOX, bench_image, missing

from gpulayer_executor import container as ctr

PODMAN = shutil.which("podman")
pytestmark = pytest.mark.skipif(missing() is not None, reason=str(missing()))


def _podman(*args: str) -> subprocess.CompletedProcess[str]:
    assert PODMAN is not None
    return subprocess.run(
        [PODMAN, "--runtime", "runc", *args], capture_output=True, text=True, timeout=120
    )


@pytest.fixture
def initialised(tmp_path: Path) -> Iterator[str]:
    """A container made and initialised, never started: its name."""
    name = f"{ctr.NAME_PREFIX}{uuid.uuid4().hex}"
    with bench_image(tmp_path) as image:
        try:
            made = _podman(
                "create", *ctr.machine_ulimits(), "--name", name, image, BUSYBOX, "sleep", "600"
            )
            assert made.returncode == 0, made.stderr
            done = _podman("init", name)
            assert done.returncode == 0, done.stderr
            yield name
        finally:
            _podman("rm", "--force", "--time", "0", name)


def _monitor(name: str) -> tuple[psutil.Process, list[psutil.Process]]:
    """The conmon of container ``name`` and what runs under it."""
    for proc in psutil.process_iter(["name", "cmdline"]):
        if proc.info["name"] == "conmon" and name in (proc.info["cmdline"] or []):
            return proc, proc.children(recursive=True)
    raise AssertionError(f"no conmon for {name}")


def _forgotten(argv: Sequence[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """podman's removal of a container it has no record of: it succeeds and kills nothing."""
    return subprocess.CompletedProcess(list(argv), 0, "", "")


def test_removal_kills_the_monitor_and_init_podman_forgot(initialised: str) -> None:
    conmon, under = _monitor(initialised)
    assert [p.cmdline()[1:] for p in under] == [["init"]], under  # runc init: waits to start
    assert ctr.remove("podman", initialised, run=_forgotten) is None
    gone, alive = psutil.wait_procs([conmon, *under], timeout=10)
    assert alive == [], alive
    assert len(gone) == 1 + len(under)


def _hung(argv: Sequence[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """A podman that doesn't return (``run`` gave up on it after its timeout)."""
    raise subprocess.TimeoutExpired(list(argv), timeout)


def test_a_hung_podman_rm_still_leaves_nothing_running(initialised: str) -> None:
    conmon, under = _monitor(initialised)
    assert ctr.remove("podman", initialised, run=_hung) == "podman rm took over 60 s"
    _, alive = psutil.wait_procs([conmon, *under], timeout=10)
    assert alive == [], alive


def test_a_conmon_of_another_user_is_never_killed() -> None:
    # Any user can name a process conmon and give it a container's name: it is not ours. A
    # script's process is named after the script.
    name = f"{ctr.NAME_PREFIX}{uuid.uuid4().hex}"
    folder = Path(tempfile.mkdtemp(prefix="gpulayer-strays-"))
    try:
        folder.chmod(0o755)
        fake = folder / "conmon"
        fake.write_text("#!/bin/sh\nsleep 600\n")
        fake.chmod(0o755)
        proc = subprocess.Popen([str(fake), "-n", name], user=65534)  # nobody
        try:
            p = psutil.Process(proc.pid)
            deadline = time.monotonic() + 10
            while p.name() != "conmon":  # until the exec: nothing to await
                assert time.monotonic() < deadline, p.name()
                time.sleep(0.01)
            assert ctr._named(p.cmdline(), name)
            assert ctr.kill_strays(name) == 0
            assert proc.poll() is None
        finally:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
            proc.wait()
    finally:
        shutil.rmtree(folder)


def test_another_containers_monitor_is_left_alone(initialised: str) -> None:
    conmon, under = _monitor(initialised)
    other = f"{ctr.NAME_PREFIX}{uuid.uuid4().hex}"
    assert ctr.kill_strays(other) == 0
    assert conmon.is_running()
    assert all(p.is_running() for p in under)
    assert ctr.kill_strays(initialised) == 1 + len(under)
    assert not conmon.is_running()
