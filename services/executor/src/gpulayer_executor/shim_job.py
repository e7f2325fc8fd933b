"""One job under its shim, seen to its end by a small synchronous loop.

The same steps as ``runner.run_process`` (its spawn, limits and outcomes are reused), without an
event loop: a shim lives for one job, and an event loop's set-up and tear-down cost more than
the shim's whole work for a short job. One ``selectors`` loop waits on the job's two pipes, a
pidfd for its exit (a SIGCHLD wake-up where there is none) and the wake-up pipe of SIGTERM (a
stop from the executor); output is written to the run folder once per turn (``FileSink``).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import selectors
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from gpulayer_executor import procs, shim_container, users
from gpulayer_executor.cgroup_spare import Spare
from gpulayer_executor.env import RunAs
from gpulayer_executor.job_cgroup import JobCgroup, LimitError
from gpulayer_executor.limits import JobLimits
from gpulayer_executor.lines import CHUNK, LineSplitter, Stream, consume, offer, widen_pipe
from gpulayer_executor.runner import (
    MARKER,
    PIPE_DRAIN_S,
    SpawnError,
    StopRequest,
    _as_account,
    _exit_outcome,
    _limit_resources,
    _memory_outcome,
    _resolve,
    _start,
    _stopped_outcome,
)
from gpulayer_executor.shim import (
    OUTPUT_FILE,
    FileSink,
    Notifier,
    ShimInfo,
    ShimSpec,
    StatusLine,
    StatusWriter,
    hierarchy_of,
    read_stop,
    status_line,
)
from gpulayer_executor.state import Outcome, ProcessInfo

log = logging.getLogger(__name__)

# Reads of one pipe per turn, at most (the other pipe and a stop get their turn in between).
READS_PER_TURN = 8
# This shim's last job cgroup, kept for its next job (closed as the shim ends).
SPARE = Spare()


def run_job(
    spec: ShimSpec, notify: Notifier, signals: Signals, ended: Callable[[], None] | None = None
) -> None:
    """Run the job of ``spec`` to its end; its outcome in ``status``, then ``ended`` (the shim
    says it is free), then a poke."""
    run = Path(spec.run_dir)
    status = StatusWriter(run, _me(os.getpid()))
    try:
        # A SIGTERM may have come before this job (a late stop of the shim's previous job, or
        # this job's own stop, sent as soon as it was asked): look for a stop request once.
        signals.look = True
        sink = FileSink(
            run / OUTPUT_FILE,
            spec.job_id,
            notify,
            max_bytes_per_s=spec.max_bytes_per_s,
            max_file_bytes=spec.max_file_bytes,
        )
        try:
            outcome = _supervise(spec, run, sink, notify, signals, status)
        except SpawnError as err:
            outcome = Outcome(state="failed", reason=f"spawn: {err}")
        sink.close()
        status.add(StatusLine(exit=outcome))
    finally:
        status.close()
    if ended is not None:
        ended()
    notify(b"e")


@functools.cache
def _me(pid: int) -> bytes:
    """``status``' first line: the same for every job of this shim (keyed by pid: a fork is
    another)."""
    info = ShimInfo(pid=pid, start_ticks=procs.start_ticks(pid), boot_id=procs.boot_id())
    return status_line(StatusLine(shim=info))


class _Reader:
    """One of the job's pipes into the sink (``lines.consume``: split only what fits)."""

    def __init__(self, fd: int, stream: Stream, sink: FileSink, max_line_bytes: int) -> None:
        self.fd = fd
        self.stream: Stream = stream
        self.sink = sink
        self.splitter = LineSplitter(max_line_bytes)
        self.open = True
        os.set_blocking(fd, False)
        widen_pipe(fd)

    def read(self, reads: int) -> bool:
        """Read what is there (at most ``reads`` chunks); False once at EOF (then closed)."""
        for _ in range(reads):
            try:
                data = os.read(self.fd, CHUNK)
            except BlockingIOError:
                return True
            except OSError:
                data = b""
            if not data:
                self.close()
                return False
            consume(data, self.splitter, self.sink, self.stream)
        return True

    def close(self) -> None:
        if self.open:
            self.open = False
            os.close(self.fd)
            offer(self.sink, self.stream, self.splitter.close())


class Signals:
    """SIGTERM (a stop from the executor) as a flag, and every handled signal as a byte on a
    pipe the loop's selector watches (``signal.set_wakeup_fd``); set up once per shim, before
    its first job, so that no SIGTERM ever ends a shim by default."""

    def __init__(self) -> None:
        self.look = False  # look for a stop request (a SIGTERM came, or a job begins)
        self.signalled = False  # a SIGTERM came since the last look
        self.fd, self._write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        signal.signal(signal.SIGTERM, self._on_term)

    def _on_term(self, signum: int, frame: FrameType | None) -> None:
        self.look = self.signalled = True

    def read(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self.fd, 4096)


class _Watch:
    """The shim's loop: pipes, the job's exit and a stop, in one selector."""

    def __init__(
        self,
        run: Path,
        pid: int,
        readers: list[_Reader],
        sink: FileSink,
        signals: Signals,
    ) -> None:
        self.run = run
        self.pid = pid
        self.request: StopRequest | None = None
        self.sink = sink
        self.signals = signals
        self.returncode: int | None = None
        self._sel = selectors.DefaultSelector()
        self._readers = {r.fd: r for r in readers}
        for r in readers:
            self._sel.register(r.fd, selectors.EVENT_READ)
        self._sel.register(signals.fd, selectors.EVENT_READ)
        self._pidfd: int | None = None
        try:
            self._pidfd = os.pidfd_open(pid)
            self._sel.register(self._pidfd, selectors.EVENT_READ)
        except (AttributeError, OSError):
            signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake the selector
        self._poll_exit()

    @property
    def stopped(self) -> bool:
        """Whether the executor asked to stop the job (``stop.json``, then SIGTERM)."""
        if self.request is None and self.signals.look:
            signalled = self.signals.signalled
            self.signals.look = self.signals.signalled = False
            self.request = read_stop(self.run)
            if self.request is None and signalled:
                log.warning("SIGTERM without a stop request in %s: ignored", self.run)
        return self.request is not None

    def _poll_exit(self) -> None:
        if self.returncode is not None:
            return
        try:
            done, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:  # pragma: no cover - reaped elsewhere: nothing to say but this
            done, status = self.pid, 255 << 8
        if done == 0:
            return
        self.returncode = os.waitstatus_to_exitcode(status)
        if self.returncode is not None and self._pidfd is not None:
            # Readable for good from now on: out of the selector, or every turn would spin.
            self._sel.unregister(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None

    def turn(self, timeout: float | None) -> None:
        """Wait up to ``timeout`` for something to happen, and handle it."""
        for key, _ in self._sel.select(timeout):
            fd = key.fd
            reader = self._readers.get(fd)
            if reader is not None:
                if not reader.read(READS_PER_TURN):
                    self._sel.unregister(fd)
                    del self._readers[fd]
            elif fd == self.signals.fd:
                self.signals.read()
        self._poll_exit()
        self.sink.flush()

    def until(self, deadline: float | None, *, stop: bool = True) -> None:
        """Turn until the job's main process exits, a stop arrives (``stop``) or ``deadline``."""
        while self.returncode is None and not (stop and self.stopped):
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            self.turn(left)

    def pause(self, seconds: float) -> None:
        """Go on reading the pipes for ``seconds``."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            self.turn(left)
            if self.returncode is not None and not self._readers:
                time.sleep(left)  # nothing left to read; the caller waits for processes
                return

    def drain(self, limit_s: float) -> None:
        """The job is over: read its pipes to EOF, for at most ``limit_s`` (something the job
        left behind, out of our reach, may hold them), then close them."""
        deadline = time.monotonic() + limit_s
        while self._readers and (left := deadline - time.monotonic()) > 0:
            self.turn(left)
        for reader in list(self._readers.values()):
            reader.read(16)
            reader.close()
        self._readers.clear()

    def close(self) -> None:
        self._sel.close()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


class _Group:
    """Every process of the job, synchronously (``runner._JobProcesses`` in the executor)."""

    def __init__(self, pgid: int, cgroup: JobCgroup | None, marker: str | None) -> None:
        self.pgid = pgid
        self.cgroup = cgroup
        self.marker = marker

    def _escaped(self) -> list[int]:
        if self.cgroup is not None:
            pids = self.cgroup.members()
        elif self.marker is not None:
            pids = procs.find_by_env(MARKER, self.marker)
        else:
            return []
        return [p for p in pids if p != os.getpid() and procs.pgid_of(p) != self.pgid]

    def signal_all(self, sig: int) -> None:
        procs.signal_group(self.pgid, sig)
        if self.cgroup is not None:
            self.cgroup.signal_all(sig)
            return
        for pid in self._escaped():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    def alive(self) -> bool:
        if self.cgroup is not None:
            return bool(self.cgroup.members())
        if procs.group_alive(self.pgid):
            return True
        return any(procs.pid_alive(p) for p in self._escaped())

    def wait_gone(self, watch: _Watch, limit_s: float) -> bool:
        deadline = time.monotonic() + limit_s
        pause = 0.002  # killed processes are usually gone within a few ms: look again soon
        while self.alive():
            if time.monotonic() >= deadline:
                return False
            watch.pause(pause)
            pause = min(pause * 2, 0.05)
        return True

    def kill(self, watch: _Watch) -> None:
        """SIGKILL to everything of the job until nothing is left (bounded)."""
        if not self.alive():
            return
        for _ in range(3):
            self.signal_all(signal.SIGKILL)
            if self.wait_gone(watch, 1.0):
                return
        log.warning("job group %s: processes survive SIGKILL", self.pgid)


def _supervise(
    spec: ShimSpec,
    run: Path,
    sink: FileSink,
    notify: Notifier,
    signals: Signals,
    status: StatusWriter,
) -> Outcome:
    def process(s: ShimSpec) -> Outcome:
        return _supervise_process(s, run, sink, notify, signals, status)

    if spec.container is None:
        return process(spec)
    return shim_container.supervise(spec, spec.container, run, signals, process)


def _supervise_process(
    spec: ShimSpec,
    run: Path,
    sink: FileSink,
    notify: Notifier,
    signals: Signals,
    status: StatusWriter,
) -> Outcome:
    marker = spec.env.get(MARKER)
    limits = spec.limits or JobLimits()
    hierarchy = hierarchy_of(spec.hierarchy)
    cgroup = SPARE.take(hierarchy, marker, limits) if hierarchy is not None and marker else None
    pid, out_fd, err_fd = _spawn(spec, cgroup, limits)
    group = _Group(pid, cgroup, marker)
    readers = [
        _Reader(out_fd, "stdout", sink, spec.max_line_bytes),
        _Reader(err_fd, "stderr", sink, spec.max_line_bytes),
    ]
    watch = _Watch(run, pid, readers, sink, signals)
    try:
        refused = _limit_resources(cgroup, limits)
        info = ProcessInfo(
            pid=pid,
            pgid=pid,
            start_ticks=procs.start_ticks(pid),
            boot_id=procs.boot_id(),
        )
        status.add(StatusLine(started=info))
        notify(b"s")
        if refused is not None:
            group.kill(watch)
            watch.until(None, stop=False)
            return Outcome(state="failed", reason=refused)
        outcome = _until_end(spec, run, group, watch)
        return _memory_outcome(outcome, cgroup, limits)
    except BaseException:
        # Whatever went wrong here, the job must not outlive our knowledge of it.
        procs.signal_group(pid, signal.SIGKILL)
        if cgroup is not None:
            cgroup.signal_all(signal.SIGKILL)
        with contextlib.suppress(BaseException):
            watch.until(time.monotonic() + 5.0, stop=False)
        raise
    finally:
        watch.drain(PIPE_DRAIN_S)
        watch.close()
        if cgroup is not None:
            SPARE.park(cgroup)


def _spawn(spec: ShimSpec, cgroup: JobCgroup | None, limits: JobLimits) -> tuple[int, int, int]:
    """Start the job as ``runner._start`` does (same argv, account, session, cgroup, umask,
    stdin from /dev/null, fresh pipes), with ``posix_spawn``: no Python runs between the fork
    and the exec, where ``subprocess`` runs a lot of it in a process that pays for every page it
    touches. The shim's own cwd and umask become the job's (the shim has no other use for
    them). The account is changed by the shim itself around the spawn (``users.switched_to``) where
    it runs as root; elsewhere as ``runner`` does (setpriv, or Popen)."""
    # The account this shim takes on itself for the spawn; None: none, or not ours to take.
    switch = spec.run_as if spec.run_as is not None and users.may_switch() else None
    if switch is not None:
        argv = [_resolve(spec.argv[0], spec.env.get("PATH", os.defpath), switch), *spec.argv[1:]]
        kwargs: dict[str, object] = {}
    else:
        argv, kwargs = _as_account(spec.argv, spec.env, spec.run_as)
    if kwargs:
        proc, out_r, err_r = _start(
            spec.argv, spec.env, Path(spec.cwd), spec.run_as, cgroup, limits
        )
        proc.returncode = 0  # reaped by the shim's own waitpid, not by Popen
        return proc.pid, out_r, err_r
    try:
        if cgroup is not None:
            cgroup.limit_before_spawn(limits)
        return _posix_spawn(argv, spec, cgroup, switch)
    except (OSError, ValueError, LimitError) as err:
        if cgroup is not None:
            cgroup.remove()
        what = "limit" if isinstance(err, LimitError) else "start"
        raise SpawnError(f"could not {what} {spec.argv[0]!r}: {err}") from err


def _posix_spawn(
    argv: list[str], spec: ShimSpec, cgroup: JobCgroup | None, run_as: RunAs | None = None
) -> tuple[int, int, int]:
    program = argv[0]
    if os.sep not in program:
        found = shutil.which(program, path=spec.env.get("PATH", os.defpath))
        if found is None:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", program)
        program = found
    os.chdir(spec.cwd)
    os.umask(0o077)  # what the job creates is its own account's alone
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    actions = [
        (os.POSIX_SPAWN_DUP2, devnull, 0),
        (os.POSIX_SPAWN_DUP2, out_w, 1),
        (os.POSIX_SPAWN_DUP2, err_w, 2),
    ]
    try:
        # In the job's cgroup before its first instruction (see cgroups.JobCgroup.spawning);
        # the cgroup is joined as root, then the account taken on for the spawn alone.
        with (
            cgroup.spawning() if cgroup is not None else contextlib.nullcontext(False) as inside,
            users.switched_to(run_as) if run_as is not None else contextlib.nullcontext(),
        ):
            pid = os.posix_spawn(program, argv, spec.env, file_actions=actions, setsid=True)
        if cgroup is not None and not inside:
            cgroup.add(pid)
    except BaseException:
        os.close(out_r)
        os.close(err_r)
        raise
    finally:
        for fd in (out_w, err_w, devnull):
            os.close(fd)
    return pid, out_r, err_r


def _until_end(spec: ShimSpec, run: Path, group: _Group, watch: _Watch) -> Outcome:
    """The first of: the main process' exit, a stop (SIGTERM; why in ``stop.json``), the
    timeout (counted from the job's start, here: the shim lives as long as the job)."""
    deadline = None if spec.timeout_s is None else time.monotonic() + spec.timeout_s
    watch.until(deadline)
    if watch.returncode is not None:
        # Whatever the main process left behind goes with it (no stray child holds a GPU).
        group.kill(watch)
        return _exit_outcome(watch.returncode)
    if watch.request is not None:
        request = watch.request
        log.info("stopping pid %s: %s", group.pgid, request.reason)
        _terminate(group, watch, spec)
        assert watch.returncode is not None
        return _stopped_outcome(watch.returncode, request.state, request.reason)
    log.info("pid %s exceeded its timeout of %ss", group.pgid, spec.timeout_s)
    _terminate(group, watch, spec)
    assert watch.returncode is not None
    return _stopped_outcome(watch.returncode, "failed", "timeout")


def _terminate(group: _Group, watch: _Watch, spec: ShimSpec) -> None:
    """SIGTERM to all of the job, the grace period, SIGKILL to what is left; its output is read
    all the while. A container is stopped by podman (its stop signal, the grace, SIGKILL);
    whatever of podman is left then is killed."""
    grace_s = spec.kill_grace_s
    if spec.container is not None:
        stopper = shim_container.start_stop(spec.container, grace_s)
        watch.until(time.monotonic() + grace_s + shim_container.STOP_MARGIN_S, stop=False)
        group.kill(watch)
        watch.until(None, stop=False)
        shim_container.reap(stopper)
        return
    group.signal_all(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    watch.until(deadline, stop=False)
    # The leader may be gone while children that ignore SIGTERM live on: give them the rest of
    # the grace, then kill whatever is left.
    group.wait_gone(watch, max(deadline - time.monotonic(), 0.0))
    group.kill(watch)
    watch.until(None, stop=False)
