"""Signed grants and cancels against real NATS (and PostgreSQL where placement runs): what any
client with full NATS rights publishes straight to JetStream is refused by the executor (not
run, not recorded, not reported, counted and logged); what placement signs runs, and a cancel
through the API still works."""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from tests.helpers import (
    TEST_KEY,
    TEST_PUBLIC_KEYS,
    TEST_SIGNER,
    linux_node,
    publish_cancel,
    publish_grant,
    running_executor,
)
from tests.integration.test_executor import (
    grants_settled,
    job_events_until_terminal,
    make_grant,
    wait_for_event,
)

from gpulayer_cli.client import api
from gpulayer_contracts import CancelJob, encode
from gpulayer_contracts.events import Grant
from gpulayer_contracts.jobenv import base_environment
from gpulayer_contracts.subjects import (
    API_CANCEL,
    JOBS_SUBMIT,
    MSG_ID_HEADER,
    job_events,
    node_capabilities,
    node_grants,
    node_status,
)
from gpulayer_executor.service import Executor, ExecutorConfig
from gpulayer_placement.service import PlacementService, Settings
from gpulayer_placement.store import create_pool
from gpulayer_runtime.nats import ensure_streams
from gpulayer_runtime.signing import (
    DEFAULT_MAX_AGE_S,
    SIGNATURE_HEADER,
    Signer,
    Verifier,
    parse_public_keys,
)

pytestmark = pytest.mark.integration

NODE = "node-s"
ATTACKER = Signer(Ed25519PrivateKey.generate())


@pytest.fixture
async def js(nc: Client) -> JetStreamContext:
    js = nc.jetstream()
    await ensure_streams(js)
    return js


@pytest.fixture
async def executor(nc: Client, js: JetStreamContext, tmp_path: Path) -> AsyncIterator[Executor]:
    config = ExecutorConfig(
        node_id=NODE,
        workdir=tmp_path / "executor",
        base_env=base_environment(os.environ, user="tester", home=str(tmp_path)),
        kill_grace_s=0.5,
        fetch_timeout_s=0.2,
        placement_public_keys=TEST_PUBLIC_KEYS,
    )
    async with running_executor(nc, config) as ex:
        yield ex


@pytest.fixture
async def placement(
    nc: Client, js: JetStreamContext, database_url: str
) -> AsyncIterator[PlacementService]:
    pool = await create_pool(database_url)
    svc = PlacementService(
        nc, pool, Settings(node_timeout_s=30, resend_after_s=0.3), signer=TEST_SIGNER
    )
    await svc.start()
    yield svc
    await svc.close()
    await pool.close()


async def stored(js: JetStreamContext, stream: str, subject: str) -> list[bytes]:
    """Every payload the stream holds on ``subject`` (read by sequence, consuming nothing)."""
    state = (await js.stream_info(stream)).state
    out = []
    for seq in range(state.first_seq, state.last_seq + 1) if state.messages else ():
        try:
            msg = await js.get_msg(stream, seq)
        except Exception:  # deleted (a work queue's acked message): nothing there
            continue
        if msg.subject == subject and msg.data:
            out.append(msg.data)
    return out


async def publish_raw(
    js: JetStreamContext, subject: str, data: bytes, headers: dict[str, str]
) -> None:
    await js.publish(subject, data, headers={MSG_ID_HEADER: uuid.uuid4().hex, **headers})


def forged(grant: Grant, benign: Grant) -> list[tuple[str, bytes, dict[str, str], str]]:
    """(case, payload, headers, expected reason): what an attacker with full NATS rights can
    publish on this node's grants subject to run ``grant``; ``benign`` is a grant placement
    really signed, under the same grant id."""
    data = encode(grant)
    real = TEST_SIGNER.headers("grant", NODE, grant.grant_id, data)
    old = Signer(TEST_KEY, clock=lambda: time.time() - DEFAULT_MAX_AGE_S - 60)
    elsewhere = msgspec.structs.replace(grant, node_id="node-b")
    for_b = encode(elsewhere)
    forged_sig = ATTACKER.headers("grant", NODE, grant.grant_id, data)[SIGNATURE_HEADER]
    real_sig = real[SIGNATURE_HEADER]
    return [
        ("unsigned", data, {}, "unsigned"),
        ("other key", data, ATTACKER.headers("grant", NODE, grant.grant_id, data), "unknown_key"),
        (
            "other key, placement's key id",
            data,
            {SIGNATURE_HEADER: TEST_SIGNER.key_id + "." + forged_sig.split(".", 1)[1]},
            "bad_signature",
        ),
        # Placement's real signature over the benign grant, sent with the evil bytes.
        (
            "tampered",
            data,
            TEST_SIGNER.headers("grant", NODE, benign.grant_id, encode(benign)),
            "bad_signature",
        ),
        # Placement's real grant for node-b, copied onto this node's subject.
        (
            "wrong node",
            for_b,
            TEST_SIGNER.headers("grant", "node-b", grant.grant_id, for_b),
            "wrong_node",
        ),
        # Naming this node, but signed for node-b.
        (
            "moved",
            data,
            TEST_SIGNER.headers("grant", "node-b", grant.grant_id, data),
            "bad_signature",
        ),
        # A genuine grant issued longer ago than the bound (its record pruned since).
        ("replayed old", data, old.headers("grant", NODE, grant.grant_id, data), "expired"),
        ("junk header", data, {SIGNATURE_HEADER: real_sig.replace(".", ".x", 1)}, "malformed"),
    ]


async def test_grants_not_signed_by_placement_for_this_node_leave_no_trace(
    js: JetStreamContext, executor: Executor, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    marker = tmp_path / "forged-ran"
    benign = make_grant(["true"], node_id=NODE)
    evil = make_grant(["touch", str(marker)], node_id=NODE, job_id=benign.job.job_id)
    evil = msgspec.structs.replace(evil, grant_id=benign.grant_id)
    cases = forged(evil, benign)
    with caplog.at_level(logging.ERROR, logger="gpulayer_executor.service"):
        for _, data, headers, _ in cases:
            await publish_raw(js, node_grants(NODE), data, headers)
        await grants_settled(js, "GRANTS", f"executor-{NODE}")
    expected: dict[tuple[str, str], int] = {}
    for _, _, _, why in cases:
        expected[("grant", why)] = expected.get(("grant", why), 0) + 1
    assert dict(executor.intake.refused) == expected
    assert not marker.exists()
    assert executor.store.load(evil.grant_id) is None
    assert executor.runner.jobs == {}
    assert await stored(js, "JOB_EVENTS", job_events(evil.job.job_id)) == []
    assert await stored(js, "STATUS", node_status(NODE)) == []
    refusals = [
        r.getMessage() for r in caplog.records if r.getMessage().startswith("refused grant")
    ]
    assert len(refusals) == len(cases)
    assert all(evil.grant_id in line for line in refusals)
    # The consumer goes on, and what placement signed runs.
    await publish_grant(js, benign)
    events = await job_events_until_terminal(js, benign.job.job_id)
    assert [e.__struct_config__.tag for e in events] == ["running", "succeeded"]


async def test_a_signed_grant_published_again_runs_once(
    js: JetStreamContext, executor: Executor, tmp_path: Path
) -> None:
    starts = tmp_path / "starts"
    grant = make_grant(["sh", "-c", f'echo start >> "{starts}"'], node_id=NODE)
    data = encode(grant)
    headers = TEST_SIGNER.headers("grant", NODE, grant.grant_id, data)
    await publish_raw(js, node_grants(NODE), data, headers)
    await job_events_until_terminal(js, grant.job.job_id)
    # The very same signed message again (a fresh message id, so JetStream keeps it).
    await publish_raw(js, node_grants(NODE), data, headers)
    await grants_settled(js, "GRANTS", f"executor-{NODE}")
    assert executor.intake.refused == {("grant", "replayed"): 1}
    assert starts.read_text() == "start\n"
    kinds = [
        msgspec.json.decode(m)["type"]
        for m in await stored(js, "JOB_EVENTS", job_events(grant.job.job_id))
    ]
    assert kinds == ["running", "succeeded"]


async def cancels_settled(js: JetStreamContext) -> None:
    await grants_settled(js, "CONTROL", f"executor-{NODE}-control")


async def test_unsigned_and_forged_cancels_neither_stop_a_job_nor_wait_for_one(
    js: JetStreamContext, executor: Executor
) -> None:
    grant = make_grant(
        ["sh", "-c", "while [ ! -e go ]; do sleep 0.02; done"], node_id=NODE, timeout_s=30
    )
    await publish_grant(js, grant)
    await wait_for_event(js, grant.job.job_id, "running")
    later = make_grant(["true"], node_id=NODE)  # not submitted yet
    for target in (grant, later):
        cancel = CancelJob(job_id=target.job.job_id, grant_id=target.grant_id)
        await publish_cancel(js, NODE, cancel, signer=None)
        await publish_cancel(js, NODE, cancel, signer=ATTACKER)
    await cancels_settled(js)
    assert executor.intake.refused == {("cancel", "unsigned"): 2, ("cancel", "unknown_key"): 2}
    assert executor.store.cancel_mark(grant.job.job_id) is None
    assert executor.store.cancel_mark(later.job.job_id) is None
    (executor.store.job_dir(grant.grant_id) / "go").touch()
    events = await job_events_until_terminal(js, grant.job.job_id)
    assert [e.__struct_config__.tag for e in events] == ["running", "succeeded"]
    # The job whose id was cancelled before it existed runs when it comes.
    await publish_grant(js, later)
    events = await job_events_until_terminal(js, later.job.job_id)
    assert [e.__struct_config__.tag for e in events] == ["running", "succeeded"]


async def test_a_signed_cancel_before_its_grant_still_applies(
    js: JetStreamContext, executor: Executor, tmp_path: Path
) -> None:
    marker = tmp_path / "late-started"
    grant = make_grant(["touch", str(marker)], node_id=NODE)
    await publish_cancel(js, NODE, CancelJob(job_id=grant.job.job_id, grant_id=grant.grant_id))
    await cancels_settled(js)
    await publish_grant(js, grant)
    events = await job_events_until_terminal(js, grant.job.job_id)
    assert [e.__struct_config__.tag for e in events] == ["cancelled"]
    assert not marker.exists()


async def submit(js: JetStreamContext, job_id: str, command: list[str]) -> None:
    body = msgspec.json.encode({"job_id": job_id, "command": command})
    await js.publish(JOBS_SUBMIT, body, headers={MSG_ID_HEADER: job_id})


async def test_placement_signs_grants_and_cancels_and_the_executor_runs_them(
    nc: Client, js: JetStreamContext, executor: Executor, placement: PlacementService
) -> None:
    await js.publish(node_capabilities(NODE), encode(linux_node(NODE)))
    job_id = f"signed-{uuid.uuid4().hex[:8]}"
    await submit(js, job_id, ["sleep", "600"])
    await wait_for_event(js, job_id, "running")
    reply = await api(nc, API_CANCEL, {"job_id": job_id})
    assert reply["state"] == "cancelling"
    events = await job_events_until_terminal(js, job_id)
    assert [e.__struct_config__.tag for e in events][-2:] == ["running", "cancelled"]
    assert executor.intake.refused == {}


async def test_resent_grants_carry_a_valid_signature(
    nc: Client, js: JetStreamContext, placement: PlacementService
) -> None:
    """No executor: the grant stays placed, so placement re-sends it (resend_after_s=0.3)."""
    node = "node-idle"
    seen: list[Msg] = []
    twice = asyncio.Event()

    async def on_grant(msg: Msg) -> None:
        seen.append(msg)
        if len(seen) >= 2:
            twice.set()

    sub = await nc.subscribe(node_grants(node), cb=on_grant)
    await js.publish(node_capabilities(node), encode(linux_node(node)))
    await submit(js, f"resent-{uuid.uuid4().hex[:8]}", ["true"])
    await asyncio.wait_for(twice.wait(), 20)
    await sub.unsubscribe()
    verifier = Verifier(parse_public_keys(TEST_SIGNER.public_key))
    first, again = seen[:2]
    for msg in (first, again):
        grant_id = msgspec.json.decode(msg.data)["grant_id"]
        assert verifier.refusal("grant", node, grant_id, msg.data, msg.headers) is None
    assert first.headers is not None
    assert again.headers is not None
    assert first.headers[MSG_ID_HEADER] == again.headers[MSG_ID_HEADER]


async def test_a_batch_of_grants_under_one_signature_all_run(
    nc: Client, js: JetStreamContext, executor: Executor, database_url: str
) -> None:
    """Jobs queued before placement starts are placed together: their grants share one
    signature, each with its own path to the signed root, and the executor runs every one."""
    await js.publish(node_capabilities(NODE), encode(linux_node(NODE)))
    job_ids = [f"batch-{i}-{uuid.uuid4().hex[:6]}" for i in range(6)]
    for job_id in job_ids:
        await submit(js, job_id, ["true"])
    headers: list[str] = []

    async def on_grant(msg: Msg) -> None:
        headers.append((msg.headers or {}).get(SIGNATURE_HEADER, ""))

    sub = await nc.subscribe(node_grants(NODE), cb=on_grant)
    pool = await create_pool(database_url)
    svc = PlacementService(nc, pool, Settings(node_timeout_s=30), signer=TEST_SIGNER)
    await svc.start()
    try:
        for job_id in job_ids:
            events = await job_events_until_terminal(js, job_id)
            assert events[-1].__struct_config__.tag == "succeeded"
    finally:
        await sub.unsubscribe()
        await svc.close()
        await pool.close()
    assert executor.intake.refused == {}
    batched = [h for h in headers if len(h.split(".")) == 6]
    assert batched, headers
    assert len({h.split(".")[2] for h in batched}) < len(batched)  # shared signatures
