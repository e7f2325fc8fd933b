"""Reading configuration from the environment. Only a service's ``__main__`` calls these."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import socket
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any

import msgspec

from gpulayer_contracts.version import __version__
from gpulayer_runtime.database import PassfileError, check_passfile, passfile_of
from gpulayer_runtime.logs import setup_logging
from gpulayer_runtime.stopping import Stopped

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
DEFAULT_DATABASE_URL = "postgresql://gpulayer@127.0.0.1:5432/gpulayer"


class ConfigError(ValueError):
    pass


def env_str(env: Mapping[str, str], name: str, default: str) -> str:
    value = env.get(name, "").strip()
    return value or default


def parse_number(
    raw: str, *, low: float = 0.0, high: float = math.inf, low_open: bool = True
) -> float:
    """``raw`` as a finite number from ``low`` (excluded when ``low_open``: above 0 by default)
    to ``high``; a ValueError saying what was expected otherwise.

    The one parser of numbers in settings and command-line options: ``float()`` alone takes
    ``nan``, ``inf`` and ``1e400`` (inf), which no setting means, and NaN slips through any
    check written as ``if value <= 0: reject``."""
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    above = value > low if low_open else value >= low
    if not (math.isfinite(value) and above and value <= high):
        raise ValueError(f"expected {_number_range(low, high, low_open)}")
    return value


def _number_range(low: float, high: float, low_open: bool) -> str:
    if math.isinf(high):
        return f"a number above {low:g}" if low_open else f"a number of {low:g} or more"
    if low_open:
        return f"a number above {low:g} and at most {high:g}"
    return f"a number from {low:g} to {high:g}"


def setting_number(
    name: str, raw: str, *, low: float = 0.0, high: float = math.inf, low_open: bool = True
) -> float:
    """``parse_number`` for the setting ``name``: a ConfigError naming it."""
    try:
        return parse_number(raw, low=low, high=high, low_open=low_open)
    except ValueError as err:
        raise ConfigError(f"{name}={raw[:40]!r}: {err}") from None


def env_float(
    env: Mapping[str, str],
    name: str,
    default: float,
    *,
    low: float = 0.0,
    high: float = math.inf,
    low_open: bool = True,
) -> float:
    """The number ``name`` sets (a positive one unless the bounds say otherwise), ``default``
    when unset."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    return setting_number(name, raw, low=low, high=high, low_open=low_open)


def number_option(
    *, low: float = 0.0, high: float = math.inf, low_open: bool = True
) -> Callable[[str], float]:
    """An argparse ``type`` for a number option (``--timeout``): ``parse_number`` with these
    bounds, a usage error naming the option otherwise."""

    def parse(raw: str) -> float:
        try:
            return parse_number(raw, low=low, high=high, low_open=low_open)
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"{raw[:40]!r}: {err}") from None

    return parse


def env_int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r}: expected an integer") from None
    if value <= 0:
        raise ConfigError(f"{name}={raw!r}: expected a positive integer")
    return value


def nats_url(env: Mapping[str, str] | None = None) -> str:
    return env_str(os.environ if env is None else env, "GPULAYER_NATS_URL", DEFAULT_NATS_URL)


class NatsSettings(msgspec.Struct, frozen=True, kw_only=True):
    """How to reach and log into NATS: passed to ``gpulayer_runtime.nats.connect``."""

    url: str = DEFAULT_NATS_URL
    creds: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    def connect_args(self) -> dict[str, str | None]:
        return {
            "creds": self.creds,
            "tls_ca": self.tls_ca,
            "tls_cert": self.tls_cert,
            "tls_key": self.tls_key,
        }


def _env_file(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(name, "").strip()
    if value and not os.path.isfile(value):
        raise ConfigError(f"{name}={value!r}: no such file")
    return value or None


def nats_settings(env: Mapping[str, str] | None = None) -> NatsSettings:
    """``GPULAYER_NATS_URL`` (comma-separated servers), ``GPULAYER_NATS_CREDS`` (a .creds
    file), ``GPULAYER_NATS_TLS_CA`` / ``_CERT`` / ``_KEY`` (PEM files)."""
    env = os.environ if env is None else env
    settings = NatsSettings(
        url=nats_url(env),
        creds=_env_file(env, "GPULAYER_NATS_CREDS"),
        tls_ca=_env_file(env, "GPULAYER_NATS_TLS_CA"),
        tls_cert=_env_file(env, "GPULAYER_NATS_TLS_CERT"),
        tls_key=_env_file(env, "GPULAYER_NATS_TLS_KEY"),
    )
    if bool(settings.tls_cert) != bool(settings.tls_key):
        raise ConfigError("GPULAYER_NATS_TLS_CERT and GPULAYER_NATS_TLS_KEY go together")
    return settings


# JetStream keeps at most 5 copies of a stream.
MAX_STREAM_REPLICAS = 5


def stream_replicas(env: Mapping[str, str] | None = None) -> int:
    """``GPULAYER_STREAM_REPLICAS``: copies of each stream (1 by default; 3 in a cluster of 3
    or more servers), from 1 to 5."""
    env = os.environ if env is None else env
    raw = env.get("GPULAYER_STREAM_REPLICAS", "").strip()
    if not raw:
        return 1
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_STREAM_REPLICAS:
        raise ConfigError(
            f"GPULAYER_STREAM_REPLICAS={raw!r}: expected a whole number from 1 to "
            f"{MAX_STREAM_REPLICAS}"
        )
    return int(raw)


def database_url(env: Mapping[str, str] | None = None) -> str:
    """``GPULAYER_DATABASE_URL``; ConfigError when the password file it would be read from is
    missing or open to others (libpq and asyncpg would skip it and fail as on a wrong
    password)."""
    env = os.environ if env is None else env
    url = env_str(env, "GPULAYER_DATABASE_URL", DEFAULT_DATABASE_URL)
    if (found := passfile_of(url, env)) is not None:
        try:
            check_passfile(*found)
        except PassfileError as err:
            raise ConfigError(f"GPULAYER_DATABASE_URL: {err}") from None
    return url


def default_node_id() -> str:
    """The host name up to its first dot (``gpu-01.example.com`` → ``gpu-01``), as Slurm names
    nodes: a node id is a NATS subject token and may not hold dots."""
    return socket.gethostname().split(".", 1)[0]


def node_id(env: Mapping[str, str] | None = None) -> str:
    value = env_str(os.environ if env is None else env, "GPULAYER_NODE_ID", default_node_id())
    # Node ids are NATS subject tokens.
    if any(c in value for c in ".*> \t"):
        raise ConfigError(f"GPULAYER_NODE_ID={value!r}: may not contain '.', '*', '>' or spaces")
    return value


def service_arguments(service: str, doc: str = "", argv: Sequence[str] | None = None) -> None:
    """A service's command line: ``--help`` and ``--version`` (``<service> <version>``), each
    printed and exit 0; anything else is a usage error naming it, exit 2. Settings are never
    options: they come from the environment alone, as under systemd or compose."""
    parser = argparse.ArgumentParser(
        prog=service,
        description=doc or None,
        epilog="Configured by GPULAYER_* environment variables only: see docs/operations.md.",
    )
    parser.add_argument("--version", action="version", version=f"{service} {__version__}")
    parser.parse_args(argv)


def run_service(
    service: str, amain: Callable[[], Coroutine[Any, Any, None]], doc: str = ""
) -> None:
    """A service's entry point: its command line (``service_arguments``: ``doc`` is what
    ``--help`` says it is), logging as ``GPULAYER_LOG_FORMAT`` says, then ``amain``. A bad
    setting (ConfigError, which names the variable) is one logged line and exit status 2; told
    to stop while still waiting to start (``stopping.Stopped``), one line and exit status 0."""
    service_arguments(service, doc)
    setup_logging(service, env_str(os.environ, "GPULAYER_LOG_FORMAT", "text"))
    try:
        asyncio.run(amain())
    except ConfigError as err:
        logging.getLogger(service.replace("-", "_")).error("configuration: %s", err)
        raise SystemExit(2) from None
    except Stopped as err:
        logging.getLogger(service.replace("-", "_")).info("stopped while waiting for %s", err)
