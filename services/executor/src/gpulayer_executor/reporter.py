"""Reporting a grant's state: a ``JobStatus`` to placement and the job event to its user.

Both carry a ``Nats-Msg-Id`` (``<grant id>:<state>``; a job event of the grant's end,
``<grant id>:end``), so a repeated report (a retry, or the next start reporting again what a
crash left unconfirmed) is dropped by JetStream within its duplicate window.
"""

from __future__ import annotations

import asyncio
import logging

import nats.errors
from nats.js import JetStreamContext

from gpulayer_contracts.codec import encode
from gpulayer_contracts.events import (
    Cancelled,
    Failed,
    JobEvent,
    JobStatus,
    Lost,
    Running,
    Succeeded,
)
from gpulayer_contracts.subjects import (
    MSG_ID_HEADER,
    end_msg_id,
    job_events,
    node_status,
    valid_owner,
)
from gpulayer_executor import state as st
from gpulayer_executor.writer import DurableWriter

# The executor's lines keep the logger name they had before it was split into parts.
log = logging.getLogger("gpulayer_executor.service")


def int32_exit_code(code: int | None) -> int | None:
    """An exit code as a signed 32-bit number: Windows' are unsigned (0xC0000005 is
    3221225477), and placement stores and bounds them as PostgreSQL int4."""
    if code is None or -(2**31) <= code < 2**31:
        return code
    return ((code + 2**31) % 2**32) - 2**31


def status_for(rec: st.GrantRecord, node_id: str) -> tuple[JobStatus, JobEvent]:
    """The status message and job event reporting the record's latest state. Pure."""
    job_id, grant_id = rec.job_id, rec.grant_id
    owner = valid_owner(rec.grant.owner)
    # A rank of a distributed job: its events say which rank they are about.
    rank = rec.grant.gang.rank if rec.grant.gang is not None else None
    out = rec.outcome
    if out is None:
        proc = rec.process
        pid = proc.pid if proc else None
        at = proc.started_at if proc else rec.received_at
        return (
            JobStatus(
                job_id=job_id, grant_id=grant_id, node_id=node_id, state="running", pid=pid, at=at
            ),
            Running(job_id=job_id, node_id=node_id, pid=pid, at=at, owner=owner, rank=rank),
        )
    status = JobStatus(
        job_id=job_id,
        grant_id=grant_id,
        node_id=node_id,
        state=out.state,
        at=out.at,
        pid=rec.process.pid if rec.process else None,
        exit_code=int32_exit_code(out.exit_code),
        signal=out.signal,
        reason=out.reason,
    )
    event: JobEvent
    if out.state == "succeeded":
        event = Succeeded(
            job_id=job_id,
            node_id=node_id,
            exit_code=out.exit_code or 0,
            at=out.at,
            owner=owner,
            rank=rank,
        )
    elif out.state == "failed":
        event = Failed(
            job_id=job_id,
            node_id=node_id,
            exit_code=int32_exit_code(out.exit_code),
            signal=out.signal,
            reason=out.reason,
            at=out.at,
            owner=owner,
            rank=rank,
        )
    elif out.state == "cancelled":
        event = Cancelled(
            job_id=job_id, node_id=node_id, reason=out.reason, at=out.at, owner=owner, rank=rank
        )
    else:
        event = Lost(
            job_id=job_id, node_id=node_id, reason=out.reason, at=out.at, owner=owner, rank=rank
        )
    return status, event


class Reporter:
    """Publishes a record's state to both streams, retrying while the executor serves.

    ``stopping`` changes the retry rule: until it is set a failed publish is retried forever
    (NATS may be restarting); once set, three tries, and the record stays unreported for the
    next start to report."""

    def __init__(
        self,
        js: JetStreamContext,
        node_id: str,
        writer: DurableWriter,
        stopping: asyncio.Event,
        *,
        publish_timeout_s: float = 5.0,
    ) -> None:
        self._js = js
        self._node_id = node_id
        self._writer = writer
        self._stopping = stopping
        self._publish_timeout_s = publish_timeout_s

    async def report(self, rec: st.GrantRecord, *, to_placement: bool = True) -> bool:
        """Publish the record's state to placement and to the job's events. True when both
        were stored; False leaves the record unreported for the next start to retry.

        A grant's end event is named ``<grant>:end``, as placement names the ``lost`` of a job
        it gave up with its node: whichever is stored first is the job's one outcome (within
        the stream's duplicate window). An end placement was told of first (``told``) goes
        to placement alone. ``to_placement=False``: to the job's events alone (a ``running``
        placement learns from the end that follows)."""
        status, event = status_for(rec, self._node_id)
        msg_id = f"{rec.grant_id}:{status.state}"
        event_id = msg_id if rec.outcome is None else end_msg_id(rec.grant_id)
        if not to_placement:
            subject = job_events(rec.job_id, event.owner)
            return await self._publish(subject, encode(event), event_id)
        to_status = self._publish(node_status(self._node_id), encode(status), msg_id)
        if rec.outcome is not None and rec.outcome.told:
            return await to_status
        # Independent streams: both in flight at once, one round trip instead of two.
        to_placement, to_user = await asyncio.gather(
            to_status,
            self._publish(job_events(rec.job_id, event.owner), encode(event), event_id),
        )
        return to_placement and to_user

    async def report_never_came(self, job_id: str, grant_id: str, reason: str) -> bool:
        """To placement alone: a grant it gave up never reached this node, and never runs
        here. What placement kept fenced for it is free."""
        status = JobStatus(
            job_id=job_id,
            grant_id=grant_id,
            node_id=self._node_id,
            state="cancelled",
            reason=reason,
        )
        msg_id = f"{grant_id}:cancelled"
        return await self._publish(node_status(self._node_id), encode(status), msg_id)

    async def report_finished(self, rec: st.GrantRecord) -> None:
        """Report a finished record; once both streams stored it, mark it ``reported`` (in the
        next commit, not waited for: losing the mark costs only a deduplicated repeat)."""
        if await self.report(rec):
            self._writer.save_soon(st.reported(rec))

    async def _publish(self, subject: str, payload: bytes, msg_id: str) -> bool:
        delay = 0.2
        attempts = 0
        while True:
            attempts += 1
            try:
                await self._js.publish(
                    subject,
                    payload,
                    timeout=self._publish_timeout_s,
                    headers={MSG_ID_HEADER: msg_id},
                )
                return True
            except (nats.errors.Error, OSError) as err:
                # While serving, keep trying (NATS may be restarting); once stopping, a few
                # tries and the unreported record waits for the next start.
                if self._stopping.is_set() and attempts >= 3:
                    log.error("could not publish %s to %s: %s", msg_id, subject, err)
                    return False
                log.warning("publishing %s failed, retrying: %s", msg_id, err)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
