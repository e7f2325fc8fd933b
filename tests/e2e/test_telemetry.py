"""One trace per job across processes, and the metrics, seen by a real OTLP/HTTP receiver."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from nats.aio.client import Client
from tests.helpers import Services, bin_path, events_until, service_env
from tests.otlp_receiver import OtlpReceiver, Received, SpanRecord

from gpulayer_contracts import (
    AcceleratorDevice,
    GpuApis,
    Heartbeat,
    HostInfo,
    WorkerCapabilities,
    encode,
)
from gpulayer_contracts.subjects import (
    JOBS_SUBMIT,
    MSG_ID_HEADER,
    node_capabilities,
    node_heartbeat,
)
from gpulayer_runtime.nats import ensure_streams

pytestmark = pytest.mark.e2e


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as r:
        yield r


def _has(r: Received, service: str, trace_id: str) -> bool:
    return any(s.service == service and s.trace_id == trace_id for s in r.spans)


def _names(r: Received, service: str, trace_id: str) -> set[str]:
    return {s.name for s in r.spans if s.service == service and s.trace_id == trace_id}


def _metric(r: Received, name: str) -> list[float]:
    return [p.value for p in r.metrics if p.name == name]


async def test_one_trace_per_job_and_metrics(
    nats_url: str, database_url: str, tmp_path: Path, nc: Client, receiver: OtlpReceiver
) -> None:
    await ensure_streams(nc.jetstream())
    env = service_env(
        nats_url,
        database_url,
        tmp_path / "work",
        "otel-node",
        OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
        OTEL_BSP_SCHEDULE_DELAY="100",
        OTEL_METRIC_EXPORT_INTERVAL="300",
        GPULAYER_LOG_FORMAT="json",
    )
    services = Services()
    for name in ("gpulayer-placement", "gpulayer-executor", "gpulayer-probe"):
        await services.start(name, env, tmp_path / f"{name}.log")
    try:
        trace_id = secrets.token_hex(16)
        traceparent = f"00-{trace_id}-{secrets.token_hex(8)}-01"
        waiter = asyncio.create_task(events_until(nc, {"otel-1"}))
        await asyncio.sleep(0)
        await nc.flush()
        submitted = time.monotonic()
        await nc.jetstream().publish(
            JOBS_SUBMIT,
            json.dumps({"job_id": "otel-1", "command": ["true"]}).encode(),
            headers={MSG_ID_HEADER: "otel-1", "traceparent": traceparent},
        )
        seen = await waiter
        # Submit to grant took no longer than submit to the job's end as seen here.
        ended_within_s = time.monotonic() - submitted
        assert seen["otel-1"][-1] == "succeeded"

        r = receiver.received
        # Spans are exported as they end, in batches: a job's child spans can arrive before its
        # "placement place" span, which ends last. Wait for every span the test reads.
        placement_spans = {
            "placement place",
            "placement match",
            "placement commit",
            "placement publish grant",
        }
        got = await asyncio.to_thread(
            r.wait,
            lambda r: (
                placement_spans <= _names(r, "gpulayer-placement", trace_id)
                and _has(r, "gpulayer-executor", trace_id)
            ),
            20,
        )
        services_seen = {(s.service, s.name) for s in r.spans if s.trace_id == trace_id}
        assert got, f"spans under the submitter's trace: {services_seen}"
        place = next(s for s in r.spans if s.trace_id == trace_id and s.name == "placement place")
        assert place.attributes["gpulayer.job.id"] == "otel-1"
        assert place.attributes["gpulayer.node.id"] == "otel-node"
        assert place.attributes["messaging.system"] == "nats"
        children = [
            s
            for s in r.spans
            if s.trace_id == trace_id and s.name in placement_spans - {place.name}
        ]
        assert {s.parent_span_id for s in children} == {place.span_id}

        # A capability update from the probe is its own trace.
        assert await asyncio.to_thread(
            r.wait, lambda r: any(s.service == "gpulayer-probe" for s in r.spans), 20
        )
        assert all(s.trace_id != trace_id for s in r.spans if s.service == "gpulayer-probe")

        wanted = [
            "gpulayer.placement.submit_to_grant.duration",
            "gpulayer.placement.decision.duration",
            "gpulayer.nodes",
            "gpulayer.executor.job.duration",
            "gpulayer.probe.detection.duration",
        ]
        assert await asyncio.to_thread(r.wait, lambda r: all(_metric(r, n) for n in wanted), 20), {
            p.name for p in r.metrics
        }
        grant_latency = [
            p for p in r.metrics if p.name == "gpulayer.placement.submit_to_grant.duration"
        ]
        # In seconds (a unit slip to ms would be ~1000x over), whatever the machine's load.
        assert any(p.value >= 1 and 0 < p.total <= ended_within_s for p in grant_latency), [
            (p.value, p.total, ended_within_s) for p in grant_latency
        ]
        online = [
            p.value
            for p in r.metrics
            if p.name == "gpulayer.nodes" and p.attributes.get("state") == "online"
        ]
        assert max(online) >= 1
        durations = [p for p in r.metrics if p.name == "gpulayer.executor.job.duration"]
        assert any(
            p.attributes.get("outcome") == "succeeded" and 0 < p.total < 10 for p in durations
        )
        # JSON log lines about the job carry its id, the node and the submitter's trace id.
        executor_log = [
            json.loads(line)
            for line in (tmp_path / "gpulayer-executor.log").read_text().splitlines()
            if line.startswith("{")
        ]
        finished = [e for e in executor_log if e.get("job_id") == "otel-1"]
        assert finished, executor_log[-5:]
        assert finished[-1]["msg"].startswith("job otel-1 (grant ")
        assert finished[-1]["node_id"] == "otel-node"
        assert finished[-1]["trace_id"] == trace_id
    finally:
        await services.stop()


def _simulated(
    node_id: str,
    host: HostInfo,
    accelerators: list[AcceleratorDevice] | None = None,
    gpu_apis: GpuApis | None = None,
) -> WorkerCapabilities:
    return WorkerCapabilities(
        node_id=node_id,
        agent_version="0",
        detected_at=datetime.now(UTC),
        host=host,
        accelerators=accelerators or [],
        gpu_apis=gpu_apis or GpuApis(),
    )


SIMULATED = [
    _simulated(
        "sim-dgx",
        host=HostInfo(hostname="dgx-01", platform="linux-x86_64"),
        accelerators=[
            AcceleratorDevice(accelerator="cuda", index=i, execution_supported=True)
            for i in range(8)
        ],
        gpu_apis=GpuApis(host=["cuda", "vulkan"], containers=["cuda"]),
    ),
    _simulated(
        "sim-mac",
        host=HostInfo(hostname="studio.local", platform="darwin-arm64"),
        accelerators=[
            AcceleratorDevice(
                accelerator="mps", index=0, memory_kind="unified", execution_supported=True
            )
        ],
        gpu_apis=GpuApis(host=["metal"]),
    ),
    _simulated("sim-cpu", host=HostInfo(hostname="ci-runner", platform="linux-aarch64")),
]


def _info(r: Received, node: str, state: str) -> list[int]:
    """When the fleet table's series of ``node`` in ``state`` was measured."""
    return [
        p.time_unix_nano
        for p in r.metrics
        if p.name == "gpulayer.node.info"
        and p.attributes.get("node") == node
        and p.attributes.get("state") == state
    ]


async def test_fleet_table_metric_for_a_simulated_fleet(
    nats_url: str, database_url: str, tmp_path: Path, nc: Client, receiver: OtlpReceiver
) -> None:
    await ensure_streams(nc.jetstream())
    env = service_env(
        nats_url,
        database_url,
        tmp_path / "work",
        "unused",
        OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
        OTEL_METRIC_EXPORT_INTERVAL="300",
        GPULAYER_NODE_TIMEOUT_S="2",
    )
    alive = {caps.node_id for caps in SIMULATED}

    async def heartbeats() -> None:
        while True:
            for node in sorted(alive):
                beat = Heartbeat(node_id=node, sent_at=datetime.now(UTC))
                await nc.publish(node_heartbeat(node), encode(beat))
            await asyncio.sleep(0.3)  # a node's beat interval, not a wait for a result

    async with Services() as services:
        await services.start("gpulayer-placement", env, tmp_path / "placement.log")
        for caps in SIMULATED:
            await nc.jetstream().publish(node_capabilities(caps.node_id), encode(caps))
        beating = asyncio.create_task(heartbeats())
        try:
            r = receiver.received
            seen = await asyncio.to_thread(
                r.wait, lambda r: all(_info(r, n, "online") for n in alive), 30
            )
            assert seen, {p.attributes.get("node") for p in r.metrics if "node" in p.attributes}
            latest = {
                p.attributes["node"]: p.attributes
                for p in r.metrics
                if p.name == "gpulayer.node.info"
            }
            assert latest["sim-dgx"] == {
                "node": "sim-dgx",
                "hostname": "dgx-01",
                "platform": "linux-x86_64",
                "host_apis": "cuda, vulkan",
                "container_apis": "cuda",
                "containers_get_gpu": "yes",
                "state": "online",
                "accelerators": "8x cuda",
            }
            mac = latest["sim-mac"]
            assert (mac["platform"], mac["host_apis"], mac["container_apis"]) == (
                "darwin-arm64",
                "metal",
                "none",
            )
            assert (mac["containers_get_gpu"], mac["accelerators"]) == ("no", "1x mps")
            assert latest["sim-cpu"]["accelerators"] == "cpu only"
            assert all(
                p.value == 1 and p.kind == "gauge"
                for p in r.metrics
                if p.name == "gpulayer.node.info"
            )

            # A node falls silent: placement marks it offline, and its "online" series stops.
            alive.discard("sim-cpu")
            assert await asyncio.to_thread(
                r.wait, lambda r: bool(_info(r, "sim-cpu", "offline")), 30
            )
            first_offline = min(_info(r, "sim-cpu", "offline"))
            # A later collection still has the others online, and no "online" row for it.
            assert await asyncio.to_thread(
                r.wait, lambda r: any(t > first_offline for t in _info(r, "sim-dgx", "online")), 30
            )
            assert all(t < first_offline for t in _info(r, "sim-cpu", "online"))
        finally:
            beating.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beating


async def test_submit_wait_trace_starts_at_the_cli(
    nats_url: str, database_url: str, tmp_path: Path, nc: Client, receiver: OtlpReceiver
) -> None:
    await ensure_streams(nc.jetstream())
    env = service_env(
        nats_url,
        database_url,
        tmp_path / "work",
        "cli-trace-node",
        OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
        OTEL_BSP_SCHEDULE_DELAY="100",
    )
    env.pop("TRACEPARENT", None)
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"job_id": "cli-root", "command": ["true"]}))
    async with Services() as services:
        for name in ("gpulayer-placement", "gpulayer-executor", "gpulayer-probe"):
            await services.start(name, env, tmp_path / f"{name}.log")
        cli = await asyncio.create_subprocess_exec(
            bin_path("gpulayer"),
            "submit",
            str(job),
            "--wait",
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        out, _ = await asyncio.wait_for(cli.communicate(), 60)
        assert cli.returncode == 0, out.decode()

        r = receiver.received

        def cli_root(r: Received) -> SpanRecord | None:
            return next(
                (s for s in r.spans if s.service == "gpulayer-cli" and s.name == "gpulayer submit"),
                None,
            )

        def complete(r: Received) -> bool:
            root = cli_root(r)
            return root is not None and (
                "placement place" in _names(r, "gpulayer-placement", root.trace_id)
                and _has(r, "gpulayer-executor", root.trace_id)
            )

        # The CLI exported its spans before it exited; the services' come in their batches.
        assert await asyncio.to_thread(r.wait, complete, 20), {
            (s.service, s.name, s.trace_id) for s in r.spans
        }
        # Under a caller's TRACEPARENT (CI, otel-cli), the CLI's span is that span's child.
        caller_trace, caller_span = secrets.token_hex(16), secrets.token_hex(8)
        job.write_text(json.dumps({"job_id": "cli-child", "command": ["true"]}))
        cli = await asyncio.create_subprocess_exec(
            bin_path("gpulayer"),
            "submit",
            str(job),
            env={**env, "TRACEPARENT": f"00-{caller_trace}-{caller_span}-01"},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        out, _ = await asyncio.wait_for(cli.communicate(), 60)
        assert cli.returncode == 0, out.decode()
    under_caller = [
        s for s in r.spans if s.name == "gpulayer submit" and s.trace_id == caller_trace
    ]
    assert [s.parent_span_id for s in under_caller] == [caller_span]
    root = cli_root(r)
    assert root is not None
    assert root.parent_span_id == ""  # nothing above it: the trace starts at the CLI
    assert root.attributes["gpulayer.job.id"] == "cli-root"
    assert root.attributes["gpulayer.cli.wait"] is True
    trace = [s for s in r.spans if s.trace_id == root.trace_id]
    # Every other span of the job hangs below the CLI's: its only root.
    assert [s for s in trace if not s.parent_span_id] == [root]
    by_id = {s.span_id: s for s in trace}
    for span in trace:
        seen = span
        while seen.parent_span_id:
            assert seen.parent_span_id in by_id, f"{span.name}: parent not in the trace"
            seen = by_id[seen.parent_span_id]
        assert seen is root
    publish = next(s for s in trace if s.name == "gpulayer publish job")
    assert publish.parent_span_id == root.span_id
    place = next(s for s in trace if s.name == "placement place")
    assert place.parent_span_id == publish.span_id
