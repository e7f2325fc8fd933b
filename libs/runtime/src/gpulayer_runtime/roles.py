"""What each gpulayer identity may publish and subscribe to on NATS: one function per role.

Pure data, computed from ``gpulayer_contracts.subjects``: the credentials minted by
``gpulayer_runtime.auth`` carry exactly these lists, and ``docs/security.md`` shows them (a
test checks the page against this module).

JetStream API subjects that name a consumer also name its filter subject
(``$JS.API.CONSUMER.CREATE.<stream>.<consumer>.<filter>``; the server refuses a request whose
config filter differs from the one in the subject), so a permission on that subject limits
both the consumer a client may create and what it may read with it. The filter-less form
``$JS.API.CONSUMER.CREATE.<stream>`` is given to no one but placement and admins.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from gpulayer_contracts.subjects import AUDIT_WILDCARD, MAX_DELIVERIES_ADVISORY, PREFIX, STREAMS

Role = Literal["placement", "node", "user", "admin", "viewer"]
ROLES: tuple[Role, ...] = ("placement", "node", "user", "admin", "viewer")

# The API verbs a viewer may ask: reads only (no cancel). ``quota`` answers a non-admin with the
# list alone (placement refuses set and delete to anyone but admins).
VIEWER_VERBS = ("nodes", "jobs", "job", "explain", "matrix", "profiles", "services", "quota")

# Names a user may not take: the owner of jobs submitted without auth, and the prefix tokens of
# other roles' inboxes are kept apart by ``inbox_prefix`` already.
RESERVED_NAMES = frozenset({"anonymous"})

_JS = "$JS.API"


class Permissions(msgspec.Struct, frozen=True, kw_only=True):
    """Subjects an identity may publish to and subscribe to (NATS wildcards allowed).
    ``allow_responses``: it may also answer the requests it received, once each."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = False


def check_name(name: str, what: str = "name") -> str:
    """A name used as one NATS subject token and as a consumer-name part, or ValueError."""
    ok = name and len(name) <= 64 and all(c.isalnum() or c in "-_" for c in name)
    if not ok or not name[0].isalnum():
        raise ValueError(
            f"{what} {name!r}: use 1 to 64 letters, digits, '-' or '_', starting with a "
            "letter or digit"
        )
    return name


def inbox_prefix(role: Role, name: str) -> str:
    """The reply-subject prefix of one identity: no other identity may subscribe under it, so
    replies to one client (API answers, JetStream acks, pulled messages) reach only it."""
    return "_INBOX.placement" if role == "placement" else f"_INBOX.{role}-{name}"


def executor_consumer(node_id: str, kind: Literal["grants", "control"]) -> str:
    """The durable consumer a node's executor pulls its grants / cancels through."""
    return f"executor-{node_id}" if kind == "grants" else f"executor-{node_id}-control"


def permissions(role: Role, name: str) -> Permissions:
    """The permissions of identity ``name`` in ``role``."""
    if role == "admin":
        return Permissions(publish=(">",), subscribe=(">",), allow_responses=True)
    if role == "placement":
        return _placement()
    check_name(name, f"{role} name")
    if role == "node":
        return _node(name)
    if role in ("user", "viewer") and name in RESERVED_NAMES:
        raise ValueError(f"{role} name {name!r} is reserved")
    if role == "user":
        return _user(name)
    if role == "viewer":
        return _viewer(name)
    raise ValueError(f"unknown role {role!r}")


def _placement() -> Permissions:
    streams = [s.name for s in STREAMS]
    # Placement declares the streams (the only service that does), consumes jobs, status and
    # capabilities, and publishes grants, cancels and job events.
    js_api = [f"{_JS}.INFO", f"{_JS}.STREAM.NAMES"]
    for stream in streams:
        js_api += [
            f"{_JS}.STREAM.INFO.{stream}",
            f"{_JS}.STREAM.CREATE.{stream}",
            f"{_JS}.STREAM.UPDATE.{stream}",
        ]
    for stream, consumer in (("JOBS", "placement-jobs"), ("STATUS", "placement-status")):
        js_api += [
            f"{_JS}.CONSUMER.INFO.{stream}.{consumer}",
            f"{_JS}.CONSUMER.CREATE.{stream}.{consumer}",
            f"{_JS}.CONSUMER.CREATE.{stream}.{consumer}.>",
            f"{_JS}.CONSUMER.DURABLE.CREATE.{stream}.{consumer}",
            f"{_JS}.CONSUMER.MSG.NEXT.{stream}.{consumer}",
            f"$JS.ACK.{stream}.{consumer}.>",
        ]
    # The capabilities are read with an ordered (ephemeral, re-created) consumer.
    js_api += [
        f"{_JS}.CONSUMER.CREATE.NODES",
        f"{_JS}.CONSUMER.CREATE.NODES.>",
        f"{_JS}.CONSUMER.DELETE.NODES.*",
        f"{_JS}.CONSUMER.INFO.NODES.*",
        "$JS.FC.NODES.>",
    ]
    return Permissions(
        publish=(
            f"{PREFIX}.node.*.grants",
            f"{PREFIX}.node.*.control",
            f"{PREFIX}.job.*.*.events",
            # Dead letters (issue 11): placement moves a message it cannot handle there.
            f"{PREFIX}.dlq.>",
            # The audit trail (issue 31): submits, cancels, quota changes. No user may.
            AUDIT_WILDCARD,
            *js_api,
        ),
        subscribe=(
            f"{PREFIX}.api.>",
            f"{PREFIX}.node.*.heartbeat",
            # Device observations and health (issue 17), core NATS like heartbeats.
            f"{PREFIX}.node.*.observations",
            f"{inbox_prefix('placement', '')}.>",
            # A message left undelivered at a consumer's max_deliver (dead_letters.py).
            MAX_DELIVERIES_ADVISORY,
        ),
        allow_responses=True,
    )


def _node(node_id: str) -> Permissions:
    node = f"{PREFIX}.node.{node_id}"
    js_api: list[str] = []
    for stream, kind in (("GRANTS", "grants"), ("CONTROL", "control")):
        consumer = executor_consumer(node_id, kind)  # type: ignore[arg-type]
        js_api += [
            f"{_JS}.STREAM.INFO.{stream}",
            f"{_JS}.CONSUMER.INFO.{stream}.{consumer}",
            # Name and filter are both in the subject: only its own consumer, on its own subject.
            f"{_JS}.CONSUMER.CREATE.{stream}.{consumer}.{node}.{kind}",
            f"{_JS}.CONSUMER.MSG.NEXT.{stream}.{consumer}",
            f"$JS.ACK.{stream}.{consumer}.>",
        ]
    return Permissions(
        publish=(
            f"{node}.capabilities",
            f"{node}.heartbeat",
            f"{node}.observations",
            f"{node}.status",
            # Any job's events and logs: the executor reports the jobs granted to it, and the
            # grant's signature (not NATS) limits what it runs. See docs/security.md.
            f"{PREFIX}.job.*.*.events",
            f"{PREFIX}.job.*.*.logs",
            f"{_JS}.STREAM.INFO.NODES",
            *js_api,
        ),
        subscribe=(f"{node}.doctor", f"{inbox_prefix('node', node_id)}.>"),
        # The probe answers its own doctor requests.
        allow_responses=True,
    )


def _user(name: str) -> Permissions:
    own_jobs = f"{PREFIX}.job.{name}"
    js_api: list[str] = []
    for stream, kind in (("JOB_EVENTS", "events"), ("LOGS", "logs")):
        # Its own jobs only: the filter (in the subject) starts with its own owner token. The
        # consumer's name is free (clients use a random one); the filter is what limits reading.
        js_api.append(f"{_JS}.CONSUMER.CREATE.{stream}.*.{own_jobs}.*.{kind}")
    return Permissions(
        publish=(
            f"{PREFIX}.jobs.submit.{name}",
            f"{PREFIX}.api.*.{name}",
            *js_api,
        ),
        subscribe=(f"{own_jobs}.>", f"{inbox_prefix('user', name)}.>"),
    )


def _viewer(name: str) -> Permissions:
    """Read-only (the fleet page, issue 29): what the API shows every user, every job's events
    and the nodes' device observations; no submit, no cancel, no publish, no logs."""
    return Permissions(
        publish=(
            *(f"{PREFIX}.api.{verb}.{name}" for verb in VIEWER_VERBS),
            # Whether placement declared the stream yet (it starts before placement may).
            f"{_JS}.STREAM.INFO.JOB_EVENTS",
            # Any job's events (its timeline, and the live page): a named consumer whose filter
            # (in the subject) is some job's events, never its logs.
            f"{_JS}.CONSUMER.CREATE.JOB_EVENTS.*.{PREFIX}.job.*.*.events",
        ),
        subscribe=(f"{PREFIX}.node.*.observations", f"{inbox_prefix('viewer', name)}.>"),
    )
