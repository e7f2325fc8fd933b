"""Queue policy: the order waiting jobs are matched in, quotas, the reservation that keeps a
large job from starving, and what preemption may take. docs/placement-rules.md ("Order of
decisions") is the rule; this is its state.

It keeps, per replica, the placed and running jobs (``Active``: owner, node, devices, priority,
when they end), per-owner tallies of what they hold, the quotas and each owner's decayed
GPU-seconds. PostgreSQL is the truth: the tallies are reloaded with the fleet's holds
(replica sync) and every few seconds, and the ``owner_holds`` trigger refuses a placement past a
quota whatever a replica believed.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from gpulayer_contracts import JobRequest
from gpulayer_contracts.subjects import ANONYMOUS
from gpulayer_matching import NodeView, would_fit_when_idle
from gpulayer_placement import quotas as q
from gpulayer_placement.preemption import Active, Items, room_after
from gpulayer_placement.store import Store

# How often the quotas and owners' ended usage are read again from PostgreSQL (another
# replica's quota change or job ends reach this one within that).
REFRESH_S = 5.0
# How often a full pass may recompute the reservation (it scans the nodes that could run the
# job): in between, the last one stands while its job still waits.
RESERVATION_EVERY_S = 1.0
# ... and at least this many times as long as the last one took to compute.
RESERVATION_COST_SHARE = 10.0


@dataclass(frozen=True, slots=True)
class Reservation:
    """The node kept for the waiting job ``job_id``: no job that holds devices is placed there
    unless its timeout ends by ``until`` (epoch seconds; inf: none is)."""

    job_id: str
    node_id: str
    until: float
    priority: int = 0  # a job of higher priority is ahead of it: the reservation doesn't hold it
    # A distributed job keeps N nodes (``node_id`` among them): ``until`` is when the last of
    # them frees up (gangs.py).
    nodes: frozenset[str] = frozenset()
    # The waiting job itself (single-node reservations): a job that leaves it room once the
    # node's blockers end may go there anyway (``Gate.admit``), as Slurm's backfill does.
    job: JobRequest | None = None

    def kept(self) -> frozenset[str]:
        """Every node kept for the job."""
        return self.nodes | {self.node_id}

    def why(self) -> str:
        """Why a job that would delay the reservation's job waits (explain, pending)."""
        where = (
            f"node {self.node_id} is"
            if not self.nodes
            else f"nodes {', '.join(sorted(self.kept()))} are"
        )
        return (
            f"{where} kept for job {self.job_id}, waiting longer for its devices; this job's "
            "timeout_s does not end before that job can start"
        )


class _Tally:
    __slots__ = ("gpu_started", "gpus", "held")

    def __init__(self) -> None:
        self.held: dict[str, int] = {}
        self.gpus = 0  # devices held now
        self.gpu_started = 0.0  # sum of gpus * started over active jobs: running GPU-seconds


class Policy:
    def __init__(self) -> None:
        self.active: dict[str, Active] = {}
        self.by_node: dict[str, dict[str, Active]] = {}
        self._tally: dict[str, _Tally] = {}
        self.quotas: dict[str, q.Limits] = {}
        self.shares: dict[str, float] = {}  # ended GPU-seconds, decayed, per owner
        self.loaded_at = -math.inf  # monotonic time of the last load_policy
        self.reservation: Reservation | None = None
        self._reserved_at = -math.inf
        self._reserve_s = 0.0  # how long the last reservation took to compute
        # Waiting job -> the victims its preemption is waiting on.
        self.preempting: dict[str, set[str]] = {}
        self.min_preemptible: int | None = None  # lowest priority of a preemptible active job

    # --- What is active ---

    def add(self, a: Active) -> None:
        """A job placed (here, or read from PostgreSQL)."""
        if a.job_id in self.active:
            self.remove(a.job_id, ended=False)
        self.active[a.job_id] = a
        self.by_node.setdefault(a.node_id, {})[a.job_id] = a
        t = self._tally.setdefault(a.owner, _Tally())
        for resource, amount in q.job_need(a.gpus, a.accelerator, a.millicores).items():
            t.held[resource] = t.held.get(resource, 0) + amount
        t.gpus += a.gpus
        t.gpu_started += a.gpus * a.started
        if a.preemptible and not a.preempting:
            p = self.min_preemptible
            self.min_preemptible = a.priority if p is None else min(p, a.priority)

    def remove(self, job_id: str, *, ended: bool = True) -> None:
        """A job ended, was requeued or lost: its holds go; with ``ended`` its GPU-seconds count
        for fair share at once (PostgreSQL's sum is read again later)."""
        a = self.active.pop(job_id, None)
        self.preempting.pop(job_id, None)
        self.clear_reservation(job_id)
        if a is None:
            return
        node = self.by_node.get(a.node_id)
        if node is not None:
            node.pop(job_id, None)
        t = self._tally[a.owner]
        for resource, amount in q.job_need(a.gpus, a.accelerator, a.millicores).items():
            t.held[resource] = t.held.get(resource, 0) - amount
        t.gpus -= a.gpus
        t.gpu_started -= a.gpus * a.started
        if ended and a.gpus:
            spent = a.gpus * max(0.0, time.time() - a.started)
            self.shares[a.owner] = self.shares.get(a.owner, 0.0) + spent

    def replace(self, rows: Iterable[Active], nodes: Iterable[str] | None) -> None:
        """The active jobs on ``nodes`` (None: all) as PostgreSQL has them. A job held here that
        PostgreSQL no longer has active ended, was requeued or lost elsewhere (another
        replica applied it): its GPU time counts as ended at once, as the holds trigger has
        counted it there, rather than vanishing from its owner's usage until the next
        ``load_policy``."""
        fresh = list(rows)
        still = {a.job_id for a in fresh}
        targets = set(self.by_node) if nodes is None else set(nodes)
        for node in targets:
            for job_id in list(self.by_node.get(node, {})):
                self.remove(job_id, ended=job_id not in still)
        for a in fresh:
            self.add(a)
        self._recount_preemptible()

    def _recount_preemptible(self) -> None:
        prios = [a.priority for a in self.active.values() if a.preemptible and not a.preempting]
        self.min_preemptible = min(prios) if prios else None

    def load_policy(self, rows: Iterable[Any]) -> None:
        """Quotas and decayed shares from ``load_policy``'s rows."""
        quotas: dict[str, q.Limits] = {}
        shares: dict[str, float] = {}
        for r in rows:
            if r["kind"] == "quota":
                quotas.setdefault(r["owner"], {})[r["resource"]] = int(r["value"])
            else:
                shares[r["owner"]] = float(r["value"])
        self.quotas, self.shares = quotas, shares
        self.loaded_at = time.monotonic()

    def stale(self) -> bool:
        return time.monotonic() - self.loaded_at > REFRESH_S

    # --- Fair share ---

    def usage(self, owner: str, now: float | None = None) -> float:
        """The owner's recent GPU-seconds: ended ones decayed, plus those of running jobs."""
        t = self._tally.get(owner)
        ended = self.shares.get(owner, 0.0)
        if t is None or not t.gpus:
            return ended
        now = time.time() if now is None else now
        return ended + max(0.0, t.gpus * now - t.gpu_started)

    def gpus_held(self, owner: str) -> int:
        t = self._tally.get(owner)
        return t.gpus if t is not None else 0

    def order(self, rows: Sequence[Any]) -> Iterator[Any]:
        """``rows`` (highest priority first, then oldest) in matching order: within a priority,
        the owner with the least recent usage goes first, then the one holding fewer GPUs now
        (read again after each pick, so owners alternate within a pass), then the oldest job."""
        if not rows:
            return
        now = time.time()
        i = 0
        while i < len(rows):
            prio = rows[i].get("priority") or 0
            queues: dict[str, deque[Any]] = {}
            while i < len(rows) and (rows[i].get("priority") or 0) == prio:
                queues.setdefault(rows[i].get("owner") or ANONYMOUS, deque()).append(rows[i])
                i += 1
            if len(queues) == 1:
                yield from next(iter(queues.values()))
                continue
            usage = {o: self.usage(o, now) for o in queues}
            while queues:
                owner = min(
                    queues,
                    key=lambda o: (usage[o], self.gpus_held(o), queues[o][0]["submitted_at"]),
                )
                dq = queues[owner]
                yield dq.popleft()
                if not dq:
                    del queues[owner]

    # --- Quotas ---

    def over_quota(
        self, owner: str, gpus: int, accelerator: str | None, millicores: int
    ) -> str | None:
        """Why one more such job would take ``owner`` past a quota; None when it fits."""
        if not self.quotas:
            return None
        t = self._tally.get(owner)
        held = t.held if t is not None else {}
        return q.over_quota(self.quotas, owner, held, q.job_need(gpus, accelerator, millicores))

    def over_quota_need(self, owner: str, need: dict[str, int]) -> str | None:
        """``over_quota`` for a need given whole (a distributed job's ranks together)."""
        if not self.quotas:
            return None
        t = self._tally.get(owner)
        return q.over_quota(self.quotas, owner, t.held if t is not None else {}, need)

    # --- No starvation ---

    def new_pass(self) -> bool:
        """A full pass starts. True when it may compute the reservation: the last computation
        (found or not) is older than RESERVATION_EVERY_S, or its job was placed or ended."""
        # At least RESERVATION_EVERY_S, and ten times what the last computation took: scanning
        # a fleet of 10,000 nodes running a million jobs takes seconds, and a pass that
        # computes it holds its batch's grants until it is done.
        every = max(RESERVATION_EVERY_S, RESERVATION_COST_SHARE * self._reserve_s)
        if time.monotonic() - self._reserved_at < every:
            return False
        self.reservation = None
        return True

    def reserve(
        self,
        job_id: str,
        job: JobRequest,
        views: Iterable[NodeView],
        items: Items,
        priority: int = 0,
    ) -> None:
        """Keep for ``job`` (blocked, first in order) the node where enough devices free up
        soonest by the running jobs' timeouts (a job without one never ends)."""
        t0 = self._reserved_at = time.monotonic()
        try:
            self._reserve(job_id, job, views, items, priority)
        finally:
            self._reserve_s = time.monotonic() - t0

    def _reserve(
        self, job_id: str, job: JobRequest, views: Iterable[NodeView], items: Items, priority: int
    ) -> None:
        best: tuple[float, str] | None = None
        for view in views:
            on_node = list(self.by_node.get(view.node_id, {}).values())
            if not on_node or not view.online or not would_fit_when_idle(job, view):
                continue
            order = sorted(on_node, key=lambda a: (a.ends_at, a.job_id))
            if best is not None and (order[0].ends_at, view.node_id) > best:
                continue  # room here comes no sooner than the first end: not before best's
            n = room_after(job, view, order, on_node, items)
            if n is None:
                continue
            until = order[n - 1].ends_at
            if best is None or (until, view.node_id) < best:
                best = (until, view.node_id)
        self.reservation = (
            None if best is None else Reservation(job_id, best[1], best[0], priority, job=job)
        )

    def mark_reserved(self) -> None:
        """A reservation was computed now (found or not): the next waits RESERVATION_EVERY_S."""
        self._reserved_at = time.monotonic()

    def clear_reservation(self, job_id: str) -> None:
        """``job_id`` was placed or ended: its reservation goes, and the next full pass may
        compute one for the job now first in order."""
        if self.reservation is not None and self.reservation.job_id == job_id:
            self.reservation = None
            self._reserved_at = -math.inf

    def may_backfill(
        self, job_id: str, job: JobRequest, node_id: str, devices: int, priority: int = 0
    ) -> bool:
        """Whether a job that holds ``devices`` may go on ``node_id``: yes unless that node is
        reserved for another job of at least its priority, and then only when its timeout ends
        before the reservation's job can start."""
        r = self.reservation
        if r is None or r.job_id == job_id or devices == 0:
            return True
        if r.node_id != node_id and node_id not in r.nodes:
            return True
        if priority > r.priority:
            return True
        return job.timeout_s is not None and time.time() + job.timeout_s <= r.until

    # --- Preemption ---

    def may_preempt(self, job_id: str, priority: int) -> bool:
        """Whether a waiting job of ``priority`` could preempt anything now: some preemptible job
        of lower priority runs, and no victim chosen for it earlier is still running."""
        p = self.min_preemptible
        if p is None or p >= priority:
            return False
        victims = self.preempting.get(job_id)
        return not victims or not any(v in self.active for v in victims)

    def preempted(self, job_id: str, victims: Iterable[str]) -> None:
        """``victims`` were marked in PostgreSQL for ``job_id``: they are no candidates again."""
        chosen = set(victims)
        self.preempting[job_id] = chosen
        for v in chosen:
            a = self.active.get(v)
            if a is not None:
                a.preempting = True
        self._recount_preemptible()

    def active_by_node(self) -> dict[str, list[Active]]:
        return {n: list(jobs.values()) for n, jobs in self.by_node.items() if jobs}


def active_from_row(r: Any) -> Active:
    """An ``Active`` from a ``load_active`` row."""
    started = float(r["started"])
    timeout = r["timeout_s"]
    return Active(
        job_id=r["job_id"],
        node_id=r["node_id"],
        owner=r["owner"] or ANONYMOUS,
        accelerator=r["accelerator"],
        devices=tuple(r["devices"] or ()),
        shared=r["mode"] == "shared",
        priority=r["priority"] or 0,
        preemptible=bool(r["preemptible"]),
        started=started,
        ends_at=started + float(timeout) if timeout is not None else math.inf,
        millicores=int(r["millicores"] or 0),
        preempting=r["preempted_for"] is not None,
    )


async def load_active(policy: Policy, conn: Any, nodes: list[str] | None) -> None:
    """Replace ``policy``'s active jobs on ``nodes`` (None: all) with PostgreSQL's."""
    rows = await Store.fetch(conn, "load_active", nodes)
    policy.replace((active_from_row(r) for r in rows), nodes)


async def load_policy(policy: Policy, conn: Any) -> None:
    """Read the quotas and the owners' decayed usage again."""
    policy.load_policy(await Store.fetch(conn, "load_policy"))
