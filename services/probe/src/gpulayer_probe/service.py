"""The probe service: publish capabilities at start and on change, a heartbeat in between.

Tasks, under one ``run``: the heartbeat (never waits on detection), the refresher (detects every
``refresh_s``, or at once when the observer sees other devices than detection did), the
observer (device observations and health every ``observe_s``, ``observer.py``), the torch query
(in the background, so the first publish never waits for ``import torch``), the container
runtime (in the background at each refresh too: its self-test takes a second, and a podman that
hangs must not hold the other sources' report back; the self-test itself is cached), and the doctor
(NATS request/reply: re-detect now, torch included, and reply with what changed and the node's
health). A lock orders detections and publishes. Consecutive detections are compared: what
drifted (a device vanished, a driver or a device's memory changed) is logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from opentelemetry.trace import SpanKind

from gpulayer_contracts import Heartbeat, WorkerCapabilities, __version__, encode
from gpulayer_contracts.health import DoctorReport, drift
from gpulayer_contracts.subjects import node_capabilities, node_doctor, node_heartbeat
from gpulayer_detection.base import DEFAULT_CDI_DIRS, Finding, ProbeContext
from gpulayer_detection.containers import ContainerRuntimeProbe, ContainerSettings, runtime_pending
from gpulayer_detection.frameworks import query_torch
from gpulayer_detection.registry import (
    TOOL_DIRS,
    build_capabilities,
    collect,
    default_probes,
    make_context,
    torch_unknown,
)
from gpulayer_detection.runner import Runner, run_command, with_tool_dirs
from gpulayer_probe.observer import Observer
from gpulayer_runtime.ratelimit import Buckets
from gpulayer_runtime.telemetry import DISABLED, Telemetry, inject

log = logging.getLogger(__name__)

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
# Free disk moves all the time; only a move this large (or this share) is worth an event.
DISK_CHANGE_BYTES = 1 << 30
DISK_CHANGE_SHARE = 0.05


def _comparable(caps: WorkerCapabilities) -> WorkerCapabilities:
    return msgspec.structs.replace(
        caps,
        detected_at=_EPOCH,
        host=msgspec.structs.replace(caps.host, disk_free_bytes=None),
    )


def significantly_changed(old: WorkerCapabilities | None, new: WorkerCapabilities) -> bool:
    """Whether ``new`` is worth publishing after ``old``: any change but ``detected_at``, with
    free disk counted only when it moved by more than 1 GiB and 5%."""
    if old is None or _comparable(old) != _comparable(new):
        return True
    a, b = old.host.disk_free_bytes, new.host.disk_free_bytes
    if (a is None) != (b is None):
        return True
    if a is None or b is None:
        return False
    moved = abs(a - b)
    return moved > DISK_CHANGE_BYTES and moved > DISK_CHANGE_SHARE * max(a, 1)


@dataclass(frozen=True, slots=True)
class ProbeSettings:
    python: str = sys.executable
    refresh_s: float = 60.0
    # Unchanged capabilities are published again this often (checked at each refresh): a report
    # that slipped onto this node's subject some other way can't stand for long.
    republish_s: float = 600.0
    heartbeat_s: float = 5.0
    timeout: float = 10.0
    torch_timeout: float = 60.0
    cdi_dirs: Sequence[str] = DEFAULT_CDI_DIRS
    advertise_address: str | None = None
    # Device observations: how often, and how many clean ones in a row make a device healthy
    # again (hysteresis). 0 turns observations off.
    observe_s: float = 5.0
    recover_after: int = 3
    dev_dir: str = "/dev"  # where GPU device files (nvidia<N>, dxg) are looked for
    # Where the host's /proc, /sys, /dev and /usr/lib/wsl are read (a probe in a container
    # sees the host where it is mounted).
    host_root: str = "/"
    # The container runtime: podman, its OCI runtime, the self-test's bound.
    containers: ContainerSettings = field(default_factory=ContainerSettings)
    # Doctor requests this probe answers: a bucket of ``doctor_burst`` refilled at
    # ``doctor_rate`` a second (GPULAYER_DOCTOR_RATE / GPULAYER_DOCTOR_BURST). Each one runs
    # every detector and torch: a flood of them would keep the node busy detecting.
    doctor_rate: float = 0.2
    doctor_burst: int = 3


class ProbeService:
    def __init__(
        self,
        nc: Client,
        node_id: str,
        settings: ProbeSettings = ProbeSettings(),
        *,
        run: Runner = run_command,
        telemetry: Telemetry = DISABLED,
    ) -> None:
        self._nc = nc
        self._tel = telemetry
        self._node = node_id
        self._s = settings
        # nvidia-smi in WSL2's /usr/lib/wsl/lib is found off PATH too, by detection and the
        # observer alike.
        self._run = with_tool_dirs(run, TOOL_DIRS)
        # Kept across refreshes: its self-test runs again only when podman changes.
        self.containers = ContainerRuntimeProbe(settings.containers)
        self._runtime: Finding | None = None  # its last answer
        self._runtime_task: asyncio.Task[None] | None = None
        self._doctor_limit = Buckets(settings.doctor_rate, settings.doctor_burst)
        self._lock = asyncio.Lock()
        self._findings: list[Finding] = []
        self._torch: Finding | None = None
        self._torch_key: tuple[object, ...] | None = None
        self._torch_task: asyncio.Task[None] | None = None
        self._published: WorkerCapabilities | None = None
        self._published_at = 0.0  # time.monotonic() of the last publish
        self.current: WorkerCapabilities | None = None
        self.detections = 0  # completed refresh cycles, for tests and metrics
        self._detected = asyncio.Condition()
        self._kick = asyncio.Event()  # detect now (the observer saw other devices)
        self._previous: WorkerCapabilities | None = None  # the detection before the last
        self.changes: list[str] = []  # drift found by the last detection
        self.observer = Observer(
            nc,
            node_id,
            run=self._run,
            timeout=settings.timeout,
            interval_s=settings.observe_s,
            recover_after=settings.recover_after,
            dev_dir=settings.dev_dir,
            capabilities=lambda: self.current,
            redetect=self._kick.set,
        )

    async def run(self, stop: asyncio.Event) -> None:
        sub = await self._nc.subscribe(node_doctor(self._node), cb=self._on_doctor)
        tasks = [
            asyncio.create_task(self._heartbeat(stop), name="probe-heartbeat"),
            asyncio.create_task(self._refresher(stop), name="probe-refresher"),
        ]
        if self._s.observe_s > 0:
            tasks.append(asyncio.create_task(self.observer.run(stop), name="probe-observer"))
        try:
            await stop.wait()
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            if self._torch_task is not None:
                tasks.append(self._torch_task)
            if self._runtime_task is not None:
                tasks.append(self._runtime_task)
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await t

    # -- detection -------------------------------------------------------------------------

    def _context(self) -> ProbeContext:
        return make_context(
            run=self._run,
            timeout=self._s.timeout,
            python=self._s.python,
            cdi_dirs=self._s.cdi_dirs,
            dev_dir=self._s.dev_dir,
            advertise_address=self._s.advertise_address,
            host_root=self._s.host_root,
            tool_dirs=(),  # self._run looks there already
        )

    @property
    def _looks_for_containers(self) -> bool:
        return self._s.containers.podman is not None

    async def detect(self) -> WorkerCapabilities:
        """Re-run every fast probe; combine with the last torch and container runtime answers
        (or say they are pending)."""
        on_timing = self._record_timing if self._tel.enabled else None
        probes = default_probes(include_containers=False)
        if not self._looks_for_containers:
            probes.append(self.containers)  # runs nothing: it notes it was told not to look
        self._findings = await collect(self._context(), probes, on_timing)
        return self._build()

    def _record_timing(self, source: str, seconds: float) -> None:
        self._tel.record("gpulayer.probe.detection.duration", seconds, {"source": source})

    def _frameworks(self) -> dict[str, str]:
        return {k: v for f in self._findings for k, v in f.frameworks.items()}

    def _torch_cache_key(self) -> tuple[object, ...]:
        # torch's answer changes with torch itself or with the driver under it.
        devices = tuple((d.uuid, d.driver_version) for f in self._findings for d in f.accelerators)
        return (self._s.python, self._frameworks().get("torch"), devices)

    def _build(self) -> WorkerCapabilities:
        findings = list(self._findings)
        if self._looks_for_containers:
            findings.append(self._runtime if self._runtime is not None else runtime_pending())
        if "torch" in self._frameworks():
            if self._torch is not None and self._torch_key == self._torch_cache_key():
                findings.append(self._torch)
            else:
                findings.append(torch_unknown("pending"))
        caps = build_capabilities(self._node, findings)
        self.current = caps
        return caps

    def _compare(self, caps: WorkerCapabilities) -> list[str]:
        """Drift between the previous detection and ``caps``, logged; ``caps`` becomes the
        previous one."""
        changes = drift(self._previous, caps) if self._previous is not None else []
        for change in changes:
            log.warning("drift on node %s: %s", self._node, change)
        self._previous = caps
        self.changes = changes
        return changes

    async def _query_torch(self) -> None:
        key = self._torch_cache_key()
        finding = await query_torch(self._s.python, self._run, self._s.torch_timeout)
        async with self._lock:
            self._torch, self._torch_key = finding, key
            await self._publish_if_changed(self._build())

    def _start_torch_if_needed(self, *, force: bool = False) -> None:
        if "torch" not in self._frameworks():
            return
        if not force and self._torch_key == self._torch_cache_key():
            return
        if self._torch_task is not None and not self._torch_task.done():
            if not force:
                return
            self._torch_task.cancel()
        self._torch_task = asyncio.create_task(self._query_torch(), name="probe-torch")

    async def _detect_runtime(self) -> None:
        on_timing = self._record_timing if self._tel.enabled else None
        (finding,) = await collect(self._context(), [self.containers], on_timing)
        async with self._lock:
            self._runtime = finding
            await self._publish_if_changed(self._build())

    def _start_runtime_if_needed(self) -> None:
        if not self._looks_for_containers:
            return
        if self._runtime_task is not None and not self._runtime_task.done():
            return
        self._runtime_task = asyncio.create_task(self._detect_runtime(), name="probe-containers")

    # -- publishing ------------------------------------------------------------------------

    async def _publish_if_changed(self, caps: WorkerCapabilities) -> bool:
        due = time.monotonic() - self._published_at >= self._s.republish_s
        if not due and not significantly_changed(self._published, caps):
            return False
        try:
            # Each capability update is a trace of its own.
            with self._tel.span(
                "probe publish capabilities",
                kind=SpanKind.PRODUCER,
                attributes={
                    "messaging.system": "nats",
                    "messaging.destination.name": node_capabilities(self._node),
                    "gpulayer.node.id": self._node,
                    "gpulayer.accelerators": len(caps.accelerators),
                },
            ) as span:
                headers = inject({}, span) if span is not None else None
                await self._nc.jetstream().publish(
                    node_capabilities(self._node), encode(caps), headers=headers
                )
        except Exception as err:  # NATS down: the next refresh tries again
            log.warning("publishing capabilities failed: %s", err)
            return False
        self._published = caps
        self._published_at = time.monotonic()
        log.info(
            "published capabilities for %s: %d device(s), apis %s",
            self._node,
            len(caps.accelerators),
            ",".join(caps.gpu_apis.host) or "-",
        )
        return True

    async def wait_for_detections(self, count: int) -> None:
        """Return once ``count`` refresh cycles have completed (detected and, if changed,
        published)."""
        async with self._detected:
            await self._detected.wait_for(lambda: self.detections >= count)

    async def _refresher(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            async with self._lock:
                try:
                    caps = await self.detect()
                    self._compare(caps)
                    await self._publish_if_changed(caps)
                except Exception:
                    log.exception("detection failed; trying again at the next refresh")
            self._start_torch_if_needed()
            self._start_runtime_if_needed()
            async with self._detected:
                self.detections += 1
                self._detected.notify_all()
            await self._sleep(stop, self._s.refresh_s)

    async def _sleep(self, stop: asyncio.Event, seconds: float) -> None:
        """Until ``seconds`` pass, ``stop`` is set or a re-detection is asked for."""
        waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self._kick.wait())]
        try:
            await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
            self._kick.clear()

    async def _on_doctor(self, msg: Msg) -> None:
        """Re-detect now, torch included, publish if changed, and reply with a DoctorReport:
        what changed since the detection before, the node's health and its devices'. Over the
        doctor rate limit: a report that says so, at once."""
        wait = self._doctor_limit.take("doctor")
        if wait:
            await self._refuse_doctor(msg, wait)
            return
        try:
            if self._looks_for_containers:
                # Asked to look again: the container self-test too (an admin fixed podman).
                if self._runtime_task is not None and not self._runtime_task.done():
                    self._runtime_task.cancel()  # its answer may predate the fix
                    with contextlib.suppress(asyncio.CancelledError):
                        await self._runtime_task
                self.containers.forget()
                (runtime,) = await collect(self._context(), [self.containers])
                self._runtime = runtime
            async with self._lock:
                caps = await self.detect()
                changes = self._compare(caps)
            if "torch" in self._frameworks():
                key = self._torch_cache_key()
                finding = await query_torch(self._s.python, self._run, self._s.torch_timeout)
                async with self._lock:
                    self._torch, self._torch_key = finding, key
            async with self._lock:
                caps = self._build()
                await self._publish_if_changed(caps)
            obs = await self.observer.observe_once()
            report = DoctorReport(
                node_id=self._node,
                capabilities=caps,
                changes=changes,
                health=obs.health,
                devices=obs.devices,
                notes=obs.notes,
            )
            await msg.respond(encode(report))
        except Exception:
            log.exception("doctor request failed")

    async def _refuse_doctor(self, msg: Msg, wait: float) -> None:
        s = self._s
        why = (
            f"rate limited: node {self._node} answers {s.doctor_burst} doctor requests at once "
            f"and {s.doctor_rate:g} a second after; retry in {math.ceil(wait)} s"
        )
        log.warning("doctor request refused: %s", why)
        report = DoctorReport(node_id=self._node, error=why, retry_after_s=round(wait, 1))
        with contextlib.suppress(Exception):  # the requester is gone: nothing to tell
            await msg.respond(encode(report))

    async def _heartbeat(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            hb = Heartbeat(node_id=self._node, sent_at=datetime.now(UTC), agent_version=__version__)
            try:
                await self._nc.publish(node_heartbeat(self._node), encode(hb))
            except Exception as err:
                log.warning("heartbeat failed: %s", err)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self._s.heartbeat_s)


async def serve(
    nc: Client,
    node_id: str,
    *,
    heartbeat_s: float,
    stop: asyncio.Event,
    settings: ProbeSettings | None = None,
) -> None:
    """Run the probe service until ``stop`` is set (kept for callers of the first version)."""
    s = settings or ProbeSettings(heartbeat_s=heartbeat_s)
    await ProbeService(nc, node_id, s).run(stop)


async def detect(node_id: str) -> WorkerCapabilities:
    """One detection without the torch query (kept for callers of the first version, which
    was synchronous; now a coroutine)."""
    from gpulayer_detection.registry import detect_capabilities

    return await detect_capabilities(node_id, include_torch=False)
