"""Which local account a job runs as: one job user, or one per owner. Plain values in and out.

``__main__`` reads the settings (and the mapping file) and calls these; the job runner only
asks :func:`run_as_for` which account a grant's job gets.

When the executor runs as root, every job runs as an unprivileged account: the configured job
user, ``nobody`` when none is configured, or the account the per-owner mapping names. Running
jobs as root is refused unless explicitly allowed. When the executor is not root it can't
switch users, so jobs run as its own account, which is no boundary at all (docs/security.md).
A shim running as root takes on the job's account for the moment of the spawn
(:func:`switched_to`).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import stat
import tomllib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from gpulayer_contracts.events import Grant
from gpulayer_executor.env import RunAs

# The job user of an executor running as root when none is configured: the conventional
# account that owns nothing. Its home (/nonexistent) doesn't exist, so jobs get their own
# folder as HOME instead (see ``RunAs.home``).
DEFAULT_JOB_USER = "nobody"

Lookup = Callable[[str], pwd.struct_passwd]


class UserError(ValueError):
    """A job user setting can't be honoured. ``str()`` names the setting and the problem."""


def account(name: str, setting: str, lookup: Lookup = pwd.getpwnam) -> RunAs:
    """The unprivileged account ``name``; UserError when it doesn't exist or is root."""
    try:
        entry = lookup(name)
    except KeyError:
        raise UserError(f"{setting}={name!r}: no such user") from None
    if entry.pw_uid == 0 or entry.pw_gid == 0:
        raise UserError(f"{setting}={name!r}: must be an unprivileged user (not uid or gid 0)")
    # An empty home means "the job's own folder": a job never gets a HOME it can't write to.
    home = entry.pw_dir if entry.pw_dir and os.path.isdir(entry.pw_dir) else ""
    return RunAs(name=name, uid=entry.pw_uid, gid=entry.pw_gid, home=home)


def parse_user_map(text: str, source: str, lookup: Lookup = pwd.getpwnam) -> dict[str, RunAs]:
    """``owner = "local user"`` lines (TOML) into accounts; UserError naming the bad entry."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise UserError(f"{source}: not valid TOML: {err}") from None
    users: dict[str, RunAs] = {}
    for owner, name in data.items():
        if not isinstance(name, str) or not name:
            raise UserError(f"{source}: {owner!r} must map to a user name (a string)")
        users[owner] = account(name, f"{source}: {owner}", lookup)
    return users


def job_users(
    *,
    euid: int,
    job_user: str,
    user_map: Mapping[str, RunAs],
    allow_root_jobs: bool,
    lookup: Lookup = pwd.getpwnam,
) -> RunAs | None:
    """The default account jobs run as (None: the executor's own). UserError when the executor
    runs as root with no usable job user and root jobs weren't allowed, or when a non-root
    executor is asked to switch users it can't switch to."""
    if euid != 0:
        me = _name_of(euid)
        if (job_user and job_user != me) or user_map:
            raise UserError(
                "GPULAYER_EXECUTOR_JOB_USER / GPULAYER_EXECUTOR_USER_MAP: jobs can run as "
                f"another user only when the executor runs as root (it runs as {me!r})"
            )
        return None
    if job_user:
        return account(job_user, "GPULAYER_EXECUTOR_JOB_USER", lookup)
    if allow_root_jobs:
        return None
    try:
        return account(DEFAULT_JOB_USER, "GPULAYER_EXECUTOR_JOB_USER (default)", lookup)
    except UserError:
        raise UserError(
            "the executor runs as root and there is no job user: no "
            f"GPULAYER_EXECUTOR_JOB_USER and no usable {DEFAULT_JOB_USER!r} account. Set "
            "GPULAYER_EXECUTOR_JOB_USER to an unprivileged user (or "
            "GPULAYER_EXECUTOR_ALLOW_ROOT_JOBS=1 to run jobs as root, which gives every job "
            "the whole machine)"
        ) from None


def _name_of(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def run_as_for(grant: Grant, default: RunAs | None, user_map: Mapping[str, RunAs]) -> RunAs | None:
    """The account a grant's job runs as: its owner's in the mapping, else the default."""
    return user_map.get(grant.owner, default)


def _permits(st: os.stat_result, user: RunAs, other: int, group: int, owner: int) -> bool:
    """Whether ``st``'s mode bits give ``user`` a permission (``other``/``group``/``owner``:
    that permission's bit for each class, e.g. ``stat.S_IROTH``, ``S_IRGRP``, ``S_IRUSR``)."""
    mode = st.st_mode
    return bool(
        mode & other
        or (mode & group and st.st_gid == user.gid)
        or (mode & owner and st.st_uid == user.uid)
    )


def readable_by(path: Path, users: list[RunAs]) -> list[str]:
    """Names of the accounts in ``users`` that may read ``path`` by its mode bits (a secret
    the executor holds must be readable by none of them). A missing file is nobody's."""
    try:
        st = path.stat()
    except OSError:
        return []
    read = (stat.S_IROTH, stat.S_IRGRP, stat.S_IRUSR)
    return [user.name for user in users if _permits(st, user, *read)]


def not_passable(path: Path, users: list[RunAs]) -> list[tuple[str, Path]]:
    """(account, folder) for each account in ``users`` that can't pass through a folder above
    ``path`` by its mode bits (no ``x`` for it): such an account can't use a file under ``path``
    by its absolute path. ``users`` empty: the accounts of owners' own uids, judged as others."""
    accounts = users or [RunAs(name="an owner's uid", uid=-1, gid=-1, home="")]
    passing = (stat.S_IXOTH, stat.S_IXGRP, stat.S_IXUSR)
    found = []
    for folder in reversed(path.parents):
        try:
            st = folder.stat()
        except OSError:
            continue
        found += [(u.name, folder) for u in accounts if not _permits(st, u, *passing)]
    return found


def may_switch() -> bool:
    """Whether this shim can take on a job's account for a spawn and come back: it runs as
    root (real, effective and saved)."""
    return os.getresuid() == (0, 0, 0)


@contextlib.contextmanager
def switched_to(run_as: RunAs) -> Iterator[None]:
    """The job's account for the moment of a spawn: real and effective ids the job's, no
    supplementary groups; the saved ids stay root's, so the shim can come back. The spawned
    process execs with these ids and so keeps only them (exec copies the effective ids into the
    saved ones). This replaces exec'ing setpriv before each job, the most expensive part of a
    short job's start (about 1.1 ms of CPU against 0.45 ms for the spawn itself).

    The window is safe from the job's account: a process whose ids change is made
    non-dumpable by the kernel, and ptrace also needs the saved id to match. The shim is
    single-threaded, so no other code runs with these ids meanwhile; signals only set flags.
    What the window does allow: the account's own processes may signal the shim (kill's rule
    uses the real id), which they could already do to that account's jobs themselves."""
    groups = os.getgroups()
    rgid, egid, _ = os.getresgid()
    os.setgroups([])
    try:
        os.setresgid(run_as.gid, run_as.gid, -1)
        try:
            os.setresuid(run_as.uid, run_as.uid, -1)
            try:
                yield
            finally:
                os.setresuid(0, 0, -1)  # first: setting the gids back needs root again
        finally:
            os.setresgid(rgid, egid, -1)
    finally:
        os.setgroups(groups)
