"""A container job's start against ``podman run --rm`` of the same image and command alone
(issue 49): both timed to the moment the command inside the container reads the clock.

The command is busybox's ``adjtimex``, which reads the kernel's clock (``adjtimex(2)``: the
wall clock, CLOCK_REALTIME, in µs) before anything else and prints it. The job's start is that
time less the bench's clock just before the job's submit publish (its line arrives on the job's
LOGS subject); podman's is that time less the bench's clock just before ``podman run`` is
spawned (its line on podman's stdout). One at a time, alternating job and podman, so each
sample is one start's latency on an otherwise idle node; the first few of each are warm-up.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import msgspec
from nats.aio.msg import Msg

from bench.containers import BUSYBOX, container_node, job_maker
from bench.figures import EventWatch, start_executor
from bench.fleet import encoded
from bench.harness import (
    BenchError,
    Scenario,
    load_fleet,
    percentile,
    tail,
    wait_for_consumer,
)
from bench.report import Figure
from gpulayer_contracts.events import LogLine
from gpulayer_contracts.subjects import (
    JOB_WILDCARD_EVENTS,
    JOB_WILDCARD_LOGS,
    JOBS_SUBMIT,
    MSG_ID_HEADER,
)

COMMAND = (BUSYBOX, "adjtimex")
# podman's options that the job's ``podman run`` shares and that change its cost: the OCI
# runtime and the network (the executor's default, ``GPULAYER_EXECUTOR_CONTAINER_NETWORK``).
PODMAN_OPTIONS = ("--runtime", "runc")
RUN_OPTIONS = ("--network", "host")
# podman's defaults as the repository's own podman runs have them (runc, and open-file and
# process limits this host's hard limits allow: podman's own ask for more, and runc refuses).
CONTAINERS_CONF = Path(__file__).resolve().parent.parent / "deploy" / "podman" / "containers.conf"
SAMPLES = 40
WARMUP = 3
# One job's or one podman run's bound, its removal included.
SAMPLE_TIMEOUT_S = 60.0

_SEC = re.compile(r"time\.tv_sec:\s*(\d+)")
_USEC = re.compile(r"time\.tv_usec:\s*(\d+)")
_STATUS = re.compile(r"status:\s*(\d+)")
STA_NANO = 0x2000  # adjtimex(2): tv_usec holds nanoseconds


def clock_read(text: str) -> float | None:
    """The wall-clock time busybox ``adjtimex`` printed, in seconds; None when ``text`` holds
    no complete reading. Pure."""
    sec, sub = _SEC.search(text), _USEC.search(text)
    if sec is None or sub is None:
        return None
    status = _STATUS.search(text)
    nano = status is not None and int(status.group(1)) & STA_NANO
    return int(sec.group(1)) + int(sub.group(1)) / (1e9 if nano else 1e6)


class LogWatch:
    """The in-container clock reading of each job, from its LOGS lines (core subscription)."""

    def __init__(self) -> None:
        self.text: dict[str, str] = {}
        self.read: dict[str, float] = {}
        self.event = asyncio.Event()
        self.decoder = msgspec.json.Decoder(LogLine)

    async def cb(self, msg: Msg) -> None:
        try:
            line = self.decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        if line.stream != "stdout" or line.job_id in self.read:
            return
        text = self.text.get(line.job_id, "") + line.line + "\n"
        self.text[line.job_id] = text
        when = clock_read(text)
        if when is not None:
            self.read[line.job_id] = when
            self.event.set()

    async def wait(self, job_id: str, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while job_id not in self.read:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BenchError(f"job {job_id}: no clock reading in {timeout:g}s")
            self.event.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.event.wait(), left)
        return self.read[job_id]


def podman_run_once(image: str) -> float:
    """Seconds from the spawn of ``podman run --rm`` to its command's clock reading. Blocking."""
    argv = ["podman", *PODMAN_OPTIONS, "run", "--rm", *RUN_OPTIONS, image, *COMMAND]
    env = {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}
    t0 = time.time()
    done = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=SAMPLE_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
        env=env,
    )
    when = clock_read(done.stdout)
    if done.returncode != 0 or when is None:
        raise BenchError(f"podman run: exit {done.returncode}: {done.stderr.strip()[-300:]}")
    return when - t0


@dataclass
class ContainerStart:
    job_s: list[float] = field(default_factory=list)
    podman_s: list[float] = field(default_factory=list)

    def figures(self) -> list[Figure]:
        job_p50 = percentile(self.job_s, 50) * 1000
        pod_p50 = percentile(self.podman_s, 50) * 1000
        note = f"{len(self.job_s)} of each, alternating, after {WARMUP} warm-up each"
        return [
            Figure("container_start_p50_ms", job_p50, "ms", note=note),
            Figure("container_start_p99_ms", percentile(self.job_s, 99) * 1000, "ms"),
            Figure(
                "podman_run_p50_ms", pod_p50, "ms", note="podman run --rm, same image and command"
            ),
            Figure("podman_run_p99_ms", percentile(self.podman_s, 99) * 1000, "ms"),
            Figure("container_start_over_podman", job_p50 / pod_p50, "x", note="ratio of p50s"),
        ]


async def container_start(
    s: Scenario,
    image: str,
    executor_env: dict[str, str],
    samples: int = SAMPLES,
    warmup: int = WARMUP,
) -> ContainerStart:
    """One node with 8 CUDA devices and its real executor; ``warmup + samples`` container jobs
    and as many ``podman run --rm``, alternating, one at a time."""
    node = "bench-cstart"
    executor = start_executor(s, node, executor_env)
    logs = LogWatch()
    events = EventWatch()
    subs = [
        await s.nc.subscribe(JOB_WILDCARD_LOGS, cb=logs.cb),
        await s.nc.subscribe(JOB_WILDCARD_EVENTS, cb=events.cb),
    ]
    make = job_maker(image)
    out = ContainerStart()
    loop = asyncio.get_running_loop()
    try:
        await wait_for_consumer(s.js, "GRANTS", f"executor-{node}", executor, timeout=60)
        await load_fleet(s, [container_node(node, datetime.now(UTC))], timeout=30)
        for i in range(warmup + samples):
            ((key, body),) = encoded([make(f"cstart-{i:04d}", list(COMMAND))])
            events.reset({key})
            t0 = time.time()
            await s.js.publish(JOBS_SUBMIT, body, headers={MSG_ID_HEADER: key})
            try:
                job = await logs.wait(key, SAMPLE_TIMEOUT_S) - t0
            except BenchError as err:
                executor.check_alive()
                raise BenchError(f"{err}: {tail(executor.log)}") from None
            # The next sample starts once this job is over, its container removed.
            await events.wait(SAMPLE_TIMEOUT_S)
            if events.finished.get(key, (0.0, ""))[1] != "succeeded":
                raise BenchError(f"job {key}: {events.finished.get(key)}: {tail(executor.log)}")
            podman = await loop.run_in_executor(None, podman_run_once, image)
            if i >= warmup:
                out.job_s.append(job)
                out.podman_s.append(podman)
            print(
                f"# container_start {i + 1}/{warmup + samples}{' (warm-up)' if i < warmup else ''}:"
                f" job {job * 1000:.0f} ms, podman {podman * 1000:.0f} ms",
                flush=True,
            )
        return out
    finally:
        for sub in subs:
            await sub.unsubscribe()
        executor.stop()
