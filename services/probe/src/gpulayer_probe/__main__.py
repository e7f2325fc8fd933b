"""``gpulayer-probe``: configuration is read here, from the environment, and nowhere deeper.

GPULAYER_NATS_URL, GPULAYER_NODE_ID (default: hostname), GPULAYER_WORKLOAD_PYTHON (default: this
interpreter), GPULAYER_PROBE_REFRESH_S (60), GPULAYER_PROBE_REPUBLISH_S (600),
GPULAYER_HEARTBEAT_S (5), GPULAYER_PROBE_TIMEOUT_S
(10, each source), GPULAYER_PROBE_TORCH_TIMEOUT_S (60), GPULAYER_ADVERTISE_ADDRESS (an IP address or host name;
default: detected), GPULAYER_PROBE_OBSERVE_S (5), GPULAYER_PROBE_RECOVER_AFTER (3
clean observations before a device is healthy again), GPULAYER_PROBE_HOST_ROOT (/: where the
host's /proc, /sys, /dev and /usr/lib/wsl are read), GPULAYER_PROBE_DEVICE_DIR (the host root's
/dev),
GPULAYER_PROBE_PODMAN (podman: the container runtime looked for, a name on PATH or a path; none: don't
look), GPULAYER_OCI_RUNTIME (what podman starts containers with; default runc when installed),
GPULAYER_PROBE_CONTAINER_TEST_S (20, the container self-test's bound),
GPULAYER_LOG_FORMAT (text|json).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Mapping

from gpulayer_contracts.bounds import address_error
from gpulayer_detection.base import under_root
from gpulayer_detection.containers import ContainerSettings, settings_from_env
from gpulayer_detection.registry import host_root_from_env
from gpulayer_probe.service import ProbeService, ProbeSettings
from gpulayer_runtime.nats import connect, let_go, wait_for_streams
from gpulayer_runtime.settings import (
    ConfigError,
    NatsSettings,
    env_float,
    env_int,
    env_str,
    nats_settings,
    node_id,
    run_service,
)
from gpulayer_runtime.stopping import or_stop
from gpulayer_runtime.telemetry import setup_telemetry

log = logging.getLogger("gpulayer_probe")


def advertise_address(env: Mapping[str, str]) -> str | None:
    """GPULAYER_ADVERTISE_ADDRESS (an IP address or a host name), or None: detected."""
    value = env.get("GPULAYER_ADVERTISE_ADDRESS", "").strip()
    if not value:
        return None
    error = address_error(value, "GPULAYER_ADVERTISE_ADDRESS")
    if error:
        raise ConfigError(error)
    return value


def container_settings(env: Mapping[str, str]) -> ContainerSettings:
    """GPULAYER_PROBE_PODMAN, GPULAYER_OCI_RUNTIME and GPULAYER_PROBE_CONTAINER_TEST_S."""
    try:
        return settings_from_env(env)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def host_root(env: Mapping[str, str]) -> str:
    """GPULAYER_PROBE_HOST_ROOT: an absolute path to a folder, default ``/``."""
    try:
        return host_root_from_env(env)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def read_settings(env: Mapping[str, str]) -> tuple[NatsSettings, str, ProbeSettings]:
    """NATS settings, node id and probe settings from ``env``. Raises ConfigError on bad
    values."""
    root = host_root(env)
    settings = ProbeSettings(
        python=env_str(env, "GPULAYER_WORKLOAD_PYTHON", sys.executable),
        refresh_s=env_float(env, "GPULAYER_PROBE_REFRESH_S", 60.0),
        republish_s=env_float(env, "GPULAYER_PROBE_REPUBLISH_S", 600.0),
        heartbeat_s=env_float(env, "GPULAYER_HEARTBEAT_S", 5.0),
        timeout=env_float(env, "GPULAYER_PROBE_TIMEOUT_S", 10.0),
        torch_timeout=env_float(env, "GPULAYER_PROBE_TORCH_TIMEOUT_S", 60.0),
        advertise_address=advertise_address(env),
        observe_s=env_float(env, "GPULAYER_PROBE_OBSERVE_S", 5.0),
        recover_after=env_int(env, "GPULAYER_PROBE_RECOVER_AFTER", 3),
        dev_dir=env_str(env, "GPULAYER_PROBE_DEVICE_DIR", under_root(root, "/dev")),
        host_root=root,
        containers=container_settings(env),
        doctor_rate=env_float(env, "GPULAYER_DOCTOR_RATE", 0.2),
        doctor_burst=env_int(env, "GPULAYER_DOCTOR_BURST", 3),
    )
    return nats_settings(env), node_id(env), settings


async def _amain() -> None:
    nats, node, settings = read_settings(os.environ)
    log.info("settings: nats=%s node=%s %s", nats, node, settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    telemetry = setup_telemetry("gpulayer-probe", os.environ)
    nc = await or_stop(
        connect(nats.url, f"gpulayer-probe-{node}", **nats.connect_args()), stop, "NATS"
    )
    try:
        # Placement declares the streams; a node's credential may not (docs/security.md).
        await or_stop(wait_for_streams(nc.jetstream(), ["NODES"]), stop, "stream NODES")
        await ProbeService(nc, node, settings, telemetry=telemetry).run(stop)
    finally:
        await let_go(nc)
        telemetry.shutdown()
    log.info("stopped")


# What ``gpulayer-probe --help`` says it is.
DESCRIPTION = (
    "Detects this node's accelerators, frameworks and container runtime and publishes them, "
    "its heartbeats and its devices' health."
)


def main() -> None:
    run_service("gpulayer-probe", _amain, DESCRIPTION)


if __name__ == "__main__":
    main()
