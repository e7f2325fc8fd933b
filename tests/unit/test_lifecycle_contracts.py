"""Lifecycle fields of a job (issue 15, part B): retries, services, arrays, dependencies. Their
defaults keep old messages decoding, their bounds are named with the limit, the fast bounds
check agrees with the detailed one, and the rules between them are validated at submit."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gpulayer_contracts import bounds as b
from gpulayer_contracts.bounds import jobs as bounds_jobs
from gpulayer_contracts.codec import decode_job_json, decode_job_toml, event_decoder
from gpulayer_contracts.events import Grant, Requeued
from gpulayer_contracts.jobenv import grant_environment
from gpulayer_contracts.jobs import ArraySpec, JobRequest, Restart
from gpulayer_contracts.validation import protected_env_names, validate_job


def make_job(**fields: Any) -> JobRequest:
    base: dict[str, Any] = {"job_id": "j1", "command": ["true"]}
    base.update(fields)
    return JobRequest(**base)


def test_an_old_job_decodes_with_the_lifecycle_defaults() -> None:
    job = decode_job_json(b'{"job_id": "old-1", "command": ["true"]}')
    assert (job.retries, job.retry_on_failure, job.kind) == (0, False, "job")
    assert (job.restart, job.array, job.after) == (None, None, [])


def test_a_service_job_file_decodes() -> None:
    job = decode_job_toml(
        'job_id = "svc"\ncommand = ["serve"]\nkind = "service"\n'
        '[restart]\npolicy = "on-failure"\nbackoff_s = 2\nmax_backoff_s = 60\n'
    )
    assert job.kind == "service"
    assert job.restart == Restart(policy="on-failure", backoff_s=2, max_backoff_s=60)
    assert validate_job(job).errors == []


def test_an_unknown_kind_or_policy_is_refused_by_the_decoder() -> None:
    with pytest.raises(Exception, match="kind"):
        decode_job_json(b'{"job_id": "x", "command": ["t"], "kind": "daemon"}')
    with pytest.raises(Exception, match="policy"):
        decode_job_json(
            b'{"job_id": "x", "command": ["t"], "kind": "service", "restart": {"policy": "never"}}'
        )
    with pytest.raises(Exception, match="after"):
        decode_job_json(b'{"job_id": "x", "command": ["t"], "after": ["a.b"]}')


@pytest.mark.parametrize(
    ("outside", "expected", "inside"),
    [
        pytest.param(
            make_job(retries=b.MAX_RETRIES + 1),
            "$.retries: 101 is out of range (0 <= x <= 100)",
            make_job(retries=b.MAX_RETRIES),
            id="retries",
        ),
        pytest.param(
            make_job(kind="service", restart=Restart(backoff_s=1, max_backoff_s=1e308)),
            "$.restart.max_backoff_s: 1e+308 is out of range (0 <= x <= 86400)",
            make_job(kind="service", restart=Restart(backoff_s=1, max_backoff_s=b.MAX_BACKOFF_S)),
            id="max backoff",
        ),
        pytest.param(
            make_job(kind="service", restart=Restart(backoff_s=float("nan"))),
            "$.restart.backoff_s: nan is out of range",
            make_job(kind="service", restart=Restart(backoff_s=0)),
            id="backoff NaN",
        ),
        pytest.param(
            make_job(array=ArraySpec(count=b.MAX_ARRAY_COUNT + 1)),
            "$.array.count: 10001 is out of range (1 <= x <= 10000)",
            make_job(array=ArraySpec(count=b.MAX_ARRAY_COUNT)),
            id="array count",
        ),
        pytest.param(
            make_job(job_id="a" * 124, array=ArraySpec(count=1001)),
            "$.array.count: the array's last job id 'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa... is "
            "129 characters, over the job id's 128",
            make_job(job_id="a" * 124, array=ArraySpec(count=1000)),
            id="array ids past the id length",
        ),
        pytest.param(
            make_job(after=[f"d{i}" for i in range(b.MAX_AFTER + 1)]),
            "$.after: 1025 entries, over the limit of 1024",
            make_job(after=[f"d{i}" for i in range(b.MAX_AFTER)]),
            id="after count",
        ),
        pytest.param(
            make_job(after=["ok", "no\x00"]),
            "$.after[1]: 'no\\x00' is not a job id",
            make_job(after=["ok", "no"]),
            id="after id built in Python",
        ),
    ],
)
def test_lifecycle_bound_is_named_and_just_inside_passes(
    outside: JobRequest, expected: str, inside: JobRequest
) -> None:
    errors = validate_job(outside).errors
    assert any(e.startswith(expected) for e in errors), errors
    assert validate_job(inside).errors == []


def test_an_array_too_large_in_bytes_is_named() -> None:
    assert b.array_size_error(10, 1000) is None
    error = b.array_size_error(10000, 10_000)
    assert error == (
        "$.array.count: 10000 jobs of 10000 bytes are 100000000 bytes together, over the limit "
        "of 67108864 bytes for one array"
    )


@pytest.mark.parametrize(
    ("job", "expected"),
    [
        (
            make_job(restart=Restart()),
            '$.restart: only a service restarts (set kind = "service")',
        ),
        (
            make_job(kind="service", retries=2),
            "$.retries: a service is restarted by its restart policy, not retried",
        ),
        (make_job(retry_on_failure=True), "$.retry_on_failure: set retries too"),
        (
            make_job(kind="service", restart=Restart(backoff_s=10, max_backoff_s=5)),
            "$.restart.max_backoff_s: 5 is below backoff_s (10)",
        ),
        (
            make_job(array=ArraySpec(count=3, index=1)),
            "$.array.index: set by gpulayer on each job of the array",
        ),
        (make_job(after=["x", "j1"]), "$.after[1]: a job can't wait for itself"),
    ],
)
def test_lifecycle_rules(job: JobRequest, expected: str) -> None:
    errors = validate_job(job).errors
    assert any(e.startswith(expected) for e in errors), errors


def test_array_index_is_a_protected_name_and_the_executor_sets_it() -> None:
    assert protected_env_names({"GPULAYER_ARRAY_INDEX": "3"}) == ["GPULAYER_ARRAY_INDEX"]
    assert validate_job(make_job(env={"GPULAYER_ARRAY_INDEX": "3"})).errors
    element = make_job(job_id="arr-7", array=ArraySpec(count=20, index=7))
    grant = Grant(grant_id="arr-7-1", job=element, node_id="n", accelerator="cpu")
    assert grant_environment(grant, {})["GPULAYER_ARRAY_INDEX"] == "7"
    plain = Grant(grant_id="j1-1", job=make_job(), node_id="n", accelerator="cpu")
    assert "GPULAYER_ARRAY_INDEX" not in grant_environment(plain, {})


def test_requeued_event_round_trips_and_is_not_terminal() -> None:
    from gpulayer_contracts import encode, is_terminal

    ev = Requeued(job_id="j", node_id="n", ended="lost", reason="node gone", requeues=2)
    back = event_decoder.decode(encode(ev))
    assert back == ev
    assert not is_terminal(back)


_ids = st.one_of(
    st.from_regex(r"\A[a-z0-9-]{1,12}\Z"),
    st.sampled_from(["", "a.b", "x\x00", "a" * 128, "a" * 129]),
)
_floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, b.MAX_BACKOFF_S, b.MAX_BACKOFF_S + 1, -1.0]),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    job_id=st.one_of(st.just("j1"), st.sampled_from(["a" * 120, "a" * 124, "a" * 128])),
    retries=st.sampled_from([0, 1, b.MAX_RETRIES, b.MAX_RETRIES + 1, -1, 2**70]),
    restart=st.one_of(st.none(), st.builds(Restart, backoff_s=_floats, max_backoff_s=_floats)),
    count=st.one_of(st.none(), st.sampled_from([0, 1, 9, 10, 1000, b.MAX_ARRAY_COUNT + 1, -5])),
    index=st.one_of(st.none(), st.sampled_from([0, 5, b.MAX_ARRAY_COUNT, -1])),
    after=st.one_of(st.lists(_ids, max_size=4), st.just(["d"] * (b.MAX_AFTER + 1))),
)
def test_the_fast_check_agrees_with_the_detailed_one_on_lifecycle_fields(
    job_id: str,
    retries: int,
    restart: Restart | None,
    count: int | None,
    index: int | None,
    after: list[str],
) -> None:
    array = None if count is None else ArraySpec(count=count, index=index)
    job = make_job(job_id=job_id, retries=retries, restart=restart, array=array, after=after)
    detailed = list(bounds_jobs._job_bounds(job))
    event("within bounds" if not detailed else "out of bounds")
    assert bounds_jobs._within_bounds(job) == (not detailed), detailed


def test_old_consumers_skip_a_requeued_event() -> None:
    """A reader of an older version decodes the union without ``requeued``: it fails to
    decode that one event (follow_events skips it) rather than misreading it."""
    from gpulayer_contracts import encode
    from gpulayer_contracts.events import (
        Accepted,
        Cancelled,
        Failed,
        Lost,
        Pending,
        Placed,
        Rejected,
        Running,
        Succeeded,
    )

    old = Accepted | Rejected | Pending | Placed | Running | Succeeded | Failed | Cancelled | Lost
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(encode(Requeued(job_id="j")), type=old)
