"""One job's cgroup (``cgroups.Hierarchy.create`` makes it): the job spawned inside, its limits
written, its OOM kills read, its processes signalled, the cgroup removed, or renamed and kept for
a shim's next job (``cgroup_spare``)."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import msgspec

from gpulayer_executor.limits import JobLimits, counter, device_writes, resource_writes
from gpulayer_executor.procs import own_tasks

log = logging.getLogger("gpulayer_executor.cgroups")

# A v1 job whose peak memory came this close to its limit reached it.
_PEAK_SLACK = 64 * 1024


class LimitError(RuntimeError):
    """A limit could not be written to the job's cgroup; ``str()`` names the file and value."""

    def __init__(self, message: str, *, file: str = "", code: int = 0) -> None:
        super().__init__(message)
        self.file = file
        self.code = code

    @property
    def over_memory(self) -> bool:
        """A memory limit below what the job already uses (v1 refuses it with EBUSY)."""
        return self.file.startswith("memory.") and self.code == errno.EBUSY


def _write(path: Path, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


class Hierarchy(Protocol):
    """What a job's cgroup needs of ``cgroups.Hierarchy``, where it is made."""

    version: str
    controllers: dict[str, Path]
    parents: list[Path]
    swap: bool

    def leave_fds(self) -> list[int]: ...


class JobCgroup:
    """One job's cgroup (one folder per hierarchy in v1). The job is born inside: the executor
    steps into it for the moment of the spawn (``spawning``), so the child inherits it at fork,
    and every process the job ever forks is inside too. (A ``preexec_fn`` that joins in the
    child would do the same, but forces a full fork of the executor instead of vfork: ~10 ms a
    job instead of ~2.)"""

    def __init__(self, hierarchy: Hierarchy, paths: list[Path]) -> None:
        self.hierarchy = hierarchy
        self.paths = paths
        self.path = paths[0]  # where its processes are tracked
        self._by_parent = dict(zip(hierarchy.parents, paths, strict=True))
        # cgroup v2 since Linux 5.14: the kernel kills every member at once, forks included.
        self._can_kill_all = (self.path / "cgroup.kill").exists()
        self.join_fds: list[int] = []
        self._pids_max: int | None = None  # the job's own, once raised for the spawn
        # The limits in force once all were written; kept by a reuse (``cgroup_spare``), so
        # only what differs is written again. ``_before``: those of the job before, if reused.
        self.applied: JobLimits | None = None
        self._before: JobLimits | None = None
        self._oom_base: dict[str, int] = {}  # the OOM counters when this job got the cgroup
        try:
            for path in paths:
                self.join_fds.append(os.open(path / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC))
        except OSError:
            self._close()
            raise

    def file(self, controller: str, name: str) -> Path:
        return self._by_parent[self.hierarchy.controllers[controller]] / name

    def _apply(self, writes: list[tuple[str, str, str]]) -> None:
        for controller, name, value in writes:
            path = self.file(controller, name)
            try:
                _write(path, value)
            except OSError as err:
                raise LimitError(
                    f"{path.name} = {value}: {err.strerror or err}", file=name, code=err.errno or 0
                ) from err

    def limit_before_spawn(self, limits: JobLimits) -> None:
        """Before the spawn, holding from the job's first instruction: its devices and pids.
        The spawner's tasks, inside for the spawn, count in ``pids.max``: it is raised by their
        number until ``spawning`` writes the job's own before it leaves, so the job never has
        more than ``pids_max`` however long the spawner is off the CPU. Raises LimitError."""
        before, self.applied = self.applied, None
        self._before = before
        writes: list[tuple[str, str, str]] = []
        if "devices" in self.hierarchy.controllers and (
            before is None or before.deny != limits.deny
        ):
            writes += device_writes(limits)
        if limits.pids_max is not None and "pids" in self.hierarchy.controllers:
            writes.append(("pids", "pids.max", str(limits.pids_max + own_tasks())))
            self._pids_max = limits.pids_max
        self._apply(writes)

    def limit_resources(self, limits: JobLimits) -> None:
        """After the spawn, the spawner out again: memory and CPU (inside, the spawner would be
        charged the job's memory, be the OOM killer's choice, share its CPU quota), and pids
        again. The job is microseconds old: a memory limit below its use reclaims, or fails
        (LimitError; the job is ended)."""
        h = self.hierarchy
        writes = resource_writes(limits, h.version, frozenset(h.controllers), memsw=h.swap)
        if self._before is not None:  # reused with the same memory, CPU and pids limits
            writes = [w for w in writes if w[1] == "pids.max"]
        self._apply(writes)
        self.applied = limits

    def reuse_for(self, limits: JobLimits) -> None:
        """Ready a kept cgroup (``applied`` set) for a job of ``limits``: its last job's device
        denials lifted where this one's differ, its peak memory back to its use (v1), its OOM
        counters read as they stand. Raises OSError (the caller makes a fresh one instead)."""
        assert self.applied is not None
        h, v1 = self.hierarchy, self.hierarchy.version == "v1"
        if "devices" in h.controllers and self.applied.deny not in ((), limits.deny):
            _write(self.file("devices", "devices.allow"), "a")
            self.applied = msgspec.structs.replace(self.applied, deny=())
        if "memory" in h.controllers and limits.memory_bytes is not None:
            if v1:
                _write(self.file("memory", "memory.max_usage_in_bytes"), "0")
            text = self.file("memory", "memory.oom_control" if v1 else "memory.events").read_text()
            self._oom_base = {k: counter(text, k) or 0 for k in ("oom", "oom_kill")}

    def rename(self, name: str) -> None:
        """Its folders renamed to ``name`` (v1; v2 refuses), its open files still its own.
        Raises OSError, with what had moved moved back."""
        moved: list[Path] = []
        try:
            for path in self.paths:
                os.rename(path, path.parent / name)
                moved.append(path.parent / name)
        except OSError:
            for new, old in zip(moved, self.paths, strict=False):
                with contextlib.suppress(OSError):
                    os.rename(new, old)
            raise
        self.paths, self.path = moved, moved[0]
        self._by_parent = dict(zip(self.hierarchy.parents, moved, strict=True))

    def out_of_memory(self, *, sigkill: bool) -> str | None:
        """ "limit": the kernel's OOM killer killed a process of the job because the job reached
        its memory limit; "node": because the whole node ran out; None: no OOM kill.
        ``sigkill``: the job's main process died of SIGKILL (the only sign on kernels without
        an ``oom_kill`` counter)."""
        if "memory" not in self.hierarchy.controllers:
            return None
        v1 = self.hierarchy.version == "v1"
        try:
            text = self.file("memory", "memory.oom_control" if v1 else "memory.events").read_text()
            hit = self._reached_limit() if v1 else self._count(text, "oom") > 0
        except (OSError, ValueError):
            return None
        kills = None if counter(text, "oom_kill") is None else self._count(text, "oom_kill")
        if kills is None:  # v1 before Linux 4.13: a job that reached it and died of SIGKILL
            return "limit" if hit and sigkill else None
        if kills == 0:
            return None
        return "limit" if hit else "node"

    def _count(self, text: str, name: str) -> int:
        return (counter(text, name) or 0) - self._oom_base.get(name, 0)

    def _reached_limit(self) -> bool:
        """v1: the job's memory use reached its limit once (its peak is at the limit, less a
        little: usage moves by pages). ``memory.failcnt`` would say so too, but recent kernels
        leave it at 0 in v1."""
        peak = int(self.file("memory", "memory.max_usage_in_bytes").read_text())
        limit = int(self.file("memory", "memory.limit_in_bytes").read_text())
        return peak + _PEAK_SLACK >= limit

    @contextlib.contextmanager
    def spawning(self) -> Iterator[bool]:
        """Inside: the spawner itself is in the job's cgroups (True), or could not enter them
        (False: the caller adds the child after the spawn, microseconds later). The spawn is
        synchronous in a single-threaded loop: nothing else of the spawner runs inside."""
        joined, inside = 0, True
        try:
            for fd in self.join_fds:
                os.write(fd, b"0")
                joined += 1
        except OSError:
            self._leave(joined)
            joined, inside = 0, False
        try:
            yield inside
        finally:
            if self._pids_max is not None:  # the job's own, before the spawner stops counting
                with contextlib.suppress(OSError):  # limit_resources writes it again, or fails
                    _write(self.file("pids", "pids.max"), str(self._pids_max))
            self._leave(joined)

    def _leave(self, count: int) -> None:
        for fd, path in zip(self.hierarchy.leave_fds()[:count], self.paths, strict=False):
            try:
                os.write(fd, b"0")
            except OSError as err:  # pragma: no cover - the cgroup we came from is gone
                log.error("could not leave job cgroup %s: %s", path, err)

    def add(self, pid: int) -> None:
        for fd in self.join_fds:
            with contextlib.suppress(OSError):
                os.write(fd, str(pid).encode())

    def members(self) -> list[int]:
        try:
            text = (self.path / "cgroup.procs").read_text()
        except OSError:
            return []
        return [int(p) for p in text.split()]

    def signal_all(self, sig: int) -> None:
        if sig == signal.SIGKILL and self._can_kill_all:
            try:
                (self.path / "cgroup.kill").write_text("1")
                return
            except OSError:
                pass  # fall through: one by one
        for pid in self.members():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    def _close(self) -> None:
        for fd in self.join_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.join_fds = []

    def remove(self) -> None:
        """Close our fds and remove the (empty) cgroups; one still busy is left and logged."""
        self._close()
        for path in self.paths:
            try:
                path.rmdir()
            except OSError as err:
                if err.errno != errno.ENOENT:
                    log.warning("cgroup %s not removed: %s", path, err)
