"""A shim's job cgroup kept for its next job (cgroup v1): renamed, not removed and made again.

A spawn of ``true`` cost the machine 800-950 µs of CPU here without a cgroup, 2,000-2,100 in a
cgroup made in the four v1 hierarchies, limited and removed (most of the difference the kernel's
set-up and tear-down of a memory cgroup), 1,600-1,800 in a kept one renamed (200 µs of it the
renames) and its limits left as they were (docs/performance.md). A shim runs one job at a
time, so it keeps its last job's cgroup, empty, as ``spare-<its pid>`` in each hierarchy and
renames it to the next job's grant id: a job's cgroup has its grant's name while the job runs,
as before (``Hierarchy.clear_leftover`` finds it after a crash).

Handed on only when nothing of the last job can reach the next one: nothing left inside, every
limit written (``JobCgroup.applied``), less than ``KEEP_MAX_BYTES`` of memory still charged
(files a job left in tmpfs stay charged to its cgroup), and the next job's memory, CPU and pids
limits the same as the last one's; its devices are written again where they differ, its peak
and OOM counters start from where they stand. Else the spare is removed and a fresh cgroup made.
cgroup v2 refuses a rename: there every job gets a fresh cgroup.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re

from gpulayer_executor import procs
from gpulayer_executor.cgroups import Hierarchy
from gpulayer_executor.job_cgroup import JobCgroup
from gpulayer_executor.limits import JobLimits

log = logging.getLogger("gpulayer_executor.cgroups")

SPARE = "spare-"
KEEP_MAX_BYTES = 16 << 20
_SPARE_NAME = re.compile(re.escape(SPARE) + r"([0-9]+)")


def same_resources(a: JobLimits | None, b: JobLimits) -> bool:
    """``a``'s memory, CPU and pids limits are ``b``'s (devices may differ). Pure."""
    return a is not None and (a.memory_bytes, a.cpu_quota_us, a.pids_max) == (
        b.memory_bytes,
        b.cpu_quota_us,
        b.pids_max,
    )


class Spare:
    """The one cgroup a shim keeps between its jobs."""

    def __init__(self) -> None:
        self._kept: JobCgroup | None = None

    def take(self, hierarchy: Hierarchy, name: str, limits: JobLimits) -> JobCgroup | None:
        """The cgroup for the job of grant ``name``: the kept one renamed where it fits, else a
        fresh one (None, logged, when none can be made)."""
        kept, self._kept = self._kept, None
        if kept is not None:
            if kept.hierarchy is hierarchy and same_resources(kept.applied, limits):
                try:
                    kept.reuse_for(limits)
                    kept.rename(name)
                    return kept
                except OSError as err:
                    log.info("spare cgroup %s not reused: %s", kept.path, err)
            kept.remove()
        return hierarchy.create(name)

    def park(self, cgroup: JobCgroup) -> None:
        """The job of ``cgroup`` is over: keep it for the next job if it may be handed on, else
        remove it."""
        if self._kept is not None:  # pragma: no cover - a shim runs one job at a time
            self._kept.remove()
            self._kept = None
        if cgroup.hierarchy.version != "v1" or cgroup.applied is None or not _empty(cgroup):
            cgroup.remove()
            return
        try:
            cgroup.rename(f"{SPARE}{os.getpid()}")
        except OSError as err:
            log.info("cgroup %s not kept: %s", cgroup.path, err)
            cgroup.remove()
            return
        self._kept = cgroup

    def close(self) -> None:
        """The shim is ending: its spare goes."""
        kept, self._kept = self._kept, None
        if kept is not None:
            kept.remove()


def _empty(cgroup: JobCgroup) -> bool:
    """No process left in it, and little memory still charged to it."""
    if cgroup.members():
        return False
    if "memory" not in cgroup.hierarchy.controllers:
        return True
    try:
        charged = int(cgroup.file("memory", "memory.usage_in_bytes").read_text())
    except (OSError, ValueError):
        return False
    return charged < KEEP_MAX_BYTES


def sweep(hierarchy: Hierarchy | None) -> int:
    """Remove the spares of shims that are gone (killed before they could remove their own);
    how many. Run by the executor as it starts: a live shim's spare is left to it."""
    if hierarchy is None:
        return 0
    removed = 0
    for parent in hierarchy.parents:
        try:
            names = [e.name for e in os.scandir(parent) if e.is_dir(follow_symlinks=False)]
        except OSError:
            continue
        for name in names:
            found = _SPARE_NAME.fullmatch(name)
            if found is None or procs.pid_alive(int(found.group(1))):
                continue
            with contextlib.suppress(OSError):  # still in use: a process inside, or gone already
                (parent / name).rmdir()
                removed += 1
    return removed
