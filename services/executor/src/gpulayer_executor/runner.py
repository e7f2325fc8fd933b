"""Launching one job's process and seeing it to its end.

argv only, never a shell; a new session (so the job leads its own process group and every
child it forks stays reachable with one ``killpg``), and its own cgroup where the machine allows
(so a child that leaves the group with ``setsid`` is still found); stdin from /dev/null; stdout
and stderr read in large chunks into the job's log sink. The job ends when its main process
exits, never when its pipes close. Timeout, cancel and executor stop all end it the same way:
SIGTERM to all its processes, a grace period, SIGKILL to all of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import msgspec

from gpulayer_executor import procs
from gpulayer_executor.cgroups import Hierarchy
from gpulayer_executor.env import RunAs
from gpulayer_executor.job_cgroup import JobCgroup, LimitError
from gpulayer_executor.limits import JobLimits, oom_reason
from gpulayer_executor.lines import LineSink, PipeReader
from gpulayer_executor.state import Outcome, ProcessInfo

log = logging.getLogger(__name__)

# After the job's end and the kill of all its processes, how long its pipes may stay open (held
# by a process we could not find) before we read what they hold and close them.
PIPE_DRAIN_S = 0.5

# Set in every job's environment (gpulayer_contracts.jobenv); inherited by whatever the job starts.
MARKER = "GPULAYER_GRANT_ID"


class StopRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Why a job is being stopped from outside: a user's cancel, or the executor shutting down."""

    state: Literal["cancelled", "lost"]
    reason: str


# Told the job's process once it runs, and whether the job has already ended by then (a short
# job whose end was known at the first look: its "running" need not go to placement).
OnStarted = Callable[[ProcessInfo, bool], Awaitable[None]]


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


def _memory_outcome(outcome: Outcome, cgroup: JobCgroup | None, limits: JobLimits) -> Outcome:
    """A job that failed because the kernel's OOM killer ended it says so, with its limit,
    instead of a bare signal or exit code (a shell reports its killed child as 137)."""
    if cgroup is None or limits.memory_bytes is None or outcome.state != "failed":
        return outcome
    if outcome.reason == "timeout":  # ended by its timeout, whatever a child met before
        return outcome
    cause = cgroup.out_of_memory(sigkill=outcome.signal == signal.SIGKILL)
    if cause is None:
        return outcome
    return Outcome(
        state="failed",
        exit_code=outcome.exit_code,
        signal=outcome.signal,
        reason=oom_reason(limits, cause),
    )


def _stopped_outcome(
    returncode: int, state: Literal["failed", "cancelled", "lost"], reason: str
) -> Outcome:
    code = _exit_outcome(returncode)
    return Outcome(state=state, exit_code=code.exit_code, signal=code.signal, reason=reason)


class _Exit:
    """The job's main process' exit status, awaited without its pipes: a pidfd in the event
    loop's selector (Linux 5.3+), else a thread blocked in ``waitpid`` for this one pid."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self._proc = proc
        self._loop = asyncio.get_running_loop()
        self.future: asyncio.Future[int] = self._loop.create_future()
        self._pidfd: int | None = None
        try:
            self._pidfd = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):
            threading.Thread(
                target=self._wait_in_thread, name=f"wait-{proc.pid}", daemon=True
            ).start()
        else:
            self._loop.add_reader(self._pidfd, self._exited)

    def _exited(self) -> None:
        returncode = self._proc.poll()  # reaps it
        if returncode is None or self._pidfd is None:
            return
        self._loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        self._pidfd = None
        if not self.future.done():
            self.future.set_result(returncode)

    def _wait_in_thread(self) -> None:
        returncode = self._proc.wait()
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            self._loop.call_soon_threadsafe(self._set, returncode)

    def _set(self, returncode: int) -> None:
        if not self.future.done():
            self.future.set_result(returncode)


class _JobProcesses:
    """Every process of one job: its process group, and what left the group (``setsid``).

    The job's cgroup holds everything it forked, where one could be made
    (``cgroups.hierarchy``); elsewhere escaped processes are found by the marker in their
    environment (``GPULAYER_GRANT_ID``), which children inherit unless they clear it."""

    def __init__(self, pgid: int, cgroup: JobCgroup | None, marker: tuple[str, str] | None) -> None:
        self.pgid = pgid
        self.cgroup = cgroup
        self.marker = marker

    async def _escaped(self) -> list[int]:
        if self.cgroup is not None:
            pids = self.cgroup.members()
        elif self.marker is not None:
            pids = await asyncio.to_thread(procs.find_by_env, *self.marker)
        else:
            return []
        return [p for p in pids if p != os.getpid() and procs.pgid_of(p) != self.pgid]

    async def signal_all(self, sig: int) -> None:
        procs.signal_group(self.pgid, sig)
        if self.cgroup is not None:
            self.cgroup.signal_all(sig)
            return
        for pid in await self._escaped():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    async def alive(self) -> bool:
        if self.cgroup is not None:
            # Everything the job ever forked is in its cgroup, its group included: one small
            # read instead of a walk over every process of the machine.
            return bool(self.cgroup.members())
        if procs.group_alive(self.pgid):
            return True
        return any(procs.pid_alive(p) for p in await self._escaped())

    async def wait_gone(self, limit_s: float, interval: float = 0.05) -> bool:
        deadline = time.monotonic() + limit_s
        pause = 0.002  # killed processes are usually gone within a few ms: look again soon
        while await self.alive():
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(pause)
            pause = min(pause * 2, interval)
        return True

    async def kill(self) -> None:
        """SIGKILL to everything of the job, until nothing is left (bounded: a process in
        uninterruptible sleep dies when the kernel lets it). Most jobs leave nothing behind,
        and then this is one look."""
        if not await self.alive():
            return
        for _ in range(3):
            await self.signal_all(signal.SIGKILL)
            if await self.wait_gone(1.0):
                return
        log.warning("job group %s: processes survive SIGKILL", self.pgid)


@functools.cache
def _setpriv() -> str | None:
    return shutil.which("setpriv")


def _as_account(
    argv: Sequence[str], env: Mapping[str, str], run_as: RunAs | None
) -> tuple[list[str], dict[str, Any]]:
    """The argv and Popen arguments that start the job as ``run_as``.

    Popen's own ``user=``/``group=`` make CPython fork the whole executor (it can't change
    credentials in a vfork child), which costs more than the job's start itself; util-linux's
    ``setpriv`` changes them after a vfork instead, and then execs the job in the same
    process. A command that isn't there is still refused here, before anything runs, as Popen
    would; one the account may not execute ends with setpriv's exit 126/127 and its message."""
    if run_as is None:
        return list(argv), {}
    setpriv = _setpriv()
    if setpriv is None:  # not Linux with util-linux: the slower, equally correct way
        return list(argv), {"user": run_as.uid, "group": run_as.gid, "extra_groups": []}
    program = _resolve(argv[0], env.get("PATH", os.defpath), run_as)
    ids = [f"--reuid={run_as.uid}", f"--regid={run_as.gid}", "--clear-groups"]
    return [setpriv, *ids, "--", program, *argv[1:]], {}


def _resolve(program: str, path: str, run_as: RunAs) -> str:
    """``program`` as the job's account would find it on ``path``: the first candidate that
    account may execute, judged by mode bits (as Popen's own search skips a directory it may
    not enter, e.g. a shim under /root). setpriv is then given that path, so its own search,
    made with credentials half changed, never picks a different file. Raises
    FileNotFoundError when no candidate exists; when candidates exist but none passes (an ACL
    may still allow it), the name is left for setpriv to try."""
    if os.sep in program:
        if not os.path.exists(program):
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", program)
        return program
    candidates = [
        c
        for d in path.split(os.pathsep)
        if (c := os.path.join(d or ".", program)) and os.path.isfile(c)
    ]
    if not candidates:
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", program)
    return next((c for c in candidates if _may_execute(c, run_as)), program)


def _may_execute(file: str, run_as: RunAs) -> bool:
    """Whether ``run_as`` (its uid and primary gid: jobs get no other groups) may search every
    directory down to ``file`` and execute it, by the mode bits."""

    def allowed(st: os.stat_result, bits: tuple[int, int, int]) -> bool:
        if st.st_uid == run_as.uid:
            return bool(st.st_mode & bits[0])
        if st.st_gid == run_as.gid:
            return bool(st.st_mode & bits[1])
        return bool(st.st_mode & bits[2])

    x = (0o100, 0o010, 0o001)
    real = os.path.realpath(file)
    # The folders of the name as given and of what its symlinks lead to are both searched.
    folders = {*Path(os.path.abspath(file)).parents, *Path(real).parents}
    try:
        return all(allowed(os.stat(d), x) for d in folders) and allowed(os.stat(real), x)
    except OSError:
        return False


def _spawn(
    argv: Sequence[str],
    env: Mapping[str, str],
    cwd: Path,
    run_as: RunAs | None,
    cgroup: JobCgroup | None,
) -> tuple[subprocess.Popen[bytes], int, int]:
    """Start the job with its stdout and stderr on fresh pipes; the pipes' read ends back."""
    argv, kwargs = _as_account(argv, env, run_as)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        # In the job's cgroup before its first instruction: a child it forks at once can't be
        # born outside.
        with cgroup.spawning() if cgroup is not None else contextlib.nullcontext(False) as inside:
            proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=out_w,
                stderr=err_w,
                cwd=cwd,
                env=dict(env),
                start_new_session=True,
                close_fds=True,
                # What the job creates is its own account's alone, whatever the executor's umask.
                umask=0o077,
                **kwargs,
            )
        if cgroup is not None and not inside:
            cgroup.add(proc.pid)
    except BaseException:
        os.close(out_r)
        os.close(err_r)
        raise
    finally:
        # Only the job holds the write ends: EOF comes when the job (and whatever it passed
        # them to) is gone.
        os.close(out_w)
        os.close(err_w)
    return proc, out_r, err_r


async def run_process(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: Path,
    run_as: RunAs | None,
    timeout_s: float | None,
    kill_grace_s: float,
    stop: asyncio.Future[StopRequest],
    sink: LineSink,
    max_line_bytes: int,
    on_started: OnStarted,
    hierarchy: Hierarchy | None = None,
    limits: JobLimits | None = None,
) -> Outcome:
    """Run the job to its end and say how it ended. Raises SpawnError if it never started.
    ``hierarchy``: where the job's cgroup is made (``cgroups.hierarchy``; None: no cgroup);
    ``limits``: what that cgroup enforces, where its controllers can. The end is the main
    process' exit (or the timeout, or ``stop``), never EOF on its pipes: whatever the job left
    behind (in its group, its cgroup, or found by its marker) is killed then, and its output
    read for at most ``PIPE_DRAIN_S`` more."""
    marker_value = env.get(MARKER)
    limits = limits or JobLimits()
    cgroup = hierarchy.create(marker_value) if hierarchy is not None and marker_value else None
    proc, out_fd, err_fd = _start(argv, env, cwd, run_as, cgroup, limits)
    pgid = proc.pid  # start_new_session: the job leads its own session and group
    job = _JobProcesses(pgid, cgroup, (MARKER, marker_value) if marker_value else None)
    readers = [
        PipeReader(out_fd, "stdout", sink, max_line_bytes),
        PipeReader(err_fd, "stderr", sink, max_line_bytes),
    ]
    waiter = _Exit(proc).future
    try:
        refused = _limit_resources(cgroup, limits)
        info = ProcessInfo(
            pid=proc.pid,
            pgid=pgid,
            start_ticks=procs.start_ticks(proc.pid),
            boot_id=procs.boot_id(),
        )
        await on_started(info, False)
        if refused is not None:
            outcome = await _end_refused(job, waiter, refused)
        else:
            outcome = await _until_end(job, waiter, stop, timeout_s, kill_grace_s)
            outcome = _memory_outcome(outcome, cgroup, limits)
    except BaseException:
        # Whatever went wrong here (including our own cancellation), the job must not outlive
        # our knowledge of it.
        procs.signal_group(pgid, signal.SIGKILL)
        if cgroup is not None:
            cgroup.signal_all(signal.SIGKILL)
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(asyncio.shield(waiter), 5.0)
        raise
    finally:
        await _close_readers(readers)
        if cgroup is not None:
            cgroup.remove()
    return outcome


def _start(
    argv: Sequence[str],
    env: Mapping[str, str],
    cwd: Path,
    run_as: RunAs | None,
    cgroup: JobCgroup | None,
    limits: JobLimits,
) -> tuple[subprocess.Popen[bytes], int, int]:
    """``_spawn`` in the job's cgroup, its device policy and pids limit written first (the job
    never opens a device it was not granted, nor forks past its pids). Raises SpawnError, the
    cgroup removed."""
    try:
        if cgroup is not None:
            cgroup.limit_before_spawn(limits)
        return _spawn(argv, env, cwd, run_as, cgroup)
    except (OSError, ValueError, subprocess.SubprocessError, LimitError) as err:
        if cgroup is not None:
            cgroup.remove()
        what = "limit" if isinstance(err, LimitError) else "start"
        raise SpawnError(f"could not {what} {argv[0]!r}: {err}") from err


async def _end_refused(job: _JobProcesses, waiter: asyncio.Future[int], reason: str) -> Outcome:
    await job.kill()
    await waiter
    return Outcome(state="failed", reason=reason)


def _limit_resources(cgroup: JobCgroup | None, limits: JobLimits) -> str | None:
    """Memory and CPU limits (and its own pids limit) on the job just started; why they could
    not be set (the job is then ended, never left running unlimited on a node that enforces)."""
    if cgroup is None:
        return None
    try:
        cgroup.limit_resources(limits)
    except LimitError as err:
        log.warning("job cgroup %s: %s", cgroup.path, err)
        if err.over_memory:  # already past it in its first microseconds
            return oom_reason(limits, "limit")
        return f"could not set the job's limits: {err}"
    return None


async def _close_readers(readers: list[PipeReader]) -> None:
    # Everything of the job is dead by now, so the pipes normally reach EOF at once; a process
    # we could not find may still hold them, and must not hold up the job's end.
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(
            asyncio.gather(*(asyncio.shield(r.done) for r in readers)), PIPE_DRAIN_S
        )
    for reader in readers:
        reader.close()


async def _until_end(
    job: _JobProcesses,
    waiter: asyncio.Future[int],
    stop: asyncio.Future[StopRequest],
    timeout_s: float | None,
    kill_grace_s: float,
) -> Outcome:
    """Wait for the first of: the main process' exit, ``stop``, the timeout; end the job's
    processes accordingly and say how it ended."""
    either: set[asyncio.Future[Any]] = {waiter, stop}
    done, _ = await asyncio.wait(either, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    if waiter in done:
        # The main process is done; whatever it left behind goes with it, so no stray child
        # keeps holding the job's GPUs (or its pipes).
        await job.kill()
        return _exit_outcome(waiter.result())
    if stop in done:
        request = stop.result()
        log.info("stopping pid %s: %s", job.pgid, request.reason)
        await _terminate(job, waiter, kill_grace_s)
        return _stopped_outcome(waiter.result(), request.state, request.reason)
    log.info("pid %s exceeded its timeout of %ss", job.pgid, timeout_s)
    await _terminate(job, waiter, kill_grace_s)
    return _stopped_outcome(waiter.result(), "failed", "timeout")


async def _terminate(job: _JobProcesses, waiter: asyncio.Future[int], grace_s: float) -> None:
    await job.signal_all(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(waiter), grace_s)
    # The leader may be gone while children that ignore SIGTERM live on: give the rest of the
    # grace to them, then kill whatever is left.
    await job.wait_gone(max(deadline - time.monotonic(), 0.0))
    await job.kill()
    await waiter
