"""Ranks of a distributed job on two real executors (two node ids, two work folders) against a
real NATS server, given signed grants by hand (no placement): torchrun with a static rendezvous,
gloo, and torch 2.13.0 CPU in a real workload venv (tests/workload.py)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import socket
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from tests.helpers import (
    TEST_PUBLIC_KEYS,
    connect_args,
    pid_alive,
    publish_cancel,
    publish_grant,
    running_executor,
)
from tests.workload import ALL_REDUCE, Workload, all_reduce_sum

from gpulayer_cli.logs import run_logs
from gpulayer_contracts.codec import event_decoder
from gpulayer_contracts.events import AnyJobEvent, CancelJob, GangRank, Grant, is_terminal
from gpulayer_contracts.jobenv import base_environment
from gpulayer_contracts.jobs import Distributed, JobRequest, rank_job_id
from gpulayer_contracts.subjects import job_events
from gpulayer_executor.service import Executor, ExecutorConfig
from gpulayer_runtime.nats import ensure_streams

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

NODES = ("node-a", "node-b")
DIST = Distributed(nodes=2, processes_per_node=2, backend="gloo", launcher="torchrun")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_grants(job_id: str, command: list[str], env: dict[str, str]) -> list[Grant]:
    """Placement's grants for the 2 ranks of ``job_id``: rank 0 on node-a hosts the rendezvous."""
    port = free_port()
    grants = []
    for rank, node in enumerate(NODES):
        job = JobRequest(
            job_id=rank_job_id(job_id, rank), command=command, env=env, distributed=DIST
        )
        gang = GangRank(
            job_id=job_id,
            rank=rank,
            nnodes=DIST.nodes,
            nproc_per_node=DIST.processes_per_node,
            master_addr="127.0.0.1",
            master_port=port,
        )
        grants.append(
            Grant(
                grant_id=f"g-{uuid.uuid4().hex[:12]}",
                job=job,
                node_id=node,
                accelerator="cpu",
                gang=gang,
            )
        )
    return grants


@contextlib.asynccontextmanager
async def two_executors(
    nc: Client, tmp_path: Path, workload: Workload
) -> AsyncIterator[dict[str, Executor]]:
    base = base_environment(os.environ, user="tester", home=str(tmp_path))
    async with contextlib.AsyncExitStack() as stack:
        executors = {}
        for node in NODES:
            config = ExecutorConfig(
                node_id=node,
                workdir=tmp_path / f"executor-{node}",
                base_env=base,
                kill_grace_s=2.0,
                fetch_timeout_s=0.2,
                placement_public_keys=TEST_PUBLIC_KEYS,
                workload_python=workload.python,
            )
            executors[node] = await stack.enter_async_context(running_executor(nc, config))
        yield executors


async def events_of(js: JetStreamContext, job_id: str, timeout: float) -> list[AnyJobEvent]:
    """Every event of ``job_id`` up to its terminal one."""
    sub = await js.subscribe(job_events(job_id), ordered_consumer=True)
    events: list[AnyJobEvent] = []
    try:
        async with asyncio.timeout(timeout):
            while not events or not is_terminal(events[-1]):
                events.append(event_decoder.decode((await sub.next_msg(timeout=timeout)).data))
    finally:
        await sub.unsubscribe()
    return events


async def eventually(check: Callable[[], bool], timeout: float) -> None:
    """Poll ``check`` until true: for files the workers write and processes ending, which
    nothing can be subscribed to."""
    async with asyncio.timeout(timeout):
        while True:
            if check():
                return
            await asyncio.sleep(0.05)


def tags(events: list[AnyJobEvent]) -> list[str]:
    return [str(e.__struct_config__.tag) for e in events]


@pytest.fixture
async def js(nc: Client) -> JetStreamContext:
    js = nc.jetstream()
    await ensure_streams(js)
    return js


async def test_two_nodes_torchrun_gloo_all_reduce(
    nc: Client, js: JetStreamContext, tmp_path: Path, workload_venv: Workload
) -> None:
    workload_venv.need_torch()
    script = tmp_path / "all_reduce.py"
    script.write_text(ALL_REDUCE)
    grants = rank_grants("allreduce", [workload_venv.python, str(script)], {})
    async with two_executors(nc, tmp_path, workload_venv) as executors:
        for g in grants:
            await publish_grant(js, g)
        ends = await asyncio.gather(*(events_of(js, g.job.job_id, 300) for g in grants))
        for rank, events in enumerate(ends):
            assert tags(events) == ["running", "succeeded"], events
            assert [getattr(e, "rank", None) for e in events] == [rank, rank]
            assert {getattr(e, "node_id", None) for e in events} == {NODES[rank]}
        seen: dict[str, list[dict[str, Any]]] = {}
        for g in grants:
            folder = executors[g.node_id].store.job_dir(g.grant_id)
            seen[g.node_id] = [json.loads(p.read_text()) for p in sorted(folder.glob("rank*.json"))]
            # Exactly its 2 processes ran on each node.
            assert sorted(p.name for p in folder.glob("pid-*")) == [
                f"pid-{g.gang.rank}-0",  # type: ignore[union-attr]
                f"pid-{g.gang.rank}-1",  # type: ignore[union-attr]
            ]
    # Global ranks 0, 1 on node-a (node rank 0), 2, 3 on node-b; every one summed 1+2+3+4.
    assert [r["rank"] for r in seen["node-a"]] == [0, 1]
    assert [r["rank"] for r in seen["node-b"]] == [2, 3]
    for node_rank, node in enumerate(NODES):
        for local, r in enumerate(seen[node]):
            assert r["sum"] == all_reduce_sum(4)
            assert (r["world"], r["WORLD_SIZE"]) == (4, "4")
            assert (r["NODE_RANK"], r["LOCAL_RANK"]) == (str(node_rank), str(local))
            assert (r["MASTER_ADDR"], r["MASTER_PORT"]) == (
                "127.0.0.1",
                str(grants[0].gang.master_port),  # type: ignore[union-attr]
            )
            assert r["GPULAYER_JOB_ID"] == "allreduce"  # the distributed job, not the rank
    # Each rank's output is its own job's log.
    out = io.StringIO()
    url = nc.connected_url
    assert url is not None
    nats_url = f"{url.scheme}://{url.hostname}:{url.port}"
    code = await run_logs(
        nats_url, grants[1].job.job_id, follow=False, out=out, connect_args=connect_args()
    )
    assert code == 0
    assert {"rank 2: sum 10", "rank 3: sum 10"} <= set(out.getvalue().splitlines())


async def test_a_failing_rank_fails_and_a_cancel_ends_every_worker_of_the_other(
    nc: Client, js: JetStreamContext, tmp_path: Path, workload_venv: Workload
) -> None:
    """Rank 1's workers exit 3 before the rendezvous: rank 1 fails (torchrun's own exit code, 1,
    the workers' 3 in its output); rank 0's workers wait at the rendezvous until placement would
    cancel rank 0: then torchrun and both its workers (in sessions of their own) are gone."""
    workload_venv.need_torch()
    script = tmp_path / "all_reduce.py"
    script.write_text(ALL_REDUCE)
    grants = rank_grants("failing", [workload_venv.python, str(script)], {"FAIL_NODE": "1"})
    async with two_executors(nc, tmp_path, workload_venv) as executors:
        for g in grants:
            await publish_grant(js, g)
        failed = await events_of(js, grants[1].job.job_id, 300)
        assert tags(failed) == ["running", "failed"]
        assert getattr(failed[-1], "rank", None) == 1
        assert getattr(failed[-1], "exit_code", None) == 1  # torchrun's, for a failed worker

        folder = executors["node-a"].store.job_dir(grants[0].grant_id)
        pid_files = [folder / "pid-0-0", folder / "pid-0-1"]
        await eventually(lambda: all(p.exists() and p.read_text() for p in pid_files), 120)
        workers = [int(p.read_text()) for p in pid_files]
        assert all(pid_alive(p) for p in workers)
        cancel = CancelJob(
            job_id=grants[0].job.job_id, reason="rank 1 failed", grant_id=grants[0].grant_id
        )
        await publish_cancel(js, "node-a", cancel)
        cancelled = await events_of(js, grants[0].job.job_id, 60)
        assert tags(cancelled) == ["running", "cancelled"]
        assert getattr(cancelled[-1], "rank", None) == 0
        # Ended with the job (a killed process is gone once the kernel next schedules it).
        await eventually(lambda: not any(pid_alive(p) for p in workers), 10)

    out = io.StringIO()
    url = nc.connected_url
    assert url is not None
    await run_logs(
        f"{url.scheme}://{url.hostname}:{url.port}",
        grants[1].job.job_id,
        follow=False,
        out=out,
        connect_args=connect_args(),
    )
    assert "exitcode  : 3" in out.getvalue()


SLEEPER = """\
import os, time
from pathlib import Path

Path(f"pid-{os.environ['LOCAL_RANK']}").write_text(str(os.getpid()))
time.sleep(600)
"""


async def test_a_timeout_ends_torchrun_and_its_workers(
    nc: Client, js: JetStreamContext, tmp_path: Path, workload_venv: Workload
) -> None:
    """A one-node rank whose 2 workers sleep: at timeout_s, torchrun and both workers go."""
    workload_venv.need_torch()
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    dist = Distributed(nodes=1, processes_per_node=2, backend="gloo", launcher="torchrun")
    job = JobRequest(
        job_id=rank_job_id("sleepy", 0),
        command=[workload_venv.python, str(script)],
        distributed=dist,
        timeout_s=30,  # torchrun imports torch first: a few seconds, more on a busy machine
    )
    gang = GangRank(
        job_id="sleepy",
        rank=0,
        nnodes=1,
        nproc_per_node=2,
        master_addr="127.0.0.1",
        master_port=free_port(),
    )
    grant = Grant(grant_id="g-sleepy", job=job, node_id=NODES[0], accelerator="cpu", gang=gang)
    async with two_executors(nc, tmp_path, workload_venv) as executors:
        await publish_grant(js, grant)
        folder = executors[NODES[0]].store.job_dir(grant.grant_id)
        pid_files = [folder / "pid-0", folder / "pid-1"]
        await eventually(lambda: all(p.exists() and p.read_text() for p in pid_files), 60)
        workers = [int(p.read_text()) for p in pid_files]
        events = await events_of(js, job.job_id, 120)
        assert tags(events) == ["running", "failed"]
        assert "timeout" in str(getattr(events[-1], "reason", ""))
        launcher = getattr(events[0], "pid", None)
        assert launcher is not None
        await eventually(lambda: not any(pid_alive(p) for p in [launcher, *workers]), 10)
