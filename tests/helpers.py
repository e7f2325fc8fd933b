"""Helpers shared by the end-to-end tests: services as processes, waiting for job events."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

from nats.aio.client import Client

from gpulayer_contracts.codec import event_decoder

BIN = Path(sys.executable).parent


def bin_path(name: str) -> str:
    return str(BIN / name)


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

    async def cb(msg: object) -> None:
        ev = event_decoder.decode(msg.data)  # type: ignore[attr-defined]
        if ev.job_id in seen:
            seen[ev.job_id].append(type(ev).__struct_config__.tag)
            if all(set(types) & terminal for types in seen.values()):
                done.set()

    sub = await nc.subscribe("gpulayer.job.*.events", cb=cb)
    try:
        await asyncio.wait_for(done.wait(), timeout)
    finally:
        await sub.unsubscribe()
    return seen
