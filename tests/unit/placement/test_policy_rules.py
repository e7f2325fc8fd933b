"""Queue policy, pure parts: quotas never exceeded, preemption never picks a job it may not, no
device held twice across preemptions and requeues, fair-share order."""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.unit.placement.placement_fakes import gpu_node

from gpulayer_contracts import JobRequest
from gpulayer_contracts.jobs import Requirements
from gpulayer_matching import NodeView, Placement, match
from gpulayer_placement import quotas as q
from gpulayer_placement.policy import Policy
from gpulayer_placement.preemption import Active, choose_victims, without
from gpulayer_placement.waiting import heads_cut


def job(job_id: str, gpus: int = 1, **fields: Any) -> JobRequest:
    return JobRequest(
        job_id=job_id, command=["true"], requirements=Requirements(gpu_count=gpus), **fields
    )


def active(job_id: str, node: str, devices: tuple[int, ...], **kw: Any) -> Active:
    fields: dict[str, Any] = {
        "owner": "anonymous",
        "accelerator": "cuda",
        "shared": False,
        "priority": 0,
        "preemptible": False,
        "started": 0.0,
        "ends_at": math.inf,
        "millicores": 1000,
    }
    fields.update(kw)
    return Active(job_id=job_id, node_id=node, devices=devices, **fields)


def no_items(job_id: str) -> list[tuple[str, int]]:
    return []


def test_quota_reason_names_the_owner_what_it_holds_and_the_limit() -> None:
    quotas = {"alice": {"gpus:cuda": 8}, q.DEFAULT_OWNER: {"jobs": 2, "gpus:cuda": 1}}
    need = q.job_need(1, "cuda", 1000)
    assert (
        q.over_quota(quotas, "alice", {"gpus:cuda": 8}, need) == "owner alice holds 8/8 cuda GPUs"
    )
    assert q.over_quota(quotas, "alice", {"gpus:cuda": 7}, need) is None
    # alice's own row replaces the default's for GPUs only: the default's jobs limit holds.
    assert q.over_quota(quotas, "alice", {"jobs": 2}, need) == "owner alice holds 2/2 jobs"
    assert q.over_quota(quotas, "bob", {"gpus:cuda": 1}, need) == "owner bob holds 1/1 cuda GPUs"
    assert (
        q.over_quota(quotas, "bob", {}, q.job_need(2, "cuda", 1000))
        == "owner bob holds 0/1 cuda GPUs; this job needs 2 more"
    )


@pytest.mark.parametrize(
    ("request_", "error"),
    [
        (q.QuotaRequest(gpus={"cuda": -2}), "gpus cuda: -2 is out of range"),
        (q.QuotaRequest(gpus={"tpu": 2}), "'tpu' is not an accelerator"),
        (q.QuotaRequest(cores=math.nan), "cores: nan is not a number of cores"),
        (q.QuotaRequest(jobs=10**12), "jobs: 1000000000000 is out of range"),
        (q.QuotaRequest(), "nothing to set"),
    ],
)
def test_bad_quota_requests_are_refused_naming_the_value(
    request_: q.QuotaRequest, error: str
) -> None:
    with pytest.raises(ValueError, match=error.replace("(", r"\(")):
        q.quota_rows(request_)


def test_quota_rows_set_and_clear() -> None:
    rows = q.quota_rows(q.QuotaRequest(gpus={"cuda": 8, "mps": -1}, cores=1.5, jobs=100))
    assert rows == (["gpus:cuda", "cores", "jobs"], [8, 1500, 100], ["gpus:mps"])


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["alice", "bob"]),
            st.integers(0, 4),
            st.sampled_from(["cuda", "mps"]),
            st.booleans(),
        ),
        max_size=40,
    ),
    limits=st.tuples(st.integers(0, 6), st.integers(0, 5), st.integers(0, 9)),
)
def test_quotas_are_never_exceeded(
    ops: list[tuple[str, int, str, bool]], limits: tuple[int, int, int]
) -> None:
    """Any sequence of placements (each admitted only when ``over_quota`` says it fits) and
    ends: no owner ever holds more than its quota."""
    gpus_max, jobs_max, default_gpus = limits
    policy = Policy()
    policy.quotas = {
        "alice": {"gpus:cuda": gpus_max, "jobs": jobs_max},
        q.DEFAULT_OWNER: {"gpus:cuda": default_gpus},
    }
    held: dict[str, list[Active]] = {"alice": [], "bob": []}
    for i, (owner, gpus, acc, end) in enumerate(ops):
        if end and held[owner]:
            policy.remove(held[owner].pop(0).job_id)
            continue
        if policy.over_quota(owner, gpus, acc, 1000) is None:
            a = active(f"j{i}", "n", tuple(range(gpus)), owner=owner, accelerator=acc)
            policy.add(a)
            held[owner].append(a)
        for o, jobs in held.items():
            cuda = sum(a.gpus for a in jobs if a.accelerator == "cuda")
            assert cuda <= (gpus_max if o == "alice" else default_gpus)
            if o == "alice":
                assert len(jobs) <= jobs_max


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    running=st.lists(
        st.tuples(st.integers(-3, 3), st.booleans(), st.booleans(), st.integers(1, 2)),
        min_size=1,
        max_size=4,
    ),
    priority=st.integers(-3, 4),
    need=st.integers(1, 8),
)
def test_preemption_never_picks_a_job_it_may_not(
    running: list[tuple[int, bool, bool, int]], priority: int, need: int
) -> None:
    """Victims are always preemptible, of strictly lower priority, not already being preempted,
    on the chosen node; and once they end, the job fits there."""
    view = NodeView(node_id="n", capabilities=gpu_node("n", 8))
    jobs: list[Active] = []
    next_device = 0
    for i, (prio, preemptible, preempting, gpus) in enumerate(running):
        devices = tuple(range(next_device, next_device + gpus))
        next_device += gpus
        jobs.append(
            active(
                f"r{i}",
                "n",
                devices,
                priority=prio,
                preemptible=preemptible,
                preempting=preempting,
                started=float(i),
            )
        )
    view = msgspec.structs.replace(view, exclusive=frozenset(range(next_device)))
    wanted = job("hp", gpus=need)
    choice = choose_victims(wanted, priority, [view], {"n": jobs}, no_items)
    if choice is None:
        return
    assert choice.node_id == "n"
    for v in choice.victims:
        assert v.preemptible
        assert not v.preempting
        assert v.priority < priority
    ids = {v.job_id for v in choice.victims}
    freed = without(view, choice.victims, [a for a in jobs if a.job_id not in ids], no_items)
    assert isinstance(match(wanted, [freed]), Placement)


@settings(max_examples=100, deadline=None)
@given(rounds=st.lists(st.tuples(st.integers(1, 4), st.integers(0, 3)), min_size=1, max_size=12))
def test_no_device_is_held_twice_across_preemptions_and_requeues(
    rounds: list[tuple[int, int]],
) -> None:
    """Each round a job of rising priority wants ``need`` devices of a 4-GPU node: it is placed
    on free devices, or its victims are stopped (their devices freed, they are requeued and
    placed again when devices are free). Devices held by active jobs never overlap."""
    view = NodeView(node_id="n", capabilities=gpu_node("n", 4))
    jobs: dict[str, Active] = {}
    waiting: list[tuple[str, int, int]] = []

    def held() -> frozenset[int]:
        devices = [d for a in jobs.values() for d in a.devices]
        assert len(devices) == len(set(devices)), jobs
        return frozenset(devices)

    def place(job_id: str, need: int, prio: int) -> bool:
        current = msgspec.structs.replace(view, exclusive=held())
        decision = match(job(job_id, gpus=need), [current])
        if not isinstance(decision, Placement):
            return False
        jobs[job_id] = active(job_id, "n", tuple(decision.devices), priority=prio, preemptible=True)
        held()
        return True

    for i, (need, extra) in enumerate(rounds):
        prio = i + extra
        if place(f"j{i}", need, prio):
            continue
        current = msgspec.structs.replace(view, exclusive=held())
        choice = choose_victims(
            job("x", gpus=need), prio, [current], {"n": list(jobs.values())}, no_items
        )
        if choice is None:
            continue
        for v in choice.victims:  # stopped, then requeued
            del jobs[v.job_id]
            waiting.append((v.job_id, v.gpus, v.priority))
        assert place(f"j{i}", need, prio)
        for w in list(waiting):
            if place(*w):
                waiting.remove(w)


def test_fair_share_orders_owners_by_recent_usage_then_alternates() -> None:
    policy = Policy()
    policy.shares = {"alice": 100.0}
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    rows = [
        {"job_id": f"a{i}", "owner": "alice", "priority": 0, "submitted_at": t0} for i in range(3)
    ] + [
        {
            "job_id": f"b{i}",
            "owner": "bob",
            "priority": 0,
            "submitted_at": t0 + timedelta(seconds=1),
        }
        for i in range(2)
    ]
    high = {"job_id": "h", "owner": "alice", "priority": 5, "submitted_at": t0}
    order = [r["job_id"] for r in policy.order([high, *rows])]
    # Priority first; then bob (less usage), though alice's jobs are older.
    assert order == ["h", "b0", "b1", "a0", "a1", "a2"]
    # Equal usage: the owner holding fewer GPUs now goes first, read again after each pick.
    even = Policy()
    picked = []
    for r in even.order(rows):
        picked.append(r["job_id"])
        even.add(active(r["job_id"], "n", (len(picked),), owner=r["owner"], started=1e12))
    assert picked == ["a0", "b0", "a1", "b1", "a2"]


def test_a_reload_counts_the_gpu_seconds_of_jobs_that_ended_elsewhere() -> None:
    """Another replica applied the end of a job (its NOTIFY makes this one reload the node's
    active jobs): the job's GPU time moves from running to ended in this replica's fair share
    at once, as PostgreSQL's trigger adds it there, instead of vanishing until the next read
    of the shares. A job still active keeps counting as running, not twice."""
    policy = Policy()
    started = time.time() - 100.0
    policy.add(active("gone", "n", (0, 1), owner="alice", started=started))
    policy.add(active("stays", "n", (2,), owner="alice", started=started))
    policy.add(active("elsewhere", "m", (0,), owner="bob", started=started))
    before = policy.usage("alice")
    assert 299.0 < before < 310.0  # three GPUs for 100 s
    # The reload of node n finds only "stays" active: "gone" ended on another replica.
    policy.replace([active("stays", "n", (2,), owner="alice", started=started)], ["n"])
    assert "gone" not in policy.active
    assert policy.gpus_held("alice") == 1
    after = policy.usage("alice")
    assert before <= after < before + 10.0
    assert policy.shares["alice"] >= 199.0  # the ended job's two GPUs for 100 s
    # Bob's node was not reloaded: nothing of his changed.
    assert "elsewhere" in policy.active
    assert "bob" not in policy.shares


def test_backfill_only_for_jobs_that_end_before_the_reservation() -> None:
    policy = Policy()
    view = NodeView(node_id="n", capabilities=gpu_node("n", 2), exclusive=frozenset({0, 1}))
    now = time.time()
    policy.add(active("r0", "n", (0,), started=now - 10, ends_at=now + 100))
    policy.add(active("r1", "n", (1,), started=now - 10, ends_at=now + 50))
    policy.reserve("big", job("big", gpus=2), [view], no_items, priority=0)
    r = policy.reservation
    assert r is not None
    assert (r.node_id, r.until) == ("n", now + 100)
    assert not policy.may_backfill("s", job("s", timeout_s=1e6), "n", 1)
    assert policy.may_backfill("s", job("s", timeout_s=10.0), "n", 1)  # ends well before
    assert not policy.may_backfill("s", job("s"), "n", 1)  # no timeout: never ends
    assert policy.may_backfill("s", job("s"), "n", 0)  # holds no device
    assert policy.may_backfill("s", job("s"), "n", 1, priority=1)  # ahead of the reserved job
    assert policy.may_backfill("big", job("big", gpus=2), "n", 2)


def test_a_job_that_leaves_the_reserved_job_room_backfills_without_a_timeout() -> None:
    """Backfill as Slurm's: a job with no timeout may still go on the node kept for a waiting
    job when that job would start as early anyway (a MIG instance beside a job waiting for a
    whole GPU was refused for a minute: tests/e2e/test_health.py, issue 26)."""
    from gpulayer_placement.fleet import Fleet
    from gpulayer_placement.queue_gate import Gate

    fleet = Fleet()
    fleet.upsert(gpu_node("n", 4))
    policy = Policy()
    gate = Gate(fleet=fleet, policy=policy, publisher=None)  # type: ignore[arg-type]
    now = time.time()
    for job_id, device, ends in (("r0", 0, now + 100), ("r1", 1, math.inf)):
        fleet.hold("n", [device], "exclusive")
        policy.add(active(job_id, "n", (device,), started=now, ends_at=ends))
    policy.reserve("big", job("big", gpus=2), fleet.views(), no_items)
    assert policy.reservation is not None
    assert policy.reservation.until == now + 100  # devices 0, 2 and 3 free once r0 ends

    def place(job_id: str) -> Placement | str:
        j = job(job_id)
        decision = match(j, fleet.views())
        assert isinstance(decision, Placement)
        admitted = gate.admit(job_id, j, decision, "anonymous")
        if not isinstance(admitted, Placement):
            return admitted.summary
        fleet.hold("n", admitted.devices, "exclusive")
        policy.add(active(job_id, "n", tuple(admitted.devices), started=now))
        return admitted

    first = place("s1")  # one of 2, 3: two of 0, 2, 3 stay for big once r0 ends
    assert isinstance(first, Placement)
    assert first.devices[0] in (2, 3)
    second = place("s2")  # the last free device: big would wait for a job that never ends
    assert isinstance(second, str)
    assert "big" in second


def test_heads_keep_no_job_below_the_priority_of_one_left_behind() -> None:
    """Each owner's first jobs (2 each here): alice's two at 5 may have more at 5 behind them,
    so bob's job at 0 can't be matched before those; carol's at 5 can (equals: fair share)."""
    rows = [
        {"job_id": "a1", "owner": "alice", "priority": 5},
        {"job_id": "c1", "owner": "carol", "priority": 5},
        {"job_id": "a2", "owner": "alice", "priority": 5},
        {"job_id": "b1", "owner": "bob", "priority": 0},
    ]
    assert [r["job_id"] for r in heads_cut(rows, per_owner=2)] == ["a1", "c1", "a2"]
    # Every owner's whole queue taken: nothing is behind, every row stays.
    assert [r["job_id"] for r in heads_cut(rows, per_owner=3)] == ["a1", "c1", "a2", "b1"]
    # Behind bob's two jobs (9, then 0) only jobs at 0 or below can wait: dave's at 0 stays.
    bob = [
        {"job_id": "b1", "owner": "bob", "priority": 9},
        {"job_id": "b2", "owner": "bob", "priority": 0},
        {"job_id": "d1", "owner": "dave", "priority": 0},
    ]
    assert [r["job_id"] for r in heads_cut(bob, per_owner=2)] == ["b1", "b2", "d1"]
    assert [r["job_id"] for r in heads_cut([bob[0], bob[2]], per_owner=1)] == ["b1"]


def test_room_after_finds_the_fewest_ends_by_bisection_as_one_by_one_would() -> None:
    """Against the count taken one job at a time, on random nodes of 8 GPUs running jobs of 0
    to 2 GPUs each, for jobs of 1 to 8 GPUs."""
    import random

    from gpulayer_placement.preemption import room_after, without

    rng = random.Random(49)
    for case in range(200):
        view = NodeView(node_id="n", capabilities=gpu_node("n", 8))
        on_node: list[Active] = []
        free = list(range(8))
        for i in range(rng.randint(1, 12)):
            k = min(rng.choice([0, 1, 2]), len(free))
            devices = tuple(free.pop() for _ in range(k))
            on_node.append(active(f"j{i}", "n", devices, ends_at=rng.random()))
        held = frozenset(d for a in on_node for d in a.devices)
        view = msgspec.structs.replace(view, exclusive=held)
        order = sorted(on_node, key=lambda a: (a.ends_at, a.job_id))
        want = job("big", gpus=rng.randint(1, 8))

        expected = None
        for n in range(1, len(order) + 1):  # the count taken one job at a time
            gone = order[:n]
            ids = {a.job_id for a in gone}
            rest = [a for a in on_node if a.job_id not in ids]
            if isinstance(match(want, [without(view, gone, rest, no_items)]), Placement):
                expected = n
                break
        assert room_after(want, view, order, on_node, no_items) == expected, case


def test_a_costly_reservation_is_computed_again_only_after_ten_times_its_cost() -> None:
    policy = Policy()
    policy.reserve("big", job("big"), [], no_items)
    assert not policy.new_pass()  # within RESERVATION_EVERY_S
    policy._reserved_at -= 2.0
    assert policy.new_pass()
    policy._reserve_s = 5.0  # the last one took 5 s: the next after 50 s
    policy._reserved_at = time.monotonic() - 30.0
    assert not policy.new_pass()
    policy._reserved_at -= 21.0
    assert policy.new_pass()
