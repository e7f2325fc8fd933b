"""The CLI's side of the job lifecycle: arrays folded in `gpulayer jobs`, services listed, and
when `submit --wait` stops following a retried job or a service."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from gpulayer_cli.render import describe_event, fold_arrays, services_table
from gpulayer_cli.submit_cmd import _end_of, _job_ids
from gpulayer_contracts import Cancelled, Failed, Lost, Requeued, Succeeded
from gpulayer_contracts.jobs import ArraySpec, JobRequest


def row(job_id: str, state: str, array_id: str | None = None, node: str | None = None) -> Any:
    return {
        "job_id": job_id,
        "state": state,
        "array_id": array_id,
        "node_id": node,
        "submitted_at": "2025-01-01T00:00:00+00:00",
    }


def test_the_jobs_of_an_array_fold_into_one_line_where_the_first_stood() -> None:
    jobs = [
        row("solo", "running"),
        *(row(f"a-{i}", "succeeded" if i < 18 else "running", "a", "n1") for i in range(20)),
        row("other", "pending"),
    ]
    folded = fold_arrays(jobs)
    assert [j["job_id"] for j in folded] == ["solo", "a [20 jobs]", "other"]
    assert folded[1]["state"] == "running 2, succeeded 18"
    assert folded[1]["node_id"] == "n1"


def test_services_table_shows_restarts_and_node() -> None:
    console = Console(width=200, record=True)
    console.print(
        services_table(
            [
                {
                    "job_id": "svc",
                    "state": "running",
                    "node_id": "a",
                    "restarts": 2,
                    "restart": {"policy": "on-failure"},
                }
            ]
        )
    )
    text = console.export_text()
    (line,) = [x for x in text.splitlines() if x.startswith("│ svc")]
    cells = [c.strip() for c in line.split("│")[1:6]]
    assert cells == ["svc", "running", "a", "2", "on-failure"]


def test_array_submit_follows_each_job() -> None:
    job = JobRequest(job_id="arr", command=["t"], array=ArraySpec(count=3))
    assert _job_ids(job) == ["arr-0", "arr-1", "arr-2"]


def test_wait_stops_at_the_last_end_of_a_retried_job() -> None:
    stop = _end_of(JobRequest(job_id="r", command=["t"], retries=1))
    assert not stop(Lost(job_id="r"))  # a retry follows
    assert not stop(Requeued(job_id="r"))
    assert stop(Lost(job_id="r"))  # retries spent: lost for good
    plain = _end_of(JobRequest(job_id="p", command=["t"], retries=1))
    assert plain(Failed(job_id="p"))  # failed is retried only with retry_on_failure


def test_wait_follows_a_service_until_it_is_cancelled() -> None:
    stop = _end_of(JobRequest(job_id="s", command=["t"], kind="service"))
    assert not stop(Succeeded(job_id="s", node_id="a"))
    assert not stop(Failed(job_id="s"))
    assert stop(Cancelled(job_id="s"))


def test_a_requeued_event_reads_as_waiting_again() -> None:
    ev = Requeued(job_id="r", reason="retry 1 of 2 after the job lost")
    assert describe_event(ev) == "waits again: retry 1 of 2 after the job lost"
