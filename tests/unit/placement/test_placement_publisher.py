"""The outcome publisher alone: message ids and headers, pipelining, and the order in which an
outcome's messages go out (owed announcements first, grants last)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, cast

import msgspec
from tests.unit.placement.placement_fakes import FakeJetStream, FakePool

from gpulayer_contracts import Accepted, Cancelled, Pending, Rejected
from gpulayer_contracts.codec import decode_job_json
from gpulayer_contracts.subjects import MSG_ID_HEADER
from gpulayer_matching import NoPlacement, Placement
from gpulayer_placement.outcome import Outcome, PlacedJob, make_grant
from gpulayer_placement.publisher import Publisher
from gpulayer_placement.settings import Settings


def publisher(js: FakeJetStream, timeout_s: float = 5.0) -> Publisher:
    return Publisher(cast(Any, js), cast(Any, FakePool()), Settings(publish_timeout_s=timeout_s))


def job(job_id: str) -> Any:
    return decode_job_json(msgspec.json.encode({"job_id": job_id, "command": ["true"]}))


def placed(job_id: str, traceparent: str | None = None) -> PlacedJob:
    return PlacedJob(
        job=job(job_id),
        placement=Placement(node_id="n1", accelerator="cpu", devices=[], use="none"),
        grant_id=f"{job_id}-1",
        traceparent=traceparent,
        submitted=0.0,
        match_ns=(0, 0),
    )


def ids(js: FakeJetStream) -> list[str]:
    return [h[MSG_ID_HEADER] for _, _, h in js.sent]


def test_event_ids_name_announcements_by_job_and_other_events_by_time() -> None:
    at = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)
    subject, _, headers = Publisher.event_item(Accepted(job_id="j1"))
    assert subject == "gpulayer.job.anonymous.j1.events"
    assert headers == {MSG_ID_HEADER: "j1:accepted"}
    assert Publisher.event_item(Rejected(job_id="j1", reasons=["x"]))[2] == {
        MSG_ID_HEADER: "j1:rejected"
    }
    pending = Pending(job_id="j1", summary="s", reasons=[], at=at)
    assert Publisher.event_item(pending)[2] == {MSG_ID_HEADER: f"j1:pending:{at.timestamp()}"}
    # Placement cancels a job once (waiting, by its dependency, its gang): said again later,
    # with another time, it is still the same message (JetStream keeps one).
    later = datetime(2025, 1, 2, 3, 9, 5, tzinfo=UTC)
    cancels = [Cancelled(job_id="j1", reason="r", at=t) for t in (at, later)]
    assert [Publisher.event_item(c)[2] for c in cancels] == [{MSG_ID_HEADER: "j1:cancelled"}] * 2


def test_grant_and_placed_are_named_by_the_grant_and_carry_the_trace() -> None:
    grant = make_grant(job("j1"), "node-7", "j1-3", "cpu", [])
    subject, data, headers = Publisher.grant_item(grant, {"traceparent": "00-abc-def-01"})
    assert subject == "gpulayer.node.node-7.grants"
    assert headers == {MSG_ID_HEADER: "j1-3", "traceparent": "00-abc-def-01"}
    assert msgspec.json.decode(data)["grant_id"] == "j1-3"
    assert Publisher.grant_item(grant)[2] == {MSG_ID_HEADER: "j1-3"}
    subject, data, headers = Publisher.placed_item(grant)
    assert subject == "gpulayer.job.anonymous.j1.events"
    assert headers == {MSG_ID_HEADER: "j1-3:placed"}
    assert msgspec.json.decode(data)["node_id"] == "node-7"


async def test_publish_sends_every_message_before_waiting_for_acks() -> None:
    js = FakeJetStream(ack_after=3)  # acks come only once all three were sent
    items = [Publisher.event_item(Accepted(job_id=f"j{i}")) for i in range(3)]
    assert await publisher(js).publish(items)
    assert ids(js) == ["j0:accepted", "j1:accepted", "j2:accepted"]


async def test_publish_is_false_when_an_ack_does_not_come() -> None:
    js = FakeJetStream(ack_after=None)  # never acks
    assert not await publisher(js, timeout_s=0.05).publish_events([Accepted(job_id="j1")])
    assert await publisher(js).publish([])  # nothing to send is no failure


async def test_outcome_goes_out_owed_then_before_then_placed_pending_then_grants() -> None:
    js = FakeJetStream(ack_after=5)
    pub = publisher(js)
    pub.owe([Accepted(job_id="a")])  # an earlier publish of a's announcement failed
    waiting = NoPlacement(summary="no node", reasons=["r"], unsatisfiable=False)
    outcome = Outcome(placements=[placed("a", "00-t-s-01")], waiting=[("b", waiting)])
    assert await pub.publish_outcome(outcome, before=[Accepted(job_id="b")])
    sent = ids(js)
    assert sent[:3] == ["a:accepted", "b:accepted", "a-1:placed"]
    assert sent[3].startswith("b:pending:")
    assert sent[4] == "a-1"
    assert js.sent[4][0] == "gpulayer.node.n1.grants"
    assert js.sent[4][2]["traceparent"] == "00-t-s-01"
    assert pub.placed_total == 1
    # Stored: a's announcement is no longer owed.
    js.sent.clear()
    js.ack_after = 2
    assert await pub.publish_outcome(Outcome(placements=[placed("a")]))
    assert ids(js) == ["a-1:placed", "a-1"]


async def test_an_announcement_stays_owed_until_it_was_stored() -> None:
    js = FakeJetStream(ack_after=None)
    pub = publisher(js, timeout_s=0.05)
    pub.owe([Accepted(job_id="a")])
    assert not await pub.publish_outcome(Outcome(placements=[placed("a")]))
    js.ack_after = 3
    js.sent.clear()
    assert await pub.publish_outcome(Outcome(placements=[placed("a")]))
    assert ids(js)[0] == "a:accepted"
    pub.forget("a")
    js.sent.clear()
    js.ack_after = 2
    assert await pub.publish_outcome(Outcome(placements=[placed("a")]))
    assert "a:accepted" not in ids(js)
