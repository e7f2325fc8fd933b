"""``gpulayer_contracts.jobenv`` (what ``gpulayer conform`` runs a job with) builds the same
environment as the executor's own ``gpulayer_executor.env`` for the same job and grant."""

from __future__ import annotations

import pytest

from gpulayer_contracts import Grant, JobRequest, Sandbox, SandboxDevices
from gpulayer_contracts.events import GangRank
from gpulayer_contracts.jobenv import base_environment, job_env_error, job_environment
from gpulayer_contracts.jobs import Distributed, rank_job_id
from gpulayer_executor import env as executor_env

SOURCE = {"PATH": "/opt/bin:/usr/bin", "LANG": "de_DE.UTF-8", "NATS_TOKEN": "secret", "TZ": "UTC"}
COMPUTE = Sandbox(devices=SandboxDevices(gpu="compute"))


@pytest.mark.parametrize(
    ("accelerator", "devices", "sandbox", "env"),
    [
        ("cpu", [], Sandbox(), {}),
        ("cuda", [0, 3], COMPUTE, {"SEED": "1"}),
        ("cuda", [1], Sandbox(), {"PATH": "/job/bin"}),  # no sandbox grant: nothing visible
        ("rocm", [0], COMPUTE, {}),
        ("mps", [0], COMPUTE, {"HOME": "/elsewhere"}),
    ],
)
def test_same_environment_as_the_executor(
    accelerator: str, devices: list[int], sandbox: Sandbox, env: dict[str, str]
) -> None:
    job = JobRequest(job_id="j1", command=["true"], env=env, sandbox=sandbox)
    grant = Grant(
        grant_id="g1",
        job=job,
        node_id="n",
        accelerator=accelerator,  # type: ignore[arg-type]
        devices=devices,
    )
    theirs = executor_env.job_environment(
        grant, executor_env.base_environment(SOURCE, user="u", home="/home/u")
    )
    ours = job_environment(
        job,
        accelerator=accelerator,  # type: ignore[arg-type]
        devices=devices,
        grant_id="g1",
        base=base_environment(SOURCE, user="u", home="/home/u"),
    )
    assert ours == theirs
    assert "NATS_TOKEN" not in ours


@pytest.mark.parametrize(
    "env",
    [
        {"CUDA_VISIBLE_DEVICES": "0"},
        {"LD_PRELOAD": "x", "GPULAYER_X": "1"},
        {"A=B": "1"},
        {"A": "\0"},
    ],
)
def test_same_refusals_as_the_executor(env: dict[str, str]) -> None:
    with pytest.raises(executor_env.EnvRefused) as theirs:
        executor_env.check_job_env(env)
    assert job_env_error(env) == str(theirs.value)


@pytest.mark.parametrize(("launcher", "nproc"), [("torchrun", 2), (None, 1), (None, 2)])
def test_same_environment_for_a_rank(launcher: str | None, nproc: int) -> None:
    dist = Distributed(nodes=2, processes_per_node=nproc, backend="gloo", launcher=launcher)
    job = JobRequest(job_id=rank_job_id("d", 1), command=["true"], distributed=dist)
    gang = GangRank(
        job_id="d", rank=1, nnodes=2, nproc_per_node=nproc, master_addr="h", master_port=29500
    )
    grant = Grant(grant_id="g1", job=job, node_id="n", accelerator="cpu", gang=gang)
    base = base_environment(SOURCE, user="u", home="/home/u")
    theirs = executor_env.job_environment(grant, base)
    ours = job_environment(job, accelerator="cpu", devices=[], grant_id="g1", base=base, gang=gang)
    assert ours == theirs
    assert ours["GPULAYER_JOB_ID"] == "d"
    assert ("RANK" in ours) is (launcher is None and nproc == 1)


@pytest.mark.parametrize("env", [{"MASTER_ADDR": "x"}, {"RANK": "0", "NNODES": "2"}])
def test_same_refusals_for_a_distributed_job(env: dict[str, str]) -> None:
    assert job_env_error(env) is None  # a one-node job may set them
    with pytest.raises(executor_env.EnvRefused) as theirs:
        executor_env.check_job_env(env, distributed=True)
    assert job_env_error(env, distributed=True) == str(theirs.value)
