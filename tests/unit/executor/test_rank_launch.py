"""A rank of a distributed job on the executor (pure): its environment and its argv."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from gpulayer_contracts.events import GangRank, Grant
from gpulayer_contracts.jobenv import EnvRefused, grant_environment
from gpulayer_contracts.jobs import Distributed, JobRequest, rank_job_id
from gpulayer_executor.container import container_env
from gpulayer_executor.gang import (
    LaunchRefused,
    find_torchrun,
    job_argv,
    torchrun_argv,
)

BASE = {"PATH": "/usr/bin:/bin", "HOME": "/home/u", "USER": "u", "LOGNAME": "u"}
COMMAND = ["python", "train.py", "--lr", "0.1"]


def rank_grant(
    rank: int = 1,
    *,
    launcher: str | None = "torchrun",
    nproc: int = 2,
    env: dict[str, str] | None = None,
) -> Grant:
    dist = Distributed(nodes=2, processes_per_node=nproc, backend="gloo", launcher=launcher)
    job = JobRequest(
        job_id=rank_job_id("train", rank), command=COMMAND, env=env or {}, distributed=dist
    )
    gang = GangRank(
        job_id="train",
        rank=rank,
        nnodes=2,
        nproc_per_node=nproc,
        master_addr="10.0.0.5",
        master_port=29500,
    )
    return Grant(grant_id=f"g{rank}", job=job, node_id="n", accelerator="cpu", gang=gang)


def test_a_rank_gets_the_rendezvous_and_the_distributed_job_id() -> None:
    env = grant_environment(rank_grant(), BASE)
    assert {k: env[k] for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "NODE_RANK")} == {
        "MASTER_ADDR": "10.0.0.5",
        "MASTER_PORT": "29500",
        "WORLD_SIZE": "4",
        "NODE_RANK": "1",
    }
    assert (env["NNODES"], env["NPROC_PER_NODE"]) == ("2", "2")
    assert env["GPULAYER_JOB_ID"] == "train"  # not train-rank1
    assert env["GPULAYER_GRANT_ID"] == "g1"
    assert "RANK" not in env
    assert "LOCAL_RANK" not in env


def test_without_a_launcher_one_process_per_node_is_its_rank() -> None:
    env = grant_environment(rank_grant(launcher=None, nproc=1), BASE)
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == ("1", "0", "2")


def test_a_grant_without_gang_gets_no_rendezvous() -> None:
    grant = Grant(
        grant_id="g",
        job=JobRequest(job_id="j", command=["true"], env={"MASTER_ADDR": "localhost"}),
        node_id="n",
        accelerator="cpu",
    )
    env = grant_environment(grant, BASE)
    assert env["MASTER_ADDR"] == "localhost"  # the job's own: it is no distributed job
    assert "WORLD_SIZE" not in env
    assert "NODE_RANK" not in env


def test_a_rank_may_not_set_the_rendezvous_itself() -> None:
    with pytest.raises(EnvRefused, match="WORLD_SIZE is set by gpulayer"):
        grant_environment(rank_grant(env={"WORLD_SIZE": "8"}), BASE)


def test_torchrun_argv_is_the_static_rendezvous() -> None:
    assert torchrun_argv("/venv/bin/torchrun", rank_grant()) == [
        "/venv/bin/torchrun",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--node-rank",
        "1",
        "--master-addr",
        "10.0.0.5",
        "--master-port",
        "29500",
        "--no-python",
        "--",
        *COMMAND,
    ]


def _executable(folder: Path, name: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("#!/bin/sh\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_torchrun_next_to_the_workload_interpreter_first(tmp_path: Path) -> None:
    venv = _executable(tmp_path / "venv/bin", "torchrun")
    on_path = _executable(tmp_path / "usr/bin", "torchrun")
    python = str(tmp_path / "venv/bin/python")
    path = str(on_path.parent)
    assert find_torchrun(python, path) == str(venv)
    assert job_argv(rank_grant(), workload_python=python, path=path)[0] == str(venv)
    venv.unlink()
    assert find_torchrun(python, path) == str(on_path)
    assert find_torchrun(None, path) == str(on_path)


def test_no_torchrun_fails_naming_where_it_looked(tmp_path: Path) -> None:
    python = str(tmp_path / "venv/bin/python")
    with pytest.raises(LaunchRefused) as err:
        job_argv(rank_grant(), workload_python=python, path=str(tmp_path / "none"))
    assert str(err.value) == (
        f"torchrun is neither next to the workload interpreter {python} nor on the job's "
        f"PATH ({tmp_path / 'none'})"
    )
    with pytest.raises(LaunchRefused, match=r"^torchrun is not on the job's PATH \(/nowhere\)$"):
        job_argv(rank_grant(), workload_python=None, path="/nowhere")


def test_the_command_itself_without_a_launcher_or_a_gang() -> None:
    assert job_argv(rank_grant(launcher=None), workload_python=None, path="/nowhere") == COMMAND
    plain = Grant(
        grant_id="g", job=JobRequest(job_id="j", command=COMMAND), node_id="n", accelerator="cpu"
    )
    assert job_argv(plain, workload_python=None, path="/nowhere") == COMMAND


def test_a_launcher_the_executor_cannot_start_is_refused() -> None:
    with pytest.raises(LaunchRefused, match="'mpirun' is not a launcher"):
        job_argv(rank_grant(launcher="mpirun"), workload_python=None, path=os.defpath)


def test_a_rank_in_a_container_runs_the_images_torchrun_with_the_same_rendezvous(
    tmp_path: Path,
) -> None:
    # torchrun is the image's (its PATH), never looked up on the host; the rank's environment is
    # the same as a bare rank's, and goes into the container whole (less the host's PATH).
    grant = rank_grant()
    argv = job_argv(grant, workload_python=None, path=str(tmp_path), in_container=True)
    assert argv == torchrun_argv("torchrun", grant)
    env = grant_environment(grant, BASE)
    inside = container_env(env, grant.job.env, tmp_path)
    rendezvous = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "NODE_RANK", "GPULAYER_JOB_ID")
    assert {k: inside[k] for k in rendezvous} == {k: env[k] for k in rendezvous}
    assert "PATH" not in inside
