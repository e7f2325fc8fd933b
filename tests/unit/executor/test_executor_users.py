"""Which account a job runs as: the job user, the per-owner mapping, the refusals."""

from __future__ import annotations

import os
import pwd
from pathlib import Path
from typing import Any

import pytest
from tests.unit.executor.fakes import grant

from gpulayer_executor.env import RunAs
from gpulayer_executor.users import (
    Lookup,
    UserError,
    account,
    job_users,
    not_passable,
    parse_user_map,
    readable_by,
    run_as_for,
)


def _entry(name: str, uid: int, home: str = "/nonexistent") -> pwd.struct_passwd:
    return pwd.struct_passwd((name, "x", uid, uid, "", home, "/usr/sbin/nologin"))


def lookup_of(*entries: pwd.struct_passwd) -> Lookup:
    by_name = {e.pw_name: e for e in entries}

    def lookup(name: str) -> pwd.struct_passwd:
        return by_name[name]  # KeyError, as pwd.getpwnam, for an unknown name

    return lookup


NOBODY = _entry("nobody", 65534)
ALICE = _entry("alice", 2001, home="/")
ROOT = _entry("root", 0, home="/root")
WITH_NOBODY = lookup_of(NOBODY, ALICE, ROOT)
WITHOUT_NOBODY = lookup_of(ALICE, ROOT)


def _users(**kw: Any) -> RunAs | None:
    args: dict[str, Any] = {
        "euid": 0,
        "job_user": "",
        "user_map": {},
        "allow_root_jobs": False,
        "lookup": WITH_NOBODY,
    }
    args.update(kw)
    return job_users(**args)


def test_root_runs_jobs_as_nobody_by_default_with_its_own_folder_as_home() -> None:
    run_as = _users()
    assert run_as == RunAs(name="nobody", uid=65534, gid=65534, home="")


def test_root_runs_jobs_as_the_configured_user() -> None:
    assert _users(job_user="alice") == RunAs(name="alice", uid=2001, gid=2001, home="/")


def test_root_with_no_job_user_refuses_to_start_unless_root_jobs_are_allowed() -> None:
    with pytest.raises(UserError, match="runs as root and there is no job user") as err:
        _users(lookup=WITHOUT_NOBODY)
    assert "GPULAYER_EXECUTOR_JOB_USER" in str(err.value)
    assert "GPULAYER_EXECUTOR_ALLOW_ROOT_JOBS=1" in str(err.value)
    # Allowed explicitly: jobs run as the executor (root); __main__ logs a loud warning.
    assert _users(lookup=WITHOUT_NOBODY, allow_root_jobs=True) is None


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"job_user": "root"}, "must be an unprivileged user"),
        ({"job_user": "ghost"}, "no such user"),
        ({"euid": 1000, "job_user": "alice"}, "only when the executor runs as root"),
        ({"euid": 1000, "user_map": {"a": RunAs(name="x", uid=5, gid=5, home="")}}, "as root"),
    ],
)
def test_impossible_job_users_are_refused_by_name(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(UserError, match=match):
        _users(**kw)


def test_a_non_root_executor_runs_jobs_as_itself() -> None:
    assert _users(euid=os.geteuid() or 1000) is None


def test_the_user_map_gives_each_owner_its_account_and_others_the_default() -> None:
    users = parse_user_map('alice = "alice"\n"team-b" = "nobody"\n', "map.toml", WITH_NOBODY)
    assert set(users) == {"alice", "team-b"}
    default = RunAs(name="d", uid=7, gid=7, home="")
    assert run_as_for(grant("g1", owner="alice"), default, users) == users["alice"]
    assert run_as_for(grant("g2", owner="team-b"), default, users) == users["team-b"]
    assert users["team-b"].name == "nobody"
    assert run_as_for(grant("g3", owner="mallory"), default, users) == default
    assert run_as_for(grant("g4"), default, users) == default  # "anonymous"


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("alice = ", "not valid TOML"),
        ("alice = 3", "'alice' must map to a user name"),
        ('alice = ""', "'alice' must map to a user name"),
        ('alice = "ghost"', "map.toml: alice='ghost': no such user"),
        ('alice = "root"', "unprivileged"),
    ],
)
def test_a_bad_user_map_names_the_entry(text: str, match: str) -> None:
    with pytest.raises(UserError, match=match):
        parse_user_map(text, "map.toml", WITH_NOBODY)


def test_a_home_that_exists_is_kept() -> None:
    assert account("alice", "S", WITH_NOBODY).home == "/"


@pytest.mark.parametrize(
    ("mode", "owner", "group", "readers"),
    [
        (0o600, 0, 0, []),
        (0o644, 0, 0, ["nobody", "alice"]),
        (0o640, 0, 2001, ["alice"]),
        (0o600, 65534, 0, ["nobody"]),
        (0o000, 65534, 0, []),
    ],
)
def test_readable_by_follows_the_mode_bits(
    tmp_path: Path, mode: int, owner: int, group: int, readers: list[str]
) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a file away needs root")
    secret = tmp_path / "node.creds"
    secret.write_text("x")
    secret.chmod(mode)
    os.chown(secret, owner, group)
    accounts = [
        RunAs(name="nobody", uid=65534, gid=65534, home=""),
        RunAs(name="alice", uid=2001, gid=2001, home=""),
    ]
    assert readable_by(secret, accounts) == readers
    assert readable_by(tmp_path / "missing", accounts) == []


@pytest.mark.parametrize(
    ("mode", "owner", "group", "blocked"),
    [
        (0o711, 0, 0, []),  # as the executor makes its workdir: others may pass
        (0o700, 0, 0, ["nobody", "alice"]),  # a private home such as /root
        (0o710, 0, 2001, ["nobody"]),  # alice's group may pass
        (0o700, 65534, 0, ["alice"]),  # nobody's own
    ],
)
def test_not_passable_follows_the_mode_bits(
    tmp_path: Path, mode: int, owner: int, group: int, blocked: list[str]
) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a folder away needs root")
    top = tmp_path / "top"
    (top / "workdir").mkdir(parents=True)
    top.chmod(mode)
    os.chown(top, owner, group)
    accounts = [
        RunAs(name="nobody", uid=65534, gid=65534, home=""),
        RunAs(name="alice", uid=2001, gid=2001, home=""),
    ]
    # Only the folder made here is judged (pytest's own folders above it are root's, 0700).
    found = [name for name, folder in not_passable(top / "workdir", accounts) if folder == top]
    assert found == blocked
    # No accounts (owners' own uids): judged as others.
    others = [f for _, f in not_passable(top / "workdir", []) if f == top]
    assert others == ([] if mode & 0o001 else [top])
