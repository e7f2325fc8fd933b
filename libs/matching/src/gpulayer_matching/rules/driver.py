"""NVIDIA driver: ``driver`` (a PEP 440 specifier) on each of the job's devices."""

from __future__ import annotations

from gpulayer_contracts.jobs import Accelerator
from gpulayer_matching.facts import Device, Facts, satisfies, version_key
from gpulayer_matching.plan import Plan
from gpulayer_matching.rules.base import DeviceRule, Outcome, Tally, seen
from gpulayer_matching.verdicts import Fail


def _unknown_words(plan: Plan, rule: str, t: Tally) -> tuple[str, str]:
    return "have", "unknown NVIDIA driver version"


def _other_words(plan: Plan, rule: str, t: Tally) -> tuple[str, str]:
    return "have", f"NVIDIA driver not matching {plan.driver}{seen(t)}"


UNKNOWN = Outcome("driver_unknown", 550, "driver", "driver", _unknown_words)
OTHER = Outcome("driver", 551, "driver", "driver", _other_words)


def check(
    plan: Plan, facts: Facts, acc: Accelerator, devs: tuple[Device, ...], n: int
) -> tuple[Device, ...] | Fail:
    spec = plan.driver
    if spec is None:
        return devs
    verdicts = [None if d.driver is None else satisfies(spec, d.driver) for d in devs]
    passing = [d for d, ok in zip(devs, verdicts, strict=True) if ok]
    if len(passing) < n:
        if len(passing) + verdicts.count(None) >= n:
            return Fail(UNKNOWN.rank, UNKNOWN.name)
        short = [
            d.driver
            for d, ok in zip(devs, verdicts, strict=True)
            if ok is False and d.driver is not None
        ]
        return Fail(OTHER.rank, OTHER.name, max(short, key=version_key))
    return tuple(passing)


RULE = DeviceRule("driver", (UNKNOWN, OTHER), check)
