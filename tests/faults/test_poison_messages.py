"""One bad message never stops placement (issue 11).

One placement and one executor run for the whole module, against their own NATS server and
database. Each test sends one bad message (a job, a status report, a capabilities report), then
checks that placement is still running (its stop event unset; a task that died fails the test
through ``task_crashes``), that the bad message got its ``rejected`` event or dead-letter entry
naming the reason, and that a normal job submitted after it runs to ``succeeded`` on the real
executor.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import asyncpg
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig
from tests.helpers import TEST_PUBLIC_KEYS, TEST_SIGNER, Postgres

from gpulayer_cli.dlq import dead_letters
from gpulayer_contracts import (
    AcceleratorDevice,
    HostInfo,
    JobStatus,
    WorkerCapabilities,
    __version__,
    encode,
    validate_job,
)
from gpulayer_contracts.codec import event_decoder
from gpulayer_contracts.events import AnyJobEvent
from gpulayer_contracts.jobenv import base_environment
from gpulayer_contracts.subjects import (
    DLQ_CLASS_HEADER,
    DLQ_REASON_HEADER,
    DLQ_STREAM_HEADER,
    DLQ_SUBJECT_HEADER,
    JOB_WILDCARD_EVENTS,
    JOBS_SUBMIT,
    MSG_ID_HEADER,
    node_capabilities,
    node_observations,
    node_status,
)
from gpulayer_executor.service import Executor, ExecutorConfig
from gpulayer_placement import submits as submits_module
from gpulayer_placement.service import PlacementService, Settings
from gpulayer_placement.store import create_pool
from gpulayer_runtime.nats import connect, ensure_streams
from gpulayer_runtime.servers import EmbeddedNats

pytestmark = pytest.mark.integration

NODE = "poison-node"
PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"
# Normal jobs ask for a Python only NODE reports, so they never go to the other nodes the tests
# add (a node without an executor would never run them).
NORMAL_REQUIREMENTS = {"python": ">=3"}


def node_caps(node_id: str, *, python: str | None = None, **kw: Any) -> WorkerCapabilities:
    return WorkerCapabilities(
        node_id=node_id,
        agent_version=__version__,
        detected_at=datetime.now(UTC),
        host=HostInfo(platform="linux-x86_64", os="linux", cpu_cores=4),
        workload_python_version=python,
        **kw,
    )


@dataclass
class Stack:
    nc: Client  # the test's own connection
    placement_nc: Client
    svc: PlacementService
    executor: Executor
    database_url: str
    events: dict[str, list[AnyJobEvent]] = field(default_factory=dict)
    dead: list[Msg] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def on_event(self, msg: Msg) -> None:
        event = event_decoder.decode(msg.data)
        self.events.setdefault(event.job_id, []).append(event)
        self.changed.set()

    async def on_dead(self, msg: Msg) -> None:
        self.dead.append(msg)
        self.changed.set()

    async def until(self, found: Callable[[], Any], timeout: float = 20.0) -> Any:
        """Wait for the events or dead letters collected so far to satisfy ``found``."""

        async def wait() -> Any:
            while not (result := found()):
                self.changed.clear()
                await self.changed.wait()
            return result

        return await asyncio.wait_for(wait(), timeout)

    def event(self, job_id: str, tag: str) -> AnyJobEvent | None:
        for e in self.events.get(job_id, []):
            if e.__struct_config__.tag == tag:
                return e
        return None

    async def rejected(self, job_id: str) -> list[str]:
        event = await self.until(lambda: self.event(job_id, "rejected"))
        return list(event.reasons)

    async def dead_letter(self, marker: bytes) -> Msg:
        """The dead letter whose body holds ``marker``."""
        return cast(
            Msg, await self.until(lambda: next((m for m in self.dead if marker in m.data), None))
        )

    async def submit(self, body: bytes, msg_id: str | None = None) -> None:
        headers = {MSG_ID_HEADER: msg_id or uuid.uuid4().hex}
        await self.nc.jetstream().publish(JOBS_SUBMIT, body, headers=headers)

    async def normal_job_succeeds(self) -> None:
        """Placement still runs, and a normal job submitted now runs to ``succeeded``."""
        job_id = f"ok-{uuid.uuid4().hex[:10]}"
        job = {"job_id": job_id, "command": ["true"], "requirements": NORMAL_REQUIREMENTS}
        await self.submit(json.dumps(job).encode(), job_id)
        await self.until(
            lambda: self.event(job_id, "succeeded") or self.event(job_id, "failed"), 30
        )
        assert self.event(job_id, "succeeded") is not None, self.events[job_id]
        assert not self.svc.stop.is_set()
        assert self.placement_nc.is_connected
        assert self.placement_nc.stats["reconnects"] == 0


@pytest.fixture(scope="module")
async def stack(
    tmp_path_factory: pytest.TempPathFactory, postgres: Postgres
) -> AsyncIterator[Stack]:
    tmp = tmp_path_factory.mktemp("poison")
    server = EmbeddedNats(tmp / "nats").start()
    # Stopped whatever happens below, setup included: a server left running would surface as
    # a ResourceWarning in some later test.
    try:
        name, database_url = await postgres.create()
        nc = await connect(server.url, "test")
        placement_nc = await connect(server.url, "placement")
        executor_nc = await connect(server.url, "executor")
        await ensure_streams(nc.jetstream())
        pool = await create_pool(database_url)
        svc = PlacementService(
            placement_nc, pool, Settings(node_timeout_s=30, resend_after_s=60), signer=TEST_SIGNER
        )
        await svc.start()
        executor = Executor(
            executor_nc,
            ExecutorConfig(
                node_id=NODE,
                workdir=tmp / "executor",
                base_env=base_environment(os.environ, user="tester", home=str(tmp)),
                kill_grace_s=0.5,
                fetch_timeout_s=0.2,
                placement_public_keys=TEST_PUBLIC_KEYS,
            ),
        )
        stop = asyncio.Event()
        executor_task = asyncio.create_task(executor.run(stop))
        await asyncio.wait_for(executor.ready.wait(), 10)
        s = Stack(nc, placement_nc, svc, executor, database_url)
        await nc.subscribe(JOB_WILDCARD_EVENTS, cb=s.on_event)
        await nc.subscribe("gpulayer.dlq.>", cb=s.on_dead)
        await nc.jetstream().publish(
            node_capabilities(NODE), encode(node_caps(NODE, python=PYTHON))
        )
        try:
            yield s
        finally:
            stop.set()
            await executor_task
            await svc.close()
            await pool.close()
            for client in (nc, placement_nc, executor_nc):
                await client.drain()
            await postgres.drop(name)
    finally:
        server.stop()


def job(job_id: str, **fields: Any) -> dict[str, Any]:
    return {"job_id": job_id, "command": ["true"], **fields}


def j(obj: Any) -> bytes:
    return json.dumps(obj).encode()


DEEP = 100_000
# (case, body, where the reason is named): each body names its job id, which is readable.
REJECTED: list[tuple[str, Callable[[str], bytes], str]] = [
    (
        "gpu_memory_1e308",
        lambda i: j(job(i, requirements={"gpu_memory_gb": 1e308})),
        "gpu_memory_gb",
    ),
    (
        "nested_100000_deep",
        lambda i: (
            f'{{"job_id": "{i}", "command": ["true"], "x": {"[" * DEEP}{"]" * DEEP}}}'.encode()
        ),
        "unknown field `x`",
    ),
    (
        "nested_100000_deep_before_the_id",
        lambda i: f'{{"x": {"[" * DEEP}{"]" * DEEP}, "job_id": "{i}"}}'.encode(),
        "unknown field `x`",
    ),
    ("oversize_1mb", lambda i: j(job(i, command=["echo"] + ["x" * 103_000] * 10)), "bytes encoded"),
    ("nul_in_command", lambda i: j(job(i, command=["echo", "a\x00b"])), "$.command"),
    ("nul_in_env", lambda i: j(job(i, env={"A": "a\x00b"})), "$.env"),
    ("nul_in_name", lambda i: j(job(i, name="a\x00b")), "$.name"),
    (
        "not_json",
        lambda i: f'{{"job_id": "{i}", "command": ["true"] oops'.encode(),
        "not valid JSON",
    ),
    ("json_array", lambda i: j([job(i)]), "Expected `object`, got `array`"),
    (
        "nan",
        lambda i: f'{{"job_id": "{i}", "command": ["true"], "timeout_s": NaN}}'.encode(),
        "JSON",
    ),
    (
        "invalid_utf8",
        lambda i: f'{{"job_id": "{i}", "command": ["echo", "'.encode() + b"\xff\xfe" + b'"]}',
        "Invalid UTF-8",
    ),
    ("out_of_range_int", lambda i: j(job(i, requirements={"gpu_count": 10**30})), "gpu_count"),
    ("timeout_1e308", lambda i: j(job(i, timeout_s=1e308)), "timeout_s"),
    ("env_name_with_equals", lambda i: j(job(i, env={"A=B": "x"})), "$.env"),
    ("env_name_empty", lambda i: j(job(i, env={"": "x"})), "$.env"),
    ("env_value_1mb", lambda i: j(job(i, env={"BIG": "x" * 1_000_000})), "$.env.BIG"),
]


@pytest.mark.parametrize(
    ("body", "named"), [(c[1], c[2]) for c in REJECTED], ids=[c[0] for c in REJECTED]
)
async def test_a_bad_job_with_a_readable_id_is_rejected_and_placement_goes_on(
    stack: Stack, body: Callable[[str], bytes], named: str
) -> None:
    job_id = f"bad-{uuid.uuid4().hex[:10]}"
    await stack.submit(body(job_id))
    reasons = await stack.rejected(job_id)
    assert any(named in r for r in reasons), reasons
    assert stack.event(job_id, "accepted") is None
    await stack.normal_job_succeeds()


# Bodies that name no job: each goes to the DLQ at once, with the reason.
DEAD: list[tuple[str, Callable[[str], bytes]]] = [
    ("integer_job_id", lambda m: j({"job_id": 5, "command": ["true"], "marker": m})),
    ("not_json_no_id", lambda m: f"{m} is no job at all".encode()),
    ("nested_no_id", lambda m: f'["{m}", {"[" * DEEP}{"]" * DEEP}]'.encode()),
    ("invalid_utf8_no_id", lambda m: m.encode() + b"\xff\xfe\x00"),
]


@pytest.mark.parametrize("body", [c[1] for c in DEAD], ids=[c[0] for c in DEAD])
async def test_a_message_that_names_no_job_is_dead_lettered_at_once(
    stack: Stack, body: Callable[[str], bytes]
) -> None:
    marker = f"marker-{uuid.uuid4().hex}"
    await stack.submit(body(marker))
    entry = await stack.dead_letter(marker.encode())
    headers = entry.headers or {}
    assert headers[DLQ_STREAM_HEADER] == "JOBS"
    assert headers[DLQ_SUBJECT_HEADER] == JOBS_SUBMIT
    assert headers[DLQ_CLASS_HEADER] == "malformed"
    assert "no job id could be read" in headers[DLQ_REASON_HEADER]
    await stack.normal_job_succeeds()
    listed = await dead_letters(stack.nc.jetstream(), 100)
    assert any(e["reason"] == headers[DLQ_REASON_HEADER] and e["stream"] == "JOBS" for e in listed)


async def test_nul_jobs_in_one_batch_are_rejected_and_the_others_of_the_batch_go_on(
    stack: Stack,
) -> None:
    ids = [f"batch-{k}-{uuid.uuid4().hex[:8]}" for k in range(6)]
    bodies = [
        j(job(ids[0], command=["echo", "\x00"])),
        j(job(ids[1], requirements=NORMAL_REQUIREMENTS)),
        j(job(ids[2], env={"X": "\x00"})),
        j(job(ids[3], requirements=NORMAL_REQUIREMENTS)),
        j(job(ids[4], name="\x00")),
        j(job(ids[5], requirements=NORMAL_REQUIREMENTS)),
    ]
    js = stack.nc.jetstream()
    acks = [await js.publish_async(JOBS_SUBMIT, b) for b in bodies]
    await asyncio.gather(*acks)
    for bad in ids[0::2]:
        assert any("NUL" in r or "\\x00" in r for r in await stack.rejected(bad))
    goods = ids[1::2]
    await stack.until(lambda: all(stack.event(g, "succeeded") for g in goods), 30)
    await stack.normal_job_succeeds()


async def test_rows_postgresql_refuses_are_rejected_one_by_one(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Were a bound missed (here: validation switched off), PostgreSQL refusing one row of a
    batch makes intake insert the rows one at a time: only that job is rejected, naming the
    database's reason, and the rest of the batch is placed."""

    class Accepting:
        def __init__(self, real: Any) -> None:
            self.real = real

        def __call__(self, job: Any) -> Any:
            result = self.real(job)
            return type(result)(errors=[], warnings=result.warnings)

    monkeypatch.setattr(submits_module, "validate_job", Accepting(validate_job))
    bad, good = f"pg-bad-{uuid.uuid4().hex[:8]}", f"pg-good-{uuid.uuid4().hex[:8]}"

    class Fake(Msg):
        async def ack(self) -> None:
            self._ackd = True

        async def nak(self, delay: float | None = None) -> None:
            self._ackd = True

    msgs = [
        Fake(cast(Any, None), subject=JOBS_SUBMIT, data=j(job(bad, name="\x00"))),
        Fake(
            cast(Any, None),
            subject=JOBS_SUBMIT,
            data=j(job(good, requirements=NORMAL_REQUIREMENTS)),
        ),
    ]
    await stack.svc.intake.ingest(cast(list[Msg], msgs))
    reasons = await stack.rejected(bad)
    assert any("could not be stored" in r for r in reasons), reasons
    await stack.until(lambda: stack.event(good, "succeeded"), 30)
    assert all(getattr(m, "_ackd", False) for m in msgs)
    await stack.normal_job_succeeds()


@pytest.mark.parametrize("kind", ["malformed", "out_of_range"])
async def test_a_poison_status_report_is_dead_lettered_and_placement_goes_on(
    stack: Stack, kind: str
) -> None:
    marker = f"status-{uuid.uuid4().hex[:10]}"
    if kind == "malformed":
        body = f'{{"job_id": "{marker}", "state": "runn'.encode()
        named = "not valid JSON"
    else:
        status = JobStatus(
            job_id=marker, grant_id=f"{marker}-1", node_id=NODE, state="failed", exit_code=2**40
        )
        body = encode(status)
        named = "$.exit_code"
    await stack.nc.jetstream().publish(node_status(NODE), body)
    entry = await stack.dead_letter(marker.encode())
    headers = entry.headers or {}
    assert headers[DLQ_STREAM_HEADER] == "STATUS"
    assert named in headers[DLQ_REASON_HEADER]
    await stack.normal_job_succeeds()


async def test_an_out_of_range_capabilities_report_is_refused_and_the_node_keeps_its_last(
    stack: Stack,
) -> None:
    other = f"other-{uuid.uuid4().hex[:8]}"
    gpu = AcceleratorDevice(accelerator="cuda", index=0, memory_mib=16_000)
    good = node_caps(other, accelerators=[gpu])
    js = stack.nc.jetstream()
    await js.publish(node_capabilities(other), encode(good))
    fleet = stack.svc.fleet
    await wait_until(lambda: fleet.get(other) is not None)
    bad = node_caps(other, accelerators=[AcceleratorDevice(accelerator="cuda", index=2**40)])
    await js.publish(node_capabilities(other), encode(bad))
    await wait_until(lambda: other in fleet.report_errors)
    assert "$.accelerators[0].index" in fleet.report_errors[other]
    view = fleet.get(other)
    assert view is not None
    assert [d.index for d in view.capabilities.accelerators] == [0]
    await stack.normal_job_succeeds()


async def test_poison_observations_are_dropped_and_the_consumer_goes_on(stack: Stack) -> None:
    """Garbage, a NaN, a huge number, a NUL and a forged node id on the observations subject:
    each is dropped and counted, and the next good message still changes the node's health."""
    other = f"obs-{uuid.uuid4().hex[:8]}"
    gpu = AcceleratorDevice(
        accelerator="cuda", index=0, memory_mib=16_000, execution_supported=True
    )
    await stack.nc.jetstream().publish(
        node_capabilities(other), encode(node_caps(other, accelerators=[gpu]))
    )
    fleet = stack.svc.fleet
    await wait_until(lambda: fleet.get(other) is not None)
    part = stack.svc.observations
    dropped = part.dropped
    subject = node_observations(other)
    now = datetime.now(UTC).isoformat()

    def obs(device: str, node: str = other) -> bytes:
        return f'{{"node_id": "{node}", "observed_at": "{now}", "devices": [{device}]}}'.encode()

    poison = [
        b"not json",
        b'{"node_id": [1, 2]}',
        obs('{"index": 0, "power_w": NaN}'),
        obs('{"index": 0, "ecc_uncorrected_volatile": 1e400}'),
        obs('{"index": 0, "temperature_c": 99999999999999999999999}'),
        obs('{"index": 0, "reason": "a\\u0000b", "health": "unhealthy"}'),
        b'{"node_id": "x", "observed_at": "' + now.encode() + b'", "devices": ' + b"[" * 5000,
    ]
    # One at a time: a batch keeps only the latest message per node.
    for i, body in enumerate(poison, 1):
        await stack.nc.publish(subject, body)
        await wait_until(lambda i=i: part.dropped - dropped >= i)  # type: ignore[misc]
    await stack.nc.publish("gpulayer.node.bad*node.observations", obs('{"index": 0}'))
    # A forged sender: the node id in the payload is not the subject's, and loses.
    await stack.nc.publish(
        subject, obs('{"index": 0, "health": "unhealthy", "reason": "ECC"}', node="someone-else")
    )
    await wait_until(lambda: fleet.get(other) is not None and bool(fleet.get(other).sick))  # type: ignore[union-attr]
    assert part.dropped - dropped >= len(poison)
    view = fleet.get(other)
    assert view is not None
    assert view.health == {0: "unhealthy: ECC"}
    assert "someone-else" not in part.latest
    await stack.normal_job_succeeds()


async def wait_until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    """For state with no event to await (the capabilities consumer's in-memory fleet)."""
    async with asyncio.timeout(timeout):
        while not cond():  # noqa: ASYNC110 - no event is sent for these
            await asyncio.sleep(0.02)


async def test_an_oversized_stored_grant_fails_its_job_instead_of_being_resent(
    stack: Stack,
) -> None:
    """A job stored before the size bound, placed, whose grant is over max_payload: the resend
    fails it with the reason, once, and keeps placement's connection."""
    job_id = f"old-big-{uuid.uuid4().hex[:8]}"
    request = encode({"job_id": job_id, "command": ["echo", "x" * 1_100_000]}).decode()
    conn = await asyncpg.connect(stack.database_url)
    try:
        await conn.execute(
            "INSERT INTO jobs (job_id, request, state, node_id, grant_id, accelerator, "
            "updated_at) VALUES ($1, $2::jsonb, 'placed', $3, $4, 'cpu', now() - interval '1 hour')",
            job_id,
            request,
            NODE,
            f"{job_id}-1",
        )
        await stack.svc.publisher.resend()
        row = await conn.fetchrow("SELECT state, reason FROM jobs WHERE job_id = $1", job_id)
    finally:
        await conn.close()
    assert row is not None
    assert row["state"] == "failed"
    assert "max_payload" in row["reason"]
    failed = await stack.until(lambda: stack.event(job_id, "failed"))
    assert "max_payload" in (failed.reason or "")
    await stack.normal_job_succeeds()


async def test_max_deliveries_advisories_are_counted(stack: Stack) -> None:
    """A consumer that gives up on a message (here one with max_deliver=1 that never acks)
    makes JetStream send the advisory; placement counts it."""
    js = stack.nc.jetstream()
    before = stack.svc.dead.max_deliveries
    sub = await js.pull_subscribe(
        JOB_WILDCARD_EVENTS,
        durable=f"adv-{uuid.uuid4().hex[:8]}",
        config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, max_deliver=1, ack_wait=0.5),
    )
    try:
        await sub.fetch(1, timeout=5)  # not acked
        await wait_until(lambda: stack.svc.dead.max_deliveries > before, 15)
    finally:
        await sub.unsubscribe()
    assert not stack.svc.stop.is_set()


async def test_gpulayer_dlq_lists_the_dead_letters(stack: Stack, tmp_path: Path) -> None:
    marker = f"cli-{uuid.uuid4().hex[:10]}"
    await stack.submit(f"{marker}: no job here".encode())
    await stack.dead_letter(marker.encode())
    env = dict(os.environ, GPULAYER_NATS_URL=stack.nc.connected_url.geturl())  # type: ignore[union-attr]
    proc = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).parent / "gpulayer"),
        "dlq",
        "--json",
        "--limit",
        "500",
        env=env,
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await proc.communicate()
    assert proc.returncode == 0
    entries = json.loads(out)
    mine = [e for e in entries if e["size"] == len(f"{marker}: no job here")]
    assert mine
    assert mine[-1]["stream"] == "JOBS"
    assert mine[-1]["subject"] == JOBS_SUBMIT
    assert "no job id could be read" in mine[-1]["reason"]
    assert mine[-1]["job_id"] is None
    assert mine[-1]["time"]
