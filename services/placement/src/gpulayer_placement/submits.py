"""What a batch of submit messages says: each decoded once, its runtime profile expanded,
validated and bounded, folded by job id (the first message of an id wins), arrays expanded
into their jobs, malformed ones rejected under the id read from them or dead-lettered. Pure
but for logging and telemetry: intake stores and announces what it returns."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
from nats.aio.msg import Msg

from gpulayer_contracts import ArraySpec, JobRequest, encode, validate_job
from gpulayer_contracts.bounds import array_size_error, bound_messages, job_size_error
from gpulayer_contracts.codec import InvalidInput, best_effort_job_id, decode_job_json
from gpulayer_contracts.profiles import Profiles, expand_profile
from gpulayer_contracts.subjects import ANONYMOUS, owner_from_submit
from gpulayer_runtime.logs import job_context
from gpulayer_runtime.telemetry import DISABLED, Telemetry

# The name every placement part logs under since before the split: log queries filter on it.
log = logging.getLogger("gpulayer_placement.service")

Row = tuple[str, str, str, str | None]  # job id, request body, state, traceparent


@dataclass
class Batch:
    """One fetch of submit messages, folded by job id (the first message of an id wins)."""

    rows: dict[str, Row] = field(default_factory=dict)
    accepted: dict[str, JobRequest] = field(default_factory=dict)
    warnings: dict[str, list[str]] = field(default_factory=dict)
    rejections: dict[str, list[str]] = field(default_factory=dict)
    origin: dict[str, Msg] = field(default_factory=dict)
    submitted: dict[str, float] = field(default_factory=dict)  # stream time, with telemetry on
    # Messages that are no job and name none (or can't be stored at all): message, reason,
    # reason class, job id if one was read. Dead-lettered, never acked with the batch.
    dead: list[tuple[Msg, str, str, str | None]] = field(default_factory=list)
    # From the submit subject, which only the owner's credential may publish on.
    owners: dict[str, str] = field(default_factory=dict)
    # The runtime profile each job named (its events name it too).
    profiles: dict[str, str | None] = field(default_factory=dict)
    # Submits over their owner's rate limit: job id -> (owner, reason). Neither stored nor
    # dead-lettered: acked with the batch and answered with a ``rejected`` event, so the same
    # job id may be submitted again later.
    limited: dict[str, tuple[str, str]] = field(default_factory=dict)


# An owner's submit to admit, given when it was stored: None, else why it is refused
# (``limits.RateLimit.check``).
Limit = Callable[[str, float | None], str | None]


def read_batch(
    msgs: list[Msg],
    profiles: Profiles,
    max_payload: int,
    telemetry: Telemetry = DISABLED,
    limit: Limit | None = None,
) -> Batch:
    """Decode and validate each message once; the same job id twice is one job. ``profiles``:
    the runtime profiles jobs may name; ``max_payload``: the NATS server's (a job whose grant
    would not fit it is refused); ``limit``: the submit rate limit, asked once per message."""
    r = _Reader(profiles, max_payload, telemetry, limit)
    b = Batch()
    for msg in msgs:
        try:
            r.read_one(b, msg)
        except Exception as err:
            # A bug met by one message: that message goes to the DLQ, the batch goes on.
            log.exception("reading message on %s failed", msg.subject)
            b.dead.append(
                (msg, f"internal error: {err!r}", "internal", best_effort_job_id(msg.data))
            )
    return b


class _Reader:
    def __init__(
        self, profiles: Profiles, max_payload: int, telemetry: Telemetry, limit: Limit | None
    ) -> None:
        self.profiles, self.max_payload = profiles, max_payload
        self.tel = telemetry
        self.limit = limit

    def read_one(self, b: Batch, msg: Msg) -> None:
        if self.limit is not None and self._limited(b, msg):
            return
        tel = self.tel.enabled
        traceparent = (msg.headers or {}).get("traceparent")
        if tel:
            meta = msg.metadata
            if meta.num_delivered and meta.num_delivered > 1:
                self.tel.count("gpulayer.consumer.redeliveries", 1, {"consumer": "placement-jobs"})
        try:
            job = decode_job_json(msg.data)
        except InvalidInput as err:
            self._malformed(b, msg, err, traceparent)
            return
        if job.job_id in b.rows:
            return  # the same id twice in one batch is one job
        b.origin[job.job_id] = msg
        b.owners[job.job_id] = _owner(msg)
        b.profiles[job.job_id] = job.profile
        # The profile's requirements join the job's own here, once: what is stored, matched and
        # granted is the expanded job, so a later change of the profiles file can't change it.
        expanded, errors = expand_profile(job, self.profiles)
        result = validate_job(expanded)
        errors = bound_messages([*errors, *result.errors])
        if not errors:
            job = expanded
        try:
            encoded = encode(job)
        except UnicodeEncodeError:  # a lone surrogate: validate_job names it
            body = stored_text(msg.data.decode("utf-8", "replace"))
        else:
            body = encoded.decode()
            too_big = job_size_error(len(encoded), self.max_payload)
            if too_big is not None:
                errors = bound_messages([too_big, *errors])
        if errors:
            self.tel.count(
                "gpulayer.messages.rejected", 1, {"subject": "jobs.submit", "why": "invalid"}
            )
            b.rejections[job.job_id] = errors
            b.rows[job.job_id] = (job.job_id, _storable(body), "rejected", traceparent)
        elif job.array is not None:
            self._expand(b, job, result.warnings, traceparent, msg)
        else:
            b.accepted[job.job_id] = job
            b.warnings[job.job_id] = result.warnings
            b.rows[job.job_id] = (job.job_id, body, "pending", traceparent)
            if tel:
                b.submitted[job.job_id] = msg.metadata.timestamp.timestamp()

    def _expand(
        self, b: Batch, job: JobRequest, warnings: list[str], traceparent: str | None, msg: Msg
    ) -> None:
        """An array: ``count`` jobs ``<id>-<i>``, each carrying its index (the executor sets
        ``GPULAYER_ARRAY_INDEX`` from it), stored and placed as jobs of their own. Refused whole
        (under the array's id) when its last job's grant would not fit the server or all its
        jobs together pass MAX_ARRAY_BYTES."""
        assert job.array is not None
        n, owner = job.array.count, b.owners[job.job_id]

        def element(i: int) -> JobRequest:
            spec = ArraySpec(count=n, index=i)
            return msgspec.structs.replace(job, job_id=f"{job.job_id}-{i}", array=spec)

        size = len(encode(element(n - 1)))  # the longest id and index
        error = job_size_error(size, self.max_payload) or array_size_error(n, size)
        if error is not None:
            b.rejections[job.job_id] = [error]
            b.rows[job.job_id] = (job.job_id, encode(job).decode(), "rejected", traceparent)
            return
        del b.origin[job.job_id], b.owners[job.job_id]  # the array's id names no job
        stamp = msg.metadata.timestamp.timestamp() if self.tel.enabled else None
        for i in range(n):
            one = element(i)
            if one.job_id in b.rows:
                continue  # the same id twice in one batch is one job
            b.origin[one.job_id], b.owners[one.job_id] = msg, owner
            b.accepted[one.job_id] = one
            b.warnings[one.job_id] = warnings
            b.rows[one.job_id] = (one.job_id, encode(one).decode(), "pending", traceparent)
            if stamp is not None:
                b.submitted[one.job_id] = stamp

    def _limited(self, b: Batch, msg: Msg) -> bool:
        """Whether the message is over its owner's submit rate (``b.limited`` then names it;
        one that names no job id is only acked). Counted before decoding: a flood of malformed
        messages costs the same tokens. A redelivery was counted when it first came."""
        assert self.limit is not None
        owner = _owner(msg)
        why = self.limit(owner, stored_at(msg))
        if why is None or _redelivered(msg):
            return False
        job_id = best_effort_job_id(msg.data)
        self.tel.count("gpulayer.messages.rejected", 1, {"subject": "jobs.submit", "why": "rate"})
        if job_id is None:
            log.warning("dropped a submit of %s with no job id: %s", owner[:64], why)
        elif job_id not in b.rows:
            b.limited.setdefault(job_id, (owner, why))
        return True

    def _malformed(self, b: Batch, msg: Msg, err: InvalidInput, traceparent: str | None) -> None:
        """A message that doesn't decode is rejected under the job id read from it; one that
        names no job goes to the DLQ with the reason."""
        job_id = best_effort_job_id(msg.data)
        log.warning(
            "rejected message on %s (job %s): %s",
            msg.subject,
            job_id,
            err,
            extra=job_context(job_id, traceparent=traceparent),
        )
        self.tel.count(
            "gpulayer.messages.rejected", 1, {"subject": "jobs.submit", "why": "malformed"}
        )
        if job_id is None:
            b.dead.append(
                (msg, f"not a job request, and no job id could be read: {err}", "malformed", None)
            )
        elif job_id not in b.rows:
            b.origin[job_id] = msg
            b.owners[job_id] = _owner(msg)
            b.rejections[job_id] = [str(err)]
            text = stored_text(msg.data.decode("utf-8", "replace"))
            b.rows[job_id] = (job_id, text, "rejected", traceparent)


def _owner(msg: Msg) -> str:
    """The job's owner, from the subject it was submitted on (never from the payload)."""
    try:
        return owner_from_submit(msg.subject)
    except ValueError:  # not a submit subject: the stream holds none, so nobody's in particular
        return ANONYMOUS


def _redelivered(msg: Msg) -> bool:
    try:
        return (msg.metadata.num_delivered or 1) > 1
    except Exception:  # not a JetStream message (no metadata): delivered once
        return False


def stored_text(text: str) -> str:
    """Text that is no storable job, as a JSON string (the row keeps what was sent): NUL, which
    PostgreSQL refuses in text and jsonb, is written as ``\\x00``."""
    return encode(text.replace("\x00", "\\x00")).decode()


def _storable(body: str) -> str:
    """A rejected job's encoded body as it can be stored: jsonb refuses ``\\u0000``."""
    return stored_text(body) if "\\u0000" in body else body


def stored_at(msg: Msg) -> float | None:
    """When JetStream stored ``msg`` (Unix seconds), read from its ack subject alone (cheaper
    than ``msg.metadata``): ``$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ns>.<pending>``,
    or with a domain and account hash after ``ACK`` (and a token more at the end). None for a
    message that is not a JetStream delivery."""
    reply = msg.reply
    if not reply or not reply.startswith("$JS.ACK."):
        return None
    tokens = reply.split(".")
    ns = tokens[7] if len(tokens) == 9 else tokens[9] if len(tokens) >= 11 else None
    try:
        return int(ns) / 1e9 if ns is not None else None
    except ValueError:
        return None
