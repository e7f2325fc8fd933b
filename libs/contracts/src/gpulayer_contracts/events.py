"""Grants, executor status and job events: everything placement and executors say about jobs."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Literal

import msgspec

from gpulayer_contracts._base import Wire
from gpulayer_contracts.jobs import Accelerator, JobRequest


def utcnow() -> datetime:
    return datetime.now(UTC)


class GangRank(Wire, frozen=True):
    """One rank (node) of a distributed job, as its grant carries it (issue 14).

    A distributed job of ``nnodes`` nodes is placed as ``nnodes`` rank jobs at once, each with
    its own grant; the grant's ``job.job_id`` is the rank's own id (``rank_job_id``), its events
    and logs go there, and ``job_id`` here is the distributed job's id the user submitted
    (``GPULAYER_JOB_ID``). Rank 0's node hosts the rendezvous at ``master_addr:master_port``
    (an address its probe advertises, a port placement reserved for the job there)."""

    job_id: str
    rank: int
    nnodes: int
    nproc_per_node: int
    master_addr: str
    master_port: int

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


class RankPlacement(Wire, frozen=True):
    """Where one rank of a distributed job was placed (in its ``placed`` event)."""

    rank: int
    node_id: str
    job_id: str
    devices: list[int] = []


class Grant(Wire, frozen=True):
    """Placement's decision, sent to the chosen node on ``gpulayer.node.<node>.grants``.

    ``visible_env`` holds the device visibility variables the executor must set; it was computed
    by placement from the granted devices and the job's sandbox grant.
    """

    grant_id: str
    job: JobRequest
    node_id: str
    accelerator: Accelerator
    devices: list[int] = []
    visible_env: dict[str, str] = {}
    granted_at: datetime = msgspec.field(default_factory=utcnow)
    # Who submitted the job, as placement established it from the submit subject (never the
    # job's own payload): the executor publishes the job's events and logs under it, and picks
    # the local account the job runs as by it. "anonymous" without auth.
    owner: str = "anonymous"
    # MIG instances granted (``MIG-...`` UUIDs): then ``devices`` are their parent GPUs, whose
    # device nodes the job must open, and CUDA_VISIBLE_DEVICES names the instances.
    instance_uuids: list[str] = []
    # A rank of a distributed job: the executor sets the rendezvous environment and, with
    # ``job.distributed.launcher = "torchrun"``, starts the command through torchrun.
    gang: GangRank | None = None


ExecState = Literal["running", "succeeded", "failed", "cancelled", "lost"]


class JobStatus(Wire, frozen=True):
    """Executor → placement on ``gpulayer.node.<node>.status``."""

    job_id: str
    grant_id: str
    node_id: str
    state: ExecState
    at: datetime = msgspec.field(default_factory=utcnow)
    pid: int | None = None
    exit_code: int | None = None
    signal: int | None = None
    reason: str | None = None


class CancelJob(Wire, frozen=True):
    """Placement → executor on ``gpulayer.node.<node>.control``."""

    job_id: str
    reason: str = "cancelled by user"
    # The grant being cancelled: placement's signature binds the cancel to it. Empty from a
    # placement older than signing (whose cancels an executor that requires signatures refuses).
    grant_id: str = ""
    # Placement has ended this grant's job already (``lost`` with its node, which was cut off
    # rather than down): stop it, and report its end to placement alone (which frees what the
    # grant held there); the job's outcome was told.
    given_up: bool = False


class LogLine(Wire, frozen=True):
    """One output line of a job on ``gpulayer.job.<owner>.<job>.logs``."""

    job_id: str
    stream: Literal["stdout", "stderr"]
    line: str
    at: datetime = msgspec.field(default_factory=utcnow)


# --- Job events: one tagged union on gpulayer.job.<owner>.<job>.events, tag field "type". ---


class JobEvent(Wire, frozen=True, tag_field="type"):
    job_id: str
    at: datetime = msgspec.field(default_factory=utcnow)
    # The job's owner: its events are published on gpulayer.job.<owner>.<job>.events.
    owner: str = "anonymous"


class Accepted(JobEvent, frozen=True, tag="accepted", kw_only=True):
    warnings: list[str] = []
    # The runtime profile the job named (name@version), its requirements expanded into the job.
    profile: str | None = None


class Rejected(JobEvent, frozen=True, tag="rejected", kw_only=True):
    reasons: list[str] = []
    profile: str | None = None


class Pending(JobEvent, frozen=True, tag="pending", kw_only=True):
    """The job waits. ``unsatisfiable`` says no node in the fleet could ever run it now."""

    summary: str = ""
    reasons: list[str] = []
    unsatisfiable: bool = False


class Placed(JobEvent, frozen=True, tag="placed", kw_only=True):
    node_id: str
    accelerator: Accelerator
    devices: list[int] = []
    profile: str | None = None
    # A distributed job: every rank, rank 0 first (``node_id``/``devices`` are rank 0's).
    ranks: list[RankPlacement] = []


class Running(JobEvent, frozen=True, tag="running", kw_only=True):
    node_id: str
    pid: int | None = None
    # A rank of a distributed job: which one this report is about (a rank's own events,
    # and the end of the distributed job that a rank caused).
    rank: int | None = None


class Succeeded(JobEvent, frozen=True, tag="succeeded", kw_only=True):
    node_id: str
    exit_code: int = 0
    # A rank of a distributed job: which one this report is about (a rank's own events,
    # and the end of the distributed job that a rank caused).
    rank: int | None = None


class Failed(JobEvent, frozen=True, tag="failed", kw_only=True):
    node_id: str | None = None
    exit_code: int | None = None
    signal: int | None = None
    reason: str | None = None
    # A rank of a distributed job: which one this report is about (a rank's own events,
    # and the end of the distributed job that a rank caused).
    rank: int | None = None


class Cancelled(JobEvent, frozen=True, tag="cancelled", kw_only=True):
    node_id: str | None = None
    reason: str | None = None
    # A rank of a distributed job: which one this report is about (a rank's own events,
    # and the end of the distributed job that a rank caused).
    rank: int | None = None


class Lost(JobEvent, frozen=True, tag="lost", kw_only=True):
    node_id: str | None = None
    reason: str | None = None
    # A rank of a distributed job: which one this report is about (a rank's own events,
    # and the end of the distributed job that a rank caused).
    rank: int | None = None


class Requeued(JobEvent, frozen=True, tag="requeued", kw_only=True):
    """The job's attempt ended (``ended``: lost, failed, or a service's exit) and it waits to be
    placed again, under the same id: a retry of a job, or a service's restart. ``requeues``
    counts them so far; ``not_before``: a service's backoff, it is not placed before then."""

    node_id: str | None = None
    ended: str = "lost"
    reason: str | None = None
    requeues: int = 1
    not_before: datetime | None = None


class Warned(JobEvent, frozen=True, tag="warning", kw_only=True):
    """Something the job's owner should know while it runs: a device it holds turned
    unhealthy (``devices``), with the reason. Not a state change: the job keeps running."""

    node_id: str | None = None
    devices: list[int] = []
    reason: str | None = None


AnyJobEvent = (
    Accepted
    | Rejected
    | Pending
    | Placed
    | Running
    | Succeeded
    | Failed
    | Cancelled
    | Lost
    | Requeued
    | Warned
)

TERMINAL_EVENT_TYPES = frozenset({"rejected", "succeeded", "failed", "cancelled", "lost"})


def is_terminal(event: JobEvent) -> bool:
    return isinstance(event, Rejected | Succeeded | Failed | Cancelled | Lost)
