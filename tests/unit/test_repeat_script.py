"""tests/repeat.sh (`make test-repeat`), with a stand-in `make` first on PATH that reports what
it saw instead of running the suite: each run counted, a failing test named, and with
``BUSY=1`` a spinning core while the runs go and none left after."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

SPINNER = ["sh", "-c", "while :; do :; done"]
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "repeat.sh"

# What pytest prints at the end of a run; and, in LOG, how many spinners the repeat.sh that ran
# it has while it runs (its children: found up the chain of parents, not the whole machine's).
FAKE_MAKE = f"""#!{sys.executable}
import os, sys, psutil
me = psutil.Process()
script = next(p for p in me.parents() if any(a.endswith("tests/repeat.sh") for a in p.cmdline()))
spinning = [c for c in script.children() if c.cmdline() == {SPINNER!r}]
with open(os.environ["LOG"], "a") as log:
    log.write(f"spinners: {{len(spinning)}}\\n")
if os.path.exists(os.environ["SLOW"]):  # this run waits until the test lets it go on
    import time
    release = os.environ["SLOW"] + ".release"
    try:  # as pytest does: a Ctrl-C ends the run with exit status 2, not by the signal
        for _ in range(3000):
            if os.path.exists(release):
                break
            time.sleep(0.02)
    except KeyboardInterrupt:
        sys.exit(2)
    os.remove(os.environ["SLOW"])
if os.path.exists(os.environ["FAIL"]):
    print("FAILED tests/unit/test_x.py::test_y - assert 1 == 2")
    print("1 failed, 9 passed in 1.00s")
    sys.exit(1)
print("10 passed in 1.00s")
"""


def _env(tmp_path: Path, busy: str) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    make = bin_dir / "make"
    make.write_text(FAKE_MAKE)
    make.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", BUSY=busy, TMPDIR=str(tmp_path))
    env.update(LOG=str(tmp_path / "seen.log"), FAIL=str(tmp_path / "fail"))
    env["SLOW"] = str(tmp_path / "slow")
    return env


def _until_first_run(log: Path, proc: subprocess.Popen[str]) -> None:
    """Until the first run's make has written its line (or the script ended)."""
    for _ in range(600):
        if (log.exists() and log.read_text().endswith("\n")) or proc.poll() is not None:
            return
        time.sleep(0.05)


def _run(tmp_path: Path, n: str, busy: str, fail: bool = False) -> subprocess.CompletedProcess[str]:
    env = _env(tmp_path, busy)
    if fail:
        (tmp_path / "fail").touch()
    return subprocess.run(
        ["bash", str(SCRIPT), n], env=env, capture_output=True, text=True, timeout=120, check=False
    )


def _spinners() -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if proc.info["cmdline"] == SPINNER:
            found.append(proc)
    return found


def test_busy_keeps_a_core_spinning_during_the_runs_and_stops_it_after(tmp_path: Path) -> None:
    before = {p.pid for p in _spinners()}
    got = _run(tmp_path, "2", "1")
    assert got.returncode == 0, got.stderr
    assert ", 1 core(s) kept busy" in got.stdout
    assert "test-repeat: 2 of 2 runs green" in got.stdout
    assert (tmp_path / "seen.log").read_text().splitlines() == ["spinners: 1", "spinners: 1"]
    assert {p.pid for p in _spinners()} - before == set()  # none left behind


def test_without_busy_nothing_spins_and_a_failure_is_named(tmp_path: Path) -> None:
    got = _run(tmp_path, "1", "0", fail=True)
    assert got.returncode == 1
    assert "kept busy" not in got.stdout
    assert "FAILED tests/unit/test_x.py::test_y" in got.stdout
    assert "test-repeat: 0 of 1 runs green" in got.stdout
    assert (tmp_path / "seen.log").read_text().splitlines() == ["spinners: 0"]


@pytest.mark.parametrize(
    ("n", "busy", "says"),
    [
        ("0", "0", "N must"),
        ("2", "-1", "BUSY must"),
        ("2", str(len(os.sched_getaffinity(0)) + 1), "BUSY must"),  # more than the cores (nproc)
        ("2", "9" * 40, "BUSY must"),  # past what the shell's numbers hold
    ],
)
def test_bad_counts_are_refused_naming_which(tmp_path: Path, n: str, busy: str, says: str) -> None:
    got = _run(tmp_path, n, busy)
    assert got.returncode == 2
    assert says in got.stderr


def test_ctrl_c_ends_the_hunt_not_only_its_run_and_stops_the_spinners(tmp_path: Path) -> None:
    """A terminal's Ctrl-C (SIGINT to the whole process group) while a run goes: pytest exits 2
    from it, and the script stops there instead of going on to its next run."""
    env = _env(tmp_path, "1")
    (tmp_path / "slow").touch()
    # SIGINT as a terminal leaves it (a test runner may have it ignored, which exec keeps).
    reset = (
        "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL);"
        " os.execvp('bash', ['bash', *sys.argv[1:]])"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", reset, str(SCRIPT), "3"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        log = tmp_path / "seen.log"
        _until_first_run(log, proc)
        assert log.read_text() == "spinners: 1\n"
        spinners = [c for c in psutil.Process(proc.pid).children() if c.cmdline() == SPINNER]
        assert len(spinners) == 1
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130
    assert "test-repeat: stopped" in err
    assert log.read_text() == "spinners: 1\n"  # no second run
    assert not any(s.is_running() and s.status() != psutil.STATUS_ZOMBIE for s in spinners)


def test_an_edit_of_the_script_during_a_hunt_changes_nothing_it_runs(tmp_path: Path) -> None:
    """A hunt runs for half an hour from the working tree, where work goes on: bash reads a
    script as it runs it, so an edit used to land in the middle of the running loop (a syntax
    error, seen). Here a copy of the script, in a repository of its own, is rewritten while its
    first run goes: both runs still finish, and nothing of the new text runs."""
    repo = tmp_path / "repo"
    (repo / "tests").mkdir(parents=True)
    copy = repo / "tests" / "repeat.sh"
    copy.write_bytes(SCRIPT.read_bytes())
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "script"], check=True)
    env = _env(tmp_path, "0")
    (tmp_path / "slow").touch()
    proc = subprocess.Popen(
        ["bash", str(copy), "2"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        _until_first_run(tmp_path / "seen.log", proc)
        assert proc.poll() is None
        copy.write_text("echo EDITED; exit 99\n" * 200 + SCRIPT.read_text())
        (tmp_path / "slow.release").touch()
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "EDITED" not in out + err
    assert proc.returncode == 0, (out, err)
    assert "test-repeat: 2 of 2 runs green" in out
