"""A shim's job cgroup kept for its next job (``cgroup_spare``), on this machine's real v1
cgroups: handed on only when nothing of the last job can reach the next, else removed; the
spares of shims that are gone swept. Skipped where there is no enforcing v1 hierarchy."""

from __future__ import annotations

import os
import subprocess
import uuid

import pytest

from gpulayer_executor import cgroups
from gpulayer_executor.cgroup_spare import SPARE, Spare, sweep
from gpulayer_executor.job_cgroup import JobCgroup
from gpulayer_executor.limits import JobLimits

pytestmark = pytest.mark.integration

LIMITS = JobLimits(pids_max=32, deny=((1, 7),))  # /dev/full denied


@pytest.fixture
def v1() -> cgroups.Hierarchy:
    if os.geteuid() != 0:
        pytest.skip("job cgroups need root")
    found, why = cgroups.v1_enforcing()
    if found is None:
        pytest.skip(f"no enforcing cgroup v1 hierarchy here: {why}")
    return found


def _name() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"


def _run(cgroup: JobCgroup, limits: JobLimits, argv: list[str]) -> subprocess.Popen[bytes]:
    cgroup.limit_before_spawn(limits)
    with cgroup.spawning():
        proc = subprocess.Popen(argv)
    cgroup.limit_resources(limits)
    return proc


def _folders(hierarchy: cgroups.Hierarchy, name: str) -> list[bool]:
    return [(p / name).is_dir() for p in hierarchy.parents]


def test_a_kept_cgroup_is_the_next_jobs_under_its_grant_name(v1: cgroups.Hierarchy) -> None:
    spare, first, second = Spare(), _name(), _name()
    cgroup = spare.take(v1, first, LIMITS)
    assert cgroup is not None
    assert _run(cgroup, LIMITS, ["true"]).wait(timeout=30) == 0
    spare.park(cgroup)
    kept = f"{SPARE}{os.getpid()}"
    try:
        assert _folders(v1, kept) == [True] * len(v1.parents)
        assert _folders(v1, first) == [False] * len(v1.parents)
        again = spare.take(v1, second, LIMITS)
        assert again is cgroup
        assert _folders(v1, second) == [True] * len(v1.parents)
        assert _folders(v1, kept) == [False] * len(v1.parents)
        # Its open files followed it: the job is born inside, under the new name.
        proc = _run(again, LIMITS, ["sleep", "30"])
        try:
            assert again.members() == [proc.pid]
        finally:
            proc.kill()
            proc.wait(timeout=30)
    finally:
        spare.close()
        cgroup.remove()
    assert _folders(v1, second) == [False] * len(v1.parents)


def test_other_limits_or_a_process_left_inside_get_a_fresh_cgroup(v1: cgroups.Hierarchy) -> None:
    spare = Spare()
    cgroup = spare.take(v1, _name(), LIMITS)
    assert cgroup is not None
    assert _run(cgroup, LIMITS, ["true"]).wait(timeout=30) == 0
    spare.park(cgroup)
    # Another pids limit: the kept one is removed, a fresh one made.
    other = JobLimits(pids_max=64, deny=LIMITS.deny)
    fresh = spare.take(v1, _name(), other)
    assert fresh is not None
    assert fresh is not cgroup
    assert _folders(v1, f"{SPARE}{os.getpid()}") == [False] * len(v1.parents)
    # A process still inside at the end: not kept (and not removable until it goes).
    proc = _run(fresh, other, ["sleep", "30"])
    third = None
    try:
        spare.park(fresh)
        assert _folders(v1, f"{SPARE}{os.getpid()}") == [False] * len(v1.parents)
        third = spare.take(v1, _name(), other)
        assert third is not None
        assert third is not fresh
    finally:
        proc.kill()
        proc.wait(timeout=30)
        for made in (fresh, third):
            if made is not None:
                made.remove()
    assert not [m for m in (fresh, third) if m is not None and m.path.exists()]


def test_sweep_removes_the_spares_of_shims_that_are_gone(v1: cgroups.Hierarchy) -> None:
    gone = f"{SPARE}{4_194_305}"  # above any pid_max: no such process
    alive = f"{SPARE}{os.getpid()}"
    for parent in v1.parents:
        (parent / gone).mkdir()
        (parent / alive).mkdir()
    try:
        assert sweep(v1) >= len(v1.parents)  # other tests' dead shims' spares may go too
        assert _folders(v1, gone) == [False] * len(v1.parents)
        assert _folders(v1, alive) == [True] * len(v1.parents)
    finally:
        for parent in v1.parents:
            for name in (gone, alive):
                if (parent / name).is_dir():
                    (parent / name).rmdir()


def test_a_kept_cgroup_that_cannot_be_readied_gives_way_to_a_fresh_one(
    v1: cgroups.Hierarchy,
) -> None:
    """Lifting the last job's device denials can fail (v1 refuses ``devices.allow a`` in a
    cgroup with a child, and in one whose parent is limited): the next job gets a fresh
    cgroup, never a failed start."""
    if "devices" not in v1.controllers:
        pytest.skip("no writable v1 devices controller here")
    spare, first, second = Spare(), _name(), _name()
    cgroup = spare.take(v1, first, LIMITS)
    assert cgroup is not None
    assert _run(cgroup, LIMITS, ["true"]).wait(timeout=30) == 0
    spare.park(cgroup)
    child = cgroup.file("devices", "child")
    child.mkdir()
    fresh = None
    try:
        other = JobLimits(pids_max=LIMITS.pids_max, deny=((1, 5),))  # /dev/zero, not /dev/full
        fresh = spare.take(v1, second, other)
        assert fresh is not None
        assert fresh is not cgroup
        assert _run(fresh, other, ["sh", "-c", "exec 3</dev/full"]).wait(timeout=30) == 0
        assert _run(fresh, other, ["sh", "-c", "exec 3</dev/zero"]).wait(timeout=30) != 0
    finally:
        child.rmdir()
        cgroup.remove()  # its devices folder stayed while it had a child
        if fresh is not None:
            fresh.remove()
    assert not [p for p in (*cgroup.paths, *(fresh.paths if fresh else [])) if p.exists()]
