"""A job's shim: the small process that owns one job and outlives the executor.

The executor starts each job through a shim (``GPULAYER_EXECUTOR_SHIM=on``, the default). The
shim is the job's parent: it spawns the job exactly as the executor did (``runner.run_process``:
own session, own cgroup, limits, timeout, SIGTERM-grace-SIGKILL), reads its pipes with the same
bounds, and writes what the executor needs into the job's run folder
``<workdir>/run/<grant>/`` (the executor's, 0700: the job can't forge its own exit status):

- ``shim.json``: the shim's pid, start time and boot id (to recognise it after a restart);
- ``started.json``: the job's ``ProcessInfo`` once its process exists;
- ``output``: the job's lines, one record each (``o``/``e`` for stdout/stderr, the text, a
  newline), cut, rate-limited and capped as the executor's own log sink does, written once per
  turn of the shim's loop (not once per line); made at the first line (none for a silent job);
- ``exit.json``: the job's ``Outcome``, written to a temporary file and renamed, so it is
  either whole or absent; written once, when the job is over and its processes are gone.

While the executor lives, the shim also pokes a pipe the executor reads (``s`` started,
``o`` output, ``e`` ended) so the executor needs no polling. A stop (cancel) is a
``stop.json`` the executor writes and a SIGTERM to the shim.

Shims are forked from a fork server (``shim_server``), which hands the executor each new
shim's control socket; an idle shim is handed its next job on that socket by the executor
itself (``shim_pool``). A shim runs the job with a small synchronous loop (``shim_job``). This
module holds what the shim and the executor share: the spec, the run folder's files and their
formats, the words on a shim's control socket.
"""

from __future__ import annotations

import os
import struct
import time
from pathlib import Path

import msgspec

from gpulayer_executor.cgroups import Hierarchy
from gpulayer_executor.container import ContainerRun
from gpulayer_executor.env import RunAs
from gpulayer_executor.limits import JobLimits
from gpulayer_executor.lines import Stream
from gpulayer_executor.runner import StopRequest

# A request's length prefix (to the fork server or to an idle shim), and the fork server's
# reply (the shim's pid, its control socket attached; 0 and no socket: refused).
FRAME = struct.Struct("!I")
# What a shim says on its control socket once its job is over and it may take the next one.
IDLE = b"i"
# Idle shims the executor keeps for the next jobs, at most; and for how long each.
MAX_IDLE = 64
IDLE_S = 30.0
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


def hierarchy_of(spec: HierarchySpec | None) -> Hierarchy | None:
    """The ``Hierarchy`` a spec describes (in the shim)."""
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
    # A container job: ``argv`` and ``env`` are the command's and the job's; podman runs them.
    container: ContainerRun | None = None


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
    line, drops counted in a marker line) and a cap on the file's size. Lines are buffered until
    ``flush`` (the shim's loop calls it once per turn, or when ``FLUSH_BYTES`` are waiting): one
    write and one poke per turn, whatever the number of lines."""

    FLUSH_BYTES = 1 << 16

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
        # Made at the first line only: most short jobs print nothing, and a file made per job
        # is a cost of its own (see folders.py). The executor reads a missing one as empty.
        self._path = path
        self._fd: int | None = None
        try:
            self._size = os.stat(path).st_size  # a job started again appends to its own
        except FileNotFoundError:
            self._size = 0
        self._notify = notify
        self.max_bytes_per_s = max_bytes_per_s
        self.max_file_bytes = max_file_bytes
        self._tokens = float(max_bytes_per_s)
        self._refilled = time.monotonic()
        self._buf = bytearray()
        self._dropped = 0

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
        if len(self._buf) >= self.FLUSH_BYTES:
            self.flush()
        return True

    def offer(self, stream: Stream, line: str) -> None:
        """Append the line, or count it as dropped. The count is said in a marker line just
        before the next line that fits, so a flood costs one marker, not one per line."""
        if not self._fits(len(line)):
            self._dropped += 1
            return
        if self._dropped:
            marker = f"[gpulayer: {self._dropped} lines dropped, output too fast]"
            if not self._append("stderr", marker, marker=True):
                self._dropped += 1
                return
            self._dropped = 0
        if not self._append(stream, line, marker=False):
            self._dropped += 1

    def _fits(self, length: int) -> bool:
        if self._tokens < length + 64:
            self._refill()
        return self._tokens >= length + 64

    def flush(self) -> None:
        """Write what is buffered and poke the executor (nothing when nothing is)."""
        if self._buf:
            if self._fd is None:
                flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC
                self._fd = os.open(self._path, flags, 0o600)
            os.write(self._fd, self._buf)
            self._size += len(self._buf)
            self._buf.clear()
            self._notify(b"o")

    def close(self) -> None:
        if self._dropped:
            self._append("stderr", f"[gpulayer: {self._dropped} lines dropped]", marker=True)
        self.flush()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


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


def read_stop(run: Path) -> StopRequest | None:
    """Why the shim is asked to stop: the executor's ``stop.json`` in the job's run folder. None
    without one: the SIGTERM was not the executor's stop of this job (a late stop of the job
    the shim ran before, or someone else's signal) and is ignored."""
    try:
        return msgspec.json.decode((run / STOP_FILE).read_bytes(), type=StopRequest)
    except FileNotFoundError:
        return None
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return StopRequest(state="cancelled", reason="stopped (unreadable stop request)")
