"""Talking to a running gpulayer: submit jobs, follow their events, call the placement API."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import ConsumerConfig, DeliverPolicy

from gpulayer_contracts import JobEvent, JobRequest, encode, is_terminal
from gpulayer_contracts.codec import event_decoder
from gpulayer_contracts.subjects import JOBS_SUBMIT, MSG_ID_HEADER, job_events


class ApiUnavailable(RuntimeError):
    pass


class ApiFailed(RuntimeError):
    pass


def _traceparent(parent: str | None) -> str:
    """A W3C ``traceparent`` for the submit: under ``parent`` (the ``TRACEPARENT`` convention of
    CI systems and otel-cli) when it is well formed, else a new trace, so that the job's spans in
    placement and executor share one trace id."""
    parts = (parent or "").strip().split("-")
    if len(parts) == 4 and len(parts[1]) == 32 and len(parts[2]) == 16 and parts[1] != "0" * 32:
        return f"00-{parts[1]}-{secrets.token_hex(8)}-{parts[3]}"
    return f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"


async def submit(nc: Client, job: JobRequest, parent: str | None = None) -> str:
    """Publish a job; returns its trace id. The job id is the message id, so a retried publish
    is deduplicated."""
    traceparent = _traceparent(parent)
    headers = {MSG_ID_HEADER: job.job_id, "traceparent": traceparent}
    await nc.jetstream().publish(JOBS_SUBMIT, encode(job), headers=headers)
    return traceparent.split("-")[1]


async def follow_events(
    nc: Client, job_ids: list[str], *, stop_when: Callable[[JobEvent], bool] = is_terminal
) -> AsyncIterator[JobEvent]:
    """Every event of ``job_ids`` from the start of their history, until ``stop_when`` held for
    each job."""
    queue: asyncio.Queue[JobEvent] = asyncio.Queue()

    async def cb(msg: Any) -> None:
        # An event type from a newer version doesn't decode: skip it.
        with contextlib.suppress(msgspec.ValidationError):
            await queue.put(event_decoder.decode(msg.data))

    js = nc.jetstream()
    subs = []
    for job_id in job_ids:
        subs.append(
            await js.subscribe(
                job_events(job_id),
                cb=cb,
                ordered_consumer=True,
                config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL),
            )
        )
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
    nc: Client, subject: str, payload: dict[str, Any] | None = None, timeout: float = 5.0
) -> Any:
    try:
        reply = await nc.request(subject, encode(payload or {}), timeout=timeout)
    except (NoRespondersError, NatsTimeoutError) as err:
        raise ApiUnavailable(
            f"no placement service answered on {subject} (is gpulayer running? {type(err).__name__})"
        ) from err
    body = msgspec.json.decode(reply.data)
    if not body.get("ok"):
        raise ApiFailed(body.get("error", "unknown error"))
    if body.get("note"):  # e.g. a list cut to fit one message
        print(f"gpulayer: {body['note']}", file=sys.stderr)
    return body.get("data")


async def history(nc: Client, job_id: str, timeout: float = 5.0) -> list[JobEvent]:
    """Every event of a job stored so far (the JOB_EVENTS stream keeps them for a week)."""
    js = nc.jetstream()
    events: list[JobEvent] = []
    done = asyncio.Event()

    async def cb(msg: Any) -> None:
        with contextlib.suppress(msgspec.ValidationError):
            events.append(event_decoder.decode(msg.data))
        if msg.metadata.num_pending == 0:
            done.set()

    # Nothing stored yet: an empty history, not a wait.
    info = await js.stream_info("JOB_EVENTS", subjects_filter=job_events(job_id))
    if not (info.state.subjects or {}).get(job_events(job_id)):
        return events
    sub = await js.subscribe(
        job_events(job_id),
        cb=cb,
        ordered_consumer=True,
        config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL),
    )
    try:
        await asyncio.wait_for(done.wait(), timeout)
    finally:
        await sub.unsubscribe()
    return events
