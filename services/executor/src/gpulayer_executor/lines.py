"""A job's output as lines: split, cut at ``max_line_bytes``, and offered to a sink only as far
as it has room (the rest counted, never split). Shared by the executor (``PipeReader`` into
``output.LogSink``) and a job's shim (``shim_job``, synchronous, into ``shim.FileSink``);
nothing here imports NATS, so the shim's fork server stays small.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
from typing import Literal, Protocol

log = logging.getLogger(__name__)

Stream = Literal["stdout", "stderr"]

# Per read of a job's pipe.
CHUNK = 1 << 20


class LineSplitter:
    """Bytes in, complete text lines out (without the newline). Pure.

    Splitting happens in C (``bytes.split``); Python only touches the lines it returns. What the
    caller has no room for it passes to ``skip``, which counts lines without making them."""

    def __init__(self, max_line_bytes: int) -> None:
        self.max_line_bytes = max_line_bytes
        self._buf = bytearray()
        self._cut = 0  # bytes dropped from the current over-long line

    def _append(self, data: bytes) -> None:
        room = max(self.max_line_bytes - len(self._buf), 0)
        if len(data) > room:
            self._buf += data[:room]
            self._cut += len(data) - room
        else:
            self._buf += data

    def _emit(self, raw: bytes) -> str:
        text = raw.decode("utf-8", errors="replace").rstrip("\r")
        if self._cut:
            text += f" [gpulayer: line truncated, {self._cut} bytes dropped]"
            self._cut = 0
        return text

    def feed(self, data: bytes) -> list[str]:
        parts = data.split(b"\n")
        tail = parts.pop()
        if not parts:
            self._append(tail)
            return []
        # The first part ends the line already buffered (or a fresh one).
        self._append(parts[0])
        lines = [self._emit(bytes(self._buf))]
        self._buf.clear()
        rest = parts[1:]
        limit = self.max_line_bytes
        if rest and max(map(len, rest)) <= limit:
            lines += [raw.decode("utf-8", errors="replace").rstrip("\r") for raw in rest]
        else:
            for raw in rest:
                self._append(raw)
                lines.append(self._emit(bytes(self._buf)))
                self._buf.clear()
        self._append(tail)
        return lines

    def skip(self, data: bytes) -> int:
        """Like ``feed``, for output nobody has room for: the number of lines it completed."""
        n = data.count(b"\n")
        if n:
            self._buf.clear()
            self._cut = 0
            self._append(data[data.rindex(b"\n") + 1 :])
        else:
            self._append(data)
        return n

    def close(self) -> list[str]:
        """The last line, if the output did not end with a newline."""
        if not self._buf and not self._cut:
            return []
        line = self._emit(bytes(self._buf))
        self._buf.clear()
        return [line]


class LineSink(Protocol):
    """Where a ``PipeReader`` puts a job's lines: ``LogSink`` (NATS) in the executor, the
    shim's file sink (``shim.FileSink``) in a job's shim."""

    job_id: str

    def room(self) -> int: ...

    def drop(self, lines: int) -> None: ...

    def offer(self, stream: Stream, line: str) -> None: ...


def widen_pipe(fd: int) -> None:
    """Linux: a 1 MiB pipe (the unprivileged maximum by default) instead of 64 KiB, so the job
    writes on while its reader is busy elsewhere for a moment."""
    with contextlib.suppress(AttributeError, OSError):
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, CHUNK)


def consume(data: bytes, splitter: LineSplitter, sink: LineSink, stream: Stream) -> None:
    """One chunk of a pipe into ``sink``: split only as far as it has room, the rest counted."""
    room = sink.room()
    if room <= 0:
        sink.drop(splitter.skip(data))
        return
    if len(data) > room:
        # Split only what could still fit; count the rest.
        cut = data.rfind(b"\n", 0, room)
        if cut < 0:
            cut = data.find(b"\n")
        if cut >= 0:
            offer(sink, stream, splitter.feed(data[: cut + 1]))
            sink.drop(splitter.skip(data[cut + 1 :]))
            return
    offer(sink, stream, splitter.feed(data))


def offer(sink: LineSink, stream: Stream, lines: list[str]) -> None:
    for line in lines:
        sink.offer(stream, line)


class PipeReader:
    """Reads one of the job's pipes into ``sink`` from the event loop's selector: large
    non-blocking reads, lines split only as far as the sink has room, the rest counted and
    dropped unsplit. So a flood costs a ``read`` and a ``count`` per chunk, and the job is never
    held up by how fast its lines are published.

    The reader never decides when the job ends: ``done`` is set at EOF, and ``close`` stops it
    early (reading what is already buffered first) when something outside the job holds the
    pipe open."""

    # Per wake-up at most this many reads, so other tasks (the publisher, other jobs' readers)
    # get the loop between chunks.
    CHUNK = CHUNK
    READS_PER_WAKE = 8

    def __init__(self, fd: int, stream: Stream, sink: LineSink, max_line_bytes: int) -> None:
        self.fd = fd
        self.stream: Stream = stream
        self.sink = sink
        self.bytes_read = 0
        self._splitter = LineSplitter(max_line_bytes)
        self._loop = asyncio.get_running_loop()
        self.done: asyncio.Future[None] = self._loop.create_future()
        os.set_blocking(fd, False)
        widen_pipe(fd)
        self._loop.add_reader(fd, self._readable)

    def _readable(self) -> None:
        self._read(self.READS_PER_WAKE)

    def _read(self, reads: int) -> None:
        for _ in range(reads):
            try:
                data = os.read(self.fd, self.CHUNK)
            except BlockingIOError:
                return
            except OSError as err:
                log.debug("reading %s of %s: %s", self.stream, self.sink.job_id, err)
                data = b""
            if not data:
                self._finish()
                return
            self.bytes_read += len(data)
            self._consume(data)

    def _consume(self, data: bytes) -> None:
        consume(data, self._splitter, self.sink, self.stream)

    def _finish(self) -> None:
        if self.done.done():
            return
        self._loop.remove_reader(self.fd)
        os.close(self.fd)
        offer(self.sink, self.stream, self._splitter.close())
        self.done.set_result(None)

    def close(self, max_reads: int = 16) -> None:
        """Stop reading: first what the pipe already holds (bounded), then close it."""
        if self.done.done():
            return
        self._read(max_reads)
        self._finish()
