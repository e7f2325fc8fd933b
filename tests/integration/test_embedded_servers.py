"""The embedded servers are ready only when *their own* process listens: a port that another
process took between ``free_port`` and the server's bind is never mistaken for the server
(test-repeat: a test's NATS was another xdist worker's, and went away with that test)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpulayer_runtime import pgserver, servers
from gpulayer_runtime.pgserver import EmbeddedPostgres
from gpulayer_runtime.servers import EmbeddedNats, EmbeddedNatsCluster, ServerStartError


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A loopback port something else listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


def _picks_first(monkeypatch: pytest.MonkeyPatch, port: int) -> None:
    """``free_port`` answers ``port`` once (the race lost), then as it would: for the NATS
    servers and for PostgreSQL (``pgserver``), which each look it up in their own module."""
    real = servers.free_port
    answers = iter([port])

    def first(host: str = "127.0.0.1") -> int:
        return next(answers, None) or real(host)

    monkeypatch.setattr(servers, "free_port", first)
    monkeypatch.setattr(pgserver, "free_port", first)


def _listening_pid(port: int) -> set[int]:
    """The pids with a listening socket on ``port`` (from /proc)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if int(f[1].rsplit(":", 1)[1], 16) == port and f[3] == "0A":  # LISTEN
                inodes.add(f[9])
    pids = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                link = str(fd.readlink())
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    pids.add(int(proc.name))
        except OSError:
            continue
    return pids


def test_nats_picks_another_port_when_its_first_was_taken(
    tmp_path: Path, taken_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    _picks_first(monkeypatch, taken_port)
    server = EmbeddedNats(tmp_path / "nats")
    assert server.port == taken_port
    with server:
        assert server.port != taken_port
        assert server.proc is not None
        assert _listening_pid(server.port) == {server.proc.pid}


def test_a_running_nats_is_started_once(tmp_path: Path) -> None:
    """``with EmbeddedNats(...).start()`` (``__enter__`` starts too): one server, not a second
    one beside a first left running."""
    with EmbeddedNats(tmp_path / "nats").start() as server:
        assert server.proc is not None
        first = server.proc.pid
        again = server.start().proc
        assert again is not None
        assert again.pid == first
        assert _listening_pid(server.port) == {first}
    assert server.proc.poll() is not None  # and stopped with the block


def test_nats_on_a_port_the_caller_chose_and_another_holds_fails_naming_it(
    tmp_path: Path, taken_port: int
) -> None:
    server = EmbeddedNats(tmp_path / "nats", port=taken_port)
    with pytest.raises(ServerStartError, match="port was taken"):
        server.start()
    assert server.proc is not None
    assert server.proc.poll() is not None


def test_postgres_picks_another_port_when_its_first_was_taken(
    tmp_path: Path, taken_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    _picks_first(monkeypatch, taken_port)
    server = EmbeddedPostgres(tmp_path / "pg", fast=True)
    assert server.port == taken_port
    with server:
        assert server.port != taken_port
        assert server.proc is not None
        assert server.proc.pid in _listening_pid(server.port)


def test_a_cluster_is_routed_once_started(tmp_path: Path) -> None:
    """Started means every server routes to both others (its own monitor says so), not only
    that each listens: a request to every server right after would reach only some."""
    with EmbeddedNatsCluster(tmp_path / "cluster") as cluster:
        assert [s.peers() for s in cluster.servers] == [2, 2, 2]
        cluster.servers[2].stop()
        # A route gone is seen as gone: peers() reads the server, it doesn't remember.
        for _ in range(200):
            if cluster.servers[0].peers() == 1:
                break
            time.sleep(0.05)
        assert cluster.servers[0].peers() == 1
