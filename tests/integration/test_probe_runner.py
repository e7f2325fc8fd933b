"""The command runner against real processes: timeouts end the whole process group."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from gpulayer_detection.runner import run_command

pytestmark = pytest.mark.integration


def script(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


async def test_output_and_exit_status(tmp_path: Path) -> None:
    exe = script(tmp_path, "tool", 'echo "out $1"; echo err >&2; exit 3\n')
    r = await run_command([exe, "x"], 5)
    assert (r.returncode, r.stdout, r.stderr, r.error) == (3, "out x\n", "err\n", None)
    assert not r.ok
    assert r.describe() == "exit 3: out x"


async def test_missing_tool_is_a_result_not_an_exception(tmp_path: Path) -> None:
    r = await run_command(["gpulayer-no-such-tool-xyz"], 5)
    assert r.returncode is None
    assert r.error == "gpulayer-no-such-tool-xyz not found on PATH"
    r = await run_command([str(tmp_path / "absent")], 5)
    assert r.error is not None
    assert "not executable" in r.error


async def test_timeout_kills_the_tool_and_its_children(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    # The child sleeps in the background and would keep the pipes open if only the shell died.
    exe = script(tmp_path, "hang", f"sleep 300 &\necho $! > {pidfile}\necho started\nwait\n")
    started = time.monotonic()
    r = await run_command([exe], 1.0)
    assert (
        time.monotonic() - started < 60
    )  # cut off, not the 300 s hang (room for a loaded machine)
    assert r.error == f"{exe} timed out after 1s"
    assert r.returncode is None
    assert r.stdout == "started\n"  # what it printed before the timeout is kept
    child = int(pidfile.read_text())
    await _gone(child)


async def test_cancelled_caller_leaves_no_process(tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    exe = script(tmp_path, "hang", f"echo $$ > {pidfile}\nexec sleep 300\n")
    task = asyncio.create_task(run_command([exe], 60))
    await asyncio.wait_for(
        _until(lambda: pidfile.exists() and pidfile.read_text().strip() != ""), 10
    )
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _gone(int(pidfile.read_text()))


async def _until(check: Callable[[], bool]) -> None:
    # Polls a file the child writes: there is no event to await for another process's progress.
    while not check():  # noqa: ASYNC110
        await asyncio.sleep(0.02)


def _dead(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A killed grandchild is reaped by init; until then it is a zombie, which counts as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


async def _gone(pid: int) -> None:
    try:
        await asyncio.wait_for(_until(lambda: _dead(pid)), 5)
    except TimeoutError:
        raise AssertionError(f"process {pid} still running") from None
