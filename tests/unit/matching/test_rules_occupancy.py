"""The rules the placement step applies, called directly: health (sick devices' reasons),
devices in use (which outcome by mode and use), shared GPU memory (``roomy``)."""

from __future__ import annotations

from collections.abc import Sequence

from tests.unit.matching.rule_cases import SHARED, job, node

from gpulayer_matching.plan import compile_plan
from gpulayer_matching.rules import busy_devices, health, shared_gpu_memory
from gpulayer_matching.verdicts import COUNT, POOL, Cap, Miss


def kept(result: Sequence[int] | Miss) -> list[int]:
    assert not isinstance(result, Miss), result
    return list(result)


def test_sick_reasons_in_index_order_at_most_eight() -> None:
    view = node(view={"sick": frozenset(range(10)), "health": {3: "XID 79", 0: "hot"}})
    reasons = health.sick_reasons(view)
    assert reasons[:2] == ["n1 GPU 0: hot", "n1 GPU 1: unhealthy"]
    assert reasons[3] == "n1 GPU 3: XID 79"
    assert len(reasons) == 8


def test_busy_rule_by_mode_and_use() -> None:
    rule = busy_devices.busy_rule
    assert rule(Cap(ok=True, mode=COUNT, use="exclusive")) == "busy_exclusive"
    assert rule(Cap(ok=True, mode=COUNT, use="shared")) == "busy_shared"
    assert rule(Cap(ok=True, mode=POOL, use="exclusive")) == "busy_pool"
    assert rule(Cap(ok=True, mode=POOL, use="shared")) == "busy_pool_shared"


def test_roomy_keeps_devices_with_room_beside_other_shared_jobs() -> None:
    plan = compile_plan(job(gpu_count=1, gpu_memory_gb=30, gpu_section=SHARED))
    cap = Cap(ok=True, mode=COUNT, use="shared", mib={0: 81_559, 1: 81_559})
    view = node(view={"gpu_reserved": {0: 60_000}})
    assert kept(shared_gpu_memory.roomy(plan, cap, view, [0, 1], 1)) == [1]
    miss = shared_gpu_memory.roomy(plan, cap, view, [0, 1], 2)
    assert isinstance(miss, Miss)
    # The nearest miss: the n-th roomiest device's free MiB.
    assert (miss.rule, miss.value) == ("busy_gpu_memory", 81_559 - 60_000)
    # No reservations, or no memory figure: every free device has room.
    assert kept(shared_gpu_memory.roomy(plan, cap, node(), [0, 1], 2)) == [0, 1]
    plain = compile_plan(job(gpu_count=1, gpu_section=SHARED))
    assert kept(shared_gpu_memory.roomy(plain, cap, view, [0, 1], 2)) == [0, 1]
