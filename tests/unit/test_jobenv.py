"""``gpulayer_contracts.jobenv``: a job's environment, the one copy of the rules that the
executor applies to every grant and ``gpulayer conform`` to the job it runs (pure)."""

from __future__ import annotations

import msgspec
import pytest

from gpulayer_contracts import JobRequest, Sandbox, SandboxDevices
from gpulayer_contracts.events import GangRank, Grant
from gpulayer_contracts.jobenv import (
    EnvRefused,
    base_environment,
    grant_device_env,
    grant_environment,
    job_env_error,
    job_environment,
)
from gpulayer_contracts.jobs import ArraySpec, Distributed, rank_job_id

COMPUTE = Sandbox(devices=SandboxDevices(gpu="compute"))
SOURCE = {"PATH": "/opt/bin:/usr/bin", "LANG": "de_DE.UTF-8", "NATS_TOKEN": "secret", "TZ": "UTC"}

BASE = {"PATH": "/usr/bin:/bin", "HOME": "/home/u", "USER": "u", "LOGNAME": "u", "LANG": "C.UTF-8"}


def grant(
    accelerator: str = "cpu",
    devices: list[int] | None = None,
    sandbox: Sandbox | None = None,
    env: dict[str, str] | None = None,
    visible_env: dict[str, str] | None = None,
) -> Grant:
    return Grant(
        grant_id="g1",
        job=JobRequest(job_id="j1", command=["true"], env=env or {}, sandbox=sandbox or Sandbox()),
        node_id="n",
        accelerator=accelerator,  # type: ignore[arg-type]
        devices=devices or [],
        visible_env=visible_env or {},
    )


def test_base_environment_keeps_only_chosen_variables() -> None:
    source = {
        "PATH": "/opt/bin:/usr/bin",
        "LANG": "de_DE.UTF-8",
        "TZ": "UTC",
        "HOME": "/root",
        "GPULAYER_NATS_URL": "nats://secret",
        "AWS_SECRET_ACCESS_KEY": "x",
        "LD_PRELOAD": "/evil.so",
        "CUDA_VISIBLE_DEVICES": "0,1,2,3",
    }
    env = base_environment(source, user="job", home="/home/job")
    assert env == {
        "PATH": "/opt/bin:/usr/bin",
        "LANG": "de_DE.UTF-8",
        "TZ": "UTC",
        "HOME": "/home/job",
        "USER": "job",
        "LOGNAME": "job",
    }


def test_base_environment_defaults_path_and_lang() -> None:
    env = base_environment({}, user="u", home="/h")
    assert env["PATH"].startswith("/usr/local/sbin")
    assert env["LANG"] == "C.UTF-8"


def test_cpu_job_gets_empty_cuda_visible_devices() -> None:
    env = grant_environment(grant(), BASE)
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    assert env["GPULAYER_DEVICES"] == ""
    assert env["GPULAYER_JOB_ID"] == "j1"
    assert env["GPULAYER_GRANT_ID"] == "g1"
    assert "CUDA_DEVICE_ORDER" not in env


def test_cuda_job_with_sandbox_gets_exactly_its_devices() -> None:
    env = grant_device_env(grant("cuda", [2, 5], COMPUTE))
    assert env == {
        "CUDA_VISIBLE_DEVICES": "2,5",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "GPULAYER_DEVICES": "2,5",
    }


def test_without_sandbox_grant_nothing_is_visible_whatever_the_payload_says() -> None:
    g = grant("cuda", [2, 5], visible_env={"CUDA_VISIBLE_DEVICES": "2,5"})
    env = grant_environment(g, BASE)
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    assert env["GPULAYER_DEVICES"] == ""


def test_rocm_job_gets_rocr_and_hip_variables() -> None:
    env = grant_device_env(grant("rocm", [0, 1], COMPUTE))
    assert env["ROCR_VISIBLE_DEVICES"] == env["HIP_VISIBLE_DEVICES"] == "0,1"
    assert env["CUDA_VISIBLE_DEVICES"] == ""


def test_job_env_is_applied_over_the_base() -> None:
    env = grant_environment(grant(env={"PATH": "/job/bin", "X": "1"}), BASE)
    assert env["PATH"] == "/job/bin"
    assert env["X"] == "1"


@pytest.mark.parametrize(
    "name",
    [
        "CUDA_VISIBLE_DEVICES",
        "LD_PRELOAD",
        "LD_LIBRARY_PATH",
        "HIP_VISIBLE_DEVICES",
        "GPULAYER_JOB_ID",
    ],
)
def test_protected_variables_are_refused_by_name(name: str) -> None:
    with pytest.raises(EnvRefused) as info:
        grant_environment(grant(env={name: "x"}), BASE)
    assert str(info.value) == f"env: {name} is set by gpulayer, a job may not set it"


def test_several_protected_variables_are_all_named() -> None:
    with pytest.raises(EnvRefused, match="LD_AUDIT, LD_PRELOAD are set by gpulayer"):
        grant_environment(grant(env={"LD_PRELOAD": "a", "LD_AUDIT": "b", "OK": "c"}), BASE)


@pytest.mark.parametrize(
    ("env", "match"), [({"A=B": "1"}, "valid variable name"), ({"A": "x\0y"}, "NUL")]
)
def test_unusable_variables_are_refused(env: dict[str, str], match: str) -> None:
    with pytest.raises(EnvRefused, match=match):
        grant_environment(grant(env=env), BASE)


def test_mig_instances_are_visible_by_uuid_and_only_them() -> None:
    g = msgspec.structs.replace(grant("cuda", [0], COMPUTE), instance_uuids=["MIG-a", "MIG-b"])
    env = grant_environment(g, BASE)
    assert env["CUDA_VISIBLE_DEVICES"] == "MIG-a,MIG-b"
    plain = grant_environment(grant("cuda", [0], COMPUTE), BASE)
    assert plain["CUDA_VISIBLE_DEVICES"] == "0"


# A grant is the job plus what placement chose for it: conform, which has no grant, names the
# same parts itself and must get the same environment (every field of the grant carried over).
@pytest.mark.parametrize(
    ("accelerator", "devices", "sandbox", "env", "instances", "array"),
    [
        ("cpu", [], Sandbox(), {}, [], None),
        ("cuda", [0, 3], COMPUTE, {"SEED": "1"}, [], None),
        ("cuda", [1], Sandbox(), {"PATH": "/job/bin"}, [], None),  # no sandbox grant
        ("cuda", [2], COMPUTE, {}, ["MIG-x"], None),
        ("rocm", [0], COMPUTE, {}, [], ArraySpec(count=4, index=2)),
        ("mps", [0], COMPUTE, {"HOME": "/elsewhere"}, [], None),
    ],
)
def test_a_grant_and_its_parts_give_the_same_environment(
    accelerator: str,
    devices: list[int],
    sandbox: Sandbox,
    env: dict[str, str],
    instances: list[str],
    array: ArraySpec | None,
) -> None:
    job = JobRequest(job_id="j1", command=["true"], env=env, sandbox=sandbox, array=array)
    g = Grant(
        grant_id="g1",
        job=job,
        node_id="n",
        accelerator=accelerator,  # type: ignore[arg-type]
        devices=devices,
        instance_uuids=instances,
    )
    base = base_environment(SOURCE, user="u", home="/home/u")
    from_parts = job_environment(
        job,
        accelerator=accelerator,  # type: ignore[arg-type]
        devices=devices,
        grant_id="g1",
        base=base,
        instance_uuids=instances,
    )
    assert from_parts == grant_environment(g, base)
    assert "NATS_TOKEN" not in from_parts
    assert ("GPULAYER_ARRAY_INDEX" in from_parts) is (array is not None)


@pytest.mark.parametrize(("launcher", "nproc"), [("torchrun", 2), (None, 1), (None, 2)])
def test_a_rank_gets_its_rendezvous(launcher: str | None, nproc: int) -> None:
    dist = Distributed(nodes=2, processes_per_node=nproc, backend="gloo", launcher=launcher)
    job = JobRequest(job_id=rank_job_id("d", 1), command=["true"], distributed=dist)
    gang = GangRank(
        job_id="d", rank=1, nnodes=2, nproc_per_node=nproc, master_addr="h", master_port=29500
    )
    g = Grant(grant_id="g1", job=job, node_id="n", accelerator="cpu", gang=gang)
    base = base_environment(SOURCE, user="u", home="/home/u")
    env = grant_environment(g, base)
    assert env == job_environment(
        job, accelerator="cpu", devices=[], grant_id="g1", base=base, gang=gang
    )
    assert env["GPULAYER_JOB_ID"] == "d"
    assert env["MASTER_ADDR"] == "h"
    assert ("RANK" in env) is (launcher is None and nproc == 1)


@pytest.mark.parametrize(
    "env",
    [
        {"CUDA_VISIBLE_DEVICES": "0"},
        {"LD_PRELOAD": "x", "GPULAYER_X": "1"},
        {"A=B": "1"},
        {"A": "\0"},
    ],
)
def test_the_refusal_is_job_env_errors_reason(env: dict[str, str]) -> None:
    with pytest.raises(EnvRefused) as refused:
        grant_environment(grant(env=env), BASE)
    assert job_env_error(env) == str(refused.value)


@pytest.mark.parametrize("env", [{"MASTER_ADDR": "x"}, {"RANK": "0", "NNODES": "2"}])
def test_a_distributed_job_may_not_set_the_rendezvous(env: dict[str, str]) -> None:
    assert job_env_error(env) is None  # a one-node job may set them
    dist = Distributed(nodes=2, processes_per_node=1, backend="gloo")
    job = JobRequest(job_id="d", command=["true"], env=env, distributed=dist)
    with pytest.raises(EnvRefused) as refused:
        job_environment(job, accelerator="cpu", devices=[], grant_id="g1", base=BASE)
    assert job_env_error(env, distributed=True) == str(refused.value)
