"""Owner-scoped subjects: where a job's events, logs and submits go, and who an API request is
from. Each identity token is one NATS subject token, or refused."""

from __future__ import annotations

import pytest

from gpulayer_contracts.subjects import (
    API_CANCEL,
    JOB_WILDCARD_EVENTS,
    api_caller,
    api_subject,
    job_events,
    job_from_subject,
    job_logs,
    jobs_submit,
    owner_from_submit,
    valid_owner,
)


def test_submit_subject_names_its_owner() -> None:
    assert jobs_submit("alice") == "gpulayer.jobs.submit.alice"
    assert jobs_submit() == "gpulayer.jobs.submit"
    assert owner_from_submit("gpulayer.jobs.submit.alice") == "alice"
    assert owner_from_submit("gpulayer.jobs.submit") == "anonymous"
    for bad in ("gpulayer.jobs.other", "gpulayer.jobs.submit.", "x.jobs.submit.alice"):
        with pytest.raises(ValueError, match="not a submit subject"):
            owner_from_submit(bad)


def test_job_subjects_are_under_the_owner() -> None:
    assert job_events("j1", "alice") == "gpulayer.job.alice.j1.events"
    assert job_logs("j1") == "gpulayer.job.anonymous.j1.logs"
    assert job_from_subject(job_events("j1", "alice")) == "j1"
    assert JOB_WILDCARD_EVENTS == "gpulayer.job.*.*.events"


@pytest.mark.parametrize("bad", ["", "a.b", "*", ">", "a b", "x\n"])
def test_an_owner_that_is_not_one_token_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="owner"):
        job_events("j1", bad)
    with pytest.raises(ValueError, match="owner"):
        jobs_submit(bad)
    # A grant carrying one still gets its reports out, where no user reads.
    assert valid_owner(bad) == "anonymous"


def test_api_subject_names_the_caller() -> None:
    assert api_subject(API_CANCEL, "bob") == "gpulayer.api.cancel.bob"
    assert api_subject(API_CANCEL) == "gpulayer.api.cancel"
    assert api_caller("gpulayer.api.cancel.bob") == "bob"
    assert api_caller("gpulayer.api.cancel") == "anonymous"
    with pytest.raises(ValueError, match="not an API subject"):
        api_caller("gpulayer.api.cancel.bob.extra")
