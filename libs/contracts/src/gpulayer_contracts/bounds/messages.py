"""The bounds of what placement publishes: a job's size in its grant, an event's size."""

from __future__ import annotations

from typing import TypeVar

import msgspec

from gpulayer_contracts.bounds.checks import bound_messages, clip_text
from gpulayer_contracts.bounds.limits import (
    GRANT_ENVELOPE_BYTES,
    HEADER_RESERVE_BYTES,
    MAX_EVENT_BYTES,
    MAX_MESSAGE_CHARS,
    MIN_MAX_PAYLOAD,
)
from gpulayer_contracts.events import JobEvent


def max_job_bytes(max_payload: int) -> int:
    """The largest job, as placement encodes it (``len(encode(job))``), whose grant fits a
    server with this ``max_payload``: the grant is the job plus at most GRANT_ENVELOPE_BYTES,
    sent with at most HEADER_RESERVE_BYTES of headers. Raises ValueError below MIN_MAX_PAYLOAD
    (a server configured that small is a deployment error, not a job's)."""
    if max_payload < MIN_MAX_PAYLOAD:
        raise ValueError(
            f"the NATS server's max_payload is {max_payload} bytes; gpulayer needs at least "
            f"{MIN_MAX_PAYLOAD}"
        )
    return max_payload - GRANT_ENVELOPE_BYTES - HEADER_RESERVE_BYTES


def job_size_error(encoded_len: int, max_payload: int) -> str | None:
    """The rejection for a job of ``encoded_len`` bytes (``len(encode(job))``, the job as it
    will sit in its grant) on a server with this ``max_payload``; None when it fits."""
    limit = max_job_bytes(max_payload)
    if encoded_len <= limit:
        return None
    return (
        f"$: the job is {encoded_len} bytes encoded, over the limit of {limit} bytes "
        f"(the server's max_payload of {max_payload} bytes, less "
        f"{max_payload - limit} kept for the grant around the job)"
    )


# --- Events placement publishes ---

E = TypeVar("E", bound=JobEvent)
_TEXT_FIELDS = ("summary", "reason")
_LIST_FIELDS = ("reasons", "warnings")
_encoder = msgspec.json.Encoder()


def bound_event(event: E) -> E:
    """``event`` with its texts (``summary``, ``reason``, ``reasons``, ``warnings``) clipped so
    that it encodes to at most MAX_EVENT_BYTES, whatever the job, the matcher or an executor
    put in them. Placement calls it on every event before publishing; unchanged when it fits."""
    if len(_encoder.encode(event)) <= MAX_EVENT_BYTES:
        return event
    changes: dict[str, object] = {}
    for name in _TEXT_FIELDS:
        value = getattr(event, name, None)
        if isinstance(value, str):
            changes[name] = clip_text(value, 4 * MAX_MESSAGE_CHARS)
    lists: dict[str, list[str]] = {}
    for name in _LIST_FIELDS:
        value = getattr(event, name, None)
        if isinstance(value, list):
            lists[name] = bound_messages(value)
    clipped = msgspec.structs.replace(event, **changes, **lists)
    # Each line is short now, but up to MAX_ERRORS of them, escaped, can still be too much:
    # drop lines from the end, saying how many.
    while len(_encoder.encode(clipped)) > MAX_EVENT_BYTES:
        candidates = [n for n in lists if lists[n]]
        if not candidates:
            break  # pragma: no cover - ids and clipped texts alone are far under the limit
        name = max(candidates, key=lambda n: len(lists[n]))
        kept = [line for line in lists[name] if not line.startswith("... and ")][:-1]
        dropped = len(getattr(event, name)) - len(kept)
        lists[name] = [*kept, f"... and {dropped} more"]
        clipped = msgspec.structs.replace(event, **changes, **lists)
    return clipped
