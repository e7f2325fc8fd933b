"""One outcome per distributed job (issue 14): the gang row follows its ranks.

Called inside the transaction that changed rank rows (executor status, the reaping of silent
nodes, devices that vanished), through ``Lifecycle.settle``:

- every rank running (or already done) -> the gang is ``running``;
- every rank succeeded -> ``succeeded``;
- a rank failed, timed out, was lost or was cancelled by anything but the gang -> the gang is
  ``failed`` (``lost`` for a lost rank) naming the rank and its node, and the ranks still
  active get a signed cancel after the commit;
- ``gpulayer cancel`` of the gang (``stop_requested``) -> ``cancelled`` once every rank ended.

The gang row is locked first, so two replicas settling reports of one gang take turns, and a
gang that already ended changes no more: a redelivered or late report makes no second end.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncpg import Record

from gpulayer_contracts import CancelJob, Cancelled, Failed, JobEvent, Lost, Running, Succeeded
from gpulayer_contracts.subjects import ANONYMOUS
from gpulayer_placement import dependencies
from gpulayer_placement.store import Store

# A jobs row: an asyncpg Record, a dict in unit tests.
Row = Mapping[str, Any] | Record

ACTIVE = ("placed", "running")
ENDED_BADLY = ("failed", "lost", "cancelled")


@dataclass
class GangSettled:
    """What ``settle`` decided, to announce once the transaction commits."""

    events: list[JobEvent] = field(default_factory=list)
    cancels: list[tuple[str, CancelJob]] = field(default_factory=list)  # (node, cancel)
    ended: list[str] = field(default_factory=list)  # gang ids that ended for good
    unblocked: list[str] = field(default_factory=list)  # their dependents free to run now


@dataclass(frozen=True)
class Verdict:
    state: str
    exit_code: int | None
    reason: str | None
    event: JobEvent
    cancel: list[Row]  # ranks still active, to cancel


def _culprit(ranks: Sequence[Row]) -> Row | None:
    """The rank whose end ends the gang: a failure before a loss before a cancel, lowest rank
    first."""
    bad = [r for r in ranks if r["state"] in ENDED_BADLY]
    if not bad:
        return None
    return min(bad, key=lambda r: (ENDED_BADLY.index(r["state"]), r["rank"]))


def _why(r: Row) -> str:
    where = f"rank {r['rank']} on {r['node_id']}"
    reason = r.get("reason")
    if r["state"] == "failed":
        if (code := r.get("exit_code")) is not None:
            text = f"{where} exited with code {code}"
            # The executor's reason starts with what the code already says ("exit code 1").
            said = f"exit code {code}"
            rest = "" if reason == said else (reason or "").removeprefix(f"{said}; ")
            return f"{text} ({rest})" if rest else text
        return f"{where} failed: {reason}" if reason else f"{where} failed"
    verb = "was lost" if r["state"] == "lost" else "was cancelled"
    return f"{where} {verb}: {reason}" if reason else f"{where} {verb}"


def decide(gang: Row, ranks: Sequence[Row]) -> Verdict | None:
    """Pure: the gang's next state from its row and its ranks' rows; None: no change."""
    job_id, owner = gang["job_id"], gang.get("owner") or ANONYMOUS
    if gang["state"] not in ACTIVE or not ranks:
        return None
    active = [r for r in ranks if r["state"] in ACTIVE]
    rank0 = ranks[0]
    if gang.get("stop_requested"):
        if active:
            return None
        reason = "cancelled by user"
        event: JobEvent = Cancelled(
            job_id=job_id, owner=owner, node_id=rank0["node_id"], reason=reason
        )
        return Verdict("cancelled", None, reason, event, [])
    bad = _culprit(ranks)
    if bad is not None:
        why = _why(bad)
        node, rank = bad["node_id"], bad["rank"]
        if bad["state"] == "lost":
            event = Lost(job_id=job_id, owner=owner, node_id=node, reason=why, rank=rank)
            return Verdict("lost", None, why, event, active)
        code = bad.get("exit_code") if bad["state"] == "failed" else None
        event = Failed(
            job_id=job_id, owner=owner, node_id=node, exit_code=code, reason=why, rank=rank
        )
        return Verdict("failed", code, why, event, active)
    if all(r["state"] == "succeeded" for r in ranks):
        event = Succeeded(job_id=job_id, owner=owner, node_id=rank0["node_id"], exit_code=0)
        return Verdict("succeeded", 0, None, event, [])
    if gang["state"] == "placed" and all(r["state"] in ("running", "succeeded") for r in ranks):
        event = Running(job_id=job_id, owner=owner, node_id=rank0["node_id"])
        return Verdict("running", None, None, event, [])
    return None


async def settle(conn: Any, rows: Iterable[Row]) -> GangSettled:
    """The gangs of the rank rows in ``rows`` (apply_status / lose_*_jobs rows), decided on
    ``conn`` in the caller's transaction."""
    out = GangSettled()
    gang_ids = sorted({r["gang_id"] for r in rows if r.get("gang_id")})
    if not gang_ids:
        return out
    gangs = await Store.fetch(conn, "lock_gangs", gang_ids)
    if not gangs:
        return out
    by_gang: dict[str, list[Any]] = {}
    for r in await Store.fetch(conn, "gang_rank_states", [g["job_id"] for g in gangs]):
        by_gang.setdefault(r["gang_id"], []).append(r)
    verdicts = [(g, v) for g in gangs if (v := decide(g, by_gang.get(g["job_id"], []))) is not None]
    if not verdicts:
        return out
    await Store.fetch(
        conn,
        "set_gangs",
        [g["job_id"] for g, _ in verdicts],
        [v.state for _, v in verdicts],
        [v.exit_code for _, v in verdicts],
        [v.reason for _, v in verdicts],
    )
    ended = [(g["job_id"], v.state) for g, v in verdicts if v.state != "running"]
    for g, v in verdicts:
        out.events.append(v.event)
        for rk in v.cancel:
            why = f"distributed job {g['job_id']} ended: {v.reason}"
            cancel = CancelJob(job_id=rk["job_id"], reason=why, grant_id=rk["grant_id"])
            out.cancels.append((rk["node_id"], cancel))
    if ended:
        out.ended = [j for j, _ in ended]
        out.unblocked = await dependencies.release(conn, ended)
    return out
