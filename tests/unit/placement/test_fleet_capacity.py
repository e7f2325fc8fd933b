"""Cores, RAM, job slots and shared GPU memory in the fleet and the matcher, for any sequence of
placements and releases: no node ever holds more than it offers, a job the plain arithmetic
says fits somewhere is placed, and a waiting job's reason names the resource."""

from __future__ import annotations

import math
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.unit.placement.placement_fakes import gpu_node

from gpulayer_contracts.jobs import GpuUsage, JobRequest, Requirements
from gpulayer_matching import NoPlacement, Placement, explain, match
from gpulayer_matching.resources import reservations
from gpulayer_placement.fleet import Fleet, Offer

GB = 10**9
MIB = 1 << 20
DEVICE_MIB = 81559  # an H100 80GB as nvidia-smi reports it


def cpu_job(job_id: str, cores: float, memory_gb: float) -> JobRequest:
    return JobRequest(
        job_id=job_id,
        command=["true"],
        requirements=Requirements(cpu_cores=cores, memory_gb=memory_gb),
    )


def shared_job(job_id: str, gpu_gb: float) -> JobRequest:
    return JobRequest(
        job_id=job_id,
        command=["true"],
        requirements=Requirements(gpu_count=1, gpu_memory_gb=gpu_gb, cpu_cores=0.5),
        gpu=GpuUsage(use="shared"),
    )


def exclusive_job(job_id: str) -> JobRequest:
    return JobRequest(
        job_id=job_id,
        command=["true"],
        requirements=Requirements(gpu_count=1, cpu_cores=0.25, memory_gb=0.5),
    )


NODES = {"a": (4, 16 * GB, 3), "b": (8, 8 * GB, 6)}  # cores, RAM, slots; 2 H100s each


def build() -> Fleet:
    fleet = Fleet()
    for node, (cores, memory, slots) in NODES.items():
        fleet.upsert(gpu_node(node, 2, cores=cores, memory_bytes=memory))
        fleet.set_offer(node, Offer(slots=slots))
    return fleet


_job = st.one_of(
    st.tuples(
        st.just("cpu"),
        st.sampled_from([0.001, 0.5, 1.0, 2.0, 3.5, 8.0, 9.0]),
        st.sampled_from([0.25, 1.0, 4.0, 8.0, 17.0]),
    ),
    st.tuples(st.just("shared"), st.sampled_from([10.0, 30.0, 45.0, 80.0, 85.6]), st.just(0.0)),
    st.tuples(st.just("exclusive"), st.just(0.0), st.just(0.0)),
)
_ops = st.lists(st.one_of(_job, st.tuples(st.just("end"), st.integers(0, 50))), max_size=60)


def _fits_plainly(job: JobRequest, fleet: Fleet, held: dict[str, tuple[str, JobRequest]]) -> bool:
    """The oracle, for cpu jobs: some node with a free slot, the cores and the RAM."""
    need_cores = math.ceil(job.requirements.cpu_cores * 1000) / 1000
    need_memory = math.ceil(job.requirements.memory_gb * GB)
    for node, (cores, memory, slots) in NODES.items():
        mine = [j for n, j in held.values() if n == node]
        used_cores = sum(math.ceil(j.requirements.cpu_cores * 1000) / 1000 for j in mine)
        used_memory = sum(math.ceil(j.requirements.memory_gb * GB) for j in mine)
        if (
            len(mine) < slots
            and used_cores + need_cores <= cores + 1e-9
            and used_memory + need_memory <= memory
        ):
            return True
    return False


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_ops)
def test_no_sequence_of_places_and_releases_exceeds_any_capacity(
    ops: list[tuple[Any, ...]],
) -> None:
    fleet = build()
    held: dict[str, tuple[str, JobRequest]] = {}
    devices_of: dict[str, tuple[list[int], str]] = {}
    for i, op in enumerate(ops):
        kind = op[0]
        if kind == "end":
            if held:
                job_id = sorted(held)[int(op[1]) % len(held)]
                node, _ = held.pop(job_id)
                devices, mode = devices_of.pop(job_id)
                fleet.release(node, devices, mode)
                assert fleet.unreserve(job_id) == node
            continue
        job_id = f"j{i}"
        if kind == "cpu":
            job = cpu_job(job_id, float(op[1]), float(op[2]))
        elif kind == "shared":
            job = shared_job(job_id, float(op[1]))
        else:
            job = exclusive_job(job_id)
        plain = _fits_plainly(job, fleet, held) if kind == "cpu" else None
        decision = match(job, fleet.rotated())
        if plain is not None:
            assert isinstance(decision, Placement) == plain, (decision, held)
        if isinstance(decision, Placement):
            mode = "shared" if decision.use == "shared" else "exclusive"
            fleet.hold(decision.node_id, decision.devices, mode)
            fleet.reserve(
                job_id, decision.node_id, reservations(job, decision.devices, decision.use)
            )
            held[job_id] = (decision.node_id, job)
            devices_of[job_id] = (decision.devices, mode)
        else:
            assert isinstance(decision, NoPlacement)
        _check_invariants(fleet, held, devices_of)


def _check_invariants(
    fleet: Fleet,
    held: dict[str, tuple[str, JobRequest]],
    devices_of: dict[str, tuple[list[int], str]],
) -> None:
    for node, (cores, memory, slots) in NODES.items():
        mine = [(j, job) for j, (n, job) in held.items() if n == node]
        assert len(mine) <= slots
        assert sum(math.ceil(job.requirements.cpu_cores * 1000) for _, job in mine) <= cores * 1000
        assert sum(math.ceil(job.requirements.memory_gb * GB) for _, job in mine) <= memory
        for device in (0, 1):
            users = [(j, job) for j, job in mine if device in devices_of[j][0]]
            modes = {devices_of[j][1] for j, _ in users}
            assert not ("exclusive" in modes and len(users) > 1)
            reserved = sum(
                math.ceil(job.requirements.gpu_memory_gb * GB / MIB)
                for j, job in users
                if devices_of[j][1] == "shared" and job.requirements.gpu_memory_gb is not None
            )
            assert reserved <= DEVICE_MIB
        view = fleet.get(node)
        assert view is not None
        assert view.slots_free == slots - len(mine)


def test_explanations_name_the_resource_that_is_short() -> None:
    fleet = build()
    assert fleet.set_offer("b", Offer(slots=0))
    big = cpu_job("big", 3.0, 1.0)
    placed = match(big, fleet.rotated())
    assert isinstance(placed, Placement)
    assert placed.node_id == "a"
    fleet.reserve("big", "a", reservations(big, [], "none"))
    why = explain(cpu_job("next", 2.0, 1.0), fleet.views())
    assert why.reasons == ["1 has no free job slot", "1 has 1/4 free cores (need 2)"]
    assert not why.unsatisfiable

    # What no node offers at all is a capability: the job can never run here.
    never = explain(cpu_job("huge", 9.0, 1.0), fleet.views())
    assert never.unsatisfiable
    assert never.reasons == ["2 have < 9 cores for jobs (best: b 8)"]
    ram = explain(cpu_job("ram", 1.0, 17.0), fleet.views())
    assert ram.unsatisfiable
    assert ram.reasons == ["2 have < 17 GB of RAM for jobs (best: a 16 GB)"]

    fleet.set_offer("b", Offer(slots=6))
    memory = explain(cpu_job("mem", 1.0, 15.5), fleet.views())
    # ("big" holds 1 GB of a's 16.)
    assert memory.reasons == [
        "1 has < 15.5 GB of RAM for jobs (best: b 8 GB)",
        "1 has 15/16 GB free RAM (need 15.5)",
    ]
    assert memory.can_run_now == 0
    assert not memory.unsatisfiable

    # Shared GPU memory: 60 GB held on each device (of 85.5 GB), then a 40 GB job waits.
    for node in ("a", "b"):
        for device in (0, 1):
            fleet.hold(node, [device], "shared")
            fleet.reserve(f"s-{node}{device}", node, [(f"gpu_memory:{device}", 57221)])
    waiting = explain(shared_job("s40", 40.0), fleet.views())
    assert waiting.reasons == ["2 have 25.5 GB free on their best shared GPU (need 40)"]
    fits = match(shared_job("s20", 20.0), fleet.rotated())
    assert isinstance(fits, Placement)


def test_a_replicas_uncommitted_placement_is_given_back() -> None:
    fleet = build()
    job = cpu_job("j", 4.0, 1.0)
    fleet.reserve("j", "a", reservations(job, [], "none"))
    view = fleet.get("a")
    assert view is not None
    assert (view.cpu_free, view.slots_free) == (0, 2)
    assert fleet.unreserve("j") == "a"
    assert fleet.unreserve("j") is None  # twice is harmless
    view = fleet.get("a")
    assert view is not None
    assert (view.cpu_free, view.memory_free, view.slots_free) == (4000, 16 * GB, 3)


def test_the_executors_reserve_comes_off_what_the_probe_reported() -> None:
    fleet = build()
    assert fleet.set_offer("a", Offer(slots=3, reserved_millicores=1000, reserved_bytes=2 * GB))
    assert not fleet.set_offer("a", Offer(slots=3, reserved_millicores=1000, reserved_bytes=2 * GB))
    view = fleet.get("a")
    assert view is not None
    assert (view.cpu_total, view.memory_total) == (3000, 14 * GB)
