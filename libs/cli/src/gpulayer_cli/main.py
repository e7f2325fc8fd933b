"""``gpulayer``: one command line for people using and running gpulayer.

Exit codes: 0 success; 1 the thing asked about failed (a job failed, a check said no);
2 bad input (an invalid job file, a bad argument); 3 gpulayer unreachable.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
from rich.console import Console

from gpulayer_contracts import (
    WIRE_SCHEMAS,
    InvalidInput,
    JobRequest,
    __version__,
    load_job_file,
    validate_job,
    wire_schema,
)

if TYPE_CHECKING:
    from gpulayer_runtime.telemetry import Telemetry

EXIT_FAILED, EXIT_INVALID, EXIT_UNREACHABLE = 1, 2, 3


def _nats() -> Any:
    """The CLI's NATS settings (``gpulayer_cli.identity``)."""
    from gpulayer_cli.identity import cli_nats_settings

    return cli_nats_settings(os.environ)


def _me() -> str:
    """The name this CLI submits and asks as (its credentials' identity)."""
    from gpulayer_cli.identity import whoami

    return whoami(_nats())


def _console() -> Console:
    # Piped or redirected output (grep, a log file) is not cut to a guessed 80 columns.
    width = None if sys.stdout.isatty() else 200
    return Console(highlight=False, soft_wrap=True, width=width)


def cmd_schema(args: argparse.Namespace) -> int:
    # The same text as docs/schemas/<name>.json.
    print(json.dumps(wire_schema(args.name), indent=2))
    return 0


def cmd_dev_up(args: argparse.Namespace) -> int:
    from gpulayer_cli.dev import run_dev

    return run_dev(
        once=args.once,
        examples_dir=Path(args.examples),
        data_dir=Path(args.data_dir),
        timeout_s=args.timeout,
        console=_console(),
        auth=not args.no_auth,
    )


def cmd_keys_generate(args: argparse.Namespace) -> int:
    from gpulayer_runtime.signing import (
        PUBLIC_KEYS_SETTING,
        SIGNING_KEY_SETTING,
        SigningKeyError,
        generate_key_pair,
    )

    try:
        seed, public = generate_key_pair(Path(args.dir), args.name)
    except (OSError, SigningKeyError) as err:
        print(f"gpulayer keys generate: {err}", file=sys.stderr)
        return EXIT_INVALID
    print("# placement (keep the seed file private: mode 0600, never on an executor's host)")
    print(f"{SIGNING_KEY_SETTING}={seed.resolve()}")
    print("# every executor (comma-separate several keys while rotating)")
    print(f"{PUBLIC_KEYS_SETTING}={public}")
    return 0


async def _quiet(err: Exception) -> None:
    """The CLI reports a failed connection once, itself, instead of per attempt."""


async def _with_nats(fn: Callable[[Any], Awaitable[int]], *, quiet: bool = False) -> int:
    """Connect as the CLI's identity and run ``fn``; failures to connect are one line (none
    with ``quiet``) and exit status 3, a bad setting exit status 2."""
    import nats.errors

    from gpulayer_cli.client import ApiFailed, ApiUnavailable
    from gpulayer_runtime.auth import AuthError
    from gpulayer_runtime.nats import connect
    from gpulayer_runtime.settings import ConfigError

    def say(text: str) -> None:
        if not quiet:
            print(f"gpulayer: {text}", file=sys.stderr)

    try:
        settings = _nats()
    except (ConfigError, AuthError) as err:
        say(str(err))
        return EXIT_INVALID
    url = settings.url
    try:
        nc = await asyncio.wait_for(
            connect(
                url,
                "gpulayer-cli",
                max_reconnect_attempts=0,
                allow_reconnect=False,
                error_cb=_quiet,
                **settings.connect_args(),
            ),
            5,
        )
    except nats.errors.Error as err:
        if "authorization" in str(err).lower():
            say(
                f"NATS at {url} refused the connection: "
                + (
                    f"credentials {settings.creds} are not valid there"
                    if settings.creds
                    else "it needs credentials (GPULAYER_NATS_CREDS; docs/security.md)"
                )
            )
        else:
            say(f"cannot reach NATS at {url}: {str(err) or 'no server answered'}")
        return EXIT_UNREACHABLE
    except (OSError, TimeoutError) as err:
        say(f"cannot reach NATS at {url}: {str(err) or 'no server answered'}")
        return EXIT_UNREACHABLE
    try:
        return await fn(nc)
    except ApiUnavailable as err:
        print(f"gpulayer: {err}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except ApiFailed as err:
        print(f"gpulayer: {err}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        await nc.close()


def cmd_submit(args: argparse.Namespace) -> int:
    from gpulayer_cli.client import follow_events, submit
    from gpulayer_cli.render import event_tag, print_event

    try:
        job = load_job_file(args.file)
    except (InvalidInput, OSError) as err:
        print(f"gpulayer: {args.file}: {err}", file=sys.stderr)
        return EXIT_INVALID
    result = validate_job(job)
    if result.errors:
        for e in result.errors:
            print(f"gpulayer: {args.file}: {e}", file=sys.stderr)
        return EXIT_INVALID
    console = _console()
    tel = _cli_telemetry()

    async def go(nc: Any) -> int:
        existing = await _known_job(nc, job.job_id)
        if existing is None:
            await submit(nc, job, os.environ.get("TRACEPARENT"), owner=_me(), telemetry=tel)
        elif not _same_request(existing.get("request"), job):
            print(
                f"gpulayer: job id {job.job_id!r} already names a different job "
                f"({existing.get('state')}, submitted {str(existing.get('submitted_at'))[:19]}); "
                "a job id is the dedupe key, so this one would be ignored: choose a new job_id",
                file=sys.stderr,
            )
            return EXIT_INVALID
        else:
            print(
                f"gpulayer: job {job.job_id} was already submitted ({existing.get('state')}); "
                "not submitting it again",
                file=sys.stderr,
            )
        if not args.wait:
            print(job.job_id)
            return 0
        last: dict[str, str] = {}
        owner = (existing or {}).get("owner") or _me()
        ids = _job_ids(job)
        async for event in follow_events(nc, ids, owner=owner, stop_when=_end_of(job)):
            if args.json:
                from gpulayer_contracts import encode

                print(encode(event).decode(), flush=True)
            else:
                print_event(console, event)
            last[event.job_id] = event_tag(event)
        # Every job of the submit (each of an array) must have succeeded.
        return 0 if all(last.get(i) == "succeeded" for i in ids) else EXIT_FAILED

    try:
        return _in_cli_span(tel, job.job_id, args.wait, lambda: asyncio.run(_with_nats(go)))
    except KeyboardInterrupt:
        if args.wait:
            print(
                f"\ngpulayer: stopped following {job.job_id}; the job itself goes on "
                f"(gpulayer job {job.job_id} / gpulayer cancel {job.job_id})",
                file=sys.stderr,
            )
        return 130
    finally:
        tel.shutdown()


def _job_ids(job: JobRequest) -> list[str]:
    """The ids a submit creates: the job's, or each job of its array."""
    if job.array is None:
        return [job.job_id]
    return [f"{job.job_id}-{i}" for i in range(job.array.count)]


def _end_of(job: JobRequest) -> Callable[[Any], bool]:
    """When ``submit --wait`` stops following a job: at its last end. A service's process
    ending is no end (it restarts) until it is cancelled; a job's ``lost`` (or ``failed``, with
    retry_on_failure) is none while it has retries left, counted from its requeued events."""
    from gpulayer_contracts import Requeued, is_terminal

    requeued: dict[str, int] = {}

    def stop(event: Any) -> bool:
        if isinstance(event, Requeued):
            requeued[event.job_id] = requeued.get(event.job_id, 0) + 1
            return False
        if not is_terminal(event):
            return False
        tag = type(event).__struct_config__.tag
        if job.kind == "service":
            return tag in ("cancelled", "rejected")
        if tag == "lost" or (tag == "failed" and job.retry_on_failure):
            return requeued.get(event.job_id, 0) >= job.retries
        return True

    return stop


def _cli_telemetry() -> Telemetry:
    """The CLI's tracing: on when OTLP export is configured (OTEL_EXPORTER_OTLP_ENDPOINT...)."""
    from gpulayer_runtime.telemetry import setup_telemetry

    return setup_telemetry("gpulayer-cli", os.environ, metrics_export=False, export_timeout_s=2.0)


def _in_cli_span(tel: Telemetry, job_id: str, wait: bool, run: Callable[[], int]) -> int:
    """Run ``run`` inside the span ``gpulayer submit``, the root of the job's trace (or a child
    of ``TRACEPARENT``'s, when set); its status follows the exit code."""
    from opentelemetry.trace import StatusCode

    from gpulayer_runtime.telemetry import extract

    caller = os.environ.get("TRACEPARENT")
    parent = extract({"traceparent": caller}) if caller else None
    attributes = {"gpulayer.job.id": job_id, "gpulayer.cli.wait": wait}
    with tel.span("gpulayer submit", parent=parent, attributes=attributes) as span:
        code = run()
        if span is not None:
            span.set_attribute("gpulayer.cli.exit_code", code)
            if code != 0:
                span.set_status(StatusCode.ERROR, f"exit code {code}")
        return code


async def _known_job(nc: Any, job_id: str) -> dict[str, Any] | None:
    """The stored record of ``job_id``, or None when placement doesn't know it (or can't be
    asked right now: the submit is then queued in JetStream like any other)."""
    from gpulayer_cli.client import ApiFailed, ApiUnavailable, api
    from gpulayer_contracts.subjects import API_JOB

    try:
        record = await api(nc, API_JOB, {"job_id": job_id}, timeout=2.0, caller=_me())
    except (ApiFailed, ApiUnavailable):
        return None
    return record if isinstance(record, dict) else None


def _same_request(stored: object, job: JobRequest) -> bool:
    from gpulayer_contracts.profiles import same_submission

    try:
        # Placement stores a job with its profile expanded: compared as submitted.
        return same_submission(msgspec.convert(stored, JobRequest), job)
    except msgspec.ValidationError:
        return False  # a rejected submission's body: not this job


def _api_command(
    subject: str,
    payload: Callable[[argparse.Namespace], dict[str, Any]],
    render: Callable[[Console, Any], None],
) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        from gpulayer_cli.client import api

        async def go(nc: Any) -> int:
            data = await api(nc, subject, payload(args), caller=_me())
            if args.json:
                print(json.dumps(data, indent=2, default=str))
            elif getattr(args, "devices", False):
                render(_console(), data, True)  # type: ignore[call-arg]
            else:
                render(_console(), data)
            return 0

        return asyncio.run(_with_nats(go))

    return run


def _render_nodes(console: Console, data: Any, devices: bool = False) -> None:
    from gpulayer_cli.render import nodes_table

    console.print(nodes_table(data))
    if devices:
        from gpulayer_cli.doctor import render_node_devices

        render_node_devices(console, data)


def cmd_doctor(args: argparse.Namespace) -> int:
    """The node's probe detects again; what changed, and the node's health."""
    import nats.errors

    from gpulayer_cli.doctor import ask_doctor, print_report

    async def go(nc: Any) -> int:
        try:
            report = await ask_doctor(nc, args.node, args.timeout)
        except (TimeoutError, nats.errors.TimeoutError, nats.errors.NoRespondersError) as err:
            print(
                f"gpulayer: no probe answered for node {args.node!r} "
                f"({type(err).__name__}): is its probe running?",
                file=sys.stderr,
            )
            return EXIT_UNREACHABLE
        return print_report(_console(), report, args.json)

    return asyncio.run(_with_nats(go))


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
    return _api_command(API_JOBS, lambda a: {"state": a.state, "limit": a.limit}, render)(args)


def _render_services(console: Console, data: Any) -> None:
    from gpulayer_cli.render import services_table

    console.print(services_table(data))


def cmd_job(args: argparse.Namespace) -> int:
    """A job's record and its whole event history."""
    from gpulayer_cli.client import api, history
    from gpulayer_cli.render import print_event
    from gpulayer_contracts import encode
    from gpulayer_contracts.subjects import API_JOB

    async def go(nc: Any) -> int:
        record = await api(nc, API_JOB, {"job_id": args.job_id}, caller=_me())
        events = await history(nc, args.job_id, owner=record.get("owner") or _me())
        if args.json:
            print(
                json.dumps(
                    {"job": record, "events": [json.loads(encode(e)) for e in events]},
                    indent=2,
                )
            )
            return 0
        console = _console()
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

    return asyncio.run(_with_nats(go))


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


def _render_quotas(console: Console, data: Any) -> None:
    from gpulayer_cli.render import quotas_table

    console.print(quotas_table(data))


def _quota_body(args: argparse.Namespace) -> dict[str, Any]:
    """The API request of ``gpulayer quota set|delete|list``."""
    if args.quota_op == "list":
        return {"op": "list"}
    owner = None if args.default else args.owner
    if owner is None and not args.default:
        raise SystemExit("gpulayer quota: name an OWNER or give --default")
    if args.quota_op == "delete":
        return {"op": "delete", "owner": owner}
    gpus: dict[str, int] = {}
    for item in args.gpus or []:
        acc, sep, n = item.partition("=")
        if not sep or not n.lstrip("-").isdigit():
            raise SystemExit(f"gpulayer quota: --gpus {item!r} is not ACCELERATOR=N")
        gpus[acc] = int(n)
    return {"op": "set", "owner": owner, "gpus": gpus, "cores": args.cores, "jobs": args.jobs}


def _quota_parser(sub: Any) -> None:
    from gpulayer_contracts.subjects import API_QUOTA

    qp = sub.add_parser("quota", help="per-owner quotas: list (anyone), set and delete (admins)")
    qs = qp.add_subparsers(dest="quota_op", required=True)
    for name, text in (
        ("set", "set an owner's (or the default) quota; -1 clears a limit"),
        ("delete", "remove an owner's (or the default) quota"),
        ("list", "every quota and what each owner holds now"),
    ):
        p = qs.add_parser(name, help=text)
        if name != "list":
            p.add_argument("owner", nargs="?")
            p.add_argument("--default", action="store_true", help="the default quota")
        if name == "set":
            p.add_argument("--gpus", action="append", metavar="ACC=N", help="e.g. cuda=8")
            p.add_argument("--cores", type=float, default=None)
            p.add_argument("--jobs", type=int, default=None)
        p.add_argument("--json", action="store_true")
        p.set_defaults(fn=_api_command(API_QUOTA, _quota_body, _render_quotas))


def _render_cancel(console: Console, data: Any) -> None:
    console.print(f"{data['job_id']}: {data['state']}")


def _render_matrix(console: Console, data: Any) -> None:
    from gpulayer_cli.render import matrix_table

    console.print(matrix_table(data))


def cmd_matrix(args: argparse.Namespace) -> int:
    """The matrix is part of this version's contracts: no running service needed."""
    from gpulayer_contracts.matrix import SUPPORT_MATRIX

    if args.json:
        print(json.dumps(SUPPORT_MATRIX, indent=2))
    else:
        _render_matrix(_console(), SUPPORT_MATRIX)
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    from gpulayer_cli.logs import run_logs

    nats = _nats()
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
    me = _me()

    async def ask(nc: Any) -> int:
        record = await _known_job(nc, job_id)
        found.append(str((record or {}).get("owner") or me))
        return 0

    found: list[str] = []
    await _with_nats(ask, quiet=True)
    return found[0] if found else me


def cmd_dlq(args: argparse.Namespace) -> int:
    """The newest dead letters, from the DLQ stream."""
    from gpulayer_cli.dlq import dead_letters, dlq_table

    async def go(nc: Any) -> int:
        entries = await dead_letters(nc.jetstream(), args.limit)
        if args.json:
            print(json.dumps(entries, indent=2))
        else:
            _console().print(dlq_table(entries))
        return 0

    return asyncio.run(_with_nats(go))


def cmd_check(args: argparse.Namespace) -> int:
    from gpulayer_cli.check import run_check

    return int(
        run_check(
            args.file,
            python=args.python,
            as_json=args.json,
            console=_console(),
            profiles=_profiles_file(args),
        )
    )


def _profiles_file(args: argparse.Namespace) -> str | None:
    """The profiles file a job file's ``profile`` is expanded from: --profiles, else the
    GPULAYER_PROFILES placement reads."""
    return str(args.profiles or os.environ.get("GPULAYER_PROFILES") or "") or None


def cmd_conform(args: argparse.Namespace) -> int:
    from gpulayer_cli.conform import run_conform

    return int(
        run_conform(
            args.file,
            golden=args.golden,
            update=args.update,
            python=args.python,
            profiles=_profiles_file(args),
            as_json=args.json,
            console=_console(),
            environ=os.environ,
        )
    )


def _render_profiles(console: Console, data: Any) -> None:
    from gpulayer_cli.render import profiles_table

    if not data:
        console.print("no runtime profiles (placement's GPULAYER_PROFILES is unset)")
        return
    console.print(profiles_table(data))
    for entry in data:
        if entry["reasons"]:
            console.print(f"[bold]{entry['profile']}[/]: {entry['satisfy']}/{entry['nodes']}")
            for reason in entry["reasons"]:
                console.print(f"  - {reason}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpulayer", description="GPU-aware job placement over NATS.")
    p.add_argument("--version", action="version", version=f"gpulayer {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    dev = sub.add_parser("dev", help="run the whole stack on this machine")
    dev_sub = dev.add_subparsers(dest="dev_command", required=True)
    up = dev_sub.add_parser(
        "up", help="start NATS, PostgreSQL and the services; submit the examples"
    )
    up.add_argument(
        "--once", action="store_true", help="exit after the examples end (0 when as expected)"
    )
    up.add_argument("--examples", default="examples", help="folder of example job files")
    up.add_argument("--data-dir", default=".gpulayer", help="where servers keep their data")
    up.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the examples")
    up.add_argument(
        "--no-auth",
        action="store_true",
        help="NATS without credentials: anyone who reaches it may do anything (GPULAYER_AUTH=off)",
    )
    up.set_defaults(fn=cmd_dev_up)

    from gpulayer_cli.auth_cmd import add_parser as add_auth_parser

    add_auth_parser(sub)

    keys = sub.add_parser("keys", help="placement's grant signing key")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    kg = keys_sub.add_parser(
        "generate", help="make a signing key pair (kept if one exists); print the settings"
    )
    kg.add_argument("dir", help="folder for the seed file")
    kg.add_argument("--name", default="placement", help="seed file name (<name>.seed)")
    kg.set_defaults(fn=cmd_keys_generate)

    sc = sub.add_parser("schema", help="print the JSON Schema of a message (default: job request)")
    sc.add_argument("name", nargs="?", default="job", choices=list(WIRE_SCHEMAS))
    sc.set_defaults(fn=cmd_schema)

    s = sub.add_parser("submit", help="submit a job file (TOML or JSON)")
    s.add_argument("file")
    s.add_argument(
        "--wait", action="store_true", help="print events until the job ends; exit code follows it"
    )
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_submit)

    from gpulayer_contracts.subjects import (
        API_CANCEL,
        API_EXPLAIN,
        API_NODES,
        API_PROFILES,
        API_SERVICES,
    )

    n = sub.add_parser("nodes", help="the fleet: platforms, accelerators, APIs, state")
    n.add_argument("--json", action="store_true")
    n.add_argument(
        "--devices", action="store_true", help="each node's health and its devices' observations"
    )
    n.set_defaults(fn=_api_command(API_NODES, lambda a: {}, _render_nodes))

    dr = sub.add_parser(
        "doctor",
        help="ask a node's probe to detect again now; print what changed and its health "
        "(0 healthy or undetected, 1 degraded or unhealthy, 3 no answer)",
    )
    dr.add_argument("node")
    dr.add_argument("--timeout", type=float, default=90.0, help="seconds to wait for the probe")
    dr.add_argument("--json", action="store_true")
    dr.set_defaults(fn=cmd_doctor)

    j = sub.add_parser("jobs", help="recent jobs")
    j.add_argument("--state", default=None)
    j.add_argument("--limit", type=int, default=50)
    j.add_argument("--json", action="store_true")
    j.add_argument("--expand", action="store_true", help="each job of an array on its own line")
    j.set_defaults(fn=cmd_jobs)

    sv = sub.add_parser("services", help="long-running services: state, node, restarts")
    sv.add_argument("--state", default=None)
    sv.add_argument("--limit", type=int, default=50)
    sv.add_argument("--json", action="store_true")
    sv.set_defaults(
        fn=_api_command(
            API_SERVICES, lambda a: {"state": a.state, "limit": a.limit}, _render_services
        )
    )

    jb = sub.add_parser("job", help="one job: its record and every event so far")
    jb.add_argument("job_id")
    jb.add_argument("--json", action="store_true")
    jb.set_defaults(fn=cmd_job)

    e = sub.add_parser("explain", help="why a job waits (or where it runs)")
    e.add_argument("job_id")
    e.add_argument("--json", action="store_true")
    e.set_defaults(fn=_api_command(API_EXPLAIN, lambda a: {"job_id": a.job_id}, _render_explain))

    _quota_parser(sub)

    c = sub.add_parser("cancel", help="cancel a waiting or running job")
    c.add_argument("job_id")
    c.add_argument("--json", action="store_true")
    c.set_defaults(fn=_api_command(API_CANCEL, lambda a: {"job_id": a.job_id}, _render_cancel))

    m = sub.add_parser("matrix", help="what gpulayer may schedule, per accelerator")
    m.add_argument("--json", action="store_true")
    m.set_defaults(fn=cmd_matrix)

    # Listed for --help; main() hands `gpulayer probe ...` to the probe's own parser.
    sub.add_parser(
        "probe", help="detect this machine's capabilities as JSON (gpulayer probe --help)"
    )

    lg = sub.add_parser("logs", help="print a job's output")
    lg.add_argument("job_id")
    lg.add_argument("-f", "--follow", action="store_true")
    lg.set_defaults(fn=cmd_logs)

    dl = sub.add_parser("dlq", help="messages placement could not handle (the dead letters)")
    dl.add_argument("--limit", type=int, default=50, help="the newest N entries")
    dl.add_argument("--json", action="store_true")
    dl.set_defaults(fn=cmd_dlq)

    ck = sub.add_parser(
        "check", help="would this machine get this job? (0 yes, 1 no, 2 invalid job file)"
    )
    ck.add_argument("file")
    ck.add_argument("--python", default=None, help="workload interpreter to probe")
    ck.add_argument("--json", action="store_true")
    ck.add_argument(
        "--profiles",
        default=None,
        help="profiles file for a job naming a profile (GPULAYER_PROFILES)",
    )
    ck.set_defaults(fn=cmd_check)

    cf = sub.add_parser(
        "conform",
        help="run a job here and compare its output with the golden for this node class "
        "(0 passed or skipped, 1 mismatch or failure, 2 invalid input)",
    )
    cf.add_argument("file")
    cf.add_argument(
        "--golden", default=None, help="folder of goldens (default: <job file stem>.golden)"
    )
    cf.add_argument("--update", action="store_true", help="write this node class's golden")
    cf.add_argument("--python", default=None, help="workload interpreter to probe")
    cf.add_argument(
        "--profiles",
        default=None,
        help="profiles file for a job naming a profile (GPULAYER_PROFILES)",
    )
    cf.add_argument("--json", action="store_true")
    cf.set_defaults(fn=cmd_conform)

    pr = sub.add_parser(
        "profiles", help="runtime profiles, and how many nodes satisfy each now (and why not)"
    )
    pr.add_argument("--json", action="store_true")
    pr.set_defaults(fn=_api_command(API_PROFILES, lambda a: {}, _render_profiles))
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["probe"]:
        # The probe has its own options (--python, --gpu-apis, ...): hand them over untouched.
        from gpulayer_detection.cli import main as probe_main

        return int(probe_main(argv[1:]))
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
