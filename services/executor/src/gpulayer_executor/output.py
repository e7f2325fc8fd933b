"""A job's output: split into lines, truncated, published with a bounded backlog.

A job may print faster than NATS takes it, or print one endless line. Neither may grow the
executor's memory: lines are cut at ``max_line_bytes``, the backlog waiting to be published is
capped in bytes, and what doesn't fit is dropped and counted in a marker line. The pipes are
always read promptly, so a chatty job is never blocked on its own output by us.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from typing import Literal

from nats.js import JetStreamContext
from nats.js.api import PubAck

from gpulayer_contracts.codec import encode
from gpulayer_contracts.events import LogLine
from gpulayer_contracts.subjects import job_logs

log = logging.getLogger(__name__)

Stream = Literal["stdout", "stderr"]


class LineSplitter:
    """Bytes in, complete text lines out (without the newline). Pure."""

    def __init__(self, max_line_bytes: int) -> None:
        self.max_line_bytes = max_line_bytes
        self._buf = bytearray()
        self._cut = 0  # bytes dropped from the current over-long line

    def _emit(self, raw: bytes) -> str:
        text = raw.decode("utf-8", errors="replace").rstrip("\r")
        if self._cut:
            text += f" [gpulayer: line truncated, {self._cut} bytes dropped]"
            self._cut = 0
        return text

    def feed(self, data: bytes) -> list[str]:
        lines: list[str] = []
        start = 0
        while True:
            nl = data.find(b"\n", start)
            chunk = data[start:] if nl < 0 else data[start:nl]
            room = self.max_line_bytes - len(self._buf)
            if len(chunk) > room:
                self._buf += chunk[: max(room, 0)]
                self._cut += len(chunk) - max(room, 0)
            else:
                self._buf += chunk
            if nl < 0:
                return lines
            lines.append(self._emit(bytes(self._buf)))
            self._buf.clear()
            start = nl + 1

    def close(self) -> list[str]:
        """The last line, if the output did not end with a newline."""
        if not self._buf and not self._cut:
            return []
        line = self._emit(bytes(self._buf))
        self._buf.clear()
        return [line]


class LogSink:
    """Publishes a job's lines to its LOGS subject; never blocks the reader, never grows
    beyond ``max_backlog_bytes`` of waiting lines."""

    def __init__(
        self,
        js: JetStreamContext,
        job_id: str,
        *,
        max_backlog_bytes: int = 1 << 20,
        max_in_flight: int = 256,
    ) -> None:
        self._js = js
        self.job_id = job_id
        self.subject = job_logs(job_id)
        self.max_backlog_bytes = max_backlog_bytes
        self.max_in_flight = max_in_flight
        self._queue: collections.deque[tuple[Stream, str]] = collections.deque()
        self._backlog = 0
        self._dropped = 0
        self.dropped_total = 0
        self.published = 0
        self.failed = 0
        self._wake = asyncio.Event()
        self._closed = False
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"logs-{self.job_id}")

    def _put(self, stream: Stream, line: str) -> bool:
        size = len(line) + 64
        if self._backlog + size > self.max_backlog_bytes:
            return False
        self._queue.append((stream, line))
        self._backlog += size
        return True

    def offer(self, stream: Stream, line: str) -> None:
        """Queue a line for publishing, or count it as dropped when the backlog is full."""
        if self._dropped:
            marker = f"[gpulayer: {self._dropped} lines dropped, output too fast]"
            if not self._put("stderr", marker):
                self._dropped += 1
                self.dropped_total += 1
                return
            self._dropped = 0
        if not self._put(stream, line):
            self._dropped += 1
            self.dropped_total += 1
        self._wake.set()

    async def _run(self) -> None:
        in_flight: collections.deque[asyncio.Future[PubAck]] = collections.deque()
        while True:
            while not self._queue:
                if self._closed:
                    if self._dropped:
                        self._put("stderr", f"[gpulayer: {self._dropped} lines dropped]")
                        self._dropped = 0
                        continue
                    await self._settle(in_flight, len(in_flight))
                    return
                self._wake.clear()
                await self._wake.wait()
            stream, line = self._queue.popleft()
            self._backlog -= len(line) + 64
            payload = encode(LogLine(job_id=self.job_id, stream=stream, line=line))
            try:
                fut = await self._js.publish_async(self.subject, payload, wait_stall=5.0)
            except Exception as err:
                self.failed += 1
                log.debug("log line of %s not published: %s", self.job_id, err)
                continue
            in_flight.append(fut)
            if len(in_flight) >= self.max_in_flight:
                await self._settle(in_flight, len(in_flight) // 2)

    async def _settle(self, in_flight: collections.deque[asyncio.Future[PubAck]], n: int) -> None:
        for _ in range(n):
            fut = in_flight.popleft()
            try:
                await asyncio.wait_for(fut, 5.0)
                self.published += 1
            except Exception:
                self.failed += 1

    async def close(self, limit_s: float = 10.0) -> None:
        """Publish what is queued (for at most ``limit_s``), then stop."""
        self._closed = True
        self._wake.set()
        if self._task is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(self._task), limit_s)
        except TimeoutError:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            log.warning("logs of %s: gave up publishing the rest after %ss", self.job_id, limit_s)


async def pump(
    reader: asyncio.StreamReader, stream: Stream, sink: LogSink, max_line_bytes: int
) -> None:
    """Read one pipe to its end, line by line, into ``sink``."""
    splitter = LineSplitter(max_line_bytes)
    while True:
        data = await reader.read(65536)
        if not data:
            break
        for line in splitter.feed(data):
            sink.offer(stream, line)
    for line in splitter.close():
        sink.offer(stream, line)
