"""The commands about jobs already submitted: ``jobs``, ``services``, ``job``, ``explain``,
``cancel`` and ``logs``."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from rich.console import Console

from gpulayer_cli import common


def _render_jobs(console: Console, data: Any) -> None:
    from gpulayer_cli.render import jobs_table

    console.print(jobs_table(data))


def _render_jobs_folded(console: Console, data: Any) -> None:
    from gpulayer_cli.render import fold_arrays, jobs_table

    console.print(jobs_table(fold_arrays(data)))


def cmd_jobs(args: argparse.Namespace) -> int:
    """Recent jobs; the jobs of an array on one line unless ``--expand`` (``--json``: every
    job)."""
    from gpulayer_contracts.subjects import API_JOBS

    render = _render_jobs if args.expand else _render_jobs_folded
    return common.api_command(API_JOBS, lambda a: {"state": a.state, "limit": a.limit}, render)(
        args
    )


def _render_services(console: Console, data: Any) -> None:
    from gpulayer_cli.render import services_table

    console.print(services_table(data))


def cmd_job(args: argparse.Namespace) -> int:
    """A job's record and its whole event history. Another owner's job: its record (env values
    redacted by placement) and, where the credential may not read its events, a note saying so
    instead of them."""
    from gpulayer_cli.client import api, history
    from gpulayer_cli.denials import PermissionDenied
    from gpulayer_cli.render import print_event
    from gpulayer_contracts import encode
    from gpulayer_contracts.subjects import API_JOB

    async def go(nc: Any) -> int:
        record = await api(nc, API_JOB, {"job_id": args.job_id}, caller=common.me())
        note = None
        try:
            events = await history(nc, args.job_id, owner=record.get("owner") or common.me())
        except PermissionDenied as err:
            events, note = [], f"events not shown: {err}"
            print(f"gpulayer: {note}", file=sys.stderr)
        if args.json:
            out: dict[str, Any] = {"job": record, "events": [json.loads(encode(e)) for e in events]}
            if note:
                out["events"], out["note"] = None, note
            print(json.dumps(out, indent=2))
            return 0
        console = common.console()
        devices = ",".join(map(str, record.get("devices") or [])) or "none"
        ranks = record.get("ranks") or []
        where = (
            f"on {record['node_id']} (devices {devices})"
            if record.get("node_id")
            else f"on {len(ranks)} nodes, rendezvous {record.get('rendezvous')}"
            if ranks
            else "(never placed)"
        )
        request = record.get("request")
        profile = request.get("profile") if isinstance(request, dict) else None
        console.print(
            f"[bold]{record['job_id']}[/bold] {record['state']} {where}, "
            f"submitted {str(record['submitted_at'])[:19]} by {record.get('owner', 'anonymous')}"
            + (f", profile {profile}" if isinstance(profile, str) else "")
        )
        if ranks:  # a distributed job: each rank's node, devices, state and exit code
            from gpulayer_cli.render import ranks_table

            console.print(ranks_table(ranks))
        for event in events:
            print_event(console, event)
        return 0

    return asyncio.run(common.with_nats(go))


def _render_explain(console: Console, data: Any) -> None:
    console.print(f"[bold]{data['job_id']}[/bold] is {data['state']}")
    if "node_id" in data:
        console.print(f"placed on {data['node_id']} devices {data.get('devices')}")
    for r in data.get("ranks", []):  # a distributed job: each rank's node
        console.print(f"rank {r['rank']} on {r['node_id']} devices {r['devices']}")
    if data.get("note"):
        console.print(f"[yellow]{data['note']}[/]")
    console.print(data.get("summary", ""))
    for reason in data.get("reasons", []):
        console.print(f"  - {reason}")
    policy = data.get("policy")
    if policy:  # queue policy: where the job stands among the waiting ones
        console.print(
            f"priority {policy['priority']}; owner {policy['owner']} used "
            f"{policy['owner_usage_gpu_s']:g} GPU-seconds recently ({policy['order']})"
        )
        for key in ("waiting_reason", "note", "reservation", "preempted_for"):
            if policy.get(key):
                console.print(f"  {key.replace('_', ' ')}: {policy[key]}")


def _render_cancel(console: Console, data: Any) -> None:
    console.print(f"{data['job_id']}: {data['state']}")


def cmd_logs(args: argparse.Namespace) -> int:
    from gpulayer_cli.logs import run_logs

    nats = common.nats_settings()
    owner = asyncio.run(_owner_of(args.job_id))
    return int(
        asyncio.run(
            run_logs(
                nats.url,
                args.job_id,
                follow=args.follow,
                out=sys.stdout,
                owner=owner,
                connect_args=nats.connect_args(),
            )
        )
    )


async def _owner_of(job_id: str) -> str:
    """Whose job this is, as placement recorded it; the CLI's own name when placement can't
    say (a user reads only its own jobs anyway)."""
    me = common.me()

    async def ask(nc: Any) -> int:
        record = await common.known_job(nc, job_id)
        found.append(str((record or {}).get("owner") or me))
        return 0

    found: list[str] = []
    await common.with_nats(ask, quiet=True)
    return found[0] if found else me


def add_jobs(sub: Any) -> None:
    j = sub.add_parser("jobs", help="recent jobs")
    j.add_argument("--state", default=None)
    j.add_argument("--limit", type=int, default=50)
    j.add_argument("--json", action="store_true")
    j.add_argument("--expand", action="store_true", help="each job of an array on its own line")
    j.set_defaults(fn=cmd_jobs)


def add_services(sub: Any) -> None:
    from gpulayer_contracts.subjects import API_SERVICES

    sv = sub.add_parser("services", help="long-running services: state, node, restarts")
    sv.add_argument("--state", default=None)
    sv.add_argument("--limit", type=int, default=50)
    sv.add_argument("--json", action="store_true")
    sv.set_defaults(
        fn=common.api_command(
            API_SERVICES, lambda a: {"state": a.state, "limit": a.limit}, _render_services
        )
    )


def add_job(sub: Any) -> None:
    jb = sub.add_parser("job", help="one job: its record and every event so far")
    jb.add_argument("job_id")
    jb.add_argument("--json", action="store_true")
    jb.set_defaults(fn=cmd_job)


def add_explain(sub: Any) -> None:
    from gpulayer_contracts.subjects import API_EXPLAIN

    e = sub.add_parser("explain", help="why a job waits (or where it runs)")
    e.add_argument("job_id")
    e.add_argument("--json", action="store_true")
    e.set_defaults(
        fn=common.api_command(API_EXPLAIN, lambda a: {"job_id": a.job_id}, _render_explain)
    )


def add_cancel(sub: Any) -> None:
    from gpulayer_contracts.subjects import API_CANCEL

    c = sub.add_parser("cancel", help="cancel a waiting or running job")
    c.add_argument("job_id")
    c.add_argument("--json", action="store_true")
    c.set_defaults(
        fn=common.api_command(API_CANCEL, lambda a: {"job_id": a.job_id}, _render_cancel)
    )


def add_logs(sub: Any) -> None:
    lg = sub.add_parser("logs", help="print a job's output")
    lg.add_argument("job_id")
    lg.add_argument("-f", "--follow", action="store_true")
    lg.set_defaults(fn=cmd_logs)
