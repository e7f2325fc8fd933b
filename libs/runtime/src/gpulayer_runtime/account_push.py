"""Giving a re-signed account JWT to the running NATS servers, live (``gpulayer auth revoke``
and ``push``): nats-server applies an account update sent by the system account on
``$SYS.REQ.ACCOUNT.<account>.CLAIMS.UPDATE`` at once, closing a revoked user's connections,
and routed servers take it from there. Apart from ``auth`` (which only writes files) because it
connects: ``gpulayer_runtime.nats`` reads credentials with ``auth``.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import msgspec

from gpulayer_runtime.credentials import decode_jwt_claims


class ServerAnswer(msgspec.Struct, frozen=True, kw_only=True):
    """One server's answer to an account update."""

    server: str
    ok: bool
    message: str


class Pushed(msgspec.Struct, frozen=True, kw_only=True):
    """What ``push_account`` heard: the servers the cluster counts, and each one's answer."""

    servers: int
    answers: list[ServerAnswer]

    @property
    def complete(self) -> bool:
        return len(self.answers) >= self.servers and all(a.ok for a in self.answers)


class _ServerInfo(msgspec.Struct):
    name: str = ""
    id: str = ""


class _Stats(msgspec.Struct):
    active_servers: int = 0


class _Ping(msgspec.Struct):
    """A server's answer to ``$SYS.REQ.SERVER.PING.STATSZ`` (only what is read here)."""

    server: _ServerInfo = msgspec.field(default_factory=_ServerInfo)
    statsz: _Stats = msgspec.field(default_factory=_Stats)


class _Route(msgspec.Struct):
    remote_id: str = ""
    remote_name: str = ""


class _Routes(msgspec.Struct):
    routes: list[_Route] | None = None


class _Routez(msgspec.Struct):
    """A server's answer to ``$SYS.REQ.SERVER.PING.ROUTEZ`` (only what is read here)."""

    data: _Routes = msgspec.field(default_factory=_Routes)


def routed_servers(raw: bytes) -> int:
    """The servers one ROUTEZ answer shows: the answering one and each it routes to (a route
    pool opens several connections to one peer); 0 when unreadable."""
    try:
        routes = _ROUTEZ.decode(raw).data.routes or []
    except msgspec.DecodeError:
        return 0
    return 1 + len({r.remote_name or r.remote_id for r in routes})


class _Status(msgspec.Struct):
    message: str = ""


class _Failure(msgspec.Struct):
    description: str = ""


class _ClaimsReply(msgspec.Struct):
    """A server's answer to an account claims update."""

    server: _ServerInfo = msgspec.field(default_factory=_ServerInfo)
    data: _Status | None = None
    error: _Failure | None = None


_PING = msgspec.json.Decoder(_Ping)
_ROUTEZ = msgspec.json.Decoder(_Routez)
_CLAIMS_REPLY = msgspec.json.Decoder(_ClaimsReply)


def server_answer(raw: bytes) -> ServerAnswer:
    """One server's reply to an account claims update, in words (anything unreadable is a
    failure that says so, never an exception)."""
    try:
        r = _CLAIMS_REPLY.decode(raw)
    except msgspec.DecodeError:
        return ServerAnswer(server="?", ok=False, message=f"unreadable answer {raw[:80]!r}")
    message = (r.data.message if r.data else "") or (r.error.description if r.error else "")
    # "jwt update skipped": a memory resolver (an older server.conf) that has not loaded the
    # account: it keeps the old JWT.
    ok = r.error is None and message == "jwt updated"
    return ServerAnswer(
        server=(r.server.name or r.server.id or "?")[:200],
        ok=ok,
        message=message[:500] or "no answer",
    )


async def _gather(nc: Any, subject: str, payload: bytes, want: int, timeout: float) -> list[bytes]:
    """Replies to one request from many servers: until ``want`` came (a ping reply may raise
    it: each says how many servers it knows of) or ``timeout`` passed."""
    replies: asyncio.Queue[bytes] = asyncio.Queue()

    async def on_reply(msg: Any) -> None:
        await replies.put(msg.data)

    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, cb=on_reply)
    try:
        await nc.publish(subject, payload, reply=inbox)
        got: list[bytes] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while len(got) < want and (left := deadline - loop.time()) > 0:
            try:
                got.append(await asyncio.wait_for(replies.get(), left))
            except TimeoutError:
                break
            with contextlib.suppress(msgspec.DecodeError):
                want = max(want, _PING.decode(got[-1]).statsz.active_servers)
        return got
    finally:
        await sub.unsubscribe()


async def _running_servers(nc: Any, timeout: float) -> int:
    """How many servers there are: each answers a ping and says how many it knows of; at
    least the one connected to (no answer at all must not read as "all applied it")."""
    pings = await _gather(nc, "$SYS.REQ.SERVER.PING.STATSZ", b"", 1, timeout)
    servers = max(1, len(pings))
    for raw in pings:
        with contextlib.suppress(msgspec.DecodeError):
            servers = max(servers, _PING.decode(raw).statsz.active_servers)
    # A server's stats count the servers it has heard from, fewer than it routes to in its
    # first seconds (a revocation right after a start said "all 1 running servers applied
    # it" of three): its routes count them too.
    for raw in await _gather(nc, "$SYS.REQ.SERVER.PING.ROUTEZ", b"", 1, timeout):
        servers = max(servers, routed_servers(raw))
    return servers


async def push_account(
    url: str,
    system_creds: str,
    account_jwt: str,
    *,
    timeout: float = 5.0,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
) -> Pushed:
    """Give ``account_jwt`` to every running server reachable from ``url``, live: a server
    applies it at once (a revoked user's connections closed), routed servers each get it
    from the system account's subject."""
    from nats.aio.client import Client, RawCredentials

    from gpulayer_runtime.nats import server_list, tls_context

    async def quiet(err: Exception) -> None:
        # A server that can't be reached is the caller's to report, once, from what is raised.
        pass

    options: dict[str, Any] = {}
    if (ctx := tls_context(tls_ca, tls_cert, tls_key)) is not None:
        options["tls"] = ctx
    # A Client of our own, closed also when the server refuses it: nats-py leaves the
    # socket of a refused connection open otherwise.
    nc = Client()
    try:
        # Each server tried twice at most (nats-py's 0 means "forever"), all within ``timeout``.
        await asyncio.wait_for(
            nc.connect(
                servers=server_list(url),
                name="gpulayer-auth",
                user_credentials=RawCredentials(system_creds),
                allow_reconnect=False,
                max_reconnect_attempts=1,
                connect_timeout=max(1, int(timeout)),
                error_cb=quiet,
                **options,
            ),
            timeout,
        )
    except BaseException:
        await nc.close()
        raise
    try:
        servers = await _running_servers(nc, timeout)
        account = decode_jwt_claims(account_jwt)["sub"]
        subject = f"$SYS.REQ.ACCOUNT.{account}.CLAIMS.UPDATE"
        replies = await _gather(nc, subject, account_jwt.encode(), servers, timeout)
    finally:
        await nc.close()
    answers = [server_answer(raw) for raw in replies]
    return Pushed(servers=servers, answers=answers)
