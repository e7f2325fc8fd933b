"""Submit and API rate limits (limits.py) and how a batch of submits meets them (submits.py),
on a clock stepped by hand; the audit wrapper of the API (audit.audited)."""

from __future__ import annotations

from typing import Any, cast

import pytest
from nats.aio.msg import Msg
from tests.unit.placement.placement_fakes import FakeJetStream

from gpulayer_contracts.audit import audit_decoder
from gpulayer_contracts.profiles import Profiles
from gpulayer_placement.audit import Auditor, audited
from gpulayer_placement.limits import RateLimit, submit_limit
from gpulayer_placement.submits import read_batch, stored_at
from gpulayer_runtime.roles import permissions


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def submit(owner: str, body: bytes, delivered: int = 1, stored_s: float = 1.7e9) -> Msg:
    """A submit as the placement-jobs consumer delivers it, stored by JetStream at ``stored_s``."""
    reply = f"$JS.ACK.JOBS.placement-jobs.{delivered}.1.1.{int(stored_s * 1e9)}.0"
    return Msg(cast(Any, None), subject=f"gpulayer.jobs.submit.{owner}", data=body, reply=reply)


def job(job_id: str) -> bytes:
    return f'{{"job_id": "{job_id}", "command": ["true"]}}'.encode()


def test_past_its_burst_an_owner_is_told_the_limit_and_when_to_retry() -> None:
    clock = Clock()
    limit = RateLimit("submits", 2.0, 3, clock=clock)
    assert [limit.check("alice") for _ in range(3)] == [None, None, None]
    why = limit.check("alice")
    assert why == "rate limit: alice over 2 submits/s (burst 3); retry in 0.5 s"
    assert limit.check("bob") is None  # its own bucket
    clock.now += 0.5
    assert limit.check("alice") is None


def test_admins_and_the_anonymous_owner_are_not_limited() -> None:
    limit = submit_limit(1.0, 1, frozenset({"root"}))
    for _ in range(10):
        assert limit.check("root") is None
        assert limit.check("anonymous") is None


def test_a_huge_owner_name_is_cut_in_the_reason() -> None:
    limit = RateLimit("submits", 1.0, 1, clock=Clock())
    limit.check("x" * 10_000)
    why = limit.check("x" * 10_000)
    assert why is not None
    assert len(why) < 200


def test_a_batch_over_the_limit_is_neither_stored_nor_dead_lettered() -> None:
    limit = RateLimit("submits", 1.0, 2, clock=Clock())
    msgs = [submit("alice", job(f"j{i}")) for i in range(4)]
    msgs.append(submit("alice", b"\x00 no job id here"))
    msgs.append(submit("bob", job("bob-1")))
    b = read_batch(msgs, Profiles(), 1 << 20, limit=limit.check)
    assert list(b.rows) == ["j0", "j1", "bob-1"]
    assert sorted(b.limited) == ["j2", "j3"]
    owner, why = b.limited["j2"]
    assert owner == "alice"
    assert why.startswith("rate limit: alice over 1 submits/s (burst 2)")
    assert not b.dead  # the one with no job id is only acked


def test_submits_count_when_they_were_sent_not_when_placement_reads_them() -> None:
    """Read in one batch from a backlog: alice's three sent a second apart are within 1/s
    (burst 1); of three sent at once later, one is admitted (a second's token) and two not."""
    limit = RateLimit("submits", 1.0, 1, clock=Clock())
    t = 1.8e9
    paced = [submit("alice", job(f"p{i}"), stored_s=t + i) for i in range(3)]
    flood = [submit("alice", job(f"f{i}"), stored_s=t + 3) for i in range(3)]
    b = read_batch([*paced, *flood], Profiles(), 1 << 20, limit=limit.check)
    assert list(b.rows) == ["p0", "p1", "p2", "f0"]
    assert sorted(b.limited) == ["f1", "f2"]
    # One stored before the bucket's last counted is counted at that last time, not earlier.
    late = read_batch(
        [submit("alice", job("old"), stored_s=t)], Profiles(), 1 << 20, limit=limit.check
    )
    assert list(late.limited) == ["old"]


def test_a_submits_stored_time_is_read_from_its_ack_subject() -> None:
    def msg(reply: str | None) -> Msg:
        return Msg(cast(Any, None), subject="gpulayer.jobs.submit.a", data=b"", reply=reply or "")

    assert stored_at(msg("$JS.ACK.JOBS.placement-jobs.1.7.7.1700000000500000000.3")) == 1700000000.5
    # With a domain and account hash (and a random token at the end).
    v2 = "$JS.ACK.hub.ACCHASH.JOBS.placement-jobs.1.7.7.1700000001000000000.3.r4nd"
    assert stored_at(msg(v2)) == 1700000001.0
    assert stored_at(msg("_INBOX.abc")) is None
    assert stored_at(msg(None)) is None
    assert stored_at(msg("$JS.ACK.JOBS.c.1.7.7.notanumber.3")) is None


def test_the_owner_is_the_subjects_not_the_payloads() -> None:
    limit = RateLimit("submits", 1.0, 1, clock=Clock())
    forged = b'{"job_id": "m1", "command": ["true"], "owner": "bob"}'
    read_batch([submit("mallory", forged)], Profiles(), 1 << 20, limit=limit.check)
    b = read_batch([submit("bob", job("b1"))], Profiles(), 1 << 20, limit=limit.check)
    assert list(b.rows) == ["b1"]  # mallory spent her token, not bob's


def test_a_redelivery_is_not_counted_again() -> None:
    limit = RateLimit("submits", 1.0, 1, clock=Clock())
    read_batch([submit("alice", job("a1"))], Profiles(), 1 << 20, limit=limit.check)
    again = submit("alice", job("a1"), delivered=2)
    b = read_batch([again], Profiles(), 1 << 20, limit=limit.check)
    assert list(b.rows) == ["a1"]
    assert not b.limited


def test_an_array_is_one_submit() -> None:
    limit = RateLimit("submits", 1.0, 1, clock=Clock())
    body = b'{"job_id": "arr", "command": ["true"], "array": {"count": 50}}'
    b = read_batch([submit("alice", body)], Profiles(), 1 << 20, limit=limit.check)
    assert len(b.rows) == 50
    assert limit.check("alice") is not None


def test_no_user_may_publish_on_the_audit_subjects() -> None:
    def allowed(subject: str, pattern: str) -> bool:
        s, p = subject.split("."), pattern.split(".")
        if p[-1] == ">":
            return len(s) >= len(p) and all(a in ("*", b) for a, b in zip(p[:-1], s, strict=False))
        return len(s) == len(p) and all(a in ("*", b) for a, b in zip(p, s, strict=True))

    for role in ("user", "viewer", "node"):
        publish = permissions(role, "alice").publish
        assert not any(allowed("gpulayer.audit.mint", p) for p in publish), (role, publish)
    assert any(allowed("gpulayer.audit.submit", p) for p in permissions("placement", "").publish)


class Denied(Exception):
    denied = True


async def test_cancels_and_quota_changes_are_recorded_with_their_outcome() -> None:
    auditor = Auditor(cast(Any, None), frozenset({"root"}))

    async def cancel(data: bytes, caller: str) -> Any:
        if caller != "alice":
            raise Denied("not yours")
        return {"job_id": "j1", "state": "cancelled"}

    async def quota(data: bytes, caller: str) -> Any:
        return []

    wrapped_cancel = audited(auditor, "cancel", cancel)
    wrapped_quota = audited(auditor, "quota", quota)
    await wrapped_cancel(b'{"job_id": "j1"}', "alice")
    with pytest.raises(Denied):
        await wrapped_cancel(b'{"job_id": "j1"}', "bob")
    await wrapped_quota(b'{"op": "list"}', "bob")  # changes nothing: not recorded
    await wrapped_quota(b'{"op": "set", "owner": "alice", "jobs": 5}', "root")
    await wrapped_cancel(b"\x00 not json", "alice")  # recorded all the same, target unknown
    rows = [(r.identity, r.role, r.action, r.target, r.outcome) for r in auditor._queue]
    assert rows == [
        ("alice", "user", "cancel", "j1", "cancelled"),
        ("bob", "user", "cancel", "j1", "denied"),
        ("root", "admin", "quota-set", "alice", "ok"),
        ("alice", "user", "cancel", "?", "cancelled"),
    ]


class DownJetStream:
    """NATS away: every publish fails."""

    async def publish_async(self, subject: str, payload: bytes, headers: Any = None) -> Any:
        raise ConnectionError("no server")


async def test_records_go_out_in_a_few_messages_and_wait_when_nats_is_away() -> None:
    js = FakeJetStream(ack_after=1)
    auditor = Auditor(cast(Any, js), frozenset())
    for i in range(450):
        auditor.record("alice", "submit", f"j{i}", "accepted")
    auditor.record("alice", "cancel", "j1", "cancelled")
    assert await auditor.flush()
    subjects = [s for s, _, _ in js.sent]
    assert subjects == ["gpulayer.audit.submit"] * 3 + ["gpulayer.audit.cancel"]  # 200 a message
    sent = [r for _, data, _ in js.sent for r in audit_decoder.decode(data)]
    assert [r.target for r in sent[:450]] == [f"j{i}" for i in range(450)]
    down = Auditor(cast(Any, DownJetStream()), frozenset())
    down.record("alice", "submit", "k1", "accepted")
    assert not await down.flush()
    down.record("alice", "submit", "k2", "accepted")
    assert [r.target for r in down._queue] == ["k1", "k2"]  # kept, in order, for the next try


def test_the_queue_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("gpulayer_placement.audit.MAX_QUEUED", 10)
    auditor = Auditor(cast(Any, None), frozenset())
    for i in range(25):
        auditor.record("alice", "submit", f"j{i}", "accepted")
    assert len(auditor._queue) == 10
    assert auditor.dropped == 15
    assert auditor._queue[0].target == "j15"  # the oldest went first
