"""The shim fork server: ``python -m gpulayer_executor.shim_server``.

The executor starts it once and talks to it over a socket pair (on its stdin): a request is a
length-prefixed ``ShimSpec`` with the write end of the job's notify pipe attached; the reply is
the pid of the shim that runs the job (0: the spec was bad, or no shim could be had).

A shim runs one job at a time, in a process of its own that outlives the executor. Once its job
is over (``exit.json`` written, its notify pipe closed) a shim tells the fork server it is idle
and may be handed the next job: starting a job then costs a message, where a fresh fork costs
the copy of every page the shim touches (a few milliseconds of CPU per job, the most expensive
part of a short job's start). Idle shims are let go (their socket closed: they exit) after
``IDLE_S``, beyond ``MAX_IDLE``, after ``MAX_JOBS`` jobs each, and all at once when the fork
server exits. A shim whose job outlives the fork server (the executor restarted) exits when
that job is over.

The fork server imports no NATS client and freezes its heap before serving, so a shim's garbage
collections never touch (and so never copy) the pages it inherited. It exits when the executor
closes the socket (or dies).
"""

from __future__ import annotations

import collections
import contextlib
import gc
import logging
import os
import selectors
import signal
import socket
import sys
import time
from pathlib import Path
from typing import NoReturn

import msgspec

from gpulayer_executor.shim import FRAME, Notifier, ShimSpec
from gpulayer_executor.shim_job import Signals, run_job

log = logging.getLogger("gpulayer_executor.shim")

_spec_decoder = msgspec.json.Decoder(ShimSpec)

# A spec is a few KiB (argv and environment are bounded by the grant's own bounds).
MAX_REQUEST_BYTES = 16 << 20
# Idle shims kept for the next jobs, at most; and for how long each.
MAX_IDLE = 64
IDLE_S = 30.0
# Jobs one shim runs (one after the other) before it exits: bounds what a leak could grow to.
MAX_JOBS = 1000
# What an idle shim says on its socket.
IDLE = b"i"

# Each shim's log, set up once here (in the fork server) rather than in every shim; pointed at
# the job's run folder per job, it opens the file at the first record only (most never log).
_LOG = logging.FileHandler(os.devnull, delay=True)


def _recv_request(sock: socket.socket) -> tuple[bytes, list[int]] | None:
    """One request: its body and the descriptors that came with it; None at EOF."""
    data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 1)
    if not data:
        for fd in fds:
            os.close(fd)
        return None
    head = bytearray(data)
    while len(head) < FRAME.size:
        more = sock.recv(FRAME.size - len(head))
        if not more:
            return None
        head += more
    (size,) = FRAME.unpack_from(head)
    if size > MAX_REQUEST_BYTES:
        raise SystemExit(f"gpulayer shim fork server: a request of {size} bytes; giving up")
    body = bytearray(head[FRAME.size :])
    while len(body) < size:
        more = sock.recv(size - len(body))
        if not more:
            return None
        body += more
    return bytes(body), list(fds)


def _shim_loop(spec: ShimSpec, notify_fd: int, ctl: socket.socket) -> int:
    """A shim's jobs: this one, then each the fork server hands it while it is idle."""
    signals = Signals()
    jobs = 0
    while True:
        # Received with the request, so inheritable: the job must not hold it (its end is how
        # the executor learns the shim is gone or done).
        os.set_inheritable(notify_fd, False)
        _LOG.close()
        _LOG.baseFilename = str(Path(spec.run_dir) / "shim.log")
        notify = Notifier(notify_fd)
        jobs += 1
        idle = jobs < MAX_JOBS

        def ended() -> None:
            # Said before the executor hears of the end: its next request then finds this
            # shim idle (the request waits in the socket until this job is wound up).
            nonlocal idle
            if idle:
                try:
                    ctl.sendall(IDLE)
                except OSError:
                    idle = False

        try:
            run_job(spec, notify, signals, ended)
        finally:
            if notify.fd is not None:
                os.close(notify.fd)
        if not idle:
            return 0
        try:
            request = _recv_request(ctl)
        except OSError:
            return 0
        if request is None:  # let go by the fork server (or it is gone)
            return 0
        body, fds = request
        spec = _spec_decoder.decode(body)  # checked by the fork server already
        notify_fd = fds[0]


def run_shim(spec: ShimSpec, notify_fd: int, ctl: socket.socket) -> NoReturn:
    """The forked shim: a session of its own, its log in the job's run folder; never returns."""
    code = 1
    try:
        os.setsid()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the fork server ignores it; we wait
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):  # the executor's terminal or log pipe may go away before we do
            os.dup2(devnull, fd)
        os.close(devnull)
        code = _shim_loop(spec, notify_fd, ctl)
    except BaseException:
        with contextlib.suppress(BaseException):
            log.exception("shim of grant %s failed", spec.grant_id)
    finally:
        with contextlib.suppress(BaseException):
            logging.shutdown()
        os._exit(code)


class _Server:
    """The fork server's state: the executor's socket, and a socket to each shim it started."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sel = selectors.DefaultSelector()
        self.sel.register(sock, selectors.EVENT_READ)
        self.shims: dict[int, tuple[int, socket.socket]] = {}  # fd -> (pid, socket)
        self.idle: collections.OrderedDict[int, float] = collections.OrderedDict()  # fd -> since

    def _drop(self, fd: int) -> None:
        _, ctl = self.shims.pop(fd)
        self.idle.pop(fd, None)
        self.sel.unregister(ctl)
        ctl.close()

    def _from_shim(self, fd: int) -> None:
        if fd not in self.shims:  # let go earlier in this turn
            return
        _, ctl = self.shims[fd]
        try:
            data = ctl.recv(64)
        except OSError:
            data = b""
        if not data or data != IDLE:  # gone, or saying what no shim says
            self._drop(fd)
            return
        self.idle[fd] = time.monotonic()
        while len(self.idle) > MAX_IDLE:
            self._drop(next(iter(self.idle)))

    def _expire(self) -> float | None:
        """Let idle shims past ``IDLE_S`` go; how long until the next one is due."""
        now = time.monotonic()
        while self.idle:
            fd, since = next(iter(self.idle.items()))
            if now - since < IDLE_S:
                return IDLE_S - (now - since)
            self._drop(fd)
        return None

    def _hand_over(self, body: bytes, fds: list[int]) -> int:
        """An idle shim takes the job: its pid, or 0 when none could."""
        while self.idle:
            fd, _ = self.idle.popitem(last=True)  # the most recently busy: warmest
            pid, ctl = self.shims[fd]
            try:
                socket.send_fds(ctl, [FRAME.pack(len(body)) + body], fds)
            except OSError:
                self._drop(fd)
                continue
            return pid
        return 0

    def _fork(self, spec: ShimSpec, body: bytes, fds: list[int]) -> int:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            pid = os.fork()
        except OSError:
            ours.close()
            theirs.close()
            raise
        if pid == 0:
            # A shim holds none of the fork server's sockets: only its own end of its own.
            self.sock.close()
            for _, ctl in self.shims.values():
                ctl.close()
            ours.close()
            run_shim(spec, fds[0], theirs)
        theirs.close()
        self.shims[ours.fileno()] = (pid, ours)
        self.sel.register(ours, selectors.EVENT_READ)
        return pid

    def _request(self, body: bytes, fds: list[int]) -> int:
        try:
            if len(fds) != 1:
                raise ValueError(f"{len(fds)} descriptors attached, expected the notify pipe")
            spec = _spec_decoder.decode(body)
            return self._hand_over(body, fds) or self._fork(spec, body, fds)
        except (ValueError, OSError, msgspec.DecodeError, msgspec.ValidationError) as err:
            print(f"gpulayer shim fork server: request refused: {err}", file=sys.stderr, flush=True)
            return 0
        finally:
            for fd in fds:
                os.close(fd)

    def serve(self) -> None:
        while True:
            ready = [key.fileobj for key, _ in self.sel.select(self._expire())]
            # The shims' news first: an idle shim takes the request that came with it.
            for obj in ready:
                if obj is not self.sock and isinstance(obj, socket.socket):
                    self._from_shim(obj.fileno())
            if self.sock not in ready:
                continue
            request = _recv_request(self.sock)
            if request is None:
                return
            self.sock.sendall(FRAME.pack(self._request(*request)))

    def close(self) -> None:
        for fd in list(self.shims):
            self._drop(fd)
        self.sel.close()


def serve(sock: socket.socket) -> None:
    """The fork server's loop, until the executor closes ``sock``."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # shims are reaped by the kernel
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the executor stops us by closing the socket
    # Also what a shim has until its handler is in place: a stop sent that early is not lost
    # (each job begins with a look for its stop request), and never kills a shim.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _LOG.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(handlers=[_LOG], level=logging.INFO, force=True)
    # Everything imported so far is shared with every shim: frozen, a shim's collections skip
    # it (without, the first full collection in a shim would copy the whole heap).
    gc.collect()
    gc.freeze()
    server = _Server(sock)
    try:
        server.serve()
    finally:
        server.close()


def main() -> None:
    """``python -m gpulayer_executor.shim_server``: serve on the socket given as stdin."""
    sock = socket.socket(fileno=os.dup(0))
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    serve(sock)


if __name__ == "__main__":
    main()
