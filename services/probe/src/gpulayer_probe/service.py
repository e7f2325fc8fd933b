"""The probe service: publishes capabilities at start and a heartbeat in between."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import UTC, datetime

from nats.aio.client import Client

from gpulayer_contracts import Heartbeat, WorkerCapabilities, __version__, encode
from gpulayer_contracts.subjects import node_capabilities, node_heartbeat
from gpulayer_probe.host import detect_host

log = logging.getLogger(__name__)


def detect(node_id: str) -> WorkerCapabilities:
    return WorkerCapabilities(
        node_id=node_id,
        agent_version=__version__,
        detected_at=datetime.now(UTC),
        host=detect_host(),
        accelerators=[],
    )


async def serve(nc: Client, node_id: str, *, heartbeat_s: float, stop: asyncio.Event) -> None:
    js = nc.jetstream()
    caps = detect(node_id)
    await js.publish(node_capabilities(node_id), encode(caps))
    log.info("published capabilities for %s", node_id)
    while not stop.is_set():
        hb = Heartbeat(node_id=node_id, sent_at=datetime.now(UTC), agent_version=__version__)
        await nc.publish(node_heartbeat(node_id), encode(hb))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), heartbeat_s)
