"""How a job is started as its account: through util-linux's setpriv after a vfork where it is
installed (Popen's own user= forks the whole executor), refusing a missing command up front."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from gpulayer_executor import runner
from gpulayer_executor.env import RunAs

NOBODY = RunAs(name="nobody", uid=65534, gid=65534, home="")
ENV = {"PATH": "/usr/bin:/bin"}


def test_no_account_leaves_the_command_as_it_is() -> None:
    assert runner._as_account(["true", "x"], ENV, None) == (["true", "x"], {})


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="util-linux setpriv not installed")
def test_an_account_goes_through_setpriv_with_no_extra_groups() -> None:
    argv, kwargs = runner._as_account(["true", "--flag"], ENV, NOBODY)
    ids = ["--reuid=65534", "--regid=65534", "--clear-groups", "--"]
    assert argv[1:] == [*ids, shutil.which("true", path=ENV["PATH"]), "--flag"]
    assert kwargs == {}  # no user=/group=: CPython may vfork


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="util-linux setpriv not installed")
@pytest.mark.parametrize("program", ["no-such-program-gpulayer", "/no/such/path/prog"])
def test_a_missing_command_is_refused_before_anything_runs(program: str) -> None:
    with pytest.raises(FileNotFoundError, match=program):
        runner._as_account([program], ENV, NOBODY)


def test_without_setpriv_popen_changes_the_account(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "_setpriv", lambda: None)
    argv, kwargs = runner._as_account(["true"], ENV, NOBODY)
    assert argv == ["true"]
    assert kwargs == {"user": 65534, "group": 65534, "extra_groups": []}


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="util-linux setpriv not installed")
def test_the_job_really_runs_as_the_account() -> None:
    if os.geteuid() != 0:
        pytest.skip("changing accounts needs root")
    argv, kwargs = runner._as_account(["id", "-u"], ENV, NOBODY)
    out = subprocess.run(argv, env=ENV, capture_output=True, text=True, check=True, **kwargs)
    assert out.stdout.strip() == "65534"


def test_the_search_skips_what_the_account_may_not_reach() -> None:
    # A PATH whose first entry holds the program in a folder only root may enter (a shim under
    # /root): the job's account gets the next one, as Popen's own search would. (Not under
    # pytest's tmp_path: its base folder is the running user's alone.)
    with tempfile.TemporaryDirectory(dir="/tmp") as top:
        _search_skips(Path(top))


def _search_skips(tmp_path: Path) -> None:
    hidden = tmp_path / "hidden"
    (hidden / "bin").mkdir(parents=True)
    public = tmp_path / "public"
    public.mkdir()
    for folder in (hidden / "bin", public):
        prog = folder / "tool"
        prog.write_text("#!/bin/sh\n")
        prog.chmod(0o755)
    hidden.chmod(0o700)
    tmp_path.chmod(0o755)
    path = f"{hidden / 'bin'}:{public}"
    if os.geteuid() == 0:
        assert runner._resolve("tool", path, NOBODY) == str(public / "tool")
    owner = RunAs(name="me", uid=os.geteuid(), gid=os.getegid(), home="")
    assert runner._resolve("tool", path, owner) == str(hidden / "bin" / "tool")


def test_a_name_nothing_on_path_has_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        runner._resolve("tool", str(tmp_path), NOBODY)
