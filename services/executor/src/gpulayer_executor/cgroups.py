"""A cgroup per job, where this machine lets us make one: the record of a job's processes that
a job can't leave (``setsid``, double fork and a cleared environment all stay inside), and,
where the controllers are writable, the job's limits (memory, CPU quota, pids, devices).

Chosen once per executor process (``hierarchy``) and said in a log line, first that can be made:

- **cgroup v2 enforcing**: the ``memory``, ``cpu`` and ``pids`` controllers (those offered)
  enabled below the executor's own cgroup (it moves itself into a leaf ``executor`` first when its cgroup holds it,
  as the "no internal processes" rule asks). Devices are not limited: that needs an eBPF
  program in v2.
- **cgroup v1 enforcing**: one directory per controller (``memory``, ``cpu``, ``pids``,
  ``devices``, those that are mounted and writable), the job joined to all.
- **tracking only** (``enforcement: none``): the v2 hierarchy (killed with ``cgroup.kill``
  where the kernel has it), else the v1 ``pids`` hierarchy (killed pid by pid), else nothing,
  and the runner finds escaped children by walking /proc for the job's marker instead.

A job's cgroup is ``gpulayer/<grant id>`` under the executor's own one, in each hierarchy.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import os
import signal
from collections.abc import Callable, Mapping
from pathlib import Path

from gpulayer_executor.job_cgroup import JobCgroup, _write

log = logging.getLogger(__name__)

_ROOT = Path("/sys/fs/cgroup")
_PARENT = "gpulayer"
_V2_LEAF = "executor"
V1_CONTROLLERS = ("memory", "cpu", "pids", "devices")
V2_CONTROLLERS = ("memory", "cpu", "pids")
NONE = "none"


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


def v1_enforcement(controllers: list[str]) -> str:
    """The heartbeat's words for v1 limits with ``controllers``. Pure."""
    missing = [c for c in V1_CONTROLLERS if c not in controllers]
    text = "cgroup v1: " + " ".join(c for c in V1_CONTROLLERS if c in controllers)
    return f"{text} (not enforced: {' '.join(missing)})" if missing else text


def v2_enforcement(controllers: list[str]) -> str:
    """The heartbeat's words for v2 limits with ``controllers``. Pure."""
    have = " ".join(c for c in V2_CONTROLLERS if c in controllers)
    missing = [c for c in V2_CONTROLLERS if c not in controllers]
    if not missing:
        return f"cgroup v2: {have} (devices not enforced: needs eBPF)"
    return f"cgroup v2: {have} (not enforced: {' '.join(missing)}; devices: needs eBPF)"


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
    """Where job cgroups are made, how they are limited and killed.

    ``parent``: the folder job cgroups are tracked in (members, kill); ``controllers``: each
    enforced controller's folder (v2: all the same one). ``homes``: for each folder, the
    executor's own cgroup there, where it goes back to after spawning a job from inside."""

    def __init__(
        self,
        version: str,
        parent: Path,
        controllers: Mapping[str, Path] | None = None,
        *,
        homes: Mapping[Path, Path] | None = None,
        enforcement: str = NONE,
    ) -> None:
        self.version = version  # "v1" or "v2"
        self.parent = parent
        self.controllers = dict(controllers or {})
        self.parents = list(dict.fromkeys([parent, *self.controllers.values()]))
        self.homes = {p: (homes or {}).get(p, p.parent) for p in self.parents}
        self.enforcement = enforcement
        self.kind = f"{version} ({enforcement})" if self.controllers else f"{version} tracking"
        memory = self.controllers.get("memory")
        # Swap accounting on: its limit gets the memory limit too (v1) or 0 (v2).
        swap_file = "memory.memsw.limit_in_bytes" if version == "v1" else "memory.swap.max"
        self.swap = memory is not None and (memory / swap_file).exists()
        self._leave_fds: list[int] | None = None

    def leave_fds(self) -> list[int]:
        """Open once, kept: leaving a job's cgroups after each spawn is one write each."""
        if self._leave_fds is None:
            self._leave_fds = [
                os.open(self.homes[p] / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)
                for p in self.parents
            ]
        return self._leave_fds

    def create(self, name: str) -> JobCgroup | None:
        """A fresh cgroup for one job; None (logged) when it can't be made after all."""
        made: list[Path] = []
        try:
            self.leave_fds()
            for parent in self.parents:
                path = parent / name
                with contextlib.suppress(FileExistsError):
                    path.mkdir()
                made.append(path)
            return JobCgroup(self, made)
        except OSError as err:
            log.warning("no cgroup for %s: %s", name, err)
            for path in made:
                with contextlib.suppress(OSError):
                    path.rmdir()
            return None

    def leftover(self, name: str) -> JobCgroup | None:
        """The cgroup a previous run of the executor made for ``name``, if still there."""
        if not any((p / name).is_dir() for p in self.parents):
            return None
        return self.create(name)

    async def clear_leftover(self, name: str) -> None:
        """Kill what is left in ``name``'s cgroup (children that left the job's group included)
        and remove it, if a previous run left one."""
        cgroup = self.leftover(name)
        if cgroup is None:
            return
        for _ in range(50):  # SIGKILLed processes go when the kernel next runs them
            cgroup.signal_all(signal.SIGKILL)
            if not cgroup.members():
                break
            await asyncio.sleep(0.02)
        cgroup.remove()


def enforcement(found: Hierarchy | None) -> str:
    """The heartbeat's ``enforcement``: the mode in force, or "none"."""
    return found.enforcement if found is not None else NONE


def _own() -> dict[str, str]:
    try:
        return _own_paths(Path("/proc/self/cgroup").read_text())
    except OSError:
        return {}


def v2_hierarchy() -> tuple[Hierarchy | None, str]:
    """Job cgroups in the v2 hierarchy, tracking only, or why not."""
    own = _own()
    v2 = _v2_mount()
    if v2 is None or "" not in own:
        return None, "v2 not mounted"
    parent = v2 / own[""].lstrip("/") / _PARENT
    why = _usable(parent)
    return (Hierarchy("v2", parent), "") if why is None else (None, f"v2 {why}")


def v1_pids_hierarchy() -> tuple[Hierarchy | None, str]:
    """Job cgroups in the v1 ``pids`` hierarchy, tracking only, or why not."""
    own = _own()
    if "pids" not in own or not (_ROOT / "pids" / "cgroup.procs").exists():
        return None, "v1 pids not mounted"
    parent = _ROOT / "pids" / own["pids"].lstrip("/") / _PARENT
    why = _usable(parent)
    return (Hierarchy("v1", parent), "") if why is None else (None, f"v1 pids {why}")


@functools.cache
def v1_enforcing() -> tuple[Hierarchy | None, str]:
    """Job cgroups in each writable v1 controller of memory, cpu, pids and devices (tracked
    in ``pids``, else the first of them), or why none."""
    own = _own()
    found: dict[str, Path] = {}
    reasons = []
    for name in V1_CONTROLLERS:
        mount = _ROOT / name
        if name not in own or not (mount / "cgroup.procs").exists():
            reasons.append(f"{name} not mounted")
            continue
        # resolve(): co-mounted controllers (cpu -> cpu,cpuacct) share one folder.
        parent = mount.resolve() / own[name].lstrip("/") / _PARENT
        why = _usable(parent)
        if why is None:
            found[name] = parent
        else:
            reasons.append(why)
    if not found:
        return None, "v1: " + "; ".join(reasons)
    track = found.get("pids") or next(iter(found.values()))
    return Hierarchy("v1", track, found, enforcement=v1_enforcement(list(found))), ""


@functools.cache
def v2_enforcing() -> tuple[Hierarchy | None, str]:
    """Job cgroups in v2 with the memory, cpu and pids controllers enabled for them, or why
    not. Decided once per process: it may move the executor into a leaf of its own cgroup."""
    own = _own()
    v2 = _v2_mount()
    if v2 is None or "" not in own:
        return None, "v2 not mounted"
    own_dir = v2 / own[""].lstrip("/")
    try:
        available = (own_dir / "cgroup.controllers").read_text().split()
    except OSError as err:
        return None, f"v2 {own_dir}: {err.strerror or err}"
    # Those of memory, cpu and pids it offers (a container may get memory alone); the heartbeat
    # names the rest as not enforced.
    offered = [c for c in V2_CONTROLLERS if c in available]
    if not offered:
        return None, f"v2: {own_dir} offers none of the memory, cpu, pids controllers"
    home, why = _enable_below(own_dir, offered)
    if home is None:
        return None, why
    parent = own_dir / _PARENT
    why2 = _usable(parent)
    if why2 is None:
        try:
            _write(parent / "cgroup.subtree_control", _plus(offered))
        except OSError as err:
            why2 = f"{parent}: {err.strerror or err}"
    if why2 is not None:
        return None, f"v2 {why2}"
    controllers = dict.fromkeys(offered, parent)
    return Hierarchy(
        "v2", parent, controllers, homes={parent: home}, enforcement=v2_enforcement(offered)
    ), ""


def _plus(controllers: list[str]) -> str:
    return " ".join(f"+{c}" for c in controllers)


def _enable_below(own_dir: Path, controllers: list[str]) -> tuple[Path | None, str]:
    """Enable ``controllers`` for cgroups below ``own_dir``; the executor's home cgroup after
    that, or why it can't be done. A cgroup that holds processes (the executor's, under a
    systemd unit with Delegate=yes) may not: the executor moves itself into a leaf first."""
    control = own_dir / "cgroup.subtree_control"
    try:
        _write(control, _plus(controllers))
        return own_dir, ""
    except OSError as err:
        if err.errno != errno.EBUSY:
            return None, f"v2 {control}: {err.strerror or err}"
    leaf = own_dir / _V2_LEAF
    try:
        leaf.mkdir(exist_ok=True)
        _write(leaf / "cgroup.procs", str(os.getpid()))
    except OSError as err:
        return None, f"v2 {leaf}: {err.strerror or err}"
    try:
        _write(control, _plus(controllers))
        return leaf, ""
    except OSError as err:
        with contextlib.suppress(OSError):
            _write(own_dir / "cgroup.procs", str(os.getpid()))
            leaf.rmdir()
        return None, (
            f"v2 {control}: {err.strerror or err} (other processes share the executor's cgroup: "
            "give it one of its own, e.g. systemd Delegate=yes)"
        )


@functools.cache
def hierarchy(enforce: bool = True) -> Hierarchy | None:
    """The hierarchy in force for this process (decided once, logged once). ``enforce``
    False (GPULAYER_EXECUTOR_ENFORCE=off): tracking only, whatever the machine allows."""
    reasons = []
    choosers: list[Callable[[], tuple[Hierarchy | None, str]]] = [v2_hierarchy, v1_pids_hierarchy]
    if enforce:
        choosers = [v2_enforcing, v1_enforcing, *choosers]
    for choose in choosers:
        found, why = choose()
        if found is not None:
            log.info("job processes are kept in cgroup %s under %s", found.kind, found.parent)
            return found
        reasons.append(why)
    log.info(
        "no writable cgroup (%s): a job's escaped children are found by walking /proc for "
        "its GPULAYER_GRANT_ID",
        "; ".join(reasons),
    )
    return None
