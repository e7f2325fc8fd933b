"""The services as processes, each with its own role's credential, against a nats-server with
the generated auth config: a user's job runs end to end, and placement refuses one user's
attempts on another user's job (cancel, env)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats.errors
import pytest
from nats.aio.client import Client
from tests.helpers import SecureNats, secure_stack

from gpulayer_cli.client import ApiFailed, ApiUnavailable, api, follow_events, history, submit
from gpulayer_contracts import JobRequest
from gpulayer_contracts.subjects import API_CANCEL, API_JOB, API_JOBS

pytestmark = pytest.mark.e2e

NODE = "secure-node"


@pytest.fixture
async def stack(
    secure_nats: SecureNats, database_url: str, tmp_path: Path
) -> AsyncIterator[SecureNats]:
    """Placement, executor and probe, each with its own credential; ready once placement
    sees the node's executor."""
    async with secure_stack(secure_nats, database_url, tmp_path, NODE) as stack:
        yield stack


async def _job(nc: Client, caller: str, job_id: str) -> dict[str, Any]:
    record = await api(nc, API_JOB, {"job_id": job_id}, caller=caller)
    assert isinstance(record, dict)
    return record


async def test_a_users_job_runs_and_only_its_owner_sees_its_env(stack: SecureNats) -> None:
    alice = await stack.connect("user", "alice")
    bob = await stack.connect("user", "bob")
    admin = await stack.connect("admin", "root")
    try:
        job = JobRequest(
            job_id="alice-hello", command=["echo", "hello"], env={"HF_TOKEN": "hf_secret"}
        )
        await submit(alice, job, owner="alice")
        tags = [
            type(e).__struct_config__.tag
            async for e in follow_events(alice, [job.job_id], owner="alice")
        ]
        assert tags[0] == "accepted"
        assert tags[-1] == "succeeded", tags
        mine = await _job(alice, "alice", job.job_id)
        assert mine["owner"] == "alice"
        assert mine["request"]["env"] == {"HF_TOKEN": "hf_secret"}
        # Another user sees the job, not the value; an admin sees everything.
        theirs = await _job(bob, "bob", job.job_id)
        assert theirs["request"]["env"] == {"HF_TOKEN": "<redacted>"}
        assert "hf_secret" not in repr(theirs)
        assert (await _job(admin, "root", job.job_id))["request"]["env"] == {
            "HF_TOKEN": "hf_secret"
        }
        listed = await api(bob, API_JOBS, {}, caller="bob")
        assert [(j["job_id"], j["owner"]) for j in listed] == [("alice-hello", "alice")]
        # Bob can't read alice's events either (the server refuses his consumer).
        with pytest.raises(nats.errors.TimeoutError):  # the server dropped the request
            await history(bob, job.job_id, timeout=2, owner="alice")
        assert [
            type(e).__struct_config__.tag for e in await history(alice, job.job_id, owner="alice")
        ] == tags
        # Asking as someone else is refused by NATS: placement never hears it.
        with pytest.raises(ApiUnavailable):
            await api(bob, API_JOB, {"job_id": job.job_id}, caller="alice", timeout=2)
    finally:
        for nc in (alice, bob, admin):
            await nc.close()


async def test_a_user_cannot_cancel_another_users_job(stack: SecureNats) -> None:
    alice = await stack.connect("user", "alice")
    bob = await stack.connect("user", "bob")
    try:
        job = JobRequest(job_id="alice-sleeps", command=["sleep", "60"])
        await submit(alice, job, owner="alice")
        async for _ in follow_events(
            alice,
            [job.job_id],
            owner="alice",
            stop_when=lambda e: e.__struct_config__.tag == "running",
        ):
            pass
        with pytest.raises(ApiFailed, match="belongs to another user"):
            await api(bob, API_CANCEL, {"job_id": job.job_id}, caller="bob")
        # Nothing changed: not cancelled (placement may not have applied "running" yet), no
        # cancel in its history, and the process still runs (its owner's cancel ends it below).
        assert (await _job(alice, "alice", job.job_id))["state"] in ("placed", "running")
        tags = [
            type(e).__struct_config__.tag for e in await history(alice, job.job_id, owner="alice")
        ]
        assert "cancelled" not in tags
        # Its owner may.
        assert (await api(alice, API_CANCEL, {"job_id": job.job_id}, caller="alice"))[
            "state"
        ] == "cancelling"
        async for event in follow_events(alice, [job.job_id], owner="alice"):
            last = event.__struct_config__.tag
        assert last == "cancelled"
    finally:
        await alice.close()
        await bob.close()
