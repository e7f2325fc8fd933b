"""Jobs outlive their executor (each runs under its shim): SIGKILL the executor while a job
runs, start it again, and the job ends exactly once, with every line it printed stored once, in
order; a cancel sent while the executor is down is applied once it is back; a job that ended
while it was down is reported with its real outcome; a timeout counts from the job's start."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from tests.faults.test_executor_restart import (
    NODE,
    ExecutorProcess,
    all_events,
    events_of,
    job_dir,
    make_grant,
    publish_grant,
    wait_for_file,
)
from tests.helpers import pid_alive, publish_cancel, reason

from gpulayer_contracts.events import CancelJob, Grant, is_terminal
from gpulayer_contracts.subjects import job_logs
from gpulayer_executor.shim import read_status
from gpulayer_runtime.nats import ensure_streams

pytestmark = pytest.mark.integration


@pytest.fixture
async def js(nc: Client) -> JetStreamContext:
    js = nc.jetstream()
    await ensure_streams(js)
    return js


@pytest.fixture
async def shim_executor(nats_url: str, tmp_path: Path) -> AsyncIterator[ExecutorProcess]:
    ex = ExecutorProcess(nats_url, tmp_path / "wd", tmp_path / "executor.log")
    ex.env.pop("GPULAYER_EXECUTOR_SHIM", None)  # the default: on
    yield ex
    if ex.proc is not None and ex.proc.returncode is None:
        await ex.kill(signal.SIGKILL)


def printer(lines: int, every_s: float, then: str = "") -> list[str]:
    """A job printing ``0`` .. ``lines - 1``, one every ``every_s``, then running ``then``."""
    code = (
        "import sys, time, os\n"
        f"open('pid', 'w').write(str(os.getpid()))\n"
        f"for i in range({lines}):\n"
        "    print(i, flush=True)\n"
        f"    time.sleep({every_s})\n"
        f"{then}\n"
    )
    return [sys.executable, "-c", code]


async def log_lines(js: JetStreamContext, grant: Grant) -> list[str]:
    """Every line stored for the job, in stream order (what ``gpulayer logs`` prints)."""
    subject = job_logs(grant.job.job_id)
    state = (await js.stream_info("LOGS")).state
    out = []
    for seq in range(state.first_seq, state.last_seq + 1) if state.messages else ():
        msg = await js.get_msg("LOGS", seq)
        if msg.subject == subject and msg.data:
            out.append(msgspec.json.decode(msg.data)["line"])
    return out


async def wait_for_line(js: JetStreamContext, grant: Grant, line: str) -> None:
    sub = await js.subscribe(job_logs(grant.job.job_id), ordered_consumer=True)
    try:
        async with asyncio.timeout(30):
            while True:
                msg = await sub.next_msg(timeout=30)
                if msgspec.json.decode(msg.data)["line"] == line:
                    return
    finally:
        await sub.unsubscribe()


async def test_a_30s_job_survives_its_executor_killed_at_5s(
    js: JetStreamContext, shim_executor: ExecutorProcess
) -> None:
    ex = shim_executor
    grant = make_grant(printer(300, 0.1))  # 30 s
    await ex.start(js)
    await publish_grant(js, grant)
    await wait_for_line(js, grant, "50")  # about 5 s in
    pid = int(await wait_for_file(job_dir(ex.workdir, grant) / "pid"))

    assert await ex.kill(signal.SIGKILL) == -signal.SIGKILL
    assert pid_alive(pid)
    await ex.start(js)
    events = await events_of(js, grant.job.job_id, is_terminal)
    assert [e.__struct_config__.tag for e in events] == ["running", "succeeded"]
    assert not pid_alive(pid)
    assert await log_lines(js, grant) == [str(i) for i in range(300)]
    assert await all_events(js, grant.job.job_id) == ["running", "succeeded"]


async def test_a_cancel_sent_while_the_executor_is_down_is_applied_when_it_is_back(
    js: JetStreamContext, shim_executor: ExecutorProcess
) -> None:
    ex = shim_executor
    grant = make_grant(printer(100_000, 0.05))
    await ex.start(js)
    await publish_grant(js, grant)
    await wait_for_line(js, grant, "5")
    pid = int(await wait_for_file(job_dir(ex.workdir, grant) / "pid"))
    assert await ex.kill(signal.SIGKILL) == -signal.SIGKILL

    cancel = CancelJob(job_id=grant.job.job_id, reason="user changed their mind")
    await publish_cancel(js, NODE, msgspec.structs.replace(cancel, grant_id=grant.grant_id))
    assert pid_alive(pid)  # nobody applies it while the executor is down
    await ex.start(js)
    events = await events_of(js, grant.job.job_id, is_terminal)
    assert [e.__struct_config__.tag for e in events] == ["running", "cancelled"]
    assert reason(events[-1]) == "user changed their mind"
    assert not pid_alive(pid)
    lines = await log_lines(js, grant)
    assert lines == [str(i) for i in range(len(lines))]  # each once, in order, none skipped
    assert await all_events(js, grant.job.job_id) == ["running", "cancelled"]


async def test_a_job_that_ends_while_the_executor_is_down_is_reported_as_it_ended(
    js: JetStreamContext, shim_executor: ExecutorProcess, tmp_path: Path
) -> None:
    ex = shim_executor
    go = tmp_path / "go"
    wait_go = f"while not os.path.exists({str(go)!r}): time.sleep(0.02)\nprint('end')\nsys.exit(3)"
    grant = make_grant(printer(20, 0.01, then=wait_go))
    await ex.start(js)
    await publish_grant(js, grant)
    await wait_for_line(js, grant, "19")
    pid = int(await wait_for_file(job_dir(ex.workdir, grant) / "pid"))
    assert await ex.kill(signal.SIGKILL) == -signal.SIGKILL

    go.touch()
    async with asyncio.timeout(30):  # another process: polled, with a deadline
        while True:
            if not pid_alive(pid):
                break
            await asyncio.sleep(0.02)
    await ex.start(js)
    events = await events_of(js, grant.job.job_id, is_terminal)
    assert [e.__struct_config__.tag for e in events] == ["running", "failed"]
    assert reason(events[-1]) == "exit code 3"
    assert await log_lines(js, grant) == [*map(str, range(20)), "end"]


async def test_a_timeout_counts_from_the_jobs_start_across_a_restart(
    js: JetStreamContext, shim_executor: ExecutorProcess
) -> None:
    ex = shim_executor
    grant = make_grant(printer(100_000, 0.05), timeout_s=4.0)
    await ex.start(js)
    await publish_grant(js, grant)
    await wait_for_line(js, grant, "1")
    assert await ex.kill(signal.SIGKILL) == -signal.SIGKILL
    await ex.start(js)
    events = await events_of(js, grant.job.job_id, is_terminal)
    assert [e.__struct_config__.tag for e in events] == ["running", "failed"]
    assert reason(events[-1]) == "timeout"
    ran = (events[-1].at - events[0].at).total_seconds()
    # Counted afresh after the restart, it would have run for the restart's time plus 4 s.
    assert 4.0 <= ran < 4.0 + 0.5 + 3.0, ran


async def test_a_job_whose_shim_is_killed_is_lost_and_killed(
    js: JetStreamContext, shim_executor: ExecutorProcess
) -> None:
    """Only a shim that is gone makes a job lost; what is left of the job is killed then, so
    that it never runs on unsupervised on GPUs given to other jobs."""
    ex = shim_executor
    grant = make_grant(printer(100_000, 0.05))
    await ex.start(js)
    await publish_grant(js, grant)
    await wait_for_line(js, grant, "2")
    pid = int(await wait_for_file(job_dir(ex.workdir, grant) / "pid"))
    shim = read_status(ex.workdir / "run" / grant.grant_id).shim
    assert shim is not None
    os.kill(shim.pid, signal.SIGKILL)
    events = await events_of(js, grant.job.job_id, is_terminal)
    assert [e.__struct_config__.tag for e in events] == ["running", "lost"]
    assert reason(events[-1]) == "the job's shim died"
    assert not pid_alive(pid)  # killed before the loss was reported
    assert ex.proc is not None
    assert ex.proc.returncode is None  # the executor itself goes on
