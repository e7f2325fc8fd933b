"""Container jobs on real podman, the whole way: CLI submit, placement, executor, shim, podman.

One stack runs every case at once (a container start costs about a second here): the image is
made by the test from Debian's busybox-static and a marker file, imported with ``podman
import`` (never pulled), and removed at the end; GPUs are the fake nvidia-smi's, handed to
containers through a CDI spec the test writes under a kind of its own, mapping device names to
device nodes it makes.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import tarfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from tests.helpers import Services, gpulayer, service_env

from gpulayer_contracts.codec import event_decoder
from gpulayer_contracts.subjects import JOB_WILDCARD_EVENTS
from gpulayer_detection.containers import is_static_elf
from gpulayer_executor import container as ctr
from gpulayer_executor.container import LABEL_EXECUTOR, container_name, executor_label
from gpulayer_executor.shim import read_status
from gpulayer_runtime.nats import ensure_streams

PODMAN = shutil.which("podman")
# A static one: the image holds nothing else (a dynamic busybox would find no libc there).
BUSYBOX = next(
    (p for p in ("/bin/busybox", "/usr/bin/busybox") if os.path.exists(p) and is_static_elf(p)),
    None,
)

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        PODMAN is None or shutil.which("runc") is None or BUSYBOX is None or os.geteuid() != 0,
        reason="container jobs need root, podman, runc and a static busybox: "
        "apt-get install podman runc busybox-static",
    ),
]

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TERMINAL = {"rejected", "succeeded", "failed", "cancelled", "lost"}
OWNER_UIDS = (4_100_000, 4_100_999)
PULL_TIMEOUT_S = 8


def _podman(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    assert PODMAN is not None
    return subprocess.run(
        [PODMAN, "--runtime", "runc", *args], input=stdin, capture_output=True, timeout=120
    )


@pytest.fixture
def image(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """A busybox image only this test has: its name and the marker only it holds. The same
    files also as an image for another architecture: ``<name>-foreign``."""
    assert BUSYBOX is not None
    marker = f"marker-{uuid.uuid4().hex}"
    name = f"localhost/gpulayer-test-{uuid.uuid4().hex[:12]}:1"
    root = tmp_path / "rootfs"
    (root / "bin").mkdir(parents=True)
    shutil.copy(BUSYBOX, root / "bin" / "busybox")
    (root / "marker").write_text(marker + "\n")
    tar = tmp_path / "rootfs.tar"
    with tarfile.open(tar, "w") as t:
        t.add(root, arcname=".")
    foreign = name.replace(":1", "-foreign:1")
    other = "arm64" if ctr.host_arch() != "arm64" else "amd64"
    for args in ([str(tar), name], ["--arch", other, str(tar), foreign]):
        done = _podman("import", *args)
        assert done.returncode == 0, done.stderr
    try:
        yield name, marker
    finally:
        _podman("rmi", "--force", name, foreign)


@pytest.fixture
async def silent_registry() -> AsyncIterator[str]:
    """A registry address that accepts connections and never answers: a pull that hangs."""
    held: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"127.0.0.1:{port}"
    finally:
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()


@pytest.fixture
def cdi(tmp_path: Path) -> Iterator[str]:
    """A CDI spec in /etc/cdi (podman 4.3 reads no other folder) under a kind of this test's
    own: devices 0-3, each a device node the test made (/dev/null's 1:3, harmless)."""
    kind = f"gpulayer-test.example/gpu{uuid.uuid4().hex[:12]}"
    nodes = tmp_path / "dev"
    nodes.mkdir()
    devices = []
    for i in range(4):
        host = nodes / f"gpu{i}"
        os.mknod(host, 0o666 | 0o020000, os.makedev(1, 3))
        edits = {"deviceNodes": [{"path": f"/dev/gltest-gpu{i}", "hostPath": str(host)}]}
        devices.append({"name": str(i), "containerEdits": edits})
    spec = {"cdiVersion": "0.5.0", "kind": kind, "devices": devices}
    folder = Path("/etc/cdi")
    folder.mkdir(exist_ok=True)
    path = folder / f"{kind.replace('/', '_')}.json"
    path.write_text(json.dumps(spec))
    try:
        yield kind
    finally:
        path.unlink(missing_ok=True)


class Events:
    """Every event of the jobs, as they come."""

    def __init__(self) -> None:
        self.seen: dict[str, list[Any]] = {}
        self.changed = asyncio.Event()

    async def cb(self, msg: Msg) -> None:
        ev = event_decoder.decode(msg.data)
        self.seen.setdefault(ev.job_id, []).append(ev)
        self.changed.set()

    def types(self, job: str) -> list[str]:
        return [str(type(e).__struct_config__.tag) for e in self.seen.get(job, [])]

    def last(self, job: str) -> Any:
        return self.seen[job][-1]

    async def until(self, job: str, types: set[str], timeout: float = 60) -> Any:
        try:
            async with asyncio.timeout(timeout):
                while not set(self.types(job)) & types:
                    self.changed.clear()
                    await self.changed.wait()
        except TimeoutError:
            raise AssertionError(f"{job}: no {types} in {self.seen.get(job)}") from None
        return next(e for e, t in zip(self.seen[job], self.types(job), strict=True) if t in types)


def _leftovers(label: str) -> list[str]:
    done = _podman(
        "ps", "--all", "--filter", f"label={LABEL_EXECUTOR}={label}", "--format", "{{.Names}}"
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.decode().split()


def _monitors(name: str) -> list[psutil.Process]:
    """The conmon processes still running container ``name``."""
    return [
        p
        for p in psutil.process_iter(["name", "cmdline"])
        if p.info["name"] == "conmon" and name in (p.info["cmdline"] or [])
    ]


@pytest.fixture
async def stack(
    nats_url: str,
    database_url: str,
    tmp_path: Path,
    nc: Client,
    cdi: str,
) -> AsyncIterator[tuple[Services, dict[str, str]]]:
    await ensure_streams(nc.jetstream())
    tools = tmp_path / "bin"
    tools.mkdir()
    shutil.copy(FIXTURES / "nvidia-smi" / "fake-nvidia-smi", tools / "nvidia-smi")
    (tools / "nvidia-smi").chmod(0o755)
    env = service_env(
        nats_url,
        database_url,
        tmp_path / "work",
        f"ctr-{uuid.uuid4().hex[:8]}",
        GPULAYER_EXECUTOR_CDI_KIND=cdi,
        GPULAYER_EXECUTOR_OWNER_UIDS=f"{OWNER_UIDS[0]}-{OWNER_UIDS[1]}",
        GPULAYER_KILL_GRACE_S="1",
        GPULAYER_EXECUTOR_CONTAINER_PULL_TIMEOUT_S=str(PULL_TIMEOUT_S),
        FAKE_NVIDIA_SMI_DIR=str(FIXTURES / "nvidia-smi" / "t4-2x"),
        # The probe looks for podman (tests/conftest.py tells other stacks' probes not to):
        # container jobs are placed only where its self-test started a container.
        GPULAYER_PROBE_PODMAN="podman",
    )
    env["PATH"] = f"{tools}{os.pathsep}{env['PATH']}"
    async with Services() as services:
        for name in ("gpulayer-placement", "gpulayer-executor", "gpulayer-probe"):
            await services.start(name, env, tmp_path / f"{name}.log")
        yield services, env


def _job(path: Path, job: dict[str, Any]) -> str:
    path.write_text(json.dumps(job))
    return str(path)


def _gpu(job_id: str, image: str, command: list[str]) -> dict[str, Any]:
    return {
        "job_id": job_id,
        "command": command,
        "container": {"image": image, "pull": "never"},
        "requirements": {"accelerator": "cuda", "gpu_count": 1, "cpu_cores": 0.1},
        "gpu": {"use": "exclusive"},
        "sandbox": {"devices": {"gpu": "compute"}},
    }


async def _logs(job: str, env: dict[str, str]) -> str:
    code, out, err = await gpulayer("logs", job, env=env)
    assert code == 0, err
    return out


async def test_container_jobs_the_whole_way(
    stack: tuple[Services, dict[str, str]],
    image: tuple[str, str],
    silent_registry: str,
    nc: Client,
    tmp_path: Path,
) -> None:
    services, env = stack
    name, marker = image
    events = Events()
    sub = await nc.subscribe(JOB_WILDCARD_EVENTS, cb=events.cb)
    bb = "/bin/busybox"
    tag = uuid.uuid4().hex[:6]
    keys = "ok seven never oom timeout hold dev1 kill pullfail pullslow arch shim pullcancel"
    ids = {k: f"ctr-{k}-{tag}" for k in keys.split()}
    missing = f"localhost/gpulayer-missing-{tag}:1"
    # Nothing listens on port 1: the pull fails at once. The silent registry holds it.
    unreachable = f"127.0.0.1:1/gpulayer-{tag}:1"
    hanging = f"{silent_registry}/gpulayer-{tag}:1"
    foreign = name.replace(":1", "-foreign:1")
    jobs: dict[str, dict[str, Any]] = {
        "ok": {
            "command": [bb, "sh", "-c", f"{bb} cat /marker; {bb} id -u; echo $GREETING; {bb} pwd"],
            "env": {"GREETING": "hello from outside"},
            "container": {"image": name, "pull": "never"},
        },
        "seven": {"command": [bb, "sh", "-c", "exit 7"], "container": {"image": name}},
        "never": {"command": ["true"], "container": {"image": missing, "pull": "never"}},
        "oom": {
            "command": [bb, "sh", "-c", f'x=$({bb} head -c 200000000 /dev/zero | {bb} tr "\\0" a)'],
            "requirements": {"memory_gb": 0.03, "cpu_cores": 0.1},
            "container": {"image": name, "pull": "never"},
        },
        "timeout": {
            "command": [bb, "sleep", "60"],
            "timeout_s": 2,
            "container": {"image": name, "pull": "never"},
        },
        "pullfail": {"command": ["true"], "container": {"image": unreachable}},
        "pullslow": {"command": ["true"], "container": {"image": hanging, "pull": "always"}},
        "arch": {"command": ["true"], "container": {"image": foreign}},
        "pullcancel": {"command": ["true"], "container": {"image": hanging, "pull": "always"}},
    }
    for key, body in jobs.items():
        # A tenth of a core each: the 2-core node runs them all at once.
        body.setdefault("requirements", {"cpu_cores": 0.1})
        path = _job(tmp_path / f"{key}.json", {"job_id": ids[key], **body})
        code, _, err = await gpulayer("submit", path, env=env)
        assert code == 0, err
    # Cancelled while its image is being pulled (never running): the pull ends with it.
    await events.until(ids["pullcancel"], {"placed"} | TERMINAL)
    code, _, err = await gpulayer("cancel", ids["pullcancel"], env=env)
    assert code == 0, err
    # The GPU jobs: the one holding device 0 runs first, so the second gets device 1.
    hold = _gpu(ids["hold"], name, [bb, "sleep", "60"])
    code, _, err = await gpulayer("submit", _job(tmp_path / "hold.json", hold), env=env)
    assert code == 0, err
    await events.until(ids["hold"], {"running"} | TERMINAL)
    dev1 = _gpu(ids["dev1"], name, [bb, "ls", "/dev"])
    code, _, err = await gpulayer("submit", _job(tmp_path / "dev1.json", dev1), env=env)
    assert code == 0, err

    never = await events.until(ids["never"], TERMINAL)
    placed = await events.until(ids["never"], {"placed"})
    never_s = (never.at - placed.at).total_seconds()
    await events.until(ids["dev1"], TERMINAL, timeout=120)
    code, _, err = await gpulayer("cancel", ids["hold"], env=env)
    assert code == 0, err
    for key in ("hold", "ok", "seven", "oom", "timeout", "pullfail", "pullslow", "arch"):
        await events.until(ids[key], TERMINAL, timeout=120)

    assert events.types(ids["ok"])[-1] == "succeeded", events.seen[ids["ok"]]
    out = (await _logs(ids["ok"], env)).splitlines()
    assert marker in out[0]  # read from inside the image
    uid = int(out[1].split()[-1])
    assert OWNER_UIDS[0] <= uid <= OWNER_UIDS[1]  # the owner's uid, not root
    assert out[2].endswith("hello from outside")
    assert "/jobs/" in out[3]  # its own folder is its working directory

    seven = events.last(ids["seven"])
    assert (events.types(ids["seven"])[-1], seven.exit_code) == ("failed", 7), seven

    assert events.types(ids["never"])[-1] == "failed"
    assert missing in never.reason, never.reason
    assert "never" in never.reason, never.reason
    print(f"missing image with pull=never: failed {never_s:.2f} s after it was placed")

    pullfail = events.last(ids["pullfail"])
    assert events.types(ids["pullfail"])[-1] == "failed"
    assert pullfail.reason.startswith(f"image {unreachable}: pull failed: "), pullfail.reason
    pullslow = events.last(ids["pullslow"])
    assert events.types(ids["pullslow"])[-1] == "failed"
    assert pullslow.reason.startswith(
        f"image {hanging}: its pull took longer than {PULL_TIMEOUT_S} s"
    ), pullslow.reason
    await events.until(ids["pullcancel"], TERMINAL)
    assert events.types(ids["pullcancel"])[-1] == "cancelled", events.seen[ids["pullcancel"]]
    assert "running" not in events.types(ids["pullcancel"])
    arch = events.last(ids["arch"])
    assert events.types(ids["arch"])[-1] == "failed"
    assert arch.reason == f"image {foreign} is for arm64, this node is amd64" or (
        ctr.host_arch() == "arm64"
    ), arch.reason

    oom = events.last(ids["oom"])
    assert events.types(ids["oom"])[-1] == "failed"
    assert oom.reason.startswith("out of memory"), oom.reason

    timeout = events.last(ids["timeout"])
    assert (events.types(ids["timeout"])[-1], timeout.reason) == ("failed", "timeout")
    assert events.types(ids["hold"])[-1] == "cancelled"

    assert events.types(ids["dev1"])[-1] == "succeeded", events.seen[ids["dev1"]]
    devs = {d for d in (await _logs(ids["dev1"], env)).split() if "gltest-gpu" in d}
    assert {d.rsplit("gltest-", 1)[-1] for d in devs} == {"gpu1"}, devs

    # The executor killed while a container job runs: the job goes on under its shim, and the
    # executor started again reports it once, with its whole log.
    body = {
        "job_id": ids["kill"],
        "command": [bb, "sh", "-c", "echo before; sleep 3; echo after"],
        "container": {"image": name, "pull": "never"},
    }
    code, _, err = await gpulayer("submit", _job(tmp_path / "kill.json", body), env=env)
    assert code == 0, err
    await events.until(ids["kill"], {"running"} | TERMINAL)
    executor = services.procs["gpulayer-executor"]
    executor.send_signal(signal.SIGKILL)
    await executor.wait()
    await services.start("gpulayer-executor", env, tmp_path / "executor-2.log")
    await events.until(ids["kill"], TERMINAL, timeout=60)
    await asyncio.sleep(1)  # a second report would come now
    types = events.types(ids["kill"])
    assert [t for t in types if t in TERMINAL] == ["succeeded"], types
    lines = (await _logs(ids["kill"], env)).splitlines()
    assert [line.split()[-1] for line in lines] == ["before", "after"], lines

    # Its shim killed: the job is lost, and its container goes with it.
    body = {
        "job_id": ids["shim"],
        "command": [bb, "sleep", "60"],
        "container": {"image": name, "pull": "never"},
    }
    code, _, err = await gpulayer("submit", _job(tmp_path / "shim.json", body), env=env)
    assert code == 0, err
    await events.until(ids["shim"], {"running"} | TERMINAL)
    runs = [r for r in (tmp_path / "work" / "run").iterdir() if read_status(r).exit is None]
    assert len(runs) == 1, runs
    shim = read_status(runs[0]).shim
    assert shim is not None
    label = executor_label((tmp_path / "work").resolve())
    # The job's container (its run folder is named by its grant): killed once its monitor runs,
    # so that there is a monitor whose end this step can check.
    name = container_name((tmp_path / "work").resolve(), runs[0].name)
    deadline = asyncio.get_running_loop().time() + 60
    while not _monitors(name):  # a process's start: nothing to await
        assert asyncio.get_running_loop().time() < deadline, f"no conmon for {name}"
        await asyncio.sleep(0.05)
    os.kill(shim.pid, signal.SIGKILL)
    lost = await events.until(ids["shim"], TERMINAL)
    assert (events.types(ids["shim"])[-1], lost.reason) == ("lost", "the job's shim died")

    await sub.unsubscribe()
    # Nothing of an ended job is left: no container of this executor's, and no container
    # monitor (with what runs under it) podman may have lost track of.
    assert _leftovers(label) == []
    assert _monitors(name) == []
