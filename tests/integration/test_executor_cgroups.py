"""A job is born inside its cgroup: the executor steps in for the spawn and back out, so even a
child the job forks at once is inside, and the executor itself is never left in a job's cgroup.
Real cgroups (v2 and v1 ``pids``), each skipped where this machine can't make one."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest

from gpulayer_executor import cgroups, procs
from gpulayer_executor.limits import JobLimits


@pytest.fixture(params=["v2", "v1-pids"])
def hierarchy(request: pytest.FixtureRequest) -> cgroups.Hierarchy:
    choose = cgroups.v2_hierarchy if request.param == "v2" else cgroups.v1_pids_hierarchy
    found, why = choose()
    if found is None:
        pytest.skip(f"not on this machine: {why}")
    return found


def _own_cgroups() -> str:
    return Path("/proc/self/cgroup").read_text()


def test_the_job_is_born_inside_and_the_executor_goes_back(hierarchy: cgroups.Hierarchy) -> None:
    name = f"test-{uuid.uuid4().hex[:8]}"
    cgroup = hierarchy.create(name)
    assert cgroup is not None
    before = _own_cgroups()
    try:
        with cgroup.spawning() as inside:
            # The child reads its own cgroups as its first act: no time for the parent to move it.
            proc = subprocess.Popen(["cat", "/proc/self/cgroup"], stdout=subprocess.PIPE)
        out, _ = proc.communicate(timeout=10)
        assert inside
        assert f"/gpulayer/{name}" in out.decode()
        assert _own_cgroups() == before
        assert f"/gpulayer/{name}" not in _own_cgroups()
    finally:
        cgroup.signal_all(9)
        cgroup.remove()
    assert not cgroup.path.exists()


# Forks until refused (at most 300), then says how many children it made.
_BOMB = """
import errno, os, sys
children = []
for _ in range(300):
    try:
        pid = os.fork()
    except OSError as err:
        print(errno.errorcode[err.errno], len(children))
        break
    if pid == 0:
        os.read(0, 1)  # until the test closes our stdin
        os._exit(0)
    children.append(pid)
else:
    print("none", len(children))
sys.stdout.flush()
"""


def test_the_pids_limit_holds_before_the_spawner_is_out() -> None:
    """A job is limited to its pids_max from its first instruction, however long its spawner
    stays off the CPU before writing the rest of the limits (here: never). The spawner's own
    threads, inside for the spawn, don't take the job's share."""
    found = cgroups.hierarchy(enforce=True)
    if found is None or "pids" not in found.controllers:
        pytest.skip("no writable pids controller on this machine")
    name = f"test-{uuid.uuid4().hex[:8]}"
    cgroup = found.create(name)
    assert cgroup is not None
    limits = JobLimits(pids_max=16)
    release = threading.Event()
    # A thread of the spawner's own: it is inside with the spawner for the spawn.
    extra = threading.Thread(target=release.wait)
    extra.start()
    bomb = None
    try:
        tasks = procs.own_tasks()
        cgroup.limit_before_spawn(limits)
        raised = cgroup.file("pids", "pids.max").read_text().strip()
        with cgroup.spawning() as inside:
            bomb = subprocess.Popen(
                [sys.executable, "-c", _BOMB],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
        release.set()
        assert inside
        assert bomb.stdout is not None
        # Raised by the spawner's own tasks (two here) for the spawn, then the job's own.
        assert raised == str(16 + tasks)
        assert cgroup.file("pids", "pids.max").read_text().strip() == "16"
        # limit_resources is never called: the job and 15 children, its 16 tasks.
        assert bomb.stdout.readline().split() == ["EAGAIN", "15"]
    finally:
        release.set()
        extra.join()
        if bomb is not None:
            bomb.communicate(timeout=30)  # its stdin closed: the children go too
        asyncio.run(found.clear_leftover(name))
        cgroup.remove()
    assert not [p for p in found.parents if (p / name).exists()]
