"""Rate limits and the audit trail (issue 31) on one real stack: placement, executor and probe
as processes with their own credentials against a nats-server with gpulayer's auth config,
limits set low so a flood takes a second, not minutes.

- one owner floods submits: another owner's job still starts, and the flooder's submits past
  its burst get ``rejected`` events naming the limit;
- a caller over its API rate gets an error naming the limit; an admin is not limited;
- a node's probe answers doctor requests past its bucket with "rate limited, retry in N s";
- submits, a cancel and a quota change land in the AUDIT stream; ``gpulayer audit --who``
  shows them to an admin; a user gets the permission message; a user can't forge a record.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import msgspec
import pytest
from nats.aio.client import Client
from tests.helpers import (
    Postgres,
    SecureNats,
    gpulayer,
    secure_server,
    secure_stack,
    subscribed,
)

from gpulayer_cli.audit_cmd import Query, read_audit
from gpulayer_cli.client import ApiFailed, api, follow_events, submit
from gpulayer_contracts import JobRequest, encode
from gpulayer_contracts.audit import AuditRecord, audit_subject
from gpulayer_contracts.codec import event_decoder
from gpulayer_contracts.subjects import API_CANCEL, API_JOBS, API_QUOTA, jobs_submit
from gpulayer_runtime.auth import AuthStore

pytestmark = pytest.mark.e2e

NODE = "limits-node"
SUBMIT_BURST, API_BURST = 5, 5
FLOOD = 60
DENIED = 4


@pytest.fixture(scope="module")
async def stack(
    tmp_path_factory: pytest.TempPathFactory, auth_store: AuthStore, postgres: Postgres
) -> AsyncIterator[SecureNats]:
    folder = tmp_path_factory.mktemp("limits")
    async with (
        postgres.database() as db,
        secure_server(folder, auth_store) as nats,
        secure_stack(
            nats,
            db,
            folder,
            NODE,
            # Low, so that a flood of FLOOD submits is over the limit within a second; the rate
            # (one a minute) adds nothing while the test runs.
            GPULAYER_SUBMIT_RATE="0.016",
            GPULAYER_SUBMIT_BURST=str(SUBMIT_BURST),
            GPULAYER_API_RATE="0.016",
            GPULAYER_API_BURST=str(API_BURST),
            GPULAYER_DOCTOR_RATE="0.016",
            GPULAYER_DOCTOR_BURST="1",
        ) as stack,
    ):
        yield stack


async def _ends(nc: Client, job_id: str, owner: str) -> list[str]:
    tags: list[str] = []
    async for event in follow_events(nc, [job_id], owner=owner):
        tags.append(_tag(event))
    return tags


async def test_a_flood_from_one_owner_does_not_hold_back_another(stack: SecureNats) -> None:
    mallory = await stack.connect("user", "mallory")
    alice = await stack.connect("user", "alice")
    try:
        events: dict[str, list[object]] = {}
        done = asyncio.Event()

        async def on_event(msg: object) -> None:
            event = event_decoder.decode(msg.data)  # type: ignore[attr-defined]
            events.setdefault(event.job_id, []).append(event)
            answered = [j for j, evs in events.items() if _announced(evs)]
            if len(answered) == FLOOD:
                done.set()

        # The flooder may read its own jobs' events: subscribed before the first submit.
        await mallory.subscribe("gpulayer.job.mallory.*.events", cb=on_event)
        await subscribed(mallory)
        js = mallory.jetstream()
        subject = jobs_submit("mallory")
        acks = [
            js.publish(subject, encode(JobRequest(job_id=f"flood-{i}", command=["true"])))
            for i in range(FLOOD)
        ]
        await asyncio.gather(*acks)
        # Another owner's job, submitted after the flood is queued, still runs.
        job = JobRequest(job_id="alice-after-flood", command=["true"])
        await submit(alice, job, owner="alice")
        assert "running" in await _ends(alice, job.job_id, "alice")
        async with asyncio.timeout(60):
            await done.wait()
    finally:
        await mallory.close()
        await alice.close()
    limited = [j for j, evs in events.items() if any(_limit_reason(e, "submits") for e in evs)]
    accepted = [j for j, evs in events.items() if any(_tag(e) == "accepted" for e in evs)]
    # The burst gets in, nothing more (the rate adds one a minute), the rest are told why.
    assert SUBMIT_BURST <= len(accepted) <= SUBMIT_BURST + 1, accepted
    assert len(limited) == FLOOD - len(accepted), sorted(events)
    reason = next(r for e in events[limited[0]] for r in getattr(e, "reasons", []))
    assert f"rate limit: mallory over 0.016 submits/s (burst {SUBMIT_BURST})" in reason
    assert "retry in" in reason


def _tag(event: object) -> str:
    return type(event).__struct_config__.tag  # type: ignore[attr-defined,no-any-return]


def _announced(events: list[object]) -> bool:
    return any(_tag(e) in ("accepted", "rejected") for e in events)


def _limit_reason(event: object, what: str) -> bool:
    return _tag(event) == "rejected" and any(
        f"{what}/s" in r and r.startswith("rate limit:") for r in getattr(event, "reasons", [])
    )


async def test_api_requests_per_caller_are_bounded(stack: SecureNats) -> None:
    carol = await stack.connect("user", "carol")
    root = await stack.connect("admin", "root")
    try:
        results = await asyncio.gather(
            *(api(carol, API_JOBS, caller="carol") for _ in range(API_BURST * 3)),
            return_exceptions=True,
        )
        refused = [r for r in results if isinstance(r, ApiFailed)]
        assert len(refused) >= API_BURST * 2 - 1, results
        assert all("rate limit: carol over 0.016 API requests/s" in str(r) for r in refused)
        # An admin is not limited, nor is another user.
        for _ in range(API_BURST * 2):
            await api(root, API_JOBS, caller="root")
        dave = await stack.connect("user", "dave")
        try:
            assert isinstance(await api(dave, API_JOBS, caller="dave"), list)
        finally:
            await dave.close()
    finally:
        await carol.close()
        await root.close()
    rc, _, err = await gpulayer("jobs", env=stack.env("user", "carol"))
    assert rc == 1, err
    assert "rate limit: carol over" in err
    assert "Traceback" not in err


async def test_doctor_requests_past_the_probes_bucket_are_refused(stack: SecureNats) -> None:
    env = stack.env("admin", "root")
    first = await gpulayer("doctor", NODE, "--timeout", "60", env=env, timeout=90)
    assert first[0] in (0, 1), first
    assert "rate limited" not in first[2]
    rc, out, err = await gpulayer("doctor", NODE, "--timeout", "60", env=env, timeout=90)
    assert rc == 1, (rc, out, err)
    assert f"node '{NODE}': rate limited: node {NODE} answers 1 doctor requests" in err, err
    assert "retry in" in err
    assert "no probe answered" not in err


async def _audit_until(js: object, q: Query, want: int) -> list[AuditRecord]:
    """The records matching ``q`` once there are ``want`` (placement sends them in the
    background): asked again until then."""
    async with asyncio.timeout(30):
        while True:
            found = await read_audit(js, q, timeout=0.5)  # type: ignore[arg-type]
            if len(found) >= want:
                return found
            await asyncio.sleep(0.2)


async def test_submits_cancels_and_quota_changes_are_audited(stack: SecureNats) -> None:
    erin = await stack.connect("user", "erin")
    root = await stack.connect("admin", "root")
    try:
        await submit(erin, JobRequest(job_id="erin-ok", command=["true"]), owner="erin")
        await submit(erin, JobRequest(job_id="erin-bad", command=[]), owner="erin")
        await submit(erin, JobRequest(job_id="erin-sleep", command=["sleep", "300"]), owner="erin")
        root_js = root.jetstream()
        await _audit_until(root_js, Query(who="erin", action="submit"), 3)  # all three stored
        await api(erin, API_CANCEL, {"job_id": "erin-sleep"}, caller="erin")
        with pytest.raises(ApiFailed, match="only admins"):
            await api(erin, API_QUOTA, {"op": "set", "owner": "erin", "jobs": 99}, caller="erin")
        await api(root, API_QUOTA, {"op": "set", "owner": "erin", "jobs": 50}, caller="root")
        js = root.jetstream()
        erins = await _audit_until(js, Query(who="erin"), 5)
        rows = {(r.action, r.target, r.outcome) for r in erins}
        assert ("submit", "erin-ok", "accepted") in rows
        assert ("submit", "erin-bad", "rejected") in rows
        assert ("submit", "erin-sleep", "accepted") in rows
        assert any(a == "cancel" and t == "erin-sleep" for a, t, _ in rows), rows
        assert ("quota-set", "erin", "denied") in rows
        assert all(r.role == "user" for r in erins)
        quota = await _audit_until(js, Query(who="root", action="quota-set"), 1)
        assert quota[-1].target == "erin"
        assert quota[-1].outcome == "ok"
        assert quota[-1].role == "admin"
        assert '"jobs": 50' in quota[-1].detail or '"jobs":50' in quota[-1].detail
    finally:
        await erin.close()
        await root.close()
    rc, out, err = await gpulayer(
        "audit", "--who", "erin", "--json", env=stack.env("admin", "root")
    )
    assert rc == 0, err
    shown = msgspec.convert(json.loads(out), list[AuditRecord])
    assert {r.identity for r in shown} == {"erin"}
    assert {"erin-ok", "erin-bad", "erin-sleep"} <= {r.target for r in shown}
    rc, out, err = await gpulayer(
        "audit", "--who", "erin", "--action", "cancel", env=stack.env("admin", "root")
    )
    assert rc == 0, err
    assert "erin-sleep" in out
    assert "erin-ok" not in out
    rc, out, _ = await gpulayer(
        "audit", "--who", "erin", "--until", "1d", env=stack.env("admin", "root")
    )
    assert rc == 0
    assert "erin-ok" not in out


async def test_a_user_may_neither_read_nor_forge_the_audit_trail(stack: SecureNats) -> None:
    rc, out, err = await gpulayer("audit", env=stack.env("user", "frank"), timeout=30)
    assert rc == DENIED, (rc, out, err)
    assert "permission denied: user frank may not" in err, err
    assert "audit trail" in err
    assert "Traceback" not in err
    refused: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def on_error(e: Exception) -> None:
        if not refused.done():
            refused.set_result(str(e))

    frank = await stack.connect("user", "frank", error_cb=on_error)
    try:
        forged = AuditRecord(identity="root", role="admin", action="mint", target="user frank")
        await frank.publish(audit_subject("mint"), encode([forged]))
        await frank.flush()
        assert "permissions violation for publish" in await asyncio.wait_for(refused, 10)
    finally:
        await frank.close()
    root = await stack.connect("admin", "root")
    try:
        info = await root.jetstream().stream_info("AUDIT")
        found = await read_audit(root.jetstream(), Query(action="mint"), timeout=0.5)
        assert not any(r.target == "user frank" for r in found), (info, found)
    finally:
        await root.close()


async def test_the_cli_helper_records_a_credential_change(
    stack: SecureNats, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpulayer_cli.audit_cmd import record_credential_change

    for key, value in stack.env("admin", "root").items():
        if key.startswith("GPULAYER_"):
            monkeypatch.setenv(key, value)
    ok = await asyncio.to_thread(record_credential_change, "revoke", "user mallory", "ok", "leaked")
    assert ok
    root = await stack.connect("admin", "root")
    try:
        found = await _audit_until(root.jetstream(), Query(who="root", action="revoke"), 1)
    finally:
        await root.close()
    assert found[-1].target == "user mallory"
    assert found[-1].role == "admin"
    assert found[-1].detail == "leaked"
