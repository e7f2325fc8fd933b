"""Merging findings, and one failing or hanging probe never taking the others down."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from datetime import UTC, datetime

import msgspec

from gpulayer_contracts.capabilities import AcceleratorDevice, HostInfo, WorkerCapabilities
from gpulayer_detection.base import Finding, ProbeContext
from gpulayer_detection.cli import gpu_apis_view
from gpulayer_detection.host import platform_tag, usable_address
from gpulayer_detection.registry import build_capabilities, collect
from gpulayer_detection.runner import RunResult
from gpulayer_probe.service import significantly_changed


async def _no_run(argv: Sequence[str], timeout: float) -> RunResult:
    return RunResult(tuple(argv), None, error="not found")


CTX = ProbeContext(run=_no_run, timeout=0.2, system="linux", machine="x86_64")


class Fixed:
    def __init__(self, name: str, finding: Finding) -> None:
        self.name = name
        self._finding = finding

    async def probe(self, ctx: ProbeContext) -> Finding:
        return self._finding


class Broken:
    name = "broken"

    async def probe(self, ctx: ProbeContext) -> Finding:
        raise RuntimeError("driver library segfaulted politely")


class Hangs:
    name = "hangs"

    async def probe(self, ctx: ProbeContext) -> Finding:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


async def test_broken_and_hanging_probes_become_notes(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import gpulayer_detection.registry as registry

    monkeypatch.setattr(registry, "_GUARD_GRACE_S", 0.3)
    good = Finding("good", frameworks={"numpy": "2.0.0"})
    started = time.monotonic()
    findings = await collect(CTX, [Broken(), Fixed("good", good), Hangs()])
    assert time.monotonic() - started < 30  # cut off at the guard, not hung (room for load)
    caps = build_capabilities("n1", findings)
    assert caps.frameworks == {"numpy": "2.0.0"}
    assert any(n.startswith("broken: probe failed: RuntimeError") for n in caps.notes)
    assert any(n.startswith("hangs: probe did not finish") for n in caps.notes)


def test_merge_keeps_every_device_and_evidence() -> None:
    nv = Finding(
        "nvidia",
        accelerators=[
            AcceleratorDevice(accelerator="cuda", index=0, name="A"),
            AcceleratorDevice(accelerator="cuda", index=1, name="B"),
        ],
        host_apis={"cuda": "nvidia-smi lists 2 GPU(s)"},
    )
    apis = Finding(
        "gpu_apis",
        container_apis={"cuda": "CDI kind nvidia.com/gpu"},
        evidence={"vulkan": "not available: vulkaninfo not found on PATH"},
        notes=["gpu_apis: vulkan not available"],
    )
    host = Finding("host", host=HostInfo(platform="linux-x86_64"), advertise_address="10.0.0.5")
    caps = build_capabilities("n1", [host, nv, apis], agent_version="9.9.9")
    assert [d.name for d in caps.accelerators] == ["A", "B"]
    assert caps.gpu_apis.host == ["cuda"]
    assert caps.gpu_apis.containers == ["cuda"]
    assert caps.gpu_apis.evidence["cuda"] == "nvidia-smi lists 2 GPU(s)"
    assert caps.gpu_apis.evidence["container:cuda"] == "CDI kind nvidia.com/gpu"
    assert caps.gpu_apis.evidence["vulkan"].startswith("not available")
    assert caps.advertise_address == "10.0.0.5"
    view = gpu_apis_view(caps)
    assert set(view) == {"host", "containers", "evidence", "platform", "agent_version"}
    assert (view["platform"], view["agent_version"]) == ("linux-x86_64", "9.9.9")


def test_platform_tags() -> None:
    assert platform_tag("Linux", "x86_64") == "linux-x86_64"
    assert platform_tag("Linux", "aarch64") == "linux-arm64"
    assert platform_tag("Darwin", "arm64") == "darwin-arm64"
    assert platform_tag("Windows", "AMD64") == "windows-amd64"


def test_usable_address() -> None:
    assert usable_address("10.1.2.3") == "10.1.2.3"
    for bad in ("127.0.1.1", "169.254.0.3", "0.0.0.0", "", None, "host.example"):
        assert usable_address(bad) is None


def _caps(
    disk: int | None, *, at: datetime, frameworks: dict[str, str] | None = None
) -> WorkerCapabilities:
    return WorkerCapabilities(
        node_id="n1",
        agent_version="1",
        detected_at=at,
        host=HostInfo(disk_free_bytes=disk),
        frameworks=frameworks or {},
    )


def test_change_detection_ignores_time_and_disk_jitter() -> None:
    t1, t2 = datetime(2025, 1, 1, tzinfo=UTC), datetime(2025, 1, 2, tzinfo=UTC)
    gib = 1 << 30
    base = _caps(100 * gib, at=t1)
    assert significantly_changed(None, base)
    assert not significantly_changed(base, _caps(100 * gib, at=t2))
    assert not significantly_changed(base, _caps(100 * gib - 5_000_000, at=t2))
    assert significantly_changed(base, _caps(80 * gib, at=t2))
    assert significantly_changed(base, _caps(None, at=t2))
    assert significantly_changed(base, _caps(100 * gib, at=t2, frameworks={"torch": "2.3.1"}))
    assert msgspec.structs.replace(base, detected_at=t2) != base  # the struct itself differs
