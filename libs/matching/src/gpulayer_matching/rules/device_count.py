"""Device count: the node has at least ``gpu_count`` usable devices of the accelerator."""

from __future__ import annotations

from gpulayer_contracts.jobs import Accelerator
from gpulayer_matching.facts import Device, Facts
from gpulayer_matching.plan import Plan
from gpulayer_matching.rules.base import DeviceRule, Outcome, Tally, label
from gpulayer_matching.verdicts import Fail


def _words(plan: Plan, rule: str, t: Tally) -> tuple[str, str]:
    return "have", f"< {plan.n} usable {label(plan)} devices (best: {t.best_node} {t.best})"


TOO_FEW = Outcome("count", 200, "gpu_count", "usable", _words)


def check(
    plan: Plan, facts: Facts, acc: Accelerator, devs: tuple[Device, ...], n: int
) -> tuple[Device, ...] | Fail:
    if len(devs) < n:
        return Fail(TOO_FEW.rank, TOO_FEW.name, len(devs))
    return devs


RULE = DeviceRule("device_count", (TOO_FEW,), check)
