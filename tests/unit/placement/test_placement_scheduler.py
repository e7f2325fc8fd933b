"""The scheduler alone, over a real Fleet: the wake/idle rule, matching rows in order with
devices held at once, what a batch persists, and which waiting jobs a wake-up takes."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, cast

import msgspec
from tests.unit.placement.placement_fakes import FakeConn, FakeJetStream, fake_scheduler, gpu_node

from gpulayer_contracts.codec import job_request_decoder
from gpulayer_placement.fleet import Fleet
from gpulayer_placement.outcome import Outcome
from gpulayer_placement.queue_pass import RELEASE_FIRST_PAGE, THOROUGH_MAX_PAGES
from gpulayer_placement.scheduler import Scheduler
from gpulayer_placement.wake import Wake


def gpu_row(job_id: str, reason: str | None = None) -> dict[str, Any]:
    request = {
        "job_id": job_id,
        "command": ["true"],
        "requirements": {"accelerator": "cuda", "gpu_count": 1},
        "sandbox": {"devices": {"gpu": "compute"}},
    }
    return {
        "job_id": job_id,
        "request": msgspec.json.encode(request).decode(),
        "reason": reason,
        "attempt": 0,
        "submitted_at": datetime(2025, 1, 1, tzinfo=UTC),
        "traceparent": None,
    }


def build(conn: FakeConn | None = None) -> tuple[Scheduler, Fleet, Wake, FakeJetStream]:
    scheduler, js = fake_scheduler(gpu_node("g", 1), conn)
    return scheduler, scheduler.fleet, scheduler.wake, js


def test_wake_is_idle_only_when_no_pass_runs_or_is_due() -> None:
    wake = Wake()
    assert wake.idle()
    wake.passing = True
    assert not wake.idle()
    wake.passing = False
    epoch = wake.epoch
    wake.capacity()
    assert not wake.idle()
    assert wake.epoch == epoch + 1
    assert wake.event.is_set()
    wake.jobs(["j1"])
    assert wake.take() == (["j1"], True, False)
    assert wake.idle()  # taking the work clears it


async def test_a_thorough_request_makes_the_scheduler_busy() -> None:
    wake = Wake()
    await wake.request_thorough()
    assert not wake.idle()
    assert wake.take() == ([], False, True)


def test_match_rows_holds_devices_at_once_so_a_batch_never_books_one_twice() -> None:
    scheduler, fleet, _, _ = build()
    outcome = Outcome()
    scheduler.match_rows(cast(Any, [gpu_row("j1"), gpu_row("j2"), gpu_row("j3")]), {}, outcome)
    (pl,) = outcome.placements
    assert (pl.job.job_id, pl.grant_id, pl.placement.node_id) == ("j1", "j1-1", "g")
    view = fleet.get("g")
    assert view is not None
    assert view.exclusive == frozenset({0})
    assert [j for j, _ in outcome.waiting] == ["j2", "j3"]
    # The equal job behind one that found no node reuses its decision instead of matching.
    assert outcome.waiting[0][1] is outcome.waiting[1][1]
    scheduler.release(outcome)
    view = fleet.get("g")
    assert view is not None
    assert view.exclusive == frozenset()
    assert outcome.placements == []


def test_a_waiting_job_whose_reason_did_not_change_is_not_written_again() -> None:
    scheduler, fleet, _, _ = build()
    fleet.hold("g", [0], "exclusive")
    first = Outcome()
    scheduler.match_rows(cast(Any, [gpu_row("j1")]), {}, first)
    ((_, decision),) = first.waiting
    again = Outcome()
    scheduler.match_rows(cast(Any, [gpu_row("j1", reason=decision.summary)]), {}, again)
    assert again.waiting == []


async def test_persist_writes_allocations_and_jobs_in_one_statement_tagged_by_replica() -> None:
    conn = FakeConn()
    scheduler, _, _, _ = build(conn)
    outcome = Outcome()
    scheduler.match_rows(cast(Any, [gpu_row("j1"), gpu_row("j2")]), {}, outcome)
    await scheduler.persist(conn, outcome)
    assert conn.names() == ["place_jobs", "mark_waiting"]
    place = conn.calls[0][1]
    assert place[0] == ["j1"]
    assert place[4] == ["{0}"]
    assert place[5:9] == (["j1"], ["g"], [0], ["exclusive"])
    assert place[9] == "replica-1"
    assert conn.calls[1][1][0] == ["j2"]


async def test_new_jobs_wake_a_pass_over_those_ids_only_and_capacity_a_full_one() -> None:
    conn = FakeConn({"take_jobs": [gpu_row("j1")]})
    scheduler, _, wake, js = build(conn)
    task = asyncio.create_task(scheduler.run())
    try:
        wake.jobs(["j1"])
        async with asyncio.timeout(5):
            while len(js.sent) < 2:  # noqa: ASYNC110 (placed event and grant)
                await asyncio.sleep(0.01)
        assert conn.names() == ["take_jobs", "place_jobs"]
        assert conn.calls[0][1] == (["j1"],)
        conn.calls.clear()
        wake.capacity()
        async with asyncio.timeout(5):
            while "take_pending" not in conn.names():  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        # The first full pass reads the quotas and owners' usage (queue policy) and the owners
        # with a waiting job (none here: no batch of each one's first jobs), then pages.
        assert conn.names() == ["load_policy", "waiting_owners", "take_pending"]
        assert not wake.passing
    finally:
        scheduler.stop.set()
        wake.event.set()
        await task


def page_row(job_id: str) -> dict[str, Any]:
    """A row as take_pending returns it: no request."""
    row = gpu_row(job_id)
    del row["request"]
    return row


def page_of_two(conn: FakeConn) -> Scheduler:
    """A scheduler on ``conn`` whose page holds j1 and j2: j1's request decoded here already,
    j2's read from the database."""
    conn.rows["take_pending"] = [page_row("j1"), page_row("j2")]
    conn.rows["job_requests"] = [{"job_id": "j2", "request": gpu_row("j2")["request"]}]
    scheduler, _, _, _ = build(conn)
    scheduler.remember({"j1": job_request_decoder.decode(gpu_row("j1")["request"])}, {})
    return scheduler


async def test_a_page_reads_only_the_requests_of_jobs_not_decoded_here() -> None:
    conn = FakeConn()
    scheduler = page_of_two(conn)
    await scheduler._schedule_all()
    assert conn.names()[:4] == ["load_policy", "waiting_owners", "take_pending", "job_requests"]
    assert conn.calls[3][1] == (["j2"],)
    assert "j2" in scheduler._jobs  # decoded once: the next page needs no query for it
    # One GPU: the oldest job gets it, j2 waits.
    assert next(c for c in conn.calls if c[0] == "place_jobs")[1][0] == ["j1"]
    conn.calls.clear()
    scheduler.fleet.release("g", [0], "exclusive")
    conn.rows["take_pending"] = [page_row("j2")]
    await scheduler._schedule_all()
    assert "job_requests" not in conn.names()
    assert next(c for c in conn.calls if c[0] == "place_jobs")[1][0] == ["j2"]


async def test_with_two_owners_waiting_a_pass_takes_each_ones_first_jobs_before_its_pages() -> None:
    """bob's job is behind alice's in the queue's pages; the batch of each waiting owner's
    first jobs (least recent use first) comes before them and places it."""
    conn = FakeConn()
    conn.rows["waiting_owners"] = [{"owner": "alice"}, {"owner": "bob"}]
    conn.rows["take_heads"] = [page_row("j1") | {"owner": "bob", "priority": 0}]
    conn.rows["take_pending"] = []
    conn.rows["job_requests"] = [{"job_id": "j1", "request": gpu_row("j1")["request"]}]
    # alice's ended GPU-seconds, decayed, as load_policy reads them
    conn.rows["load_policy"] = [{"kind": "share", "owner": "alice", "value": 10.0}]
    scheduler, _, _, _ = build(conn)
    await scheduler._schedule_all()
    assert conn.names()[:3] == ["load_policy", "waiting_owners", "take_heads"]
    # Owners by least recent use, and a page's worth shared among them (at most 8 each).
    assert conn.calls[2][1] == (["bob", "alice"], 8)
    assert next(c for c in conn.calls if c[0] == "place_jobs")[1][0] == ["j1"]
    # The fleet's one GPU is taken: the pass stops before the pages.
    assert "take_pending" not in conn.names()


async def test_a_thorough_pass_reads_at_most_its_pages_of_a_long_queue() -> None:
    """A queue longer than THOROUGH_MAX_PAGES pages (here every page is full, as if it never
    ended): the thorough pass stops there; a pass that stops early stops at the first page that
    leaves the fleet full."""
    conn = FakeConn()
    conn.rows["take_pending"] = [page_row("j1"), page_row("j2")]
    conn.rows["job_requests"] = [
        {"job_id": j, "request": gpu_row(j)["request"]} for j in ("j1", "j2")
    ]
    scheduler, _, _, _ = build(conn)
    scheduler.settings = dataclasses.replace(scheduler.settings, page_size=2)
    await scheduler._schedule_all(early_stop=False)
    assert conn.names().count("take_pending") == THOROUGH_MAX_PAGES
    conn.calls.clear()
    await scheduler._schedule_all(early_stop=True)
    assert conn.names().count("take_pending") == 1


class _ForgettingConn(FakeConn):
    """While the page's unknown requests are read, an end applied meanwhile forgets a job of
    the page (a retried job: ended, and waiting again)."""

    scheduler: Scheduler

    async def fetch(self, sql: str, *args: Any) -> list[dict[str, Any]]:
        rows = await super().fetch(sql, *args)
        if self.calls[-1][0] == "job_requests":
            self.scheduler.forget("j1")
        return rows


async def test_a_job_forgotten_while_its_page_is_read_is_still_matched() -> None:
    # The suite's repeat run once failed a restarted service: "its stored request is gone".
    conn = _ForgettingConn()
    conn.scheduler = scheduler = page_of_two(conn)
    await scheduler._schedule_all()
    assert conn.calls[3] == ("job_requests", (["j2"],))
    assert "fail_pending" not in conn.names()
    assert next(c for c in conn.calls if c[0] == "place_jobs")[1][0] == ["j1"]


class _NodeJoinsConn(FakeConn):
    """A node joins while intake's inline placement takes its new rows."""

    wake: Wake

    async def fetch(self, sql: str, *args: Any) -> list[dict[str, Any]]:
        rows = await super().fetch(sql, *args)
        if self.calls[-1][0] == "take_jobs":
            self.wake.capacity()
        return rows


async def test_inline_placement_yields_to_the_pass_a_node_joining_wakes_meanwhile() -> None:
    # A job waiting on an empty fleet was overtaken by the next one submitted as the node joined:
    # intake found the scheduler idle, then matched the new job on the new node while the pass
    # the join woke was matching the older one.
    conn = _NodeJoinsConn({"take_jobs": [gpu_row("new")]})
    scheduler, _, wake, _ = build(conn)
    conn.wake = wake
    assert wake.idle()
    assert await scheduler.place_inline(conn, ["new"]) is None
    assert "place_jobs" not in conn.names()
    assert scheduler.fleet.any_free_device()  # nothing held: the pass places in order
    # Nothing happened meanwhile: placed here, as before.
    conn.rows["take_jobs"] = [gpu_row("next")]
    wake.take()
    conn.wake = Wake()  # the join now goes elsewhere
    outcome = await scheduler.place_inline(conn, ["next"])
    assert outcome is not None
    assert [pl.job.job_id for pl in outcome.placements] == ["next"]


async def test_a_pass_over_new_jobs_yields_to_the_full_pass_a_node_joining_queues() -> None:
    # The same race one step later: the new job went to a pass over new jobs only, which took
    # its row while the node joined, and placed it ahead of the older job the join's pass had.
    conn = _NodeJoinsConn({"take_jobs": [gpu_row("new")]})
    scheduler, _, wake, _ = build(conn)
    conn.wake = wake
    await scheduler._schedule_ids(["new"], wake.epoch)
    assert "place_jobs" not in conn.names()
    assert wake.capacity_changed  # the full pass comes next, every waiting job in order
    conn.wake = Wake()
    await scheduler._schedule_ids(["new"], wake.epoch)
    assert next(c for c in conn.calls if c[0] == "place_jobs")[1][0] == ["new"]


class _OnceConn(FakeConn):
    """Answers ``cancel_dependents`` once (one level of dependents), then with nothing."""

    async def fetch(self, sql: str, *args: Any) -> list[dict[str, Any]]:
        rows = await super().fetch(sql, *args)
        if self.calls[-1][0] == "cancel_dependents":
            self.rows.pop("cancel_dependents", None)
        return rows


async def test_jobs_waiting_for_a_job_that_cannot_be_matched_are_cancelled() -> None:
    """A job the matcher fails on is failed; the jobs that waited for it (``after``) are
    cancelled naming it in the same transaction, their events put in the outbox there."""
    dependent = {"job_id": "b", "reason": "dependency a ended failed (after)", "owner": "o"}
    conn = _OnceConn({"cancel_dependents": [dependent]})
    scheduler, _, _, _ = build(conn)
    outcome = Outcome()
    outcome.failed.append(("a", "placement could not match this job: boom"))
    await scheduler.persist(conn, outcome)
    assert conn.names() == [
        "fail_pending",
        "cancel_dependents",
        "cancel_dependents",
        "record_outbox",
    ]
    assert conn.calls[1][1] == (["a"], ["failed"])
    assert conn.calls[2][1] == (["b"], ["cancelled"])  # and b's own dependents after it
    msg_ids, subjects, payloads = conn.calls[3][1]
    assert (msg_ids, subjects) == (["b:cancelled"], ["gpulayer.job.o.b.events"])
    assert json.loads(payloads[0])["reason"] == "dependency a ended failed (after)"


def _decoded(scheduler: Scheduler, *rows: dict[str, Any]) -> None:
    """The requests of ``rows`` known to the scheduler, as after their intake."""
    outcome = Outcome()
    scheduler.match_rows(cast(Any, list(rows)), {}, outcome)
    scheduler.release(outcome)


def test_a_pass_after_a_release_passes_over_jobs_that_can_only_wait_once_the_fleet_is_full() -> (
    None
):
    scheduler, _, _, _ = build()
    rows = [gpu_row("j1"), gpu_row("j2", reason="stale"), gpu_row("j3", reason="stale")]
    _decoded(scheduler, *rows)
    thorough = Outcome()
    scheduler.match_rows(cast(Any, rows), {}, thorough)
    assert [j for j, _ in thorough.waiting] == ["j2", "j3"]
    scheduler.release(thorough)
    skimmed = Outcome()
    scheduler.match_rows(cast(Any, rows), {}, skimmed, skim=True)
    assert [pl.job.job_id for pl in skimmed.placements] == ["j1"]
    # j2, the first that found no room, still goes through the gate (its reservation, its
    # reason); j3 behind it is passed over: its stored reason waits for the thorough pass.
    assert [j for j, _ in skimmed.waiting] == ["j2"]


def test_a_skimming_pass_never_passes_over_a_job_it_has_not_decoded_or_a_shared_one() -> None:
    scheduler, _, _, _ = build()
    shared = gpu_row("s1", reason="stale")
    request = msgspec.json.decode(shared["request"])
    shared["request"] = msgspec.json.encode({**request, "gpu": {"use": "shared"}}).decode()
    _decoded(scheduler, gpu_row("j1"), gpu_row("j2", reason="stale"), shared)
    rows = [gpu_row("j1"), gpu_row("j2", reason="stale"), shared, gpu_row("new", reason="x")]
    outcome = Outcome()
    scheduler.match_rows(cast(Any, rows), {}, outcome, skim=True)
    assert [j for j, _ in outcome.waiting] == ["j2", "s1", "new"]


class _PagedConn(FakeConn):
    """A queue of 2-GPU jobs in pages: ``take_pending`` answers by its cursor (the job id the
    page starts after). ``on_take`` runs at each page taken (a release applied meanwhile)."""

    def __init__(self, job_ids: list[str], on_take: Callable[[str], None]) -> None:
        super().__init__()
        self.job_ids = job_ids
        self.on_take = on_take

    async def fetch(self, sql: str, *args: Any) -> list[dict[str, Any]]:
        rows = await super().fetch(sql, *args)
        if self.calls[-1][0] != "take_pending":
            return rows
        size, after = args[0], args[3]
        self.on_take(after)
        rest = [j for j in self.job_ids if j > after]
        return [page_row(j) for j in rest[:size]]

    def cursors(self) -> list[str]:
        return [args[3] for name, args in self.calls if name == "take_pending"]


def _paged(conn: _PagedConn) -> Scheduler:
    """Two GPUs, one held by a running job; pages of two 2-GPU jobs, decoded here: after a
    page a device is free (so a pass after a release goes on), but no job fits."""
    scheduler, _ = fake_scheduler(gpu_node("g", 2), conn)
    scheduler.settings = dataclasses.replace(scheduler.settings, page_size=2)
    scheduler.fleet.hold("g", [0], "exclusive")
    for j in conn.job_ids:
        request = json.loads(gpu_row(j)["request"])
        request["requirements"]["gpu_count"] = 2
        scheduler.remember({j: job_request_decoder.decode(json.dumps(request))}, {})
    return scheduler


async def test_a_pass_starts_again_from_the_head_when_a_device_frees_between_its_pages() -> None:
    """The held GPU frees while the second page is read: the pass went on to the queue's end
    skipping every job equal to the one that found too few GPUs (its memo of failures), while
    the freed GPUs waited. Now it starts again from the head, and the oldest job gets them."""
    scheduler: Scheduler

    def release_at_page_two(after: str) -> None:
        if after == "a2":
            scheduler.fleet.release("g", [0], "exclusive")
            scheduler.wake.capacity()

    conn = _PagedConn(["a1", "a2", "a3", "a4", "a5"], release_at_page_two)
    scheduler = _paged(conn)
    await scheduler._schedule_all()
    assert conn.cursors() == ["", "a2", ""]  # head, second page, head again: not a4's page
    assert [c[1][0] for c in conn.calls if c[0] == "place_jobs"] == [["a1"]]
    assert not scheduler.fleet.any_free_device()


async def test_a_pass_starts_again_only_once_so_steady_releases_never_starve_the_rest() -> None:
    """Capacity changes at every page (releases elsewhere) while no job fits: the pass restarts
    once, then walks to the queue's end, which a pass restarting at every change never would."""
    scheduler: Scheduler

    def change_every_page(after: str) -> None:
        scheduler.wake.capacity()

    conn = _PagedConn(["a1", "a2", "a3", "a4", "a5"], change_every_page)
    scheduler = _paged(conn)
    await scheduler._schedule_all()
    assert conn.cursors() == ["", "", "a2", "a4"]
    assert "place_jobs" not in conn.names()


async def test_a_pass_after_a_release_reads_a_small_first_page_then_full_ones() -> None:
    """A release frees a device in front of a long queue: the pass locks RELEASE_FIRST_PAGE
    rows first, not a full page. None of them fits (2 GPUs each, one free), so it goes on with
    full pages, in order, and the 1-GPU job behind them gets the device. A thorough pass reads
    full pages from the start."""
    ids = [f"a{i:03d}" for i in range(RELEASE_FIRST_PAGE + 10)]
    conn = _PagedConn([*ids, "b000"], lambda after: None)
    scheduler, _ = fake_scheduler(gpu_node("g", 2), conn)
    scheduler.fleet.hold("g", [0], "exclusive")
    for j in [*ids, "b000"]:
        request = json.loads(gpu_row(j)["request"])
        request["requirements"]["gpu_count"] = 1 if j == "b000" else 2
        scheduler.remember({j: job_request_decoder.decode(json.dumps(request))}, {})
    page = scheduler.settings.page_size
    assert page > RELEASE_FIRST_PAGE

    await scheduler._schedule_all(early_stop=True)
    sizes = [args[0] for name, args in conn.calls if name == "take_pending"]
    assert sizes == [RELEASE_FIRST_PAGE, page]
    assert conn.cursors() == ["", ids[RELEASE_FIRST_PAGE - 1]]
    assert [c[1][0] for c in conn.calls if c[0] == "place_jobs"] == [["b000"]]

    conn.calls.clear()
    scheduler.fleet.release("g", [1], "exclusive")
    await scheduler._schedule_all(early_stop=False)
    assert [args[0] for name, args in conn.calls if name == "take_pending"] == [page]
