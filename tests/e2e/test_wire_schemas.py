"""Every message a running stack puts on the wire validates against the schema `gpulayer schema`
prints for its subject (a validator from PyPI, jsonschema, not one of ours): job events from
accepted to succeeded, rejected, pending, failed and cancelled; grants, status reports, a cancel,
log lines, heartbeats, observations, and capabilities from a real probe: this machine's
(published, and in its doctor reply), and `gpulayer probe` reading nvidia-smi output captured on a real H200."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from tests.helpers import Services, bin_path, gpulayer, service_env, subscribed

from gpulayer_cli.client import api
from gpulayer_contracts import WIRE_SCHEMAS, schema_for_subject
from gpulayer_contracts.subjects import API_CANCEL, JOBS_SUBMIT, MSG_ID_HEADER, node_doctor
from gpulayer_runtime.nats import ensure_streams

pytestmark = pytest.mark.e2e

NODE = "schema-node"
GPU_NODE = "schema-h200"
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


class Wire:
    """Every message on ``gpulayer.>`` as (subject, decoded JSON body), in arrival order."""

    def __init__(self) -> None:
        self.messages: list[tuple[str, Any]] = []
        self._changed = asyncio.Condition()

    async def on_message(self, msg: Msg) -> None:
        try:
            body = json.loads(msg.data) if msg.data else None
        except ValueError:
            body = msg.data  # a garbage submit of the test's own; checked below
        async with self._changed:
            self.messages.append((msg.subject, body))
            self._changed.notify_all()

    def events(self, job_id: str) -> list[str]:
        return [
            b["type"]
            for subject, b in self.messages
            if schema_for_subject(subject) == "event" and b.get("job_id") == job_id
        ]

    async def until(self, predicate: Callable[[], bool], timeout: float = 30) -> None:
        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(predicate)


async def printed_schema(name: str) -> dict[str, Any]:
    rc, out, err = await gpulayer("schema", name, env=dict(os.environ))
    assert rc == 0, err
    schema: dict[str, Any] = json.loads(out)
    return schema


@pytest.fixture
async def wire(nats_url: str, database_url: str, tmp_path: Path, nc: Client) -> AsyncIterator[Wire]:
    await ensure_streams(nc.jetstream())
    wire = Wire()
    # Before the services start: the probe's first capabilities are on the wire too.
    sub = await nc.subscribe("gpulayer.>", cb=wire.on_message)
    await subscribed(nc)
    env = service_env(nats_url, database_url, tmp_path / "work", NODE, GPULAYER_KILL_GRACE_S="0.5")
    try:
        async with Services() as services:
            for name in ("gpulayer-placement", "gpulayer-executor", "gpulayer-probe"):
                await services.start(name, env, tmp_path / f"{name}.log")
            yield wire
    finally:
        await sub.unsubscribe()


async def _submit(nc: Client, job_id: str, body: dict[str, Any] | bytes) -> None:
    data = body if isinstance(body, bytes) else json.dumps({"job_id": job_id, **body}).encode()
    await nc.jetstream().publish(JOBS_SUBMIT, data, headers={MSG_ID_HEADER: job_id})


async def test_every_message_of_a_run_validates(wire: Wire, nc: Client) -> None:
    py = sys.executable
    await wire.until(lambda: any(schema_for_subject(s) == "capabilities" for s, _ in wire.messages))
    await _submit(
        nc,
        "ws-ok",
        {"command": [py, "-c", "print('out'); import sys; print('err', file=sys.stderr)"]},
    )
    await _submit(nc, "ws-fail", {"command": ["sh", "-c", "exit 3"]})
    await _submit(nc, "ws-rejected", {"command": []})
    await _submit(nc, "ws-garbage", b'{"job_id": "ws-garbage", "command": ')
    # No GPU on this node: the job waits, then is cancelled while pending (placement alone).
    gpu = {"requirements": {"accelerator": "cuda", "gpu_count": 1}, "command": ["true"]}
    await _submit(nc, "ws-pending", gpu)
    # A running job cancelled: placement sends the executor a cancel on the control subject.
    await _submit(nc, "ws-long", {"command": ["sleep", "60"]})

    await wire.until(lambda: "pending" in wire.events("ws-pending"))
    await api(nc, API_CANCEL, {"job_id": "ws-pending"})
    await wire.until(lambda: "running" in wire.events("ws-long"))
    await api(nc, API_CANCEL, {"job_id": "ws-long"})
    doctor = await nc.request(node_doctor(NODE), b"", timeout=60)

    ends = {
        "ws-ok": "succeeded",
        "ws-fail": "failed",
        "ws-rejected": "rejected",
        "ws-garbage": "rejected",
        "ws-pending": "cancelled",
        "ws-long": "cancelled",
    }
    await wire.until(lambda: all(end in wire.events(j) for j, end in ends.items()))
    # The executor's report of the cancelled run, and a heartbeat from each sender.
    await wire.until(
        lambda: (
            any(
                schema_for_subject(s) == "status"
                and b["job_id"] == "ws-long"
                and b["state"] == "cancelled"
                for s, b in wire.messages
            )
            and {b.get("source") for s, b in wire.messages if schema_for_subject(s) == "heartbeat"}
            >= {"probe", "executor"}
        )
    )

    validators = {
        name: jsonschema.Draft202012Validator(await printed_schema(name)) for name in WIRE_SCHEMAS
    }
    checked: dict[str, int] = dict.fromkeys(WIRE_SCHEMAS, 0)
    for subject, body in list(wire.messages):
        name = schema_for_subject(subject)
        if name is None:
            continue
        if name == "job" and (not isinstance(body, dict) or body["job_id"] in ("ws-rejected",)):
            # What placement rejected is no job request: the schema says so too.
            assert not validators["job"].is_valid(body), body
            continue
        errors = [e.message for e in validators[name].iter_errors(body)]
        assert not errors, f"{subject}: {errors}: {body}"
        checked[name] += 1
    # The doctor's reply (on the requester's inbox) is a DoctorReport holding the capabilities.
    report = json.loads(doctor.data)
    validators["doctor"].validate(report)
    validators["capabilities"].validate(report["capabilities"])
    checked["doctor"] += 1

    assert all(checked.values()), checked  # every kind of message was seen (and passed)
    types = {b["type"] for s, b in wire.messages if schema_for_subject(s) == "event"}
    assert types >= {
        "accepted", "placed", "running", "succeeded", "failed", "rejected", "pending", "cancelled",
    }  # fmt: skip
    logs = {b["line"] for s, b in wire.messages if schema_for_subject(s) == "log"}
    assert {"out", "err"} <= logs


async def test_capabilities_of_a_probe_on_an_h200_validate(tmp_path: Path) -> None:
    """`gpulayer probe` (the probe service's detection) with nvidia-smi answering as a real H200
    did (tests/fixtures/nvidia-smi/h200-1x, captured on one)."""
    tools = tmp_path / "bin"
    tools.mkdir()
    shutil.copy(FIXTURES / "nvidia-smi" / "fake-nvidia-smi", tools / "nvidia-smi")
    env = dict(
        os.environ,
        GPULAYER_NODE_ID=GPU_NODE,
        PATH=f"{tools}{os.pathsep}{os.environ['PATH']}",
        FAKE_NVIDIA_SMI_DIR=str(FIXTURES / "nvidia-smi" / "h200-1x"),
    )
    proc = await asyncio.create_subprocess_exec(
        bin_path("gpulayer"), "probe", "--no-torch", env=env, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0
    caps = json.loads(out)
    jsonschema.Draft202012Validator(await printed_schema("capabilities")).validate(caps)
    assert caps["node_id"] == GPU_NODE
    devices = [(d["name"], d["memory_mib"], d["execution_supported"]) for d in caps["accelerators"]]
    assert devices == [("NVIDIA H200", 143771, True)]
    assert "cuda" in caps["gpu_apis"]["host"]
