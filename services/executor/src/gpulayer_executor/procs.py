"""Process groups: recognising ours after a restart, telling whether one still runs, killing it.

Every job runs as the leader of its own session and process group (pgid == pid), so one
``killpg`` reaches its children and grandchildren. On Linux, /proc lets us skip zombies (an
orphan nobody reaped yet is not running) and tell our process from a later one reusing its pid;
elsewhere we fall back to ``killpg(pgid, 0)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import threading
import time
from pathlib import Path

_PROC = Path("/proc")


@functools.cache
def boot_id() -> str | None:
    """This boot's id (Linux); read once, it can't change while the process lives."""
    try:
        return (_PROC / "sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


class _Stat:
    __slots__ = ("pgid", "sid", "start_ticks", "state")

    def __init__(self, state: str, pgid: int, sid: int, start_ticks: int) -> None:
        self.state = state
        self.pgid = pgid
        self.sid = sid
        self.start_ticks = start_ticks


def parse_stat(text: str) -> _Stat:
    """Parse /proc/<pid>/stat. The command name may hold spaces and parentheses, so split at the
    last ')'; fields after it start at field 3 (state)."""
    rest = text[text.rindex(")") + 2 :].split()
    return _Stat(state=rest[0], pgid=int(rest[2]), sid=int(rest[3]), start_ticks=int(rest[19]))


def _stat(pid: int) -> _Stat | None:
    try:
        return parse_stat((_PROC / str(pid) / "stat").read_text())
    except (OSError, ValueError, IndexError):
        return None


def start_ticks(pid: int) -> int | None:
    st = _stat(pid)
    return st.start_ticks if st else None


def _have_proc() -> bool:
    return (_PROC / "self" / "stat").exists()


def pid_alive(pid: int) -> bool:
    """The process exists and is not a zombie (Linux); elsewhere, it can be signalled."""
    if not _have_proc():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    st = _stat(pid)
    return st is not None and st.state not in ("Z", "X")


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of the group."""
    if not _have_proc():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        except PermissionError:
            return [pgid]
        return [pgid]
    members = []
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        st = _stat(int(entry.name))
        if st is not None and st.pgid == pgid and st.state not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def group_alive(pgid: int) -> bool:
    """Whether a live (non-zombie) process of the group is left. Most often none at all is,
    which one ``killpg(pgid, 0)`` tells; only when some process exists is /proc walked (a
    zombie counts for killpg), so a job's end costs no walk over every process of the node."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return bool(group_members(pgid))


def owns_group(pgid: int, leader_start_ticks: int | None, recorded_boot_id: str | None) -> bool:
    """Whether the group we recorded still exists (it may have lost its leader).

    Linux never hands out a pid that is still some group's pgid, so if the leader's pid now
    belongs to a different process, our group is gone; if not, any member with that pgid is ours.
    """
    current_boot = boot_id()
    if recorded_boot_id and current_boot and recorded_boot_id != current_boot:
        return False
    if leader_start_ticks is not None:
        st = _stat(pgid)
        if st is not None and st.start_ticks != leader_start_ticks:
            return False
    return group_alive(pgid)


def signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to the group; False when no such group exists."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True


async def wait_group_gone(pgid: int, limit_s: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + limit_s
    while True:
        if not group_alive(pgid):
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(interval)


async def terminate_group(pgid: int, grace_s: float) -> None:
    """SIGTERM to the whole group, up to ``grace_s`` for it to go, then SIGKILL to the group."""
    if not signal_group(pgid, signal.SIGTERM):
        return
    if await wait_group_gone(pgid, grace_s):
        return
    signal_group(pgid, signal.SIGKILL)
    # A SIGKILLed process can't refuse; this only waits for the kernel to tear it down.
    await wait_group_gone(pgid, 5.0)


def find_by_env(name: str, value: str) -> list[int]:
    """Pids whose environment holds ``name=value`` (Linux). Used after a crash between spawn
    and recording the pid: the job's environment carries its grant id."""
    if not _have_proc():
        return []
    needle = f"{name}={value}".encode()
    found = []
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            environ = (entry / "environ").read_bytes()
            if needle in environ.split(b"\0"):
                found.append(int(entry.name))
    return found


def pgid_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def own_tasks() -> int:
    """This process' tasks (threads included: ``pids.max`` counts each)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # pragma: no cover - no /proc: the Python threads at least
        return threading.active_count()
