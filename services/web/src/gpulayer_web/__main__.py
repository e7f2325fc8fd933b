"""``gpulayer-web``: the fleet page. Configuration is read here, from the environment, and
nowhere deeper.

GPULAYER_NATS_URL, GPULAYER_NATS_CREDS (a viewer's credential: ``gpulayer auth add-viewer``; any
other role is refused), GPULAYER_WEB_HOST (127.0.0.1; see docs/security.md before binding
elsewhere), GPULAYER_WEB_PORT (8470; 0: any free port), GPULAYER_WEB_ALLOWED_HOSTS (the Host
names answered, comma-separated; default: the loopback names for a loopback bind, else any),
GPULAYER_WEB_REFRESH_S (2: how often placement is asked, once for all viewers, and how often a
page refreshes), GPULAYER_WEB_JOBS (1000: recent jobs kept), GPULAYER_LOG_FORMAT (text|json).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import signal
from collections.abc import Iterator, Mapping

import msgspec
import uvicorn
from nats.aio.client import Client

from gpulayer_contracts.subjects import ANONYMOUS
from gpulayer_runtime.auth import identity_of
from gpulayer_runtime.nats import connect, let_go, wait_for_streams
from gpulayer_runtime.settings import (
    ConfigError,
    NatsSettings,
    env_float,
    env_int,
    env_str,
    nats_settings,
    run_service,
)
from gpulayer_runtime.stopping import or_stop
from gpulayer_web.app import build_app
from gpulayer_web.cache import FleetCache
from gpulayer_web.reader import NatsReader

log = logging.getLogger("gpulayer_web")

DEFAULT_PORT = 8470
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1", "[::1]")


class WebSettings(msgspec.Struct, frozen=True, kw_only=True):
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    allowed_hosts: tuple[str, ...] = LOOPBACK_NAMES
    refresh_s: float = 2.0
    jobs: int = 1000


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_settings(env: Mapping[str, str]) -> tuple[NatsSettings, WebSettings]:
    """NATS and web settings from ``env``. Raises ConfigError on bad values."""
    host = env_str(env, "GPULAYER_WEB_HOST", "127.0.0.1")
    raw_port = env.get("GPULAYER_WEB_PORT", "").strip()
    if raw_port and not (raw_port.isdigit() and 0 <= int(raw_port) <= 65535):
        raise ConfigError(f"GPULAYER_WEB_PORT={raw_port!r}: expected a port from 0 to 65535")
    raw_hosts = env.get("GPULAYER_WEB_ALLOWED_HOSTS", "").strip()
    if raw_hosts:
        allowed = tuple(h.strip() for h in raw_hosts.split(",") if h.strip())
    else:
        allowed = LOOPBACK_NAMES if _is_loopback(host) else ("*",)
    web = WebSettings(
        host=host,
        port=int(raw_port) if raw_port else DEFAULT_PORT,
        allowed_hosts=allowed,
        refresh_s=env_float(env, "GPULAYER_WEB_REFRESH_S", 2.0),
        jobs=min(env_int(env, "GPULAYER_WEB_JOBS", 1000), 10_000),
    )
    return nats_settings(env), web


def caller_of(nats: NatsSettings) -> str:
    """The API caller the page asks as: its viewer name. A credential of another role is refused
    (the page must never hold one that can submit or cancel); without one (auth off) it asks as
    the anonymous caller."""
    if nats.creds is None:
        return ANONYMOUS
    identity = identity_of(nats.creds)
    if identity is None or identity[0] != "viewer":
        role = identity[0] if identity else "unknown"
        raise ConfigError(
            f"GPULAYER_NATS_CREDS={nats.creds}: its role is {role}; the web service takes only a "
            "read-only viewer's credential (`gpulayer auth add-viewer NAME`)"
        )
    return identity[1]


class _Server(uvicorn.Server):
    """Uvicorn without its own signal handling: this process stops it, then drains NATS."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def _feed(nc: Client, reader: NatsReader, cache: FleetCache) -> None:
    """Job events (to refresh early) and observations, once placement declared the streams (a
    viewer may not); the pages are served, and refreshed each interval, meanwhile."""
    await wait_for_streams(nc.jetstream(), ["JOB_EVENTS"])
    try:
        await reader.feed(cache)
        log.info("live feed on: every job's events, the nodes' observations")
    except Exception as err:  # the pages still refresh each interval without it
        log.error("no live feed (job events, observations): %r", err)


async def _amain() -> None:
    nats, web = read_settings(os.environ)
    caller = caller_of(nats)
    log.info("settings: nats=%s caller=%s %s", nats.url, caller, web)
    if caller == ANONYMOUS:
        log.warning("no credential: asking placement as the anonymous caller (auth off)")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    nc = await or_stop(
        connect(nats.url, f"gpulayer-web-{caller}", **nats.connect_args()), stop, "NATS"
    )
    reader = NatsReader(nc, caller)
    cache = FleetCache(reader.ask, reader.events, interval_s=web.refresh_s, jobs_limit=web.jobs)
    app = build_app(
        cache, allowed_hosts=list(web.allowed_hosts), refresh_ms=int(web.refresh_s * 1000)
    )
    config = uvicorn.Config(
        app, host=web.host, port=web.port, log_config=None, lifespan="off", access_log=False
    )
    server = _Server(config)
    try:
        cached = asyncio.create_task(cache.run(stop), name="cache")
        fed = asyncio.create_task(_feed(nc, reader, cache), name="feed")
        http = asyncio.create_task(server.serve(), name="http")
        stopped = asyncio.create_task(stop.wait(), name="stop")
        await asyncio.wait([http, stopped], return_when=asyncio.FIRST_COMPLETED)
        stop.set()
        server.should_exit = True
        fed.cancel()
        await asyncio.gather(cached, http, stopped, fed, return_exceptions=True)
    finally:
        await reader.close()
        await let_go(nc)
    log.info("stopped")


# What ``gpulayer-web --help`` says it is.
DESCRIPTION = "The fleet page: nodes and jobs as placement reports them, read-only, over HTTP."


def main() -> None:
    run_service("gpulayer-web", _amain, DESCRIPTION)


if __name__ == "__main__":
    main()
