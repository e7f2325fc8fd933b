"""Revoking and expiring credentials on running nats-servers (one, and a routed three): the
revoked identity's connections are closed and new ones refused, everyone else stays connected,
and no server restarts. Each test has an auth folder of its own: the session's is shared."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client, RawCredentials

from gpulayer_cli.main import main
from gpulayer_runtime.account_push import routed_servers
from gpulayer_runtime.auth import AuthStore, decode_jwt_claims
from gpulayer_runtime.nats import connect
from gpulayer_runtime.roles import Role
from gpulayer_runtime.servers import EmbeddedNats, EmbeddedNatsCluster

pytestmark = pytest.mark.integration


class Followed:
    """A client that reconnects a few times, then gives up: its errors and its end kept."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.closed = asyncio.Event()
        self.nc: Client

    async def on_error(self, err: Exception) -> None:
        self.errors.append(str(err).lower())

    async def on_closed(self) -> None:
        # nats-py reports the -ERR a server closed it with (or refused a reconnect with) here,
        # not to the error callback.
        self.errors.append(str(self.nc.last_error).lower())
        self.closed.set()


@asynccontextmanager
async def followed(url: str, creds: Path) -> AsyncIterator[Followed]:
    f = Followed()
    f.nc = await connect(
        url, "followed", creds=str(creds), error_cb=f.on_error, closed_cb=f.on_closed,
        max_reconnect_attempts=3, reconnect_time_wait=0.1,
    )  # fmt: skip
    try:
        yield f
    finally:
        await f.nc.close()


async def refused(url: str, creds: Path) -> bool:
    """Whether the server refuses a new connection with these credentials."""
    nc = Client()
    try:
        await nc.connect(
            url, user_credentials=str(creds), allow_reconnect=False, max_reconnect_attempts=0,
            connect_timeout=5,
        )  # fmt: skip
    except nats.errors.Error as err:
        return "authorization violation" in str(err).lower()
    finally:
        # Also after a refusal: nats-py leaves that socket open otherwise.
        await nc.close()
    return False


async def still_works(nc: Client) -> None:
    """A round trip to the server on this connection (PING, PONG)."""
    await nc.flush(timeout=5)
    assert nc.is_connected


def leaked(store: AuthStore, role: Role, name: str, folder: Path) -> Path:
    """A copy of the identity's credential, held elsewhere (as a leaked one would be):
    revoking removes the auth folder's own."""
    copy = folder / f"leaked-{role}-{name}.creds"
    shutil.copy(store.ensure(role, name), copy)
    return copy


def server_id(server: EmbeddedNats) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.monitor_port}/varz", timeout=5) as r:
        return str(json.load(r)["server_id"])


async def revoke(folder: Path, url: str, monkeypatch: pytest.MonkeyPatch, *what: str) -> int:
    """``gpulayer auth revoke`` as a user runs it (in a thread: it runs its own event loop)."""
    monkeypatch.setenv("GPULAYER_NATS_URL", url)
    return await asyncio.to_thread(main, ["auth", "--dir", str(folder), "revoke", *what])


async def test_revoking_a_connected_user_closes_it_alone_without_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    store = AuthStore(tmp_path / "auth").init()
    alice_creds, bob_creds = leaked(store, "user", "alice", tmp_path), store.ensure("user", "bob")
    with EmbeddedNats(tmp_path / "nats", auth_conf=store.server_conf, monitor=True) as server:
        assert server.proc is not None
        pid, sid = server.proc.pid, server_id(server)
        async with (
            followed(server.url, alice_creds) as alice,
            followed(server.url, bob_creds) as bob,
        ):
            await still_works(bob.nc)
            assert await revoke(store.folder, server.url, monkeypatch, "user", "alice") == 0
            out = capsys.readouterr().out
            assert "jwt updated" in out, out
            await asyncio.wait_for(alice.closed.wait(), 15)
            # The server closed it, saying why (nats-py does not reconnect after that -ERR).
            assert "user authentication revoked" in alice.errors[-1], alice.errors
            assert await refused(server.url, alice_creds)
            # Bob never noticed: the same connection, no error, no reconnect.
            await still_works(bob.nc)
            assert bob.errors == []
            assert not bob.closed.is_set()
            assert bob.nc.stats["reconnects"] == 0
        assert server.proc.pid == pid
        assert server.proc.poll() is None
        assert server_id(server) == sid
        assert not store.creds_path("user", "alice").exists()
    # A restart keeps it: from the server's own account folder, and a fresh server (nothing but
    # the auth folder's server.conf) has it too.
    for data in (tmp_path / "nats", tmp_path / "fresh"):
        with EmbeddedNats(data, auth_conf=store.server_conf, monitor=True) as again:
            assert await refused(again.url, alice_creds)
            assert not await refused(again.url, bob_creds)
    # And it is listed.
    assert main(["auth", "--dir", str(store.folder), "list"]) == 0
    listed = capsys.readouterr().out
    assert "revoked" in listed
    assert "alice" in listed
    assert "bob" in listed


async def test_a_service_connection_revoked_says_so_in_its_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A service's connection (connect's own callbacks) whose credential is revoked: nats-py
    gives up on it for good, and the log says the credential was refused, naming it."""
    store = AuthStore(tmp_path / "auth").init()
    creds = leaked(store, "node", "gpu-07", tmp_path)
    with EmbeddedNats(tmp_path / "nats", auth_conf=store.server_conf) as server:
        ended = asyncio.Event()
        ending = EndSeen(ended)
        logging.getLogger("gpulayer_runtime.nats").addHandler(ending)
        nc = await connect(server.url, "gpulayer-probe", creds=str(creds))
        try:
            with caplog.at_level("INFO", logger="gpulayer_runtime.nats"):
                assert await revoke(store.folder, server.url, monkeypatch, "node", "gpu-07") == 0
                await asyncio.wait_for(ended.wait(), 15)
            assert nc.is_closed
            said = [r for r in caplog.records if r.name == "gpulayer_runtime.nats"]
            closed = [r.getMessage() for r in said if r.levelname == "ERROR"]
            assert len(closed) == 1, [r.getMessage() for r in said]
            assert "connection closed for good" in closed[0]
            assert f"refused the credential {creds}" in closed[0]
        finally:
            logging.getLogger("gpulayer_runtime.nats").removeHandler(ending)
            await nc.close()


class EndSeen(logging.Handler):
    """Sets ``event`` at the first error logged (the connection's end, said)."""

    def __init__(self, event: asyncio.Event) -> None:
        super().__init__(logging.ERROR)
        self.event = event

    def emit(self, record: logging.LogRecord) -> None:
        self.event.set()


async def test_revoking_on_a_three_server_cluster_reaches_every_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    store = AuthStore(tmp_path / "auth").init()
    alice_creds, bob_creds = leaked(store, "user", "alice", tmp_path), store.ensure("user", "bob")
    with EmbeddedNatsCluster(tmp_path / "cluster", auth_conf=store.server_conf) as cluster:
        n0, n1, n2 = cluster.servers
        before = {s.url: (s.proc.pid if s.proc else 0, server_id(s)) for s in cluster.servers}
        async with followed(n0.url, alice_creds) as alice, followed(n1.url, bob_creds) as bob:
            await still_works(bob.nc)
            # Pushed through the third server: alice's and bob's see it over the routes.
            assert await revoke(store.folder, n2.url, monkeypatch, "user", "alice") == 0
            out = capsys.readouterr().out
            assert all(f"server {s}: jwt updated" in out for s in ("n0", "n1", "n2")), out
            await asyncio.wait_for(alice.closed.wait(), 15)
            # The server closed it, saying why (nats-py does not reconnect after that -ERR).
            assert "user authentication revoked" in alice.errors[-1], alice.errors
            for s in cluster.servers:
                assert await refused(s.url, alice_creds), s.url
                # Each server keeps the revocation in its own account folder.
                account = decode_jwt_claims(store.account_jwt())["sub"]
                kept = (s.data_dir / "accounts" / f"{account}.jwt").read_text().strip()
                assert kept == store.account_jwt(), s.url
            await still_works(bob.nc)
            assert bob.errors == []
            assert bob.nc.stats["reconnects"] == 0
        after = {s.url: (s.proc.pid if s.proc else 0, server_id(s)) for s in cluster.servers}
        assert after == before
        assert all(s.proc is not None and s.proc.poll() is None for s in cluster.servers)


async def test_an_expired_credential_is_disconnected_and_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "auth"
    assert main(["auth", "--dir", str(folder), "init"]) == 0
    assert main(["auth", "--dir", str(folder), "add-user", "carol", "--expires", "3s"]) == 0
    carol_creds = Path(capsys.readouterr().out.strip().splitlines()[-1])
    claims = decode_jwt_claims((await asyncio.to_thread(carol_creds.read_text)).splitlines()[1])
    assert claims["exp"] == claims["iat"] + 3
    store = AuthStore(folder)
    bob_creds = store.ensure("user", "bob")
    with EmbeddedNats(tmp_path / "nats", auth_conf=store.server_conf) as server:
        async with (
            followed(server.url, carol_creds) as carol,
            followed(server.url, bob_creds) as bob,
        ):
            # The server ends the connection when the credential expires, by itself.
            await asyncio.wait_for(carol.closed.wait(), 20)
            assert "user authentication expired" in carol.errors[-1], carol.errors
            # The server refuses a JWT once the clock, in whole seconds, is past its exp (at
            # exp itself it still accepts one, and then closes it at once).
            if (left := claims["exp"] + 1 - time.time()) > 0:
                await asyncio.sleep(left)
            assert await refused(server.url, carol_creds)
            await still_works(bob.nc)
    assert main(["auth", "--dir", str(folder), "list"]) == 0
    assert "expired" in capsys.readouterr().out


async def test_a_revocation_no_server_took_is_pushed_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Revoked while the servers were out of reach: on disk only, said so (exit 3); `auth push`
    then brings the running server up to date. A server of another auth folder refuses it."""
    store = AuthStore(tmp_path / "auth").init()
    alice_creds = leaked(store, "user", "alice", tmp_path)
    with EmbeddedNats(tmp_path / "nats", auth_conf=store.server_conf) as server:
        async with followed(server.url, alice_creds) as alice:
            assert (
                await revoke(store.folder, "nats://127.0.0.1:1", monkeypatch, "user", "alice") == 3
            )
            assert "no running server took it" in capsys.readouterr().err
            await still_works(alice.nc)  # the server was never told
            monkeypatch.setenv("GPULAYER_NATS_URL", server.url)
            push = ["auth", "--dir", str(store.folder), "push"]
            assert await asyncio.to_thread(main, push) == 0
            assert "jwt updated" in capsys.readouterr().out
            await asyncio.wait_for(alice.closed.wait(), 15)
            assert "user authentication revoked" in alice.errors[-1], alice.errors
        other = AuthStore(tmp_path / "other").init()
        assert await asyncio.to_thread(main, ["auth", "--dir", str(other.folder), "push"]) == 3
        assert "another auth folder" in capsys.readouterr().err


async def test_every_server_of_a_cluster_is_counted_from_its_routes(tmp_path: Path) -> None:
    """How many servers a push waits for: one ROUTEZ answer names the answering server's
    routes, so a cluster of three counts three even while a server's stats have heard of
    fewer (its first seconds)."""
    store = AuthStore(tmp_path / "auth").init()
    with EmbeddedNatsCluster(tmp_path / "cluster", auth_conf=store.server_conf) as cluster:
        creds = RawCredentials(store.system_creds())
        nc = await nats.connect(cluster.servers[2].url, user_credentials=creds)
        try:
            reply = await nc.request("$SYS.REQ.SERVER.PING.ROUTEZ", b"", timeout=10)
        finally:
            await nc.close()
    assert routed_servers(reply.data) == 3
    assert routed_servers(b"not json") == 0
