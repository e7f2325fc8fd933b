"""Grant intake alone, fed messages by hand: the ``received`` record is on disk before the ack,
a repeat is acked and ignored, a grant for another node is refused, a cancel is recorded
before its ack and reaches the job; with a verifier, unsigned grants and cancels are dropped
without a trace, and only a signed cancel leaves a mark."""

from __future__ import annotations

import asyncio
import os
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import cast

import pytest
from nats.aio.msg import Msg
from tests.helpers import TEST_SIGNER
from tests.unit.executor.fakes import NODE, FakeJetStream, FakeLaunch, grant, until

from gpulayer_contracts.codec import encode
from gpulayer_contracts.events import CancelJob, Grant
from gpulayer_contracts.subjects import job_events, node_grants, node_status
from gpulayer_executor import state as st
from gpulayer_executor.config import ExecutorConfig
from gpulayer_executor.intake import GrantIntake
from gpulayer_executor.job_runner import JobRunner
from gpulayer_executor.reporter import Reporter
from gpulayer_executor.writer import DurableWriter
from gpulayer_runtime.signing import Kind, Verifier, parse_public_keys

VERIFIER = Verifier(parse_public_keys(TEST_SIGNER.public_key))


class FakeMsg:
    def __init__(
        self,
        data: bytes,
        on_ack: Callable[[], object] = lambda: None,
        signed: tuple[Kind, str] | None = None,
    ) -> None:
        """``signed``: (kind, grant id) to sign the message as placement does, for NODE."""
        self.data = data
        self.subject = node_grants(NODE)
        self.headers: dict[str, str] | None = {
            "traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"
        }
        if signed is not None:
            self.headers.update(TEST_SIGNER.headers(signed[0], NODE, signed[1], data))
        self.acks = 0
        self.on_ack = on_ack

    async def ack(self) -> None:
        self.on_ack()
        self.acks += 1

    @property
    def msg(self) -> Msg:
        return cast(Msg, self)


class Parts:
    def __init__(self, tmp_path: Path, verifier: Verifier | None = None) -> None:
        self.fake = FakeJetStream()
        self.store = st.StateStore(tmp_path)
        self.writer = DurableWriter(self.store)
        # Set: the executor is stopping, and a report it can't publish is given up on.
        self.stopping = asyncio.Event()
        reporter = Reporter(self.fake.js, NODE, self.writer, self.stopping)
        self.launch = FakeLaunch(self.store)
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
        self.intake = GrantIntake(
            self.fake.js,
            NODE,
            self.store,
            self.writer,
            self.runner,
            reporter,
            asyncio.Event(),
            verifier=verifier,
        )

    async def settle(self) -> None:
        self.launch.finish.set()
        await asyncio.gather(*(j.task for j in list(self.runner.jobs.values()) if j.task))
        await self.writer.drain()


async def test_a_grant_is_on_disk_as_received_before_its_ack(tmp_path: Path) -> None:
    p = Parts(tmp_path)
    g = grant("g1")
    at_ack: list[str | None] = []

    def seen() -> None:
        rec = p.store.load("g1")
        at_ack.append(rec.phase if rec else None)

    msg = FakeMsg(encode(g), on_ack=seen)
    await p.intake.on_grant(msg.msg)
    assert at_ack == ["received"]
    assert msg.acks == 1
    await until(lambda: p.launch.spawned == ["g1"])
    rec = p.store.load("g1")
    assert rec is not None
    assert rec.traceparent == (msg.headers or {})["traceparent"]
    await p.settle()


async def test_a_grant_delivered_again_is_acked_and_never_started_twice(tmp_path: Path) -> None:
    p = Parts(tmp_path)
    payload = encode(grant("g1"))
    first, again = FakeMsg(payload), FakeMsg(payload)
    await asyncio.gather(p.intake.on_grant(first.msg), p.intake.on_grant(again.msg))
    await p.settle()
    later = FakeMsg(payload)  # after the job ended, too
    await p.intake.on_grant(later.msg)
    await p.settle()
    assert (first.acks, again.acks, later.acks) == (1, 1, 1)
    assert p.launch.spawned == ["g1"]


async def test_an_unwritable_record_leaves_the_grant_unacked(tmp_path: Path) -> None:
    p = Parts(tmp_path)
    p.store.close()
    msg = FakeMsg(encode(grant("g1")))
    # The consumer logs the error; JetStream redelivers the grant after ack_wait.
    with pytest.raises(sqlite3.ProgrammingError):
        await p.intake.on_grant(msg.msg)
    assert msg.acks == 0
    assert p.launch.spawned == []


async def test_a_grant_for_another_node_is_refused_once(tmp_path: Path) -> None:
    p = Parts(tmp_path)
    foreign = Grant(grant_id="g1", job=grant("g1").job, node_id="node-b", accelerator="cpu")
    for _ in range(2):
        msg = FakeMsg(encode(foreign))
        await p.intake.on_grant(msg.msg)
        assert msg.acks == 1
    await p.settle()
    assert p.launch.spawned == []
    rec = p.store.load("g1")
    assert rec is not None
    assert rec.outcome is not None
    assert rec.outcome.state == "failed"
    assert "'node-b' was delivered to node 'node-u'" in (rec.outcome.reason or "")
    assert p.fake.msg_ids(node_status(NODE)) == ["g1:failed"]
    assert p.fake.msg_ids(job_events("job-g1")) == ["g1:end"]


async def test_a_malformed_grant_is_acked_and_dropped(tmp_path: Path) -> None:
    p = Parts(tmp_path)
    msg = FakeMsg(b'{"grant_id": 3}')
    await p.intake.on_grant(msg.msg)
    assert msg.acks == 1
    assert p.store.all() == []


async def test_a_cancel_is_recorded_before_its_ack_and_stops_the_job(tmp_path: Path) -> None:
    p = Parts(tmp_path, VERIFIER)
    await p.intake.on_grant(FakeMsg(encode(grant("g1")), signed=("grant", "g1")).msg)
    await until(lambda: p.launch.running == 1)
    marked: list[bool] = []
    cancel = CancelJob(job_id="job-g1", reason="user asked", grant_id="g1")
    msg = FakeMsg(
        encode(cancel),
        on_ack=lambda: marked.append(p.store.cancel_mark("job-g1") is not None),
        signed=("cancel", "g1"),
    )
    await p.intake.on_cancel(msg.msg)
    assert marked == [True]
    await asyncio.gather(*(j.task for j in list(p.runner.jobs.values()) if j.task))
    rec = p.store.load("g1")
    assert rec is not None
    assert rec.outcome is not None
    assert (rec.outcome.state, rec.outcome.reason) == ("cancelled", "user asked")


async def test_with_a_verifier_an_unsigned_grant_leaves_no_trace(tmp_path: Path) -> None:
    p = Parts(tmp_path, VERIFIER)
    unsigned = FakeMsg(encode(grant("g1")))
    await p.intake.on_grant(unsigned.msg)
    assert unsigned.acks == 1
    assert p.store.all() == []
    assert p.fake.published == []
    assert p.intake.refused == {("grant", "unsigned"): 1}
    # The same grant signed runs: the refusal was about the signature only.
    signed = FakeMsg(encode(grant("g1")), signed=("grant", "g1"))
    await p.intake.on_grant(signed.msg)
    await until(lambda: p.launch.spawned == ["g1"])
    await p.settle()


async def test_with_a_verifier_a_grant_for_another_node_is_dropped_unreported(
    tmp_path: Path,
) -> None:
    p = Parts(tmp_path, VERIFIER)
    foreign = Grant(grant_id="g1", job=grant("g1").job, node_id="node-b", accelerator="cpu")
    msg = FakeMsg(encode(foreign), signed=("grant", "g1"))
    await p.intake.on_grant(msg.msg)
    assert msg.acks == 1
    assert p.store.all() == []
    assert p.fake.published == []
    assert p.intake.refused == {("grant", "wrong_node"): 1}


async def test_a_grant_recorded_already_is_counted_as_replayed(tmp_path: Path) -> None:
    p = Parts(tmp_path, VERIFIER)
    payload = encode(grant("g1"))
    await p.intake.on_grant(FakeMsg(payload, signed=("grant", "g1")).msg)
    await p.settle()
    await p.intake.on_grant(FakeMsg(payload, signed=("grant", "g1")).msg)
    await p.settle()
    assert p.launch.spawned == ["g1"]
    assert p.intake.refused == {("grant", "replayed"): 1}


async def test_with_a_verifier_an_unsigned_cancel_neither_marks_nor_stops(tmp_path: Path) -> None:
    p = Parts(tmp_path, VERIFIER)
    await p.intake.on_grant(FakeMsg(encode(grant("g1")), signed=("grant", "g1")).msg)
    await until(lambda: p.launch.running == 1)
    for cancel in (
        CancelJob(job_id="job-g1", grant_id="g1"),  # running here
        CancelJob(job_id="job-later", grant_id="later-1"),  # not submitted yet
    ):
        msg = FakeMsg(encode(cancel))
        await p.intake.on_cancel(msg.msg)
        assert msg.acks == 1
    assert p.store.cancel_mark("job-g1") is None
    assert p.store.cancel_mark("job-later") is None
    assert p.intake.refused == {("cancel", "unsigned"): 2}
    assert p.launch.running == 1  # not asked to stop
    await p.settle()
    rec = p.store.load("g1")
    assert rec is not None
    assert rec.outcome is not None
    assert rec.outcome.state == "succeeded"


async def test_signing_off_an_unsigned_cancel_stops_the_job_but_marks_nothing(
    tmp_path: Path,
) -> None:
    p = Parts(tmp_path)
    await p.intake.on_grant(FakeMsg(encode(grant("g1"))).msg)
    await until(lambda: p.launch.running == 1)
    await p.intake.on_cancel(FakeMsg(encode(CancelJob(job_id="job-g1", reason="stop"))).msg)
    await p.intake.on_cancel(FakeMsg(encode(CancelJob(job_id="job-later"))).msg)
    await asyncio.gather(*(j.task for j in list(p.runner.jobs.values()) if j.task))
    rec = p.store.load("g1")
    assert rec is not None
    assert rec.outcome is not None
    assert (rec.outcome.state, rec.outcome.reason) == ("cancelled", "stop")
    # A job submitted later under that id would not be stopped by it.
    assert p.store.cancel_mark("job-later") is None
    assert p.store.cancel_mark("job-g1") is None


@pytest.mark.parametrize("verifier", [VERIFIER, None], ids=["signed", "signing-off"])
async def test_a_given_up_grant_that_never_came_is_reported_ended_and_never_starts(
    tmp_path: Path, verifier: Verifier | None
) -> None:
    # Placement lost the job with this node (cut off) before its grant reached it: it keeps
    # what the grant would hold fenced until this node says the grant ended, so it is told at
    # once; the grant, should it still come, never starts (its end goes to placement alone).
    p = Parts(tmp_path, verifier)
    stop = CancelJob(job_id="job-g9", reason="lost: node cut off", grant_id="g9", given_up=True)
    await p.intake.on_cancel(FakeMsg(encode(stop), signed=("cancel", "g9")).msg)
    assert p.fake.msg_ids(node_status(NODE)) == ["g9:cancelled"]
    assert p.fake.msg_ids(job_events("job-g9")) == []
    await p.intake.on_grant(FakeMsg(encode(grant("g9")), signed=("grant", "g9")).msg)
    await p.settle()
    assert p.launch.spawned == []
    rec = p.store.load("g9")
    assert rec is not None
    assert rec.outcome is not None
    assert (rec.outcome.state, rec.outcome.told) == ("cancelled", True)
    await until(lambda: p.fake.msg_ids(node_status(NODE)) == ["g9:cancelled", "g9:cancelled"])
    assert p.fake.msg_ids(job_events("job-g9")) == []
    # A given-up grant the node did run is reported by its own end, not twice.
    await p.intake.on_grant(FakeMsg(encode(grant("g8")), signed=("grant", "g8")).msg)
    await p.settle()
    stop = CancelJob(job_id="job-g8", reason="lost: node cut off", grant_id="g8", given_up=True)
    await p.intake.on_cancel(FakeMsg(encode(stop), signed=("cancel", "g8")).msg)
    assert p.fake.msg_ids(node_status(NODE)).count("g8:cancelled") == 0


async def test_a_never_came_report_is_stored_before_its_cancel_is_acked(tmp_path: Path) -> None:
    # Nothing on this node would say it again (it has no record of the grant): acked first, a
    # crash before the report lost it, and placement kept the grant's fence for good.
    p = Parts(tmp_path, VERIFIER)
    stop = CancelJob(job_id="job-g9", reason="lost: node cut off", grant_id="g9", given_up=True)
    told_at_ack: list[list[str]] = []
    msg = FakeMsg(
        encode(stop),
        on_ack=lambda: told_at_ack.append(p.fake.msg_ids(node_status(NODE))),
        signed=("cancel", "g9"),
    )
    await p.intake.on_cancel(msg.msg)
    assert told_at_ack == [["g9:cancelled"]]


async def test_a_never_came_report_not_stored_leaves_its_cancel_to_be_redelivered(
    tmp_path: Path,
) -> None:
    # The executor stopping while NATS refuses the report: the cancel stays unacked, so the
    # next start gets it again and tells placement then, once.
    p = Parts(tmp_path, VERIFIER)
    stop = CancelJob(job_id="job-g9", reason="lost: node cut off", grant_id="g9", given_up=True)
    p.stopping.set()
    p.fake.fail[node_status(NODE)] = 3
    first = FakeMsg(encode(stop), signed=("cancel", "g9"))
    await p.intake.on_cancel(first.msg)
    assert (first.acks, p.fake.msg_ids(node_status(NODE))) == (0, [])
    again = FakeMsg(encode(stop), signed=("cancel", "g9"))
    await p.intake.on_cancel(again.msg)
    assert (again.acks, p.fake.msg_ids(node_status(NODE))) == (1, ["g9:cancelled"])
    mark = p.store.cancel_mark("job-g9", "g9")
    assert mark is not None
    assert mark.given_up
