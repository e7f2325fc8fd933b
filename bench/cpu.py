"""CPU time per part of the full loop, read from the kernel (``/proc/<pid>/stat`` through
psutil): what each process of the loop spent, in µs of CPU (user + system) per job.

A part's time is the sum over its live processes of their own time plus their reaped
children's (``cutime``/``cstime``): a job's ``true`` process and a shim that ended count in
the process that waited for them. Taken before and after a measured span, the difference is
that span's CPU; a process that ended during the span counts only if its parent reaped it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import psutil

# The parts, in the order printed.
PARTS = ("placement", "executor", "shims_and_jobs", "nats", "postgres", "load_generator")


def _own(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return float(t.user + t.system)


def _reaped(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return float(t.children_user + t.children_system)


def tree_cpu(proc: psutil.Process) -> float:
    """The process, its live descendants, and every child any of them reaped."""
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += _own(p) + _reaped(p)
        except psutil.Error:  # ended meanwhile: its time is in its parent's once reaped
            continue
    return total


def loop_cpu(placement: Iterable[int], executor: int | None, nats: int) -> dict[str, float]:
    """Seconds of CPU so far per part: placement (its processes), the executor's own process,
    what runs under it (fork server, shims and the jobs themselves, and any child it reaped
    itself), nats-server, PostgreSQL (every child of this process named ``postgres*`` that is
    none of the above, and its backends) and this process (the load generator). Without an
    executor (placement alone) its two parts stay 0."""
    me = psutil.Process()
    parts = dict.fromkeys(PARTS, 0.0)
    placement = list(placement)
    known = {*placement, executor, nats}
    try:
        for pid in placement:
            parts["placement"] += tree_cpu(psutil.Process(pid))
        if executor is not None:
            ex = psutil.Process(executor)
            parts["executor"] = _own(ex)
            parts["shims_and_jobs"] = tree_cpu(ex) - parts["executor"]
        parts["nats"] = tree_cpu(psutil.Process(nats))
    except psutil.Error:
        pass  # a part gone: the caller's check_alive says why
    for child in me.children():
        try:
            if child.pid not in known and child.name().startswith("postgres"):
                parts["postgres"] += tree_cpu(child)
        except psutil.Error:
            continue
    parts["load_generator"] = _own(me)
    return parts


def per_job_us(
    before: Mapping[str, float], after: Mapping[str, float], jobs: int
) -> dict[str, float]:
    """µs of CPU per job for each part between two ``loop_cpu`` readings, and their total."""
    if jobs <= 0:
        raise ValueError(f"jobs = {jobs}: need at least one")
    out = {k: max(0.0, after.get(k, 0.0) - before.get(k, 0.0)) * 1e6 / jobs for k in PARTS}
    out["total"] = sum(out.values())
    return out
