"""A scheduling batch's outcome written to PostgreSQL: preemption marks, gangs' ranks, the
placements (allocations, reservations, owner holds and job rows in one statement), failures
and changed waiting reasons, all on the batch's connection and in its transaction."""

from __future__ import annotations

from typing import Any

from gpulayer_matching.resources import job_millicores
from gpulayer_placement import dependencies
from gpulayer_placement.fleet import Fleet
from gpulayer_placement.gangs import Gangs
from gpulayer_placement.outcome import Outcome, PlacedJob, mode
from gpulayer_placement.store import Store


async def persist(
    conn: Any, outcome: Outcome, *, gangs: Gangs, fleet: Fleet, replica_id: str
) -> None:
    """Allocations and job rows of ``outcome`` in one statement each, on ``conn``."""
    for job_id, priority, victims in outcome.preempt:
        outcome.cancels += await Store.fetch(conn, "mark_preempted", victims, job_id, priority)
    for gang_id in await gangs.persist(conn, outcome):
        gangs.unplace(gang_id, outcome)
    if outcome.placements:
        alloc: tuple[list[str], list[str], list[int], list[str]] = ([], [], [], [])
        for pl in outcome.placements:
            for d in pl.placement.devices:
                alloc[0].append(pl.job.job_id)
                alloc[1].append(pl.placement.node_id)
                alloc[2].append(d)
                alloc[3].append(mode(pl.placement))
        ps = outcome.placements
        held = _reservation_rows(fleet, ps)
        await Store.execute(
            conn,
            "place_jobs",
            [pl.job.job_id for pl in ps],
            [pl.placement.node_id for pl in ps],
            [pl.grant_id for pl in ps],
            [pl.placement.accelerator for pl in ps],
            ["{" + ",".join(map(str, pl.placement.devices)) + "}" for pl in ps],
            *alloc,
            replica_id,
            *held,
            [pl.owner for pl in ps],
            [len(pl.placement.devices) for pl in ps],
            [job_millicores(pl.job) for pl in ps],
        )
    if outcome.failed:
        await Store.execute(
            conn, "fail_pending", [j for j, _ in outcome.failed], [r for _, r in outcome.failed]
        )
        # Jobs waiting for one that failed here are cancelled naming it, as for any failure
        # (announced from the outbox).
        await dependencies.release(conn, [(j, "failed") for j, _ in outcome.failed])
    if outcome.waiting:
        await Store.execute(
            conn,
            "mark_waiting",
            [j for j, _ in outcome.waiting],
            [d.summary for _, d in outcome.waiting],
            [d.unsatisfiable for _, d in outcome.waiting],
        )


def _reservation_rows(
    fleet: Fleet, placed: list[PlacedJob]
) -> tuple[list[str], list[str], list[str], list[int], list[int | None]]:
    """``place_jobs``' reservation columns: job, node, resource, amount, and the capacity
    this replica matched against (the database's trigger checks the sum against it)."""
    rows: tuple[list[str], list[str], list[str], list[int], list[int | None]] = (
        [],
        [],
        [],
        [],
        [],
    )
    capacities: dict[str, dict[str, int | None]] = {}
    for pl in placed:
        node = pl.placement.node_id
        cap = capacities.get(node)
        if cap is None:
            view = fleet.get(node)
            cap = capacities[node] = Fleet.capacities(view) if view else {}
        for resource, amount in pl.held:
            rows[0].append(pl.job.job_id)
            rows[1].append(node)
            rows[2].append(resource)
            rows[3].append(amount)
            rows[4].append(cap.get(resource))
    return rows
