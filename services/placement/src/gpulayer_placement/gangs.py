"""Distributed jobs in a scheduling pass (issue 14): a gang is matched whole (N distinct nodes,
``gpulayer_matching.gang``), its N rank jobs held in memory at once, and committed with the
rest of the batch: the rendezvous port, the rank rows, the gang row, then every rank's
allocations and reservations in ``place_jobs``, all in the pass's one transaction. A conflict
with another replica rolls the whole transaction back, so a gang is never partly held.

No deadlock: a gang holds nothing until all its ranks fit, and then all at once. No
starvation: the first gang that can't be placed in a full pass keeps the nodes where it would
start soonest (the queue policy's reservation, over several nodes); jobs that hold devices go
there only when their timeout ends before the gang could start (docs/placement-rules.md).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec

from gpulayer_contracts import JobRequest, encode
from gpulayer_contracts.events import GangRank
from gpulayer_contracts.jobs import rank_job_id
from gpulayer_contracts.validation import requested_gpu_count
from gpulayer_matching import NodeView, NoPlacement, Placement, would_fit_when_idle
from gpulayer_matching.gang import GangPlacement, fitting_nodes, match_gang
from gpulayer_matching.resources import job_millicores
from gpulayer_placement import quotas as q
from gpulayer_placement.fleet import Fleet
from gpulayer_placement.outcome import Outcome, PlacedJob, mode
from gpulayer_placement.policy import Policy, Reservation
from gpulayer_placement.preemption import room_after
from gpulayer_placement.store import Store

log = logging.getLogger("gpulayer_placement.service")

# (row, job, placement, owner, match times, outcome): the scheduler's own bookkeeping of one
# placement (holds, queue policy), reused for each rank.
PlaceOne = Callable[[Any, JobRequest, Placement, str, tuple[int, int], Outcome], None]


def rank_request(job: JobRequest, rank: int) -> JobRequest:
    """What rank ``rank``'s grant carries: the job under the rank's id, never retried,
    restarted, preempted, in an array or waiting for others (the gang row is all that)."""
    return msgspec.structs.replace(
        job,
        job_id=rank_job_id(job.job_id, rank),
        retries=0,
        retry_on_failure=False,
        kind="job",
        restart=None,
        array=None,
        after=[],
        preemptible=False,
    )


class Gangs:
    def __init__(self, *, fleet: Fleet, policy: Policy, ports: tuple[int, int]) -> None:
        self.fleet = fleet
        self.policy = policy
        self.ports = ports

    def match_row(
        self,
        row: Any,
        job: JobRequest,
        owner: str,
        outcome: Outcome,
        place_one: PlaceOne,
        *,
        reserve: bool,
        failed: dict[bytes, NoPlacement],
        key: bytes,
    ) -> NoPlacement | None:
        """Place the gang of ``row`` whole into ``outcome`` (None), or say why it waits.
        ``failed``: requirement sets that found too few nodes earlier in this pass (capacity
        only shrinks during a pass), under ``key``."""
        job_id = row["job_id"]
        priority = row.get("priority") or 0
        t0 = time.time_ns()
        decision: GangPlacement | NoPlacement | None = failed.get(key)
        if decision is None:
            decision = match_gang(job, self.fleet.rotated())
            if isinstance(decision, NoPlacement):
                failed[key] = decision
        if isinstance(decision, GangPlacement):
            decision = self._admit(job_id, job, decision, owner, priority)
        if isinstance(decision, NoPlacement):
            if reserve and self.policy.reservation is None and not decision.unsatisfiable:
                self._reserve(job_id, job, priority)
            return decision
        t1 = time.time_ns()
        for rank, placement in enumerate(decision.ranks):
            rank_row = {
                "job_id": rank_job_id(job_id, rank),
                "attempt": 0,
                "traceparent": row["traceparent"],
                "submitted_at": row["submitted_at"],
                "priority": priority,
            }
            place_one(rank_row, rank_request(job, rank), placement, owner, (t0, t1), outcome)
            outcome.placements[-1] = dataclasses.replace(outcome.placements[-1], gang_id=job_id)
        outcome.gangs[job_id] = (job, owner, decision.master_addr)
        self.policy.clear_reservation(job_id)
        return None

    def _admit(
        self, job_id: str, job: JobRequest, gang: GangPlacement, owner: str, priority: int
    ) -> GangPlacement | NoPlacement:
        """The queue policy's word on a whole gang: its owner's quota for all ranks together,
        then the reservation kept for another job (the gang goes elsewhere, or waits)."""
        n = len(gang.ranks)
        need = q.job_need(sum(len(p.devices) for p in gang.ranks), gang.ranks[0].accelerator, 0)
        need[q.JOBS] = n
        need[q.CORES] = job_millicores(job) * n
        why = self.policy.over_quota_need(owner, need)
        if why is not None:
            return NoPlacement(summary=why, reasons=[why], unsatisfiable=False)
        if all(
            self.policy.may_backfill(job_id, job, p.node_id, len(p.devices), priority)
            for p in gang.ranks
        ):
            return gang
        r = self.policy.reservation
        assert r is not None
        kept = r.kept()
        again = match_gang(job, [v for v in self.fleet.rotated() if v.node_id not in kept])
        if isinstance(again, GangPlacement):
            return again
        why = r.why()
        return NoPlacement(summary=why, reasons=[why, *again.reasons], unsatisfiable=False)

    def _reserve(self, job_id: str, job: JobRequest, priority: int) -> None:
        """Keep for the gang the N nodes where a rank could start soonest: free ones now, the
        others when enough of their jobs' timeouts have run out (a job without one never
        ends). Nothing when fewer than N nodes could ever take a rank."""
        if requested_gpu_count(job) == 0:
            return  # reservations keep devices; a gang holding none waits like any such job
        want = job.distributed.nodes if job.distributed is not None else 1
        now = time.time()
        views = self.fleet.views()
        fit_now = {p.node_id for p in fitting_nodes(job, views)}
        ends: list[tuple[float, str]] = []
        for view in views:
            until = self._free_at(job, view, now, fit_now)
            if until is not None:
                ends.append((until, view.node_id))
        self.policy.mark_reserved()
        if len(ends) < want:
            return
        ends.sort()
        chosen = ends[:want]
        self.policy.reservation = Reservation(
            job_id,
            chosen[0][1],
            chosen[-1][0],
            priority,
            nodes=frozenset(n for _, n in chosen),
        )

    def _free_at(
        self, job: JobRequest, view: NodeView, now: float, fit_now: set[str]
    ) -> float | None:
        if view.node_id in fit_now:
            return now
        if not view.online or not would_fit_when_idle(job, view):
            return None
        on_node = list(self.policy.by_node.get(view.node_id, {}).values())
        if not on_node:
            return None
        order = sorted(on_node, key=lambda a: (a.ends_at, a.job_id))
        n = room_after(job, view, order, on_node, self.fleet.reserved_items)
        return None if n is None else order[n - 1].ends_at

    async def persist(self, conn: Any, outcome: Outcome) -> list[str]:
        """Before ``place_jobs``: each gang's rendezvous port on rank 0's node, its rank rows
        (with the GangRank their grants carry) and the gang row placed. A gang for which no
        port is free on that node is taken out of ``outcome`` (returned: the caller releases its
        holds and it waits)."""
        if not outcome.gangs:
            return []
        lo, hi = self.ports
        dropped: list[str] = []
        ranks: dict[str, list[int]] = {}
        for i, pl in enumerate(outcome.placements):
            if pl.gang_id is not None:
                ranks.setdefault(pl.gang_id, []).append(i)
        cols: tuple[list[Any], ...] = ([], [], [], [], [], [], [], [])
        for gang_id, (job, owner, addr) in list(outcome.gangs.items()):
            idx = ranks.get(gang_id, [])
            rank0 = outcome.placements[idx[0]]
            got = await Store.fetchrow(
                conn, "reserve_gang_port", gang_id, rank0.placement.node_id, lo, hi
            )
            if got is None:
                dropped.append(gang_id)
                continue
            port = got["port"]
            dist = job.distributed
            nproc = dist.processes_per_node if dist is not None else 1
            for rank, i in enumerate(idx):
                pl = outcome.placements[i]
                gang = GangRank(
                    job_id=gang_id,
                    rank=rank,
                    nnodes=len(idx),
                    nproc_per_node=nproc,
                    master_addr=addr,
                    master_port=int(port),
                )
                outcome.placements[i] = dataclasses.replace(pl, gang=gang)
                for col, value in zip(
                    cols,
                    (
                        pl.job.job_id,
                        encode(pl.job).decode(),
                        pl.traceparent,
                        owner,
                        self._priority(pl),
                        gang_id,
                        rank,
                        encode(gang).decode(),
                    ),
                    strict=True,
                ):
                    col.append(value)
        placed = [g for g in outcome.gangs if g not in dropped]
        if placed:
            await Store.execute(conn, "insert_ranks", *cols)
            await Store.execute(conn, "place_gangs", placed)
        return dropped

    def unplace(self, gang_id: str, outcome: Outcome) -> None:
        """A gang that got no rendezvous port: its ranks' holds given back, and it waits."""
        ranks = [pl for pl in outcome.placements if pl.gang_id == gang_id]
        outcome.placements = [pl for pl in outcome.placements if pl.gang_id != gang_id]
        for pl in ranks:
            self.fleet.release(pl.placement.node_id, pl.placement.devices, mode(pl.placement))
            self.fleet.unreserve(pl.job.job_id)
            self.policy.remove(pl.job.job_id, ended=False)
        _, owner, _ = outcome.gangs.pop(gang_id)
        node = ranks[0].placement.node_id if ranks else "?"
        outcome.waiting.append((gang_id, no_port(node, self.ports)))
        outcome.owners[gang_id] = owner

    def _priority(self, pl: PlacedJob) -> int:
        a = self.policy.active.get(pl.job.job_id)
        return a.priority if a is not None else 0


def no_port(node_id: str, ports: tuple[int, int]) -> NoPlacement:
    why = (
        f"no rendezvous port of {ports[0]}-{ports[1]} is free on node {node_id} "
        "(GPULAYER_RENDEZVOUS_PORTS): every one is held by another distributed job"
    )
    return NoPlacement(summary=why, reasons=[why], unsatisfiable=False)
