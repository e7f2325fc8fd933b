"""Building a job's environment (pure)."""

from __future__ import annotations

import pytest

from gpulayer_contracts.events import Grant
from gpulayer_contracts.jobs import JobRequest, Sandbox, SandboxDevices
from gpulayer_executor.env import (
    EnvRefused,
    base_environment,
    check_job_env,
    device_env,
    job_environment,
)

COMPUTE = Sandbox(devices=SandboxDevices(gpu="compute"))
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
    env = job_environment(grant(), BASE)
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    assert env["GPULAYER_DEVICES"] == ""
    assert env["GPULAYER_JOB_ID"] == "j1"
    assert env["GPULAYER_GRANT_ID"] == "g1"
    assert "CUDA_DEVICE_ORDER" not in env


def test_cuda_job_with_sandbox_gets_exactly_its_devices() -> None:
    env = device_env(grant("cuda", [2, 5], COMPUTE))
    assert env == {
        "CUDA_VISIBLE_DEVICES": "2,5",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "GPULAYER_DEVICES": "2,5",
    }


def test_without_sandbox_grant_nothing_is_visible_whatever_the_payload_says() -> None:
    g = grant("cuda", [2, 5], visible_env={"CUDA_VISIBLE_DEVICES": "2,5"})
    env = job_environment(g, BASE)
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    assert env["GPULAYER_DEVICES"] == ""


def test_rocm_job_gets_rocr_and_hip_variables() -> None:
    env = device_env(grant("rocm", [0, 1], COMPUTE))
    assert env["ROCR_VISIBLE_DEVICES"] == env["HIP_VISIBLE_DEVICES"] == "0,1"
    assert env["CUDA_VISIBLE_DEVICES"] == ""


def test_job_env_is_applied_over_the_base() -> None:
    env = job_environment(grant(env={"PATH": "/job/bin", "X": "1"}), BASE)
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
        job_environment(grant(env={name: "x"}), BASE)
    assert str(info.value) == f"env: {name} is set by gpulayer, a job may not set it"


def test_several_protected_variables_are_all_named() -> None:
    with pytest.raises(EnvRefused, match="LD_AUDIT, LD_PRELOAD are set by gpulayer"):
        check_job_env({"LD_PRELOAD": "a", "LD_AUDIT": "b", "OK": "c"})


@pytest.mark.parametrize(
    ("env", "match"), [({"A=B": "1"}, "valid variable name"), ({"A": "x\0y"}, "NUL")]
)
def test_unusable_variables_are_refused(env: dict[str, str], match: str) -> None:
    with pytest.raises(EnvRefused, match=match):
        check_job_env(env)
