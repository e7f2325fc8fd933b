"""Jobs that leave processes behind holding their output pipes: the executor follows the job's
own process, kills what it left (escaped with ``setsid`` or not) and reports what the job did.

Each test runs with each way of finding the job's processes: its cgroup v2, its cgroup v1
``pids`` (each skipped where not writable) and the fallback that walks /proc for the job's
``GPULAYER_GRANT_ID``."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from tests.helpers import (
    TEST_PUBLIC_KEYS,
    connect_args,
    pid_alive,
    publish_cancel,
    reason,
    running_executor,
)
from tests.integration.test_executor import (
    NODE,
    job_events_until_terminal,
    make_grant,
    publish_grant,
    reported,
    statuses,
    wait_for_file,
)

from gpulayer_contracts.events import AnyJobEvent, CancelJob
from gpulayer_contracts.jobenv import base_environment
from gpulayer_executor import cgroups
from gpulayer_executor.service import Executor, ExecutorConfig
from gpulayer_runtime.nats import ensure_streams

pytestmark = pytest.mark.integration

GRACE_S = 0.5
# The child prints its pid, then holds the job's stdout and stderr for longer than any test.
SETSID_CHILD = "setsid sleep 60 & echo $! > child.pid"
PLAIN_CHILD = "sleep 25 & echo $! > child.pid"


@pytest.fixture(params=["cgroup-v2", "cgroup-v1-pids", "proc-walk"])
def mechanism(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which way the executor finds the job's processes (``cgroups.hierarchy`` picks one per
    process; here each is forced in turn)."""
    found: cgroups.Hierarchy | None = None
    if request.param != "proc-walk":
        choose = cgroups.v2_hierarchy if request.param == "cgroup-v2" else cgroups.v1_pids_hierarchy
        found, why = choose()
        if found is None:
            pytest.skip(f"not on this machine: {why}")
    monkeypatch.setattr(cgroups, "hierarchy", lambda enforce=True: found)
    return str(request.param)


@pytest.fixture
async def js(nc: Client) -> JetStreamContext:
    js = nc.jetstream()
    await ensure_streams(js)
    return js


@pytest.fixture
async def executor(
    nc: Client, js: JetStreamContext, tmp_path: Path, mechanism: str
) -> AsyncIterator[Executor]:
    config = ExecutorConfig(
        node_id=NODE,
        workdir=tmp_path / "executor",
        base_env=base_environment(os.environ, user="tester", home=str(tmp_path)),
        kill_grace_s=GRACE_S,
        fetch_timeout_s=0.2,
        placement_public_keys=TEST_PUBLIC_KEYS,
    )
    async with running_executor(nc, config) as ex:
        yield ex


async def run_until_child(
    js: JetStreamContext, executor: Executor, script: str, timeout_s: float | None = None
) -> tuple[asyncio.Task[list[AnyJobEvent]], int, str]:
    """Publish the job; return the task awaiting its terminal event, its child's pid and its
    grant id once the child is there."""
    grant = make_grant(["sh", "-c", script], timeout_s=timeout_s)
    events = asyncio.create_task(job_events_until_terminal(js, grant.job.job_id))
    await publish_grant(js, grant)
    child = int(await wait_for_file(executor.store.job_dir(grant.grant_id) / "child.pid"))
    return events, child, grant.grant_id


@pytest.mark.parametrize("child", [SETSID_CHILD, PLAIN_CHILD], ids=["setsid", "plain"])
async def test_a_job_that_exits_0_leaving_a_child_succeeds_at_once(
    js: JetStreamContext, executor: Executor, child: str
) -> None:
    events, pid, _ = await run_until_child(js, executor, f"{child}; exit 0")
    t0 = time.monotonic()
    done = await events
    # Not waiting for the child (it sleeps 25 or 60 s): a bound well below that, whatever the
    # machine's load (the suite runs in parallel), not a latency figure.
    assert time.monotonic() - t0 < 15.0
    assert [e.__struct_config__.tag for e in done] == ["running", "succeeded"]
    # Killed before the report went out, not merely soon after.
    assert not pid_alive(pid)


@pytest.mark.parametrize("child", [SETSID_CHILD, PLAIN_CHILD], ids=["setsid", "plain"])
async def test_cancel_frees_the_job_and_kills_its_escaped_child(
    js: JetStreamContext, executor: Executor, child: str
) -> None:
    events, pid, grant_id = await run_until_child(js, executor, f"{child}; exec sleep 60")
    job_id = executor.store.load(grant_id).job_id  # type: ignore[union-attr]
    t0 = time.monotonic()
    await publish_cancel(js, NODE, CancelJob(job_id=job_id, reason="user asked", grant_id=grant_id))
    done = await events
    # SIGTERM ends both here, long before the job's own 60 s (the bound leaves room for a
    # loaded machine: it tells a cancel that worked from one that waited, not a latency).
    assert time.monotonic() - t0 < 30.0
    assert [e.__struct_config__.tag for e in done] == ["running", "cancelled"]
    assert reason(done[-1]) == "user asked"
    assert not pid_alive(pid)
    grant = executor.store.load(grant_id)
    assert grant is not None
    await reported(executor, grant.grant)
    assert [s.state for s in await statuses(js)] == ["running", "cancelled"]


async def test_timeout_kills_an_escaped_child_that_ignores_sigterm(
    js: JetStreamContext, executor: Executor
) -> None:
    # The escaped child ignores SIGTERM: only the SIGKILL after the grace ends it.
    script = (
        "setsid sh -c 'trap \"\" TERM; echo $$ > child.pid; while :; do sleep 0.1; done' & "
        "exec sleep 60"
    )
    events, pid, _ = await run_until_child(js, executor, script, timeout_s=1.0)
    t0 = time.monotonic()
    done = await events
    # The timeout (1 s) and the grace (0.5 s) end it, not the job's own 60 s; room for load.
    assert time.monotonic() - t0 < 30.0
    assert [e.__struct_config__.tag for e in done] == ["running", "failed"]
    assert reason(done[-1]) == "timeout"
    assert not pid_alive(pid)


async def test_last_lines_before_exit_are_kept_despite_a_child_holding_the_pipe(
    nats_url: str, js: JetStreamContext, executor: Executor
) -> None:
    import io

    from gpulayer_cli.logs import run_logs

    events, _, grant_id = await run_until_child(
        js, executor, f"{SETSID_CHILD}; seq 1 2000; echo last words >&2"
    )
    assert (await events)[-1].__struct_config__.tag == "succeeded"
    grant = executor.store.load(grant_id)
    assert grant is not None
    out = io.StringIO()
    assert (
        await run_logs(nats_url, grant.job_id, follow=False, out=out, connect_args=connect_args())
        == 0
    )
    lines = out.getvalue().splitlines()
    assert "last words" in lines
    assert [line for line in lines if line != "last words"] == [str(i) for i in range(1, 2001)]
