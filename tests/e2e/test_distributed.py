"""A distributed job through the whole stack (issue 14): placement and two probe/executor pairs
(two node ids, two work folders, one machine, advertise address 127.0.0.1) as processes against
real NATS and PostgreSQL, the job submitted by the CLI. The workload is torchrun + gloo with
torch 2.13.0 CPU in a real venv (tests/workload.py): this run is what makes ``cpu`` distributed
``tested`` in the support matrix."""

from __future__ import annotations

import asyncio
import json
import re
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from tests.helpers import Services, gpulayer, service_env, subscribed
from tests.workload import ALL_REDUCE, Workload, all_reduce_sum

from gpulayer_contracts.codec import event_decoder
from gpulayer_contracts.events import AnyJobEvent, is_terminal
from gpulayer_contracts.jobs import rank_job_id
from gpulayer_contracts.subjects import JOB_WILDCARD_EVENTS
from gpulayer_runtime.nats import ensure_streams

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(900),
]

NODES = ("dist-a", "dist-b")
DISTRIBUTED = {"nodes": 2, "processes_per_node": 2, "backend": "gloo", "launcher": "torchrun"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Stack:
    def __init__(self, env: dict[str, str], work: dict[str, Path]) -> None:
        self.env, self.work = env, work


@pytest.fixture
async def stack(
    nats_url: str, database_url: str, tmp_path: Path, nc: Client, workload_venv: Workload
) -> AsyncIterator[Stack]:
    workload_venv.need_torch()
    await ensure_streams(nc.jetstream())
    port = free_port()  # one rendezvous port: other test runs on this machine use 29500 up
    extra = {
        "GPULAYER_KILL_GRACE_S": "1",
        "GPULAYER_WORKLOAD_PYTHON": workload_venv.python,
        "GPULAYER_ADVERTISE_ADDRESS": "127.0.0.1",
        "GPULAYER_RENDEZVOUS_PORTS": f"{port}-{port}",
    }
    work = {node: tmp_path / f"work-{node}" for node in NODES}
    envs = {node: service_env(nats_url, database_url, work[node], node, **extra) for node in NODES}
    async with Services() as services:
        await services.start("gpulayer-placement", envs[NODES[0]], tmp_path / "placement.log")
        for node in NODES:
            for name in ("gpulayer-executor", "gpulayer-probe"):
                await services.start(
                    name, envs[node], tmp_path / f"{name}-{node}.log", f"{name}-{node}"
                )
        env = envs[NODES[0]]
        async with asyncio.timeout(60):
            while True:  # until placement answers, knows both nodes and hears their executors
                code, out, _ = await gpulayer("nodes", "--json", env=env)
                nodes = {n["node_id"]: n for n in json.loads(out)} if code == 0 else {}
                if all(nodes.get(n, {}).get("executor") == "up" for n in NODES):
                    break
                await asyncio.sleep(0.2)
        yield Stack(env, work)


class Events:
    """Every event of the given jobs (the distributed job and its ranks), from before the submit."""

    def __init__(self, job_ids: set[str]) -> None:
        self.seen: dict[str, list[AnyJobEvent]] = {j: [] for j in job_ids}
        self.done = asyncio.Event()

    async def cb(self, msg: Msg) -> None:
        event = event_decoder.decode(msg.data)
        if event.job_id in self.seen:
            self.seen[event.job_id].append(event)
            if all(any(is_terminal(e) for e in es) for es in self.seen.values()):
                self.done.set()

    def tags(self, job_id: str) -> list[str]:
        return [str(e.__struct_config__.tag) for e in self.seen[job_id]]


async def run_job(
    stack: Stack, nc: Client, tmp_path: Path, workload: Workload, job_id: str, **fields: Any
) -> tuple[int, str, Events]:
    script = tmp_path / "all_reduce.py"
    script.write_text(ALL_REDUCE)
    job = {
        "job_id": job_id,
        "command": [workload.python, str(script)],
        "requirements": {"accelerator": "cpu"},
        "distributed": DISTRIBUTED,
        **fields,
    }
    path = tmp_path / f"{job_id}.json"
    path.write_text(json.dumps(job))
    events = Events({job_id, rank_job_id(job_id, 0), rank_job_id(job_id, 1)})
    sub = await nc.subscribe(JOB_WILDCARD_EVENTS, cb=events.cb)
    try:
        await subscribed(nc)
        code, out, err = await gpulayer("submit", str(path), "--wait", env=stack.env, timeout=600)
        await asyncio.wait_for(events.done.wait(), 120)  # the ranks' own ends too
    finally:
        await sub.unsubscribe()
    return code, out + err, events


def rank_files(folder: Path) -> list[dict[str, Any]]:
    """What the ranks wrote in their job folders under the node's work folder ``folder``: only
    ``jobs/`` is walked, final once the job ended (the executor's own ``trash/`` is being
    emptied behind the end report, and is no job's)."""
    return [json.loads(p.read_text()) for p in sorted((folder / "jobs").rglob("rank*.json"))]


async def test_two_nodes_torchrun_gloo_all_reduce(
    stack: Stack, nc: Client, tmp_path: Path, workload_venv: Workload
) -> None:
    code, said, events = await run_job(stack, nc, tmp_path, workload_venv, "dist-sum")
    tags = events.tags("dist-sum")
    assert code == 0, (said, tags)
    assert tags.count("succeeded") == 1, tags
    assert tags[-1] == "succeeded", tags
    assert "placed" in tags
    assert "failed" not in tags
    placed = next(e for e in events.seen["dist-sum"] if e.__struct_config__.tag == "placed")
    ranks = getattr(placed, "ranks", [])
    assert [(r.rank, r.job_id) for r in ranks] == [
        (0, "dist-sum-rank0"),
        (1, "dist-sum-rank1"),
    ]
    assert {r.node_id for r in ranks} == set(NODES)  # two distinct nodes
    node_of = {r.rank: r.node_id for r in ranks}
    for rank in (0, 1):
        rank_events = events.seen[rank_job_id("dist-sum", rank)]
        assert [str(e.__struct_config__.tag) for e in rank_events][-1] == "succeeded"
        # The executor's reports name the rank they are about.
        reports = [e for e in rank_events if e.__struct_config__.tag in ("running", "succeeded")]
        assert [getattr(e, "rank", None) for e in reports] == [rank, rank]
        # Each node ran exactly its 2 workers, global ranks 2R and 2R + 1, each summing 1..4.
        folder = stack.work[node_of[rank]] / "jobs"
        assert sorted(p.name for p in folder.rglob("pid-*")) == [f"pid-{rank}-0", f"pid-{rank}-1"]
        seen = rank_files(folder.parent)
        assert [r["rank"] for r in seen] == [2 * rank, 2 * rank + 1]
        # The rank's TMPDIR was in its job folder, torchrun's own temporary folder in it, and
        # it is gone now that the rank has ended (the node's /tmp keeps nothing of the job).
        (job_dir,) = {p.parent for p in folder.rglob("rank*.json")}
        for r in seen:
            assert r["TMPDIR"] == str(job_dir / "tmp")
            assert str(r["TORCHELASTIC_ERROR_FILE"]).startswith(f"{job_dir / 'tmp'}/torchelastic_")
        assert not (job_dir / "tmp").exists()
        for local, r in enumerate(seen):
            assert r["sum"] == all_reduce_sum(4)
            assert (r["world"], r["NODE_RANK"], r["LOCAL_RANK"]) == (4, str(rank), str(local))
            assert r["MASTER_ADDR"] == "127.0.0.1"
            assert r["GPULAYER_JOB_ID"] == "dist-sum"
    # `gpulayer logs` of the job shows its ranks' output, each line naming its rank (node rank
    # R ran global ranks 2R and 2R + 1), stored and followed alike.
    want = {f"[rank {r // 2}] rank {r}: sum {all_reduce_sum(4)}" for r in range(4)}
    for args in (("logs", "dist-sum"), ("logs", "-f", "dist-sum")):
        code, out, err = await gpulayer(*args, env=stack.env)
        assert code == 0, err
        assert want <= set(out.splitlines()), out


async def test_a_rank_exiting_3_fails_the_job_naming_it(
    stack: Stack, nc: Client, tmp_path: Path, workload_venv: Workload
) -> None:
    """Rank 1's workers exit 3 before the rendezvous: rank 1 fails, rank 0 (waiting at the
    rendezvous) is cancelled, the job ends failed naming rank 1 and its node."""
    code, said, events = await run_job(
        stack, nc, tmp_path, workload_venv, "dist-fail", env={"FAIL_NODE": "1"}
    )
    assert code != 0, said
    tags = events.tags("dist-fail")
    assert tags[-1] == "failed", tags
    assert "succeeded" not in tags
    failed = events.seen["dist-fail"][-1]
    assert getattr(failed, "rank", None) == 1
    node = getattr(failed, "node_id", None)
    assert node in NODES
    reason = str(getattr(failed, "reason", ""))
    assert f"rank 1 on {node}" in reason, failed
    # torchrun's own exit code is 1 whatever its worker's: the reason also names the worker
    # that failed first (node rank 1 runs global ranks 2 and 3) and its code, from torchrun's
    # summary on the rank's stderr.
    assert re.search(r"its worker of global rank [23] \(local [01]\) exited with code 3", reason), (
        reason
    )
    assert events.tags("dist-fail-rank1")[-1] == "failed"
    assert events.tags("dist-fail-rank0")[-1] == "cancelled"
    # No worker of rank 0 wrote a result: it never got past the rendezvous.
    assert rank_files(stack.work[NODES[0]]) + rank_files(stack.work[NODES[1]]) == []
