"""``gpulayer logs JOB_ID [-f]``: a job's output lines from the LOGS stream.

Without ``-f`` it prints what is stored now. With ``-f`` it keeps printing until the job's events
subject shows a terminal event, then prints the lines stored before that event and returns.

A distributed job's output is its ranks' (each rank job, ``<job_id>-rank<R>``, has its own
subject): found from the job's ``placed`` event, printed with a ``[rank R]`` prefix, rank by
rank without ``-f``, as they come with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Mapping
from typing import Any, TextIO

import msgspec
import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import DeliverPolicy

from gpulayer_cli.client import read_subject
from gpulayer_cli.denials import Denials, PermissionDenied, describe, watch
from gpulayer_contracts.codec import log_line_decoder
from gpulayer_contracts.events import TERMINAL_EVENT_TYPES
from gpulayer_contracts.subjects import ANONYMOUS, job_events, job_logs
from gpulayer_runtime.auth import AuthError, identity_of
from gpulayer_runtime.nats import connect

LOGS_STREAM = "LOGS"
EVENTS_STREAM = "JOB_EVENTS"
# After the terminal event, how long to wait for the last stored lines to arrive.
DRAIN_S = 10.0


class _Printer:
    """Writes each log line once, in stream order, and says when a given sequence is reached."""

    def __init__(self, out: TextIO, prefix: str = "") -> None:
        self.out = out
        self.prefix = prefix
        self.seq = 0
        self.target: int | None = None
        self.reached = asyncio.Event()

    def until(self, seq: int) -> None:
        self.target = seq
        if self.seq >= seq:
            self.reached.set()

    async def on_msg(self, msg: Msg) -> None:
        seq = msg.metadata.sequence.stream
        if seq <= self.seq:
            return
        self.seq = seq
        try:
            line = log_line_decoder.decode(msg.data).line
        except (msgspec.DecodeError, msgspec.ValidationError):
            line = None
        if line is not None:
            self.out.write(self.prefix + line + "\n")
            self.out.flush()
        if self.target is not None and seq >= self.target:
            self.reached.set()


async def _last_seq(nc: Client, stream: str, subject: str) -> int | None:
    """The stream sequence of ``subject``'s last stored message, None when there is none."""
    last: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def cb(msg: Msg) -> None:
        if not last.done():
            last.set_result(msg.metadata.sequence.stream)

    sub, stored = await read_subject(nc, stream, subject, cb, DeliverPolicy.LAST)
    try:
        return await asyncio.wait_for(last, 10) if stored else None
    finally:
        await sub.unsubscribe()


async def run_logs(
    nats_url: str,
    job_id: str,
    *,
    follow: bool,
    out: TextIO,
    err: TextIO | None = None,
    owner: str = ANONYMOUS,
    connect_args: Mapping[str, Any] | None = None,
) -> int:
    """Print ``owner``'s job's output lines; with ``follow`` until the job has ended. Exit
    status: 0, or 1 when the job is unknown, 2 for an invalid job id, 3 when NATS can't be
    reached, 4 when the credential may not read the job's logs (another owner's job).
    ``connect_args``: credentials and TLS files for ``gpulayer_runtime.nats.connect``."""
    err = err or sys.stderr
    try:
        logs_subject, events_subject = job_logs(job_id, owner), job_events(job_id, owner)
    except ValueError as e:
        err.write(f"gpulayer logs: {e}\n")
        return 2
    args = dict(connect_args or {})
    creds = args.get("creds")
    try:
        identity = identity_of(creds) if creds else None
    except AuthError as e:
        err.write(f"gpulayer logs: {e}\n")
        return 2
    denials = Denials(describe(identity) if identity or not creds else f"the credential {creds}")
    try:
        nc = await connect(
            nats_url,
            "gpulayer-logs",
            connect_timeout=5,
            max_reconnect_attempts=3,
            error_cb=denials.on_error,
            **args,
        )
    except (nats.errors.Error, OSError) as e:
        err.write(f"gpulayer logs: cannot reach NATS at {nats_url}: {e}\n")
        return 3  # as every other command that can't reach the stack
    watch(nc, denials)
    try:
        try:
            if follow:
                return await _follow(nc, logs_subject, events_subject, _Printer(out), owner)
            return await _print_stored(nc, job_id, owner, out, err)
        except PermissionDenied as e:
            err.write(f"gpulayer logs: {e}\n")
            return 4  # as every command whose credential lacks a permission
        except nats.js.errors.NotFoundError:
            err.write(
                "gpulayer logs: the LOGS and JOB_EVENTS streams do not exist (is gpulayer running?)\n"
            )
            return 1
    finally:
        with contextlib.suppress(Exception):
            await nc.close()


async def _print_stored(nc: Client, job_id: str, owner: str, out: TextIO, err: TextIO) -> int:
    """The lines stored now: a distributed job's rank by rank. 1 when the job has neither
    logs nor events."""
    logs_subject, events_subject = job_logs(job_id, owner), job_events(job_id, owner)
    if ranks := await _gang_ranks(nc, events_subject):
        for rank, rank_id in ranks:
            subject = job_logs(rank_id, owner)
            if (last := await _last_seq(nc, LOGS_STREAM, subject)) is not None:
                await _print_until(nc, subject, _Printer(out, f"[rank {rank}] "), last)
        return 0
    last = await _last_seq(nc, LOGS_STREAM, logs_subject)
    if last is None:
        if await _last_seq(nc, EVENTS_STREAM, events_subject) is None:
            err.write(f"gpulayer logs: no logs or events for job {job_id}\n")
            return 1
        return 0
    await _print_until(nc, logs_subject, _Printer(out), last)
    return 0


def _placed_ranks(data: bytes) -> list[tuple[int, str]] | None:
    """(rank, rank job id) of a distributed job's ``placed`` event; None for any other."""
    try:
        raw = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return None
    if not isinstance(raw, dict) or raw.get("type") != "placed":
        return None
    ranks = raw.get("ranks")
    if not isinstance(ranks, list) or not ranks:
        return None
    found = [
        (r["rank"], r["job_id"])
        for r in ranks
        if isinstance(r, dict)
        and isinstance(r.get("rank"), int)
        and isinstance(r.get("job_id"), str)
    ]
    return sorted(found) or None


async def _gang_ranks(nc: Client, events_subject: str) -> list[tuple[int, str]] | None:
    """The ranks of a distributed job from its stored events (the last ``placed`` naming them),
    None for a job that is no gang or not placed yet."""
    last = await _last_seq(nc, EVENTS_STREAM, events_subject)
    if last is None:
        return None
    found: list[tuple[int, str]] | None = None
    done = asyncio.Event()

    async def cb(msg: Msg) -> None:
        nonlocal found
        found = _placed_ranks(msg.data) or found
        if msg.metadata.sequence.stream >= last:
            done.set()

    sub, _ = await read_subject(nc, EVENTS_STREAM, events_subject, cb)
    try:
        await asyncio.wait_for(done.wait(), 10)
    finally:
        await sub.unsubscribe()
    return found


async def _print_until(nc: Client, subject: str, printer: _Printer, last: int) -> None:
    printer.until(last)
    sub, _ = await read_subject(nc, LOGS_STREAM, subject, printer.on_msg)
    try:
        await printer.reached.wait()
    finally:
        await sub.unsubscribe()


async def _follow(
    nc: Client, logs_subject: str, events_subject: str, printer: _Printer, owner: str
) -> int:
    ended = asyncio.Event()
    # The subjects followed: the job's own, and each rank's once its placed event names them.
    followed: dict[str, tuple[_Printer, Any]] = {}

    async def follow(subject: str, p: _Printer) -> None:
        if subject not in followed:
            followed[subject] = (p, None)
            sub, _ = await read_subject(nc, LOGS_STREAM, subject, p.on_msg)
            followed[subject] = (p, sub)

    async def on_event(msg: Msg) -> None:
        for rank, rank_id in _placed_ranks(msg.data) or []:
            with contextlib.suppress(ValueError):  # a rank id that names no subject
                await follow(job_logs(rank_id, owner), _Printer(printer.out, f"[rank {rank}] "))
        with contextlib.suppress(msgspec.DecodeError):
            raw = msgspec.json.decode(msg.data)
            if isinstance(raw, dict) and raw.get("type") in TERMINAL_EVENT_TYPES:
                ended.set()

    await follow(logs_subject, printer)
    events_sub, _ = await read_subject(nc, EVENTS_STREAM, events_subject, on_event)
    try:
        await ended.wait()
        # The executor publishes a job's lines before its terminal event: print up to the last
        # line stored now on each subject, then stop.
        for subject, (p, _) in list(followed.items()):
            last = await _last_seq(nc, LOGS_STREAM, subject)
            if last is not None:
                p.until(last)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(p.reached.wait(), DRAIN_S)
    finally:
        await events_sub.unsubscribe()
        for _, sub in followed.values():
            if sub is not None:
                await sub.unsubscribe()
    return 0
