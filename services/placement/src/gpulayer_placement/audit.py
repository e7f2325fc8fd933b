"""Audit: placement's records of submits, cancels, quota changes and nodes forgotten, sent in
the background.

``record`` only queues (the submit path never waits for the audit stream); the ``audit`` task
sends what is queued, up to MAX_RECORDS_PER_MESSAGE records a message, pipelined, and retries
what JetStream did not store. The queue is bounded: past MAX_QUEUED (NATS away for long) the
oldest records are dropped, counted and logged, never the service's memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import msgspec
from nats.js import JetStreamContext

from gpulayer_contracts import encode
from gpulayer_contracts.audit import MAX_RECORDS_PER_MESSAGE, Action, AuditRecord, audit_subject
from gpulayer_contracts.subjects import ANONYMOUS

log = logging.getLogger(__name__)

MAX_QUEUED = 100_000
RETRY_S = 1.0


def role_of(identity: str, admins: frozenset[str]) -> str:
    if identity == ANONYMOUS:
        return "anonymous"
    return "admin" if identity in admins else "user"


class Auditor:
    def __init__(
        self, js: JetStreamContext, admins: frozenset[str], *, publish_timeout_s: float = 10.0
    ) -> None:
        self.js = js
        self.admins = admins
        self.publish_timeout_s = publish_timeout_s
        self._queue: deque[AuditRecord] = deque()
        self._wake = asyncio.Event()
        self.dropped = 0
        self.sent = 0

    def record(
        self, identity: str, action: Action, target: str, outcome: str, detail: str = ""
    ) -> None:
        """Queue one record; it is sent by the ``audit`` task."""
        if len(self._queue) >= MAX_QUEUED:
            self._queue.popleft()
            self.dropped += 1
            if self.dropped in (1, 10, 100) or self.dropped % 10_000 == 0:
                log.error("audit: %d records dropped (NATS has not stored them)", self.dropped)
        rec = AuditRecord(
            identity=identity,
            role=role_of(identity, self.admins),
            action=action,
            target=target,
            outcome=outcome,
            detail=detail[:500],
        )
        self._queue.append(rec)
        self._wake.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Send queued records until ``stop``; what is queued then is sent once more."""
        while not stop.is_set():
            if not self._queue:
                self._wake.clear()
                waits = {
                    asyncio.ensure_future(self._wake.wait()),
                    asyncio.ensure_future(stop.wait()),
                }
                _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                for w in pending:
                    w.cancel()
                continue
            if not await self.flush():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), RETRY_S)
        await self.flush()

    async def flush(self) -> bool:
        """Send what is queued now; False (kept for the next try) when it was not all stored."""
        records = list(self._queue)
        if not records:
            return True
        self._queue.clear()
        by_action: dict[str, list[AuditRecord]] = {}
        for rec in records:
            by_action.setdefault(rec.action, []).append(rec)
        items = [
            (audit_subject(action), encode(recs[i : i + MAX_RECORDS_PER_MESSAGE]))  # type: ignore[arg-type]
            for action, recs in by_action.items()
            for i in range(0, len(recs), MAX_RECORDS_PER_MESSAGE)
        ]
        try:
            futures = [await self.js.publish_async(subject, data) for subject, data in items]
            await asyncio.wait_for(asyncio.gather(*futures), self.publish_timeout_s)
        except Exception as err:
            # Sent again whole: a message that was stored is stored twice (the trail says
            # the same thing twice rather than lose it).
            log.warning("audit: %d records not stored yet: %r", len(records), err)
            # Back in front of any queued since, within the bound (the oldest go first).
            room = max(0, MAX_QUEUED - len(self._queue))
            self.dropped += len(records) - min(room, len(records))
            self._queue.extendleft(reversed(records[max(0, len(records) - room) :] if room else []))
            return False
        self.sent += len(records)
        return True


class _Target(msgspec.Struct, frozen=True):
    """What an audited API request names (read loosely: the handler itself checks it)."""

    job_id: str | None = None
    owner: str | None = None
    node_id: str | None = None
    op: str = "list"


_target_decoder = msgspec.json.Decoder(_Target)
Handler = Callable[[bytes, str], Awaitable[Any]]
Verb = Literal["cancel", "quota", "node"]


def _action(verb: Verb, t: _Target) -> Action | None:
    """The action an API request is recorded as; None: not recorded (a quota list)."""
    if verb == "cancel":
        return "cancel"
    if verb == "node":
        return "node-forget"  # the verb's one operation (any other is refused as invalid)
    return "quota-set" if t.op == "set" else "quota-delete" if t.op == "delete" else None


def audited(auditor: Auditor | None, verb: Verb, handler: Handler) -> Handler:
    """``handler`` (the API's cancel, quota or node), recording who asked, what for, and how
    it ended: ``denied`` for a right the caller lacks, ``failed`` with the error, else the
    job's state (cancel) or ``ok``, with the quota asked for or what forgetting the node
    released. Listing quotas changes nothing and is not recorded."""
    if auditor is None:
        return handler

    async def run(data: bytes, caller: str) -> Any:
        try:
            t = _target_decoder.decode(data or b"{}")
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            t = _Target()
        action = _action(verb, t)
        if action is None:
            return await handler(data, caller)
        target = {"cancel": t.job_id, "quota": t.owner or "default", "node": t.node_id}[verb]
        try:
            result = await handler(data, caller)
        except Exception as err:
            outcome = "denied" if getattr(err, "denied", False) else "failed"
            auditor.record(caller, action, target or "?", outcome, str(err))
            raise
        said = result if isinstance(result, dict) else {}
        detail = {"cancel": "", "quota": data.decode("utf-8", "replace")}.get(
            verb, str(said.get("summary", ""))
        )
        auditor.record(caller, action, target or "?", said.get("state", "ok"), detail)
        return result

    return run
