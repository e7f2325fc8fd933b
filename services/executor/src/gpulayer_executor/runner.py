"""Launching one job's process and seeing it to its end.

argv only, never a shell; a new session (so the job leads its own process group and every
child it forks stays reachable with one ``killpg``); stdin from /dev/null; stdout and stderr
read line by line into the job's log sink. Timeout, cancel and executor stop all end the job
the same way: SIGTERM to the group, a grace period, SIGKILL to the group.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import msgspec

from gpulayer_executor import procs
from gpulayer_executor.env import RunAs
from gpulayer_executor.output import LogSink, pump
from gpulayer_executor.state import Outcome, ProcessInfo

log = logging.getLogger(__name__)

# After the job's main process ended, how long its pipes may stay open (held by a process that
# left the group with setsid) before we stop reading them.
PIPE_DRAIN_S = 2.0


class StopRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Why a job is being stopped from outside: a user's cancel, or the executor shutting down."""

    state: Literal["cancelled", "lost"]
    reason: str


class SpawnError(RuntimeError):
    """The process could not be started (missing program, permission, bad argument)."""


def _exit_outcome(returncode: int) -> Outcome:
    if returncode == 0:
        return Outcome(state="succeeded", exit_code=0)
    if returncode < 0:
        sig = -returncode
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return Outcome(state="failed", signal=sig, reason=f"killed by {name}")
    return Outcome(state="failed", exit_code=returncode, reason=f"exit code {returncode}")


def _stopped_outcome(
    returncode: int, state: Literal["failed", "cancelled", "lost"], reason: str
) -> Outcome:
    code = _exit_outcome(returncode)
    return Outcome(state=state, exit_code=code.exit_code, signal=code.signal, reason=reason)


async def run_process(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: Path,
    run_as: RunAs | None,
    timeout_s: float | None,
    kill_grace_s: float,
    stop: asyncio.Future[StopRequest],
    sink: LogSink,
    max_line_bytes: int,
    on_started: Callable[[ProcessInfo], Awaitable[None]],
) -> Outcome:
    """Run the job to its end and say how it ended. Raises SpawnError if it never started."""
    kwargs: dict[str, object] = {}
    if run_as is not None:
        kwargs = {"user": run_as.uid, "group": run_as.gid, "extra_groups": []}
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=cwd,
            env=dict(env),
            start_new_session=True,
            close_fds=True,
            **kwargs,  # type: ignore[arg-type]
        )
    except (OSError, ValueError, subprocess.SubprocessError) as err:
        raise SpawnError(f"could not start {argv[0]!r}: {err}") from err

    pgid = proc.pid  # start_new_session: the job leads its own session and group
    assert proc.stdout is not None
    assert proc.stderr is not None
    readers = [
        asyncio.create_task(
            pump(proc.stdout, "stdout", sink, max_line_bytes), name=f"stdout-{pgid}"
        ),
        asyncio.create_task(
            pump(proc.stderr, "stderr", sink, max_line_bytes), name=f"stderr-{pgid}"
        ),
    ]
    waiter = asyncio.create_task(proc.wait(), name=f"wait-{pgid}")
    try:
        info = ProcessInfo(
            pid=proc.pid,
            pgid=pgid,
            start_ticks=procs.start_ticks(proc.pid),
            boot_id=procs.boot_id(),
        )
        await on_started(info)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        either: set[asyncio.Future[Any]] = {waiter, stop}
        done, _ = await asyncio.wait(either, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
        if waiter in done:
            outcome = _exit_outcome(waiter.result())
            # The main process is done; whatever it left behind in its group goes with it, so
            # no stray child keeps holding the job's GPUs.
            procs.signal_group(pgid, signal.SIGKILL)
        elif stop in done:
            request = stop.result()
            log.info("stopping pid %s: %s", pgid, request.reason)
            await _terminate(pgid, waiter, kill_grace_s)
            outcome = _stopped_outcome(waiter.result(), request.state, request.reason)
        else:
            log.info("pid %s exceeded its timeout of %ss", pgid, timeout_s)
            await _terminate(pgid, waiter, kill_grace_s)
            outcome = _stopped_outcome(waiter.result(), "failed", "timeout")
    except BaseException:
        # Whatever went wrong here (including our own cancellation), the job must not outlive
        # our knowledge of it.
        procs.signal_group(pgid, signal.SIGKILL)
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(asyncio.shield(waiter), 5.0)
        raise
    finally:
        _, pending = await asyncio.wait(readers, timeout=PIPE_DRAIN_S)
        for task in pending:
            task.cancel()
        for task in readers:
            with contextlib.suppress(BaseException):
                await task
    return outcome


async def _terminate(pgid: int, waiter: asyncio.Task[int], grace_s: float) -> None:
    procs.signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(waiter), grace_s)
    # The leader may be gone while children that ignore SIGTERM live on: give the rest of the
    # grace to the group, then kill whatever is left.
    await procs.wait_group_gone(pgid, max(deadline - time.monotonic(), 0.0))
    procs.signal_group(pgid, signal.SIGKILL)
    await waiter
