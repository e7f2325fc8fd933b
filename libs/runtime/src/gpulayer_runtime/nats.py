"""NATS edges shared by every service: connecting, declaring the JetStream streams once."""

from __future__ import annotations

import logging

import nats
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError

from gpulayer_contracts.subjects import STREAMS, StreamSpec

log = logging.getLogger(__name__)

_RETENTION = {
    "limits": RetentionPolicy.LIMITS,
    "workqueue": RetentionPolicy.WORK_QUEUE,
    "interest": RetentionPolicy.INTEREST,
}


def stream_config(spec: StreamSpec, *, prefix: str = "") -> StreamConfig:
    return StreamConfig(
        name=prefix + spec.name,
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


async def connect(url: str, name: str, **kwargs: object) -> Client:
    """Connect with reconnects forever: a NATS restart must not end a service."""

    async def on_error(err: Exception) -> None:
        log.warning("nats error: %s", err)

    async def on_disconnect() -> None:
        # Also called on a deliberate close; a lost server shows up as errors and reconnects.
        log.info("nats disconnected")

    async def on_reconnect() -> None:
        log.info("nats reconnected")

    options: dict[str, object] = {
        "name": name,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.5,
        "error_cb": on_error,
        "disconnected_cb": on_disconnect,
        "reconnected_cb": on_reconnect,
    }
    options.update(kwargs)
    return await nats.connect(url, **options)


async def ensure_streams(js: JetStreamContext) -> None:
    """Create or update every gpulayer stream. Safe to call from every service at start."""
    for spec in STREAMS:
        config = stream_config(spec)
        try:
            await js.add_stream(config)
        except BadRequestError:
            # Exists with another config (an older version declared it): bring it up to date.
            await js.update_stream(config)
