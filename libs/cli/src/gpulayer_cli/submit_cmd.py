"""``gpulayer submit``: validate a job file, submit it once (a job id is the dedupe key), and
with ``--wait`` follow its events to its last end, inside the span that roots its trace."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from gpulayer_cli import common
from gpulayer_cli.common import EXIT_FAILED, EXIT_INVALID
from gpulayer_contracts import InvalidInput, JobRequest, load_job_file, validate_job

if TYPE_CHECKING:
    from gpulayer_runtime.telemetry import Telemetry


def cmd_submit(args: argparse.Namespace) -> int:
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
    tel = _cli_telemetry()
    go = _submit_and_follow(job, args.wait, args.json, tel)
    try:
        return _in_cli_span(tel, job.job_id, args.wait, lambda: asyncio.run(common.with_nats(go)))
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


def _submit_and_follow(
    job: JobRequest, wait: bool, as_json: bool, tel: Telemetry
) -> Callable[[Any], Any]:
    """What ``submit`` does once connected: submit unless placement already has the job, then
    (``wait``) print its events until it ends; the exit code."""
    from gpulayer_cli.client import follow_events, submit
    from gpulayer_cli.render import event_tag, print_event

    console = common.console()

    async def go(nc: Any) -> int:
        existing = await common.known_job(nc, job.job_id)
        if existing is None:
            await submit(nc, job, os.environ.get("TRACEPARENT"), owner=common.me(), telemetry=tel)
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
        if not wait:
            print(job.job_id)
            return 0
        last: dict[str, str] = {}
        owner = (existing or {}).get("owner") or common.me()
        ids = _job_ids(job)
        async for event in follow_events(nc, ids, owner=owner, stop_when=_end_of(job)):
            if as_json:
                from gpulayer_contracts import encode

                print(encode(event).decode(), flush=True)
            else:
                print_event(console, event)
            last[event.job_id] = event_tag(event)
        # Every job of the submit (each of an array) must have succeeded.
        return 0 if all(last.get(i) == "succeeded" for i in ids) else EXIT_FAILED

    return go


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


def _same_request(stored: object, job: JobRequest) -> bool:
    from gpulayer_contracts.profiles import same_submission

    try:
        # Placement stores a job with its profile expanded: compared as submitted.
        return same_submission(msgspec.convert(stored, JobRequest), job)
    except msgspec.ValidationError:
        return False  # a rejected submission's body: not this job


def add_submit(sub: Any) -> None:
    s = sub.add_parser("submit", help="submit a job file (TOML or JSON)")
    s.add_argument("file")
    s.add_argument(
        "--wait", action="store_true", help="print events until the job ends; exit code follows it"
    )
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_submit)
