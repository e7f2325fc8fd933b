"""``gpulayer audit`` (admins): the audit trail, read from the AUDIT stream, as a table.

Also ``record_credential_change``: what ``gpulayer auth`` calls after minting or revoking a
credential, so the trail says who did it (best effort: a stack that is not running has no trail
to write to, and the credential is made all the same).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import re
import sys
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import msgspec

from gpulayer_cli import common
from gpulayer_contracts import encode
from gpulayer_contracts.audit import ACTIONS, Action, AuditRecord, audit_decoder, audit_subject
from gpulayer_contracts.subjects import AUDIT_WILDCARD

if TYPE_CHECKING:  # the CLI starts without importing nats or rich for every command
    from nats.js import JetStreamContext
    from rich.table import Table

AUDIT_STREAM = "AUDIT"
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_when(text: str, now: datetime | None = None) -> datetime:
    """``2026-12-01T18:00:00Z`` / ``2026-12-01`` (UTC unless it says), or a duration back from
    now (``90s``, ``30m``, ``2h``, ``7d``, ``1w``); ValueError naming what was given."""
    now = now or datetime.now(UTC)
    m = _DURATION.match(text.strip())
    if m:
        try:
            return now - timedelta(seconds=float(m.group(1)) * _UNIT_S[m.group(2)])
        except OverflowError:
            raise ValueError(f"{text[:40]!r} goes back further than any time") from None
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(
            f"{text[:40]!r} is neither a time (2026-12-01T18:00:00Z) nor a duration (30m, 2h, 7d)"
        ) from None
    return when if when.tzinfo else when.replace(tzinfo=UTC)


class Query(msgspec.Struct, frozen=True, kw_only=True):
    who: str | None = None
    action: Action | None = None
    since: datetime | None = None
    until: datetime | None = None
    limit: int = 1000  # the newest this many of what matched


async def read_audit(js: JetStreamContext, q: Query, timeout: float = 5.0) -> list[AuditRecord]:
    """Records matching ``q``, oldest first: the stream read from ``since`` (or its start) up to
    its last message now, ``who`` and ``until`` applied to each record."""
    from nats.js.api import DeliverPolicy

    subject = audit_subject(q.action) if q.action else AUDIT_WILDCARD
    info = await js.stream_info(AUDIT_STREAM, subjects_filter=subject)
    last = info.state.last_seq
    if not info.state.messages or (q.action and not (info.state.subjects or {}).get(subject)):
        return []  # nothing matches: no need to wait for a message
    options: dict[str, Any] = {"deliver_policy": DeliverPolicy.ALL}
    if q.since is not None:
        options = {"deliver_policy": DeliverPolicy.BY_START_TIME, "opt_start_time": q.since}
    sub = await js.subscribe(subject, ordered_consumer=True, **options)
    found: list[AuditRecord] = []
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=timeout)
            except TimeoutError:
                break  # nothing more matches (a filtered read may end before ``last``)
            for rec in _records(msg.data):
                if q.until is not None and rec.at > q.until:
                    continue
                if (q.who is None or rec.identity == q.who) and (
                    q.since is None or rec.at >= q.since
                ):
                    found.append(rec)
            if msg.metadata.sequence.stream >= last or not msg.metadata.num_pending:
                break
    finally:
        await sub.unsubscribe()
    return found[-q.limit :] if q.limit > 0 else []


def _records(data: bytes) -> list[AuditRecord]:
    try:
        return audit_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return []  # not a record (only placement and admins may publish here): skipped


def audit_table(records: list[AuditRecord]) -> Table:
    from rich.table import Table

    table = Table(title=f"audit trail ({len(records)})")
    for column in ("time (UTC)", "who", "role", "action", "target", "outcome", "detail"):
        table.add_column(column)
    for r in records:
        table.add_row(
            r.at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S"),
            r.identity,
            r.role,
            r.action,
            r.target,
            r.outcome,
            r.detail[:120],
        )
    return table


def cmd_audit(args: argparse.Namespace) -> int:
    try:
        q = Query(
            who=args.who,
            action=args.action,
            since=parse_when(args.since) if args.since else None,
            until=parse_when(args.until) if args.until else None,
            limit=args.limit,
        )
    except ValueError as err:
        print(f"gpulayer audit: {err}", file=sys.stderr)
        return common.EXIT_INVALID

    async def go(nc: Any) -> int:
        import nats.js.errors

        try:
            records = await read_audit(nc.jetstream(), q)
        except nats.js.errors.NotFoundError:
            records = []  # placement has not declared the stream yet: nothing recorded
        if args.json:
            print(json.dumps(msgspec.to_builtins(records), indent=2))
        else:
            common.console().print(audit_table(records))
        return 0

    return asyncio.run(common.with_nats(go))


def add_audit(sub: Any) -> None:
    au = sub.add_parser(
        "audit",
        help="the audit trail (admins): who submitted, cancelled, changed a quota, forgot a "
        "node, minted or revoked a credential, and when",
    )
    au.add_argument("--who", help="one identity's records only")
    au.add_argument("--action", choices=ACTIONS)
    au.add_argument("--since", help="a time (2026-12-01T18:00Z) or how long ago (30m, 2h, 7d)")
    au.add_argument("--until", help="a time, or how long ago")
    au.add_argument("--limit", type=int, default=1000, help="the newest N records (1000)")
    au.add_argument("--json", action="store_true")
    au.set_defaults(fn=cmd_audit)


async def publish_records(js: JetStreamContext, records: list[AuditRecord]) -> None:
    """Store ``records`` on the audit stream, one message per action."""
    by_action: dict[Action, list[AuditRecord]] = {}
    for r in records:
        by_action.setdefault(r.action, []).append(r)
    for action, recs in by_action.items():
        await js.publish(audit_subject(action), encode(recs), stream=AUDIT_STREAM)


def record_credential_change(
    action: Action, target: str, outcome: str = "ok", detail: str = ""
) -> bool:
    """For ``gpulayer auth``: record that this CLI's identity minted or revoked (``action``
    "mint" / "revoke") the credential ``target`` (``user alice``). Connects with the CLI's own
    settings and credential (an admin's: nobody else may write the trail). False, with one line
    on stderr, when it was not stored; never raises."""

    def run() -> None:
        asyncio.run(
            asyncio.wait_for(_store_credential_change(action, target, outcome, detail), 5.0)
        )

    try:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            run()
        else:  # called from code that runs an event loop (a test, an embedding): a thread
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                pool.submit(run).result()
    except Exception as err:
        print(
            f"gpulayer: the audit trail did not record this {action}: "
            f"{str(err) or type(err).__name__}",
            file=sys.stderr,
        )
        return False
    return True


async def _store_credential_change(action: Action, target: str, outcome: str, detail: str) -> None:
    from gpulayer_runtime.auth import identity_of
    from gpulayer_runtime.nats import connect

    settings = common.nats_settings()
    who = identity_of(settings.creds) if settings.creds else None
    identity, role = (who[1] or who[0], who[0]) if who else ("anonymous", "anonymous")
    rec = AuditRecord(
        identity=identity,
        role=role,
        action=action,
        target=target,
        outcome=outcome,
        detail=detail[:500],
    )

    async def quiet(err: Exception) -> None:
        pass  # record_credential_change's one line says it, not one per try

    # Each server tried once (nats-py's 0 means "forever"), quickly: a mint made with no
    # server running (before the stack starts) must not wait on the trail.
    nc = await connect(
        settings.url,
        "gpulayer-cli",
        max_reconnect_attempts=1,
        allow_reconnect=False,
        connect_timeout=2,
        error_cb=quiet,
        **settings.connect_args(),
    )
    try:
        await publish_records(nc.jetstream(), [rec])
    finally:
        await nc.close()
