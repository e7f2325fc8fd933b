"""Intake alone: a batch folded by job id, bad input rejected under the id read from it, and the
rule that new jobs are placed inline only while the scheduler is idle."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any, cast

from nats.aio.msg import Msg
from tests.unit.placement.placement_fakes import FakeConn, FakeJetStream, cpu_node, fake_scheduler

from gpulayer_placement.dead_letters import MAX_DELIVER
from gpulayer_placement.intake import Intake
from gpulayer_placement.loops import handle_batch
from gpulayer_placement.wake import Wake


class AckedMsg(Msg):
    acked = False

    async def ack(self) -> None:
        self.acked = True


def submit(data: bytes) -> AckedMsg:
    return AckedMsg(cast(Any, None), subject="gpulayer.jobs.submit", data=data)


def build(conn: FakeConn) -> tuple[Intake, Wake, FakeJetStream]:
    scheduler, js = fake_scheduler(cpu_node("n1"), conn)
    intake = Intake(
        js=cast(Any, js),
        pool=scheduler.pool,
        scheduler=scheduler,
        publisher=scheduler.publisher,
        wake=scheduler.wake,
        settings=scheduler.settings,
        stop=scheduler.stop,
    )
    return intake, scheduler.wake, js


def test_a_batch_is_folded_by_job_id_and_bad_input_rejected_by_the_id_read_from_it() -> None:
    intake, _, _ = build(FakeConn())
    batch = intake.read(
        [
            submit(b'{"job_id": "a", "command": ["true"]}'),
            submit(b'{"job_id": "a", "command": ["false"]}'),
            submit(b'{"job_id": "bad", "command": "echo hi"}'),
            submit(b"\x00 not json at all"),
            submit(b'{"job_id": "inv", "command": ["true"], "env": {"LD_PRELOAD": "x"}}'),
        ]
    )
    assert list(batch.rows) == ["a", "bad", "inv"]
    assert batch.rows["a"][2] == "pending"
    assert batch.accepted["a"].command == ["true"]  # the first message of an id wins
    assert batch.rows["bad"][2] == batch.rows["inv"][2] == "rejected"
    assert "$.env.LD_PRELOAD" in batch.rejections["inv"][0]
    assert set(batch.rejections) == {"bad", "inv"}


def row(job_id: str) -> dict[str, Any]:
    return {
        "job_id": job_id,
        "request": f'{{"job_id": "{job_id}", "command": ["true"]}}',
        "reason": None,
        "attempt": 0,
        "submitted_at": datetime(2025, 1, 1, tzinfo=UTC),
        "traceparent": None,
    }


async def test_new_jobs_are_placed_in_the_ingest_transaction_when_the_scheduler_is_idle() -> None:
    conn = FakeConn({"insert_jobs": [{"job_id": "a"}], "take_jobs": [row("a")]})
    intake, wake, js = build(conn)
    msg = submit(b'{"job_id": "a", "command": ["true"]}')
    await intake.ingest([msg])
    assert conn.names() == ["insert_jobs", "take_jobs", "place_jobs"]
    assert [h["Nats-Msg-Id"] for _, _, h in js.sent] == ["a:accepted", "a-1:placed", "a-1"]
    assert msg.acked
    assert wake.new_jobs == []  # nothing left for the scheduler


async def test_new_jobs_go_to_the_scheduler_while_a_pass_is_due() -> None:
    conn = FakeConn({"insert_jobs": [{"job_id": "a"}]})
    intake, wake, js = build(conn)
    wake.capacity()
    msg = submit(b'{"job_id": "a", "command": ["true"]}')
    await intake.ingest([msg])
    assert conn.names() == ["insert_jobs"]
    assert [h["Nats-Msg-Id"] for _, _, h in js.sent] == ["a:accepted"]
    assert wake.new_jobs == ["a"]
    assert msg.acked


async def test_a_known_job_is_acked_and_not_announced_again() -> None:
    conn = FakeConn({"insert_jobs": []})  # the id was stored before
    intake, wake, js = build(conn)
    msg = submit(b'{"job_id": "a", "command": ["true"]}')
    await intake.ingest([msg])
    assert js.sent == []
    assert msg.acked
    assert wake.new_jobs == []


async def test_a_dependency_a_pass_skipped_while_intake_held_it_is_looked_at_again() -> None:
    """Checking a job's dependencies locks them (FOR SHARE) for the intake transaction; a pass
    that runs meanwhile skips them (SKIP LOCKED). When capacity changed during the transaction,
    intake asks for another pass once it committed, even if it placed nothing itself: else the
    dependency, waiting for a node that had just joined, waited for the next periodic pass."""
    wake_ref: list[Wake] = []

    class Conn(FakeConn):
        async def fetch(self, sql: str, *args: Any) -> list[dict[str, Any]]:
            rows = await super().fetch(sql, *args)
            if self.calls[-1][0] == "dependency_states":
                wake_ref[0].capacity()  # a node joins while the rows are locked
                wake_ref[0].take()  # and the scheduler's pass (skipping them) runs at once
            return rows

    conn = Conn(
        {
            "dependency_states": [{"job_id": "a", "state": "pending", "owner": "anonymous"}],
            "insert_jobs": [{"job_id": "b"}],
        }
    )
    intake, wake, _ = build(conn)
    wake_ref.append(wake)
    wake.passing = True  # no inline placement: the scheduler is busy
    await intake.ingest([submit(b'{"job_id": "b", "command": ["true"], "after": ["a"]}')])
    assert "dependency_states" in conn.names()
    assert wake.capacity_changed  # asked again after the commit


async def test_a_dependency_a_pass_woken_before_the_transaction_skipped_is_looked_at_again() -> (
    None
):
    """The node joined (capacity changed) just before the intake transaction began; the pass it
    woke ran while the transaction held the dependency locked, and skipped it. No capacity
    change during the transaction, but a pass ran beside it: another pass once committed (the
    suite met this: the dependency kept "no nodes in the fleet" until the periodic pass)."""
    wake_ref: list[Wake] = []

    class Conn(FakeConn):
        async def fetch(self, sql: str, *args: Any) -> list[dict[str, Any]]:
            rows = await super().fetch(sql, *args)
            if self.calls[-1][0] == "dependency_states":
                wake_ref[0].take()  # the pass woken before the transaction runs now
                wake_ref[0].begin_pass()
                wake_ref[0].passing = False  # and ends, having skipped the locked rows
            return rows

    conn = Conn(
        {
            "dependency_states": [{"job_id": "a", "state": "pending", "owner": "anonymous"}],
            "insert_jobs": [{"job_id": "b"}],
        }
    )
    intake, wake, _ = build(conn)
    wake_ref.append(wake)
    wake.capacity()  # before the transaction: its epoch is the same after
    await intake.ingest([submit(b'{"job_id": "b", "command": ["true"], "after": ["a"]}')])
    assert "dependency_states" in conn.names()
    assert wake.capacity_changed  # asked again after the commit
    # With no pass beside it and no capacity change, nothing more is asked.
    wake.take()
    conn.rows["insert_jobs"] = [{"job_id": "c"}]
    Conn.fetch = FakeConn.fetch  # type: ignore[method-assign]
    await intake.ingest([submit(b'{"job_id": "c", "command": ["true"], "after": ["a"]}')])
    assert not wake.capacity_changed


class OnceConn(FakeConn):
    """``insert_jobs`` stores the ids once: asked again, they are known."""

    async def fetch(self, sql: str, *args: Any) -> list[dict[str, Any]]:
        rows = await super().fetch(sql, *args)
        if self.calls[-1][0] == "insert_jobs":
            self.rows["insert_jobs"] = []
        return rows


async def test_jobs_a_failed_batch_stored_are_announced_when_retried_one_by_one() -> None:
    # The batch stores both jobs, then fails before announcing them (here: the events' publish
    # raises). handle_batch retries its messages one at a time, on their first delivery still:
    # each job is known by then, and must be announced, not taken for a repeated submit.
    young = [{"job_id": j, "age_s": 0.1} for j in ("a", "b")]
    conn = OnceConn({"insert_jobs": [{"job_id": "a"}, {"job_id": "b"}], "job_ages": young})
    intake, wake, js = build(conn)
    wake.capacity()  # a pass is due: no inline placement, the events alone are published
    real = intake.publisher.publish_events
    failures = [RuntimeError("nats: connection closed")]

    async def publish_events(events: Any) -> bool:
        if failures:
            raise failures.pop()
        return await real(events)

    intake.publisher.publish_events = publish_events  # type: ignore[method-assign]
    msgs = [submit(b'{"job_id": "a", "command": ["true"]}')]
    msgs.append(submit(b'{"job_id": "b", "command": ["true"]}'))
    await handle_batch(asyncio.Event(), list(msgs), intake.ingest, None)
    assert sorted(h["Nats-Msg-Id"] for _, _, h in js.sent) == ["a:accepted", "b:accepted"]
    assert all(m.acked for m in msgs)
    # Announced: a later submit of the same id is a repeat again, acked without an event.
    again = submit(b'{"job_id": "a", "command": ["true"]}')
    await intake.ingest([again])
    assert again.acked
    assert len(js.sent) == 2


class LastDelivery(AckedMsg):
    """A submit JetStream delivers for the last time (MAX_DELIVER): a nak would drop it."""

    nakked = False

    async def nak(self, delay: float | None = None) -> None:
        self.nakked = True

    async def in_progress(self) -> None:
        pass


async def test_a_submit_on_its_last_delivery_waits_for_nats_to_store_its_announcement() -> None:
    # JOB_EVENTS has no leader for a moment (a NATS server went away): the announcement
    # can't be stored. The message is not nak'ed into oblivion: it is held and announced once
    # NATS stores again (the fault run lost an accepted event so).
    msg = await _submit_while_nats_refuses(LastDelivery, MAX_DELIVER, refusals=2)
    assert msg.acked
    assert not msg.nakked


async def _submit_while_nats_refuses(
    kind: type[LastDelivery], delivery: int, *, refusals: int
) -> LastDelivery:
    """Job "a" submitted (its ``delivery``-th delivery, a ``kind``) while JOB_EVENTS refuses
    the first ``refusals`` publishes; it was announced once, when NATS stored again."""
    young = [{"job_id": "a", "age_s": 0.1}]
    conn = OnceConn({"insert_jobs": [{"job_id": "a"}], "job_ages": young})
    intake, wake, js = build(conn)
    wake.capacity()
    real = js.publish_async
    refused = [RuntimeError("nats: no response from stream")] * refusals

    async def publish_async(subject: str, payload: bytes, headers: Any = None) -> Any:
        if refused:
            raise refused.pop()
        return await real(subject, payload, headers)

    js.publish_async = publish_async  # type: ignore[method-assign]
    reply = f"$JS.ACK.JOBS.placement-jobs.{delivery}.7.7.1700000000000000000.0"
    msg = kind(cast(Any, None), subject="gpulayer.jobs.submit", reply=reply)
    msg.data = b'{"job_id": "a", "command": ["true"]}'
    await handle_batch(asyncio.Event(), [msg], intake.ingest, None)
    assert refused == []
    assert [h["Nats-Msg-Id"] for _, _, h in js.sent] == ["a:accepted"]
    return msg


class FirstDelivery(LastDelivery):
    """A submit on its first delivery, counting the times it is kept in progress."""

    kept = 0

    async def in_progress(self) -> None:
        self.kept += 1


async def test_a_submit_whose_announcement_cant_be_stored_is_kept_not_nakked() -> None:
    # JOB_EVENTS can't store for a while: a nak a second would spend the submit's deliveries
    # (5), and a replica stopped while keeping it on its last one would leave its job stored
    # and never announced (the fault run found two). Kept in progress from its first delivery,
    # it is announced once NATS stores again, without another delivery.
    msg = await _submit_while_nats_refuses(FirstDelivery, 1, refusals=2)
    assert isinstance(msg, FirstDelivery)
    assert msg.acked
    assert not msg.nakked
    assert msg.kept == 2  # before each retry: its ack wait never runs out meanwhile


async def test_a_replica_stopping_hands_back_what_it_kept() -> None:
    conn = OnceConn({"insert_jobs": [{"job_id": "a"}], "job_ages": []})
    intake, wake, js = build(conn)
    wake.capacity()
    stop = asyncio.Event()

    async def publish_async(subject: str, payload: bytes, headers: Any = None) -> Any:
        stop.set()  # the replica is told to stop while NATS can't store
        raise RuntimeError("nats: no response from stream")

    js.publish_async = publish_async  # type: ignore[method-assign]
    reply = "$JS.ACK.JOBS.placement-jobs.1.7.7.1700000000000000000.0"
    msg = FirstDelivery(cast(Any, None), subject="gpulayer.jobs.submit", reply=reply)
    msg.data = b'{"job_id": "a", "command": ["true"]}'
    await handle_batch(stop, [msg], intake.ingest, None)
    assert msg.nakked  # redelivered at once to a replica still running
    assert not msg.acked


class HeldPublish:
    """The publisher's send_batch: each batch waits until ``release`` (its acks in flight)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.waiting = asyncio.Event()  # a batch is waiting for its acks

    async def __call__(self, items: Any, timeout: float) -> None:
        self.waiting.set()
        await self.release.wait()


class NewJobs(FakeConn):
    """Every job is new and waiting. With ``hold_first``, the first ``insert_jobs`` waits
    until ``go`` is set. ``until(name, n)``: the n-th call of ``name`` was made."""

    def __init__(self, *, hold_first: bool = False) -> None:
        super().__init__()
        self.go = asyncio.Event()
        if not hold_first:
            self.go.set()
        self.called = asyncio.Event()

    async def fetch(self, sql: str, *args: Any) -> list[dict[str, Any]]:
        name = self._record(sql, args)
        self.called.set()
        if name == "insert_jobs":
            if self.names().count("insert_jobs") == 1:
                await self.go.wait()
            return [{"job_id": j} for j in args[0]]
        return [row(j) for j in args[0]] if name == "take_jobs" else []

    async def execute(self, sql: str, *args: Any) -> str:
        out = await super().execute(sql, *args)
        self.called.set()
        return out

    async def until(self, name: str, n: int) -> None:
        while self.names().count(name) < n:
            self.called.clear()
            await self.called.wait()


async def test_batches_match_in_turn_and_the_next_overlaps_the_last_ones_work() -> None:
    """Two batches in flight (BATCHES_IN_FLIGHT): the second is inserted while the first is
    still being stored, but matched only once the first has committed; and it is matched and
    committed while the first's announcements still wait for their acks."""
    conn = NewJobs(hold_first=True)
    intake, _, _ = build(conn)
    held = HeldPublish()
    intake.publisher.send_batch = held
    first = asyncio.create_task(intake.ingest([submit(b'{"job_id": "a", "command": ["true"]}')]))
    await conn.until("insert_jobs", 1)  # "a" is being inserted
    second = asyncio.create_task(intake.ingest([submit(b'{"job_id": "b", "command": ["true"]}')]))
    await conn.until("insert_jobs", 2)  # "b" is inserted meanwhile...
    for _ in range(20):
        await asyncio.sleep(0)
    assert "take_jobs" not in conn.names()  # ...but not matched before "a"
    conn.go.set()
    await held.waiting.wait()  # "a" stored and placed; its events wait for their acks
    await conn.until("place_jobs", 2)
    assert not first.done()  # "b" was placed inline while "a" still waited for its acks
    held.release.set()
    await asyncio.gather(first, second)
    assert conn.names() == ["insert_jobs"] * 2 + ["take_jobs", "place_jobs"] * 2
    takes = [args[0] for name, args in conn.calls if name == "take_jobs"]
    assert takes == [["a"], ["b"]]


async def test_a_job_waiting_for_the_batch_before_is_checked_after_that_one_commits() -> None:
    """A job of the second batch names a job of the first in ``after``: its dependencies are
    read only once the first batch has committed (else the first's job would look unknown)."""
    conn = NewJobs(hold_first=True)
    intake, _, _ = build(conn)
    intake.publisher.send_batch = HeldPublish()
    first = asyncio.create_task(intake.ingest([submit(b'{"job_id": "a", "command": ["true"]}')]))
    await conn.until("insert_jobs", 1)
    body = b'{"job_id": "b", "command": ["true"], "after": ["a"]}'
    second = asyncio.create_task(intake.ingest([submit(body)]))
    for _ in range(20):
        await asyncio.sleep(0)
    assert "dependency_states" not in conn.names()  # waits for "a" to be committed
    conn.go.set()
    await conn.until("dependency_states", 1)
    assert conn.names().index("dependency_states") > conn.names().index("place_jobs")
    first.cancel()
    second.cancel()
    await asyncio.gather(first, second, return_exceptions=True)


async def test_a_batch_left_to_the_scheduler_keeps_the_next_from_overtaking_it() -> None:
    """The first batch found a pass due, so its job goes to the scheduler once its
    announcement is stored. The second, stored meanwhile with the scheduler idle again, must
    not be placed inline ahead of it: it goes to the scheduler too, after the first."""
    conn = NewJobs()
    intake, wake, _ = build(conn)
    held = HeldPublish()
    intake.publisher.send_batch = held
    wake.capacity()
    first = asyncio.create_task(intake.ingest([submit(b'{"job_id": "a", "command": ["true"]}')]))
    await held.waiting.wait()  # a's "accepted" waits for its ack
    wake.take()  # the pass ran: the scheduler is idle again, "a" not yet handed to it
    assert wake.idle()
    second = asyncio.create_task(intake.ingest([submit(b'{"job_id": "b", "command": ["true"]}')]))
    await conn.until("insert_jobs", 2)
    held.release.set()
    await asyncio.gather(first, second)
    assert "take_jobs" not in conn.names()  # "b" was not placed inline ahead of "a"
    assert wake.new_jobs == ["a", "b"]
