"""A simulated heterogeneous fleet on this machine: probe + executor pairs with recorded
nvidia-smi output first on their PATH (8x H100, 2x T4), a CPU node, and an Apple node's
capabilities. Each job lands only where its requirements hold, or says why not."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from nats.aio.client import Client
from tests.helpers import Services, events_until, signing_env

from gpulayer_cli.client import api
from gpulayer_contracts import GpuApis, HostInfo, WorkerCapabilities, __version__, encode
from gpulayer_contracts.subjects import (
    API_EXPLAIN,
    API_NODES,
    JOBS_SUBMIT,
    MSG_ID_HEADER,
    node_capabilities,
    node_heartbeat,
)
from gpulayer_detection.apple import parse_system_profiler
from gpulayer_runtime.nats import ensure_streams

pytestmark = pytest.mark.e2e

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def apple_caps() -> WorkerCapabilities:
    memory = 32 * 2**30
    devices = parse_system_profiler(
        (FIXTURES / "system_profiler" / "m2-pro.json").read_text(), memory
    )
    return WorkerCapabilities(
        node_id="apple-m2",
        agent_version=__version__,
        detected_at=datetime.now(UTC),
        host=HostInfo(os="darwin", platform="darwin-arm64", arch="arm64", memory_bytes=memory),
        accelerators=devices,
        gpu_apis=GpuApis(host=["metal"], evidence={"metal": "recorded system_profiler"}),
    )


@pytest.fixture
async def fleet(
    nats_url: str, database_url: str, tmp_path: Path, nc: Client
) -> AsyncIterator[dict[str, str]]:
    await ensure_streams(nc.jetstream())
    base = dict(os.environ)
    base.update(
        GPULAYER_NATS_URL=nats_url,
        GPULAYER_DATABASE_URL=database_url,
        GPULAYER_HEARTBEAT_S="1",
        GPULAYER_EXECUTOR_ALLOW_ROOT_JOBS="1",  # as in tests.helpers.service_env
    )
    base.update(signing_env(tmp_path / "keys"))
    async with Services() as services:
        await services.start("gpulayer-placement", base, tmp_path / "placement.log")
        nodes = {"h100-node": "h100-dgx-8x", "t4-node": "t4-2x", "cpu-node": None}
        for node, recording in nodes.items():
            env = dict(base, GPULAYER_NODE_ID=node, GPULAYER_EXECUTOR_WORKDIR=str(tmp_path / node))
            if recording:
                tools = tmp_path / f"{node}-bin"
                tools.mkdir()
                shutil.copy(FIXTURES / "nvidia-smi" / "fake-nvidia-smi", tools / "nvidia-smi")
                (tools / "nvidia-smi").chmod(0o755)
                env["PATH"] = f"{tools}{os.pathsep}{env['PATH']}"
                env["FAKE_NVIDIA_SMI_DIR"] = str(FIXTURES / "nvidia-smi" / recording)
            await services.start(
                "gpulayer-probe", env, tmp_path / f"{node}-probe.log", key=f"probe-{node}"
            )
            await services.start(
                "gpulayer-executor", env, tmp_path / f"{node}-executor.log", key=f"executor-{node}"
            )
        js = nc.jetstream()
        await js.publish(node_capabilities("apple-m2"), encode(apple_caps()))

        async def apple_heartbeats() -> None:
            # Beat like the probes do (GPULAYER_HEARTBEAT_S=1): a single beat, sent before
            # placement even subscribed, would let placement's reaper take the Apple node offline
            # 15 s after it read its capabilities, and on a slow machine the fleet may take that
            # long to come up.
            while True:
                await nc.publish(node_heartbeat("apple-m2"), b"{}")
                await asyncio.sleep(1)

        beating = asyncio.create_task(apple_heartbeats())
        try:
            async with asyncio.timeout(30):
                while True:  # placement knows all four nodes (an API answer, not an event)
                    try:
                        known = {n["node_id"] for n in await api(nc, API_NODES, timeout=1)}
                    except Exception:
                        known = set()
                    if known >= {*nodes, "apple-m2"}:
                        break
                    await asyncio.sleep(0.1)
            yield base
        finally:
            beating.cancel()


def job(job_id: str, out: Path | None = None, **fields: object) -> bytes:
    command = ["true"]
    if out is not None:
        command = ["sh", "-c", f'echo "$CUDA_VISIBLE_DEVICES" > {out}']
    return json.dumps({"job_id": job_id, "command": command, **fields}).encode()


async def test_heterogeneous_fleet(fleet: dict[str, str], nc: Client, tmp_path: Path) -> None:
    js = nc.jetstream()
    placed: dict[str, dict[str, object]] = {}
    mps_placed = asyncio.Event()
    too_big_waiting = asyncio.Event()

    async def on_event(msg: object) -> None:
        ev = json.loads(msg.data)  # type: ignore[attr-defined]
        if ev["type"] == "placed":
            placed[ev["job_id"]] = ev
            if ev["job_id"] == "mps-job":
                mps_placed.set()
        if ev["type"] == "pending" and ev["job_id"] == "too-big":
            too_big_waiting.set()

    await nc.subscribe("gpulayer.job.*.*.events", cb=on_event)
    cuda_out = tmp_path / "cuda.txt"
    big_cuda = {
        "requirements": {
            "accelerator": "cuda", "gpu_count": 1, "gpu_memory_gb": 40, "min_cuda_compute_capability": 8.0,
        },
        "sandbox": {"devices": {"gpu": "compute"}},
    }  # fmt: skip
    jobs = {
        "big-cuda": job("big-cuda", cuda_out, **big_cuda),
        "any-cpu": job("any-cpu", requirements={"accelerator": "cpu"}),
        "mps-job": job("mps-job", requirements={"accelerator": "mps", "gpu_count": 1}),
        "too-big": job(
            "too-big", requirements={"accelerator": "cuda", "gpu_count": 1, "gpu_memory_gb": 200}
        ),
    }
    waiter = asyncio.create_task(events_until(nc, {"big-cuda", "any-cpu"}, timeout=60))
    await asyncio.sleep(0)
    await nc.flush()
    for job_id, body in jobs.items():
        await js.publish(JOBS_SUBMIT, body, headers={MSG_ID_HEADER: job_id})
    seen = await waiter
    assert seen["big-cuda"][-1] == "succeeded", seen
    assert seen["any-cpu"][-1] == "succeeded", seen
    assert placed["big-cuda"]["node_id"] == "h100-node"
    devices = placed["big-cuda"]["devices"]
    assert isinstance(devices, list)
    assert len(devices) == 1
    # The job saw exactly its granted device.
    assert cuda_out.read_text().strip() == str(devices[0])
    assert placed["any-cpu"]["node_id"] in {"h100-node", "t4-node", "cpu-node", "apple-m2"}

    # No executor on the Apple node: "placed" is its last word.
    await asyncio.wait_for(mps_placed.wait(), 20)
    assert placed["mps-job"]["node_id"] == "apple-m2"
    # too-big was submitted last and may be ingested in a later batch than mps-job: wait until
    # placement has stored and matched it (its "pending" event is published after the commit).
    await asyncio.wait_for(too_big_waiting.wait(), 20)
    assert "too-big" not in placed

    explained = await api(nc, API_EXPLAIN, {"job_id": "too-big"})
    assert explained["state"] == "pending"
    assert explained["unsatisfiable"] is True
    summary = explained["summary"]
    assert summary.startswith("0/4 nodes can run this job"), summary
    assert "best: h100-node" in summary, summary  # the nearest miss: 80 GB cards
