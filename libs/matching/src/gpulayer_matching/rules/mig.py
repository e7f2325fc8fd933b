"""MIG: a MIG instance goes only to a job that asks for one device and says how much memory it
needs (``Plan.mig_ok``); other jobs get whole GPUs only."""

from __future__ import annotations

from gpulayer_contracts.jobs import Accelerator
from gpulayer_matching.facts import Device, Facts
from gpulayer_matching.plan import Plan
from gpulayer_matching.rules.base import DeviceRule, Outcome, Tally, seen_all
from gpulayer_matching.verdicts import Fail


def _words(plan: Plan, rule: str, t: Tally) -> tuple[str, str]:
    return "have", (
        f"only MIG instances{seen_all(t)}, which a job gets only with gpu_count = 1 "
        "and gpu_memory_gb set"
    )


ONLY_MIG = Outcome("mig", 210, "gpu_count", "gpu_count", _words)


def check(
    plan: Plan, facts: Facts, acc: Accelerator, devs: tuple[Device, ...], n: int
) -> tuple[Device, ...] | Fail:
    if plan.mig_ok or all(d.mig is None for d in devs):
        return devs
    whole = tuple(d for d in devs if d.mig is None)
    if len(whole) < n and len(devs) >= n:
        profiles = sorted({d.mig for d in devs if d.mig is not None})
        return Fail(ONLY_MIG.rank, ONLY_MIG.name, ", ".join(profiles))
    return whole


RULE = DeviceRule("mig", (ONLY_MIG,), check)
