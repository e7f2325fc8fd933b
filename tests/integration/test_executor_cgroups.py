"""A job is born inside its cgroup: the executor steps in for the spawn and back out, so even a
child the job forks at once is inside, and the executor itself is never left in a job's cgroup.
Real cgroups (v2 and v1 ``pids``), each skipped where this machine can't make one."""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import pytest

from gpulayer_executor import cgroups


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
