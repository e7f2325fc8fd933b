"""Talking to a running gpulayer: submit jobs, follow their events, call the placement API."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from opentelemetry.trace import SpanKind

from gpulayer_cli.denials import guard
from gpulayer_contracts import JobEvent, JobRequest, encode, is_terminal
from gpulayer_contracts.codec import event_decoder
from gpulayer_contracts.subjects import (
    ANONYMOUS,
    MSG_ID_HEADER,
    api_subject,
    job_events,
    jobs_submit,
)
from gpulayer_runtime.telemetry import DISABLED, Telemetry, inject

# A reading consumer the CLI made goes away this long after its subscription does.
READER_INACTIVE_S = 30.0


class ApiUnavailable(RuntimeError):
    pass


class ApiFailed(RuntimeError):
    pass


class ApiDenied(ApiFailed):
    """Placement refused the caller a right it lacks (cancel another's job, quotas)."""


def _traceparent(parent: str | None) -> str:
    """A W3C ``traceparent`` for the submit: under ``parent`` (the ``TRACEPARENT`` convention of
    CI systems and otel-cli) when it is well formed, else a new trace, so that the job's spans in
    placement and executor share one trace id."""
    parts = (parent or "").strip().split("-")
    if len(parts) == 4 and len(parts[1]) == 32 and len(parts[2]) == 16 and parts[1] != "0" * 32:
        return f"00-{parts[1]}-{secrets.token_hex(8)}-{parts[3]}"
    return f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"


async def submit(
    nc: Client,
    job: JobRequest,
    parent: str | None = None,
    owner: str = ANONYMOUS,
    telemetry: Telemetry = DISABLED,
) -> str:
    """Publish a job as ``owner`` (the identity of ``nc``'s credentials); returns its trace id.
    The job id is the message id, so a retried publish is deduplicated.

    With ``telemetry`` on, the publish is a span (under the current one, the CLI's own) and the
    job travels under it, so placement's and the executor's spans hang below the CLI's. Off,
    the job gets a ``traceparent`` under ``parent`` or a new trace, and nothing is exported."""
    subject = jobs_submit(owner)
    attributes = {
        "gpulayer.job.id": job.job_id,
        "messaging.system": "nats",
        "messaging.destination.name": subject,
        "messaging.operation.type": "send",
    }
    with telemetry.span(
        "gpulayer publish job", kind=SpanKind.PRODUCER, attributes=attributes
    ) as span:
        traceparent = _traceparent(parent) if span is None else inject({}, span)["traceparent"]
        headers = {MSG_ID_HEADER: job.job_id, "traceparent": traceparent}
        await guard(nc, nc.jetstream().publish(subject, encode(job), headers=headers), subject)
    return traceparent.split("-")[1]


async def read_subject(
    nc: Client,
    stream: str,
    subject: str,
    cb: Callable[[Any], Awaitable[None]],
    deliver_policy: DeliverPolicy = DeliverPolicy.ALL,
) -> tuple[Any, int]:
    """Deliver ``subject``'s stored messages (and new ones) to ``cb``; returns the subscription
    and how many messages were stored when it began.

    A named consumer whose filter is in the API subject, delivering to this client's inbox: the
    one kind of consumer a user's credential may create, and only on its own jobs' subjects
    (docs/security.md). Not acked; the server removes it once the subscription is gone."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, cb=cb)
    name = secrets.token_hex(8)
    try:
        add = nc.jetstream().add_consumer(
            stream,
            ConsumerConfig(
                name=name,
                filter_subject=subject,
                deliver_subject=inbox,
                deliver_policy=deliver_policy,
                ack_policy=AckPolicy.NONE,
                inactive_threshold=READER_INACTIVE_S,
                mem_storage=True,
            ),
        )
        info = await guard(nc, add, f"$JS.API.CONSUMER.CREATE.{stream}.{name}.{subject}")
    except BaseException:
        await sub.unsubscribe()
        raise
    return sub, int(info.num_pending or 0)


async def follow_events(
    nc: Client,
    job_ids: list[str],
    *,
    stop_when: Callable[[JobEvent], bool] = is_terminal,
    owner: str = ANONYMOUS,
) -> AsyncIterator[JobEvent]:
    """Every event of ``owner``'s ``job_ids`` from the start of their history, until
    ``stop_when`` held for each job."""
    queue: asyncio.Queue[JobEvent] = asyncio.Queue()

    async def cb(msg: Any) -> None:
        # An event type from a newer version doesn't decode: skip it.
        with contextlib.suppress(msgspec.ValidationError):
            await queue.put(event_decoder.decode(msg.data))

    subs = []
    for job_id in job_ids:
        sub, _ = await read_subject(nc, "JOB_EVENTS", job_events(job_id, owner), cb)
        subs.append(sub)
    open_jobs = set(job_ids)
    try:
        while open_jobs:
            event = await queue.get()
            yield event
            if stop_when(event):
                open_jobs.discard(event.job_id)
    finally:
        for sub in subs:
            await sub.unsubscribe()


async def api(
    nc: Client,
    subject: str,
    payload: dict[str, Any] | None = None,
    timeout: float = 5.0,
    caller: str = ANONYMOUS,
) -> Any:
    """Ask placement on ``subject`` (``API_JOBS`` ...) as ``caller``, the identity of ``nc``'s
    credentials: placement answers each caller with its own rights."""
    subject = api_subject(subject, caller)
    try:
        reply = await guard(
            nc, nc.request(subject, encode(payload or {}), timeout=timeout), subject
        )
    except (NoRespondersError, NatsTimeoutError) as err:
        raise ApiUnavailable(
            f"no placement service answered on {subject} (is gpulayer running? {type(err).__name__})"
        ) from err
    body = msgspec.json.decode(reply.data)
    if not body.get("ok"):
        error = body.get("error", "unknown error")
        raise ApiDenied(f"permission denied: {error}") if body.get("denied") else ApiFailed(error)
    if body.get("note"):  # e.g. a list cut to fit one message
        print(f"gpulayer: {body['note']}", file=sys.stderr)
    return body.get("data")


async def history(
    nc: Client, job_id: str, timeout: float = 5.0, owner: str = ANONYMOUS
) -> list[JobEvent]:
    """Every event of ``owner``'s job stored so far (the JOB_EVENTS stream keeps them a week)."""
    events: list[JobEvent] = []
    done = asyncio.Event()

    async def cb(msg: Any) -> None:
        with contextlib.suppress(msgspec.ValidationError, msgspec.DecodeError):
            events.append(event_decoder.decode(msg.data))
        if msg.metadata.num_pending == 0:
            done.set()

    sub, stored = await read_subject(nc, "JOB_EVENTS", job_events(job_id, owner), cb)
    if not stored:  # nothing stored yet: an empty history, not a wait
        await sub.unsubscribe()
        return events
    try:
        await asyncio.wait_for(done.wait(), timeout)
    finally:
        await sub.unsubscribe()
    return events
