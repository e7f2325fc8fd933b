"""Device health, drift and MIG through the whole stack: the services as processes, a fake
nvidia-smi first on the probe's PATH whose recordings the test rewrites while it runs."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from tests.helpers import Services, gpulayer, service_env, subscribed

from gpulayer_contracts import JobEvent
from gpulayer_contracts.codec import event_decoder
from gpulayer_contracts.subjects import (
    API_EXPLAIN,
    API_NODES,
    JOB_WILDCARD_EVENTS,
    JOBS_SUBMIT,
    MSG_ID_HEADER,
    node_capabilities,
)
from gpulayer_runtime.nats import ensure_streams

pytestmark = pytest.mark.e2e

NVIDIA = Path(__file__).resolve().parents[1] / "fixtures" / "nvidia-smi"


class Events:
    """Every job event, as it arrives; ``wait`` for the first matching one."""

    def __init__(self) -> None:
        self.seen: list[JobEvent] = []
        self.changed = asyncio.Condition()

    async def cb(self, msg: Msg) -> None:
        async with self.changed:
            self.seen.append(event_decoder.decode(msg.data))
            self.changed.notify_all()

    async def wait(self, pred: Callable[[JobEvent], bool], timeout: float = 60) -> JobEvent:
        async with self.changed:
            await asyncio.wait_for(
                self.changed.wait_for(lambda: any(pred(e) for e in self.seen)), timeout
            )
            return next(e for e in self.seen if pred(e))


def tag(e: JobEvent) -> str:
    return str(type(e).__struct_config__.tag)


async def submit(nc: Client, job: dict[str, Any]) -> None:
    await nc.jetstream().publish(
        JOBS_SUBMIT, json.dumps(job).encode(), headers={MSG_ID_HEADER: job["job_id"]}
    )


async def api(nc: Client, subject: str, payload: dict[str, Any]) -> Any:
    reply = await nc.request(subject, json.dumps(payload).encode(), timeout=10)
    body = json.loads(reply.data)
    assert body["ok"], body
    return body["data"]


async def until(check: Callable[[], Any], timeout: float = 60) -> Any:
    """Ask ``check`` (a coroutine function) again until it returns something true: placement
    publishes nothing when it applies a health change, so its API is asked."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = await check()
        if value:
            return value
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.2)


@pytest.fixture
async def events(nc: Client) -> AsyncIterator[Events]:
    ev = Events()
    sub = await nc.subscribe(JOB_WILDCARD_EVENTS, cb=ev.cb)
    await subscribed(nc)
    yield ev
    await sub.unsubscribe()


async def start_node(
    nc: Client,
    nats_url: str,
    database_url: str,
    tmp_path: Path,
    node: str,
    scenario: Path,
    services: Services,
) -> None:
    tools = tmp_path / "bin"
    tools.mkdir()
    shutil.copy(NVIDIA / "fake-nvidia-smi", tools / "nvidia-smi")
    (tools / "nvidia-smi").chmod(0o755)
    env = service_env(
        nats_url,
        database_url,
        tmp_path / "work",
        node,
        PATH=f"{tools}{os.pathsep}{os.environ['PATH']}",
        FAKE_NVIDIA_SMI_DIR=str(scenario),
        GPULAYER_PROBE_OBSERVE_S="0.3",
        GPULAYER_PROBE_RECOVER_AFTER="2",
        GPULAYER_PROBE_REFRESH_S="60",
    )
    published: asyncio.Queue[Msg] = asyncio.Queue()
    sub = await nc.subscribe(node_capabilities(node), cb=published.put)
    await subscribed(nc)
    for name in ("gpulayer-placement", "gpulayer-executor", "gpulayer-probe"):
        await services.start(name, env, tmp_path / f"{name}.log")
    await asyncio.wait_for(published.get(), 60)  # the probe is up (and answers the doctor)
    await sub.unsubscribe()


def rows(path: Path) -> list[str]:
    return path.read_text().splitlines()


async def test_unhealthy_vanished_and_recovered_devices(
    nc: Client, nats_url: str, database_url: str, tmp_path: Path, events: Events
) -> None:
    await ensure_streams(nc.jetstream())
    scenario = tmp_path / "h100"
    shutil.copytree(NVIDIA / "h100-dgx-8x", scenario)
    observe, query = scenario / "observe.txt", scenario / "query.txt"
    clean = rows(observe)
    node = "health-node"
    async with Services() as services:
        await start_node(nc, nats_url, database_url, tmp_path, node, scenario, services)
        # A job holding all eight GPUs runs.
        await submit(nc, {"job_id": "hold8", "command": ["sleep", "120"],
                          "requirements": {"accelerator": "cuda", "gpu_count": 8}})  # fmt: skip
        await events.wait(lambda e: e.job_id == "hold8" and tag(e) == "running")

        # GPU 3 reports uncorrected ECC errors: its job is warned, with the reason.
        sick = [*clean]
        sick[4] = sick[4].replace("0x0000000000000000, 0, 0,", "0x0000000000000000, 2, 2,")
        assert sick[4] != clean[4]
        observe.write_text("\n".join(sick) + "\n")
        warned = await events.wait(lambda e: e.job_id == "hold8" and tag(e) == "warning")
        assert getattr(warned, "devices", None) == [3]
        assert "2 uncorrected ECC errors" in (getattr(warned, "reason", "") or "")

        # GPU 5 vanishes while the job runs: the job is lost, the device named.
        observe.write_text("\n".join(r for r in sick if not r.startswith("5,")) + "\n")
        query.write_text("\n".join(r for r in rows(query) if not r.startswith("5,")) + "\n")
        lost = await events.wait(lambda e: e.job_id == "hold8" and tag(e) == "lost")
        assert "device 5" in (getattr(lost, "reason", "") or ""), lost
        assert "vanished" in (getattr(lost, "reason", "") or ""), lost

        # Seven GPUs left, one unhealthy: a seven-GPU job waits, and explain says why.
        await submit(nc, {"job_id": "want7", "command": ["true"],
                          "requirements": {"accelerator": "cuda", "gpu_count": 7}})  # fmt: skip
        await events.wait(lambda e: e.job_id == "want7" and tag(e) == "pending")
        why = await api(nc, API_EXPLAIN, {"job_id": "want7"})
        assert why["state"] == "pending"
        assert "health" in why["summary"], why
        assert f"{node} GPU 3: unhealthy: 2 uncorrected ECC errors" in why["summary"], why
        nodes = await api(nc, API_NODES, {})
        (mine,) = [n for n in nodes if n["node_id"] == node]
        assert mine["health"]["health"] == "unhealthy"
        assert "3" in mine["health"]["held_back"]

        # GPU 3 recovers (the counter clears after a GPU reset): after two clean observations
        # it is used again, and the waiting job runs on it.
        observe.write_text("\n".join(r for r in clean if not r.startswith("5,")) + "\n")
        placed = await events.wait(lambda e: e.job_id == "want7" and tag(e) == "placed")
        assert 3 in getattr(placed, "devices", []), placed
        await events.wait(lambda e: e.job_id == "want7" and tag(e) == "succeeded")

        async def healthy() -> bool:
            nodes = await api(nc, API_NODES, {})
            return any(n["node_id"] == node and not n["health"]["held_back"] for n in nodes)

        assert await until(healthy)
    probe_log = (tmp_path / "gpulayer-probe.log").read_text()
    assert "drift on node health-node" in probe_log
    assert "device 5" in probe_log


async def test_a_1g10gb_mig_instance_runs_a_10gb_job(
    nc: Client, nats_url: str, database_url: str, tmp_path: Path, events: Events
) -> None:
    await ensure_streams(nc.jetstream())
    # Two whole A100 80GB PCIe (GPUs 0-1) and two in MIG with 7x 1g.10gb each (GPUs 2-3):
    # plain nvidia-smi rebuilt in the shape of a public post (9728 MiB per instance), -L ours.
    scenario = NVIDIA / "a100-pcie-80gb-2x-whole-2x-mig7-1g10gb"
    listing = (scenario / "list.txt").read_text().splitlines()
    first_instance = listing[3].split("UUID: ")[1].rstrip(")")  # GPU 2, MIG device 0
    assert first_instance.startswith("MIG-"), listing[3]
    out = tmp_path / "visible.txt"
    async with Services() as services:
        await start_node(nc, nats_url, database_url, tmp_path, "mig-node", scenario, services)

        async def placed_on(job_id: str) -> list[int]:
            placed = await events.wait(lambda e: e.job_id == job_id and tag(e) == "placed")
            return list(getattr(placed, "devices", []))

        # Whole-GPU jobs (no memory figure): the two whole GPUs, never a MIG-enabled one.
        await submit(nc, {"job_id": "whole2", "command": ["sleep", "120"],
                          "requirements": {"accelerator": "cuda", "gpu_count": 2}})  # fmt: skip
        assert await placed_on("whole2") == [0, 1]
        # With both whole GPUs taken, a one-GPU job waits although 14 instances are free.
        await submit(nc, {"job_id": "whole1", "command": ["true"],
                          "requirements": {"accelerator": "cuda", "gpu_count": 1}})  # fmt: skip
        await events.wait(lambda e: e.job_id == "whole1" and tag(e) == "pending")
        # Three whole GPUs: the node has two; explain names the instance profile it has.
        await submit(nc, {"job_id": "whole3", "command": ["true"],
                          "requirements": {"accelerator": "cuda", "gpu_count": 3}})  # fmt: skip
        await events.wait(lambda e: e.job_id == "whole3" and tag(e) == "pending")
        why = await api(nc, API_EXPLAIN, {"job_id": "whole3"})
        assert "only MIG instances (seen: 1g.10gb)" in why["summary"], why

        # A 10 GB job lands on a 1g.10gb instance (9728 MiB holds 10 * 10^9 bytes).
        script = (
            f"import os; open({str(out)!r}, 'w').write("
            "os.environ['CUDA_VISIBLE_DEVICES'] + ' ' + os.environ['GPULAYER_DEVICES'])"
        )
        await submit(
            nc,
            {
                "job_id": "mig10",
                "command": [sys.executable, "-c", script],
                "requirements": {"accelerator": "cuda", "gpu_count": 1, "gpu_memory_gb": 10},
                "sandbox": {"devices": {"gpu": "compute"}},
            },
        )
        assert await placed_on("mig10") == [2]  # the instance's parent GPU
        done = await events.wait(
            lambda e: e.job_id == "mig10" and tag(e) in ("succeeded", "failed", "lost")
        )
        assert tag(done) == "succeeded", done
        # The one-GPU whole job is still waiting: the free instances were never offered to it.
        assert not [e for e in events.seen if e.job_id == "whole1" and tag(e) == "placed"]
        assert (await api(nc, API_EXPLAIN, {"job_id": "whole1"}))["state"] == "pending"
    assert out.read_text() == f"{first_instance} 2"


async def cli(*args: str, env: dict[str, str]) -> tuple[int, str, str]:
    return await gpulayer(*args, env=env, timeout=120)


async def test_doctor_reports_what_changed_and_the_health(
    nc: Client, nats_url: str, database_url: str, tmp_path: Path
) -> None:
    await ensure_streams(nc.jetstream())
    scenario = tmp_path / "h100"
    shutil.copytree(NVIDIA / "h100-dgx-8x", scenario)
    async with Services() as services:
        await start_node(nc, nats_url, database_url, tmp_path, "doc-node", scenario, services)
        env = service_env(nats_url, database_url, tmp_path / "cli", "doc-node")
        code, out, err = await cli("doctor", "doc-node", "--json", env=env)
        assert code == 0, out + err
        first = json.loads(out)
        assert first["health"] == "healthy"
        assert len(first["devices"]) == 8
        # A driver update on the node: the doctor says what changed.
        query = scenario / "query.txt"
        query.write_text(query.read_text().replace("535.129.03", "550.54.15"))
        code, out, err = await cli("doctor", "doc-node", env=env)
        assert code == 0, out + err
        assert "driver 535.129.03 -> 550.54.15" in out, out
        assert "doc-node: healthy" in out
        code, _, err = await cli("doctor", "nobody-here", "--timeout", "2", env=env)
        assert code == 3
        assert "no probe answered" in err


async def test_a_node_with_device_files_but_no_driver_is_undetected(
    nc: Client, nats_url: str, database_url: str, tmp_path: Path
) -> None:
    await ensure_streams(nc.jetstream())
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "nvidia0").touch()
    (dev / "nvidiactl").touch()
    tools = tmp_path / "bin"
    tools.mkdir()
    shutil.copy(NVIDIA / "fake-nvidia-smi", tools / "nvidia-smi")
    (tools / "nvidia-smi").chmod(0o755)
    env = service_env(
        nats_url, database_url, tmp_path / "work", "undetected-node",
        PATH=f"{tools}{os.pathsep}{os.environ['PATH']}",
        FAKE_NVIDIA_SMI_DIR=str(NVIDIA / "driver-failure"),
        GPULAYER_PROBE_DEVICE_DIR=str(dev),
    )  # fmt: skip
    published: asyncio.Queue[Msg] = asyncio.Queue()
    sub = await nc.subscribe(node_capabilities("undetected-node"), cb=published.put)
    await subscribed(nc)
    async with Services() as services:
        await services.start("gpulayer-probe", env, tmp_path / "probe.log")
        await asyncio.wait_for(published.get(), 60)  # the probe is up
        await sub.unsubscribe()
        code, out, err = await cli("doctor", "undetected-node", "--json", env=env)
    assert code == 0, out + err  # not an alert
    report = json.loads(out)
    assert report["health"] == "undetected"
    assert not [d for d in report["capabilities"]["accelerators"] if d["execution_supported"]]
