"""Killing the executor process: jobs are reported exactly once and never started twice.

These run the executor without shims (``GPULAYER_EXECUTOR_SHIM=off``: the executor is its jobs'
parent, and a restart loses them); tests/faults/test_shim_restart.py has the default, where
jobs outlive their executor."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import BinaryIO

import msgspec
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from tests.helpers import pid_alive, reason, role_creds, signing_env
from tests.helpers import publish_grant as signed_grant

from gpulayer_contracts.codec import event_decoder, status_decoder
from gpulayer_contracts.events import AnyJobEvent, Grant, JobStatus, is_terminal
from gpulayer_contracts.jobs import JobRequest
from gpulayer_contracts.subjects import job_events, node_status
from gpulayer_executor import cgroups
from gpulayer_runtime.nats import ensure_streams

pytestmark = pytest.mark.integration

NODE = "node-f"
EXECUTOR = Path(sys.executable).parent / "gpulayer-executor"


def make_grant(command: list[str], timeout_s: float | None = None) -> Grant:
    return Grant(
        grant_id=f"g-{uuid.uuid4().hex[:12]}",
        job=JobRequest(job_id=f"job-{uuid.uuid4().hex[:10]}", command=command, timeout_s=timeout_s),
        node_id=NODE,
        accelerator="cpu",
    )


async def publish_grant(js: JetStreamContext, grant: Grant) -> None:
    await signed_grant(js, grant, NODE)


async def events_of(
    js: JetStreamContext, job_id: str, until: Callable[[AnyJobEvent], bool]
) -> list[AnyJobEvent]:
    sub = await js.subscribe(job_events(job_id), ordered_consumer=True)
    out: list[AnyJobEvent] = []
    try:
        async with asyncio.timeout(40):
            while True:
                event = event_decoder.decode((await sub.next_msg(timeout=40)).data)
                out.append(event)
                if until(event):
                    return out
    finally:
        await sub.unsubscribe()


async def all_events(js: JetStreamContext, job_id: str) -> list[str]:
    state = (await js.stream_info("JOB_EVENTS")).state
    out = []
    for seq in range(state.first_seq, state.last_seq + 1) if state.messages else ():
        msg = await js.get_msg("JOB_EVENTS", seq)
        if msg.subject == job_events(job_id) and msg.data:
            out.append(msgspec.json.decode(msg.data)["type"])
    return out


async def statuses(js: JetStreamContext, grant_id: str) -> list[JobStatus]:
    state = (await js.stream_info("STATUS")).state
    out = []
    for seq in range(state.first_seq, state.last_seq + 1) if state.messages else ():
        msg = await js.get_msg("STATUS", seq)
        if msg.subject == node_status(NODE) and msg.data:
            status = status_decoder.decode(msg.data)
            if status.grant_id == grant_id:
                out.append(status)
    return out


async def grants_consumed(js: JetStreamContext) -> None:
    async with asyncio.timeout(30):
        while True:
            info = await js.consumer_info("GRANTS", f"executor-{NODE}")
            if not info.num_pending and not info.num_ack_pending:
                return
            await asyncio.sleep(0.05)


def read_text(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


async def wait_for_file(path: Path) -> str:
    # Written by the job, outside NATS: polling with a deadline is the only way to see it.
    async with asyncio.timeout(30):
        while True:
            if text := read_text(path).strip():
                return text
            await asyncio.sleep(0.02)


class ExecutorProcess:
    def __init__(self, nats_url: str, workdir: Path, log: Path) -> None:
        self.env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(workdir),
            "GPULAYER_NATS_URL": nats_url,
            "GPULAYER_NODE_ID": NODE,
            "GPULAYER_EXECUTOR_WORKDIR": str(workdir),
            "GPULAYER_KILL_GRACE_S": "0.5",
            "GPULAYER_EXECUTOR_SHIM": "off",
            # Its jobs write into this test's private folders: as root, they run as root.
            "GPULAYER_EXECUTOR_ALLOW_ROOT_JOBS": "1",
            **signing_env(workdir.parent / "keys"),
        }
        if creds := role_creds("node", NODE):  # auth on: the node's own credential
            self.env["GPULAYER_NATS_CREDS"] = creds
        self.workdir = workdir
        self.log = log
        self.proc: asyncio.subprocess.Process | None = None

    def _open_log(self) -> BinaryIO:
        return open(self.log, "ab")  # handed to the child, closed in start()

    async def start(self, js: JetStreamContext) -> None:
        # Counted before the process exists: counted after it, a "serving" line the new process
        # already wrote (this test may be descheduled meanwhile) would be missed until timeout.
        served = read_text(self.log).count("serving")
        log = self._open_log()
        try:
            self.proc = await asyncio.create_subprocess_exec(
                str(EXECUTOR), env=self.env, stdout=log, stderr=log
            )
        finally:
            log.close()
        # The executor logs "serving" once reconciled and consuming: a process outside this
        # test's event loop, so its log is polled, with a deadline.
        async with asyncio.timeout(45):
            while True:
                text = read_text(self.log)
                if text.count("serving") > served:
                    return
                assert self.proc.returncode is None, text
                await asyncio.sleep(0.05)

    async def kill(self, sig: int) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        return await asyncio.wait_for(self.proc.wait(), 15)


@pytest.fixture
async def js(nc: Client) -> JetStreamContext:
    js = nc.jetstream()
    await ensure_streams(js)
    return js


@pytest.fixture
async def executor(nats_url: str, tmp_path: Path) -> AsyncIterator[ExecutorProcess]:
    ex = ExecutorProcess(nats_url, tmp_path / "wd", tmp_path / "executor.log")
    yield ex
    if ex.proc is not None and ex.proc.returncode is None:
        await ex.kill(signal.SIGKILL)


def job_dir(workdir: Path, grant: Grant) -> Path:
    return workdir / "jobs" / grant.grant_id


async def test_sigkill_while_running_then_restart_reports_lost_once_and_never_restarts(
    js: JetStreamContext, executor: ExecutorProcess, tmp_path: Path
) -> None:
    starts = tmp_path / "starts"
    grant = make_grant(
        ["sh", "-c", f'echo start >> "{starts}"; sleep 600 & echo $! > child.pid; wait']
    )
    await executor.start(js)
    await publish_grant(js, grant)
    await events_of(js, grant.job.job_id, lambda e: e.__struct_config__.tag == "running")
    child = int(await wait_for_file(job_dir(executor.workdir, grant) / "child.pid"))

    assert await executor.kill(signal.SIGKILL) == -signal.SIGKILL
    assert pid_alive(child)  # the job outlived its executor
    # The same grant again (a fresh Nats-Msg-Id, so JetStream does not drop it): waiting for
    # the restarted executor, which must recognise it.
    await publish_grant(js, grant)

    await executor.start(js)
    events = await events_of(js, grant.job.job_id, is_terminal)
    assert [e.__struct_config__.tag for e in events] == ["running", "lost"]
    assert reason(events[-1]) == "executor restarted"
    assert not pid_alive(child)
    # Its cgroup went with it (the executor is this process' child: same cgroups).
    found = cgroups.hierarchy(True)
    parents = found.parents if found is not None else []
    assert not [p for p in parents if (p / grant.grant_id).exists()]
    await grants_consumed(js)

    # One more restart: everything is settled, nothing is reported or started again.
    assert await executor.kill(signal.SIGTERM) == 0
    await executor.start(js)
    await grants_consumed(js)
    assert await executor.kill(signal.SIGTERM) == 0
    assert starts.read_text() == "start\n"
    assert await all_events(js, grant.job.job_id) == ["running", "lost"]
    assert [s.state for s in await statuses(js, grant.grant_id)] == ["running", "lost"]


async def test_graceful_stop_reports_running_jobs_lost_and_keeps_queued_ones(
    js: JetStreamContext, executor: ExecutorProcess, tmp_path: Path
) -> None:
    executor.env["GPULAYER_EXECUTOR_MAX_JOBS"] = "1"
    running = make_grant(["sleep", "600"])
    queued = make_grant(["sh", "-c", f'echo ran >> "{tmp_path / "queued"}"'])
    await executor.start(js)
    await publish_grant(js, running)
    await events_of(js, running.job.job_id, lambda e: e.__struct_config__.tag == "running")
    await publish_grant(js, queued)
    await grants_consumed(js)  # the queued grant is recorded and acked, waiting for a slot

    assert await executor.kill(signal.SIGTERM) == 0
    events = await events_of(js, running.job.job_id, is_terminal)
    assert events[-1].__struct_config__.tag == "lost"
    assert reason(events[-1]) == "executor stopped"
    assert await all_events(js, queued.job.job_id) == []

    await executor.start(js)
    events = await events_of(js, queued.job.job_id, is_terminal)
    assert [e.__struct_config__.tag for e in events] == ["running", "succeeded"]
    assert (tmp_path / "queued").read_text() == "ran\n"
