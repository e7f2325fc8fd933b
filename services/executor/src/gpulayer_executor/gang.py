"""How a rank of a distributed job is started: its argv. Pure but for looking up torchrun.

Without a launcher the job's command runs once on the node, its rendezvous in the environment
(``env.job_environment``). With ``launcher = "torchrun"`` the command runs under torchrun with
a **static** rendezvous: placement already knows every rank, which node is rank 0 and the port
reserved there, so each node is told its ``--node-rank`` and rank 0's address outright; c10d's
dynamic rendezvous (nodes joining, ranks assigned on arrival, elastic sizes) would buy nothing
here and add a rendezvous store to wait on. ``--no-python``: the command is an argv as always
(``python train.py``, a binary), never a script torchrun would hand to its own interpreter.
"""

from __future__ import annotations

import os
import re
import shutil
import signal

from gpulayer_contracts.events import Grant

TORCHRUN = "torchrun"


class LaunchRefused(ValueError):
    """The rank can't be started as asked. ``str()`` is the reason reported to the user."""


def find_torchrun(workload_python: str | None, path: str) -> str | None:
    """torchrun next to the node's workload interpreter (a venv's bin holds its torchrun, as the
    probe finds it), else on ``path`` (the job's PATH); None when neither has it."""
    if workload_python and os.sep in workload_python:
        found = shutil.which(TORCHRUN, path=os.path.dirname(workload_python))
        if found is not None:
            return found
    return shutil.which(TORCHRUN, path=path)


def torchrun_argv(torchrun: str, grant: Grant) -> list[str]:
    """``torchrun`` with the static rendezvous of ``grant.gang``, then ``--`` and the command."""
    gang = grant.gang
    assert gang is not None
    return [
        torchrun,
        "--nnodes",
        str(gang.nnodes),
        "--nproc-per-node",
        str(gang.nproc_per_node),
        "--node-rank",
        str(gang.rank),
        "--master-addr",
        gang.master_addr,
        "--master-port",
        str(gang.master_port),
        "--no-python",
        "--",
        *grant.job.command,
    ]


def job_argv(grant: Grant, *, workload_python: str | None, path: str) -> list[str]:
    """What the executor starts for ``grant``: its command, or for a rank of a distributed job
    with ``launcher = "torchrun"``, torchrun around it. Raises LaunchRefused."""
    dist = grant.job.distributed
    launcher = dist.launcher if dist is not None else None
    if grant.gang is None or launcher is None:
        return list(grant.job.command)
    if launcher != TORCHRUN:
        raise LaunchRefused(
            f"distributed.launcher: {launcher!r} is not a launcher this executor can start "
            f"({TORCHRUN}, or unset)"
        )
    torchrun = find_torchrun(workload_python, path)
    if torchrun is None:
        where = (
            f"neither next to the workload interpreter {workload_python} nor"
            if (workload_python)
            else "not"
        )
        raise LaunchRefused(f"{TORCHRUN} is {where} on the job's PATH ({path})")
    return torchrun_argv(torchrun, grant)


def under_torchrun(grant: Grant) -> bool:
    """The rank runs under torchrun (its exit code is torchrun's, not its worker's)."""
    dist = grant.job.distributed
    return grant.gang is not None and dist is not None and dist.launcher == TORCHRUN


# torchrun's summary of a failed run, printed on its stderr as it exits 1 (torch's
# ``_MSG_FORMAT_TEMPLATE`` / ``_FAILURE_FORMAT_TEMPLATE``, the same since torch 1.9):
#   Root Cause (first observed failure):
#   [0]:
#     ...
#     rank      : 3 (local_rank: 1)
#     exitcode  : 3 (pid: 1234)        or  -9 (pid: 1234) Signal 9 (SIGKILL) received by PID 1234
_ROOT_CAUSE = "Root Cause (first observed failure):"
_RANK = re.compile(r"^\s*rank\s*:\s*(\d{1,9}) \(local_rank: (\d{1,9})\)\s*$")
_EXITCODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d{1,9}) \(pid: \d{1,10}\)")


class RootCause:
    """Reads a torchrun rank's stderr lines as they go by and keeps the worker that failed first,
    from torchrun's closing summary. The lines are the job's own (it could print a summary of
    its own making): what is kept only ever adds to its own job's reason, bounded."""

    __slots__ = ("_in", "exit_code", "local_rank", "rank")

    def __init__(self) -> None:
        self._in = False
        self.rank: int | None = None
        self.local_rank: int | None = None
        self.exit_code: int | None = None

    def feed(self, line: str) -> None:
        if len(line) > 512:
            return
        if _ROOT_CAUSE in line:
            self._in, self.rank, self.local_rank, self.exit_code = True, None, None, None
            return
        if not self._in:
            return
        if m := _RANK.match(line):
            self.rank, self.local_rank = int(m[1]), int(m[2])
        elif m := _EXITCODE.match(line):
            self.exit_code = int(m[1])
        elif line.startswith("====="):
            self._in = False

    def summary(self) -> str | None:
        """``torchrun: its worker of global rank 3 (local 1) exited with code 3``, or None."""
        if self.rank is None or self.exit_code is None:
            return None
        worker = f"torchrun: its worker of global rank {self.rank} (local {self.local_rank})"
        if self.exit_code >= 0:
            return f"{worker} exited with code {self.exit_code}"
        try:
            name = signal.Signals(-self.exit_code).name
        except ValueError:
            name = f"signal {-self.exit_code}"
        return f"{worker} was killed by {name}"
