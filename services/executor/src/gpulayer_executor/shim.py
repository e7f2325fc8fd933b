"""A job's shim: the small process that owns one job and outlives the executor.

The executor starts each job through a shim (``GPULAYER_EXECUTOR_SHIM=on``, the default). The
shim is the job's parent: it spawns the job exactly as the executor did (``runner.run_process``:
own session, own cgroup, limits, timeout, SIGTERM-grace-SIGKILL), reads its pipes with the same
bounds, and writes what the executor needs into the job's run folder
``<workdir>/run/<grant>/`` (the executor's, 0700: the job can't forge its own exit status):

- ``shim.json``: the shim's pid, start time and boot id (to recognise it after a restart);
- ``started.json``: the job's ``ProcessInfo`` once its process exists;
- ``output``: the job's lines, one record each (``o``/``e`` for stdout/stderr, the text, a
  newline), cut, rate-limited and capped as the executor's own log sink does;
- ``exit.json``: the job's ``Outcome``, written to a temporary file and renamed, so it is
  either whole or absent; written once, when the job is over and its processes are gone.

While the executor lives, the shim also pokes a pipe the executor reads (``s`` started,
``o`` output, ``e`` ended) so the executor needs no polling. A stop (cancel) is a
``stop.json`` the executor writes and a SIGTERM to the shim.

Shims are forked from a **fork server** (``python -m gpulayer_executor.shim``), a process the
executor starts once and talks to over a socket pair: a fork of this small, already imported
process costs about a millisecond, where starting a new interpreter per job would cost tens.
The fork server exits when the executor closes the socket (or dies); the shims it forked are in
sessions of their own and go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import struct
import sys
import time
from pathlib import Path
from typing import NoReturn

import msgspec

from gpulayer_executor import procs
from gpulayer_executor.cgroups import Hierarchy
from gpulayer_executor.env import RunAs
from gpulayer_executor.limits import JobLimits
from gpulayer_executor.output import Stream
from gpulayer_executor.runner import SpawnError, StopRequest, run_process
from gpulayer_executor.state import Outcome, ProcessInfo

log = logging.getLogger(__name__)

SHIM_FILE = "shim.json"
STARTED_FILE = "started.json"
OUTPUT_FILE = "output"
EXIT_FILE = "exit.json"
STOP_FILE = "stop.json"
OFFSET_FILE = "offset"

# A job's output file holds at most this much; past it, lines are dropped and counted (LOGS
# keeps 10,000 lines per job in any case).
MAX_OUTPUT_FILE_BYTES = 256 << 20


class HierarchySpec(msgspec.Struct, frozen=True, kw_only=True):
    """The executor's ``cgroups.Hierarchy`` as plain data, rebuilt in each shim."""

    version: str
    parent: str
    controllers: dict[str, str] = {}
    homes: dict[str, str] = {}
    enforcement: str = "none"


def hierarchy_spec(h: Hierarchy) -> HierarchySpec:
    return HierarchySpec(
        version=h.version,
        parent=str(h.parent),
        controllers={k: str(v) for k, v in h.controllers.items()},
        homes={str(k): str(v) for k, v in h.homes.items()},
        enforcement=h.enforcement,
    )


def _hierarchy(spec: HierarchySpec | None) -> Hierarchy | None:
    if spec is None:
        return None
    return Hierarchy(
        spec.version,
        Path(spec.parent),
        {k: Path(v) for k, v in spec.controllers.items()},
        homes={Path(k): Path(v) for k, v in spec.homes.items()},
        enforcement=spec.enforcement,
    )


class ShimSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a shim needs to run one job (sent by the executor to the fork server)."""

    grant_id: str
    job_id: str
    run_dir: str
    argv: list[str]
    env: dict[str, str]
    cwd: str
    run_as: RunAs | None = None
    timeout_s: float | None = None
    kill_grace_s: float = 5.0
    max_line_bytes: int = 16 * 1024
    max_bytes_per_s: int = 1 << 20
    max_file_bytes: int = MAX_OUTPUT_FILE_BYTES
    hierarchy: HierarchySpec | None = None
    limits: JobLimits | None = None


class ShimInfo(msgspec.Struct, frozen=True, kw_only=True):
    """``shim.json``: enough to tell, after an executor restart, that this shim still runs."""

    pid: int
    start_ticks: int | None = None
    boot_id: str | None = None


def write_atomic(path: Path, data: bytes) -> None:
    """``path`` holds ``data`` whole or not at all: written beside it, then renamed."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def record(stream: Stream, line: str) -> bytes:
    """One line of the output file. Pure."""
    return (b"o" if stream == "stdout" else b"e") + line.encode("utf-8", "replace") + b"\n"


class FileSink:
    """The shim's end of a job's output: lines appended to the output file, with the bounds of
    ``output.LogSink`` (a one-second token bucket of ``max_bytes_per_s``, 64 bytes counted per
    line, drops counted in a marker line) and a cap on the file's size."""

    def __init__(
        self,
        path: Path,
        job_id: str,
        notify: Notifier,
        *,
        max_bytes_per_s: int,
        max_file_bytes: int,
    ) -> None:
        self.job_id = job_id
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        self._size = os.fstat(self._fd).st_size
        self._notify = notify
        self.max_bytes_per_s = max_bytes_per_s
        self.max_file_bytes = max_file_bytes
        self._tokens = float(max_bytes_per_s)
        self._refilled = time.monotonic()
        self._buf = bytearray()
        self._dropped = 0
        self._flush_soon = False

    def _refill(self) -> None:
        now = time.monotonic()
        rate = self.max_bytes_per_s
        self._tokens = min(float(rate), self._tokens + (now - self._refilled) * rate)
        self._refilled = now

    def room(self) -> int:
        self._refill()
        return int(min(self._tokens, self.max_file_bytes - self._size - len(self._buf)))

    def drop(self, lines: int) -> None:
        self._dropped += lines

    def _append(self, stream: Stream, line: str, *, marker: bool) -> bool:
        data = record(stream, line)
        size = len(line) + 64
        if self._size + len(self._buf) + len(data) > self.max_file_bytes:
            return False
        if not marker:
            if self._tokens < size:
                self._refill()
                if self._tokens < size:
                    return False
            self._tokens -= size
        self._buf += data
        if not self._flush_soon:
            self._flush_soon = True
            asyncio.get_running_loop().call_soon(self.flush)
        return True

    def offer(self, stream: Stream, line: str) -> None:
        if self._dropped:
            marker = f"[gpulayer: {self._dropped} lines dropped, output too fast]"
            if not self._append("stderr", marker, marker=True):
                self._dropped += 1
                return
            self._dropped = 0
        if not self._append(stream, line, marker=False):
            self._dropped += 1

    def flush(self) -> None:
        self._flush_soon = False
        if self._buf:
            os.write(self._fd, self._buf)
            self._size += len(self._buf)
            self._buf.clear()
            self._notify(b"o")

    def close(self) -> None:
        if self._dropped:
            self._append("stderr", f"[gpulayer: {self._dropped} lines dropped]", marker=True)
        self.flush()
        os.close(self._fd)


class Notifier:
    """The pipe to the executor that started the shim: a byte per event, never blocking; once
    the executor is gone (EPIPE) the shim goes on without it."""

    def __init__(self, fd: int | None) -> None:
        self.fd = fd
        if fd is not None:
            os.set_blocking(fd, False)

    def __call__(self, what: bytes) -> None:
        if self.fd is None:
            return
        try:
            os.write(self.fd, what)
        except BlockingIOError:
            pass  # the executor has unread pokes already: it will look at the files anyway
        except OSError:
            os.close(self.fd)
            self.fd = None


def read_stop(run: Path) -> StopRequest:
    """Why the shim is asked to stop: the executor's ``stop.json``; without one (someone else
    sent SIGTERM), the job is stopped as ``lost``."""
    try:
        return msgspec.json.decode((run / STOP_FILE).read_bytes(), type=StopRequest)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return StopRequest(state="lost", reason="the job's shim was stopped")


async def _shim(spec: ShimSpec, notify: Notifier) -> None:
    run = Path(spec.run_dir)
    me = ShimInfo(
        pid=os.getpid(), start_ticks=procs.start_ticks(os.getpid()), boot_id=procs.boot_id()
    )
    write_atomic(run / SHIM_FILE, msgspec.json.encode(me))
    loop = asyncio.get_running_loop()
    stop: asyncio.Future[StopRequest] = loop.create_future()

    def on_term() -> None:
        if not stop.done():
            stop.set_result(read_stop(run))

    loop.add_signal_handler(signal.SIGTERM, on_term)
    sink = FileSink(
        run / OUTPUT_FILE,
        spec.job_id,
        notify,
        max_bytes_per_s=spec.max_bytes_per_s,
        max_file_bytes=spec.max_file_bytes,
    )

    async def on_started(info: ProcessInfo) -> None:
        write_atomic(run / STARTED_FILE, msgspec.json.encode(info))
        notify(b"s")

    try:
        outcome = await run_process(
            spec.argv,
            env=spec.env,
            cwd=Path(spec.cwd),
            run_as=spec.run_as,
            timeout_s=spec.timeout_s,
            kill_grace_s=spec.kill_grace_s,
            stop=stop,
            sink=sink,
            max_line_bytes=spec.max_line_bytes,
            on_started=on_started,
            hierarchy=_hierarchy(spec.hierarchy),
            limits=spec.limits,
        )
    except SpawnError as err:
        outcome = Outcome(state="failed", reason=f"spawn: {err}")
    sink.close()
    write_atomic(run / EXIT_FILE, msgspec.json.encode(outcome))
    notify(b"e")


def run_shim(spec: ShimSpec, notify_fd: int) -> NoReturn:
    """The forked shim: a session of its own, its log in the run folder; never returns."""
    code = 0
    try:
        os.setsid()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the fork server ignores it; we wait
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        logging.basicConfig(
            filename=str(Path(spec.run_dir) / "shim.log"),
            level=logging.INFO,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
            force=True,
        )
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):  # the executor's terminal or log pipe may go away before we do
            os.dup2(devnull, fd)
        asyncio.run(_shim(spec, Notifier(notify_fd)))
    except BaseException:
        code = 1
        with contextlib.suppress(BaseException):
            log.exception("shim of grant %s failed", spec.grant_id)
    finally:
        os._exit(code)


_LEN = struct.Struct("!I")
_spec_decoder = msgspec.json.Decoder(ShimSpec)


def _recv_request(sock: socket.socket) -> tuple[bytes, list[int]] | None:
    data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 1)
    if not data:
        return None
    (size,) = _LEN.unpack_from(data)
    body = bytearray(data[_LEN.size :])
    while len(body) < size:
        more = sock.recv(size - len(body))
        if not more:
            return None
        body += more
    return bytes(body), list(fds)


def serve(sock: socket.socket) -> None:
    """The fork server's loop: a request is a length-prefixed ``ShimSpec`` with the notify
    pipe's write end attached; the reply is the forked shim's pid (0: the spec was bad)."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # shims are reaped by the kernel
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the executor stops us by closing the socket
    while True:
        request = _recv_request(sock)
        if request is None:
            return
        body, fds = request
        try:
            spec = _spec_decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            print(f"gpulayer shim fork server: bad request: {err}", file=sys.stderr)
            for fd in fds:
                os.close(fd)
            sock.sendall(_LEN.pack(0))
            continue
        pid = os.fork()
        if pid == 0:
            sock.close()
            run_shim(spec, fds[0])
        for fd in fds:
            os.close(fd)
        sock.sendall(_LEN.pack(pid))


def main() -> None:
    """``python -m gpulayer_executor.shim``: serve on the socket given as stdin."""
    sock = socket.socket(fileno=os.dup(0))
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    serve(sock)


if __name__ == "__main__":
    main()
