"""NATS edges shared by every service: connecting, declaring the JetStream streams once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Iterable

import nats
import nats.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError, NotFoundError, ServiceUnavailableError

from gpulayer_contracts.subjects import STREAMS, StreamSpec
from gpulayer_runtime import roles
from gpulayer_runtime.auth import identity_of

log = logging.getLogger(__name__)


class _StartTlsEofNote(logging.Filter):
    """nats-py upgrades a connection to TLS after it is made (``loop.start_tls``), so asyncio's
    stream protocol doesn't know it is over TLS, and at every close asyncio logs "returning true
    from eof_received() has no effect when using ssl": a warning about nothing wrong, which
    printed under every CLI command over ``tls://``. Only that line is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("returning true from eof_received()")


logging.getLogger("asyncio").addFilter(_StartTlsEofNote())

_RETENTION = {
    "limits": RetentionPolicy.LIMITS,
    "workqueue": RetentionPolicy.WORK_QUEUE,
    "interest": RetentionPolicy.INTEREST,
}


def stream_config(spec: StreamSpec, *, prefix: str = "", replicas: int = 1) -> StreamConfig:
    """``spec`` as JetStream's config; ``replicas``: copies kept on as many servers of a
    cluster (``GPULAYER_STREAM_REPLICAS``; 1 on a single server)."""
    return StreamConfig(
        name=prefix + spec.name,
        num_replicas=replicas,
        subjects=list(spec.subjects),
        retention=_RETENTION[spec.retention],
        storage=StorageType.FILE,
        max_msgs_per_subject=spec.max_msgs_per_subject,
        max_bytes=spec.max_bytes,
        max_age=spec.max_age_s or None,
        duplicate_window=spec.duplicate_window_s,
        discard=DiscardPolicy.OLD if spec.discard == "old" else DiscardPolicy.NEW,
        description=spec.description or None,
    )


def server_list(url: str) -> list[str]:
    """``GPULAYER_NATS_URL`` may name several servers of one cluster, comma-separated."""
    servers = [u.strip() for u in url.split(",") if u.strip()]
    if not servers:
        raise ValueError(f"no NATS server URL in {url!r}")
    return servers


def tls_context(ca: str | None, cert: str | None, key: str | None) -> ssl.SSLContext | None:
    """A client TLS context: verify the server against ``ca`` (else the system's CAs), present
    ``cert``/``key`` when given. None when no TLS setting is given (``tls://`` URLs still
    get the system's default context from nats-py)."""
    if not (ca or cert or key):
        return None
    if bool(cert) != bool(key):
        raise ValueError("GPULAYER_NATS_TLS_CERT and GPULAYER_NATS_TLS_KEY go together")
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca or None)
    if cert and key:
        ctx.load_cert_chain(cert, key)
    return ctx


_REFUSALS = ("authorization violation", "authentication revoked", "authentication expired")


def refusal_note(err: BaseException | None, creds: str | None) -> str:
    """The words a log line adds to an error that is the server refusing this connection's
    credential ('Authorization Violation' at connect, 'User Authentication Revoked' or
    'Expired' on a live connection); "" for any other error. Pure."""
    if err is None:
        return ""
    # nats-py's own error for 'Authorization Violation' reads "nats: authorization failed".
    if not isinstance(err, nats.errors.AuthorizationError) and not any(
        r in str(err).lower() for r in _REFUSALS
    ):
        return ""
    if creds is None:
        return " (no credential given: a secured server refuses anonymous connections)"
    return (
        f" (the server refused the credential {creds}: revoked, expired, or not minted for "
        "this server's account; `gpulayer auth list` where the auth folder is says which)"
    )


class _Callbacks:
    """What a connection says of itself in the log (nats-py's callbacks)."""

    def __init__(self, creds: str | None) -> None:
        self.creds = creds
        self.nc: Client | None = None
        self.established = False

    def options(self) -> dict[str, object]:
        return {
            "error_cb": self.on_error,
            "disconnected_cb": self.on_disconnect,
            "reconnected_cb": self.on_reconnect,
            "closed_cb": self.on_closed,
        }

    async def on_error(self, err: Exception) -> None:
        log.warning("nats error: %s%s", err, refusal_note(err, self.creds))

    async def on_disconnect(self) -> None:
        # Also called on a deliberate close; a lost server shows up as errors and reconnects.
        log.info("nats disconnected")

    async def on_reconnect(self) -> None:
        log.info("nats reconnected")

    async def on_closed(self) -> None:
        # nats-py gives up on a connection for good after the -ERR a server closes it with when
        # its credential is revoked or expired, or refused at a reconnect, and reports that error
        # here, not to the error callback: said, since the service goes on without NATS (each
        # publish then fails with "connection closed" alone). A refusal at the first connect is
        # the caller's to report: connect raises it.
        if self.nc is None or not self.established:
            return
        if note := refusal_note(self.nc.last_error, self.creds):
            log.error("nats: connection closed for good: %s%s", self.nc.last_error, note)


async def connect(
    url: str,
    name: str,
    *,
    creds: str | None = None,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    inbox_prefix: str | None = None,
    **kwargs: object,
) -> Client:
    """Connect with reconnects forever: a NATS restart must not end a service. ``url``: one
    or more server URLs, comma-separated; ``creds``: a ``.creds`` file (NATS JWT auth);
    ``tls_*``: files for TLS; ``inbox_prefix``: this identity's reply subjects (its
    permissions let only it read there)."""
    callbacks = _Callbacks(creds)
    options: dict[str, object] = {
        "name": name,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.5,
        **callbacks.options(),
    }
    if creds:
        options["user_credentials"] = creds
        if inbox_prefix is None and (identity := identity_of(creds)) is not None:
            inbox_prefix = roles.inbox_prefix(*identity)
    if (ctx := tls_context(tls_ca, tls_cert, tls_key)) is not None:
        options["tls"] = ctx
    if inbox_prefix:
        options["inbox_prefix"] = inbox_prefix
    options.update(kwargs)
    nc = callbacks.nc = Client()
    try:
        await nc.connect(server_list(url), **options)  # type: ignore[arg-type]
        callbacks.established = True
    except BaseException:
        # nats-py leaves a refused connection's socket open (a ResourceWarning, and one fd
        # per failed try of a CLI that is told no).
        # Bounded: after a failed TLS handshake, close() waits for a reader that never ran.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(nc.close(), 2.0)
        raise
    return nc


async def let_go(nc: Client) -> None:
    """A service's last word to NATS: drain the connection (what it buffered is sent, what its
    subscriptions hold is handled) when it is connected, else close it. nats-py's ``drain``
    raises while the connection is reconnecting (the server stopped first, or restarting as the
    service stops): the service then exits cleanly, with a line saying what was not sent."""
    if nc.is_closed:
        return
    if nc.is_connected:
        try:
            await nc.drain()
            return
        except nats.errors.Error as err:
            log.warning("nats: could not drain the connection (%s); closing it", err)
    else:
        log.warning("nats: not connected as the service stops; anything unsent is dropped")
    with contextlib.suppress(Exception):
        await asyncio.wait_for(nc.close(), 5.0)


async def ensure_streams(
    js: JetStreamContext, *, replicas: int = 1, specs: Iterable[StreamSpec] = STREAMS
) -> None:
    """Create or update every gpulayer stream, with ``replicas`` copies each. Safe to call
    from every service at start. An existing stream with another config (an older version's,
    or another replica count) is updated in place: JetStream scales a stream's replicas up or
    down without losing its messages. ``specs``: placement's, with its retention settings."""
    for spec in specs:
        config = stream_config(spec, replicas=replicas)
        try:
            await js.add_stream(config)
        except BadRequestError:
            await js.update_stream(config)


async def wait_for_streams(
    js: JetStreamContext, names: list[str], *, poll_s: float = 0.5, timeout_s: float | None = None
) -> None:
    """Wait until placement has declared the streams ``names``: services other than placement
    have no right to create streams (docs/security.md). ``timeout_s`` None: wait forever."""
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    for name in names:
        warned = False
        while True:
            try:
                await js.stream_info(name)
                break
            except (NotFoundError, nats.errors.TimeoutError, ServiceUnavailableError):
                # Not declared yet; or, in a cluster, no JetStream leader for a moment (a
                # server of three just went away): ask again, never give up the start.
                if deadline is not None and loop.time() > deadline:
                    raise TimeoutError(
                        f"stream {name} does not exist (is placement running?)"
                    ) from None
                if not warned:
                    log.info("waiting for stream %s (placement declares it)", name)
                    warned = True
                await asyncio.sleep(poll_s)
