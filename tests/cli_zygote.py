"""A process with the ``gpulayer`` command line already imported, forking one child per command
the tests run (``tests.helpers.gpulayer``).

Each child is a process of its own, as the console script's would be: its own stdin, stdout
and stderr (passed over the socket), environment, arguments and exit code. It only skips the
~0.3 s of CPU each fresh interpreter spends importing the CLI (rich, asyncio, nats, the
contracts), which the suite paid a few hundred times. Tests about the process itself (a
terminal's Ctrl-C, ``dev up``) run the real console script instead.

Protocol, one connection per command: the client sends a 4-byte length, the JSON
``{"argv": [...], "env": {...}, "cwd": ...}`` and three fds (stdin, stdout, stderr) with its first bytes;
the zygote answers ``<pid>\\n`` once forked and ``<exit code>\\n`` once the child is reaped
(negative: killed by that signal). The zygote exits when its stdin (a pipe from the test
worker) closes.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import selectors
import signal
import socket
import struct
import sys
import traceback

import gpulayer_cli.main

# What the commands import lazily, imported once here: children share it. Keep this to modules
# that read nothing from the environment when imported.
PRELOADED = (
    "nats",
    "gpulayer_cli.client",
    "gpulayer_cli.denials",
    "gpulayer_cli.render",
    "gpulayer_runtime.auth",
    "gpulayer_runtime.nats",
)

HEADER = struct.Struct("!I")
MAX_REQUEST = 1 << 22


def _read_request(conn: socket.socket) -> tuple[dict[str, object], list[int]]:
    data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, 3)
    if len(data) < HEADER.size:
        raise ValueError("short request")
    (size,) = HEADER.unpack_from(data)
    if size > MAX_REQUEST:
        raise ValueError(f"request of {size} bytes")
    body = bytearray(data[HEADER.size :])
    while len(body) < size:
        more = conn.recv(size - len(body))
        if not more:
            raise ValueError("request cut short")
        body += more
    return json.loads(body), fds


def _child(request: dict[str, object], fds: list[int], keep_closed: list[int]) -> None:
    """In the forked child: become the command, run it, exit with its code. Never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for fd in keep_closed:
            os.close(fd)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        env = request["env"]
        argv = request["argv"]
        assert isinstance(env, dict)
        assert isinstance(argv, list)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(str(request["cwd"]))
        sys.argv = ["gpulayer", *argv]
        try:
            code = gpulayer_cli.main.main(list(argv))
        except SystemExit as stop:  # what the console script does with it
            if stop.code is None or isinstance(stop.code, int):
                code = stop.code or 0
            else:
                print(stop.code, file=sys.stderr)
                code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(BaseException):  # a closed pipe: nothing more to say
                stream.flush()
        os._exit(code & 0xFF)


def serve(path: str) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(wake_r, selectors.EVENT_READ, "reap")
    sel.register(0, selectors.EVENT_READ, "parent")
    children: dict[int, socket.socket] = {}
    print("ready", flush=True)
    while True:
        for key, _ in sel.select():
            if key.data == "parent":
                if not os.read(0, 4096):  # the test worker is gone
                    for pid in children:
                        os.kill(pid, signal.SIGKILL)
                    return
            elif key.data == "accept":
                conn, _ = listener.accept()
                try:
                    request, fds = _read_request(conn)
                except (OSError, ValueError) as err:
                    conn.sendall(f"error {err}\n".encode())
                    conn.close()
                    continue
                sys.stdout.flush()
                keep_closed = [listener.fileno(), wake_r, wake_w, conn.fileno()]
                keep_closed += [c.fileno() for c in children.values()]
                pid = os.fork()
                if pid == 0:
                    _child(request, fds, keep_closed)
                for fd in fds:
                    os.close(fd)
                conn.sendall(f"{pid}\n".encode())
                children[pid] = conn
            else:
                try:
                    while os.read(wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
                while children:
                    try:
                        pid, status = os.waitpid(-1, os.WNOHANG)
                    except ChildProcessError:
                        break
                    if pid == 0:
                        break
                    conn = children.pop(pid)
                    with contextlib.suppress(OSError):  # the client gave up (a timeout)
                        conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                    conn.close()


if __name__ == "__main__":
    for module in PRELOADED:
        importlib.import_module(module)
    serve(sys.argv[1])
