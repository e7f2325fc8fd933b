"""The probe service against a real NATS server: publish at start, on change only, on request;
heartbeats never wait for detection."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from tests.helpers import subscribed

from gpulayer_contracts.codec import capabilities_decoder, doctor_decoder, heartbeat_decoder
from gpulayer_contracts.subjects import node_capabilities, node_doctor, node_heartbeat
from gpulayer_detection.containers import ContainerSettings
from gpulayer_probe.service import ProbeService, ProbeSettings
from gpulayer_runtime.nats import ensure_streams

pytestmark = pytest.mark.integration
# These tests count publishes: the container runtime (its own background detection, tested in
# tests/integration/test_container_selftest.py) is not looked for.
NO_PODMAN = ContainerSettings(podman=None)

NVIDIA = Path(__file__).resolve().parents[1] / "fixtures" / "nvidia-smi"
NODE = "probe-it"


@pytest.fixture
def recording(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str], Path]:
    """use(scenario): the fake nvidia-smi first on PATH prints that recording from now on."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shutil.copy(NVIDIA / "fake-nvidia-smi", bin_dir / "nvidia-smi")
    (bin_dir / "nvidia-smi").chmod(0o755)
    folder = tmp_path / "recording"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("FAKE_NVIDIA_SMI_DIR", str(folder))

    def use(scenario: str) -> Path:
        # ``folder`` is a symlink, swapped in one rename: a detection running meanwhile (the
        # refresher may run every 0.2 s) sees the old recording or the new one, never a missing
        # folder, as it would between removing the old folder and renaming the new one in.
        staged = tmp_path / f"staged-{scenario}"
        shutil.copytree(NVIDIA / scenario, staged)
        link = tmp_path / f"recording-{scenario}.link"
        link.symlink_to(staged, target_is_directory=True)
        link.replace(folder)
        return folder

    return use


class Inbox:
    def __init__(self) -> None:
        self.queue: asyncio.Queue[Msg] = asyncio.Queue()
        self.count = 0

    async def cb(self, msg: Msg) -> None:
        self.count += 1
        await self.queue.put(msg)

    async def next(self, timeout: float = 20) -> Msg:
        return await asyncio.wait_for(self.queue.get(), timeout)


@asynccontextmanager
async def running(nc: Client, settings: ProbeSettings) -> AsyncIterator[ProbeService]:
    await ensure_streams(nc.jetstream())
    service = ProbeService(nc, NODE, settings)
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    try:
        yield service
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def subscribe(nc: Client, subject: str) -> Inbox:
    inbox = Inbox()
    await nc.subscribe(subject, cb=inbox.cb)
    await subscribed(nc)
    return inbox


async def test_republishes_exactly_once_when_the_hardware_changes(nc: Client, recording) -> None:  # type: ignore[no-untyped-def]
    recording("rtx-4090")
    caps_inbox = await subscribe(nc, node_capabilities(NODE))
    settings = ProbeSettings(containers=NO_PODMAN, python=sys.executable, refresh_s=0.2, timeout=5)
    async with running(nc, settings) as service:
        first = capabilities_decoder.decode((await caps_inbox.next()).data)
        assert [d.name for d in first.accelerators] == ["NVIDIA GeForce RTX 4090"]
        # Unchanged re-detections publish nothing.
        await asyncio.wait_for(service.wait_for_detections(4), 20)
        assert caps_inbox.count == 1

        recording("mixed-4090-3090-a6000")
        second = capabilities_decoder.decode((await caps_inbox.next()).data)
        assert [d.index for d in second.accelerators] == [0, 1, 2]
        assert second.detected_at > first.detected_at
        seen = service.detections
        await asyncio.wait_for(service.wait_for_detections(seen + 4), 20)
        assert caps_inbox.count == 2

    # The NODES stream keeps the latest for the node: what placement reads at start.
    last = await nc.jetstream().get_last_msg("NODES", node_capabilities(NODE))
    assert last.data is not None
    assert len(capabilities_decoder.decode(last.data).accelerators) == 3


async def test_unchanged_capabilities_are_published_again_when_due(nc: Client, recording) -> None:  # type: ignore[no-untyped-def]
    # Once the report is older than republish_s, the next refresh publishes it whole again.
    recording("rtx-4090")
    caps_inbox = await subscribe(nc, node_capabilities(NODE))
    settings = ProbeSettings(
        containers=NO_PODMAN, python=sys.executable, refresh_s=0.2, republish_s=0.5, timeout=5
    )
    async with running(nc, settings):
        first = capabilities_decoder.decode((await caps_inbox.next()).data)
        again = capabilities_decoder.decode((await caps_inbox.next()).data)
    assert again.accelerators == first.accelerators
    assert again.detected_at > first.detected_at


async def test_doctor_redetects_now_and_replies(nc: Client, recording) -> None:  # type: ignore[no-untyped-def]
    recording("driver-failure")
    caps_inbox = await subscribe(nc, node_capabilities(NODE))
    settings = ProbeSettings(containers=NO_PODMAN, python=sys.executable, refresh_s=3600, timeout=5)
    async with running(nc, settings):
        first = capabilities_decoder.decode((await caps_inbox.next()).data)
        assert first.accelerators == []
        assert any("couldn't communicate with the NVIDIA driver" in n for n in first.notes)

        recording("h100-dgx-8x")  # "after a driver install"
        reply = await nc.request(node_doctor(NODE), b"", timeout=30)
        report = doctor_decoder.decode(reply.data)
        fresh = report.capabilities
        assert fresh is not None
        assert len(fresh.accelerators) == 8
        # What changed since the detection before: the eight GPUs the driver install brought.
        assert len([c for c in report.changes if c.endswith("appeared")]) == 8
        assert report.health == "healthy"
        assert "cuda" in fresh.gpu_apis.host
        published = capabilities_decoder.decode((await caps_inbox.next()).data)
        assert published.accelerators == fresh.accelerators

        # Asking again with nothing changed replies, but publishes nothing new.
        await nc.request(node_doctor(NODE), b"", timeout=30)
        assert caps_inbox.count == 2


async def test_heartbeats_flow_while_detection_hangs(nc: Client, recording, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    (recording("rtx-4090") / "hang").write_text("")
    hanging_python = tmp_path / "python"
    hanging_python.write_text("#!/bin/sh\nexec sleep 300\n")
    hanging_python.chmod(0o755)
    caps_inbox = await subscribe(nc, node_capabilities(NODE))
    beats = await subscribe(nc, node_heartbeat(NODE))
    settings = ProbeSettings(
        containers=NO_PODMAN,
        python=str(hanging_python),
        refresh_s=3600,
        heartbeat_s=0.1,
        timeout=2.0,
    )
    async with running(nc, settings):
        for _ in range(3):
            hb = heartbeat_decoder.decode((await beats.next()).data)
            assert hb.node_id == NODE
        assert caps_inbox.count == 0  # three heartbeats came while detection was still running
        caps = capabilities_decoder.decode((await caps_inbox.next()).data)
    # Both hung sources were cut off by their timeout; the capabilities were still published.
    assert caps.accelerators == []
    assert any("nvidia-smi timed out after 2s" in n for n in caps.notes)
    assert any(n.startswith("frameworks: unknown") and "timed out" in n for n in caps.notes)
    assert caps.host.cpu_cores


async def test_torch_query_never_delays_the_first_publish(nc: Client, tmp_path: Path) -> None:
    # A workload interpreter that answers the metadata question at once but hangs on `import
    # torch`: the first publish must not wait for it, and the hang becomes a note later.
    python = tmp_path / "python"
    python.write_text(
        "#!/bin/sh\n"
        'case "$2" in *"import torch"*) exec sleep 300 ;; esac\n'
        "echo 'GPULAYER_PROBE_RESULT "
        '{"python_version": "3.12.1", "frameworks": {"torch": {"version": "2.5.1", "dist": "torch"}}}'
        "'\n"
    )
    python.chmod(0o755)
    caps_inbox = await subscribe(nc, node_capabilities(NODE))
    settings = ProbeSettings(
        containers=NO_PODMAN, python=str(python), refresh_s=3600, timeout=5, torch_timeout=2.0
    )
    async with running(nc, settings):
        first = capabilities_decoder.decode((await caps_inbox.next()).data)
        assert first.frameworks == {"torch": "2.5.1"}
        assert any("torch: capability query pending" in n for n in first.notes)
        later = capabilities_decoder.decode((await caps_inbox.next()).data)
    assert later.frameworks == {"torch": "2.5.1"}
    assert any(
        n.startswith("torch: capability query failed") and "timed out" in n for n in later.notes
    )
    assert "torch.cuda" not in later.framework_capabilities
