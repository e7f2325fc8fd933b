"""NATS subjects and JetStream stream definitions, kept in one place.

The stream definitions are plain data; ``gpulayer_runtime.nats`` turns them into server config.
"""

from __future__ import annotations

from typing import Literal

import msgspec

PREFIX = "gpulayer"

# Bare: owner "anonymous" (auth off, or an admin); with a last token: that owner's submits.
JOBS_SUBMIT = f"{PREFIX}.jobs.submit"
JOBS_SUBMIT_OWNED = f"{PREFIX}.jobs.submit.*"
# Both of the above, as one consumer filter.
JOBS_SUBMIT_ALL = f"{PREFIX}.jobs.>"
ANONYMOUS = "anonymous"

NODE_WILDCARD_CAPABILITIES = f"{PREFIX}.node.*.capabilities"
NODE_WILDCARD_HEARTBEAT = f"{PREFIX}.node.*.heartbeat"
NODE_WILDCARD_GRANTS = f"{PREFIX}.node.*.grants"
NODE_WILDCARD_STATUS = f"{PREFIX}.node.*.status"
NODE_WILDCARD_CONTROL = f"{PREFIX}.node.*.control"
NODE_WILDCARD_DOCTOR = f"{PREFIX}.node.*.doctor"
NODE_WILDCARD_OBSERVATIONS = f"{PREFIX}.node.*.observations"
# gpulayer.job.<owner>.<job>.events|logs: a user's credential may read only its own owner token.
JOB_WILDCARD_EVENTS = f"{PREFIX}.job.*.*.events"
JOB_WILDCARD_LOGS = f"{PREFIX}.job.*.*.logs"
DLQ_WILDCARD = f"{PREFIX}.dlq.>"
# gpulayer.audit.<action>: placement and admins publish, admins read (gpulayer_contracts.audit).
AUDIT_WILDCARD = f"{PREFIX}.audit.>"

API_NODES = f"{PREFIX}.api.nodes"
API_JOBS = f"{PREFIX}.api.jobs"
API_JOB = f"{PREFIX}.api.job"
API_EXPLAIN = f"{PREFIX}.api.explain"
API_CANCEL = f"{PREFIX}.api.cancel"
API_MATRIX = f"{PREFIX}.api.matrix"
API_PROFILES = f"{PREFIX}.api.profiles"
API_SERVICES = f"{PREFIX}.api.services"  # lifecycle: long-running services, their restarts
# Placement answers ``gpulayer.api.<verb>`` (caller anonymous) and ``gpulayer.api.<verb>.<caller>``
# (only the caller's credential may publish there, so the token names who asks).
API_VERBS: tuple[str, ...] = (
    API_NODES,
    API_JOBS,
    API_JOB,
    API_EXPLAIN,
    API_CANCEL,
    API_MATRIX,
    API_PROFILES,
    API_SERVICES,
)
# Queue policy (issue 15 part A): quotas, set and listed by admins only.
API_QUOTA = f"{PREFIX}.api.quota"
API_VERBS += (API_QUOTA,)
# Operating on one node (admins only): ``{"op": "forget", "node_id": ...}`` releases what a node
# that never comes back still holds (gpulayer node forget).
API_NODE = f"{PREFIX}.api.node"
API_VERBS += (API_NODE,)

# Header names. Nats-Msg-Id is JetStream's own dedupe header.
MSG_ID_HEADER = "Nats-Msg-Id"


def end_msg_id(grant_id: str) -> str:
    """The ``Nats-Msg-Id`` of a grant's end on its job's events, whoever reports it: the
    executor (the job's own end) or placement (``lost`` with its node). Of the two, JetStream
    keeps the first stored (within the stream's duplicate window): one outcome per grant."""
    return f"{grant_id}:end"


# A dead letter carries the original body and headers, plus these (docs/operations.md, "Dead
# letters"). The original's Nats-Msg-Id moves to DLQ_MSG_ID_HEADER: the entry's own id is
# ``<stream>:<sequence>``, so dead-lettering one message twice keeps one entry.
DLQ_REASON_HEADER = "Gpulayer-Dlq-Reason"
DLQ_CLASS_HEADER = "Gpulayer-Dlq-Class"
DLQ_STREAM_HEADER = "Gpulayer-Dlq-Stream"
DLQ_SUBJECT_HEADER = "Gpulayer-Dlq-Subject"
DLQ_SEQUENCE_HEADER = "Gpulayer-Dlq-Sequence"
DLQ_DELIVERIES_HEADER = "Gpulayer-Dlq-Deliveries"
DLQ_JOB_ID_HEADER = "Gpulayer-Dlq-Job-Id"
DLQ_SIZE_HEADER = "Gpulayer-Dlq-Size"
DLQ_TRUNCATED_HEADER = "Gpulayer-Dlq-Truncated"
DLQ_MSG_ID_HEADER = "Gpulayer-Dlq-Msg-Id"
# The JetStream advisory sent when a message reaches a consumer's max_deliver.
MAX_DELIVERIES_ADVISORY = "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.>"


def _token(value: str, what: str) -> str:
    if not value or any(c in value for c in ".*> \t\r\n"):
        raise ValueError(f"{what} {value!r} cannot be used in a NATS subject")
    return value


def valid_owner(owner: str) -> str:
    """``owner`` when it can be a subject token, else ``anonymous``: a grant from an older or
    broken sender never stops its job's reports (they go where no user reads)."""
    try:
        return _token(owner, "owner")
    except ValueError:
        return ANONYMOUS


def jobs_submit(owner: str = ANONYMOUS) -> str:
    """Where ``owner`` submits jobs; the owner's credentials are the only ones that may."""
    return JOBS_SUBMIT if owner == ANONYMOUS else f"{JOBS_SUBMIT}.{_token(owner, 'owner')}"


def owner_from_submit(subject: str) -> str:
    """The owner a submit subject names: ``anonymous`` for the bare subject."""
    if subject == JOBS_SUBMIT:
        return ANONYMOUS
    head, _, owner = subject.rpartition(".")
    if head != JOBS_SUBMIT or not owner:
        raise ValueError(f"not a submit subject: {subject!r}")
    return owner


def node_capabilities(node_id: str) -> str:
    return f"{PREFIX}.node.{_token(node_id, 'node id')}.capabilities"


def node_heartbeat(node_id: str) -> str:
    return f"{PREFIX}.node.{_token(node_id, 'node id')}.heartbeat"


def node_grants(node_id: str) -> str:
    return f"{PREFIX}.node.{_token(node_id, 'node id')}.grants"


def node_status(node_id: str) -> str:
    return f"{PREFIX}.node.{_token(node_id, 'node id')}.status"


def node_control(node_id: str) -> str:
    return f"{PREFIX}.node.{_token(node_id, 'node id')}.control"


def node_doctor(node_id: str) -> str:
    """Request/reply: ask a node's probe to re-detect now (after a driver install)."""
    return f"{PREFIX}.node.{_token(node_id, 'node id')}.doctor"


def node_observations(node_id: str) -> str:
    """Core NATS: the probe's live device observations and health (``NodeObservations``)."""
    return f"{PREFIX}.node.{_token(node_id, 'node id')}.observations"


def job_events(job_id: str, owner: str = ANONYMOUS) -> str:
    """Where a job's events go: under its owner, whose credential alone may read them."""
    return f"{PREFIX}.job.{_token(owner, 'owner')}.{_token(job_id, 'job id')}.events"


def job_logs(job_id: str, owner: str = ANONYMOUS) -> str:
    return f"{PREFIX}.job.{_token(owner, 'owner')}.{_token(job_id, 'job id')}.logs"


def owner_jobs(owner: str) -> str:
    """Every event and log subject of ``owner``'s jobs."""
    return f"{PREFIX}.job.{_token(owner, 'owner')}.>"


def api_subject(verb_subject: str, caller: str = ANONYMOUS) -> str:
    """``gpulayer.api.<verb>`` asked as ``caller`` (``API_JOBS`` ... as ``verb_subject``)."""
    return verb_subject if caller == ANONYMOUS else f"{verb_subject}.{_token(caller, 'caller')}"


def api_caller(subject: str) -> str:
    """Who asked on an API subject: its fourth token, ``anonymous`` when there is none."""
    parts = subject.split(".")
    if len(parts) == 3:
        return ANONYMOUS
    if len(parts) != 4 or not parts[3]:
        raise ValueError(f"not an API subject: {subject!r}")
    return parts[3]


def dlq_subject(stream: str) -> str:
    """Where messages of ``stream`` that can't be handled go (the DLQ stream)."""
    return f"{PREFIX}.dlq.{_token(stream, 'stream name')}"


def node_from_subject(subject: str) -> str:
    """The node id token of a ``gpulayer.node.<node>.<kind>`` subject."""
    parts = subject.split(".")
    if len(parts) != 4 or parts[0] != PREFIX or parts[1] != "node":
        raise ValueError(f"not a node subject: {subject!r}")
    return parts[2]


def job_from_subject(subject: str) -> str:
    """The job id token of a ``gpulayer.job.<owner>.<job>.<kind>`` subject."""
    parts = subject.split(".")
    if len(parts) != 5 or parts[0] != PREFIX or parts[1] != "job":
        raise ValueError(f"not a job subject: {subject!r}")
    return parts[3]


# The audit trail's default retention: 90 days, 1 GiB (the oldest go first past either).
AUDIT_MAX_AGE_S = 90 * 24 * 3600.0
AUDIT_MAX_BYTES = 1 << 30


class StreamSpec(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    subjects: list[str]
    retention: Literal["limits", "workqueue", "interest"] = "limits"
    max_msgs_per_subject: int = -1
    max_age_s: float = 0.0
    max_bytes: int = -1
    duplicate_window_s: float = 120.0
    discard: Literal["old", "new"] = "old"
    description: str = ""


STREAMS: tuple[StreamSpec, ...] = (
    StreamSpec(
        name="NODES",
        subjects=[NODE_WILDCARD_CAPABILITIES],
        max_msgs_per_subject=1,
        description="Last capabilities per node.",
    ),
    StreamSpec(
        name="JOBS",
        subjects=[JOBS_SUBMIT, JOBS_SUBMIT_OWNED],
        retention="workqueue",
        # Within this window JetStream drops a re-published job id itself; after it, placement's
        # primary key on job_id still makes a second submission the same job.
        duplicate_window_s=600.0,
        description="Submitted job requests, consumed by placement.",
    ),
    StreamSpec(
        name="GRANTS",
        subjects=[NODE_WILDCARD_GRANTS],
        retention="workqueue",
        description="Grants to executors, one filtered consumer per node.",
    ),
    StreamSpec(
        name="STATUS",
        subjects=[NODE_WILDCARD_STATUS],
        retention="workqueue",
        description="Executor status reports, consumed by placement.",
    ),
    StreamSpec(
        name="CONTROL",
        subjects=[NODE_WILDCARD_CONTROL],
        retention="workqueue",
        description="Cancel requests to executors.",
    ),
    StreamSpec(
        name="JOB_EVENTS",
        subjects=[JOB_WILDCARD_EVENTS],
        max_age_s=7 * 24 * 3600.0,
        description="Every job's event history, for users and `gpulayer submit --wait`.",
    ),
    StreamSpec(
        name="LOGS",
        subjects=[JOB_WILDCARD_LOGS],
        max_msgs_per_subject=10_000,
        max_bytes=1 << 30,
        max_age_s=7 * 24 * 3600.0,
        description="Job output lines; bounded per job and in total.",
    ),
    StreamSpec(
        name="AUDIT",
        subjects=[AUDIT_WILDCARD],
        # Placement's GPULAYER_AUDIT_MAX_AGE_DAYS / GPULAYER_AUDIT_MAX_BYTES replace these.
        max_age_s=AUDIT_MAX_AGE_S,
        max_bytes=AUDIT_MAX_BYTES,
        description="Audit trail: who submitted, cancelled, changed a quota, minted or revoked.",
    ),
    StreamSpec(
        name="DLQ",
        subjects=[DLQ_WILDCARD],
        max_age_s=14 * 24 * 3600.0,
        max_bytes=256 << 20,
        description="Dead letters: messages of JOBS and STATUS that could not be handled.",
    ),
)


def streams_with_audit_retention(max_age_s: float, max_bytes: int) -> tuple[StreamSpec, ...]:
    """STREAMS with the AUDIT stream's retention replaced (placement's settings)."""
    return tuple(
        msgspec.structs.replace(s, max_age_s=max_age_s, max_bytes=max_bytes)
        if s.name == "AUDIT"
        else s
        for s in STREAMS
    )
