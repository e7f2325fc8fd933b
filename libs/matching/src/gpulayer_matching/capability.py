"""Step 1 of matching: does the node, idle and online, offer what the job needs?

What a node offers is fixed until it re-detects, so the verdict is cached per capabilities
object (in its ``Facts``) and job shape (``Plan.key``). A node that fails says which rule failed
first, and its value for the nearest miss.
"""

from __future__ import annotations

from gpulayer_contracts.capabilities import WorkerCapabilities
from gpulayer_contracts.jobs import Accelerator
from gpulayer_matching.facts import Facts, facts_of
from gpulayer_matching.plan import Plan
from gpulayer_matching.registry import AFTER_DEVICES, BEFORE_DEVICES, DEVICE_CHECKS
from gpulayer_matching.rules.accelerator import NO_DEVICE
from gpulayer_matching.verdicts import COUNT, CPU, POOL, Cap, Fail

__all__ = ["cached_capability", "capability", "device_chain", "evaluate"]

_RESULTS_MAX = 256


def device_chain(plan: Plan, facts: Facts, acc: Accelerator, n: int) -> tuple[int, ...] | Fail:
    """The device rules for ``n`` devices of ``acc``: the eligible indices, or the first failure.

    Each device stands on its own: a node of mixed models passes when ``n`` of its devices each
    satisfy every per-device rule. A failure's value is what the node could give all ``n``
    devices: the n-th best device. A device whose value is unknown ranks below those that pass
    and above those known to fall short, so a shortfall that an unknown might cover reads
    "unknown".
    """
    devs = facts.usable.get(acc, ())
    for check in DEVICE_CHECKS:
        passed = check(plan, facts, acc, devs, n)
        if isinstance(passed, Fail):
            return passed
        devs = passed
    return tuple(d.index for d in devs)


def capability(plan: Plan, facts: Facts) -> Cap:
    """``evaluate``, kept in the node's result cache."""
    cap = evaluate(plan, facts)
    if len(facts.results) >= _RESULTS_MAX:
        facts.results.clear()
    facts.results[plan.key] = cap
    return cap


def cached_capability(plan: Plan, caps: WorkerCapabilities) -> Cap:
    facts = facts_of(caps)
    cap = facts.results.get(plan.key)
    return cap if cap is not None else capability(plan, facts)


def evaluate(plan: Plan, facts: Facts) -> Cap:
    gpu = plan.gpu_for(facts.family)
    use = gpu.use
    for node_check in BEFORE_DEVICES:
        failed = node_check(plan, facts, gpu, False)
        if failed is not None:
            return Cap.failed(use, failed)
    n = plan.n
    mode = COUNT if n >= 1 else (POOL if use != "none" else CPU)
    pools: list[tuple[Accelerator, tuple[int, ...], frozenset[int]]] = []
    # A cpu-mode job only looks at devices to check per-device rules; it holds none.
    need_devices = mode == COUNT or plan.device_rules or (mode == POOL and use == "exclusive")
    if need_devices or mode == POOL:
        worst = Fail(NO_DEVICE.rank, NO_DEVICE.name)
        for acc in plan.candidates:
            eligible = device_chain(plan, facts, acc, max(n, 1))
            if not isinstance(eligible, Fail):
                pools.append((acc, eligible, frozenset(eligible)))
                if mode != COUNT:
                    break  # the pool is the first accelerator that has one
            elif eligible.rank > worst.rank or (
                eligible.rank == worst.rank and worst.value is None
            ):
                worst = eligible
        if need_devices and not pools:
            return Cap.failed(use, worst)
    # Placed as cpu work (no devices held), which the support matrix may forbid.
    as_cpu = mode == CPU or not pools
    for node_check in AFTER_DEVICES:
        failed = node_check(plan, facts, gpu, as_cpu)
        if failed is not None:
            return Cap.failed(use, failed)
    return Cap(ok=True, use=use, mode=mode, pools=tuple(pools), mib=facts.mib)
