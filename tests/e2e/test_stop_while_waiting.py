"""Every service told to stop (SIGTERM) while it still waits for NATS stops at once, exit 0,
saying so: it used to wait there deaf to the signal, so that ``systemctl stop`` or ``restart``
of a node whose NATS was unreachable, or that refused its certificate or credential, took the
90 s until systemd's SIGKILL."""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from pathlib import Path

import pytest
from tests.helpers import bin_path, service_env

pytestmark = pytest.mark.e2e


def unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def said(log: Path) -> str:
    return log.read_text(errors="replace")


async def until_in(log: Path, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in said(log):
        if time.monotonic() > deadline:
            raise AssertionError(f"no {text!r} in {log} after {timeout} s:\n{said(log)}")
        await asyncio.sleep(0.1)


@pytest.mark.parametrize(
    "service", ["gpulayer-placement", "gpulayer-probe", "gpulayer-executor", "gpulayer-web"]
)
async def test_a_service_waiting_for_nats_stops_on_sigterm(service: str, tmp_path: Path) -> None:
    # Nothing listens there: the service retries forever, as against a server that is down.
    url = f"nats://127.0.0.1:{unused_port()}"
    env = service_env(url, "postgresql://nobody@127.0.0.1:1/none", tmp_path / "work", "stopper")
    env.update(GPULAYER_PROBE_PODMAN="none", GPULAYER_WEB_PORT="0")
    if service == "gpulayer-web":
        env.pop("GPULAYER_NATS_CREDS", None)  # the fleet page takes a viewer's or none
    log = tmp_path / "service.log"
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            bin_path(service), env=env, stdout=out, stderr=asyncio.subprocess.STDOUT
        )
    try:
        await until_in(log, "nats error", 30)  # in the connect loop
        proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        assert await asyncio.wait_for(proc.wait(), 10) == 0, said(log)
        assert time.monotonic() - started < 5
        assert "stopped while waiting for NATS" in said(log)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
