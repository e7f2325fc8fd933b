"""JSON Schemas (draft 2020-12) of the messages on the wire, generated from the contracts.

One schema per kind of message, named as ``gpulayer schema <name>`` takes it. Each is
``msgspec.json.schema`` of the struct (or tagged union) that the services decode, with
``$schema``, a stable ``$id``, a title and a description added: a field added to a contract
shows up here by itself. ``docs/schemas/<name>.json`` holds the same text (``make docs``).

Service messages (everything but ``job``) leave ``additionalProperties`` open, as their decoders
skip fields they don't know: fields are only ever added, each with a default. A job request is
strict, as its decoder is.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgspec

from gpulayer_contracts.capabilities import Heartbeat, WorkerCapabilities
from gpulayer_contracts.events import AnyJobEvent, CancelJob, Grant, JobStatus, LogLine
from gpulayer_contracts.health import DoctorReport, NodeObservations
from gpulayer_contracts.jobs import JobRequest
from gpulayer_contracts.subjects import (
    JOB_WILDCARD_EVENTS,
    JOB_WILDCARD_LOGS,
    JOBS_SUBMIT,
    JOBS_SUBMIT_OWNED,
    NODE_WILDCARD_CAPABILITIES,
    NODE_WILDCARD_CONTROL,
    NODE_WILDCARD_GRANTS,
    NODE_WILDCARD_HEARTBEAT,
    NODE_WILDCARD_OBSERVATIONS,
    NODE_WILDCARD_STATUS,
)

SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
# An identifier, not a URL anything serves: the files are in docs/schemas/ and printed by
# `gpulayer schema <name>`.
SCHEMA_ID_BASE = "https://gpulayer.dev/schemas/"


class WireSchema(NamedTuple):
    """One kind of message: the type its consumers decode, and the subjects it travels on."""

    type: Any
    title: str
    subjects: tuple[str, ...]
    description: str


WIRE_SCHEMAS: dict[str, WireSchema] = {
    "job": WireSchema(
        JobRequest,
        "JobRequest",
        (JOBS_SUBMIT, JOBS_SUBMIT_OWNED),
        "A job as submitted (also the body of a job file). Strict: unknown fields are errors.",
    ),
    "event": WireSchema(
        AnyJobEvent,
        "JobEvent",
        (JOB_WILDCARD_EVENTS,),
        "What happened to a job; the `type` field names the event. A newer gpulayer may add "
        "event types: a reader skips a type it doesn't know.",
    ),
    "log": WireSchema(LogLine, "LogLine", (JOB_WILDCARD_LOGS,), "One output line of a job."),
    "capabilities": WireSchema(
        WorkerCapabilities,
        "WorkerCapabilities",
        (NODE_WILDCARD_CAPABILITIES,),
        "What a node can do, as its probe detected it.",
    ),
    "observations": WireSchema(
        NodeObservations,
        "NodeObservations",
        (NODE_WILDCARD_OBSERVATIONS,),
        "A node's live device observations and health, every few seconds.",
    ),
    "doctor": WireSchema(
        DoctorReport,
        "DoctorReport",
        # The reply travels on the requester's inbox; the request body is empty.
        (),
        "The probe's reply to a request on gpulayer.node.<node>.doctor: it detected again, "
        "what changed, and the node's health.",
    ),
    "heartbeat": WireSchema(
        Heartbeat, "Heartbeat", (NODE_WILDCARD_HEARTBEAT,), "A probe's or executor's liveness."
    ),
    "grant": WireSchema(
        Grant, "Grant", (NODE_WILDCARD_GRANTS,), "Placement's decision, sent to the chosen node."
    ),
    "status": WireSchema(
        JobStatus,
        "JobStatus",
        (NODE_WILDCARD_STATUS,),
        "An executor's report of a job's state change, to placement.",
    ),
    "cancel": WireSchema(
        CancelJob, "CancelJob", (NODE_WILDCARD_CONTROL,), "Placement asks an executor to cancel."
    ),
}


def schema_id(name: str) -> str:
    return f"{SCHEMA_ID_BASE}{name}.json"


def wire_schema(name: str) -> dict[str, Any]:
    """The JSON Schema of message kind ``name`` (a key of WIRE_SCHEMAS). Raises ValueError
    naming the known kinds for any other name."""
    entry = WIRE_SCHEMAS.get(name)
    if entry is None:
        raise ValueError(f"no schema {name!r}: choose one of {', '.join(WIRE_SCHEMAS)}")
    return {
        "$schema": SCHEMA_DIALECT,
        "$id": schema_id(name),
        "title": entry.title,
        "description": entry.description,
        **msgspec.json.schema(entry.type),
    }


def _matches(pattern: str, subject: str) -> bool:
    """NATS wildcard matching: ``*`` is one token, ``>`` one or more at the end."""
    want, got = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(got) > i
        if i >= len(got) or (token != "*" and token != got[i]):
            return False
    return len(want) == len(got)


def schema_for_subject(subject: str) -> str | None:
    """The name of the schema of messages published on ``subject``; None for subjects whose
    bodies are none of these (the API's requests and replies, dead letters, doctor requests)."""
    for name, entry in WIRE_SCHEMAS.items():
        if any(_matches(p, subject) for p in entry.subjects):
            return name
    return None
