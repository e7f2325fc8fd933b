"""Running a detection tool: always with a timeout, never raising for the tool's own failures.

Probes receive a ``Runner`` instead of calling subprocess themselves, so tests hand them recorded
output and the service hands them this one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class RunResult:
    """What a command did. ``error`` is set when it never ran to completion (not found, timed
    out, could not start); then ``returncode`` is None."""

    argv: tuple[str, ...]
    returncode: int | None
    stdout: str = ""
    stderr: str = ""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.returncode == 0

    @property
    def output(self) -> str:
        """stdout and stderr together: tools disagree on where their errors go."""
        return "\n".join(part for part in (self.stdout, self.stderr) if part.strip())

    def describe(self) -> str:
        """A short reason, for notes: ``not found on PATH``, ``exit 9: <first line>``."""
        if self.error is not None:
            return self.error
        first = next((line.strip() for line in self.output.splitlines() if line.strip()), "")
        return f"exit {self.returncode}" + (f": {first}" if first else "")


Runner = Callable[[Sequence[str], float], Awaitable[RunResult]]

# After a kill, how long to wait for the pipes to close before giving up on the output.
_REAP_S = 5.0


def resolve(program: str, path: str | None = None) -> str | None:
    """The executable ``program`` names: a path as given (if executable), else a PATH lookup."""
    if os.sep in program or (os.altsep and os.altsep in program):
        return program if os.path.isfile(program) and os.access(program, os.X_OK) else None
    return shutil.which(program, path=path)


def with_tool_dirs(run: Runner, dirs: Sequence[str]) -> Runner:
    """``run``, with a program that is not on PATH looked for in ``dirs`` too, in order.

    WSL2 puts the NVIDIA driver's ``nvidia-smi`` in ``/usr/lib/wsl/lib``, which a login shell
    has on PATH and a service usually has not.
    """
    if not dirs:
        return run

    async def run_there(argv: Sequence[str], timeout: float) -> RunResult:
        args = list(argv)
        if args and os.sep not in args[0] and resolve(args[0]) is None:
            for d in dirs:
                candidate = os.path.join(d, args[0])
                if resolve(candidate) is not None:
                    args[0] = candidate
                    break
        return await run(args, timeout)

    return run_there


def _kill(proc: asyncio.subprocess.Process) -> None:
    # The tool runs in its own session, so killing the group also ends whatever it started
    # (a shell script's children would otherwise keep the pipes open).
    with contextlib.suppress(ProcessLookupError, PermissionError, OSError):
        if hasattr(os, "killpg"):
            os.killpg(proc.pid, signal.SIGKILL)
        else:  # pragma: no cover - Windows
            proc.kill()


async def run_command(
    argv: Sequence[str], timeout: float, *, env: Mapping[str, str] | None = None
) -> RunResult:
    """Run ``argv`` (no shell) for at most ``timeout`` seconds."""
    args = tuple(argv)
    exe = resolve(args[0])
    if exe is None:
        where = "not executable" if os.sep in args[0] else "not found on PATH"
        return RunResult(args, None, error=f"{args[0]} {where}")
    try:
        proc = await asyncio.create_subprocess_exec(
            exe,
            *args[1:],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            env=None if env is None else dict(env),
        )
    except OSError as err:
        return RunResult(args, None, error=f"{args[0]} could not start: {err}")
    assert proc.stdout is not None
    assert proc.stderr is not None
    out, err_out = bytearray(), bytearray()
    tasks: list[asyncio.Future[Any]] = [
        asyncio.ensure_future(_drain(proc.stdout, out)),
        asyncio.ensure_future(_drain(proc.stderr, err_out)),
        asyncio.ensure_future(proc.wait()),
    ]
    try:
        _, pending = await asyncio.wait(tasks, timeout=timeout)
    except asyncio.CancelledError:
        _kill(proc)
        # Reap even when cancelled, so no zombie or open pipe outlives the caller.
        await asyncio.shield(_reap(tasks))
        raise
    if pending:
        _kill(proc)
        await _reap(tasks)
        return RunResult(
            args, None, _text(out), _text(err_out), error=f"{args[0]} timed out after {timeout:g}s"
        )
    return RunResult(args, proc.returncode, _text(out), _text(err_out))


async def _drain(stream: asyncio.StreamReader, into: bytearray) -> None:
    # Chunk by chunk into a caller-owned buffer, so output read before a timeout is kept.
    while chunk := await stream.read(65536):
        into.extend(chunk)


async def _reap(tasks: list[asyncio.Future[Any]]) -> None:
    """After a kill: let the pipes drain and the process be waited for, briefly."""
    _, pending = await asyncio.wait(tasks, timeout=_REAP_S)
    for t in pending:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _text(data: bytes | bytearray | None) -> str:
    return (data or b"").decode("utf-8", errors="replace")
