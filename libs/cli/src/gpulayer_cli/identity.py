"""Who the CLI is on NATS: its credentials (``GPULAYER_NATS_CREDS``, else the dev stack's user
credential under ``.gpulayer``), and the name it submits and asks the API as."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import msgspec

from gpulayer_contracts.subjects import ANONYMOUS
from gpulayer_runtime.auth import AuthStore, identity_of
from gpulayer_runtime.settings import NatsSettings, nats_settings

# The user `gpulayer dev up` mints for the person running it.
DEV_USER = "dev"
DEFAULT_DATA_DIR = Path(".gpulayer")


def auth_off(env: Mapping[str, str]) -> bool:
    """``GPULAYER_AUTH=off``: no credentials anywhere, every client may do everything."""
    return env.get("GPULAYER_AUTH", "").strip().lower() in ("off", "0", "false", "no")


def dev_store(data_dir: Path) -> AuthStore:
    return AuthStore(data_dir / "auth")


def cli_nats_settings(env: Mapping[str, str], data_dir: Path = DEFAULT_DATA_DIR) -> NatsSettings:
    """The NATS settings of the environment; without ``GPULAYER_NATS_CREDS``, the dev stack's
    user credential when ``gpulayer dev up`` made one here, so the CLI just works next to it."""
    settings = nats_settings(env)
    if settings.creds is None and not auth_off(env):
        dev = dev_store(data_dir).creds_path("user", DEV_USER)
        if dev.exists():
            settings = msgspec.structs.replace(settings, creds=str(dev))
    return settings


def whoami(settings: NatsSettings) -> str:
    """The owner and API caller name of these credentials: a user's, admin's or viewer's name
    (a viewer asks placement's API as itself too), else ``anonymous`` (no credentials: auth
    off; a node's, which may not ask at all)."""
    if settings.creds is None:
        return ANONYMOUS
    identity = identity_of(settings.creds)
    if identity is None or identity[0] not in ("user", "admin", "viewer"):
        return ANONYMOUS
    return identity[1]
