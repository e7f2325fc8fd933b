"""A job's output: split into lines, truncated, published with a bounded backlog.

A job may print faster than NATS takes it, or print one endless line. Neither may grow the
executor's memory: lines are cut at ``max_line_bytes``, the backlog waiting to be published is
capped in bytes, and what doesn't fit is dropped and counted in a marker line, without ever being
split into lines. The pipes are always read promptly and in large chunks, so a chatty job is
never blocked on its own output by us. Splitting and pipe reading live in ``lines`` (no NATS
there: a job's shim uses them too); they are re-exported here.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from typing import Protocol

from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import PubAck

from gpulayer_contracts.codec import encode
from gpulayer_contracts.events import LogLine
from gpulayer_contracts.subjects import MSG_ID_HEADER, job_logs, valid_owner
from gpulayer_executor.lines import LineSink as LineSink
from gpulayer_executor.lines import LineSplitter as LineSplitter
from gpulayer_executor.lines import PipeReader as PipeReader
from gpulayer_executor.lines import Stream as Stream

log = logging.getLogger(__name__)


class LineWatch(Protocol):
    def feed(self, line: str) -> None: ...


class LogSink:
    """Publishes a job's lines to its LOGS subject; never blocks the reader, never grows
    beyond ``max_backlog_bytes`` of waiting lines."""

    SYNC_EVERY = 256

    def __init__(
        self,
        nc: Client,
        js: JetStreamContext,
        job_id: str,
        *,
        owner: str = "anonymous",
        max_backlog_bytes: int = 1 << 20,
        max_in_flight: int = 256,
        max_bytes_per_s: int = 1 << 20,
    ) -> None:
        self._js = js
        # Plain publishes for the lines between acked sync points (they need no ack each).
        self._nc = nc
        self.job_id = job_id
        self.subject = job_logs(job_id, valid_owner(owner))
        self.max_backlog_bytes = max_backlog_bytes
        self.max_in_flight = max_in_flight
        # A token bucket in backlog bytes (line + 64), one second deep: what a job may have
        # published per second. LOGS keeps 10,000 lines per job, so publishing a flood whole
        # would only cost the machine (the server stores what the stream then discards).
        self.max_bytes_per_s = max_bytes_per_s
        self._tokens = float(max_bytes_per_s)
        self._refilled = time.monotonic()
        self._queue: collections.deque[tuple[Stream, str, int]] = collections.deque()
        # Lines read back from a shim's output file carry the file offset after them (``mark``,
        # else -1): published with ``Nats-Msg-Id: <msg_prefix><mark>`` so that a line sent again
        # after an executor restart is dropped by JetStream, and ``acked_mark`` says how far the
        # stream has confirmed them.
        self.msg_prefix = ""
        self.acked_mark = -1
        # Shown every stderr line the sink takes (the job runner's reader of torchrun's summary).
        self.watch: LineWatch | None = None
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

    def _refill(self) -> None:
        now = time.monotonic()
        rate = self.max_bytes_per_s
        self._tokens = min(float(rate), self._tokens + (now - self._refilled) * rate)
        self._refilled = now

    def _put(self, stream: Stream, line: str, *, marker: bool = False, mark: int = -1) -> bool:
        size = len(line) + 64
        if self._backlog + size > self.max_backlog_bytes:
            return False
        if not marker:  # a marker saying what was dropped is never itself dropped for rate
            if self._tokens < size:
                self._refill()
                if self._tokens < size:
                    return False
            self._tokens -= size
        self._queue.append((stream, line, mark))
        self._backlog += size
        if self.watch is not None and stream == "stderr" and not marker:
            self.watch.feed(line)
        return True

    def offer_marked(self, stream: Stream, line: str, mark: int) -> bool:
        """Queue a line read back from a shim's file (already bounded by the shim), when the
        backlog and rate have room for it now; False: not taken, offer it again later."""
        if not self._put(stream, line, mark=mark):
            return False
        self._wake.set()
        return True

    def room(self) -> int:
        """Bytes the sink would take now (backlog and rate): what a reader may split into lines
        for us; the rest it counts and drops."""
        if self._tokens < self.max_backlog_bytes:
            self._refill()
        return int(min(self.max_backlog_bytes - self._backlog, self._tokens))

    def drop(self, lines: int) -> None:
        """Count lines the reader dropped without making them (no room); said in a marker."""
        if lines:
            self._dropped += lines
            self.dropped_total += lines

    def offer(self, stream: Stream, line: str) -> None:
        """Queue a line for publishing, or count it as dropped when the backlog is full."""
        if self._dropped:
            marker = f"[gpulayer: {self._dropped} lines dropped, output too fast]"
            if not self._put("stderr", marker, marker=True):
                self._dropped += 1
                self.dropped_total += 1
                return
            self._dropped = 0
        if not self._put(stream, line):
            self._dropped += 1
            self.dropped_total += 1
        self._wake.set()

    async def _run(self) -> None:
        # Lines go out as plain NATS publishes, which the LOGS stream stores all the same, and
        # every SYNC_EVERY-th line (and the last one queued) with a JetStream ack: a stream
        # stores one connection's messages in order, so that ack vouches for the lines before
        # it. A flood costs microseconds per line instead of an ack round trip each, and a quiet
        # job's every line is still acked.
        in_flight: collections.deque[tuple[asyncio.Future[PubAck], int, int]] = collections.deque()
        unacked = 0
        sent = 0
        while True:
            while not self._queue:
                if self._closed:
                    if self._dropped:
                        self._put(
                            "stderr", f"[gpulayer: {self._dropped} lines dropped]", marker=True
                        )
                        self._dropped = 0
                        continue
                    await self._settle(in_flight, len(in_flight))
                    return
                self._wake.clear()
                await self._wake.wait()
            stream, line, mark = self._queue.popleft()
            self._backlog -= len(line) + 64
            payload = encode(LogLine(job_id=self.job_id, stream=stream, line=line))
            headers = {MSG_ID_HEADER: f"{self.msg_prefix}{mark}"} if mark >= 0 else None
            unacked += 1
            try:
                if unacked >= self.SYNC_EVERY or not self._queue:
                    fut = await self._js.publish_async(self.subject, payload, headers=headers)
                    in_flight.append((fut, unacked, mark))
                    unacked = 0
                else:
                    await self._nc.publish(self.subject, payload, headers=headers)
            except Exception as err:
                self.failed += unacked
                unacked = 0
                log.debug("log lines of %s not published: %s", self.job_id, err)
                continue
            if len(in_flight) >= self.max_in_flight:
                await self._settle(in_flight, len(in_flight) // 2)
            sent += 1
            if sent % 64 == 0:
                # A plain publish never waits: let the job's pipe readers have the loop.
                await asyncio.sleep(0)

    async def _settle(
        self, in_flight: collections.deque[tuple[asyncio.Future[PubAck], int, int]], n: int
    ) -> None:
        for _ in range(n):
            fut, lines, mark = in_flight.popleft()
            try:
                await asyncio.wait_for(fut, 5.0)
                self.published += lines
                self.acked_mark = max(self.acked_mark, mark)
            except Exception:
                self.failed += lines

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
