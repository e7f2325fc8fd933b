"""The executor's shims: forked through the fork server, kept when idle, handed jobs directly.

The fork server (``shim_server``) forks a shim per request and replies with its pid and its
control socket; from then on the executor talks to the shim itself. Once a shim's job is over
it says ``IDLE`` on that socket before it pokes the job's notify pipe, so by the time the
executor has read the job's end the word is there to read: the shim goes back to the pool
(``ForkServer.done``), and the next job is written to it with no process in between (a hop
through the fork server cost two more process wake-ups a job). Idle shims are let go (their
socket closed: they exit) after ``IDLE_S``, beyond ``MAX_IDLE``, and when the executor closes
the pool; a shim that said nothing (its job goes on, it ran its last, or it died) is let go
when its lease is given back.

Requests to the fork server are written from the event loop and its replies read by it, in
order: no thread per job.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import socket
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass

import msgspec

from gpulayer_executor.shim import FRAME, IDLE, IDLE_S, MAX_IDLE, ShimSpec

log = logging.getLogger("gpulayer_executor.shim_client")


@dataclass(eq=False)
class Lease:
    """A shim running one job: its pid, the read end of the job's notify pipe (the caller's to
    close), and the shim's control socket until the lease is given back (``ForkServer.done``)."""

    pid: int
    notify: int
    ctl: socket.socket | None


async def _send(sock: socket.socket, data: bytes, fd: int) -> None:
    """``data`` with ``fd`` attached, on a non-blocking socket, waiting while it is full."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            sent = socket.send_fds(sock, [data], [fd])
            break
        except BlockingIOError:
            writable: asyncio.Future[None] = loop.create_future()
            loop.add_writer(sock.fileno(), writable.set_result, None)
            try:
                await writable
            finally:
                loop.remove_writer(sock.fileno())
    if sent < len(data):
        await loop.sock_sendall(sock, data[sent:])


class ForkServer:
    """The process shims are forked from (``python -m gpulayer_executor.shim_server``), started
    once, and the idle shims it forked. Requests to the server are written one at a time (a
    request may need more than one write) and answered in order."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._replies: deque[asyncio.Future[tuple[int, socket.socket]]] = deque()
        self._reply_buf = bytearray()
        self._fds: deque[int] = deque()  # shims' sockets received, not yet matched to a reply
        self._send_lock = asyncio.Lock()
        # Idle shims, least recently busy first: socket -> (pid, idle since).
        self._idle: collections.OrderedDict[socket.socket, tuple[int, float]] = (
            collections.OrderedDict()
        )
        self._busy: set[socket.socket] = set()  # leased shims' sockets
        self._expiry: asyncio.TimerHandle | None = None
        self._closed = False

    def start(self) -> None:
        """Start the server (from the event loop's thread: its replies are read there)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with theirs:
            # Its own session: a Ctrl-C or a signal to the executor's group is not for it.
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "gpulayer_executor.shim_server"],
                stdin=theirs.fileno(),
                start_new_session=True,
                close_fds=True,
            )
        ours.setblocking(False)
        self._sock = ours
        self._closed = False
        asyncio.get_running_loop().add_reader(ours.fileno(), self._readable)

    def _readable(self) -> None:
        assert self._sock is not None
        try:
            data, fds, flags, _ = socket.recv_fds(self._sock, 1 << 16, 8, socket.MSG_CMSG_CLOEXEC)
        except BlockingIOError:
            return
        except OSError:
            data, fds, flags = b"", [], 0
        self._fds.extend(fds)
        if not data or flags & socket.MSG_CTRUNC:
            self._gone(OSError("the shim fork server closed its socket"))
            return
        self._reply_buf += data
        while len(self._reply_buf) >= FRAME.size and self._replies:
            (pid,) = FRAME.unpack_from(self._reply_buf)
            if pid > 0 and not self._fds:
                self._gone(OSError("the shim fork server sent a pid without its shim's socket"))
                return
            del self._reply_buf[: FRAME.size]
            fut = self._replies.popleft()
            if pid <= 0:
                if not fut.done():
                    fut.set_exception(OSError("the shim fork server refused the request"))
                continue
            ctl = socket.socket(fileno=self._fds.popleft())
            ctl.setblocking(False)
            if fut.done():  # its caller is gone (cancelled): the shim runs its job and exits
                ctl.close()
            else:
                fut.set_result((int(pid), ctl))

    def _gone(self, err: OSError) -> None:
        """The server died or was closed: every request waiting for its reply fails."""
        if self._sock is not None:
            asyncio.get_running_loop().remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
        self._reply_buf.clear()
        while self._fds:
            os.close(self._fds.popleft())
        while self._replies:
            fut = self._replies.popleft()
            if not fut.done():
                fut.set_exception(err)

    async def fork(self, spec: ShimSpec) -> Lease:
        """A shim running ``spec``'s job: an idle one, else a new one. The lease is to be given
        back (``done``) once the job is over or no longer followed."""
        body = msgspec.json.encode(spec)
        data = FRAME.pack(len(body)) + body
        read_end, write_end = os.pipe()
        try:
            lease = await self._hand_over(data, write_end)
            if lease is None:
                lease = await self._forked(data, write_end)
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)  # the shim's now (or nobody's): its end is how we learn it ended
        pid, ctl = lease
        self._busy.add(ctl)
        return Lease(pid=pid, notify=read_end, ctl=ctl)

    async def _hand_over(self, data: bytes, fd: int) -> tuple[int, socket.socket] | None:
        """The job written to the most recently busy idle shim (its pages the warmest)."""
        while self._idle:
            ctl, (pid, _) = self._idle.popitem(last=True)
            try:
                await _send(ctl, data, fd)
            except OSError:  # it died while idle
                ctl.close()
                continue
            except BaseException:  # half a request: closed, the shim exits
                ctl.close()
                raise
            return pid, ctl
        return None

    async def _forked(self, data: bytes, fd: int) -> tuple[int, socket.socket]:
        async with self._send_lock:
            if self._sock is None or (self._proc is not None and self._proc.poll() is not None):
                log.warning("shim fork server is gone; starting another")
                self._gone(OSError("the shim fork server is gone"))
                self._proc = None  # it exits on its own (its socket is closed)
                self.start()
            assert self._sock is not None
            reply: asyncio.Future[tuple[int, socket.socket]]
            reply = asyncio.get_running_loop().create_future()
            self._replies.append(reply)
            try:
                await _send(self._sock, data, fd)
            except OSError as err:
                self._gone(err)
                raise
        return await reply

    def done(self, lease: Lease) -> None:
        """The lease's job is over, or no longer followed: its shim back among the idle ones
        if it said it is, else let go (it exits once its job is over)."""
        ctl, lease.ctl = lease.ctl, None
        if ctl is None:
            return
        self._busy.discard(ctl)
        try:
            said = ctl.recv(len(IDLE) + 1)
        except OSError:  # BlockingIOError: not idle (its job goes on, or that was its last)
            said = b""
        if said != IDLE or self._closed:
            ctl.close()
            return
        self._idle[ctl] = (lease.pid, time.monotonic())
        while len(self._idle) > MAX_IDLE:
            self._idle.popitem(last=False)[0].close()
        if self._expiry is None:
            self._expiry = asyncio.get_running_loop().call_later(IDLE_S, self._expire)

    def _expire(self) -> None:
        """Let idle shims past ``IDLE_S`` go; look again when the next one is due."""
        self._expiry = None
        now = time.monotonic()
        while self._idle:
            ctl, (_, since) = next(iter(self._idle.items()))
            if now - since < IDLE_S:
                loop = asyncio.get_running_loop()
                self._expiry = loop.call_later(IDLE_S - (now - since), self._expire)
                return
            del self._idle[ctl]
            ctl.close()

    def idle_pids(self) -> list[int]:
        """The idle shims' pids, least recently busy first."""
        return [pid for pid, _ in self._idle.values()]

    def _reap(self) -> None:
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(5)
            self._proc = None

    async def close(self) -> None:
        """Close the server's socket (it exits) and every shim's: idle ones exit, busy ones go
        on with their jobs and exit at their end."""
        self._closed = True
        self._gone(OSError("the executor is stopping"))
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        while self._idle:
            self._idle.popitem()[0].close()
        while self._busy:
            self._busy.pop().close()
        await asyncio.to_thread(self._reap)
