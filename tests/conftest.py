"""Shared fixtures: real NATS and PostgreSQL, no Docker needed.

- Default: a session-wide embedded PostgreSQL (fresh database per test) and a fresh embedded
  nats-server per test that needs one (a few tens of milliseconds; no stream state leaks).
- ``GPULAYER_NATS_URL`` / ``GPULAYER_DATABASE_URL``: use existing servers instead (streams are
  deleted before each test; each test still gets its own database).
- ``GPULAYER_TEST_BACKEND=containers``: testcontainers starts both, where Docker exists.
- Auth is on by default: the embedded nats-server runs with a generated operator config, the
  ``nc`` fixture and every process the tests start (which inherit ``GPULAYER_NATS_CREDS``) are
  the admin ``admin``, and ``tests.helpers.Services`` gives each service its own role's
  credential. ``GPULAYER_TEST_AUTH=off`` (or an existing server) runs without.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client
from tests import helpers
from tests.workload import TORCH, Workload, make_workload_venv

from gpulayer_runtime.auth import AuthStore
from gpulayer_runtime.database import SERVICE_ROLE
from gpulayer_runtime.nats import connect
from gpulayer_runtime.pgserver import EmbeddedPostgres
from gpulayer_runtime.servers import EmbeddedNats, EmbeddedNatsCluster

REPO_ROOT = Path(__file__).resolve().parent.parent
# The probes the tests start don't look for podman: its self-test (a container started, ~1 s)
# in every stack would cost time and tie unrelated tests to the host's podman. The tests of the
# container runtime set it themselves (tests/e2e/test_container_placement.py).
os.environ.setdefault("GPULAYER_PROBE_PODMAN", "none")
FIXTURES = REPO_ROOT / "tests" / "fixtures"


class CrashWatch(logging.Handler):
    """Sees placement's "task ... crashed" and the executor's "side task ... died": a service
    task that dies is a bug, and fails the test it happens in.

    Attached to the services' own loggers (not the root), so neither caplog nor a test's logging
    setup takes it away; a test that makes a task die on purpose says so with ``expect()``."""

    LOGGERS = ("gpulayer_placement.service", "gpulayer_executor.service")
    FORMATS = ("task %s crashed", "side task %s died")

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.crashes: list[str] = []
        self.expected = 0

    def emit(self, record: logging.LogRecord) -> None:
        if str(record.msg).startswith(self.FORMATS):
            self.crashes.append(record.getMessage())

    def expect(self, n: int = 1) -> None:
        """This test makes ``n`` tasks die on purpose."""
        self.expected += n


CGROUP_ROOT = Path("/sys/fs/cgroup")
_worker_cgroups: list[Path] = []


def _cgroup_dirs(name: str) -> list[Path]:
    """``name`` below this process's cgroup in each mounted hierarchy (v1 and v2)."""
    found = []
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers:
            mount = CGROUP_ROOT / controllers.removeprefix("name=")
        elif (CGROUP_ROOT / "unified" / "cgroup.procs").exists():
            mount = CGROUP_ROOT / "unified"
        else:
            mount = CGROUP_ROOT
        if (mount / "cgroup.procs").exists():
            found.append(mount / path.lstrip("/") / name)
    return found


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, each worker moves into a cgroup of its own (as root, where writable):
    an executor makes its jobs' cgroups under its own process's cgroup (``gpulayer/<grant>``),
    so two tests in two workers running a job of the same id would otherwise share one, and
    one's end would kill the other's processes."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker and config.option.basetemp is None:
        # pytest's default root (/tmp/pytest-of-<user>) is shared by every run of this user,
        # and each run deletes all but the three newest: two runs at once removed each other's
        # PostgreSQL data. Each run gets its own, removed when it passes (make test does the
        # same with --basetemp).
        _own_basetemp.append(tempfile.mkdtemp(prefix="gpulayer-pytest-"))
        config.option.basetemp = _own_basetemp[0]
    if not worker or os.geteuid() != 0:
        return
    for folder in _cgroup_dirs(f"pytest-{worker}"):
        try:
            folder.mkdir(exist_ok=True)
            (folder / "cgroup.procs").write_text(str(os.getpid()))
            _worker_cgroups.append(folder)
        except OSError:
            continue  # not writable here: this hierarchy stays shared


# A test using the workload venv may be the one that builds it (pip installs numpy and torch:
# minutes on a loaded machine), or waits for another worker building it: its setup counts
# against its timeout, so it gets this one.
WORKLOAD_TIMEOUT_S = 900


def _module_seconds() -> dict[str, float]:
    """tests/module_seconds.txt: each slow module's last measured time (tests/durations.py)."""
    seconds: dict[str, float] = {}
    with contextlib.suppress(OSError):
        for line in (Path(__file__).parent / "module_seconds.txt").read_text().splitlines():
            secs, _, module = line.partition(" ")
            with contextlib.suppress(ValueError):
                seconds[module] = float(secs)
    return seconds


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Slowest modules first (a stable sort: the rest keep their order): with --dist loadscope
    # and --no-loadscope-reorder, xdist hands out modules in this order, so the run doesn't wait
    # at its end for a long module that started last.
    seconds = _module_seconds()
    if seconds:
        root = Path(str(config.rootpath))

        def slowest_first(item: pytest.Item) -> float:
            try:
                return -seconds.get(str(item.path.relative_to(root)), 0.0)
            except ValueError:
                return 0.0

        items.sort(key=slowest_first)
    for item in items:
        if "workload_venv" not in getattr(item, "fixturenames", ()):
            continue
        marker = item.get_closest_marker("timeout")
        if marker is None or (marker.args and marker.args[0] < WORKLOAD_TIMEOUT_S):
            item.add_marker(pytest.mark.timeout(WORKLOAD_TIMEOUT_S), append=False)


# Lines a test asks to be shown at the end of the run, passed or not (the fault run's counts):
# ``record_property("summary_line", ...)``, which pytest-xdist carries from the worker.
_summary_lines: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call":
        _summary_lines.extend(str(v) for k, v in report.user_properties if k == "summary_line")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for line in _summary_lines:
        terminalreporter.write_line(line)


_own_basetemp: list[str] = []


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _own_basetemp and exitstatus in (0, pytest.ExitCode.NO_TESTS_COLLECTED):
        shutil.rmtree(_own_basetemp.pop(), ignore_errors=True)
    elif _own_basetemp:
        session.config.get_terminal_writer().line(f"the failed run's folders: {_own_basetemp[0]}")


def pytest_unconfigure(config: pytest.Config) -> None:
    """Back to the cgroups the worker came from, and its own removed (with the empty
    ``gpulayer`` folders executors left in it)."""
    for folder in _worker_cgroups:
        with contextlib.suppress(OSError):
            (folder.parent / "cgroup.procs").write_text(str(os.getpid()))
            for empty in sorted(folder.glob("**/"), key=lambda p: len(p.parts), reverse=True):
                empty.rmdir()
    _worker_cgroups.clear()


@pytest.fixture(autouse=True)
def task_crashes() -> Iterator[CrashWatch]:
    watch = CrashWatch()
    loggers = [logging.getLogger(name) for name in CrashWatch.LOGGERS]
    for logger in loggers:
        logger.addHandler(watch)
    try:
        yield watch
    finally:
        for logger in loggers:
            logger.removeHandler(watch)
    if len(watch.crashes) != watch.expected:
        pytest.fail(
            f"{len(watch.crashes)} service task(s) died, {watch.expected} expected: "
            + "; ".join(watch.crashes)
        )


def _backend() -> str:
    return os.environ.get("GPULAYER_TEST_BACKEND", "embedded")


@pytest.fixture(scope="session")
def postgres(tmp_path_factory: pytest.TempPathFactory) -> Iterator[helpers.Postgres]:
    """The PostgreSQL server of this worker: the embedded one, locked as `make run`'s is (a
    superuser with a password, the services' own role), or the environment's."""
    if url := os.environ.get("GPULAYER_DATABASE_URL"):
        yield helpers.Postgres(url, None)
        return
    if _backend() == "containers":
        from testcontainers.postgres import PostgresContainer

        with PostgresContainer("postgres:17", driver=None) as pg:
            yield helpers.Postgres(pg.get_connection_url(), None)
        return
    with EmbeddedPostgres(tmp_path_factory.mktemp("pg"), fast=True) as pg:
        yield helpers.Postgres(pg.url, pg.data_dir / f"{SERVICE_ROLE}.pgpass")


@pytest.fixture(scope="session")
def postgres_admin_url(postgres: helpers.Postgres) -> str:
    """URL of a superuser of the tests' PostgreSQL (may create databases and roles)."""
    return postgres.admin_url


@pytest.fixture
async def database_url(postgres: helpers.Postgres) -> AsyncIterator[str]:
    """A fresh, empty database for this test, as the services connect to it."""
    async with postgres.database() as url:
        yield url


TEST_ADMIN = "admin"


def _auth_on() -> bool:
    if os.environ.get("GPULAYER_TEST_AUTH", "on").strip().lower() == "off":
        return False
    return not os.environ.get("GPULAYER_NATS_URL") and _backend() != "containers"


@pytest.fixture(scope="session")
def nats_creds(auth_store: AuthStore) -> Iterator[str | None]:
    """The admin credential the tests act as (None with auth off). Set as
    ``GPULAYER_NATS_CREDS`` for the session, so processes the tests start inherit it."""
    if not _auth_on():
        yield None
        return
    creds = str(auth_store.ensure("admin", TEST_ADMIN))
    before = os.environ.get("GPULAYER_NATS_CREDS")
    os.environ["GPULAYER_NATS_CREDS"] = creds
    helpers.AUTH_STORE, helpers.TEST_CREDS = auth_store, creds
    yield creds
    helpers.AUTH_STORE, helpers.TEST_CREDS = None, None
    if before is None:
        os.environ.pop("GPULAYER_NATS_CREDS", None)
    else:
        os.environ["GPULAYER_NATS_CREDS"] = before


@pytest.fixture(scope="session")
def _nats_container() -> Iterator[str | None]:
    if _backend() != "containers" or os.environ.get("GPULAYER_NATS_URL"):
        yield None
        return
    from testcontainers.core.container import DockerContainer

    with DockerContainer("nats:2.10").with_command("-js").with_exposed_ports(4222) as c:
        yield f"nats://{c.get_container_host_ip()}:{c.get_exposed_port(4222)}"


@pytest.fixture
async def nats_url(
    tmp_path: Path, _nats_container: str | None, auth_store: AuthStore, nats_creds: str | None
) -> AsyncIterator[str]:
    """A NATS server with JetStream and no gpulayer streams in it yet (with auth on: the
    generated auth config, see ``nats_creds``)."""
    existing = os.environ.get("GPULAYER_NATS_URL") or _nats_container
    if existing:
        nc = await connect(existing, "test-cleanup")
        js = nc.jetstream()
        for info in await js.streams_info():
            if info.config.name:
                await js.delete_stream(info.config.name)
        await nc.close()
        yield existing
        return
    auth_conf = auth_store.server_conf if nats_creds else None
    server = EmbeddedNats(tmp_path / "nats", auth_conf=auth_conf).start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
async def nats_cluster(
    tmp_path: Path, auth_store: AuthStore, nats_creds: str | None
) -> AsyncIterator[EmbeddedNatsCluster]:
    """Three routed nats-servers on loopback, JetStream on each (streams up to R3), with the
    generated auth config when auth is on (operator mode, the accounts preloaded into each
    server's own resolver folder: every server knows them without a resolver service)."""
    auth_conf = auth_store.server_conf if nats_creds else None
    cluster = EmbeddedNatsCluster(tmp_path / "cluster", auth_conf=auth_conf).start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
async def nc(nats_url: str, nats_creds: str | None) -> AsyncIterator[Client]:
    """A connection as the test admin (anonymous with auth off)."""
    client = await connect(nats_url, "test", creds=nats_creds)
    yield client
    await client.drain()


@pytest.fixture(scope="session")
def auth_store(tmp_path_factory: pytest.TempPathFactory) -> AuthStore:
    """One operator and account for the session; credentials are minted on first use."""
    return AuthStore(tmp_path_factory.mktemp("auth") / "auth").init()


@pytest.fixture
async def secure_nats(tmp_path: Path, auth_store: AuthStore) -> AsyncIterator[helpers.SecureNats]:
    async with helpers.secure_server(tmp_path, auth_store) as server:
        yield server


def _workload_cache() -> Path:
    """Where the workload venv is kept between runs: ``GPULAYER_TEST_CACHE`` or
    ``~/.cache/gpulayer-tests``, one folder per interpreter and torch version."""
    root = Path(os.environ.get("GPULAYER_TEST_CACHE") or Path.home() / ".cache" / "gpulayer-tests")
    # The interpreter behind the checkout's .venv, not the venv's own path: keyed by that,
    # every fresh clone (each CI run, each make test-repeat) built a 1 GB venv again, a
    # minute and more of the first run.
    base = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    tag = hashlib.sha256(f"{base}|{sys.version}|{TORCH}".encode()).hexdigest()[:12]
    return root / f"workload-py{sys.version_info[0]}{sys.version_info[1]}-{tag}"


def _usable(workload: Workload) -> bool:
    """The kept venv still imports what it was made with (the machine may have changed)."""
    imports = "import numpy" + (", torch" if workload.torch else "")
    try:
        done = subprocess.run([workload.python, "-c", imports], capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


@pytest.fixture(scope="session")
def workload_venv() -> Workload:
    """A venv with numpy, and torch==2.13.0 where pip can install it (tests/workload.py), made
    once and kept between runs (pip installing torch takes minutes; ``make test-repeat`` runs
    the suite five times): the first worker that needs it builds it under a lock, the others
    (and later runs) wait for it and reuse it. One made without torch (pip could not get it)
    is made again next run."""
    cache = _workload_cache()
    cache.mkdir(parents=True, exist_ok=True)
    made = cache / "workload.json"
    with (cache / "lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, a failure included
        if made.exists():
            kept = Workload(**json.loads(made.read_text()))
            if kept.torch is not None and _usable(kept):
                return kept
            made.unlink()
        venv = cache / "venv"
        if venv.exists():
            shutil.rmtree(venv)
        workload = make_workload_venv(venv)
        made.write_text(json.dumps(vars(workload)))
        return workload
