"""Servers, service processes and measuring helpers shared by the figures.

Everything listens on loopback, every wait is bounded in time, every process started here is
stopped here.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import psutil
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from gpulayer_contracts import WorkerCapabilities, encode
from gpulayer_contracts.subjects import JOBS_SUBMIT, MSG_ID_HEADER, node_capabilities
from gpulayer_runtime.auth import AuthStore
from gpulayer_runtime.database import replace_url
from gpulayer_runtime.nats import connect, ensure_streams
from gpulayer_runtime.roles import Role
from gpulayer_runtime.servers import EmbeddedNats
from gpulayer_runtime.signing import PUBLIC_KEYS_SETTING, SIGNING_KEY_SETTING, generate_key_pair

PUBLISH_WINDOW = 512  # JetStream publishes in flight at once from the load generator

# ``--cprofile DIR``: every service process runs under cProfile (its main thread), one
# ``.prof`` file per process in this folder, written when it exits (set by bench/__main__).
CPROFILE_DIR: Path | None = None
# A profiled service is given this long to exit after SIGTERM: cProfile writes its file only
# then, and placement's shutdown waits out nats-py's drain.
CPROFILE_STOP_S = 45.0


class BenchError(RuntimeError):
    """A figure could not be measured; the message says why."""


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100) of a non-empty sequence."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(p / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def tail(path: Path, lines: int = 5) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(line.strip() for line in text[-lines:])


# --- PostgreSQL -----------------------------------------------------------------------------


async def create_database(admin_url: str, name: str) -> str:
    admin = await asyncpg.connect(admin_url)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    return replace_url(admin_url, database=name)


async def drop_database(admin_url: str, name: str) -> None:
    admin = await asyncpg.connect(admin_url)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


async def wait_for_count(
    conn: asyncpg.Connection, sql: str, args: Sequence[Any], target: int, timeout: float
) -> tuple[int, float]:
    """Poll ``sql`` (a count) every 20 ms until it reaches ``target``. Returns (count, when)."""
    deadline = time.perf_counter() + timeout
    count = 0
    while True:
        count = int(await conn.fetchval(sql, *args))
        now = time.perf_counter()
        if count >= target or now > deadline:
            return count, now
        await asyncio.sleep(0.02)


# --- NATS -----------------------------------------------------------------------------------


async def publish_all(
    js: JetStreamContext,
    items: Sequence[tuple[str, bytes]],
    subject: str = JOBS_SUBMIT,
    window: int = PUBLISH_WINDOW,
) -> None:
    """Publish (id, payload) with Nats-Msg-Id = id, ``window`` awaiting acks at once."""
    for start in range(0, len(items), window):
        chunk = items[start : start + window]
        await asyncio.gather(
            *(js.publish(subject, body, headers={MSG_ID_HEADER: key}) for key, body in chunk)
        )


def encode_capabilities(nodes: Sequence[WorkerCapabilities]) -> list[tuple[str, str, bytes]]:
    """(node id, subject, payload) of each node's capabilities event, encoded ahead of timing."""
    return [(c.node_id, node_capabilities(c.node_id), encode(c)) for c in nodes]


async def publish_capabilities(
    js: JetStreamContext, payloads: Sequence[tuple[str, str, bytes]]
) -> dict[str, float]:
    """Publish capabilities events; returns each node's publish wall time."""
    sent: dict[str, float] = {}
    for start in range(0, len(payloads), PUBLISH_WINDOW):
        chunk = payloads[start : start + PUBLISH_WINDOW]
        now = time.time()
        for node, _, _ in chunk:
            sent[node] = now
        await asyncio.gather(*(js.publish(subject, body) for _, subject, body in chunk))
    return sent


class Watch:
    """A subscription callback that sets ``done`` once it has seen what it waits for."""

    def __init__(self) -> None:
        self.done = asyncio.Event()

    async def wait(self, timeout: float) -> bool:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.done.wait(), timeout)
        return self.done.is_set()


class GrantWatch(Watch):
    """Counts grants (core NATS subscription on every node's grant subject) by job id."""

    def __init__(self) -> None:
        super().__init__()
        self.at: dict[str, float] = {}
        self.expect = 0
        self.last = 0.0

    def reset(self, expect: int) -> None:
        self.at = {}
        self.expect = expect
        self.last = 0.0
        self.done.clear()

    async def cb(self, msg: Msg) -> None:
        now = time.perf_counter()
        grant_id = (msg.headers or {}).get(MSG_ID_HEADER, "")
        job_id = grant_id.rpartition("-")[0]
        if job_id and job_id not in self.at:
            self.at[job_id] = now
            self.last = now
            if len(self.at) >= self.expect:
                self.done.set()


# --- processes ------------------------------------------------------------------------------


@dataclass
class ServiceProcess:
    """A gpulayer service started as its own process (``python -m <module>``)."""

    module: str
    env: dict[str, str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    profiler: subprocess.Popen[bytes] | None = None
    rss_samples: list[int] = field(default_factory=list)

    def start(self) -> ServiceProcess:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", self.module]
        if CPROFILE_DIR is not None:
            out_file = CPROFILE_DIR / f"{self.log.parent.name}-{self.log.stem}.prof"
            argv[1:1] = ["-m", "cProfile", "-o", str(out_file)]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                argv,
                env={**os.environ, **self.env},
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def check_alive(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            code = None if self.proc is None else self.proc.returncode
            raise BenchError(f"{self.module} exited ({code}): {tail(self.log)}")

    def profile(self, out: Path, rate: int = 250) -> None:
        """Attach py-spy (when installed next to this interpreter) until ``stop_profile``."""
        spy = Path(sys.executable).parent / "py-spy"
        if not spy.exists():
            print("# profile skipped: py-spy not installed in this venv", flush=True)
            return
        self.profiler = subprocess.Popen(
            [str(spy), "record", "-p", str(self.pid), "-r", str(rate), "-f", "raw", "-o", str(out)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def stop_profile(self) -> None:
        if self.profiler is not None and self.profiler.poll() is None:
            self.profiler.send_signal(signal.SIGINT)
            try:
                self.profiler.wait(30)
            except subprocess.TimeoutExpired:
                self.profiler.kill()
                self.profiler.wait()
        self.profiler = None

    def sample_rss(self) -> int:
        try:
            rss = int(psutil.Process(self.pid).memory_info().rss)
        except psutil.Error:
            return 0
        self.rss_samples.append(rss)
        return rss

    def peak_rss(self) -> int:
        """The kernel's high-water mark (VmHWM) where readable, else the highest sample."""
        with contextlib.suppress(OSError, ValueError):
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        return max(self.rss_samples, default=0)

    def stop(self, timeout: float = 3.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout``: the figures are taken by then, and
        placement's shutdown currently waits out nats-py's 30 s drain (see docs/performance.md)."""
        self.stop_profile()
        if self.proc is None or self.proc.poll() is not None:
            return
        if CPROFILE_DIR is not None:
            timeout = max(timeout, CPROFILE_STOP_S)
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


async def rss_sampler(service: ServiceProcess, stop: asyncio.Event, period: float = 0.1) -> None:
    while not stop.is_set():
        service.sample_rss()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), period)


async def wait_for_consumer(
    js: JetStreamContext, stream: str, durable: str, service: ServiceProcess, timeout: float
) -> None:
    """A service is ready when its durable consumer exists (it creates it at the end of start)."""
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        service.check_alive()
        try:
            await js.consumer_info(stream, durable)
            return
        except Exception:  # not found yet, or the stream is still being made
            await asyncio.sleep(0.05)
    raise BenchError(f"{service.module} not ready within {timeout:g}s: {tail(service.log)}")


@dataclass
class Scenario:
    """A fresh nats-server, a fresh database, and the real placement service as a process."""

    nats: EmbeddedNats
    nc: Client
    js: JetStreamContext
    db_url: str
    db: asyncpg.Connection
    placement: ServiceProcess
    workdir: Path
    profile_dir: Path | None = None
    # Further placement replicas beside ``placement`` (same stream consumers, same database).
    replicas: list[ServiceProcess] = field(default_factory=list)
    # The NATS auth in force (None: the server is open), for credentials of further services.
    auth: AuthStore | None = None

    def creds_env(self, role: Role, name: str = "") -> dict[str, str]:
        """``GPULAYER_NATS_CREDS`` for a service of ``role``, when the server has auth."""
        return {} if self.auth is None else {"GPULAYER_NATS_CREDS": str(self.auth.mint(role, name))}


def signing_env(root: Path) -> dict[str, str]:
    """Placement's signing key and the executors' public key, as production runs them (signing
    on); the key pair is made once under ``root/keys``."""
    seed, public = generate_key_pair(root / "keys", "bench")
    return {SIGNING_KEY_SETTING: str(seed), PUBLIC_KEYS_SETTING: public}


@contextlib.asynccontextmanager
async def scenario(
    name: str,
    root: Path,
    admin_url: str,
    *,
    profile_dir: Path | None = None,
    placement_env: dict[str, str] | None = None,
    replicas: int = 1,
    auth: bool = True,
) -> AsyncIterator[Scenario]:
    """A NATS server, a database and placement, as production runs them: NATS with auth (the
    bench acts as an admin, placement with its own credential) and grants signed, unless
    ``auth`` is False or ``placement_env`` turns signing off."""
    workdir = root / name
    workdir.mkdir(parents=True, exist_ok=True)
    store = AuthStore(workdir / "auth").init() if auth else None
    nats_server = EmbeddedNats(
        workdir / "nats", auth_conf=store.server_conf if store else None
    ).start()
    db_name = f"bench_{name}"
    placement: ServiceProcess | None = None
    others: list[ServiceProcess] = []
    nc: Client | None = None
    db: asyncpg.Connection | None = None
    try:
        db_url = await create_database(admin_url, db_name)
        admin = str(store.mint("admin", "bench")) if store else None
        nc = await connect(nats_server.url, f"bench-{name}", creds=admin)
        js = nc.jetstream()
        await ensure_streams(js)
        env = {
            "GPULAYER_NATS_URL": nats_server.url,
            "GPULAYER_DATABASE_URL": db_url,
            # Simulated nodes send no heartbeats and run no executor: neither the reaper nor
            # grant re-sending may act during a run.
            "GPULAYER_NODE_TIMEOUT_S": "3600",
            "GPULAYER_GRANT_RESEND_S": "3600",
            # The load generator submits thousands of jobs at once per owner: the submit limit
            # is still asked for each message (its cost is in the figures), never refuses one.
            "GPULAYER_SUBMIT_BURST": "10000000",
            **signing_env(root),
            **({"GPULAYER_NATS_CREDS": str(store.mint("placement"))} if store else {}),
            **(placement_env or {}),
        }
        placement = ServiceProcess("gpulayer_placement", env, workdir / "placement.log").start()
        await wait_for_consumer(js, "JOBS", "placement-jobs", placement, timeout=60)
        for i in range(1, replicas):
            # Started once the first has migrated the database and created the consumers.
            others.append(
                ServiceProcess("gpulayer_placement", env, workdir / f"placement-{i}.log").start()
            )
        db = await asyncpg.connect(db_url)
        if profile_dir is not None:
            placement.profile(profile_dir / f"placement-{name}.txt")
        yield Scenario(
            nats_server, nc, js, db_url, db, placement, workdir, profile_dir, others, store
        )
    finally:
        for other in others:
            other.stop()
        if placement is not None:
            placement.stop()
        if db is not None:
            await db.close()
        if nc is not None:
            with contextlib.suppress(Exception):
                await nc.close()
        nats_server.stop()
        with contextlib.suppress(Exception):
            await drop_database(admin_url, db_name)


async def load_fleet(s: Scenario, nodes: Sequence[WorkerCapabilities], timeout: float) -> float:
    """Publish ``nodes`` and wait until PostgreSQL holds them all. Returns events/s."""
    payloads = encode_capabilities(nodes)
    t0 = time.perf_counter()
    await publish_capabilities(s.js, payloads)
    count, t1 = await wait_for_count(s.db, "SELECT count(*) FROM nodes", (), len(nodes), timeout)
    if count < len(nodes):
        s.placement.check_alive()
        raise BenchError(f"only {count} of {len(nodes)} nodes stored after {timeout:g}s")
    # The in-memory fleet is updated right after the rows are written; let that land.
    await asyncio.sleep(0.2)
    return len(nodes) / (t1 - t0)
