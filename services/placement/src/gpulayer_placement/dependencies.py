"""Dependencies between jobs (``after``): checked at submit, recorded with the job, and released
when a dependency ends.

A job waits (``blocked``, never even matched) until every job it names has succeeded; one that
ended otherwise (failed, cancelled, lost for good, rejected) cancels it, naming which, and its
own dependents after it. Dependencies must be stored before the job naming them, or come in the
same batch: an unknown id is rejected at submit, so no cycle can reach a stored job, and cycles
within one batch are found here. A dependency must belong to the same owner (the anonymous
owner, an admin or auth off, may name any).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpulayer_contracts import Cancelled, JobRequest
from gpulayer_contracts.subjects import ANONYMOUS
from gpulayer_placement import outbox
from gpulayer_placement.store import Store

ENDED_BADLY = frozenset({"failed", "cancelled", "lost", "rejected"})


@dataclass
class Checked:
    """What ``check`` found: jobs to reject (with why), the (job, dependency) rows to record, and
    the jobs that wait for some dependency."""

    rejections: dict[str, list[str]] = field(default_factory=dict)
    pairs: list[tuple[str, str]] = field(default_factory=list)
    blocked: set[str] = field(default_factory=set)


def judge(
    jobs: Mapping[str, JobRequest],
    owners: Mapping[str, str],
    stored: Mapping[str, tuple[str, str]],
) -> Checked:
    """Pure: ``jobs`` (new, valid, by id), their ``owners``, and ``stored``: the state and owner
    of every named id already in the database. Unknown, foreign or badly ended dependencies and
    cycles reject the job; a job whose dependency was rejected is rejected too."""
    out = Checked()
    waiting = {j: job for j, job in jobs.items() if job.after and j not in stored}
    in_batch: dict[str, list[str]] = {}
    for job_id, job in waiting.items():
        owner = owners.get(job_id, ANONYMOUS)
        errors: list[str] = []
        for i, dep in enumerate(dict.fromkeys(job.after)):
            if dep in stored:
                state, dep_owner = stored[dep]
                if owner not in (ANONYMOUS, dep_owner):
                    errors.append(f"$.after[{i}]: no job {dep!r} of yours")
                elif state in ENDED_BADLY:
                    errors.append(f"$.after[{i}]: job {dep!r} already ended {state}")
                elif state != "succeeded":
                    out.blocked.add(job_id)
            elif dep in jobs:
                if owner not in (ANONYMOUS, owners.get(dep, ANONYMOUS)):
                    errors.append(f"$.after[{i}]: no job {dep!r} of yours")
                in_batch.setdefault(job_id, []).append(dep)
                out.blocked.add(job_id)
            else:
                errors.append(
                    f"$.after[{i}]: no job {dep!r} (a dependency must be submitted first)"
                )
        if errors:
            out.rejections[job_id] = errors
    _reject_cycles(in_batch, out.rejections)
    _reject_behind_rejected(in_batch, out.rejections)
    for job_id in waiting:
        if job_id not in out.rejections:
            out.pairs += [(job_id, dep) for dep in dict.fromkeys(waiting[job_id].after)]
    out.blocked -= set(out.rejections)
    return out


def _reject_cycles(edges: dict[str, list[str]], rejections: dict[str, list[str]]) -> None:
    """Every job on a cycle of dependencies within the batch is rejected, naming the cycle."""
    done: set[str] = set()
    for start in sorted(edges):
        path: list[str] = []
        on_path: set[str] = set()
        stack: list[tuple[str, int]] = [(start, 0)]
        while stack:
            node, i = stack.pop()
            if i == 0:
                if node in done:
                    continue
                path.append(node)
                on_path.add(node)
            nexts = edges.get(node, [])
            if i < len(nexts):
                stack.append((node, i + 1))
                nxt = nexts[i]
                if nxt in on_path:
                    cycle = [*path[path.index(nxt) :], nxt]
                    for member in cycle[:-1]:
                        rejections.setdefault(member, []).append(
                            f"$.after: a cycle of dependencies ({' -> '.join(cycle)})"
                        )
                elif nxt not in done:
                    stack.append((nxt, 0))
            else:
                path.pop()
                on_path.discard(node)
                done.add(node)


def _reject_behind_rejected(edges: dict[str, list[str]], rejections: dict[str, list[str]]) -> None:
    changed = True
    while changed:
        changed = False
        for job_id, deps in edges.items():
            if job_id in rejections:
                continue
            bad = [d for d in deps if d in rejections]
            if bad:
                rejections[job_id] = [f"$.after: job {bad[0]!r} was rejected"]
                changed = True


async def check(conn: Any, jobs: Mapping[str, JobRequest], owners: Mapping[str, str]) -> Checked:
    """``judge`` against the database, in the caller's transaction. The named jobs are locked
    (FOR SHARE) until it commits, so a dependency can't end unseen between this check and the
    insert of the jobs that wait for it."""
    asking = {j: job for j, job in jobs.items() if job.after}
    if not asking:
        return Checked()
    names = sorted({d for job in asking.values() for d in job.after} | set(asking))
    rows = await Store.fetch(conn, "dependency_states", names)
    return judge(jobs, owners, {r["job_id"]: (r["state"], r["owner"]) for r in rows})


async def record(conn: Any, checked: Checked, new: set[str]) -> None:
    """Store the dependencies of the jobs that were inserted (``new``), marking those that wait."""
    pairs = [(j, d) for j, d in checked.pairs if j in new]
    if not pairs:
        return
    await Store.execute(
        conn,
        "record_dependencies",
        [j for j, _ in pairs],
        [d for _, d in pairs],
        sorted(checked.blocked & new),
    )


async def release(conn: Any, ended: list[tuple[str, str]]) -> list[str]:
    """Jobs that had ``ended`` (id, final state) as a dependency: returns those now free to be
    matched. Those cancelled because one ended without succeeding (their own dependents too)
    have their ``cancelled`` put in the outbox, in the caller's transaction: nothing would say
    it again if the replica stopped before publishing it (``outbox``)."""
    succeeded = [j for j, state in ended if state == "succeeded"]
    unblocked: list[str] = []
    if succeeded:
        rows = await Store.fetch(conn, "unblock_dependents", succeeded)
        unblocked = [r["job_id"] for r in rows]
    badly = [(j, state) for j, state in ended if state != "succeeded"]
    cancelled: list[Cancelled] = []
    while badly:  # one level per statement; each job is cancelled once, so this ends
        rows = await Store.fetch(
            conn, "cancel_dependents", [j for j, _ in badly], [s for _, s in badly]
        )
        cancelled += [
            Cancelled(job_id=r["job_id"], reason=r["reason"], owner=r["owner"]) for r in rows
        ]
        badly = [(r["job_id"], "cancelled") for r in rows]
    await outbox.record(conn, cancelled)
    return unblocked
