"""Accelerator: the node has devices of an accelerator the job may use, and they can run work."""

from __future__ import annotations

from gpulayer_contracts.jobs import Accelerator
from gpulayer_matching.facts import Device, Facts
from gpulayer_matching.plan import Plan
from gpulayer_matching.rules.base import DeviceRule, Outcome, Tally, label
from gpulayer_matching.verdicts import Fail


def _none_words(plan: Plan, rule: str, t: Tally) -> tuple[str, str]:
    if not plan.candidates:
        return "have", "no GPU device this job may use"
    if len(plan.candidates) == 1:
        return "have", f"no {plan.candidates[0]} device"
    return "have", f"no GPU device ({' or '.join(plan.candidates)})"


def _unusable_words(plan: Plan, rule: str, t: Tally) -> tuple[str, str]:
    return "have", f"{label(plan)} devices that can't run work (execution not supported)"


NO_DEVICE = Outcome("no_device", 100, "accelerator", "device", _none_words)
NOT_USABLE = Outcome("not_usable", 101, "accelerator", "devices", _unusable_words)


def check(
    plan: Plan, facts: Facts, acc: Accelerator, devs: tuple[Device, ...], n: int
) -> tuple[Device, ...] | Fail:
    if not devs:
        if acc in facts.unusable:
            return Fail(NOT_USABLE.rank, NOT_USABLE.name)
        return Fail(NO_DEVICE.rank, NO_DEVICE.name)
    return devs


RULE = DeviceRule("accelerator", (NO_DEVICE, NOT_USABLE), check)
