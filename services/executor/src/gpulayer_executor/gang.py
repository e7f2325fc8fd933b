"""How a rank of a distributed job is started: its argv. Pure but for looking up torchrun.

Without a launcher the job's command runs once on the node, its rendezvous in the environment
(``contracts.jobenv``). With ``launcher = "torchrun"`` the command runs under torchrun with
a **static** rendezvous: placement already knows every rank, which node is rank 0 and the port
reserved there, so each node is told its ``--node-rank`` and rank 0's address outright; c10d's
dynamic rendezvous (nodes joining, ranks assigned on arrival, elastic sizes) would buy nothing
here and add a rendezvous store to wait on. ``--no-python``: the command is an argv as always
(``python train.py``, a binary), never a script torchrun would hand to its own interpreter.
"""

from __future__ import annotations

import os
import shutil

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


def job_argv(
    grant: Grant, *, workload_python: str | None, path: str, in_container: bool = False
) -> list[str]:
    """What the executor starts for ``grant``: its command, or for a rank of a distributed job
    with ``launcher = "torchrun"``, torchrun around it (``in_container``: the image's own,
    found on the image's PATH). Raises LaunchRefused."""
    dist = grant.job.distributed
    launcher = dist.launcher if dist is not None else None
    if grant.gang is None or launcher is None:
        return list(grant.job.command)
    if launcher != TORCHRUN:
        raise LaunchRefused(
            f"distributed.launcher: {launcher!r} is not a launcher this executor can start "
            f"({TORCHRUN}, or unset)"
        )
    if in_container:
        return torchrun_argv(TORCHRUN, grant)
    torchrun = find_torchrun(workload_python, path)
    if torchrun is None:
        where = (
            f"neither next to the workload interpreter {workload_python} nor"
            if (workload_python)
            else "not"
        )
        raise LaunchRefused(f"{TORCHRUN} is {where} on the job's PATH ({path})")
    return torchrun_argv(torchrun, grant)
