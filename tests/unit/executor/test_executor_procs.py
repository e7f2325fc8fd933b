"""procs.group_alive: a job's process group, alive, ended, or left with only a zombie."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from gpulayer_executor import procs

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")


def test_a_running_group_is_alive_and_an_ended_one_is_not_without_walking_proc(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    proc = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        assert procs.group_alive(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    walked: list[int] = []

    def no_walk(pgid: int) -> list[int]:
        walked.append(pgid)
        return []

    monkeypatch.setattr(procs, "group_members", no_walk)
    assert not procs.group_alive(proc.pid)
    assert walked == []  # no process of the group at all: killpg alone said so


def test_a_group_left_with_only_a_zombie_is_not_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    # A process of its own group that has exited and is not reaped yet: killpg still finds
    # it, so the walk over /proc decides, and a zombie is no live member.
    proc = subprocess.Popen(["true"], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while procs.parse_stat(Path(f"/proc/{proc.pid}/stat").read_text()).state != "Z":
            assert time.monotonic() < deadline, "the process never exited"
            time.sleep(0.01)
        walked: list[int] = []
        members = procs.group_members

        def walk(pgid: int) -> list[int]:
            walked.append(pgid)
            return members(pgid)

        monkeypatch.setattr(procs, "group_members", walk)
        assert not procs.group_alive(proc.pid)
        assert walked == [proc.pid]
    finally:
        proc.wait()
