"""A job's folder and its TMPDIR (folders.py), on the real file system: made private to the
job's account, removed at the end, and never followed through a link the job put there."""

from __future__ import annotations

import os
import pwd
from pathlib import Path

import pytest

from gpulayer_executor.env import RunAs
from gpulayer_executor.folders import clear_scratch, empty_trash, prepare_job_dir, scratch_dir

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="giving folders to an account needs root")


def nobody() -> RunAs:
    pw = pwd.getpwnam("nobody")
    return RunAs(name="nobody", uid=pw.pw_uid, gid=pw.pw_gid, home="")


def test_the_folder_and_its_tmpdir_without_an_account(tmp_path: Path) -> None:
    cwd = tmp_path / "job"
    prepare_job_dir(cwd, None)
    prepare_job_dir(cwd, None)  # a start again: both exist already
    assert scratch_dir(cwd) == cwd / "tmp"
    for path in (cwd, cwd / "tmp"):
        assert path.is_dir()
        assert path.stat().st_mode & 0o777 == 0o700


@root_only
def test_both_are_the_accounts(tmp_path: Path) -> None:
    account = nobody()
    cwd = tmp_path / "job"
    prepare_job_dir(cwd, account)
    for path in (cwd, cwd / "tmp"):
        st = path.stat()
        assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (account.uid, account.gid, 0o700)


@root_only
def test_a_link_the_job_left_at_tmp_is_never_followed(tmp_path: Path) -> None:
    account = nobody()
    cwd = tmp_path / "job"
    prepare_job_dir(cwd, account)
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o755)
    (victim / "keep").write_text("root's")
    # The job replaces its tmp with a link to a folder it may not touch, then is started again
    # (an executor restart) and ends.
    (cwd / "tmp").rmdir()
    (cwd / "tmp").symlink_to(victim)
    prepare_job_dir(cwd, account)
    st = victim.stat()
    assert (st.st_uid, st.st_mode & 0o777) == (0, 0o755)


def trash_in(tmp_path: Path) -> Path:
    trash = tmp_path / "trash"
    trash.mkdir(mode=0o700)
    return trash


async def test_the_tmpdir_is_emptied_of_what_the_job_left(tmp_path: Path) -> None:
    cwd, trash = tmp_path / "job", trash_in(tmp_path)
    prepare_job_dir(cwd, None)
    empty = (cwd / "tmp").stat()
    assert clear_scratch(cwd, trash) is None  # empty: left as it is, nothing removed
    assert (cwd / "tmp").stat().st_ino == empty.st_ino
    assert list((cwd / "tmp").iterdir()) == []
    prepare_job_dir(cwd, None)  # a start again finds it and takes it as it is
    (cwd / "tmp" / "a" / "b").mkdir(parents=True)
    for i in range(200):
        (cwd / "tmp" / "a" / "b" / f"f{i}").write_text("x")
    (cwd / "result").write_text("kept")
    removal = clear_scratch(cwd, trash)
    # Out of the job's folder at once, whole: the folder is final before the removal ends (a
    # walk of it meanwhile sees only what the job keeps), the files go behind (awaited here).
    assert sorted(p.name for p in cwd.rglob("*")) == ["result"]
    # Moved into the trash (a removal in place returns None): its removal runs in a thread,
    # which may be done already, so the trash is not looked into before it is awaited.
    assert removal is not None
    await removal
    assert list(trash.iterdir()) == []
    assert sorted(p.name for p in cwd.iterdir()) == ["result"]  # the job's folder stays
    assert clear_scratch(cwd, trash) is None  # nothing there: nothing to do


async def test_without_a_trash_the_tmpdir_goes_before_the_call_returns(tmp_path: Path) -> None:
    cwd = tmp_path / "job"
    prepare_job_dir(cwd, None)
    (cwd / "tmp" / "f").write_text("x")
    assert clear_scratch(cwd, tmp_path / "no-trash") is None
    assert list(cwd.iterdir()) == []


async def test_what_an_earlier_run_left_in_the_trash_is_removed(tmp_path: Path) -> None:
    trash = trash_in(tmp_path)
    assert empty_trash(trash) is None
    assert empty_trash(tmp_path / "absent") is None
    (trash / "job-1" / "deep").mkdir(parents=True)
    (trash / "job-1" / "deep" / "f").write_text("x")
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("root's")
    (trash / "job-2").symlink_to(victim)  # a link the job left at its tmp, moved as a link
    removal = empty_trash(trash)
    assert removal is not None
    await removal
    assert list(trash.iterdir()) == []
    assert (victim / "keep").read_text() == "root's"


async def test_clearing_never_follows_a_link(tmp_path: Path) -> None:
    cwd, trash = tmp_path / "job", trash_in(tmp_path)
    prepare_job_dir(cwd, None)
    victim = tmp_path / "victim"
    (victim / "deep").mkdir(parents=True)
    (victim / "deep" / "keep").write_text("root's")
    (cwd / "tmp").rmdir()
    (cwd / "tmp").symlink_to(victim)
    removal = clear_scratch(cwd, trash)
    assert removal is not None
    await removal
    assert (victim / "deep" / "keep").read_text() == "root's"
    assert list(cwd.iterdir()) == []
    prepare_job_dir(cwd, None)
    (cwd / "tmp" / "link").symlink_to(victim)
    removal = clear_scratch(cwd, trash)
    assert removal is not None
    await removal
    assert list(cwd.iterdir()) == []
    assert list(trash.iterdir()) == []
    assert (victim / "deep" / "keep").read_text() == "root's"
