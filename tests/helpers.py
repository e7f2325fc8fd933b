"""Helpers shared by the end-to-end tests: services as processes, waiting for job events."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

from nats.aio.client import Client
from nats.aio.msg import Msg

from gpulayer_contracts.codec import event_decoder

BIN = Path(sys.executable).parent


def bin_path(name: str) -> str:
    return str(BIN / name)


def service_env(
    nats_url: str, database_url: str, workdir: Path, node_id: str, **extra: str
) -> dict[str, str]:
    """This process' environment plus what the three services need to form one node's stack."""
    env = dict(os.environ)
    env.update(
        GPULAYER_NATS_URL=nats_url,
        GPULAYER_DATABASE_URL=database_url,
        GPULAYER_NODE_ID=node_id,
        GPULAYER_EXECUTOR_WORKDIR=str(workdir),
        GPULAYER_HEARTBEAT_S="1",
        # These stacks' jobs run this interpreter and write into the test's own (private)
        # folders, which a job user can't reach: as root, jobs run as root here. Jobs running
        # unprivileged are tested in tests/integration/test_executor_unprivileged.py.
        GPULAYER_EXECUTOR_ALLOW_ROOT_JOBS="1",
    )
    env.update(extra)
    return env


def reason(event: object) -> str | None:
    """An event's ``reason``, checked to be a string when present."""
    value = getattr(event, "reason", None)
    assert value is None or isinstance(value, str)
    return value


def pid_alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


class Services:
    """Service processes of one test; ``async with`` stops them however the test ends."""

    def __init__(self) -> None:
        self.procs: dict[str, asyncio.subprocess.Process] = {}

    async def __aenter__(self) -> Services:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(
        self, name: str, env: dict[str, str], log: Path, key: str | None = None
    ) -> None:
        """Start console script ``name``; ``key`` names it when one script runs several times."""
        with log.open("ab") as out:
            self.procs[key or name] = await asyncio.create_subprocess_exec(
                bin_path(name), env=env, stdout=out, stderr=asyncio.subprocess.STDOUT
            )

    async def stop(self) -> None:
        for proc in self.procs.values():
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def events_until(
    nc: Client, job_ids: set[str], timeout: float = 30.0
) -> dict[str, list[str]]:
    """Every event type per job until each job reaches a terminal event."""
    seen: dict[str, list[str]] = {j: [] for j in job_ids}
    done = asyncio.Event()
    terminal = {"rejected", "succeeded", "failed", "cancelled", "lost"}

    async def cb(msg: Msg) -> None:
        ev = event_decoder.decode(msg.data)
        if ev.job_id in seen:
            seen[ev.job_id].append(str(type(ev).__struct_config__.tag))
            if all(set(types) & terminal for types in seen.values()):
                done.set()

    sub = await nc.subscribe("gpulayer.job.*.events", cb=cb)
    try:
        await asyncio.wait_for(done.wait(), timeout)
    finally:
        await sub.unsubscribe()
    return seen
