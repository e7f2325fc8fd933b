"""The shim fork server: ``python -m gpulayer_executor.shim_server``.

The executor starts it once and talks to it over a socket pair (on its stdin): a request is a
length-prefixed ``ShimSpec`` with the write end of the job's notify pipe attached; the reply is
the pid of the shim forked to run the job, with the shim's control socket attached (0 and no
socket: the spec was bad, or no shim could be had). The fork server keeps nothing of the shims
it forks: each one's socket goes to the executor, which talks to the shim from then on.

A shim runs one job at a time, in a process of its own that outlives the executor. Once its job
is over (``exit.json`` written) a shim says ``IDLE`` on its control socket, before it pokes the
executor's notify pipe, and waits for the next job on that socket: starting a job then costs a
message from the executor to the shim, where a fresh fork costs the copy of every page the shim
touches (a few milliseconds of CPU per job, the most expensive part of a short job's start) and
a hop through this server costs two more process wake-ups. A shim exits when its socket is
closed (the executor let it go: idle past ``IDLE_S``, beyond ``MAX_IDLE``, or the executor gone)
and after ``MAX_JOBS`` jobs. A shim whose job outlives the executor exits when that job is over.

The fork server imports no NATS client and freezes its heap before serving, so a shim's garbage
collections never touch (and so never copy) the pages it inherited. It exits when the executor
closes the socket (or dies).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import NoReturn

import msgspec

from gpulayer_executor import shim_job
from gpulayer_executor.shim import FRAME, IDLE, Notifier, ShimSpec
from gpulayer_executor.shim_job import Signals, run_job

log = logging.getLogger("gpulayer_executor.shim")

_spec_decoder = msgspec.json.Decoder(ShimSpec)

# A spec is a few KiB (argv and environment are bounded by the grant's own bounds).
MAX_REQUEST_BYTES = 16 << 20
# Jobs one shim runs (one after the other) before it exits: bounds what a leak could grow to.
MAX_JOBS = 1000

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
            shim_job.SPARE.close()
        with contextlib.suppress(BaseException):
            logging.shutdown()
        os._exit(code)


class _Server:
    """The fork server's loop: a request in, a shim forked, its pid and socket out."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def _fork(self, spec: ShimSpec, fds: list[int]) -> tuple[int, socket.socket]:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            pid = os.fork()
        except OSError:
            ours.close()
            theirs.close()
            raise
        if pid == 0:
            # A shim holds no socket but its own end of its own: the server keeps none of the
            # others' (each went to the executor and was closed here before this fork).
            self.sock.close()
            ours.close()
            run_shim(spec, fds[0], theirs)
        theirs.close()
        return pid, ours

    def _request(self, body: bytes, fds: list[int]) -> tuple[int, socket.socket | None]:
        try:
            if len(fds) != 1:
                raise ValueError(f"{len(fds)} descriptors attached, expected the notify pipe")
            return self._fork(_spec_decoder.decode(body), fds)
        except (ValueError, OSError, msgspec.DecodeError, msgspec.ValidationError) as err:
            print(f"gpulayer shim fork server: request refused: {err}", file=sys.stderr, flush=True)
            return 0, None
        finally:
            for fd in fds:
                os.close(fd)

    def serve(self) -> None:
        while True:
            request = _recv_request(self.sock)
            if request is None:
                return
            pid, ctl = self._request(*request)
            if ctl is None:
                self.sock.sendall(FRAME.pack(0))
                continue
            with ctl:  # the executor's from now on; a reply it can't take lets the shim go
                socket.send_fds(self.sock, [FRAME.pack(pid)], [ctl.fileno()])


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
    _Server(sock).serve()


def main() -> None:
    """``python -m gpulayer_executor.shim_server``: serve on the socket given as stdin."""
    sock = socket.socket(fileno=os.dup(0))
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    serve(sock)


if __name__ == "__main__":
    main()
