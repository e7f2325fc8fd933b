"""The reporter alone: what a record's state becomes on the wire, under which message ids, and
what a failed publish does while serving and while stopping."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest
from tests.unit.executor.fakes import NODE, FakeJetStream, grant

from gpulayer_contracts.codec import event_decoder, status_decoder
from gpulayer_contracts.events import Cancelled, Failed, GangRank, Lost, Running, Succeeded
from gpulayer_contracts.subjects import job_events, node_status
from gpulayer_executor import state as st
from gpulayer_executor.reporter import Reporter, status_for
from gpulayer_executor.writer import DurableWriter

PROC = st.ProcessInfo(pid=77, pgid=77)


def finished(grant_id: str, outcome: st.Outcome) -> st.GrantRecord:
    return st.finished(st.running(st.starting(st.received(grant(grant_id))), PROC), outcome)


@pytest.mark.parametrize(
    ("outcome", "event_type"),
    [
        (st.Outcome(state="succeeded", exit_code=0), Succeeded),
        (st.Outcome(state="failed", exit_code=3, reason="exit code 3"), Failed),
        (st.Outcome(state="cancelled", reason="user"), Cancelled),
        (st.Outcome(state="lost", reason="executor restarted"), Lost),
    ],
)
def test_a_finished_record_becomes_its_status_and_event(
    outcome: st.Outcome, event_type: type
) -> None:
    status, event = status_for(finished("g1", outcome), NODE)
    assert (status.state, status.grant_id, status.job_id, status.node_id) == (
        outcome.state,
        "g1",
        "job-g1",
        NODE,
    )
    assert (status.pid, status.exit_code, status.reason, status.at) == (
        77,
        outcome.exit_code,
        outcome.reason,
        outcome.at,
    )
    assert isinstance(event, event_type)
    assert event.at == outcome.at
    assert getattr(event, "rank", 0) is None  # no distributed job


@pytest.mark.parametrize("state", ["running", "succeeded", "failed", "cancelled", "lost"])
def test_a_ranks_events_name_the_rank(state: str) -> None:
    gang = GangRank(
        job_id="d", rank=1, nnodes=2, nproc_per_node=1, master_addr="h", master_port=29500
    )
    g = msgspec.structs.replace(grant("g1"), gang=gang)
    rec = st.running(st.starting(st.received(g)), PROC)
    if state != "running":
        rec = st.finished(rec, st.Outcome(state=state, exit_code=3 if state == "failed" else 0))  # type: ignore[arg-type]
    _, event = status_for(rec, NODE)
    assert (event.__struct_config__.tag, event.rank) == (state, 1)  # type: ignore[attr-defined]


def test_a_running_record_reports_its_pid_and_start_time() -> None:
    rec = st.running(st.starting(st.received(grant("g1"))), PROC)
    status, event = status_for(rec, NODE)
    assert (status.state, status.pid, status.at) == ("running", 77, PROC.started_at)
    assert isinstance(event, Running)
    assert event.pid == 77


def reporter(tmp_path: Path, fake: FakeJetStream, stopping: asyncio.Event) -> Reporter:
    writer = DurableWriter(st.StateStore(tmp_path))
    return Reporter(fake.js, NODE, writer, stopping, publish_timeout_s=0.1)


async def test_both_reports_carry_the_grant_and_state_as_msg_id(tmp_path: Path) -> None:
    fake = FakeJetStream()
    rec = finished("g1", st.Outcome(state="failed", exit_code=2, reason="exit code 2"))
    assert await reporter(tmp_path, fake, asyncio.Event()).report(rec)
    assert fake.msg_ids(node_status(NODE)) == ["g1:failed"]
    assert fake.msg_ids(job_events("job-g1")) == ["g1:end"]
    by_subject = {subject: payload for subject, payload, _ in fake.published}
    assert status_decoder.decode(by_subject[node_status(NODE)]).exit_code == 2
    assert isinstance(event_decoder.decode(by_subject[job_events("job-g1")]), Failed)


async def test_an_end_placement_was_told_of_first_goes_to_placement_alone(tmp_path: Path) -> None:
    # A job placement gave up with its node (lost), stopped here once the node was back: the
    # status frees what its grant held; the job's events keep the one outcome they have.
    fake = FakeJetStream()
    told = st.Outcome(state="cancelled", reason="lost: node cut off", told=True)
    assert await reporter(tmp_path, fake, asyncio.Event()).report(finished("g1", told))
    assert fake.msg_ids(node_status(NODE)) == ["g1:cancelled"]
    assert fake.msg_ids(job_events("job-g1")) == []


async def test_a_failed_publish_is_retried_while_serving(tmp_path: Path) -> None:
    fake = FakeJetStream()
    fake.fail[node_status(NODE)] = 2
    rec = finished("g1", st.Outcome(state="succeeded", exit_code=0))
    assert await reporter(tmp_path, fake, asyncio.Event()).report(rec)
    assert fake.attempts[node_status(NODE)] == 3
    assert fake.attempts[job_events("job-g1")] == 1
    # Repeats carry the same id: JetStream keeps one of them.
    assert fake.msg_ids(node_status(NODE)) == ["g1:succeeded"]


async def test_once_stopping_three_failed_tries_leave_the_record_unreported(
    tmp_path: Path,
) -> None:
    fake = FakeJetStream()
    fake.fail[job_events("job-g1")] = 100
    stopping = asyncio.Event()
    stopping.set()
    store = st.StateStore(tmp_path)
    writer = DurableWriter(store)
    rec = finished("g1", st.Outcome(state="lost", reason="executor stopped"))
    assert store.create(rec)
    rep = Reporter(fake.js, NODE, writer, stopping, publish_timeout_s=0.1)
    await rep.report_finished(rec)
    await writer.drain()
    assert fake.attempts[job_events("job-g1")] == 3
    loaded = store.load("g1")
    assert loaded is not None
    assert not loaded.reported  # the next start reports it again
    assert [r.grant_id for r in store.unsettled()] == ["g1"]


async def test_a_finished_record_both_streams_stored_is_marked_reported(tmp_path: Path) -> None:
    fake = FakeJetStream()
    store = st.StateStore(tmp_path)
    writer = DurableWriter(store)
    rec = finished("g1", st.Outcome(state="succeeded", exit_code=0))
    assert store.create(rec)
    await Reporter(fake.js, NODE, writer, asyncio.Event()).report_finished(rec)
    await writer.drain()
    loaded = store.load("g1")
    assert loaded is not None
    assert loaded.reported
    assert store.unsettled() == []
