"""PostgreSQL URLs and credentials: the services' own role, its passfile, URLs that carry no
password.

A URL names its password file with libpq's ``passfile`` parameter (asyncpg reads it too), so
the URL can be printed, logged and passed in the environment without the password in it.
"""

from __future__ import annotations

import contextlib
import secrets
import stat
import urllib.parse
from collections.abc import Mapping
from pathlib import Path

import asyncpg

from gpulayer_runtime.private_files import write_private

# The role the services connect as: it owns gpulayer's database and nothing more (no superuser,
# no CREATEDB, no CREATEROLE), so a stolen connection can't run programs or read server files.
SERVICE_ROLE = "gpulayer"
SERVICE_DATABASE = "gpulayer"


class PassfileError(ValueError):
    """A password file that libpq and asyncpg would ignore or can't read."""


def replace_url(
    url: str,
    *,
    user: str | None = None,
    database: str | None = None,
    passfile: Path | None = None,
    hosts: str | None = None,
) -> str:
    """``url`` with another user, database, passfile or host list (``h1:p1,h2:p2``); the rest
    (other query parameters) kept. A new user drops the old user's password."""
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc
    if hosts is not None:
        userinfo, at, _ = netloc.rpartition("@")
        netloc = f"{userinfo}{at}{hosts}"
    if user is not None:
        _, _, hosts = netloc.rpartition("@")
        netloc = f"{urllib.parse.quote(user, safe='')}@{hosts}"
    path = parts.path if database is None else "/" + urllib.parse.quote(database, safe="")
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    if passfile is not None:
        query = [(k, v) for k, v in query if k != "passfile"]
        query.append(("passfile", str(passfile)))
    text = urllib.parse.urlencode(query, safe="/", quote_via=urllib.parse.quote)
    return urllib.parse.urlunsplit((parts.scheme, netloc, path, text, parts.fragment))


def redact(url: str) -> str:
    """``url`` with its password, if any (in the user part or a ``password`` parameter), shown
    as ``***``; a passfile's path stays: it is no secret, and says where the password is."""
    parts = urllib.parse.urlsplit(url)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    if at and ":" in userinfo:
        parts = parts._replace(netloc=f"{userinfo.split(':', 1)[0]}:***@{hosts}")
    if "password=" in parts.query:
        query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
        shown = [(k, "***" if k == "password" else v) for k, v in query]
        parts = parts._replace(query=urllib.parse.urlencode(shown, safe="/*"))
    return urllib.parse.urlunsplit(parts)


def url_hosts(url: str) -> list[str]:
    """The hosts of a (multi-host) URL as written, each with its port if it has one:
    ``postgresql://u@h1:5432,h2:5433/db`` gives ``["h1:5432", "h2:5433"]``; none (a socket
    or libpq's default) gives ``[]``."""
    _, _, hosts = urllib.parse.urlsplit(url).netloc.rpartition("@")
    return [h for h in hosts.split(",") if h]


def _has_password(url: str) -> bool:
    parts = urllib.parse.urlsplit(url)
    userinfo, at, _ = parts.netloc.rpartition("@")
    query = urllib.parse.parse_qs(parts.query)
    return bool(at and ":" in userinfo) or "password" in query


def passfile_of(url: str, env: Mapping[str, str]) -> tuple[Path, str] | None:
    """The password file a connection to ``url`` reads, and what named it: the URL's
    ``passfile``, else ``PGPASSFILE``, else ``~/.pgpass`` where it exists (asyncpg's order).
    None when the URL carries its password, or names no file and there is no ``~/.pgpass``."""
    if _has_password(url):
        return None
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)
    if query.get("passfile"):
        return Path(query["passfile"][-1]), "the URL's passfile"
    if env.get("PGPASSFILE"):
        return Path(env["PGPASSFILE"]), "PGPASSFILE"
    home = env.get("HOME")
    if home and (Path(home) / ".pgpass").exists():
        return Path(home) / ".pgpass", "~/.pgpass"
    return None


def check_passfile(path: Path, source: str) -> None:
    """PassfileError when ``path`` is missing, no file, or open to others: libpq and asyncpg
    skip such a file with a warning and the connection then fails as a wrong password would."""
    try:
        info = path.stat()
    except OSError as err:
        raise PassfileError(f"{source} {path}: {err.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise PassfileError(f"{source} {path} is not a plain file")
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o077:
        raise PassfileError(
            f"{source} {path} has mode {mode:04o}: a password file must be readable by its owner "
            f"only (chmod 600 {path})"
        )


def pgpass_line(user: str, password: str) -> str:
    """A passfile line for ``user`` on any host, port and database (the embedded server's port
    changes from run to run). ``:`` and ``\\`` are escaped as libpq reads them."""

    def esc(text: str) -> str:
        return text.replace("\\", "\\\\").replace(":", "\\:")

    return f"*:*:*:{esc(user)}:{esc(password)}\n"


def read_pgpass_password(path: Path, user: str) -> str | None:
    """The password a ``*:*:*:user:password`` line of ``path`` gives ``user``, if any."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return None
    for line in lines:
        fields = _split_pgpass(line)
        if len(fields) == 5 and fields[3] == user:
            return fields[4]
    return None


def _split_pgpass(line: str) -> list[str]:
    fields, current, escaped = [], [], False
    for char in line:
        if escaped:
            current.append(char)
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == ":":
            fields.append("".join(current))
            current = []
        else:
            current.append(char)
    fields.append("".join(current))
    return fields


def ensure_password(passfile: Path, user: str) -> str:
    """The password ``passfile`` holds for ``user``; a new random one written there (0600) when
    it holds none. Two processes at once get the same one."""
    password = read_pgpass_password(passfile, user)
    if password is not None:
        return password
    new = secrets.token_urlsafe(32)
    if not write_private(passfile, pgpass_line(user, new), replace=False):
        password = read_pgpass_password(passfile, user)
        if password is not None:
            return password
        write_private(passfile, pgpass_line(user, new))  # a file without our line: ours now
    return new


async def create_service_database(
    admin_url: str, database: str, passfile: Path, *, role: str = SERVICE_ROLE
) -> str:
    """``database``, owned by ``role`` (made if missing: LOGIN, no superuser, no CREATEDB, no
    CREATEROLE), with ``role``'s password from ``passfile`` (made there on first use). Others
    may not connect to it. Returns the URL the services use: ``role`` at ``database``, the
    password in ``passfile``. ``admin_url`` must be a superuser's (CREATE ROLE, CREATE DATABASE)."""
    password = ensure_password(passfile, role)
    admin = await asyncpg.connect(admin_url)
    try:
        # Utility statements take no parameters: the server quotes the name and the password.
        if not await admin.fetchval("SELECT 1 FROM pg_roles WHERE rolname = $1", role):
            # Made meanwhile by another first run: either error says so.
            with contextlib.suppress(asyncpg.DuplicateObjectError, asyncpg.UniqueViolationError):
                await admin.execute(f"CREATE ROLE {_ident(role)}")
        alter = await admin.fetchval(
            "SELECT format('ALTER ROLE %I WITH LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE "
            "NOREPLICATION NOBYPASSRLS PASSWORD %L', $1::text, $2::text)",
            role,
            password,
        )
        await admin.execute(alter)
        owner = await admin.fetchval(
            "SELECT pg_get_userbyid(datdba) FROM pg_database WHERE datname = $1", database
        )
        if owner is None:
            with contextlib.suppress(asyncpg.DuplicateDatabaseError):  # made meanwhile
                await admin.execute(f"CREATE DATABASE {_ident(database)} OWNER {_ident(role)}")
        elif owner != role:
            await admin.execute(f"ALTER DATABASE {_ident(database)} OWNER TO {_ident(role)}")
        await admin.execute(f"REVOKE ALL ON DATABASE {_ident(database)} FROM PUBLIC")
    finally:
        await admin.close()
    url = replace_url(admin_url, database=database)
    if owner not in (None, role):
        await _hand_over(url, role)
    return replace_url(admin_url, user=role, database=database, passfile=passfile)


# Every table, view, sequence, routine and type of schema public that ``$1`` doesn't own, as
# the statement that gives it to ``$1``. An extension's members stay its own; a sequence that
# belongs to a column goes with its table.
_FOREIGN_OBJECTS = """
SELECT format('ALTER %s %s OWNER TO %I',
              CASE c.relkind WHEN 'S' THEN 'SEQUENCE' WHEN 'v' THEN 'VIEW'
                             WHEN 'm' THEN 'MATERIALIZED VIEW' ELSE 'TABLE' END,
              c.oid::regclass, $1::text)
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p', 'v', 'm', 'S')
  AND pg_get_userbyid(c.relowner) <> $1
  AND NOT EXISTS (SELECT 1 FROM pg_depend d WHERE d.classid = 'pg_class'::regclass
                  AND d.objid = c.oid AND d.deptype IN ('e', 'a', 'i'))
UNION ALL
SELECT format('ALTER ROUTINE %s OWNER TO %I', p.oid::regprocedure, $1::text)
FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
WHERE n.nspname = 'public' AND pg_get_userbyid(p.proowner) <> $1
  AND NOT EXISTS (SELECT 1 FROM pg_depend d WHERE d.classid = 'pg_proc'::regclass
                  AND d.objid = p.oid AND d.deptype = 'e')
UNION ALL
SELECT format('ALTER TYPE %s OWNER TO %I', t.oid::regtype, $1::text)
FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace
WHERE n.nspname = 'public' AND t.typtype IN ('e', 'd')
  AND pg_get_userbyid(t.typowner) <> $1
  AND NOT EXISTS (SELECT 1 FROM pg_depend d WHERE d.classid = 'pg_type'::regclass
                  AND d.objid = t.oid AND d.deptype = 'e')
"""


async def _hand_over(url: str, role: str) -> None:
    """Give ``role`` what a superuser made in the database at ``url`` (a database from before
    the services had a role of their own), so that they keep working as ``role``."""
    conn = await asyncpg.connect(url)
    try:
        async with conn.transaction():
            for (statement,) in await conn.fetch(_FOREIGN_OBJECTS, role):
                await conn.execute(statement)
    finally:
        await conn.close()


def _ident(name: str) -> str:
    """``name`` as a quoted SQL identifier."""
    if "\0" in name:
        raise ValueError(f"a PostgreSQL name can't hold NUL: {name!r}")
    return '"' + name.replace('"', '""') + '"'
