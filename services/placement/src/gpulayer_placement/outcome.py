"""What a scheduling batch decided (jobs placed, jobs still waiting) and the grant built from a
placement: the data the scheduler hands to the publisher."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpulayer_contracts import Grant, JobRequest
from gpulayer_contracts.capabilities import MIG_INDEX_BASE, AcceleratorDevice, grant_devices
from gpulayer_contracts.events import GangRank, Placed, RankPlacement
from gpulayer_contracts.subjects import ANONYMOUS
from gpulayer_contracts.validation import visibility_env
from gpulayer_matching import NoPlacement, Placement


@dataclass(frozen=True, slots=True)
class PlacedJob:
    job: JobRequest
    placement: Placement
    grant_id: str
    traceparent: str | None
    submitted: float  # epoch seconds the job entered the JOBS stream (or the table)
    match_ns: tuple[int, int]  # wall-clock start/end of matching, for the job's trace
    owner: str = ANONYMOUS  # who submitted it (the submit subject)
    # What it holds besides devices (resources.reservations): cores, RAM, a slot, GPU memory.
    held: list[tuple[str, int]] = field(default_factory=list)
    # A rank of a distributed job (issue 14): its rendezvous, filled once the port is reserved.
    gang: GangRank | None = None
    gang_id: str | None = None


@dataclass
class Outcome:
    placements: list[PlacedJob] = field(default_factory=list)
    waiting: list[tuple[str, NoPlacement]] = field(default_factory=list)
    # Jobs whose matching raised (job id, reason): failed, so a pass goes on without them.
    failed: list[tuple[str, str]] = field(default_factory=list)
    commit_ns: tuple[int, int] = (0, 0)
    owners: dict[str, str] = field(default_factory=dict)  # of waiting jobs; absent: anonymous
    # Preemptions chosen (queue policy): (waiting job, its priority, victims), and the victims
    # PostgreSQL marked (rows of ``mark_preempted``), whose cancels go out after the commit.
    preempt: list[tuple[str, int, list[str]]] = field(default_factory=list)
    cancels: list[Any] = field(default_factory=list)
    # Distributed jobs placed whole (gangs.py): gang id -> (request, owner, master_addr); their
    # ranks are in ``placements`` (``gang`` set once the rendezvous port is reserved).
    gangs: dict[str, tuple[JobRequest, str, str]] = field(default_factory=dict)


def mode(p: Placement) -> str:
    """How the placement holds its devices: the allocation row's ``mode``."""
    return "shared" if p.use == "shared" else "exclusive"


def make_grant(
    job: JobRequest,
    node_id: str,
    grant_id: str,
    accelerator: Any,
    devices: list[int],
    owner: str = ANONYMOUS,
    accelerators: list[AcceleratorDevice] | None = None,
    gang: GangRank | None = None,
) -> Grant:
    """The grant an executor receives: the job, its devices and the visibility env for them.

    ``devices`` are the allocated indices; with the node's ``accelerators``, a MIG instance
    among them becomes its parent GPU in ``devices`` (whose device node the job opens) and its
    UUID in ``instance_uuids`` (what CUDA_VISIBLE_DEVICES names)."""
    instances: list[str] = []
    if accelerators is not None and any(i >= MIG_INDEX_BASE for i in devices):
        devices, instances = grant_devices(accelerators, devices)
    granted = job.sandbox.devices.gpu == "compute"
    return Grant(
        grant_id=grant_id,
        job=job,
        node_id=node_id,
        accelerator=accelerator,
        devices=devices,
        visible_env=visibility_env(accelerator, devices, granted, instances),
        owner=owner,
        instance_uuids=instances,
        gang=gang,
    )


def gang_placed(outcome: Outcome) -> list[Placed]:
    """The ``placed`` event of each distributed job placed whole in ``outcome``, on the job's
    own subject: rank 0's node and devices, and every rank (each rank's own ``placed`` goes on
    its rank job's subject with its grant)."""
    events: list[Placed] = []
    for gang_id, (job, owner, _) in outcome.gangs.items():
        ranks = sorted(
            (pl for pl in outcome.placements if pl.gang_id == gang_id and pl.gang is not None),
            key=lambda pl: pl.gang.rank if pl.gang is not None else 0,
        )
        if not ranks:
            continue
        first = ranks[0].placement
        events.append(
            Placed(
                job_id=gang_id,
                node_id=first.node_id,
                accelerator=first.accelerator,
                devices=first.devices,
                owner=owner,
                profile=job.profile,
                ranks=[
                    RankPlacement(
                        rank=r,
                        node_id=pl.placement.node_id,
                        job_id=pl.job.job_id,
                        devices=pl.placement.devices,
                    )
                    for r, pl in enumerate(ranks)
                ],
            )
        )
    return events
