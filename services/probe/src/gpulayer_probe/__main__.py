"""``gpulayer-probe``: configuration is read here, from the environment, and nowhere deeper."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

from gpulayer_runtime.logs import setup_logging
from gpulayer_runtime.nats import connect, ensure_streams
from gpulayer_runtime.settings import env_float, env_str, nats_url, node_id

log = logging.getLogger("gpulayer_probe")


async def _amain() -> None:
    env = os.environ
    url = nats_url(env)
    node = node_id(env)
    heartbeat_s = env_float(env, "GPULAYER_HEARTBEAT_S", 5.0)
    log.info("settings: nats=%s node=%s heartbeat_s=%s", url, node, heartbeat_s)
    from gpulayer_probe.service import serve

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    nc = await connect(url, f"gpulayer-probe-{node}")
    try:
        await ensure_streams(nc.jetstream())
        await serve(nc, node, heartbeat_s=heartbeat_s, stop=stop)
    finally:
        await nc.drain()


def main() -> None:
    setup_logging("gpulayer-probe", env_str(os.environ, "GPULAYER_LOG_FORMAT", "text"))
    asyncio.run(_amain())


if __name__ == "__main__":
    main()
