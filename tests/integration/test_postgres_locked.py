"""The embedded PostgreSQL takes only connections that prove who they are: a random superuser
password made at the first start, scram-sha-256 everywhere, a socket folder of the server's
account alone, TCP on loopback; the services connect as a role that owns gpulayer's database
and nothing more. A data folder made by an older gpulayer with ``trust`` is locked in place."""

from __future__ import annotations

import asyncio
import logging
import os
import pwd
import secrets
import stat
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from gpulayer_placement.store import migrate
from gpulayer_runtime.database import SERVICE_ROLE, read_pgpass_password, replace_url
from gpulayer_runtime.pgserver import PG_SYSTEM_USER, EmbeddedPostgres, postgres_bin_dir

AS_ROOT = pytest.mark.skipif(
    os.geteuid() != 0, reason="the server runs as an account of its own only when started by root"
)
GUESSES = [None, "", "postgres", "gpulayer", "password"]


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


async def _refused(
    url: str, *, password: str | None, host: str | None = None, port: int | None = None
) -> str:
    """Why PostgreSQL refused a connection (a test failure if it took it). No passfile: none
    of root's own (a ~/.pgpass would be read otherwise)."""
    try:
        conn = await asyncpg.connect(
            url, host=host, port=port, password=password, passfile="/nonexistent"
        )
    except (asyncpg.InvalidAuthorizationSpecificationError, OSError) as err:
        return type(err).__name__
    await conn.close()
    raise AssertionError(f"connected to {url} with password {password!r} at {host or url}")


@pytest.fixture(scope="module")
async def pg(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[EmbeddedPostgres]:
    """A server with the services' database made, as ``gpulayer dev up`` leaves it."""
    with EmbeddedPostgres(tmp_path_factory.mktemp("locked"), fast=True) as server:
        await server.service_database()
        yield server


async def test_no_connection_without_the_password(pg: EmbeddedPostgres) -> None:
    service_url = await pg.service_database()
    for user, database in (("postgres", "postgres"), (SERVICE_ROLE, "gpulayer")):
        url = f"postgresql://{user}@127.0.0.1:{pg.port}/{database}"
        for guess in GUESSES:
            why = await _refused(url, password=guess)
            assert why in ("InvalidPasswordError", "InvalidAuthorizationSpecificationError")
            # Through the socket as well (root may enter its folder; a job may not: below).
            via_socket = await _refused(url, host=str(pg.socket_dir), port=pg.port, password=guess)
            assert via_socket == why
    # With the passfiles, both get in: the superuser, and the role as the services do.
    for url, who in ((pg.url, "postgres"), (service_url, SERVICE_ROLE)):
        conn = await asyncpg.connect(url)
        try:
            assert await conn.fetchval("SELECT current_user") == who
        finally:
            await conn.close()


async def test_every_rule_asks_for_a_password_and_tcp_is_loopback_only(
    pg: EmbeddedPostgres,
) -> None:
    conn = await asyncpg.connect(pg.url)
    try:
        rules = await conn.fetch("SELECT type, address, auth_method, error FROM pg_hba_file_rules")
        settings = {
            name: await conn.fetchval(f"SHOW {name}")
            for name in ("listen_addresses", "unix_socket_permissions", "password_encryption")
        }
        verifier = await conn.fetchval(
            "SELECT rolpassword FROM pg_authid WHERE rolname = 'postgres'"
        )
    finally:
        await conn.close()
    assert {r["auth_method"] for r in rules} == {"scram-sha-256"}
    assert all(r["error"] is None for r in rules)
    assert {r["type"] for r in rules} == {"local", "host"}
    assert settings == {
        "listen_addresses": "127.0.0.1",
        "unix_socket_permissions": "0700",
        "password_encryption": "scram-sha-256",
    }
    assert verifier.startswith("SCRAM-SHA-256$")
    assert "trust" not in (pg.pgdata / "pg_hba.conf").read_text()


def test_folders_and_password_files(pg: EmbeddedPostgres) -> None:
    for secret in (pg.passfile, pg.data_dir / f"{SERVICE_ROLE}.pgpass"):
        assert _mode(secret) == 0o600
        assert secret.stat().st_uid == os.geteuid()
    assert read_pgpass_password(pg.passfile, "postgres")
    assert _mode(pg.pgdata) == 0o700
    assert _mode(pg.socket_dir) == 0o700
    assert _mode(pg.data_dir / "postgres.log") == 0o600
    if os.geteuid() == 0:
        server = pwd.getpwnam(PG_SYSTEM_USER).pw_uid
        assert pg.socket_dir.stat().st_uid == server
        assert pg.pgdata.stat().st_uid == server
        assert _mode(pg.data_dir) == 0o711  # passed through, never listed


def _as_nobody(paths: list[Path]) -> list[str]:
    """What ``nobody`` (no groups) gets opening each of ``paths``: in a forked child that took
    that account's ids, as a job's process has them."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never back into pytest
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            lines = []
            for path in paths:
                try:
                    os.listdir(path) if path.is_dir() else path.read_bytes()
                    lines.append(f"{path} open")
                except OSError as err:
                    lines.append(f"{path} {type(err).__name__}")
            os.write(write, "\n".join(lines).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        said = f.read().splitlines()
    os.waitpid(pid, 0)
    return said


@AS_ROOT
def test_an_unprivileged_account_reaches_neither_socket_nor_secrets(pg: EmbeddedPostgres) -> None:
    """What a job's account finds: no way into the socket folder, the data or the passfiles."""
    paths = [pg.socket_dir, pg.pgdata, pg.passfile, pg.data_dir / f"{SERVICE_ROLE}.pgpass"]
    paths += [pg.data_dir, pg.data_dir / "postgres.log"]
    assert _as_nobody(paths) == [f"{p} PermissionError" for p in paths]


async def test_the_services_role_is_no_superuser(pg: EmbeddedPostgres) -> None:
    url = await pg.service_database(f"t_{uuid.uuid4().hex[:8]}")
    conn = await asyncpg.connect(url)
    try:
        # It owns its database: placement's migrations run as it.
        assert await migrate(conn)
        await conn.execute("SELECT count(*) FROM jobs")
        role = await conn.fetchrow(
            "SELECT rolsuper, rolcreatedb, rolcreaterole, rolreplication, rolbypassrls "
            "FROM pg_roles WHERE rolname = current_user"
        )
        assert role is not None
        assert not any(role.values())
        for statement in (
            "COPY (SELECT 1) TO PROGRAM 'id'",
            "SELECT pg_read_file('/etc/passwd')",
            "SELECT pg_ls_dir('.')",
            "CREATE ROLE intruder",
            "CREATE DATABASE intruder",
            "ALTER SYSTEM SET listen_addresses = '*'",
        ):
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.execute(statement)
    finally:
        await conn.close()


async def test_a_trust_data_folder_of_an_older_version_is_locked_in_place(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An older gpulayer's folder: pg_hba.conf all trust, no password file, the database made
    and migrated by the superuser. At start it gets a password and a scram-only pg_hba.conf,
    says so, and the services' role is given the database, whose rows stay."""
    pg = EmbeddedPostgres(tmp_path / "pg", fast=True).start()
    try:
        admin = await asyncpg.connect(pg.url)
        await admin.execute("CREATE DATABASE gpulayer")
        await admin.close()
        old = await asyncpg.connect(replace_url(pg.url, database="gpulayer"))
        await migrate(old)
        await old.execute("INSERT INTO quotas (owner, resource, max) VALUES ('alice', 'jobs', 3)")
        await old.close()
    finally:
        pg.stop()
    (pg.pgdata / "pg_hba.conf").write_text(
        "local all all trust\nhost all all 127.0.0.1/32 trust\nhost all all ::1/128 trust\n"
    )
    pg.passfile.unlink()
    caplog.set_level(logging.WARNING, "gpulayer_runtime.servers")
    again = EmbeddedPostgres(tmp_path / "pg", fast=True).start()
    try:
        said = [r.getMessage() for r in caplog.records]
        assert any("had no superuser password" in m and str(again.passfile) in m for m in said)
        assert any("(trust)" in m and "rewritten" in m for m in said)
        assert "trust" not in (again.pgdata / "pg_hba.conf").read_text()
        assert _mode(again.passfile) == 0o600
        why = await _refused(
            f"postgresql://postgres@127.0.0.1:{again.port}/postgres", password=None
        )
        assert why == "InvalidPasswordError"
        url = await again.service_database()
        conn = await asyncpg.connect(url)
        try:
            assert await migrate(conn) == []
            assert await conn.fetchval("SELECT max FROM quotas WHERE owner = 'alice'") == 3
            await conn.execute(
                "INSERT INTO quotas (owner, resource, max) VALUES ('bob', 'jobs', 1)"
            )
            assert await conn.fetchval("SELECT current_user") == SERVICE_ROLE
        finally:
            await conn.close()
    finally:
        again.stop()


@AS_ROOT
def test_several_first_starts_at_once_make_the_account_once(tmp_path: Path) -> None:
    """Where the server's account doesn't exist yet, servers started at once (xdist workers on
    a fresh machine) all start: one makes the account, the others find it."""
    account = f"gpl_t{uuid.uuid4().hex[:8]}"
    start = (
        "import sys\n"
        "from pathlib import Path\n"
        "from gpulayer_runtime.pgserver import EmbeddedPostgres\n"
        "with EmbeddedPostgres(Path(sys.argv[1]), fast=True, system_user=sys.argv[2]):\n"
        "    print('started')\n"
    )
    try:
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", start, str(tmp_path / f"pg{i}"), account],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for i in range(4)
        ]
        outs = [p.communicate(timeout=120)[0] for p in procs]
        assert [p.returncode for p in procs] == [0] * 4, outs
        assert outs == ["started\n"] * 4
        uid = pwd.getpwnam(account).pw_uid
        assert {(tmp_path / f"pg{i}" / "pgdata").stat().st_uid for i in range(4)} == {uid}
    finally:
        subprocess.run(["userdel", account], check=False, capture_output=True)
        subprocess.run(["groupdel", account], check=False, capture_output=True)


async def test_a_socket_path_past_the_limit_goes_to_a_folder_of_its_own(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    with EmbeddedPostgres(deep, fast=True) as pg:
        assert not pg.socket_dir.is_relative_to(deep)
        assert _mode(pg.socket_dir) == 0o700
        conn = await asyncpg.connect(pg.url, host=str(pg.socket_dir), port=pg.port)
        assert await conn.fetchval("SELECT 1") == 1
        await conn.close()
        socket_dir = pg.socket_dir
    assert not socket_dir.exists()  # removed with the server


async def test_the_compose_init_script_makes_the_same_role(tmp_path: Path) -> None:
    """deploy/postgres-init/10-gpulayer-role.sh, as the postgres image runs it on an empty
    volume (psql as the superuser), against a real server: the role it makes logs in with the
    password from the environment and is no superuser."""
    with EmbeddedPostgres(tmp_path / "pg", fast=True) as pg:
        password = secrets.token_urlsafe(16)
        env = {
            "PATH": f"{postgres_bin_dir()}:{os.environ['PATH']}",
            "POSTGRES_USER": "postgres",
            "POSTGRES_SERVICES_PASSWORD": password,
            "PGHOST": "127.0.0.1",
            "PGPORT": str(pg.port),
            "PGPASSFILE": str(pg.passfile),
            "PGDATABASE": "postgres",
        }
        script = Path(__file__).parents[2] / "deploy" / "postgres-init" / "10-gpulayer-role.sh"
        done = await asyncio.create_subprocess_exec(
            "sh",
            str(script),
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        said, _ = await done.communicate()
        assert done.returncode == 0, said.decode()
        conn = await asyncpg.connect(
            f"postgresql://gpulayer@127.0.0.1:{pg.port}/gpulayer", password=password
        )
        try:
            assert (
                await conn.fetchval("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
                is False
            )
            assert (
                await conn.fetchval(
                    "SELECT pg_get_userbyid(datdba) FROM pg_database WHERE datname = 'gpulayer'"
                )
                == "gpulayer"
            )
        finally:
            await conn.close()
