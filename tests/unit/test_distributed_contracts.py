"""Distributed jobs in the contracts (issue 14): validation per the support matrix, rank ids,
the rendezvous environment, the advertise address bound."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import msgspec
import pytest

from gpulayer_contracts import JobRequest, WorkerCapabilities, validate_capabilities, validate_job
from gpulayer_contracts.bounds import address_error, job_bound_errors
from gpulayer_contracts.capabilities import HostInfo
from gpulayer_contracts.events import GangRank
from gpulayer_contracts.jobs import rank_job_id
from gpulayer_contracts.matrix import support_level
from gpulayer_contracts.validation import RENDEZVOUS_ENV, protected_env_names, rank_env

GLOO = {"nodes": 2, "processes_per_node": 2, "backend": "gloo", "launcher": "torchrun"}


def job(**fields: Any) -> JobRequest:
    return msgspec.convert({"job_id": "j1", "command": ["python", "t.py"], **fields}, JobRequest)


def errors(**fields: Any) -> list[str]:
    return validate_job(job(**fields)).errors


def test_the_matrix_levels_of_distributed_jobs() -> None:
    assert support_level("cpu", "distributed") == "tested"
    assert support_level("cuda", "distributed") == "implemented"
    assert support_level("mps", "distributed") == "unsupported"
    assert support_level("rocm", "distributed") == "detection-only"


@pytest.mark.parametrize(
    "fields",
    [
        {"requirements": {"accelerator": "cpu"}, "distributed": GLOO},
        {"requirements": {"accelerator": "cpu"}, "distributed": {**GLOO, "processes_per_node": 64}},
        {
            "requirements": {"accelerator": "cuda", "gpu_count": 4},
            "distributed": {"nodes": 8, "processes_per_node": 4, "backend": "nccl"},
        },
        # One cuda device when none is counted: one process.
        {"requirements": {"accelerator": "cuda"}, "distributed": {"backend": "nccl"}},
        {"requirements": {"accelerator": "cpu"}, "distributed": {"nodes": 3}},  # no launcher
        # A one-node job may set up its own torch.distributed.
        {"env": {"MASTER_ADDR": "localhost", "MASTER_PORT": "12355", "RANK": "0"}},
    ],
)
def test_valid_distributed_jobs(fields: dict[str, Any]) -> None:
    assert errors(**fields) == []


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        (
            {"requirements": {"accelerator": "mps"}, "distributed": {"nodes": 1}},
            "$.distributed: mps jobs cannot be distributed",
        ),
        (
            {"requirements": {"accelerator": "rocm"}, "distributed": {"nodes": 2}},
            "$.distributed: distributed rocm jobs are detection-only in the support matrix",
        ),
        (
            {"requirements": {"accelerator": "cpu"}, "distributed": {"backend": "nccl"}},
            '$.distributed.backend: "nccl" runs on NVIDIA GPUs only',
        ),
        ({"distributed": {"backend": "nccl"}}, '$.distributed.backend: "nccl"'),
        (
            {
                "requirements": {"accelerator": "cuda", "gpu_count": 2},
                "distributed": {"processes_per_node": 4},
            },
            "$.distributed.processes_per_node: 4 processes on each node, but each node gets 2 "
            "cuda devices (requirements.gpu_count): one GPU per process",
        ),
        (
            {"requirements": {"accelerator": "cuda"}, "distributed": {"processes_per_node": 2}},
            "but each node gets 1 cuda device (",
        ),
        (
            {"distributed": {"launcher": "mpirun"}},
            "$.distributed.launcher: 'mpirun' is not a launcher the executor can start",
        ),
        ({"distributed": GLOO, "retries": 2}, "$.retries: a distributed job is not retried"),
        (
            {"distributed": GLOO, "kind": "service"},
            '$.kind: a distributed job cannot be a "service"',
        ),
        (
            {"distributed": GLOO, "env": {"MASTER_PORT": "1"}},
            "$.env.MASTER_PORT: set by gpulayer",
        ),
        ({"job_id": "train-rank1"}, "$.job_id: 'train-rank1' ends in -rank<digits>"),
        ({"job_id": "train-rank12", "distributed": GLOO}, "ends in -rank<digits>"),
    ],
)
def test_invalid_distributed_jobs(fields: dict[str, Any], expected: str) -> None:
    found = errors(**fields)
    assert any(expected in e for e in found), found


@pytest.mark.parametrize(
    "job_id", ["rank1", "train-rank", "train-rankA", "train-rank1-0", "x_rank1"]
)
def test_ids_that_only_look_like_ranks_are_fine(job_id: str) -> None:
    assert errors(job_id=job_id) == []


def test_rendezvous_names_are_protected_in_distributed_jobs_only() -> None:
    env = dict.fromkeys([*RENDEZVOUS_ENV, "OMP_NUM_THREADS"], "1")
    assert protected_env_names(env) == []
    assert protected_env_names(env, distributed=True) == sorted(RENDEZVOUS_ENV)


def test_a_distributed_job_id_leaves_room_for_its_rank_ids() -> None:
    # 2 nodes: the last rank id is <id>-rank1, 6 characters more.
    fits = "a" * (128 - len("-rank1"))
    assert job_bound_errors(job(job_id=fits, distributed=GLOO)) == []
    assert len(rank_job_id(fits, 1)) == 128
    too_long = fits + "a"
    found = job_bound_errors(job(job_id=too_long, distributed=GLOO))
    assert found == [
        "$.job_id: a distributed job's id may have at most 122 characters for 2 nodes "
        "(its ranks are <job_id>-rank<R>)"
    ]
    # 4096 nodes: -rank4095, four digits.
    found = job_bound_errors(job(job_id="a" * 120, distributed={"nodes": 4096}))
    assert found == [
        "$.job_id: a distributed job's id may have at most 119 characters for 4096 nodes "
        "(its ranks are <job_id>-rank<R>)"
    ]
    assert job_bound_errors(job(job_id="a" * 119, distributed={"nodes": 4096})) == []
    # Without distributed, the whole 128 are the job's.
    assert job_bound_errors(job(job_id="a" * 128)) == []


def test_an_array_of_distributed_jobs_counts_the_array_suffix_too() -> None:
    base = "a" * (128 - len("-9-rank1"))
    assert job_bound_errors(job(job_id=base, distributed=GLOO, array={"count": 10})) == []
    found = job_bound_errors(job(job_id=base + "a", distributed=GLOO, array={"count": 10}))
    assert found == [
        "$.job_id: a distributed job's id may have at most 120 characters for 2 nodes in an "
        "array of 10 (its ranks are <job_id>-<i>-rank<R>)"
    ]


def test_rank_env_with_and_without_a_launcher() -> None:
    gang = GangRank(
        job_id="train",
        rank=1,
        nnodes=2,
        nproc_per_node=2,
        master_addr="10.0.0.5",
        master_port=29501,
    )
    expected = {
        "MASTER_ADDR": "10.0.0.5",
        "MASTER_PORT": "29501",
        "WORLD_SIZE": "4",
        "NODE_RANK": "1",
        "NNODES": "2",
        "NPROC_PER_NODE": "2",
        "GPULAYER_JOB_ID": "train",
    }
    assert rank_env(gang, "torchrun") == expected
    # Two processes per node without a launcher: the command starts them, it sets RANK itself.
    assert rank_env(gang, None) == expected
    one = msgspec.structs.replace(gang, nproc_per_node=1)
    assert rank_env(one, None) == {
        **expected,
        "WORLD_SIZE": "2",
        "NPROC_PER_NODE": "1",
        "RANK": "1",
        "LOCAL_RANK": "0",
    }
    # torchrun sets RANK and LOCAL_RANK per worker.
    assert "RANK" not in rank_env(one, "torchrun")


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        ("10.0.0.5", True),
        ("127.0.0.1", True),
        ("fd00::5", True),
        ("node-a.cluster.local", True),
        ("node_a", True),
        ("-x", False),
        ("--master-port", False),
        ("a..b", False),
        ("", False),
        ("host name", False),
        ("host\x00", False),
        ("a" * 64, False),  # a label of 64
        (".".join(["a" * 63] * 5), False),  # 319 bytes
    ],
)
def test_advertise_address_bound(value: str, ok: bool) -> None:
    assert (address_error(value) is None) is ok
    caps = WorkerCapabilities(
        node_id="n1",
        agent_version="1",
        detected_at=datetime(2026, 11, 30, tzinfo=UTC),
        host=HostInfo(advertise_address=value),
    )
    found = validate_capabilities(caps)
    if ok:
        assert found == []
    else:
        assert found == [address_error(value)]
        assert found[0].startswith("$.host.advertise_address: ")


def test_gpulayer_matrix_shows_the_distributed_levels(capsys: pytest.CaptureFixture[str]) -> None:
    from gpulayer_cli.main import main

    assert main(["matrix", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert {acc: modes["distributed"] for acc, modes in shown.items()} == {
        "cpu": "tested",
        "cuda": "implemented",
        "mps": "unsupported",
        "rocm": "detection-only",
    }
    assert main(["matrix"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["│", "cpu", "│", "tested", "│", "tested", "│"] in rows
    assert ["│", "cuda", "│", "hardware-validated", "│", "implemented", "│"] in rows
    assert ["│", "mps", "│", "implemented", "│", "unsupported", "│"] in rows
