"""A job's limits, enforced for real in its cgroup: memory (a job past it fails with "out of
memory"), devices (only the granted /dev/nvidia<N> opens), pids (a fork bomb stops), and what
the executor's heartbeat says about them. Real NATS and real cgroups; each test is skipped, with
the reason, where this machine has no writable controller for it (or we are not root)."""

from __future__ import annotations

import io
import os
import stat
import sys
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from tests.helpers import TEST_PUBLIC_KEYS, connect_args, pid_alive, reason, running_executor
from tests.integration.test_executor import (
    NODE,
    job_events_until_terminal,
    make_grant,
    publish_grant,
)

from gpulayer_cli.logs import run_logs
from gpulayer_contracts.codec import heartbeat_decoder
from gpulayer_contracts.events import AnyJobEvent, Grant
from gpulayer_contracts.jobenv import base_environment
from gpulayer_contracts.jobs import Requirements, Sandbox, SandboxDevices
from gpulayer_contracts.subjects import node_heartbeat
from gpulayer_executor import cgroups
from gpulayer_executor.service import Executor, ExecutorConfig
from gpulayer_runtime.nats import ensure_streams

pytestmark = pytest.mark.integration

NVIDIA_MAJOR = 195
StartExecutor = Callable[..., AbstractAsyncContextManager[Executor]]


def _enforcing(controller: str) -> cgroups.Hierarchy:
    """The hierarchy this machine enforces limits in, or skip (saying why) where it has none
    that enforces ``controller``."""
    if os.geteuid() != 0:
        pytest.skip("cgroup limits need root (the executor writes its job cgroups)")
    found = cgroups.hierarchy(True)
    if found is None or controller not in found.controllers:
        mode = cgroups.enforcement(found)
        if controller == "devices" and found is not None and found.version == "v2":
            pytest.skip(f"{mode}: v2 device control needs an eBPF program, not done")
        pytest.skip(f"no writable {controller} controller here (enforcement: {mode})")
    return found


@pytest.fixture
async def js(nc: Client) -> JetStreamContext:
    js = nc.jetstream()
    await ensure_streams(js)
    return js


@pytest.fixture
def start_executor(nc: Client, tmp_path: Path) -> StartExecutor:
    """An executor (jobs run as its own account, root here) with these settings."""

    def start(**settings: Any) -> AbstractAsyncContextManager[Executor]:
        config = ExecutorConfig(
            node_id=NODE,
            workdir=tmp_path / "executor",
            base_env=base_environment(os.environ, user="tester", home=str(tmp_path)),
            kill_grace_s=0.5,
            fetch_timeout_s=0.2,
            placement_public_keys=TEST_PUBLIC_KEYS,
            **settings,
        )
        return running_executor(nc, config)

    return start


def python_job(code: str) -> Grant:
    return make_grant([sys.executable, "-c", code])


def with_requirements(grant: Grant, **req: Any) -> Grant:
    job = msgspec.structs.replace(grant.job, requirements=Requirements(**req))
    return msgspec.structs.replace(grant, job=job)


async def run_job(js: JetStreamContext, grant: Grant) -> list[AnyJobEvent]:
    await publish_grant(js, grant)
    return await job_events_until_terminal(js, grant.job.job_id, timeout=60)


async def output(nats_url: str, job_id: str) -> list[str]:
    out = io.StringIO()
    code = await run_logs(nats_url, job_id, follow=False, out=out, connect_args=connect_args())
    assert code == 0
    return out.getvalue().splitlines()


def tags(events: list[AnyJobEvent]) -> list[str]:
    return [str(e.__struct_config__.tag) for e in events]


async def test_a_job_past_its_memory_fails_with_out_of_memory(
    js: JetStreamContext, start_executor: StartExecutor
) -> None:
    _enforcing("memory")
    # 1 GB, touched page by page (bytearray zero-fills), against a 0.2 GB limit.
    grant = with_requirements(python_job("b = bytearray(10**9); print('survived')"), memory_gb=0.2)
    async with start_executor():
        done = await run_job(js, grant)
    assert tags(done) == ["running", "failed"]
    assert reason(done[-1]) == (
        "out of memory: the job passed its memory_gb = 0.2 (200000000 bytes)"
    )


async def test_a_job_past_its_memory_from_its_first_instant_fails_with_out_of_memory(
    js: JetStreamContext, start_executor: StartExecutor
) -> None:
    _enforcing("memory")
    # 1000 bytes: less than the job uses by the time the limit is written (right after the
    # spawn), which the kernel refuses to set; the job is ended, never left unlimited.
    grant = with_requirements(make_grant(["sleep", "30"]), memory_gb=1e-6)
    async with start_executor():
        done = await run_job(js, grant)
    assert tags(done) == ["running", "failed"]
    assert reason(done[-1]) == "out of memory: the job passed its memory_gb = 1e-06 (1000 bytes)"


async def test_a_job_under_its_memory_succeeds(
    js: JetStreamContext, start_executor: StartExecutor
) -> None:
    _enforcing("memory")
    grant = with_requirements(python_job("b = bytearray(50 * 10**6)"), memory_gb=0.5)
    async with start_executor():
        done = await run_job(js, grant)
    assert tags(done) == ["running", "succeeded"]


OPEN_BOTH = """
import errno, os, sys
for n in (0, 1):
    try:
        os.close(os.open(os.path.join(sys.argv[1], f"nvidia{n}"), os.O_RDWR))
        print(f"nvidia{n} opened")
    except OSError as err:
        print(f"nvidia{n} {errno.errorcode[err.errno]}")
"""


@pytest.fixture
def fake_gpus(tmp_path: Path) -> Path:
    """A device folder of a 2-GPU node: nvidia0 and nvidia1 (char 195:0, 195:1) and the control
    node nvidiactl (195:255). No driver has major 195 here, so an open that the devices cgroup
    lets through reaches the kernel's "no such device" (ENXIO)."""
    folder = tmp_path / "dev"
    folder.mkdir()
    for name, minor in (("nvidia0", 0), ("nvidia1", 1), ("nvidiactl", 255)):
        os.mknod(folder / name, 0o666 | stat.S_IFCHR, os.makedev(NVIDIA_MAJOR, minor))
    return folder


async def test_a_job_opens_only_its_granted_device(
    nats_url: str, js: JetStreamContext, start_executor: StartExecutor, fake_gpus: Path
) -> None:
    _enforcing("devices")
    gpu = Sandbox(devices=SandboxDevices(gpu="compute"))
    grant = make_grant(
        [sys.executable, "-c", OPEN_BOTH, str(fake_gpus)],
        accelerator="cuda",
        devices=[1],
        sandbox=gpu,
    )
    cpu = make_grant([sys.executable, "-c", OPEN_BOTH, str(fake_gpus)])
    async with start_executor(device_dir=fake_gpus):
        assert tags(await run_job(js, grant)) == ["running", "succeeded"]
        assert tags(await run_job(js, cpu)) == ["running", "succeeded"]
    # Device 1 is granted: the open reaches the (absent) driver. Device 0 is not: the devices
    # cgroup refuses it, root or not, whatever CUDA_VISIBLE_DEVICES says.
    assert await output(nats_url, grant.job.job_id) == ["nvidia0 EPERM", "nvidia1 ENXIO"]
    # A CPU job gets no GPU at all.
    assert await output(nats_url, cpu.job.job_id) == ["nvidia0 EPERM", "nvidia1 EPERM"]


# Prints the inode of the job's own cgroup folder in the memory hierarchy: the same for two
# jobs when the second got the first one's cgroup, renamed (``cgroup_spare``).
CGROUP_INODE = """
import os
for line in open("/proc/self/cgroup"):
    _, names, path = line.rstrip("\\n").split(":", 2)
    if "memory" in names.split(","):
        print("cgroup inode", os.stat("/sys/fs/cgroup/memory" + path).st_ino, flush=True)
"""


async def test_the_next_job_gets_the_cgroup_back_with_its_own_devices(
    nats_url: str, js: JetStreamContext, start_executor: StartExecutor, fake_gpus: Path
) -> None:
    """A shim keeps its last job's cgroup for its next (cgroup v1): the CPU job's denial of
    every GPU is lifted for the GPU job after it, which is refused the other GPU only."""
    found = _enforcing("devices")
    if found.version != "v1" or "memory" not in found.controllers:
        pytest.skip(f"cgroups are kept for the next job in v1 only ({found.kind} here)")
    probe = OPEN_BOTH + CGROUP_INODE
    cpu = make_grant([sys.executable, "-c", probe, str(fake_gpus)])
    gpu = make_grant(
        [sys.executable, "-c", probe, str(fake_gpus)],
        accelerator="cuda",
        devices=[1],
        sandbox=Sandbox(devices=SandboxDevices(gpu="compute")),
    )
    async with start_executor(device_dir=fake_gpus):
        assert tags(await run_job(js, cpu)) == ["running", "succeeded"]
        assert tags(await run_job(js, gpu)) == ["running", "succeeded"]
    *cpu_opens, cpu_inode = await output(nats_url, cpu.job.job_id)
    *gpu_opens, gpu_inode = await output(nats_url, gpu.job.job_id)
    assert cpu_opens == ["nvidia0 EPERM", "nvidia1 EPERM"]
    assert gpu_opens == ["nvidia0 EPERM", "nvidia1 ENXIO"]
    assert gpu_inode == cpu_inode  # the same cgroup, renamed to the GPU job's grant
    assert not [p for p in found.parents if (p / cpu.grant_id).exists()]


async def test_a_job_after_one_that_ran_out_of_memory_is_not_out_of_memory(
    nats_url: str, js: JetStreamContext, start_executor: StartExecutor
) -> None:
    """The OOM kill of a job is not counted against the next job in the same cgroup."""
    found = _enforcing("memory")
    if found.version != "v1":
        pytest.skip(f"cgroups are kept for the next job in v1 only ({found.kind} here)")
    first = with_requirements(python_job("b = bytearray(10**9)" + CGROUP_INODE), memory_gb=0.2)
    # Killed as the OOM killer would (SIGKILL), its memory well under the limit.
    second = with_requirements(
        python_job(CGROUP_INODE + "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"),
        memory_gb=0.2,
    )
    third = with_requirements(python_job(CGROUP_INODE), memory_gb=0.2)
    async with start_executor():
        first_done = await run_job(js, first)
        second_done = await run_job(js, second)
        assert tags(await run_job(js, third)) == ["running", "succeeded"]
    assert reason(first_done[-1]) == (
        "out of memory: the job passed its memory_gb = 0.2 (200000000 bytes)"
    )
    assert reason(second_done[-1]) == "killed by SIGKILL"
    # The second and third jobs ran in the first one's cgroup (the first never printed).
    (second_inode,) = await output(nats_url, second.job.job_id)
    assert await output(nats_url, third.job.job_id) == [second_inode]


FORK_BOMB = """
import errno, os, time
children = []
for _ in range(10000):
    try:
        pid = os.fork()
    except OSError as err:
        print("fork:", errno.errorcode[err.errno], "after", len(children))
        break
    if pid == 0:
        time.sleep(120)
        os._exit(0)
    children.append(pid)
with open("children", "w") as f:
    f.write(" ".join(map(str, children)))
"""


async def test_a_fork_bomb_stops_at_the_pids_limit_and_leaves_nothing(
    nats_url: str, js: JetStreamContext, start_executor: StartExecutor
) -> None:
    found = _enforcing("pids")
    grant = python_job(FORK_BOMB)
    async with start_executor(job_pids_max=64) as executor:
        done = await run_job(js, grant)
        children_file = executor.store.job_dir(grant.grant_id) / "children"
        children = [int(p) for p in children_file.read_text().split()]
    assert tags(done) == ["running", "succeeded"]
    (line,) = await output(nats_url, grant.job.job_id)
    assert line.startswith("fork: EAGAIN after ")
    # 64 tasks in all: the job itself and at most 63 children.
    assert len(children) == int(line.rsplit(" ", 1)[1]) < 64
    # The node is fine afterwards: every child killed with the job, its cgroups gone.
    assert not [pid for pid in children if pid_alive(pid)]
    assert not [p for p in found.parents if (p / grant.grant_id).exists()]


async def beat_of(nc: Client) -> Any:
    sub = await nc.subscribe(node_heartbeat(NODE))
    try:
        while True:
            beat = heartbeat_decoder.decode((await sub.next_msg(timeout=10)).data)
            if beat.source == "executor":
                return beat
    finally:
        await sub.unsubscribe()


async def test_the_heartbeat_says_slots_reserve_and_enforcement(
    nc: Client, js: JetStreamContext, start_executor: StartExecutor
) -> None:
    found = _enforcing("memory")
    settings = {"max_jobs": 3, "reserved_cores": 0.5, "reserved_memory_gb": 2.0}
    async with start_executor(heartbeat_s=0.1, **settings) as executor:
        beat = await beat_of(nc)
    assert (beat.slots, beat.reserved_cores, beat.reserved_memory_gb) == (3, 0.5, 2.0)
    words = cgroups.v1_enforcement if found.version == "v1" else cgroups.v2_enforcement
    assert beat.enforcement == executor.enforcement == words(list(found.controllers))


@pytest.mark.parametrize("how", ["enforce-off", "no-cgroup"])
async def test_without_enforcement_the_node_says_none_and_jobs_still_run(
    nc: Client,
    js: JetStreamContext,
    start_executor: StartExecutor,
    monkeypatch: pytest.MonkeyPatch,
    how: str,
) -> None:
    if how == "no-cgroup":
        monkeypatch.setattr(cgroups, "hierarchy", lambda enforce=True: None)
    else:
        _enforcing("memory")  # where limits could be enforced, they are not
    # Past its memory_gb, and it runs to its end: nothing limits it.
    grant = with_requirements(python_job("b = bytearray(300 * 10**6)"), memory_gb=0.1)
    async with start_executor(heartbeat_s=0.1, enforce=how != "enforce-off") as executor:
        beat = await beat_of(nc)
        done = await run_job(js, grant)
    assert beat.enforcement == executor.enforcement == "none"
    assert tags(done) == ["running", "succeeded"]
