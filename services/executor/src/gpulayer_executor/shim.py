"""A job's shim: the small process that owns one job and outlives the executor.

The executor starts each job through a shim (``GPULAYER_EXECUTOR_SHIM=on``, the default). The
shim is the job's parent: it spawns the job exactly as the executor did (``runner.run_process``:
own session, own cgroup, limits, timeout, SIGTERM-grace-SIGKILL), reads its pipes with the same
bounds, and writes what the executor needs into the job's run folder
``<workdir>/run/<grant>/`` (the executor's, 0700: the job can't forge its own exit status):

- ``status``: one JSON line per step, appended (a line's newline is written with it, so a line
  without its newline is one being written, not one to read): the shim's pid, start time and
  boot id (to recognise it after a restart) when it takes the job; the job's ``ProcessInfo``
  once its process exists; the job's ``Outcome`` once the job is over and its processes are
  gone. One file made per job, where the shim wrote three before (``shim.json``,
  ``started.json``, ``exit.json``: still read, for a shim started before an upgrade). Making a
  file is what a job's start costs most on ext4 without a journal (each one steps over the
  inodes freed in the last minutes);
- ``output``: the job's lines, one record each (``o``/``e`` for stdout/stderr, the text, a
  newline), cut, rate-limited and capped as the executor's own log sink does, written once per
  turn of the shim's loop (not once per line); made at the first line (none for a silent job).

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

import logging
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import msgspec

from gpulayer_executor.cgroups import Hierarchy
from gpulayer_executor.container import ContainerRun
from gpulayer_executor.env import RunAs
from gpulayer_executor.limits import JobLimits
from gpulayer_executor.lines import Stream
from gpulayer_executor.runner import StopRequest
from gpulayer_executor.state import Outcome, ProcessInfo

log = logging.getLogger(__name__)
T = TypeVar("T")

# A request's length prefix (to the fork server or to an idle shim), and the fork server's
# reply (the shim's pid, its control socket attached; 0 and no socket: refused).
FRAME = struct.Struct("!I")
# What a shim says on its control socket once its job is over and it may take the next one.
IDLE = b"i"
# Idle shims the executor keeps for the next jobs, at most; and for how long each.
MAX_IDLE = 64
IDLE_S = 30.0
STATUS_FILE = "status"
OUTPUT_FILE = "output"
# What a shim wrote before ``status`` (read for a shim an older executor started).
SHIM_FILE = "shim.json"
STARTED_FILE = "started.json"
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


# The executor's hierarchy, rebuilt once per shim (not per job: it keeps files open).
_hierarchies: list[tuple[HierarchySpec, Hierarchy]] = []


def hierarchy_of(spec: HierarchySpec | None) -> Hierarchy | None:
    """The ``Hierarchy`` a spec describes (in the shim), made once per shim."""
    if spec is None:
        return None
    for known, hierarchy in _hierarchies:
        if known == spec:
            return hierarchy
    made = Hierarchy(
        spec.version,
        Path(spec.parent),
        {k: Path(v) for k, v in spec.controllers.items()},
        homes={Path(k): Path(v) for k, v in spec.homes.items()},
        enforcement=spec.enforcement,
    )
    _hierarchies.append((spec, made))
    return made


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
    """Enough to tell, after an executor restart, that the job's shim still runs."""

    pid: int
    start_ticks: int | None = None
    boot_id: str | None = None


class StatusLine(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One line of ``status``: one of its fields set."""

    shim: ShimInfo | None = None
    started: ProcessInfo | None = None
    exit: Outcome | None = None


@dataclass
class RunStatus:
    """What a run folder's shim has written so far (the last line of each kind)."""

    shim: ShimInfo | None = None
    started: ProcessInfo | None = None
    exit: Outcome | None = None


_line_decoder = msgspec.json.Decoder(StatusLine)


def read_status(run: Path) -> RunStatus:
    """``status`` as written so far: its whole lines (the last one, without its newline yet, is
    being written); else the three files of a shim from before it (none: nothing yet). A line
    that can't be read is logged and passed over."""
    try:
        data = (run / STATUS_FILE).read_bytes()
    except FileNotFoundError:
        return _read_files(run)
    except OSError as err:
        log.warning("%s unreadable: %s", run / STATUS_FILE, err)
        return RunStatus()
    out = RunStatus()
    for line in data.split(b"\n")[:-1]:
        try:
            step = _line_decoder.decode(line)
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            log.warning("%s: a line unreadable: %s", run / STATUS_FILE, err)
            continue
        out.shim = step.shim or out.shim
        out.started = step.started or out.started
        out.exit = step.exit or out.exit
    return out


def _read_files(run: Path) -> RunStatus:
    return RunStatus(
        shim=_read_file(run / SHIM_FILE, ShimInfo),
        started=_read_file(run / STARTED_FILE, ProcessInfo),
        exit=_read_file(run / EXIT_FILE, Outcome),
    )


def _read_file(path: Path, kind: type[T]) -> T | None:
    try:
        return msgspec.json.decode(path.read_bytes(), type=kind)
    except FileNotFoundError:
        return None
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as err:
        log.warning("%s unreadable: %s", path, err)
        return None


def has_status(run: Path) -> bool:
    """Whether a shim ever took the job of this run folder."""
    return (run / STATUS_FILE).exists() or (run / SHIM_FILE).exists()


class StatusWriter:
    """The shim's end of ``status``: made when it takes a job, a line appended per step, each
    in one write (``O_APPEND``: whole lines, in order). Not synced: as the files before it, it
    is for an executor restart, not for a power loss (the executor's own records are)."""

    def __init__(self, run: Path, shim_line: bytes) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC
        self._fd = os.open(run / STATUS_FILE, flags, 0o600)
        try:
            self._write(shim_line)
        except BaseException:
            os.close(self._fd)
            raise

    def add(self, step: StatusLine) -> None:
        self._write(status_line(step))

    def _write(self, line: bytes) -> None:
        while line:  # a short write (the disk full) goes on where it stopped, or raises
            line = line[os.write(self._fd, line) :]

    def close(self) -> None:
        os.close(self._fd)


def status_line(step: StatusLine) -> bytes:
    return msgspec.json.encode(step) + b"\n"


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
