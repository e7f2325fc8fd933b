"""gpulayer_runtime.database: URLs that carry no password, passfiles, and the setting that
refuses a passfile libpq would skip."""

from __future__ import annotations

import threading
import urllib.parse
from pathlib import Path

import pytest

from gpulayer_runtime.database import (
    PassfileError,
    check_passfile,
    ensure_password,
    passfile_of,
    pgpass_line,
    read_pgpass_password,
    redact,
    replace_url,
    url_hosts,
)
from gpulayer_runtime.settings import ConfigError, database_url


def test_replace_url_keeps_hosts_port_and_other_parameters() -> None:
    url = "postgresql://postgres@h1:5432,h2:5433/postgres?sslmode=verify-full&passfile=/a/b"
    new = replace_url(url, user="gpulayer", database="jobs db", passfile=Path("/x y/pg.pass"))
    assert new == (
        "postgresql://gpulayer@h1:5432,h2:5433/jobs%20db?sslmode=verify-full&passfile=/x%20y/pg.pass"
    )
    parts = urllib.parse.urlsplit(new)
    assert (parts.username, parts.path) == ("gpulayer", "/jobs%20db")
    assert urllib.parse.parse_qs(parts.query)["passfile"] == ["/x y/pg.pass"]


MULTI = (
    "postgresql://gpulayer@h1:5432,h2:5433,[::1]:5434/gpulayer"
    "?target_session_attrs=read-write&passfile=/etc/gpulayer/pgpass"
)


def test_a_multi_host_url_keeps_its_hosts_and_target_session_attrs() -> None:
    assert url_hosts(MULTI) == ["h1:5432", "h2:5433", "[::1]:5434"]
    assert url_hosts("postgresql://u:pw@db/x") == ["db"]
    assert url_hosts("postgresql:///gpulayer?host=/run/postgresql") == []
    one = replace_url(MULTI, hosts="h2:5433")
    assert one == (
        "postgresql://gpulayer@h2:5433/gpulayer"
        "?target_session_attrs=read-write&passfile=/etc/gpulayer/pgpass"
    )
    assert replace_url("postgresql://h1,h2/db", hosts="h3") == "postgresql://h3/db"
    assert replace_url(MULTI, passfile=Path("/p")).startswith(
        "postgresql://gpulayer@h1:5432,h2:5433,[::1]:5434/gpulayer?target_session_attrs=read-write"
    )
    assert redact(MULTI) == MULTI
    assert redact(MULTI.replace("gpulayer@", "gpulayer:s3cret@", 1)) == MULTI.replace(
        "gpulayer@", "gpulayer:***@", 1
    )
    assert passfile_of(MULTI, {}) == (Path("/etc/gpulayer/pgpass"), "the URL's passfile")
    assert passfile_of(MULTI.replace("gpulayer@", "gpulayer:pw@", 1), {}) is None


def test_a_new_user_drops_the_old_users_password() -> None:
    assert replace_url("postgresql://postgres:s3cret@h/db", user="gpulayer") == (
        "postgresql://gpulayer@h/db"
    )


def test_redact_hides_the_password_and_shows_the_passfile() -> None:
    assert redact("postgresql://gpulayer:s3cret@db:5432/gpulayer?sslmode=require") == (
        "postgresql://gpulayer:***@db:5432/gpulayer?sslmode=require"
    )
    plain = "postgresql://gpulayer@db/gpulayer?passfile=/etc/gpulayer/pgpass"
    assert redact(plain) == plain
    assert redact("postgresql://gpulayer@db/gpulayer?sslmode=require&password=s3cret") == (
        "postgresql://gpulayer@db/gpulayer?sslmode=require&password=***"
    )


@pytest.mark.parametrize(
    ("password", "line"),
    [
        ("plain", "*:*:*:gpulayer:plain"),
        ("with:colon", "*:*:*:gpulayer:with\\:colon"),
        ("back\\slash", "*:*:*:gpulayer:back\\\\slash"),
    ],
)
def test_pgpass_lines_escape_as_libpq_reads_them(tmp_path: Path, password: str, line: str) -> None:
    # libpq: "If an entry needs to contain : or \\, escape this character with \\."
    assert pgpass_line("gpulayer", password) == line + "\n"
    path = tmp_path / "pgpass"
    path.write_text(f"other:5432:*:gpulayer:no\n*:*:*:postgres:not-this\n{line}\n")
    assert read_pgpass_password(path, "gpulayer") == "no"  # the first line for the user
    path.write_text(f"*:*:*:postgres:not-this\n{line}\n")
    assert read_pgpass_password(path, "gpulayer") == password
    assert read_pgpass_password(path, "nobody") is None


def test_two_first_runs_at_once_get_one_password(tmp_path: Path) -> None:
    path = tmp_path / "gpulayer.pgpass"
    got: list[str] = []
    start = threading.Barrier(8)

    def first_run() -> None:
        start.wait()
        got.append(ensure_password(path, "gpulayer"))

    threads = [threading.Thread(target=first_run) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(got)) == 1
    assert read_pgpass_password(path, "gpulayer") == got[0]
    assert path.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["gpulayer.pgpass"]  # no temporary left


def test_the_passfile_asyncpg_would_read(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    env = {"HOME": str(home)}
    url = "postgresql://gpulayer@db/gpulayer"
    assert passfile_of(url, env) is None  # no ~/.pgpass: none
    (home / ".pgpass").write_text("")
    assert passfile_of(url, env) == (home / ".pgpass", "~/.pgpass")
    assert passfile_of(url, {**env, "PGPASSFILE": "/p"}) == (Path("/p"), "PGPASSFILE")
    named = f"{url}?passfile=/q"
    assert passfile_of(named, {**env, "PGPASSFILE": "/p"}) == (Path("/q"), "the URL's passfile")
    # A URL with its password reads no file.
    assert passfile_of("postgresql://gpulayer:pw@db/gpulayer?passfile=/q", env) is None


def test_a_passfile_open_to_others_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "gpulayer.pgpass"
    path.write_text(pgpass_line("gpulayer", "pw"))
    env = {"GPULAYER_DATABASE_URL": f"postgresql://gpulayer@db/gpulayer?passfile={path}"}
    path.chmod(0o644)
    with pytest.raises(ConfigError) as err:
        database_url(env)
    assert str(err.value) == (
        f"GPULAYER_DATABASE_URL: the URL's passfile {path} has mode 0644: a password file must "
        f"be readable by its owner only (chmod 600 {path})"
    )
    path.chmod(0o600)
    assert database_url(env) == env["GPULAYER_DATABASE_URL"]


def test_a_missing_passfile_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "nowhere.pgpass"
    with pytest.raises(ConfigError, match=f"PGPASSFILE {path}: No such file"):
        database_url({"GPULAYER_DATABASE_URL": "postgresql://u@db/d", "PGPASSFILE": str(path)})
    with pytest.raises(PassfileError, match="is not a plain file"):
        check_passfile(tmp_path, "PGPASSFILE")
