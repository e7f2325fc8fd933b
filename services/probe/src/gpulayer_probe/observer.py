"""Live observations: every ``observe_s`` run the observation query, apply the health rule with
hysteresis, and publish ``NodeObservations`` on core NATS.

Cheap by design: one nvidia-smi call, one small message. When the devices nvidia-smi answers
for differ from the last detection's, the observer asks for a re-detection at once (a vanished
GPU must not wait for the next refresh to lose its jobs).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from datetime import UTC, datetime

from nats.aio.client import Client

from gpulayer_contracts import WorkerCapabilities, encode
from gpulayer_contracts.health import DeviceObservation, NodeHealth, NodeObservations, worst
from gpulayer_contracts.subjects import node_observations
from gpulayer_detection.health import Tracker
from gpulayer_detection.observe import gpu_device_files, observe
from gpulayer_detection.runner import Runner

log = logging.getLogger(__name__)


def node_health(
    devices: list[DeviceObservation], caps: WorkerCapabilities | None, device_files: list[str]
) -> NodeHealth:
    """The node's summary: its worst device, or ``undetected`` when it has GPU device files
    but no GPU detection reached (no driver loaded, no nvidia-smi): never an alert."""
    if (
        not devices
        and device_files
        and (caps is None or not any(d.accelerator == "cuda" for d in caps.accelerators))
    ):
        return "undetected"
    return worst([d.health for d in devices])


class Observer:
    def __init__(
        self,
        nc: Client,
        node_id: str,
        *,
        run: Runner,
        timeout: float,
        interval_s: float,
        recover_after: int,
        dev_dir: str,
        capabilities: Callable[[], WorkerCapabilities | None],
        redetect: Callable[[], None],
    ) -> None:
        self._nc = nc
        self._node = node_id
        self._run = run
        self._timeout = timeout
        self._interval = interval_s
        self._dev_dir = dev_dir
        self._caps = capabilities
        self._redetect = redetect
        self._tracker = Tracker(recover_after)
        self._buses: dict[str, int] = {}
        self.last: NodeObservations | None = None
        self.published = 0  # for tests
        # The (answering, detected) GPU sets a re-detection was last asked for; None: they agree.
        self._asked: tuple[frozenset[int], frozenset[int]] | None = None

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                obs = await self.observe_once()
                await self._nc.publish(node_observations(self._node), encode(obs))
                self.published += 1
            except Exception:
                log.exception("observing devices failed; trying again at the next period")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self._interval)

    async def observe_once(self) -> NodeObservations:
        """One pass: query, judge, and ask for a re-detection on a device mismatch."""
        caps = self._caps()
        gpus = (
            [d for d in caps.accelerators if d.accelerator == "cuda" and d.mig_parent is None]
            if caps is not None
            else []
        )
        notes: list[str] = []
        devices: list[DeviceObservation] = []
        if gpus or caps is None or gpu_device_files(self._dev_dir):
            seen, result = await observe(self._run, self._timeout, self._buses)
            self._buses.update(seen.buses)
            notes = seen.notes
            if not seen.devices and not result.ok:
                notes.append(f"nvidia-smi: {result.describe()}"[:1000])
            devices = self._tracker.update(seen.devices)
            answering = frozenset(d.index for d in devices if d.state == "ok")
            detected = frozenset(d.index for d in gpus)
            mismatch = (answering, detected) if caps is not None and answering != detected else None
            # One re-detection per mismatch: when the next detection finds the same devices and
            # nvidia-smi keeps answering the same, detecting again each period would only burn
            # the node's CPU (an observation query that fails while detection works).
            if mismatch is not None and mismatch != self._asked:
                log.info(
                    "nvidia-smi answers for GPUs %s, the last detection found %s: detecting again",
                    sorted(answering),
                    sorted(detected),
                )
                self._redetect()
            self._asked = mismatch
        files = gpu_device_files(self._dev_dir)
        obs = NodeObservations(
            node_id=self._node,
            observed_at=datetime.now(UTC),
            devices=devices,
            health=node_health(devices, caps, files),
            notes=notes[:16],
        )
        self.last = obs
        return obs
