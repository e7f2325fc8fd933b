"""The executor's side of job shims (``shim``): starting one (``shim_pool``), following
a job's run folder (its output file into the job's log sink, its exit status), and finding the
shims a previous run of the executor left running, to re-attach to them.

Following is driven by the shim's pokes on a pipe while the executor that started the shim
lives (``s``: the job's process, ``e``: its outcome, both in ``status``; ``o``: the output); a
re-attached job (its pipe went with the previous executor) is looked at every ``POLL_S``
instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path

import msgspec

from gpulayer_executor import procs
from gpulayer_executor.cgroups import Hierarchy
from gpulayer_executor.container import ContainerRun
from gpulayer_executor.env import RunAs
from gpulayer_executor.limits import JobLimits
from gpulayer_executor.output import LogSink, Stream
from gpulayer_executor.runner import MARKER, OnStarted, SpawnError, StopRequest
from gpulayer_executor.shim import (
    OFFSET_FILE,
    OUTPUT_FILE,
    STOP_FILE,
    ShimSpec,
    has_status,
    hierarchy_spec,
    read_status,
    write_atomic,
)
from gpulayer_executor.shim_pool import ForkServer
from gpulayer_executor.state import Outcome

log = logging.getLogger(__name__)


# How often a re-attached job's files are looked at (no pipe from its shim any more).
POLL_S = 0.2
# Output read per look, at most.
READ_CHUNK = 1 << 18
# The shim's pokes: the job's process in ``status``, output written, its outcome in ``status``.
_S, _O, _E = b"soe"
_SE = frozenset((_S, _E))  # pokes after which ``status`` is read
# A wake that came while the follower was not asleep (a stop requested while it awaited the
# job's "running" report, which retries while NATS can't store it): the next sleep returns.
_W = ord("w")


class Detached(Exception):
    """The executor is stopping and leaves the job to its shim (re-attached at the next start)."""


def shim_alive(run: Path) -> bool:
    """Whether the shim that ``run`` belongs to still runs (same boot, same process)."""
    info = read_status(run).shim
    if info is None:
        return False
    current = procs.boot_id()
    if info.boot_id and current and info.boot_id != current:
        return False
    if info.start_ticks is not None and procs.start_ticks(info.pid) != info.start_ticks:
        return False
    return procs.pid_alive(info.pid)


def has_shim(run: Path) -> bool:
    """Whether a shim ever took the job of this run folder (it wrote its ``status``)."""
    return has_status(run)


class Follower:
    """One job's run folder, followed until its outcome: output lines into ``sink`` (with
    ``Nats-Msg-Id`` = ``<grant>:log:<offset>``, from the offset acked before), the process
    into ``on_started``, a stop into ``stop.json`` and a SIGTERM to the shim."""

    def __init__(
        self,
        run: Path,
        grant_id: str,
        sink: LogSink,
        notify_fd: int | None,
        hierarchy: Hierarchy | None = None,
    ) -> None:
        self.run = run
        self.grant_id = grant_id
        self.hierarchy = hierarchy
        self.sink = sink
        sink.msg_prefix = f"{grant_id}:log:"
        self._notify_fd = notify_fd
        # Without a pipe from the shim (re-attached), every look reads every file.
        self._eof = notify_fd is None
        # What to look at next: everything, the first time, for a job re-attached to; a job
        # just started has nothing to look at before its shim's first poke.
        self._pokes = set(b"soe") if self._eof else set()
        self._output_seen = self._eof
        self._waiter: asyncio.Future[None] | None = None
        self._offset = _read_offset(run)
        self._recorded = self._offset
        self._out_fd: int | None = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        else:
            self._pokes.add(_W)

    def _readable(self) -> None:
        assert self._notify_fd is not None
        try:
            data = os.read(self._notify_fd, 4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._close_notify()
        self._pokes.update(data)
        if _O in self._pokes:
            self._output_seen = True
        self._wake()

    def _close_notify(self) -> None:
        if self._notify_fd is not None:
            asyncio.get_running_loop().remove_reader(self._notify_fd)
            os.close(self._notify_fd)
            self._notify_fd = None
            self._pokes.update(b"soe")  # the shim is gone or ending: look at everything
        self._eof = self._output_seen = True

    async def _sleep(self, timeout: float | None) -> None:
        """Until a poke, a stop or ``timeout``; at once when a poke came meanwhile."""
        if self._pokes:
            return
        loop = asyncio.get_running_loop()
        self._waiter = loop.create_future()
        timer = loop.call_later(timeout, self._wake) if timeout is not None else None
        try:
            await self._waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def _pump(self) -> bool:
        """Offer the output written since the last look; True when all of it was taken."""
        if self._out_fd is None:
            try:
                self._out_fd = os.open(self.run / OUTPUT_FILE, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                return True
        while True:
            data = os.pread(self._out_fd, READ_CHUNK, self._offset)
            end = data.rfind(b"\n")
            if end < 0:
                return True
            pos = 0
            for raw in data[: end + 1].split(b"\n")[:-1]:
                mark = self._offset + pos + len(raw) + 1
                stream: Stream = "stdout" if raw[:1] == b"o" else "stderr"
                if not self.sink.offer_marked(stream, raw[1:].decode("utf-8", "replace"), mark):
                    self._offset += pos
                    return False
                pos += len(raw) + 1
            self._offset += pos

    def _record_offset(self) -> None:
        acked = self.sink.acked_mark
        if acked > self._recorded:
            with contextlib.suppress(OSError):
                write_atomic(self.run / OFFSET_FILE, str(acked).encode())
            self._recorded = acked

    async def follow(
        self,
        stop: asyncio.Future[StopRequest],
        on_started: OnStarted | None,
        shim_pid: int | None,
    ) -> Outcome:
        """Until the job's end: its outcome. Raises Detached when ``stop`` asks for ``lost``
        (the executor stopping): the job goes on under its shim."""
        loop = asyncio.get_running_loop()
        if self._notify_fd is not None:
            os.set_blocking(self._notify_fd, False)
            loop.add_reader(self._notify_fd, self._readable)
        stop.add_done_callback(lambda _: self._wake())
        stop_sent = False
        drained = True
        try:
            while True:
                pokes, self._pokes = self._pokes, set()
                if self._eof:  # no pokes: every look is a look at everything
                    pokes.update(b"soe")
                if stop.done() and not stop_sent:
                    request = stop.result()
                    if request.state == "lost":
                        await self._detach()
                    self._send_stop(request, shim_pid)
                    stop_sent = True
                # Read once a turn: a short job's start and end are often both in it.
                status = read_status(self.run) if pokes & _SE else None
                if on_started is not None and status is not None and status.started:
                    await on_started(status.started, status.exit is not None)
                    on_started = None
                if _O in pokes or not drained:
                    drained = self._pump()
                    self._record_offset()
                if _E in pokes:
                    assert status is not None
                    outcome = status.exit
                    if outcome is not None:
                        await self._drain()
                        return outcome
                    if self._eof and not shim_alive(self.run):
                        # Gone without saying how the job ended (killed, or never started);
                        # Its outcome may have come just before it went.
                        outcome = read_status(self.run).exit
                        if outcome is not None:
                            continue
                        await self._kill_orphans()
                        return Outcome(state="lost", reason="the job's shim died")
                await self._sleep(0.02 if not drained else (POLL_S if self._eof else None))
        finally:
            self._close_notify()
            if self._out_fd is not None:
                os.close(self._out_fd)
                self._out_fd = None

    async def _kill_orphans(self) -> None:
        """The shim died without saying how the job ended: what is left of the job must not run
        on unsupervised once it is reported lost (its GPUs go to other jobs)."""
        info = read_status(self.run).started
        if info is not None and procs.owns_group(info.pgid, info.start_ticks, info.boot_id):
            log.warning("grant %s: its shim died; killing group %s", self.grant_id, info.pgid)
            procs.signal_group(info.pgid, signal.SIGKILL)
        if self.hierarchy is not None:
            await self.hierarchy.clear_leftover(self.grant_id)

    def _send_stop(self, request: StopRequest, shim_pid: int | None) -> None:
        write_atomic(self.run / STOP_FILE, msgspec.json.encode(request))
        pid = shim_pid
        if pid is None:
            info = read_status(self.run).shim
            pid = info.pid if info is not None and shim_alive(self.run) else None
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    async def _drain(self) -> None:
        """Every line of the file into the sink (it was all written before ``exit.json``): none
        when the shim, still talking to us, never said it wrote any."""
        if not self._output_seen:
            return
        # The sink frees room as it publishes; no event says so, so look again shortly.
        while True:
            if self._pump():
                return
            await asyncio.sleep(0.02)

    async def _detach(self) -> None:
        self._pump()
        await self.sink.close()
        self._record_offset()
        raise Detached


def _read_offset(run: Path) -> int:
    try:
        return max(int((run / OFFSET_FILE).read_text().strip() or 0), 0)
    except (OSError, ValueError):
        return 0


class ShimLauncher:
    """``job_runner.Launch`` through a shim: the job outlives this executor."""

    def __init__(self, run_root: Path, server: ForkServer) -> None:
        self.run_root = run_root
        self.server = server

    def run_dir(self, key: str) -> Path:
        return self.run_root / key

    async def __call__(
        self,
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
        on_started: OnStarted,
        hierarchy: Hierarchy | None,
        limits: JobLimits | None,
        container: ContainerRun | None = None,
    ) -> Outcome:
        grant_id = env[MARKER]
        run = self.run_dir(cwd.name)  # the job folder's name: the grant's safe key
        run.mkdir(mode=0o700, exist_ok=True)
        spec = ShimSpec(
            grant_id=grant_id,
            job_id=sink.job_id,
            run_dir=str(run),
            argv=list(argv),
            env=dict(env),
            cwd=str(cwd),
            run_as=run_as,
            timeout_s=timeout_s,
            kill_grace_s=kill_grace_s,
            max_line_bytes=max_line_bytes,
            max_bytes_per_s=sink.max_bytes_per_s,
            hierarchy=hierarchy_spec(hierarchy) if hierarchy is not None else None,
            limits=limits,
            container=container,
        )
        try:
            lease = await self.server.fork(spec)
        except OSError as err:
            raise SpawnError(f"could not start the job's shim: {err}") from err
        try:
            follower = Follower(run, grant_id, sink, lease.notify, hierarchy)
            return await follower.follow(stop, on_started, lease.pid)
        finally:
            self.server.done(lease)  # idle again once its job is over, else let go
