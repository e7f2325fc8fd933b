"""The web service's cache: one poll per interval for every viewer, the last good data kept
when placement is silent, a job's details read once for many pages, env values dropped."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from tests.unit.web.web_data import job, node

from gpulayer_contracts.health import DeviceObservation, NodeObservations
from gpulayer_contracts.subjects import API_EXPLAIN, API_JOB, API_JOBS, API_NODES, API_QUOTA
from gpulayer_web.cache import FleetCache, without_env_values


class FakePlacement:
    """Answers like placement's API; counts what it was asked."""

    def __init__(self) -> None:
        self.asked: list[str] = []
        self.down = False
        self.gate: asyncio.Event | None = None
        self.polls: asyncio.Queue[None] = asyncio.Queue()  # one item per nodes request
        self.record: dict[str, Any] = job(
            "j1", request={"command": ["true"], "env": {"TOKEN": "s3cret"}}
        )

    async def ask(self, subject: str, body: dict[str, Any]) -> Any:
        self.asked.append(subject)
        if self.gate is not None:
            await self.gate.wait()
        if self.down:
            raise RuntimeError("no placement answered")
        if body.get("offset"):  # one page of each list
            return []
        if subject == API_NODES:
            self.polls.put_nowait(None)
            return [node()]
        if subject == API_JOBS:
            if body.get("state") == "pending":
                return [job("old-wait", submitted_at="2026-11-01T00:00:00+00:00")]
            return [job("j1", "running")]
        if subject == API_QUOTA:
            raise RuntimeError("only admins may see or change quotas")
        if subject == API_JOB:
            return self.record
        if subject == API_EXPLAIN:
            return {"summary": "0/1 nodes", "reasons": ["no cuda"]}
        raise AssertionError(subject)

    async def history(self, job_id: str, owner: str) -> list[dict[str, Any]]:
        self.asked.append(f"history {owner} {job_id}")
        return [{"type": "accepted", "job_id": job_id}]


async def test_refresh_reads_nodes_recent_and_waiting_jobs() -> None:
    placement = FakePlacement()
    cache = FleetCache(placement.ask, placement.history)
    await cache.refresh()
    snap = cache.snapshot
    assert [n["node_id"] for n in snap.nodes] == ["gpu-01"]
    # A job waiting for a month is still shown, however many jobs came since.
    assert [j["job_id"] for j in snap.jobs] == ["j1", "old-wait"]
    assert snap.quotas is None  # refused: the owners page says none were listed
    assert snap.error is None
    assert snap.version == 1


async def test_placement_silent_keeps_the_last_good_data_and_says_so() -> None:
    placement = FakePlacement()
    cache = FleetCache(placement.ask, placement.history)
    await cache.refresh()
    placement.down = True
    await cache.refresh()
    assert [n["node_id"] for n in cache.snapshot.nodes] == ["gpu-01"]
    assert "placement did not answer" in (cache.snapshot.error or "")
    placement.down = False
    await cache.refresh()
    assert cache.snapshot.error is None


async def test_many_viewers_of_a_job_cost_one_read() -> None:
    placement = FakePlacement()
    placement.gate = asyncio.Event()
    cache = FleetCache(placement.ask, placement.history, interval_s=60)
    viewers = [asyncio.create_task(cache.job("j1")) for _ in range(50)]
    await asyncio.sleep(0)
    placement.gate.set()
    details = await asyncio.gather(*viewers)
    assert placement.asked == [API_JOB, API_EXPLAIN, "history alice j1"]
    assert all(d is details[0] for d in details)
    # Read again within the interval: still nothing asked.
    await cache.job("j1")
    assert len(placement.asked) == 3


async def test_a_jobs_env_values_never_reach_the_page() -> None:
    placement = FakePlacement()
    cache = FleetCache(placement.ask, placement.history)
    detail = await cache.job("j1")
    assert detail.record is not None
    assert detail.record["request"]["env"] == ["TOKEN"]
    assert "s3cret" not in repr(detail.record)
    assert without_env_values({"request": {"env": "odd"}})["request"]["env"] == []
    assert without_env_values({"request": None}) == {"request": None}


async def test_a_finished_job_is_not_explained() -> None:
    placement = FakePlacement()
    placement.record = job("j1", "succeeded")
    detail = await FleetCache(placement.ask, placement.history).job("j1")
    assert detail.explain is None
    assert API_EXPLAIN not in placement.asked


async def test_an_unknown_job_says_why() -> None:
    placement = FakePlacement()
    placement.down = True
    detail = await FleetCache(placement.ask, placement.history).job("nope")
    assert detail.record is None
    assert "no placement answered" in (detail.error or "")


async def test_run_polls_once_per_interval_and_wakes_early_on_events() -> None:
    placement = FakePlacement()
    cache = FleetCache(placement.ask, placement.history, interval_s=30, min_gap_s=0.0)
    stop = asyncio.Event()
    task = asyncio.create_task(cache.run(stop))
    await cache.wait_fresh()
    await placement.polls.get()
    assert placement.polls.empty()
    cache.wake()  # a job event: refresh now, not in 30 s
    await asyncio.wait_for(placement.polls.get(), 5)
    assert placement.polls.empty()  # one refresh, not one per page
    stop.set()
    await asyncio.wait_for(task, 5)


@pytest.mark.parametrize("keep_s", [60.0])
def test_observations_keep_the_last_minutes(keep_s: float) -> None:
    cache = FleetCache(FakePlacement().ask, FakePlacement().history, history_s=keep_s)
    start = datetime(2026, 12, 1, tzinfo=UTC)
    for i in range(20):
        cache.observe(
            NodeObservations(
                node_id="gpu-01",
                observed_at=start + timedelta(seconds=10 * i),
                devices=[DeviceObservation(index=0, utilization_pct=i)],
            )
        )
    kept = cache.observations("gpu-01")
    assert (kept[-1].observed_at - kept[0].observed_at).total_seconds() <= keep_s
    assert len(kept) == 7
    assert cache.observations("other") == []


class PagingPlacement:
    """Placement with ``n`` nodes and jobs, paging like the real one; ``cut`` replies hold at
    most that many items (the API's size bound), ``pages`` False answers every request with
    the whole list (a placement from before paging)."""

    def __init__(self, n: int, cut: int = 10_000, pages: bool = True) -> None:
        self.nodes = [node(f"n{i:04d}") for i in range(n)]
        self.jobs = [job(f"j{i:05d}", "succeeded") for i in range(n)]
        self.cut, self.pages, self.asked = cut, pages, 0

    async def ask(self, subject: str, body: dict[str, Any]) -> Any:
        self.asked += 1
        if subject == API_QUOTA:
            return []
        items = self.nodes if subject == API_NODES else self.jobs
        if subject == API_JOBS and body.get("state") == "pending":
            items = []
        if not self.pages:
            return items[: self.cut]
        start = body.get("offset", 0)
        return items[start : start + min(body.get("limit", len(items)), self.cut)]

    async def history(self, job_id: str, owner: str) -> list[dict[str, Any]]:
        return []


async def test_a_large_fleet_is_read_page_by_page() -> None:
    placement = PagingPlacement(1_050, cut=70)  # every reply cut short of the page asked
    cache = FleetCache(placement.ask, placement.history, jobs_limit=10_000)
    await cache.refresh()
    assert [n["node_id"] for n in cache.snapshot.nodes] == [f"n{i:04d}" for i in range(1_050)]
    assert len(cache.snapshot.jobs) == 1_050
    assert len({j["job_id"] for j in cache.snapshot.jobs}) == 1_050


async def test_the_jobs_kept_stop_at_the_limit() -> None:
    placement = PagingPlacement(3_000)
    cache = FleetCache(placement.ask, placement.history, jobs_limit=1_500)
    await cache.refresh()
    assert len(cache.snapshot.jobs) == 1_500


async def test_a_placement_that_does_not_page_is_read_once() -> None:
    placement = PagingPlacement(300, pages=False)
    cache = FleetCache(placement.ask, placement.history)
    await cache.refresh()
    assert len(cache.snapshot.nodes) == 300
    # Nodes, recent jobs, waiting jobs: each list asked twice (the second answer has nothing
    # new), quotas once.
    assert placement.asked <= 7
