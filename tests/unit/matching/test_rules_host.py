"""The host rules, called directly: cores and RAM (in all, then free), job slots, liveness; and
``host_miss``, which counts a node under the lowest-ranked of them."""

from __future__ import annotations

from typing import Any

from tests.unit.matching.rule_cases import GB, job, node

from gpulayer_matching.place import host_miss
from gpulayer_matching.plan import compile_plan
from gpulayer_matching.rules import cores, liveness, ram, slots
from gpulayer_matching.verdicts import Fail


def failed(result: object) -> tuple[int, str, object]:
    assert isinstance(result, Fail), result
    return result.rank, result.rule, result.value


def test_cores_in_all_before_free() -> None:
    plan = compile_plan(job(cpu_cores=2))
    assert cores.check(plan, node()) is None  # not reported: no limit
    assert failed(cores.check(plan, node(view={"cpu_total": 1500, "cpu_free": 0}))) == (
        30_100,
        "cores",
        1500,
    )
    assert failed(cores.check(plan, node(view={"cpu_total": 8000, "cpu_free": 1999}))) == (
        40_101,
        "busy_cores",
        (1999, 8000),
    )
    assert cores.check(plan, node(view={"cpu_total": 8000, "cpu_free": 2000})) is None


def test_ram_in_all_before_free() -> None:
    plan = compile_plan(job(memory_gb=2))
    assert failed(ram.check(plan, node(view={"memory_total": GB, "memory_free": 0}))) == (
        30_101,
        "host_memory",
        GB,
    )
    assert failed(ram.check(plan, node(view={"memory_total": 8 * GB, "memory_free": GB}))) == (
        40_102,
        "busy_memory",
        (GB, 8 * GB),
    )
    assert ram.check(plan, node(view={"memory_free": 2 * GB})) is None


def test_slots() -> None:
    plan = compile_plan(job())
    assert failed(slots.check(plan, node(view={"slots_total": 4, "slots_free": 0}))) == (
        40_100,
        "no_slot",
        4,
    )
    assert slots.check(plan, node(view={"slots_total": 4, "slots_free": 1})) is None


def test_liveness() -> None:
    plan = compile_plan(job())
    assert failed(liveness.check(plan, node(view={"online": False})))[1] == "offline"
    assert failed(liveness.check(plan, node(view={"executor_down": True})))[1] == "executor_down"
    assert liveness.check(plan, node()) is None


def _miss(view: dict[str, Any]) -> str | None:
    miss = host_miss(compile_plan(job(cpu_cores=2, memory_gb=2)), node(view=view))
    return None if miss is None else miss.rule


def test_a_node_is_counted_under_its_lowest_ranked_host_rule() -> None:
    # Never here (RAM in all) outranks busy now (cores free), whichever rule runs first.
    assert _miss({"cpu_total": 8000, "cpu_free": 0, "memory_total": GB}) == "host_memory"
    # Offline outranks every occupancy rule, and is outranked by a capability.
    assert _miss({"online": False, "cpu_total": 8000, "cpu_free": 0, "slots_free": 0}) == "offline"
    assert _miss({"online": False, "cpu_total": 1000}) == "cores"
    assert _miss({"slots_free": 0, "cpu_total": 8000, "cpu_free": 0}) == "no_slot"
    assert _miss({"cpu_total": 8000, "cpu_free": 8000}) is None
