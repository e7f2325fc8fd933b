"""The pages over a filled cache, through Starlette's test client: what each shows, user text
escaped, no env value, filters, paging, the live part alone, unknown hosts refused."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.testclient import TestClient
from tests.unit.web.web_data import job, node

from gpulayer_web.app import build_app
from gpulayer_web.cache import FleetCache, JobDetail

EVIL = "<script>alert(1)</script>"


def make_client(nodes: list[dict[str, Any]], jobs: list[dict[str, Any]]) -> TestClient:
    async def ask(subject: str, body: dict[str, Any]) -> Any:
        raise AssertionError("pages read the cache only")

    async def history(job_id: str, owner: str) -> list[dict[str, Any]]:
        return []

    cache = FleetCache(ask, history)
    cache.snapshot.nodes, cache.snapshot.jobs = nodes, jobs

    async def detail(job_id: str) -> JobDetail:
        found = next((j for j in jobs if j["job_id"] == job_id), None)
        if found is None:
            return JobDetail(None, None, [], error=f"no job {job_id!r}")
        explain = {"summary": "0/1 nodes can run this job", "reasons": ["1 has no cuda device"]}
        events = [{"type": "accepted", "at": "2026-12-01T10:00:00.123+00:00"}]
        return JobDetail(found, explain, events)

    cache.job = detail  # type: ignore[method-assign]
    return TestClient(build_app(cache, allowed_hosts=["testserver"]))


@pytest.fixture
def client() -> TestClient:
    waiting = job("w1", "pending", owner="bob", reason=f"why {EVIL}",
                  request={"name": EVIL, "command": ["echo", EVIL], "env": ["HF_TOKEN"]})  # fmt: skip
    running = job("r1", "running", node_id="gpu-01", devices=[1])
    return make_client([node(), node(f"x{EVIL}")], [running, waiting])


def test_fleet_page(client: TestClient) -> None:
    r = client.get("/")
    assert r.status_code == 200
    assert "linux-x86_64" in r.text
    assert "cuda, vulkan" in r.text
    assert "4 x NVIDIA H100 80GB HBM3" in r.text
    assert "detection-only" in r.text  # the support matrix beside it
    assert EVIL not in r.text
    assert "&lt;script&gt;" in r.text
    assert "script-src 'self'" in r.headers["content-security-policy"]


def test_fleet_filters_and_the_live_part(client: TestClient) -> None:
    r = client.get("/", params={"state": "offline"})
    assert "no nodes match these filters" in r.text
    live = client.get("/", headers={"X-Live": "1"})
    assert "<html" not in live.text
    assert 'data-node="gpu-01"' in live.text


def test_node_page(client: TestClient) -> None:
    r = client.get("/nodes/gpu-01")
    assert r.status_code == 200
    assert "uncorrectable ECC errors: 3" in r.text
    assert r.text.count('class="health h-unhealthy"') == 1
    assert "nvidia-smi: driver 550.54.15" in r.text
    assert 'data-job="r1"' in r.text  # the job running there
    assert client.get("/nodes/nope").status_code == 404


def test_jobs_pages(client: TestClient) -> None:
    r = client.get("/jobs")
    assert r.text.index('data-job="w1"') < r.text.index('data-job="r1"')  # waiting first
    assert "why &lt;script&gt;" in r.text
    assert EVIL not in r.text
    assert 'data-job="r1"' not in client.get("/jobs", params={"owner": "bob"}).text
    page = client.get("/jobs/w1")
    assert page.status_code == 200
    assert EVIL not in page.text
    # Its name and command; its reason gives way to the explanation (not HTML here).
    assert page.text.count("&lt;script&gt;alert(1)&lt;/script&gt;") == 2
    assert "1 has no cuda device" in page.text
    assert "Why it waits" in page.text
    assert "HF_TOKEN" in page.text
    missing = client.get("/jobs/nope")
    assert missing.status_code == 404
    assert "no job" in missing.text


def test_a_distributed_jobs_ranks() -> None:
    ranks = [
        {"rank": r, "job_id": f"g-rank{r}", "node_id": f"n{r}", "devices": [0, 1],
         "state": "running", "exit_code": None, "reason": None}
        for r in range(2)
    ]  # fmt: skip
    client = make_client([], [job("g", "running", ranks=ranks, node_id="n0")])
    r = client.get("/jobs/g")
    assert 'id="ranks"' in r.text
    assert "g-rank1" in r.text
    assert "Why it waits" not in r.text


def test_owners_page(client: TestClient) -> None:
    r = client.get("/owners")
    assert "bob" in r.text
    assert "alice" in r.text
    assert "placement did not list quotas" in r.text


def test_pages_paginate() -> None:
    jobs = [job(f"j{i:05d}", "succeeded") for i in range(250)]
    client = make_client([], jobs)
    r = client.get("/jobs", params={"page": "3", "state": "succeeded"})
    assert "page 3 of 3" in r.text
    assert r.text.count("data-job=") == 50
    assert 'href="?state=succeeded&amp;page=2"' in r.text
    assert client.get("/jobs", params={"page": "x"}).status_code == 200


def test_an_unknown_host_is_refused(client: TestClient) -> None:
    # DNS rebinding: another site's name pointed at 127.0.0.1 gets nothing.
    assert client.get("/", headers={"Host": "evil.example"}).status_code == 400


def test_only_reads(client: TestClient) -> None:
    assert client.post("/").status_code == 405
    assert client.get("/static/live.js").status_code == 200
