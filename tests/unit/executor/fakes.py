"""Fakes for building one executor part alone (unit tests only; integration tests use a real
NATS server)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import nats.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import PubAck

from gpulayer_contracts.events import Grant
from gpulayer_contracts.jobs import JobRequest
from gpulayer_contracts.subjects import MSG_ID_HEADER
from gpulayer_executor import state as st
from gpulayer_executor.cgroups import Hierarchy
from gpulayer_executor.env import RunAs
from gpulayer_executor.limits import JobLimits
from gpulayer_executor.output import LogSink
from gpulayer_executor.runner import OnStarted, StopRequest

NODE = "node-u"


def grant(
    grant_id: str,
    job_id: str | None = None,
    *,
    env: dict[str, str] | None = None,
    owner: str = "anonymous",
) -> Grant:
    return Grant(
        grant_id=grant_id,
        job=JobRequest(job_id=job_id or f"job-{grant_id}", command=["true"], env=env or {}),
        node_id=NODE,
        accelerator="cpu",
        owner=owner,
    )


class FakeJetStream:
    """Records what is published (subject, payload, Nats-Msg-Id); ``fail[subject]`` publishes
    on that subject raise first, as a NATS server that is away would make them."""

    def __init__(self) -> None:
        self.published: list[tuple[str, bytes, str]] = []
        self.attempts: dict[str, int] = {}
        self.fail: dict[str, int] = {}

    async def publish(
        self,
        subject: str,
        payload: bytes = b"",
        timeout: float | None = None,
        stream: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> PubAck:
        self.attempts[subject] = self.attempts.get(subject, 0) + 1
        if self.fail.get(subject, 0) > 0:
            self.fail[subject] -= 1
            raise nats.errors.ConnectionClosedError
        self.published.append((subject, payload, (headers or {})[MSG_ID_HEADER]))
        return PubAck(stream="S", seq=len(self.published))

    def msg_ids(self, subject: str) -> list[str]:
        return [msg_id for subj, _, msg_id in self.published if subj == subject]

    @property
    def js(self) -> JetStreamContext:
        return cast(JetStreamContext, self)

    @property
    def nc(self) -> Client:
        """The connection beside it, for plain publishes (recorded with no message id)."""
        fake = self

        class _Nats:
            async def publish(self, subject: str, payload: bytes = b"", **_: Any) -> None:
                fake.published.append((subject, payload, ""))

        return cast(Client, _Nats())


class FakeLaunch:
    """Stands in for ``runner.run_process``: each job 'runs' until ``finish`` is set or it is
    stopped, and ends as ``outcome`` (or as its stop request asks). Counts jobs running at once
    and records, for each spawn, the grant record's phase on disk at that moment."""

    def __init__(self, store: st.StateStore) -> None:
        self.store = store
        self.finish = asyncio.Event()
        self.spawned: list[str] = []
        self.phase_at_spawn: dict[str, str | None] = {}
        self.running = 0
        self.peak = 0
        self.outcome = st.Outcome(state="succeeded", exit_code=0)
        # What ``on_started`` is told: the job's end already known at its start (a short job
        # whose start and end the follower saw in one look).
        self.ended_at_start = False
        self.error: Exception | None = None

    async def __call__(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: Path,
        run_as: RunAs | None,
        timeout_s: float | None,
        kill_grace_s: float,
        stop: asyncio.Future[StopRequest],
        sink: LogSink,
        max_line_bytes: int,
        on_started: OnStarted,
        hierarchy: Hierarchy | None = None,
        limits: JobLimits | None = None,
    ) -> st.Outcome:
        grant_id = env["GPULAYER_GRANT_ID"]
        rec = self.store.load(grant_id)
        self.phase_at_spawn[grant_id] = rec.phase if rec else None
        self.spawned.append(grant_id)
        if self.error is not None:
            raise self.error
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            await on_started(st.ProcessInfo(pid=4242, pgid=4242), self.ended_at_start)
            finish = asyncio.ensure_future(self.finish.wait())
            either: set[asyncio.Future[Any]] = {finish, stop}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            finish.cancel()
            if stop.done():
                request = stop.result()
                return st.Outcome(state=request.state, reason=request.reason)
            return self.outcome
        finally:
            self.running -= 1


async def until(check: Callable[[], bool], timeout: float = 30.0) -> None:
    """Poll ``check`` until it is true: for counters of a fake, which nothing can wait on."""
    async with asyncio.timeout(timeout):
        while True:
            if check():
                return
            await asyncio.sleep(0.005)
