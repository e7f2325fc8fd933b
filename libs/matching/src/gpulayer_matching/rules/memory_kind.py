"""GPU memory kind: ``gpu_memory_kind`` (dedicated or unified) on each of the job's devices."""

from __future__ import annotations

from gpulayer_contracts.jobs import Accelerator
from gpulayer_matching.facts import Device, Facts
from gpulayer_matching.plan import Plan
from gpulayer_matching.rules.base import DeviceRule, Outcome, Tally, label
from gpulayer_matching.verdicts import Fail


def _unknown_words(plan: Plan, rule: str, t: Tally) -> tuple[str, str]:
    return "have", "unknown GPU memory kind"


def _other_words(plan: Plan, rule: str, t: Tally) -> tuple[str, str]:
    n = plan.n
    return "have", f"no {plan.kind}-memory {label(plan)} device" + (
        f" for {n} devices" if n > 1 else ""
    )


UNKNOWN = Outcome("memory_kind_unknown", 300, "gpu_memory_kind", "memory kind", _unknown_words)
OTHER = Outcome("memory_kind", 301, "gpu_memory_kind", "-memory", _other_words)


def check(
    plan: Plan, facts: Facts, acc: Accelerator, devs: tuple[Device, ...], n: int
) -> tuple[Device, ...] | Fail:
    kind = plan.kind
    if kind is None:
        return devs
    passing = [d for d in devs if d.kind == kind]
    if len(passing) < n:
        unknown = sum(1 for d in devs if d.kind is None)
        if len(passing) + unknown >= n:
            return Fail(UNKNOWN.rank, UNKNOWN.name)
        return Fail(OTHER.rank, OTHER.name)
    return tuple(passing)


RULE = DeviceRule("memory_kind", (UNKNOWN, OTHER), check)
