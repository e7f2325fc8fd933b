"""What placement can't do with a distributed job, refused at submit (issue 14, placement
side): retries, services, and ids too long for their ranks' ids."""

from __future__ import annotations

from typing import Any

import msgspec

from gpulayer_contracts.jobs import Distributed, JobRequest, rank_job_id
from gpulayer_contracts.validation import validate_job


def job(job_id: str = "d", **fields: Any) -> JobRequest:
    body = {
        "job_id": job_id,
        "command": ["python", "train.py"],
        "distributed": {"nodes": 2, "backend": "gloo"},
        **fields,
    }
    return msgspec.convert(body, JobRequest)


def test_a_plain_distributed_job_is_valid() -> None:
    assert validate_job(job()).errors == []


def test_retries_and_services_are_refused_naming_the_field() -> None:
    assert any(
        e.startswith("$.retries: a distributed job") for e in validate_job(job(retries=2)).errors
    )
    errors = validate_job(job(kind="service")).errors
    assert any(e.startswith('$.kind: a distributed job cannot be a "service"') for e in errors)


def test_an_id_leaves_room_for_its_ranks() -> None:
    fits = "x" * (128 - len("-rank1"))
    assert len(rank_job_id(fits, 1)) == 128
    assert validate_job(job(fits)).errors == []
    errors = validate_job(job(fits + "y")).errors
    assert errors == [
        "$.job_id: a distributed job's id may have at most 122 characters for 2 nodes "
        "(its ranks are <job_id>-rank<R>)"
    ]


def test_a_preemptible_distributed_job_is_accepted_with_a_warning_that_it_is_never_preempted() -> (
    None
):
    job = JobRequest(
        job_id="g",
        command=["true"],
        preemptible=True,
        distributed=Distributed(nodes=2),
    )
    v = validate_job(job)
    assert v.ok, v.errors
    assert any(
        w.startswith("$.preemptible: a distributed job is never preempted") for w in v.warnings
    )
    plain = validate_job(msgspec.structs.replace(job, distributed=None))
    assert not any(w.startswith("$.preemptible") for w in plain.warnings)
