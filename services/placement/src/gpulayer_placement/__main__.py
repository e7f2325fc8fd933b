"""``gpulayer-placement``: configuration is read here, from the environment, and nowhere deeper."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import os
import signal
from collections.abc import Iterator, Mapping
from contextlib import AsyncExitStack

from asyncpg import InsufficientPrivilegeError, InvalidAuthorizationSpecificationError

from gpulayer_contracts import InvalidInput
from gpulayer_contracts.profiles import Profiles, load_profiles
from gpulayer_contracts.subjects import (
    AUDIT_MAX_AGE_S,
    AUDIT_MAX_BYTES,
    streams_with_audit_retention,
)
from gpulayer_placement.settings import Settings
from gpulayer_runtime.database import redact
from gpulayer_runtime.nats import connect, ensure_streams, let_go
from gpulayer_runtime.settings import (
    ConfigError,
    database_url,
    env_float,
    env_int,
    env_str,
    nats_settings,
    run_service,
    setting_number,
    stream_replicas,
)
from gpulayer_runtime.signing import Signer, signer_from_env
from gpulayer_runtime.stopping import or_stop
from gpulayer_runtime.telemetry import setup_telemetry

log = logging.getLogger("gpulayer_placement")


async def _amain() -> None:
    from gpulayer_placement.service import PlacementService
    from gpulayer_placement.store import create_pool_when_up

    env = os.environ
    nats = nats_settings(env)
    db = database_url(env)
    replicas = stream_replicas(env)
    settings = read_settings(env)
    signer = signer_from_env(env)
    # The audit trail's retention: the oldest records go first past either bound.
    audit_days = env_float(env, "GPULAYER_AUDIT_MAX_AGE_DAYS", AUDIT_MAX_AGE_S / 86400)
    audit_bytes = env_int(env, "GPULAYER_AUDIT_MAX_BYTES", AUDIT_MAX_BYTES)
    streams = streams_with_audit_retention(audit_days * 86400, audit_bytes)
    _log_settings(nats, db, replicas, (audit_days, audit_bytes), settings, signer)
    telemetry = setup_telemetry("gpulayer-placement", env)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with AsyncExitStack() as stack:
        stack.callback(telemetry.shutdown)
        nc = await or_stop(
            connect(nats.url, "gpulayer-placement", **nats.connect_args()), stop, "NATS"
        )
        stack.push_async_callback(let_go, nc)
        await or_stop(
            ensure_streams(nc.jetstream(), replicas=replicas, specs=streams), stop, "its streams"
        )
        with _refused_as_setting(db):
            pool = await or_stop(create_pool_when_up(db), stop, "PostgreSQL")
            stack.push_async_callback(pool.close)
            service = PlacementService(nc, pool, settings, telemetry, signer=signer)
            await service.start()
        # The fleet's long-lived capability structs would otherwise be re-scanned by every
        # young-generation collection; freezing the start-up heap and collecting less often
        # keeps decoding cheap at 10,000 nodes.
        gc.freeze()
        gc.set_threshold(50_000, 20, 100)
        stack.push_async_callback(service.close)
        done = asyncio.create_task(service.stop.wait())
        signalled = asyncio.create_task(stop.wait())
        await asyncio.wait({done, signalled}, return_when=asyncio.FIRST_COMPLETED)
        if service.stop.is_set() and not stop.is_set():
            raise SystemExit("placement stopped after an internal failure (see log)")
        log.info("stopping")


def _log_settings(
    nats: object,
    db: str,
    replicas: int,
    audit: tuple[float, int],
    settings: Settings,
    signer: Signer | None,
) -> None:
    audit_days, audit_bytes = audit
    log.info(
        "settings: nats=%s database=%s stream_replicas=%d audit=%gd/%dB %s",
        nats,
        redact(db),
        replicas,
        audit_days,
        audit_bytes,
        dataclasses.replace(settings, profiles=Profiles(source=settings.profiles.source)),
    )
    log.info(
        "runtime profiles: %s",
        f"{len(settings.profiles.by_ref)} from {settings.profiles.source}"
        if settings.profiles.source
        else "none (GPULAYER_PROFILES unset): jobs naming a profile are rejected",
    )
    if signer is None:
        log.warning("grant signing is OFF: executors that require signatures refuse every grant")
    else:
        log.info("signing grants and cancels with key id %s", signer.key_id)


@contextlib.contextmanager
def _refused_as_setting(db: str) -> Iterator[None]:
    """PostgreSQL refusing who placement connects as (a password, a role without rights on the
    database) is about a setting: one line naming it, exit 2, no traceback."""
    try:
        yield
    except (InvalidAuthorizationSpecificationError, InsufficientPrivilegeError) as err:
        raise ConfigError(f"GPULAYER_DATABASE_URL ({redact(db)}): {err}") from None


def read_settings(env: Mapping[str, str]) -> Settings:
    """Placement's settings from the environment (ConfigError naming a bad one)."""
    return Settings(
        node_timeout_s=env_float(env, "GPULAYER_NODE_TIMEOUT_S", 15.0),
        resend_after_s=env_float(env, "GPULAYER_GRANT_RESEND_S", 30.0),
        batch_size=env_int(env, "GPULAYER_PLACEMENT_BATCH", 256),
        admins=admin_names(env_str(env, "GPULAYER_ADMINS", "admin")),
        profiles=_profiles(env_str(env, "GPULAYER_PROFILES", "")),
        rendezvous_ports=rendezvous_ports(env_str(env, "GPULAYER_RENDEZVOUS_PORTS", "29500-29999")),
        submit_rate=env_float(env, "GPULAYER_SUBMIT_RATE", 20.0),
        submit_burst=env_int(env, "GPULAYER_SUBMIT_BURST", 100),
        api_rate=env_float(env, "GPULAYER_API_RATE", 20.0),
        api_burst=env_int(env, "GPULAYER_API_BURST", 100),
        status_hold_s=status_hold(env_str(env, "GPULAYER_STATUS_HOLD_S", "0.05")),
    )


# Longer would leave a started job ``placed`` in the database for longer than a person notices.
MAX_STATUS_HOLD_S = 1.0


def status_hold(raw: str) -> float:
    """``GPULAYER_STATUS_HOLD_S``: seconds, 0 (no hold) to ``MAX_STATUS_HOLD_S``."""
    return setting_number("GPULAYER_STATUS_HOLD_S", raw, low_open=False, high=MAX_STATUS_HOLD_S)


def admin_names(raw: str) -> frozenset[str]:
    """``GPULAYER_ADMINS``: comma-separated identity names; a name NATS could not carry stops
    placement at start."""
    names = frozenset(n.strip() for n in raw.split(",") if n.strip())
    for name in names:
        if any(c in name for c in ".*> \t"):
            raise ConfigError(f"GPULAYER_ADMINS: {name[:40]!r} is not a valid identity name")
    return names


def rendezvous_ports(raw: str) -> tuple[int, int]:
    """``first-last``: the rendezvous ports placement may reserve for distributed jobs."""
    first, sep, last = raw.strip().partition("-")
    try:
        lo, hi = int(first), int(last if sep else first)
    except ValueError:
        raise ConfigError(f"GPULAYER_RENDEZVOUS_PORTS: {raw[:40]!r} is not FIRST-LAST") from None
    if not 1024 <= lo <= hi <= 65535:
        raise ConfigError(
            f"GPULAYER_RENDEZVOUS_PORTS: {raw[:40]!r}: want 1024 <= FIRST <= LAST <= 65535"
        )
    return lo, hi


def _profiles(path: str) -> Profiles:
    """The profiles file, read once: a change takes effect when placement restarts. A file that
    can't be read or checked stops placement at start, naming what is wrong."""
    if not path:
        return Profiles()
    try:
        return load_profiles(path)
    except InvalidInput as err:
        raise ConfigError(f"GPULAYER_PROFILES: {err}") from None


# What ``gpulayer-placement --help`` says it is.
DESCRIPTION = (
    "gpulayer's scheduler: takes submitted jobs, matches them to the fleet's nodes, signs "
    "and sends their grants and keeps their state in PostgreSQL. Replicas may run side by "
    "side."
)


def main() -> None:
    run_service("gpulayer-placement", _amain, DESCRIPTION)


if __name__ == "__main__":
    main()
