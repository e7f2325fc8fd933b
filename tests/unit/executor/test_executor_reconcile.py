"""Reconciliation alone: the decision for each record a previous run left, and what settling
it does (with a real state store, real processes to kill, and a stand-in launch)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from tests.unit.executor.fakes import NODE, FakeJetStream, FakeLaunch, grant

from gpulayer_contracts.subjects import job_events, node_status
from gpulayer_executor import procs
from gpulayer_executor import state as st
from gpulayer_executor.config import ExecutorConfig
from gpulayer_executor.job_runner import JobRunner
from gpulayer_executor.reconcile import RESTARTED, Reconciler, action_for
from gpulayer_executor.reporter import Reporter
from gpulayer_executor.writer import DurableWriter

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

RECEIVED = st.received(grant("g1"))
STARTING = st.starting(RECEIVED)
RUNNING = st.running(STARTING, st.ProcessInfo(pid=1, pgid=1))
OK = st.Outcome(state="succeeded", exit_code=0)
DONE = st.finished(RUNNING, OK)


@pytest.mark.parametrize(
    ("rec", "action"),
    [
        (RECEIVED, "start"),
        (STARTING, "orphan"),
        (RUNNING, "orphan"),
        (DONE, "report"),
        (st.reported(DONE), "none"),
        (st.finished(RECEIVED, st.Outcome(state="cancelled", reason="user")), "report"),
    ],
)
def test_each_leftover_state_gets_its_action(rec: st.GrantRecord, action: str) -> None:
    assert action_for(rec) == action


class Parts:
    def __init__(self, tmp_path: Path, run_root: Path | None = None) -> None:
        self.fake = FakeJetStream()
        self.store = st.StateStore(tmp_path)
        self.writer = DurableWriter(self.store)
        reporter = Reporter(self.fake.js, NODE, self.writer, asyncio.Event())
        self.launch = FakeLaunch(self.store)
        self.launch.finish.set()
        config = ExecutorConfig(node_id=NODE, workdir=tmp_path, base_env={"PATH": os.defpath})
        self.runner = JobRunner(
            self.fake.nc,
            self.fake.js,
            config,
            self.store,
            self.writer,
            reporter,
            launch=self.launch,
        )
        self.reconciler = Reconciler(
            self.store, self.runner, reporter, node_id=NODE, kill_grace_s=0.5, run_root=run_root
        )

    async def reconcile(self, *recs: st.GrantRecord) -> None:
        for rec in recs:
            assert self.store.create(rec)
        await self.reconciler.reconcile()
        await asyncio.gather(*(j.task for j in list(self.runner.jobs.values()) if j.task))
        await self.writer.drain()

    def outcome(self, grant_id: str) -> st.Outcome:
        rec = self.store.load(grant_id)
        assert rec is not None
        assert rec.outcome is not None
        return rec.outcome


def own_group(*, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        ["sleep", "60"], start_new_session=True, env={**os.environ, **(env or {})}
    )


async def test_a_finished_unreported_record_is_reported_again_under_its_ids(
    tmp_path: Path,
) -> None:
    p = Parts(tmp_path)
    await p.reconcile(DONE, st.reported(st.finished(st.received(grant("g0")), OK)))
    assert p.fake.msg_ids(node_status(NODE)) == ["g1:succeeded"]  # g0 was settled already
    assert p.fake.msg_ids(job_events("job-g1")) == ["g1:end"]
    assert p.store.unsettled() == []
    assert p.launch.spawned == []


async def test_a_received_record_is_started_as_its_first_start(tmp_path: Path) -> None:
    p = Parts(tmp_path)
    await p.reconcile(RECEIVED)
    assert p.launch.spawned == ["g1"]
    assert p.outcome("g1").state == "succeeded"


async def test_a_received_record_of_a_cancelled_job_is_not_started(tmp_path: Path) -> None:
    p = Parts(tmp_path)
    p.store.mark_cancel("job-g1", "user")
    await p.reconcile(RECEIVED)
    assert p.launch.spawned == []
    assert p.outcome("g1").state == "cancelled"


@linux_only
async def test_a_running_record_whose_group_lives_is_killed_and_reported_lost(
    tmp_path: Path,
) -> None:
    p = Parts(tmp_path)
    child = own_group()
    try:
        info = st.ProcessInfo(
            pid=child.pid,
            pgid=child.pid,
            start_ticks=procs.start_ticks(child.pid),
            boot_id=procs.boot_id(),
        )
        await p.reconcile(st.running(st.starting(st.received(grant("g1"))), info))
        assert child.wait(timeout=5) == -signal.SIGTERM
    finally:
        child.kill()
        child.wait()
    assert (p.outcome("g1").state, p.outcome("g1").reason) == ("lost", RESTARTED)
    assert p.fake.msg_ids(node_status(NODE)) == ["g1:lost"]
    assert p.launch.spawned == []  # never started again


@linux_only
async def test_a_running_record_of_another_process_is_left_alone_and_reported_lost(
    tmp_path: Path,
) -> None:
    p = Parts(tmp_path)
    bystander = own_group()
    try:
        # Same pid, but started at another time: the recorded group is gone, the pid reused.
        info = st.ProcessInfo(
            pid=bystander.pid,
            pgid=bystander.pid,
            start_ticks=(procs.start_ticks(bystander.pid) or 0) + 1,
            boot_id=procs.boot_id(),
        )
        await p.reconcile(st.running(st.starting(st.received(grant("g1"))), info))
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()
    assert (p.outcome("g1").state, p.outcome("g1").reason) == ("lost", RESTARTED)


@linux_only
async def test_a_starting_record_without_pid_finds_its_processes_by_env(tmp_path: Path) -> None:
    p = Parts(tmp_path)
    # A unique id: the search looks at every process of this user on the machine.
    grant_id = f"g-{uuid.uuid4().hex}"
    child = own_group(env={"GPULAYER_GRANT_ID": grant_id})
    try:
        await p.reconcile(st.starting(st.received(grant(grant_id, "job-1"))))
        assert child.wait(timeout=5) == -signal.SIGTERM
    finally:
        child.kill()
        child.wait()
    assert (p.outcome(grant_id).state, p.outcome(grant_id).reason) == ("lost", RESTARTED)
    assert p.fake.msg_ids(job_events("job-1")) == [f"{grant_id}:end"]


async def test_a_starting_record_whose_shim_was_never_asked_for_is_started(
    tmp_path: Path,
) -> None:
    """Killed between recording ``starting`` and making the shim's run folder (which comes
    before the fork): nothing ran, so it starts now, once. With the folder there, the shim may
    have been forked: lost, as before."""
    run_root = tmp_path / "run"
    run_root.mkdir()
    p = Parts(tmp_path / "state", run_root)
    forked = st.starting(st.received(grant("g2", "job-2")))
    (run_root / st.grant_key("g2")).mkdir()
    await p.reconcile(STARTING, forked)
    assert p.launch.spawned == ["g1"]
    assert p.outcome("g1").state == "succeeded"
    assert (p.outcome("g2").state, p.outcome("g2").reason) == ("lost", RESTARTED)
