"""Helpers shared by the end-to-end and integration tests: services as processes (one node's
stack with a credential per role: ``secure_stack``), waiting for job events and for a node,
placement in process, the ``gpulayer`` command line."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import json
import os
import re
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from gpulayer_cli.client import api
from gpulayer_contracts.capabilities import Heartbeat, HostInfo, WorkerCapabilities
from gpulayer_contracts.codec import encode, event_decoder
from gpulayer_contracts.events import CancelJob, Grant, JobStatus
from gpulayer_contracts.subjects import (
    API_NODES,
    JOB_WILDCARD_EVENTS,
    MSG_ID_HEADER,
    node_capabilities,
    node_control,
    node_grants,
    node_heartbeat,
    node_status,
)
from gpulayer_contracts.version import __version__
from gpulayer_executor.service import Executor, ExecutorConfig
from gpulayer_placement.service import PlacementService, Settings
from gpulayer_placement.store import create_pool
from gpulayer_runtime.auth import AuthStore
from gpulayer_runtime.database import create_service_database, replace_url
from gpulayer_runtime.nats import connect, ensure_streams
from gpulayer_runtime.roles import Role
from gpulayer_runtime.servers import EmbeddedNats
from gpulayer_runtime.signing import (
    PUBLIC_KEYS_SETTING,
    SIGNING_KEY_SETTING,
    Signer,
    write_seed,
)

BIN = Path(sys.executable).parent
# The runtime profiles file the repository ships (examples/profiles.toml).
PROFILES_FILE = Path(__file__).resolve().parents[1] / "examples" / "profiles.toml"

# Set by tests/conftest.py while auth is on: the store minting role credentials, and the admin
# credential the tests (and the processes they start) act as.
AUTH_STORE: AuthStore | None = None
TEST_CREDS: str | None = None


# Placement's signing key in tests: one per test session. Executors started by tests accept it;
# placements started by tests sign with it; tests that play placement sign with TEST_SIGNER.
TEST_KEY = Ed25519PrivateKey.generate()
TEST_SIGNER = Signer(TEST_KEY)
TEST_PUBLIC_KEYS = (TEST_SIGNER.public_key,)


class Postgres:
    """The tests' PostgreSQL server: a fresh database per test or module. On the embedded
    server each is owned by the services' own role (no superuser), its password in a passfile,
    as ``gpulayer dev up`` gives placement; on a server of the environment's, as its URL says."""

    def __init__(self, admin_url: str, service_passfile: Path | None) -> None:
        self.admin_url = admin_url
        self.service_passfile = service_passfile

    async def create(self) -> tuple[str, str]:
        """A new database: its name and the URL the services use for it."""
        name = f"t_{uuid.uuid4().hex[:12]}"
        if self.service_passfile is not None:
            return name, await create_service_database(self.admin_url, name, self.service_passfile)
        admin = await asyncpg.connect(self.admin_url)
        try:
            await admin.execute(f'CREATE DATABASE "{name}"')
        finally:
            await admin.close()
        return name, replace_url(self.admin_url, database=name)

    async def drop(self, name: str) -> None:
        admin = await asyncpg.connect(self.admin_url)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()

    @contextlib.asynccontextmanager
    async def database(self) -> AsyncIterator[str]:
        """A new database's URL for the services, dropped afterwards."""
        name, url = await self.create()
        try:
            yield url
        finally:
            await self.drop(name)


@dataclasses.dataclass
class DevUp:
    """A `gpulayer dev up` that serves, and what it printed."""

    proc: asyncio.subprocess.Process
    cwd: Path
    data_dir: Path
    lines: list[str]
    nats_url: str = ""
    database_url: str = ""
    web_port: int = 0
    # The CLI as its hint says to call it, with the environment it says to export.
    cli: str = ""
    cli_env: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def nats_port(self) -> int:
        return int(self.nats_url.rsplit(":", 1)[1])


@contextlib.asynccontextmanager
async def dev_up(folder: Path, examples: Path | None = None) -> AsyncIterator[DevUp]:
    """`gpulayer dev up` as a user starts it (its data under ``folder/dev``, run from
    ``folder``, no examples unless given) until it says "serving"; Ctrl-C at the end, after
    which it must have exited 0."""
    if examples is None:
        examples = folder / "no-examples"
        examples.mkdir()
        (examples / "expectations.toml").write_text("[expect]\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULAYER_")}
    proc = await asyncio.create_subprocess_exec(
        bin_path("gpulayer"), "dev", "up", "--data-dir", str(folder / "dev"),
        "--examples", str(examples),
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, cwd=folder,
    )  # fmt: skip
    assert proc.stdout is not None
    stack = DevUp(proc, folder, folder / "dev", [])
    try:
        async with asyncio.timeout(90):
            while not (stack.lines and stack.lines[-1].startswith("serving")):
                line = (await proc.stdout.readline()).decode()
                assert line, "dev up ended early:\n" + "".join(stack.lines)
                stack.lines.append(line)
                if m := re.match(r"NATS\s+(nats://\S+)", line):
                    stack.nats_url = m[1]
                if m := re.match(r"PostgreSQL\s+(postgresql://\S+)", line):
                    stack.database_url = m[1]
                if m := re.match(r"web\s+http://\S+:(\d+)$", line):
                    stack.web_port = int(m[1])
            stack.lines.append((await proc.stdout.readline()).decode())
        said = re.match(
            r"in another shell: ((?:export \S+=\S+, )*)(?:then )?(\S+) nodes, ", stack.lines[-1]
        )
        assert said, stack.lines[-1]
        stack.cli = said[2]
        stack.cli_env = dict(env, **dict(re.findall(r"export (\S+)=([^\s,]+)", said[1])))
        yield stack
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGINT)
        rest, _ = await asyncio.wait_for(proc.communicate(), 30)
        stack.lines.append(rest.decode())
    assert proc.returncode == 0, "".join(stack.lines)


async def subscribed(nc: Client) -> None:
    """Until the server has every subscription ``nc`` made so far. nats-py's ``flush()`` (2.16)
    writes its PING to the socket at once, while a SUB just made waits in the client's buffer
    for its flusher task: the PONG can come back before the server has the SUB, and a message
    another connection publishes then reaches no one (5 in 80 here with both cores busy). A
    second flush's PING goes after that SUB, which the first flush's wait let the flusher
    write (0 in 80)."""
    await nc.flush()
    await nc.flush()


def signing_env(folder: Path) -> dict[str, str]:
    """The signing settings of placement and executor processes: the test key's seed file
    (written under ``folder`` once) and its public key."""
    folder.mkdir(parents=True, exist_ok=True)
    seed = folder / "placement.seed"
    if not seed.exists():
        write_seed(seed, TEST_KEY)
    return {SIGNING_KEY_SETTING: str(seed), PUBLIC_KEYS_SETTING: TEST_SIGNER.public_key}


async def publish_grant(
    js: JetStreamContext, grant: Grant, node: str | None = None, signer: Signer | None = TEST_SIGNER
) -> None:
    """Play placement: ``grant`` on ``node``'s grants subject (its own node by default), signed
    for that node by ``signer`` (None: unsigned). A fresh ``Nats-Msg-Id`` every time, so that
    JetStream itself never dedupes a re-publish."""
    node = node or grant.node_id
    data = encode(grant)
    headers = {MSG_ID_HEADER: uuid.uuid4().hex}
    if signer is not None:
        headers.update(signer.headers("grant", node, grant.grant_id, data))
    await js.publish(node_grants(node), data, headers=headers)


async def publish_cancel(
    js: JetStreamContext, node: str, cancel: CancelJob, signer: Signer | None = TEST_SIGNER
) -> None:
    """Play placement: ``cancel`` on ``node``'s control subject, signed by ``signer``."""
    data = encode(cancel)
    headers = {MSG_ID_HEADER: uuid.uuid4().hex}
    if signer is not None:
        headers.update(signer.headers("cancel", node, cancel.grant_id, data))
    await js.publish(node_control(node), data, headers=headers)


def bin_path(name: str) -> str:
    return str(BIN / name)


def with_fake_nvidia_smi(env: dict[str, str], folder: Path, recording: str) -> dict[str, str]:
    """``env`` with the recorded ``recording`` (tests/fixtures/nvidia-smi/<recording>) as the
    ``nvidia-smi`` first on its PATH; the tool is copied into ``folder`` (made here)."""
    nvidia = Path(__file__).resolve().parent / "fixtures" / "nvidia-smi"
    folder.mkdir()
    shutil.copy(nvidia / "fake-nvidia-smi", folder / "nvidia-smi")
    (folder / "nvidia-smi").chmod(0o755)
    env["PATH"] = f"{folder}{os.pathsep}{env['PATH']}"
    env["FAKE_NVIDIA_SMI_DIR"] = str(nvidia / recording)
    return env


def service_env(
    nats_url: str, database_url: str, workdir: Path, node_id: str, **extra: str
) -> dict[str, str]:
    """This process' environment plus what the three services need to form one node's stack."""
    env = dict(os.environ)
    env.update(
        GPULAYER_NATS_URL=nats_url,
        GPULAYER_DATABASE_URL=database_url,
        GPULAYER_NODE_ID=node_id,
        GPULAYER_EXECUTOR_WORKDIR=str(workdir),
        GPULAYER_HEARTBEAT_S="1",
        # These stacks' jobs run this interpreter and write into the test's own (private)
        # folders, which a job user can't reach: as root, jobs run as root here. Jobs running
        # unprivileged are tested in tests/integration/test_executor_unprivileged.py.
        GPULAYER_EXECUTOR_ALLOW_ROOT_JOBS="1",
        # The runtime profiles the repository ships, as `gpulayer dev up` gives placement.
        GPULAYER_PROFILES=str(PROFILES_FILE),
    )
    env.update(signing_env(workdir.parent / "keys"))
    env.update(extra)
    return env


def role_creds(role: Role, name: str = "") -> str | None:
    """The credential of ``role`` (None with auth off)."""
    return str(AUTH_STORE.ensure(role, name)) if AUTH_STORE is not None else None


def connect_args() -> dict[str, str | None]:
    """What ``gpulayer_runtime.nats.connect`` needs to act as the test admin."""
    return {"creds": TEST_CREDS}


def with_role_creds(name: str, env: dict[str, str]) -> dict[str, str]:
    """``env`` with the credential of service ``name``'s role (placement, or the node named by
    ``GPULAYER_NODE_ID``) in place of the test admin's; unchanged otherwise."""
    if AUTH_STORE is None or env.get("GPULAYER_NATS_CREDS") != TEST_CREDS:
        return env
    if name == "gpulayer-placement":
        creds = AUTH_STORE.ensure("placement")
    elif name in ("gpulayer-executor", "gpulayer-probe") and env.get("GPULAYER_NODE_ID"):
        creds = AUTH_STORE.ensure("node", env["GPULAYER_NODE_ID"])
    else:
        return env
    return dict(env, GPULAYER_NATS_CREDS=str(creds))


def reason(event: object) -> str | None:
    """An event's ``reason``, checked to be a string when present."""
    value = getattr(event, "reason", None)
    assert value is None or isinstance(value, str)
    return value


def pid_alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


class Services:
    """Service processes of one test; ``async with`` stops them however the test ends."""

    def __init__(self) -> None:
        self.procs: dict[str, asyncio.subprocess.Process] = {}

    async def __aenter__(self) -> Services:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(
        self,
        name: str,
        env: dict[str, str],
        log: Path,
        key: str | None = None,
        prefix: Sequence[str] = (),
    ) -> None:
        """Start console script ``name``; ``key`` names it when one script runs several times;
        ``prefix`` runs it through another command (``nsenter``: in a network namespace).
        With auth on, a service that would act as the test admin gets its own role instead."""
        env = with_role_creds(name, env)
        with log.open("ab") as out:
            self.procs[key or name] = await asyncio.create_subprocess_exec(
                *prefix, bin_path(name), env=env, stdout=out, stderr=asyncio.subprocess.STDOUT
            )

    async def stop(self) -> None:
        for proc in self.procs.values():
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()


def linux_node(node_id: str, **fields: Any) -> WorkerCapabilities:
    """A node's capabilities as its probe reports them: linux-x86_64 with 2 cores, no device,
    and ``fields`` (``container_runtime=...``)."""
    return WorkerCapabilities(
        node_id=node_id,
        agent_version=__version__,
        detected_at=datetime.now(UTC),
        host=HostInfo(platform="linux-x86_64", os="linux", cpu_cores=2),
        **fields,
    )


@contextlib.asynccontextmanager
async def running_placement(
    nc: Client,
    database_url: str,
    settings: Settings | None = None,
    *,
    before_start: Callable[[PlacementService], None] | None = None,
) -> AsyncIterator[PlacementService]:
    """The streams and an in-process placement on the test's own ``nc``, started (migrated);
    closed with its pool on exit. ``settings``: a 5 s node timeout by default;
    ``before_start``: what a test changes of the service before it starts."""
    await ensure_streams(nc.jetstream())
    pool = await create_pool(database_url)
    settings = settings or Settings(node_timeout_s=5, resend_after_s=60)
    svc = PlacementService(nc, pool, settings)
    if before_start is not None:
        before_start(svc)
    await svc.start()
    try:
        yield svc
    finally:
        await svc.close()
        await pool.close()


class SecureNats:
    """A nats-server started with gpulayer's generated auth config."""

    def __init__(self, server: EmbeddedNats, store: AuthStore) -> None:
        self.server = server
        self.store = store
        self.url = server.url

    def creds(self, role: Role, name: str = "") -> str:
        """The path of a credential of ``role`` (minted when missing)."""
        return str(self.store.ensure(role, name))

    async def connect(self, role: Role, name: str = "", **kwargs: Any) -> Client:
        return await connect(
            self.url, f"test-{role}-{name}", creds=self.creds(role, name), **kwargs
        )

    def env(self, role: Role, name: str, url: str | None = None) -> dict[str, str]:
        """The ``gpulayer`` command line's environment as ``role`` ``name`` (``url``: another
        server to reach instead of this one)."""
        return dict(
            os.environ,
            GPULAYER_NATS_URL=url or self.url,
            GPULAYER_NATS_CREDS=self.creds(role, name),
        )


@contextlib.asynccontextmanager
async def secure_server(folder: Path, store: AuthStore) -> AsyncIterator[SecureNats]:
    """A nats-server with ``store``'s auth config, its data under ``folder``; stopped on exit."""
    server = EmbeddedNats(folder / "nats-auth", auth_conf=store.server_conf).start()
    try:
        yield SecureNats(server, store)
    finally:
        server.stop()


@contextlib.asynccontextmanager
async def secure_stack(
    nats: SecureNats, database_url: str, folder: Path, node: str, **settings: str
) -> AsyncIterator[SecureNats]:
    """Placement, executor and probe of ``node`` as processes, each with its own role's
    credential, against ``nats``; ``root`` is an admin, ``settings`` more environment for all
    three. Ready once placement hears the node's executor; stopped on exit."""
    base = service_env(
        nats.url, database_url, folder / "executor", node, GPULAYER_ADMINS="root", **settings
    )
    creds = {
        "gpulayer-placement": nats.creds("placement"),
        "gpulayer-executor": nats.creds("node", node),
        "gpulayer-probe": nats.creds("node", node),
    }
    async with Services() as services:
        for name, path in creds.items():
            env = dict(base, GPULAYER_NATS_CREDS=path)
            await services.start(name, env, folder / f"{name}.log")
        admin = await nats.connect("admin", "root")
        try:
            await until_node(admin, node, caller="root")
        finally:
            await admin.close()
        yield nats


async def until_node(
    nc: Client, node: str, *, caller: str, executor_up: bool = True, timeout: float = 60
) -> None:
    """Until placement's API, asked as ``caller``, lists ``node`` (``executor_up``: and hears
    its executor). Placement announces neither, so the API is asked again until then."""
    async with asyncio.timeout(timeout):
        while True:
            try:
                nodes = await api(nc, API_NODES, timeout=1, caller=caller)
            except Exception:  # placement still starting
                nodes = []
            if any(
                n["node_id"] == node and (n["executor"] == "up" or not executor_up) for n in nodes
            ):
                return
            await asyncio.sleep(0.1)


async def events_until(
    nc: Client, job_ids: set[str], timeout: float = 30.0
) -> dict[str, list[str]]:
    """Every event type per job until each job reaches a terminal event."""
    seen: dict[str, list[str]] = {j: [] for j in job_ids}
    done = asyncio.Event()
    terminal = {"rejected", "succeeded", "failed", "cancelled", "lost"}

    async def cb(msg: Msg) -> None:
        ev = event_decoder.decode(msg.data)
        if ev.job_id in seen:
            seen[ev.job_id].append(str(type(ev).__struct_config__.tag))
            if all(set(types) & terminal for types in seen.values()):
                done.set()

    sub = await nc.subscribe(JOB_WILDCARD_EVENTS, cb=cb)
    try:
        await asyncio.wait_for(done.wait(), timeout)
    finally:
        await sub.unsubscribe()
    return seen


@contextlib.asynccontextmanager
async def running_executor(nc: Client, config: ExecutorConfig) -> AsyncIterator[Executor]:
    """An in-process executor on ``nc``, ready (its consumers exist); stopped on exit."""
    ex = Executor(nc, config)
    stop = asyncio.Event()
    task = asyncio.create_task(ex.run(stop))
    try:
        await asyncio.wait_for(ex.ready.wait(), 10)
        yield ex
    finally:
        stop.set()
        await task


async def gpulayer(*args: str, env: dict[str, str], timeout: float = 60) -> tuple[int, str, str]:
    """Run the ``gpulayer`` command line with ``args``: its exit code, stdout and stderr. A
    process of its own, forked from one that has the CLI imported already
    (``tests/cli_zygote.py``)."""
    return await asyncio.to_thread(_cli_zygote().run, list(args), env, timeout)


class CliZygote:
    """The client side of ``tests/cli_zygote.py``: one per test worker, started at first use."""

    def __init__(self) -> None:
        self._folder = tempfile.mkdtemp(prefix="gpulayer-cli-")
        self.path = os.path.join(self._folder, "zygote.sock")
        script = Path(__file__).with_name("cli_zygote.py")
        self.proc = subprocess.Popen(
            [sys.executable, str(script), self.path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=os.getcwd(),
        )
        assert self.proc.stdout is not None
        ready = self.proc.stdout.readline()
        if ready != b"ready\n":
            raise RuntimeError(f"the CLI zygote did not start: {ready!r}")

    def run(self, argv: list[str], env: dict[str, str], timeout: float) -> tuple[int, str, str]:
        body = json.dumps({"argv": argv, "env": env, "cwd": os.getcwd()}).encode()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        devnull = os.open(os.devnull, os.O_RDONLY)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.path)
            head = struct.pack("!I", len(body)) + body
            sent = socket.send_fds(conn, [head], [devnull, out_w, err_w])
            conn.sendall(head[sent:])
        finally:
            for fd in (out_w, err_w, devnull):
                os.close(fd)
        deadline = time.monotonic() + timeout
        chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
        answer = b""
        pid = None
        sel = selectors.DefaultSelector()
        for fd in (out_r, err_r, conn.fileno()):
            sel.register(fd, selectors.EVENT_READ)
        try:
            while len(sel.get_map()):
                left = deadline - time.monotonic()
                if left <= 0:
                    if pid is not None:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                    raise TimeoutError(f"gpulayer {' '.join(argv)}: no exit in {timeout} s")
                for key, _ in sel.select(left):
                    fd = key.fd
                    data = os.read(fd, 65536)
                    if not data:
                        sel.unregister(fd)
                    elif fd in chunks:
                        chunks[fd].append(data)
                    else:
                        answer += data
                        head, newline, _ = answer.partition(b"\n")
                        if pid is None and newline:
                            if not head.isdigit():  # "error ...": the request was refused
                                raise RuntimeError(f"the CLI zygote: {answer!r}")
                            pid = int(head)
        finally:
            sel.close()
            conn.close()
            os.close(out_r)
            os.close(err_r)
        lines = answer.split(b"\n")
        if len(lines) < 3:
            raise RuntimeError(f"the CLI zygote said no exit code: {answer!r}")
        out, err = (b"".join(chunks[fd]).decode() for fd in (out_r, err_r))
        return int(lines[1]), out, err

    def close(self) -> None:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.close()
        self.proc.wait(10)
        self.proc.stdout.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)
            os.rmdir(self._folder)


_ZYGOTE: list[CliZygote] = []
_ZYGOTE_LOCK = threading.Lock()


def _cli_zygote() -> CliZygote:
    with _ZYGOTE_LOCK:
        if not _ZYGOTE:
            _ZYGOTE.append(CliZygote())
            atexit.register(_ZYGOTE[0].close)
        return _ZYGOTE[0]


async def start_replicas(
    nats_url: str, database_url: str, n: int, *, batch_size: int = 32
) -> list[tuple[PlacementService, Client]]:
    """``n`` placement replicas in this process, started, each with its NATS connection."""
    started = []
    for i in range(n):
        # Each replica has its own NATS connection and pool, as separate processes would.
        conn = await connect(nats_url, f"placement-{i}", creds=role_creds("placement"))
        pool = await create_pool(database_url, min_size=1, max_size=4)
        svc = PlacementService(
            conn, pool, Settings(node_timeout_s=30, resend_after_s=60, batch_size=batch_size)
        )
        await svc.start()
        started.append((svc, conn))
    return started


@contextlib.asynccontextmanager
async def one_placement(
    nats_url: str, database_url: str, nc: Client
) -> AsyncIterator[PlacementService]:
    """The streams and one placement replica; closed with its pool and connection on exit."""
    await ensure_streams(nc.jetstream())
    ((svc, conn),) = await start_replicas(nats_url, database_url, 1)
    try:
        yield svc
    finally:
        await svc.close()
        await svc.pool.close()
        await conn.drain()


async def executor_beat(nc: Client, node: str, slots: int) -> None:
    """Play ``node``'s executor: one heartbeat offering ``slots`` job slots."""
    beat = Heartbeat(
        node_id=node,
        sent_at=datetime.now(UTC),
        source="executor",
        slots=slots,
        reserved_cores=0.0,
        reserved_memory_gb=0.0,
        enforcement="none",
    )
    await nc.publish(node_heartbeat(node), encode(beat))


async def join_node(nc: Client, caps: WorkerCapabilities, slots: int) -> None:
    """Play a node joining: its capabilities ``caps``, then its executor's heartbeat."""
    await nc.jetstream().publish(node_capabilities(caps.node_id), encode(caps))
    await executor_beat(nc, caps.node_id, slots)


async def finish(js: Any, grant: Grant) -> None:
    """Play the executor: ``grant``'s job succeeded (exit code 0)."""
    await js.publish(
        node_status(grant.node_id),
        encode(
            JobStatus(
                job_id=grant.job.job_id,
                grant_id=grant.grant_id,
                node_id=grant.node_id,
                state="succeeded",
                exit_code=0,
            )
        ),
    )
