"""A cgroup per job, where this machine lets us make one: the only record of a job's processes
that a job can't leave (``setsid``, double fork and a cleared environment all stay inside).

Chosen once per executor process, and said in a log line: the cgroup v2 hierarchy (killed with
``cgroup.kill`` where the kernel has it), else the v1 ``pids`` hierarchy (killed pid by pid from
``cgroup.procs``), else none, and the runner finds escaped children by walking /proc for the job's marker instead.
The job's cgroup lives under the executor's own one, in ``gpulayer/<grant id>``.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import signal
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

_ROOT = Path("/sys/fs/cgroup")
_PARENT = "gpulayer"


def _own_paths(text: str) -> dict[str, str]:
    """``/proc/self/cgroup`` as {hierarchy: path}: "" names the v2 one, else the v1 controllers
    (``4:memory:/x`` gives {"memory": "/x"}). Pure."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if not controllers:
            out[""] = path
        for name in controllers.split(","):
            if name:
                out[name] = path
    return out


def _v2_mount() -> Path | None:
    """The v2 hierarchy: /sys/fs/cgroup itself, or /sys/fs/cgroup/unified beside v1 (hybrid)."""
    for candidate in (_ROOT, _ROOT / "unified"):
        if (candidate / "cgroup.controllers").exists():
            return candidate
    return None


def _usable(parent: Path) -> str | None:
    """None when a job cgroup can be made under ``parent`` (tried for real), else why not."""
    probe = parent / f"probe-{os.getpid()}"
    try:
        parent.mkdir(exist_ok=True)
        probe.mkdir(exist_ok=True)
        probe.rmdir()
    except OSError as err:
        return f"{parent}: {err.strerror or err}"
    return None


class Hierarchy:
    """Where job cgroups are made, and how they are killed."""

    def __init__(self, parent: Path, kind: str) -> None:
        self.parent = parent
        self.kind = kind  # "v2" or "v1 pids"
        # The executor's own cgroup (``parent`` is ``<own>/gpulayer``): where it goes back to
        # after spawning a job from inside the job's cgroup.
        self.home = parent.parent

    def create(self, name: str) -> JobCgroup | None:
        """A fresh cgroup for one job; None (logged) when it can't be made after all."""
        path = self.parent / name
        try:
            path.mkdir()
        except FileExistsError:
            pass
        except OSError as err:
            log.warning("no cgroup for %s: %s", name, err)
            return None
        return JobCgroup(path, self.home)


def _own() -> dict[str, str]:
    try:
        return _own_paths(Path("/proc/self/cgroup").read_text())
    except OSError:
        return {}


def v2_hierarchy() -> tuple[Hierarchy | None, str]:
    """Job cgroups in the v2 hierarchy, or why not."""
    own = _own()
    v2 = _v2_mount()
    if v2 is None or "" not in own:
        return None, "v2 not mounted"
    parent = v2 / own[""].lstrip("/") / _PARENT
    why = _usable(parent)
    return (Hierarchy(parent, "v2"), "") if why is None else (None, f"v2 {why}")


def v1_pids_hierarchy() -> tuple[Hierarchy | None, str]:
    """Job cgroups in the v1 ``pids`` hierarchy, or why not."""
    own = _own()
    if "pids" not in own or not (_ROOT / "pids" / "cgroup.procs").exists():
        return None, "v1 pids not mounted"
    parent = _ROOT / "pids" / own["pids"].lstrip("/") / _PARENT
    why = _usable(parent)
    return (Hierarchy(parent, "v1 pids"), "") if why is None else (None, f"v1 pids {why}")


@functools.cache
def hierarchy() -> Hierarchy | None:
    """The hierarchy in force for this process (decided once, logged once)."""
    reasons = []
    for choose in (v2_hierarchy, v1_pids_hierarchy):
        found, why = choose()
        if found is not None:
            log.info("job processes are tracked in cgroup %s under %s", found.kind, found.parent)
            return found
        reasons.append(why)
    log.info(
        "no writable cgroup (%s): a job's escaped children are found by walking /proc for "
        "its GPULAYER_GRANT_ID",
        "; ".join(reasons),
    )
    return None


class JobCgroup:
    """One job's cgroup. The job is born inside it: the executor steps into the cgroup for the
    moment of the spawn (``spawning``), so the child inherits it at fork, and every process the
    job ever forks is inside too. (A ``preexec_fn`` that joins in the child would do the same,
    but forces a full fork of the executor instead of vfork: ~10 ms a job instead of ~2.)"""

    def __init__(self, path: Path, home: Path) -> None:
        self.path = path
        self.home = home
        # cgroup v2 since Linux 5.14: the kernel kills every member at once, forks included.
        self._can_kill_all = (path / "cgroup.kill").exists()
        self.join_fd = os.open(path / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)

    @contextlib.contextmanager
    def spawning(self) -> Iterator[bool]:
        """Inside: the executor itself is in the job's cgroup (True), or could not enter it
        (False: the caller adds the child after the spawn instead, which leaves a window of
        microseconds before the job is inside). The executor is single-threaded in its event
        loop and the spawn is synchronous, so nothing else of it runs in the job's cgroup."""
        try:
            os.write(self.join_fd, b"0")
        except OSError:
            yield False
            return
        try:
            yield True
        finally:
            try:
                (self.home / "cgroup.procs").write_text("0")
            except OSError as err:  # pragma: no cover - the cgroup we came from is gone
                log.error("could not leave job cgroup %s: %s", self.path, err)

    def add(self, pid: int) -> None:
        with contextlib.suppress(OSError):
            os.write(self.join_fd, str(pid).encode())

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

    def remove(self) -> None:
        """Close our fd and remove the (empty) cgroup; a cgroup still busy is left and logged."""
        with contextlib.suppress(OSError):
            os.close(self.join_fd)
        try:
            self.path.rmdir()
        except OSError as err:
            if err.errno != errno.ENOENT:
                log.warning("cgroup %s not removed: %s", self.path, err)
