"""Request/reply API on ``gpulayer.api.*`` for the CLI. One replica answers each request
(queue group). Replies are JSON: ``{"ok": true, "data": ...}`` or ``{"ok": false, "error": "..."}`` (with
``"denied": true`` when the caller lacks the right: cancelling another's job, quotas).

Who asks is the subject's last token (``gpulayer.api.<verb>.<caller>``): only the caller's
credential may publish there. The bare ``gpulayer.api.<verb>`` is the anonymous caller, which
only an admin's credential reaches when auth is on, and everyone when it is off: both have every
right. Others may cancel only their own jobs and see only their own jobs' env values.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, Literal

import asyncpg
import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

import gpulayer_matching as matcher
from gpulayer_contracts import CancelJob, Cancelled, encode
from gpulayer_contracts.bounds import clip_text, node_id_errors
from gpulayer_contracts.codec import capabilities_decoder, job_request_decoder
from gpulayer_contracts.health import NodeObservations
from gpulayer_contracts.matrix import SUPPORT_MATRIX
from gpulayer_contracts.profiles import Profiles
from gpulayer_contracts.subjects import (
    ANONYMOUS,
    API_CANCEL,
    API_EXPLAIN,
    API_JOB,
    API_JOBS,
    API_MATRIX,
    API_NODE,
    API_NODES,
    API_PROFILES,
    API_QUOTA,
    API_SERVICES,
    api_caller,
)
from gpulayer_matching.gang import explain_gang, is_gang
from gpulayer_placement import dependencies, node_report, quotas
from gpulayer_placement.audit import Auditor, audited
from gpulayer_placement.fleet import Fleet
from gpulayer_placement.limits import RateLimit
from gpulayer_placement.policy import Policy, load_policy
from gpulayer_placement.publisher import ANNOUNCE_AGAIN_WITHIN_S, Publisher
from gpulayer_placement.store import Store

log = logging.getLogger(__name__)

QUEUE = "placement-api"
REDACTED = "<redacted>"


class ApiError(Exception):
    pass


class ApiDenied(ApiError):
    """The caller lacks the right this needs: the reply says so (``"denied": true``), and the
    CLI exits with its permission-denied status."""

    denied = True  # the audit trail records it so (audit.audited)


class ApiLimited(ApiError):
    """The caller is over its API request rate (``limits.api_limit``)."""


class _JobQuery(msgspec.Struct, frozen=True):
    job_id: str


class _JobsQuery(msgspec.Struct, frozen=True):
    state: str | None = None
    limit: int = 100
    offset: int = 0  # pages: the fleet page reads more jobs than fit in one reply


class _NodesQuery(msgspec.Struct, frozen=True):
    """A page of the node list (all of it by default); a reply holds ~1 MB, so a fleet of
    thousands is read page by page."""

    offset: int = 0
    limit: int | None = None


class _QuotaQuery(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    op: Literal["list", "set", "delete"] = "list"
    owner: str | None = None  # None: the default quota
    gpus: dict[str, int] = {}
    cores: float | None = None
    jobs: int | None = None


class _NodeQuery(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    op: Literal["forget"]
    node_id: str


class _CancelQuery(msgspec.Struct, frozen=True):
    job_id: str
    reason: str = "cancelled by user"


def _iso(value: Any) -> Any:
    return value.isoformat() if hasattr(value, "isoformat") else value


class Api:
    def __init__(
        self,
        *,
        nc: Client,
        js: JetStreamContext,
        pool: asyncpg.Pool,
        fleet: Fleet,
        publisher: Publisher,
        forget: Callable[[str], None],
        admins: frozenset[str] = frozenset({"admin"}),
        profiles: Profiles | None = None,
        policy: Policy | None = None,
        limit: RateLimit | None = None,
        auditor: Auditor | None = None,
        forget_node: Callable[[str, str], Awaitable[dict[str, Any]]] | None = None,
    ) -> None:
        self.auditor = auditor
        # (node, who asks) -> what was released: forget.NodeForget's (service.py wires it).
        self.forget_node = forget_node
        self.policy = policy if policy is not None else Policy()
        self.limit = limit
        self.nc = nc
        self.js = js
        self.pool = pool
        self.fleet = fleet
        self.publisher = publisher
        self.forget = forget
        self.admins = admins
        self.profiles = profiles if profiles is not None else Profiles()
        self.max_payload = 1 << 20  # the server's (set from its INFO when wired)
        # The latest device observations per node (service.py wires the observations part's).
        self.observations: dict[str, NodeObservations] = {}

    async def subscribe(self) -> list[Any]:
        """One queue-group subscription per API subject; the caller unsubscribes them."""
        routes: dict[str, Callable[[bytes, str], Awaitable[Any]]] = {
            API_NODES: self.nodes,
            API_JOBS: self.jobs,
            API_JOB: self.job,
            API_EXPLAIN: self.explain,
            API_CANCEL: audited(self.auditor, "cancel", self.cancel),
            API_MATRIX: self.matrix,
            API_PROFILES: self.profile_fit,
            API_SERVICES: self.services,
            API_QUOTA: audited(self.auditor, "quota", self.quota),
            API_NODE: audited(self.auditor, "node", self.node),
        }
        return [
            await self.nc.subscribe(subject, queue=QUEUE, cb=self._wrap(handler))
            for verb, handler in routes.items()
            for subject in (verb, f"{verb}.*")  # anonymous, and as a named caller
        ]

    def privileged(self, caller: str) -> bool:
        """Admins, and the anonymous caller (auth off, or an admin on the bare subject)."""
        return caller == ANONYMOUS or caller in self.admins

    def _wrap(
        self, handler: Callable[[bytes, str], Awaitable[Any]]
    ) -> Callable[[Msg], Awaitable[None]]:
        async def cb(msg: Msg) -> None:
            try:
                caller = api_caller(msg.subject)
                limited = self.limit.check(caller) if self.limit is not None else None
                if limited is not None:
                    raise ApiLimited(limited)
                reply: dict[str, Any] = {"ok": True, "data": await handler(msg.data, caller)}
            except ApiDenied as err:
                reply = {"ok": False, "error": clip_text(str(err)), "denied": True}
            except ApiLimited as err:
                reply = {"ok": False, "error": str(err), "limited": True}
            except (ApiError, ValueError, msgspec.ValidationError, msgspec.DecodeError) as err:
                reply = {"ok": False, "error": clip_text(str(err))}
            except RecursionError:
                reply = {"ok": False, "error": "not valid JSON: nested too deeply"}
            except Exception as err:
                log.exception("api %s failed", msg.subject)
                reply = {"ok": False, "error": clip_text(f"internal error: {err}")}
            if msg.reply:
                try:
                    await msg.respond(self._bounded(reply))
                except Exception as err:  # the requester is gone, or NATS is: nothing to do
                    log.warning("api %s: reply not sent: %r", msg.subject, err)

        return cb

    def _bounded(self, reply: dict[str, Any]) -> bytes:
        """The reply, encoded to fit the server's max_payload: a list is cut (saying how many
        were left out in ``note``), a job record loses its request."""
        data = encode(reply)
        room = self.max_payload - 1024
        if len(data) <= room:
            return data
        items = reply.get("data")
        if isinstance(items, list):
            keep = len(items) * room // len(data)
            while keep > 0 and len(data) > room:
                keep = keep * 9 // 10
                note = f"showing {keep} of {len(items)}: the rest don't fit in one reply"
                data = encode({"ok": True, "data": items[:keep], "note": note})
            return data
        if isinstance(items, dict) and "request" in items:
            size = len(encode(items["request"]))
            items = {**items, "request": None}
            note = f"request left out: {size} bytes don't fit in one reply"
            data = encode({"ok": True, "data": items, "note": note})
            if len(data) <= room:
                return data
        return encode({"ok": False, "error": f"the reply ({len(data)} bytes) is too large"})

    async def nodes(self, data: bytes, caller: str = ANONYMOUS) -> Any:
        q = msgspec.json.decode(data or b"{}", type=_NodesQuery)
        limit = None if q.limit is None else max(q.limit, 1)
        async with self.pool.acquire() as conn:
            rows = await Store.fetch(conn, "list_nodes", max(q.offset, 0), limit)
        out = []
        for r in rows:
            caps = capabilities_decoder.decode(r["capabilities"])
            view = self.fleet.get(r["node_id"])
            out.append(
                {
                    "node_id": r["node_id"],
                    "online": r["online"],
                    "last_seen": _iso(r["last_seen"]),
                    "executor": node_report.executor_state(self.fleet, r["node_id"]),
                    "active_jobs": r["active_jobs"],
                    "busy_devices": sorted(view.exclusive | view.shared) if view else [],
                    "resources": node_report.resources(self.fleet, view) if view else None,
                    "report_rejected": self.fleet.report_errors.get(r["node_id"]),
                    "capabilities": msgspec.to_builtins(caps),
                    "health": node_report.health(self.observations.get(r["node_id"]), view),
                }
            )
        return out

    async def node(self, data: bytes, caller: str = ANONYMOUS) -> Any:
        """Admins only: ``{"op": "forget", "node_id": name}`` releases what a node that never
        comes back still holds, refused while it still heartbeats (``forget.NodeForget``)."""
        if not self.privileged(caller):
            log.warning("refused: %s tried to change a node", caller)
            raise ApiDenied("only admins may forget a node (placement's GPULAYER_ADMINS)")
        q = msgspec.json.decode(data or b"{}", type=_NodeQuery)
        errors = node_id_errors(q.node_id)
        if errors:
            raise ApiError("; ".join(errors))
        if self.forget_node is None:
            raise ApiError("this placement replica can't forget nodes")
        return await self.forget_node(q.node_id, caller)

    async def jobs(self, data: bytes, caller: str = ANONYMOUS) -> Any:
        q = msgspec.json.decode(data or b"{}", type=_JobsQuery)
        async with self.pool.acquire() as conn:
            rows = await Store.fetch(
                conn, "list_jobs", q.state, min(max(q.limit, 1), 10_000), max(q.offset, 0)
            )
        out = [{k: _iso(v) for k, v in dict(r).items()} for r in rows]
        for job in out:  # fair share: the owner's recent GPU-seconds, lowest goes first
            job["owner_usage_gpu_s"] = round(self.policy.usage(job.get("owner") or ANONYMOUS), 1)
        return out

    async def services(self, data: bytes, caller: str = ANONYMOUS) -> Any:
        """Services (``kind = "service"``), newest first: state, restarts so far, the node it runs
        on (or last ran on), when a restart waits out its backoff."""
        q = msgspec.json.decode(data or b"{}", type=_JobsQuery)
        async with self.pool.acquire() as conn:
            rows = await Store.fetch(conn, "list_services", q.state, min(max(q.limit, 1), 10_000))
        out = []
        for r in rows:
            row = {k: _iso(v) for k, v in dict(r).items()}
            row["restart"] = msgspec.json.decode(r["restart"]) if r["restart"] else None
            out.append(row)
        return out

    async def _job_row(self, job_id: str) -> dict[str, Any]:
        async with self.pool.acquire() as conn:
            row = await Store.fetchrow(conn, "get_job", job_id)
        if row is None:
            raise ApiError(f"no job {job_id!r}")
        return dict(row)

    async def job(self, data: bytes, caller: str = ANONYMOUS) -> Any:
        """A job's record. Its env values only for its owner and admins: others see the names."""
        q = msgspec.json.decode(data, type=_JobQuery)
        row = await self._job_row(q.job_id)
        request = msgspec.json.decode(row["request"])
        if (
            isinstance(request, dict)
            and isinstance(request.get("env"), dict)
            and not (self.privileged(caller) or row.get("owner") == caller)
        ):
            request["env"] = dict.fromkeys(request["env"], REDACTED)
        row["request"] = request
        out = {k: _iso(v) for k, v in row.items()}
        if row.get("is_gang"):  # a distributed job: each rank's node, devices, state, exit
            async with self.pool.acquire() as conn:
                ranks = await Store.fetch(conn, "gang_ranks", q.job_id)
            out["ranks"] = [
                {**{k: _iso(v) for k, v in dict(r).items() if k != "gang"}, "devices": r["devices"]}
                for r in ranks
            ]
            gang = msgspec.json.decode(ranks[0]["gang"]) if ranks and ranks[0]["gang"] else None
            if gang is not None:
                out["rendezvous"] = f"{gang['master_addr']}:{gang['master_port']}"
        return out

    async def explain(self, data: bytes, caller: str = ANONYMOUS) -> Any:
        q = msgspec.json.decode(data, type=_JobQuery)
        row = await self._job_row(q.job_id)
        out: dict[str, Any] = {"job_id": q.job_id, "state": row["state"]}
        if row["state"] == "rejected":
            out["summary"] = f"rejected: {row['reason']}"
            return out
        job = job_request_decoder.decode(row["request"])
        views = self.fleet.views()
        decision = explain_gang(job, views) if is_gang(job) else matcher.explain(job, views)
        out.update(
            summary=decision.summary, reasons=decision.reasons, unsatisfiable=decision.unsatisfiable
        )
        out["policy"] = self._policy_note(row, decision.can_run_now > 0)
        if row["state"] in ("placed", "running") and row.get("is_gang"):
            async with self.pool.acquire() as conn:
                ranks = await Store.fetch(conn, "gang_ranks", q.job_id)
            out["ranks"] = [
                {"rank": r["rank"], "node_id": r["node_id"], "devices": list(r["devices"] or [])}
                for r in ranks
            ]
        elif row["state"] in ("placed", "running"):
            out["node_id"] = row["node_id"]
            out["devices"] = list(row["devices"])
        view = self.fleet.get(row["node_id"]) if row["state"] == "placed" else None
        if view is not None and view.executor_down:
            out["note"] = (
                f"node {row['node_id']} has no running executor (its heartbeats stopped): the "
                "grant waits there until it is back"
            )
        return out

    async def cancel(self, data: bytes, caller: str = ANONYMOUS) -> Any:
        """Only the job's owner or an admin may cancel it."""
        q = msgspec.json.decode(data, type=_CancelQuery)
        row = await self._job_row(q.job_id)
        owner = row.get("owner") or ANONYMOUS
        if owner != caller and not self.privileged(caller):
            log.warning("refused: %s tried to cancel job %s of %s", caller, q.job_id, owner)
            raise ApiDenied(
                f"job {q.job_id} belongs to another user: only its owner or an admin may cancel it"
            )
        # A retried job or a restarting service moves between waiting and running on its own:
        # whichever state it is in when asked, the cancel holds (a stop asked while it runs
        # makes its end final), so look again if it moved between the two statements.
        for _ in range(3):
            async with self.pool.acquire() as conn, conn.transaction():
                done = await Store.fetchrow(conn, "cancel_pending", q.job_id, q.reason)
                ranks = None
                if done is not None:
                    await dependencies.release(conn, [(q.job_id, "cancelled")])
                    stopping = None
                elif row.get("is_gang"):
                    # A distributed job: every rank still active is cancelled; the job ends
                    # 'cancelled' once they all reported (gang_status).
                    ranks = await Store.fetch(conn, "stop_gang", q.job_id)
                    stopping = None
                else:
                    stopping = await Store.fetchrow(conn, "request_stop", q.job_id)
            if done is not None:
                self.forget(q.job_id)
                cancelled = Cancelled(job_id=q.job_id, reason=q.reason, owner=owner)
                # Committed: no other path says it, so it is retried through a failover (the
                # jobs waiting for it that it cancelled are announced from the outbox).
                item = self.publisher.event_item(cancelled)
                await self.publisher.publish_committed([item], f"job {q.job_id}'s cancelled event")
                return {"job_id": q.job_id, "state": "cancelled"}
            if ranks:
                items = [
                    self.publisher.cancel_item(
                        r["node_id"],
                        CancelJob(job_id=r["job_id"], reason=q.reason, grant_id=r["grant_id"]),
                    )
                    for r in ranks
                ]
                if not await self.publisher.publish_committed(items, f"job {q.job_id}'s cancels"):
                    raise ApiError(f"the cancels of job {q.job_id}'s ranks were not all sent")
                nodes = sorted({r["node_id"] for r in ranks})
                return {"job_id": q.job_id, "state": "cancelling", "nodes": nodes}
            if stopping is not None:
                grant_id = stopping["grant_id"]
                cancel = CancelJob(job_id=q.job_id, reason=q.reason, grant_id=grant_id)
                item = self.publisher.cancel_item(stopping["node_id"], cancel)
                if not await self.publisher.publish_committed([item], f"job {q.job_id}'s cancel"):
                    raise ApiError(f"the cancel of job {q.job_id} was not sent: try again")
                return {"job_id": q.job_id, "state": "cancelling", "node_id": stopping["node_id"]}
            row = await self._job_row(q.job_id)
            if row["state"] not in ("pending", "placed", "running"):
                break
        await self._cancelled_again(row, owner)
        raise ApiError(f"job {q.job_id} is already {row['state']}")

    async def _cancelled_again(self, row: dict[str, Any], owner: str) -> None:
        """A job cancelled while waiting, cancelled again (a client retrying after a failover):
        the replica that cancelled it may have stopped before its event was stored. Said again
        under the same message id (``<job>:cancelled``, ``Publisher.event_item``), while
        JetStream would drop a copy already stored. Cancelled by its dependency alike."""
        age = (datetime.now(UTC) - row["updated_at"]).total_seconds()
        if row["state"] == "cancelled" and row["node_id"] is None and age < ANNOUNCE_AGAIN_WITHIN_S:
            event = Cancelled(job_id=row["job_id"], reason=row["reason"] or "", owner=owner)
            item = self.publisher.event_item(event)
            await self.publisher.publish_committed([item], f"job {event.job_id}'s cancelled event")

    async def matrix(self, data: bytes, caller: str = ANONYMOUS) -> Any:
        return SUPPORT_MATRIX

    async def profile_fit(self, data: bytes, caller: str = ANONYMOUS) -> Any:
        """The runtime profiles this replica expands jobs with, and per profile how many nodes
        of its fleet satisfy it now and why the others don't."""
        return matcher.profile_fit(self.profiles, self.fleet.views())

    def _policy_note(self, row: dict[str, Any], fits_now: bool) -> dict[str, Any]:
        """Where the queue policy puts a job: its priority, its owner's fair-share usage, and
        for a waiting one the reason the scheduler last gave (quota, reservation, preemption)."""
        owner = row.get("owner") or ANONYMOUS
        note: dict[str, Any] = {
            "priority": row.get("priority") or 0,
            "preemptible": bool(row.get("preemptible")),
            "owner": owner,
            "owner_usage_gpu_s": round(self.policy.usage(owner), 1),
            "order": "higher priority first; within a priority the owner with the least recent "
            "GPU usage (GPU-seconds, half-life 1 day), then the oldest job",
        }
        if row["state"] == "pending":
            note["waiting_reason"] = row.get("reason")
            if fits_now and row.get("reason"):
                note["note"] = "a node could run it now: the queue policy holds it (see reason)"
        r = self.policy.reservation
        if r is not None and r.job_id == row["job_id"]:
            note["reservation"] = {"node_id": r.node_id, "until": r.until}
        if row.get("preempted_for"):
            note["preempted_for"] = row["preempted_for"]
        return note

    async def quota(self, data: bytes, caller: str = ANONYMOUS) -> Any:
        """``{"op": "list"}`` for anyone (quotas and their use are what every user may see, as
        the fleet page's owners view shows); admins only: ``{"op": "set", ...QuotaRequest}``,
        ``{"op": "delete", "owner": name}`` (owner None: the default quota)."""
        q = msgspec.json.decode(data or b"{}", type=_QuotaQuery)
        if q.op != "list" and not self.privileged(caller):
            log.warning("refused: %s tried to change quotas", caller)
            raise ApiDenied("only admins may change quotas (placement's GPULAYER_ADMINS)")
        owner = quotas.DEFAULT_OWNER if q.owner is None else q.owner
        if q.owner is not None and (not q.owner or any(c in q.owner for c in ".*> \t\x00")):
            raise ApiError(f"owner {q.owner!r} is not an identity name")
        async with self.pool.acquire() as conn, conn.transaction():
            if q.op == "set":
                req = quotas.QuotaRequest(owner=q.owner, gpus=q.gpus, cores=q.cores, jobs=q.jobs)
                resources, maxima, clear = quotas.quota_rows(req)
                await Store.execute(conn, "set_quota", owner, resources, maxima, clear)
            elif q.op == "delete":
                await Store.fetch(conn, "delete_quota", owner)
            rows = await Store.fetch(conn, "list_quotas")
            await load_policy(self.policy, conn)
        return [
            {
                "owner": "default" if r["owner"] == quotas.DEFAULT_OWNER else r["owner"],
                "resource": r["resource"],
                "max": r["max"],
                "used": r["used"],
            }
            for r in rows
        ]
