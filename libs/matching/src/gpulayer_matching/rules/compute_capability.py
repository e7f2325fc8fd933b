"""Compute capability: ``min_cuda_compute_capability`` on each of the job's devices."""

from __future__ import annotations

from gpulayer_contracts.jobs import Accelerator
from gpulayer_matching.facts import Device, Facts
from gpulayer_matching.plan import Plan
from gpulayer_matching.rules.base import DeviceRule, Outcome, Tally, nth_miss
from gpulayer_matching.verdicts import Fail


def _unknown_words(plan: Plan, rule: str, t: Tally) -> tuple[str, str]:
    return "have", "unknown compute capability"


def _short_words(plan: Plan, rule: str, t: Tally) -> tuple[str, str]:
    assert plan.cc is not None
    assert isinstance(t.best, tuple)
    want = f"{plan.cc[0]}.{plan.cc[1]}"
    got = f"{t.best[0]}.{t.best[1]}"
    return "have", f"compute capability < {want} (best: {t.best_node} {got})"


FIELD = "min_cuda_compute_capability"
UNKNOWN = Outcome("cc_unknown", 500, FIELD, "compute capability", _unknown_words)
SHORT = Outcome("cc", 501, FIELD, "compute capability", _short_words)


def check(
    plan: Plan, facts: Facts, acc: Accelerator, devs: tuple[Device, ...], n: int
) -> tuple[Device, ...] | Fail:
    need = plan.cc
    if need is None:
        return devs
    passing = [d for d in devs if d.cc is not None and d.cc >= need]
    if len(passing) < n:
        miss = nth_miss([d.cc for d in devs], len(passing), n)
        if miss is None:
            return Fail(UNKNOWN.rank, UNKNOWN.name)
        return Fail(SHORT.rank, SHORT.name, miss)
    return tuple(passing)


RULE = DeviceRule("compute_capability", (UNKNOWN, SHORT), check)
