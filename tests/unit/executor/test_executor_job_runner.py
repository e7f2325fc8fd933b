"""The job runner alone, with a stand-in for the process launch: slots, the durable order
around the spawn, cancels, spawn errors and shutdown."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import msgspec
from tests.unit.executor.fakes import NODE, FakeJetStream, FakeLaunch, grant, until

from gpulayer_contracts.events import GangRank
from gpulayer_contracts.subjects import job_events, node_status
from gpulayer_executor import state as st
from gpulayer_executor.config import ExecutorConfig
from gpulayer_executor.job_runner import JobRunner
from gpulayer_executor.reporter import Reporter
from gpulayer_executor.runner import SpawnError
from gpulayer_executor.writer import DurableWriter


class Parts:
    def __init__(self, tmp_path: Path, max_jobs: int) -> None:
        self.fake = FakeJetStream()
        self.store = st.StateStore(tmp_path)
        self.writer = DurableWriter(self.store)
        self.reporter = Reporter(self.fake.js, NODE, self.writer, asyncio.Event())
        self.launch = FakeLaunch(self.store)
        config = ExecutorConfig(
            node_id=NODE, workdir=tmp_path, base_env={"PATH": os.defpath}, max_jobs=max_jobs
        )
        self.runner = JobRunner(
            self.fake.nc,
            self.fake.js,
            config,
            self.store,
            self.writer,
            self.reporter,
            launch=self.launch,
        )

    def start(self, grant_id: str) -> st.GrantRecord:
        """As intake does: the ``received`` record on disk, then the job to the runner."""
        rec = st.received(grant(grant_id))
        assert self.store.create(rec)
        self.runner.launch(rec)
        return rec

    async def all_done(self) -> None:
        await asyncio.gather(*(j.task for j in list(self.runner.jobs.values()) if j.task))
        await self.writer.drain()

    def record(self, grant_id: str) -> st.GrantRecord:
        rec = self.store.load(grant_id)
        assert rec is not None
        return rec


async def test_jobs_beyond_the_slots_wait_and_every_job_runs_once(tmp_path: Path) -> None:
    p = Parts(tmp_path, max_jobs=2)
    ids = [f"g{i}" for i in range(5)]
    for grant_id in ids:
        p.start(grant_id)
    await until(lambda: p.launch.running == 2)
    await asyncio.sleep(0.05)  # a third would have started by now
    assert len(p.launch.spawned) == 2
    waiting = [g for g in ids if g not in p.launch.spawned]
    assert {p.record(g).phase for g in waiting} == {"received"}
    p.launch.finish.set()
    await p.all_done()
    assert p.launch.peak == 2
    assert sorted(p.launch.spawned) == ids
    assert not p.runner.jobs
    for grant_id in ids:
        rec = p.record(grant_id)
        assert rec.outcome is not None
        assert (rec.phase, rec.outcome.state, rec.reported) == ("finished", "succeeded", True)
    assert sorted(p.fake.msg_ids(node_status(NODE))) == sorted(
        [f"{g}:running" for g in ids] + [f"{g}:succeeded" for g in ids]
    )


async def test_starting_is_on_disk_before_the_spawn(tmp_path: Path) -> None:
    p = Parts(tmp_path, max_jobs=4)
    p.launch.finish.set()
    p.start("g1")
    await p.all_done()
    assert p.launch.phase_at_spawn == {"g1": "starting"}


async def test_a_cancel_reaches_a_queued_job_which_never_starts(tmp_path: Path) -> None:
    p = Parts(tmp_path, max_jobs=1)
    p.start("g1")
    await until(lambda: p.launch.running == 1)
    p.start("g2")
    assert p.runner.cancel("job-g2", "user asked") == 1
    await until(lambda: p.record("g2").phase == "finished")
    outcome = p.record("g2").outcome
    assert outcome is not None
    assert (outcome.state, outcome.reason) == ("cancelled", "user asked")
    # Reported after the record is on disk: waited for, not raced.
    await until(lambda: p.fake.msg_ids(job_events("job-g2")) == ["g2:end"])
    p.launch.finish.set()
    await p.all_done()
    assert p.launch.spawned == ["g1"]


async def test_a_cancel_recorded_before_the_grant_means_it_never_starts(tmp_path: Path) -> None:
    p = Parts(tmp_path, max_jobs=1)
    p.store.mark_cancel("job-g1", "cancelled earlier")
    p.start("g1")
    await p.all_done()
    assert p.launch.spawned == []
    outcome = p.record("g1").outcome
    assert outcome is not None
    assert (outcome.state, outcome.reason) == ("cancelled", "cancelled earlier")


async def test_a_cancel_naming_a_grant_stops_that_grant_alone(tmp_path: Path) -> None:
    # A job lost with its node and retried: its old grant is stopped when the node is back,
    # its new grant on the same node runs on.
    p = Parts(tmp_path, max_jobs=1)
    for grant_id in ("j-1", "j-2"):
        rec = st.received(grant(grant_id, "j"))
        assert p.store.create(rec)
        p.runner.launch(rec)
    await until(lambda: p.launch.running == 1)
    assert p.runner.cancel("j", "lost: node cut off", grant_id="j-2") == 1
    await until(lambda: p.record("j-2").phase == "finished")
    p.launch.finish.set()
    await p.all_done()
    assert p.launch.spawned == ["j-1"]
    ended = {g: p.record(g).outcome for g in ("j-1", "j-2")}
    assert {g: (o.state, o.told) if o else None for g, o in ended.items()} == {
        "j-1": ("succeeded", False),
        "j-2": ("cancelled", False),
    }


async def test_a_grant_placement_gave_up_ends_told(tmp_path: Path) -> None:
    # Running, then given up (placement lost it with its node): its end is marked told, so
    # the reporter sends it to placement alone; a mark saying so does the same for one queued.
    p = Parts(tmp_path, max_jobs=1)
    p.start("g1")
    await until(lambda: p.launch.running == 1)
    assert p.runner.cancel("job-g1", "lost: node cut off", "g1", given_up=True) == 1
    p.store.mark_cancel("job-g2", "lost: node cut off", "g2", given_up=True)
    p.start("g2")
    await until(lambda: p.record("g1").phase == "finished")
    await until(lambda: p.record("g2").phase == "finished")
    await p.all_done()
    for grant_id in ("g1", "g2"):
        outcome = p.record(grant_id).outcome
        assert outcome is not None
        assert (outcome.state, outcome.told) == ("cancelled", True)
    assert p.fake.msg_ids(job_events("job-g1")) == ["g1:running"]
    assert p.fake.msg_ids(job_events("job-g2")) == []
    assert sorted(p.fake.msg_ids(node_status(NODE))) == [
        "g1:cancelled",
        "g1:running",
        "g2:cancelled",
    ]


async def test_a_cancel_mark_naming_a_grant_keeps_the_jobs_other_grants(tmp_path: Path) -> None:
    p = Parts(tmp_path, max_jobs=1)
    p.store.mark_cancel("j", "lost: node cut off", grant_id="j-1")
    assert p.store.cancel_mark("j") is not None
    assert p.store.cancel_mark("j", "j-1") is not None
    assert p.store.cancel_mark("j", "j-2") is None
    for grant_id in ("j-1", "j-2"):
        rec = st.received(grant(grant_id, "j"))
        assert p.store.create(rec)
        p.runner.launch(rec)
    p.launch.finish.set()
    await p.all_done()
    assert p.launch.spawned == ["j-2"]
    outcome = p.record("j-1").outcome
    assert outcome is not None
    assert (outcome.state, outcome.reason) == ("cancelled", "lost: node cut off")
    # A mark naming no grant (a job cancelled before placement gave it one) stops them all.
    p.store.mark_cancel("k", "user asked")
    assert p.store.cancel_mark("k", "k-7") is not None


async def test_a_spawn_error_fails_the_job_and_frees_its_slot(tmp_path: Path) -> None:
    p = Parts(tmp_path, max_jobs=1)
    p.launch.error = SpawnError("could not start 'nope': no such file")
    p.start("g1")
    await p.all_done()
    outcome = p.record("g1").outcome
    assert outcome is not None
    assert (outcome.state, outcome.reason) == (
        "failed",
        "spawn: could not start 'nope': no such file",
    )
    assert p.fake.msg_ids(node_status(NODE)) == ["g1:failed"]  # never said running
    p.launch.error = None
    p.launch.finish.set()
    p.start("g2")
    await p.all_done()
    assert p.record("g2").phase == "finished"


async def test_an_executor_error_reports_the_job_lost_and_frees_its_slot(tmp_path: Path) -> None:
    p = Parts(tmp_path, max_jobs=1)
    p.launch.error = RuntimeError("bug")
    p.start("g1")
    await p.all_done()
    outcome = p.record("g1").outcome
    assert outcome is not None
    assert (outcome.state, outcome.reason) == ("lost", "executor error")
    p.launch.error = None
    p.launch.finish.set()
    p.start("g2")
    await p.all_done()
    assert p.launch.spawned == ["g1", "g2"]


async def test_a_refused_env_fails_the_job_before_anything_starts(tmp_path: Path) -> None:
    p = Parts(tmp_path, max_jobs=1)
    rec = st.received(grant("g1", env={"GPULAYER_GRANT_ID": "forged"}))
    assert p.store.create(rec)
    p.runner.launch(rec)
    await p.all_done()
    assert p.launch.spawned == []
    outcome = p.record("g1").outcome
    assert outcome is not None
    assert outcome.state == "failed"
    assert "GPULAYER_GRANT_ID" in (outcome.reason or "")


async def test_shutdown_stops_running_jobs_lost_and_keeps_queued_ones(tmp_path: Path) -> None:
    p = Parts(tmp_path, max_jobs=1)
    p.start("g1")
    await until(lambda: p.launch.running == 1)
    p.start("g2")
    await p.runner.shutdown(0.0, "executor stopped")
    await p.writer.drain()
    outcome = p.record("g1").outcome
    assert outcome is not None
    assert (outcome.state, outcome.reason) == ("lost", "executor stopped")
    assert p.record("g2").phase == "received"  # started by the next run
    assert p.fake.msg_ids(job_events("job-g2")) == []
    assert p.launch.spawned == ["g1"]
    assert not p.runner.jobs


async def test_shutdown_lets_running_jobs_finish_within_the_drain_time(tmp_path: Path) -> None:
    p = Parts(tmp_path, max_jobs=1)
    p.start("g1")
    await until(lambda: p.launch.running == 1)
    asyncio.get_running_loop().call_later(0.05, p.launch.finish.set)
    await p.runner.shutdown(5.0, "executor stopped")
    outcome = p.record("g1").outcome
    assert outcome is not None
    assert outcome.state == "succeeded"


async def test_a_job_ended_at_its_first_look_tells_its_user_it_ran_and_placement_its_end(
    tmp_path: Path,
) -> None:
    """Placement takes the end of a job still placed: its ``running`` is one message fewer.
    The job's user still hears it ran; a rank's ``running`` still goes to placement (its gang's
    state is decided from its ranks')."""
    p = Parts(tmp_path, max_jobs=2)
    p.launch.ended_at_start = True
    p.launch.finish.set()
    p.start("short")
    rank = st.received(
        msgspec.structs.replace(
            grant("rank"),
            gang=GangRank(
                job_id="dist", rank=1, nnodes=2, nproc_per_node=1, master_addr="a", master_port=1
            ),
        )
    )
    assert p.store.create(rank)
    p.runner.launch(rank)
    await p.all_done()
    assert sorted(p.fake.msg_ids(node_status(NODE))) == [
        "rank:running",
        "rank:succeeded",
        "short:succeeded",
    ]
    assert p.fake.msg_ids(job_events("job-short")) == ["short:running", "short:end"]
    assert p.record("short").reported
